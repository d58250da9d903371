"""Conversion throughput and peak memory, side by side with `cp -r` of the same files.

For each model: write a synthetic Hugging Face checkpoint (random bfloat16 weights), then, in
alternation and several times, time `cp -r` of it, `llama-bridge convert` HF -> native, and
native -> HF, each followed by `sync` so that both sides pay for getting the bytes to disk. Peak
resident memory is the command's own (getrusage of the child, as `/usr/bin/time -v` reports it:
mapped file pages count too; see _STARTER). Reports medians as a markdown table and JSON.

    python -m llama_twins.bench.convert --presets llama3.2-1b llama3.2-3b --repeats 3 [--out DIR]

Targets (issue: weight bridge): peak RSS below 1.5 x the largest tensor + 300 MB at every model
size; throughput at least half of cp's.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from bridge.config import LlamaConfig, preset
from bridge.formats import write_checkpoint
from bridge.tensors import canonical_shapes

from .common import WorkerFailed, say, write_results

MB = 10**6
BRIDGE = [sys.executable, "-m", "llama_twins.cli.bridge_main"]  # `llama-bridge`, whatever PATH holds


def synthetic_hf(config: LlamaConfig, directory: Path, seed: int = 0) -> None:
    """A random bfloat16 HF checkpoint of `config`, written one tensor at a time."""
    shapes = canonical_shapes(config)
    rng = np.random.default_rng(seed)
    specs = {name: (shape, np.dtype(ml_dtypes.bfloat16)) for name, shape in shapes.items()}

    def fetch(name):
        return (rng.standard_normal(shapes[name], dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    write_checkpoint("hf", directory, config, specs, fetch)


# Each command is started by a small Python process (no site packages) that reports the command's
# peak RSS: Linux carries the starting process's own peak across fork and exec into the child's
# figure, so the starter must be small (a ~10 MB floor, which only cp's figure shows), never this
# process with its arrays and imports.
_STARTER = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:], "
            "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
            "sys.exit(code)")


def timed(command: list[str]) -> tuple[float, int]:
    """(wall seconds including a final sync, peak RSS bytes of the command)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-S", "-c", _STARTER, *command], capture_output=True,
                          text=True)
    subprocess.run(["sync"], check=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise WorkerFailed(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return wall, int(done.stdout) * (1 if sys.platform == "darwin" else 1024)  # bytes vs KiB


def bench_model(name: str, config: LlamaConfig, workdir: Path, repeats: int) -> dict:
    """Medians of `repeats` alternating runs of cp -r and both conversions of a random bfloat16
    HF checkpoint of `config`, written under workdir / name (kept there if it exists)."""
    largest = max(math.prod(s) for s in canonical_shapes(config).values()) * 2  # bfloat16
    root = workdir / name
    hf = root / "hf"
    if not hf.exists():
        say(f"[{name}] writing a synthetic bfloat16 checkpoint to {hf}")
        synthetic_hf(config, hf)
        subprocess.run(["sync"], check=True)  # not on the first timed command's bill
    nbytes = sum(f.stat().st_size for f in hf.iterdir())
    commands = {  # label -> (command, the directory it creates); run in this order each repeat
        "cp": (["cp", "-r", str(hf), str(root / "cp")], root / "cp"),
        "hf -> native": ([*BRIDGE, "convert", str(hf), str(root / "native"), "--quiet"],
                         root / "native"),
        "native -> hf": ([*BRIDGE, "convert", str(root / "native"), str(root / "hf2"), "--to", "hf",
                          "--quiet"], root / "hf2"),
    }
    runs = {label: [] for label in commands}
    for r in range(repeats):
        for label, (command, output) in commands.items():
            shutil.rmtree(output, ignore_errors=True)
            wall, rss = timed(command)
            runs[label].append((wall, rss))
            say(f"[{name}] run {r + 1}/{repeats} {label}: {wall:.2f} s, peak RSS {rss / MB:.0f} MB")
    for _, output in commands.values():
        shutil.rmtree(output, ignore_errors=True)
    bound = 1.5 * largest + 300 * MB
    cp_wall = statistics.median(w for w, _ in runs["cp"])
    result = {"model": name, "parameters": sum(math.prod(s) for s in canonical_shapes(config).values()),
              "bytes": nbytes, "largest_tensor_bytes": largest, "rss_bound_bytes": bound, "rows": {}}
    for label, samples in runs.items():
        wall = statistics.median(w for w, _ in samples)
        result["rows"][label] = {
            "median_s": wall, "throughput_MBps": nbytes / wall / MB,
            "vs_cp": cp_wall / wall, "peak_rss_bytes": max(r for _, r in samples),
            "runs_s": [w for w, _ in samples]}
    return result


def markdown(results: list[dict]) -> str:
    lines = ["| model | size | step | median s | MB/s | throughput vs cp | peak RSS | RSS bound "
             "(1.5 x largest tensor + 300 MB) |",
             "|---|---|---|---|---|---|---|---|"]
    for res in results:
        for label, row in res["rows"].items():
            ok = "" if label == "cp" else (" ok" if row["peak_rss_bytes"] < res["rss_bound_bytes"]
                                           else " OVER")
            lines.append(
                f"| {res['model']} | {res['bytes'] / 1e9:.2f} GB | {label} | {row['median_s']:.2f} | "
                f"{row['throughput_MBps']:.0f} | {row['vs_cp']:.2f}x | {row['peak_rss_bytes'] / MB:.0f} MB"
                f"{ok} | {res['rss_bound_bytes'] / MB:.0f} MB (largest {res['largest_tensor_bytes'] / MB:.0f} MB) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["llama3.2-1b", "llama3.2-3b"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/jax-llama-bench-convert")
    parser.add_argument("--out", default=".", help="directory for convert.{md,json} (default .)")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    results = [bench_model(p, preset(p, field="presets"), workdir, args.repeats)
               for p in args.presets]
    write_results("convert", [markdown(results)], {"models": results}, args.out)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
