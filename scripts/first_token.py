"""`jax-llama generate --chat` on SmolLM2 to its first token, in a fresh process as a user runs it,
and where that time still goes.

    python scripts/first_token.py [GGUF] [--rounds 5] [--incumbent DIR] [--out results/decode]

Each run is `jax-llama generate CKPT --chat --prompt "What is the capital of France?"
--max-new-tokens 16` in a new process, timed from its start to the first byte on stdout (the first
token) and to its exit. The cases, alternating round by round:

    warm               the compilation cache and the kept programs warm (a user's second run on)
    warm, no programs  JAX_LLAMA_PROGRAMS=0: jax's persistent cache alone, so every run traces
                       and lowers its programs before it can look them up
    float32, warm      --dtype float32 (the GGUF dequantised), caches warm
    cold               JAX_LLAMA_COMPILE_CACHE=off: everything traced and compiled
    incumbent          (--incumbent DIR: a checkout of the code to compare with, e.g. `git
                       worktree add /tmp/before <commit>`) the warm case on that code

Then one warm run with its stages timed in the process (imports; opening the file, its tokenizer
and its template; reading the weights; the prefill program; its first run). Writes
OUT/first_token.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from llama_twins import results
from llama_twins.bench.common import cpu_model, first_byte_and_exit, given_or_smollm2

PROMPT = "What is the capital of France?"
BASE_ENV = {k: v for k, v in os.environ.items()
            if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_LLAMA_COMPILE_CACHE",
                         "JAX_LLAMA_PROGRAMS")}

# Run in the generate process by `stages`: the command itself, with the steps it passes through
# wrapped to note the time (nothing else changed), the marks printed as JSON on stderr at exit.
STAGES = r"""
import time, sys, json
T0 = time.perf_counter()
marks = {}
def mark(name): marks.setdefault(name, time.perf_counter() - T0)
import jax
import llama_twins.cli.main as cli
import jax_llama.checkpoint as checkpoint, jax_llama.inference.generate as g
import bridge.formats as formats
mark("imports")
def wrap(owner, name, before, after):
    inner = getattr(owner, name)
    def call(*a, **k):
        mark(before); out = inner(*a, **k); mark(after); return out
    setattr(owner, name, call)
wrap(formats, "open_checkpoint", "open", "opened")
wrap(checkpoint, "load", "load", "loaded")
program = g.program
def timed_program(f, name, *a):
    mark(f"{name}: program"); run = program(f, name, *a); mark(f"{name}: program ready")
    return run
g.program = timed_program
write = sys.stdout.write
def first(s):
    if s.strip(): mark("first token")
    return write(s)
sys.stdout.write = first
sys.argv = ["jax-llama", *sys.argv[1:]]
try:
    cli.main()
finally:
    sys.stdout.write = write
    print(json.dumps(marks), file=sys.stderr)
"""


# what the span that ends at each mark holds
SPANS = {"imports": "Python, jax, flax and this project imported",
         "open": "the command line read",
         "opened": "the GGUF opened (its metadata, the model's name resolved)",
         "load": "its tokenizer and chat template rebuilt, the prompt read",
         "loaded": "the weights read into their nearest layout and onto the device",
         "prefill: program": "the prompt encoded",
         "prefill: program ready": "the prefill program loaded (traced and compiled where it "
                                   "is not kept)",
         "first token": "the prefill's first run, the token decoded and written",
         "decode: program": "",
         "decode: program ready": "the decode program loaded (after the first token)"}


def command(path: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "llama_twins.cli.main", "generate", path, "--chat",
            "--prompt", PROMPT, "--max-new-tokens", "16", *extra]


def stages(path: str, cache: str) -> dict[str, float]:
    """One warm run with its stages marked (STAGES) -> {mark: seconds since the start}."""
    run = subprocess.run([sys.executable, "-c", STAGES, *command(path)[3:]], capture_output=True,
                         text=True, env={**BASE_ENV, "JAX_LLAMA_COMPILE_CACHE": cache})
    if run.returncode:
        raise SystemExit(f"error: the staged run failed: {run.stderr[-2000:]}")
    return json.loads(run.stderr.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--incumbent", default=None,
                        help="a checkout of the code to compare with (its warm case)")
    parser.add_argument("--out", default="results/decode")
    args = parser.parse_args(argv)
    path = str(given_or_smollm2(args.gguf))
    if args.incumbent and not (Path(args.incumbent) / "llama_twins").is_dir():
        print(f"error: {args.incumbent}: not a checkout of this project (no llama_twins/)",
              file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="first-token-") as tmp:
        warm = {**BASE_ENV, "JAX_LLAMA_COMPILE_CACHE": f"{tmp}/cache"}
        cases = {"warm": (command(path), warm, None),
                 "warm, no programs": (command(path), {**warm, "JAX_LLAMA_PROGRAMS": "0"}, None),
                 "float32, warm": (command(path, "--dtype", "float32"), warm, None),
                 "cold": (command(path), {**BASE_ENV, "JAX_LLAMA_COMPILE_CACHE": "off"}, None)}
        if args.incumbent:
            incumbent = str(Path(args.incumbent).resolve())
            cases["incumbent"] = (command(path), {**warm, "PYTHONPATH": incumbent}, incumbent)
        for name, (argv_, env, cwd) in cases.items():  # fill the caches
            if name != "cold":
                first_byte_and_exit(argv_, env, cwd)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        for r in range(args.rounds):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for name in order:
                times[name].append(first_byte_and_exit(*cases[name]))
            print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1][0]:.2f} s" for n in cases),
                  file=sys.stderr, flush=True)
        marks = stages(path, f"{tmp}/cache")

    median = {name: {"first_token_s": statistics.median(t[0] for t in runs),
                     "exit_s": statistics.median(t[1] for t in runs)} for name, runs in times.items()}
    lines = ["# `jax-llama generate --chat`: time to the first token\n",
             f"`python scripts/first_token.py --rounds {args.rounds}"
             f"{' --incumbent ' + args.incumbent if args.incumbent else ''}`; {Path(path).name} "
             f"(its Q4_1 projections as 4-bit weights, the default), `generate --chat --prompt "
             f"\"{PROMPT}\" --max-new-tokens 16` in a fresh process each time; {cpu_model()}. "
             f"Medians of {args.rounds} alternating rounds, from the process's start to the first "
             "byte on stdout (the first token) and to its exit.\n",
             "| case | first token | exit | runs (first token) |", "|---|---|---|---|"]
    for name, m in median.items():
        lines.append(f"| {name} | {m['first_token_s']:.2f} s | {m['exit_s']:.2f} s | "
                     + ", ".join(f"{t[0]:.2f}" for t in times[name]) + " |")
    lines += ["", "Where a warm run's time goes (one run, marks taken inside the process):", "",
              "| until | what | at | seconds |", "|---|---|---|---|"]
    before = 0.0
    for name, t in sorted(marks.items(), key=lambda kv: kv[1]):
        lines.append(f"| {name} | {SPANS.get(name, '')} | {t:.2f} s | {t - before:.2f} |")
        before = t
    out = Path(args.out)
    print(results.write("first_token", {
        "command": " ".join(["python scripts/first_token.py", *(argv or sys.argv[1:])]),
        "cpu": cpu_model(), "checkpoint": Path(path).name, "rounds": args.rounds,
        "runs_s": times, "median": median, "stages_s": marks}, lines, out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
