"""Peak host memory of loading a checkpoint straight onto a mesh across two processes, against
today's whole-model load (issue: direct-to-mesh loading).

    python scripts/mesh_load_memory.py --out results/formats [--preset llama3.2-1b] [--work DIR]

Writes a random bfloat16 checkpoint of the preset in native and HF format (streamed, one tensor
at a time), then for each format runs, each in fresh processes: a plain `jax_llama.load` (one
process, the whole model on the host), and `jax_llama.load(path, mesh=fsdp=8)` in two processes
of four simulated CPU devices joined by jax.distributed. Each process reports its peak RSS
(VmHWM) once loaded, then checks every part it holds against the checkpoint's tensor, bit
for bit. Results: OUT/mesh_load_memory.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llama_twins import results
from llama_twins.bench.common import cpu_model

GB = 1e9


def write_random_checkpoint(path: Path, preset: str) -> int:
    """A native bfloat16 checkpoint of random N(0, 0.02) weights (norms 1); returns its bytes."""
    import ml_dtypes
    import numpy as np

    from bridge.config import preset as get_preset
    from bridge.formats import write_native
    from bridge.tensors import canonical_shapes

    config = get_preset(preset)
    shapes = canonical_shapes(config)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)

    def fetch(name):
        if "norm" in name:
            return np.ones(shapes[name], bf16)
        return (0.02 * rng.standard_normal(shapes[name], np.float32)).astype(bf16)

    write_native(path, config, {n: (s, bf16) for n, s in shapes.items()}, fetch)
    return sum(int(np.prod(s)) * 2 for s in shapes.values())


def peak_rss() -> int:
    """This process's peak resident memory in bytes: VmHWM, the high-water mark of its own
    address space. (ru_maxrss is not used: Linux carries it across exec, so a worker started
    by a large parent would report the parent's peak.)"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(args) -> None:
    """One process: load, report peak RSS, then verify what it holds."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import numpy as np

    if args.port:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{args.port}", 2, args.process_id,
                                   initialization_timeout=120)
    import jax_llama
    from bridge.formats import open_checkpoint
    from bridge.tensors import canonical_shapes
    from jax_llama.params import flax_path
    from jax_llama.sharding import make_mesh

    start = time.perf_counter()
    mesh = make_mesh("fsdp=8") if args.port else None
    _, params = jax_llama.load(args.path, mesh=mesh)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    peak = peak_rss()
    held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards
               if s.replica_id == 0)
    ckpt = open_checkpoint(args.path)
    equal = True
    for name in canonical_shapes(ckpt.config):
        path, _, transposed = flax_path(name, False)
        leaf = params
        for key in path:
            leaf = leaf[key]
        whole = ckpt.tensor(name)
        whole = whole.T if transposed else whole
        for shard in leaf.addressable_shards:
            equal &= bool(np.array_equal(np.asarray(shard.data), whole[shard.index]))
        del whole
    print(json.dumps({"peak_rss": peak, "held_bytes": held, "seconds": seconds,
                      "equal": equal}), flush=True)


def run_workers(path: Path, two: bool) -> list[dict]:
    me = [sys.executable, __file__, "--worker", "--path", str(path)]
    if not two:
        cmds = [me + ["--devices", "4"]]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmds = [me + ["--devices", "4", "--port", str(port), "--process-id", str(i)] for i in (0, 1)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    try:
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            sys.exit(f"worker failed ({p.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/formats")
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--work", help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from tqdm import tqdm

    from bridge.convert import convert

    work = Path(args.work or tempfile.mkdtemp(prefix="mesh-load-"))
    print(f"writing a random bfloat16 {args.preset} checkpoint in {work}", file=sys.stderr)
    nbytes = write_random_checkpoint(work / "native", args.preset)
    convert(work / "native", work / "hf", to="hf", progress=False)
    rows = []
    for fmt in tqdm(("native", "hf"), desc="formats", file=sys.stderr):
        whole = run_workers(work / fmt, two=False)[0]
        parts = run_workers(work / fmt, two=True)
        rows.append({"format": fmt, "whole": whole, "mesh": parts})
    target = 0.6 * nbytes + 600e6
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"preset": args.preset, "model_bytes": nbytes, "target_bytes": target,
              "cpu": cpu_model(), "cores": os.cpu_count(), "rows": rows,
              "date": time.strftime("%Y-%m-%d")}
    lines = [
        "# Loading straight onto a mesh: peak host memory per process", "",
        f"`python scripts/mesh_load_memory.py --out {args.out}`: a random bfloat16 {args.preset} "
        f"checkpoint ({nbytes / GB:.2f} GB); {report['cpu']}, {report['cores']} cores; "
        f"{report['date']}. Peak RSS (VmHWM) of each process once loaded, JAX and the "
        f"interpreter included; then every part a process holds is checked against the "
        f"checkpoint's tensor, bit for bit. Target: at most 0.6 x the model's bytes + 600 MB "
        f"= {target / GB:.2f} GB per process.", "",
        "| format | load | process | peak RSS | held on its devices | seconds | bit for bit | target |",
        "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        w = row["whole"]
        lines.append(f"| {row['format']} | `jax_llama.load(path)` (today: the whole model) | 1 of 1 "
                     f"| {w['peak_rss'] / GB:.2f} GB | {w['held_bytes'] / GB:.2f} GB | "
                     f"{w['seconds']:.1f} | {'yes' if w['equal'] else 'NO'} | - |")
        for i, m in enumerate(row["mesh"]):
            ok = "met" if m["peak_rss"] <= target else "MISSED"
            lines.append(f"| {row['format']} | `jax_llama.load(path, mesh=fsdp=8)` | {i + 1} of 2 "
                         f"| {m['peak_rss'] / GB:.2f} GB ({m['peak_rss'] / w['peak_rss']:.2f}x) | "
                         f"{m['held_bytes'] / GB:.2f} GB | {m['seconds']:.1f} | "
                         f"{'yes' if m['equal'] else 'NO'} | {ok} |")
    print(results.write("mesh_load_memory", report, lines, out), end="")


if __name__ == "__main__":
    main()
