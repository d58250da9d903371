"""Perplexity of one checkpoint in three implementations - `jax-llama eval`, `torch-llama eval` and
transformers running its guide's loop (scripts/eval_transformers.py) - each the command a user
runs, on the same text. Writes results/quality/eval.{json,md} (the table of
docs/how-to/evaluate.md).

    python scripts/eval_twins.py RUN [--seq-len 128] [--stride 64] [--out results/quality]

RUN: a `jax-llama train` run directory on a plain text corpus (the main job: `jax-llama train
--out runs/main`). Its validation split is written out by scripts/embedded_validation.py into
RUN/validation and the model converted to RUN/hf, each unless already there.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from llama_twins import results
from llama_twins.bench.common import run_json

HERE = Path(__file__).resolve().parent
KEYS = ("perplexity", "nll_per_token", "bits_per_byte", "tokens", "seconds")


def render(data: dict) -> list[str]:
    rows = [f"# Perplexity of `{data['checkpoint']}` in three implementations", "",
            f"Text: {data['data']}; windows of {data['seq_len']} tokens every "
            f"{data['stride']}.", "",
            "| implementation | perplexity | nll/token (nats) | bits/byte | tokens "
            "| scoring seconds | whole command (s) |", "|---|---|---|---|---|---|---|"]
    for name, r in data["sides"].items():
        rows.append(f"| `{data['commands'][name]}` | {r['perplexity']:.4f} | "
                    f"{r['nll_per_token']:.9f} | {r['bits_per_byte']:.7f} | {r['tokens']:,} | "
                    f"{r['seconds']:.1f} | {data['whole_command_seconds'][name]:.1f} |")
    nll = [r["nll_per_token"] for r in data["sides"].values()]
    largest = data["largest_relative_difference"]
    rows += ["", f"Largest difference in nll/token, relative: {largest:.1e} "
             f"(nll/token {', '.join(f'{x:.9f}' for x in nll)})."]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a jax-llama train run directory (model/, run.json)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--stride", type=int, default=64)
    parser.add_argument("--out", default="results/quality")
    args = parser.parse_args(argv)
    run = Path(args.run)
    if not (run / "model").is_dir():
        print(f"error: {run / 'model'}: no such directory (a finished jax-llama train run)",
              file=sys.stderr)
        return 2
    validation, hf = run / "validation", run / "hf"
    if not validation.is_dir():
        subprocess.run([sys.executable, str(HERE / "embedded_validation.py"), str(run),
                        str(validation)], check=True)
    if not hf.is_dir():
        subprocess.run(["llama-bridge", "convert", str(run / "model"), str(hf), "--to", "hf"],
                       check=True, capture_output=True)
    window = ["--data", str(validation), "--seq-len", str(args.seq_len),
              "--stride", str(args.stride), "--json"]
    commands = {"jax": ["jax-llama", "eval", str(run / "model"), *window],
                "torch": ["torch-llama", "eval", str(run / "model"), *window],
                "transformers": [sys.executable, str(HERE / "eval_transformers.py"), str(hf),
                                 *window]}
    sides, walls = {}, {}
    for name, command in commands.items():
        found, wall = run_json(command)
        sides[name] = {key: found[key] for key in KEYS}
        walls[name] = round(wall, 2)
    nll = [r["nll_per_token"] for r in sides.values()]
    shown = {name: " ".join(c if c != sys.executable else "python" for c in command)
             .replace(str(HERE), "scripts") for name, command in commands.items()}
    result = {"checkpoint": str(run / "model"), "data": str(validation),
              "seq_len": args.seq_len, "stride": args.stride, "commands": shown,
              "whole_command_seconds": walls, "sides": sides,
              "largest_relative_difference": (max(nll) - min(nll)) / min(nll)}
    print(results.write("eval", result, render, args.out), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
