"""`jax-llama grpo`'s demo on SmolLM2, as a user runs it: held-out accuracy before and after, wall
time and peak memory, the general questions side by side, the reward curve.

    python scripts/grpo_demo.py [GGUF] [--avx2] [--out results/grpo]

Runs `jax-llama grpo --init GGUF --out <a temporary directory>` (the demo's defaults) in a child
process (--avx2: with the AVX2 code-path switches of llama_twins.bench.common.AVX2_ENV, as an
AVX2-only CPU runs it), measures its wall time and peak RSS, and writes
results/grpo/demo[_avx2].{json,md} and the run's reward.png beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llama_twins import results
from llama_twins.bench.common import AVX2_ENV, cpu_model, given_or_smollm2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?")
    parser.add_argument("--avx2", action="store_true")
    parser.add_argument("--out", default="results/grpo")
    args = parser.parse_args(argv)
    path = given_or_smollm2(args.gguf)
    name = "demo_avx2" if args.avx2 else "demo"
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "grpo-demo"
        command = [sys.executable, "-m", "llama_twins.cli.main", "grpo", "--init", str(path),
                   "--out", str(run)]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, **(AVX2_ENV if args.avx2 else {})})
        wall = time.perf_counter() - started
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
        scores = json.loads((run / "grpo.json").read_text())
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(run / "reward.png", out / f"{name}_reward.png")
        spec = json.loads((run / "run.json").read_text())
    steps = [r for r in records if "loss" in r]
    rounds = [r for r in steps if "time/generation" in r][1:]  # the first compiles
    median = lambda xs: sorted(xs)[len(xs) // 2]
    result = {"cpu": cpu_model(), "cores": os.cpu_count(), "avx2_switches": args.avx2,
              "command": "jax-llama grpo --init " + Path(str(path)).name,
              "wall_s": round(wall, 1), "peak_rss_gb": round(peak_gb, 2),
              "before": scores["before"]["eval/rewards/exact_answer/mean"],
              "after": scores["after"]["eval/rewards/exact_answer/mean"],
              "evaluations": [(r["step"], r["eval/reward"]) for r in records
                              if "eval/reward" in r],
              "seconds_a_round": {k: round(median([r[f"time/{k}"] for r in rounds]), 2)
                                  for k in ("generation", "scoring", "update")},
              "sampler_logp_diff_max": max(r["sampler/logp_diff_max"] for r in steps),
              "general": {w: scores[w]["general"] for w in ("before", "after")},
              "samples": scores["after"]["samples"], "grpo": spec["grpo"],
              "train": spec["train"], "lora": spec["lora"]}
    lines = [f"# `jax-llama grpo` demo on {Path(str(path)).name}", "",
             f"{result['cpu']}, {result['cores']} cores"
             + (", on the AVX2 code paths (the four switches of AVX2_ENV)" if args.avx2 else "")
             + f"; `python scripts/grpo_demo.py{' --avx2' if args.avx2 else ''}`: the command "
             f"`{result['command']}` with its defaults ({spec['train']['steps']} steps of "
             f"{spec['train']['batch_size'] // spec['grpo']['num_generations']} prompts x "
             f"{spec['grpo']['num_generations']} completions, up to "
             f"{spec['grpo']['max_completion_length']} new tokens, LoRA rank "
             f"{spec['lora']['rank']}, lr {spec['train']['lr']:g}), one process.", "",
             "| held-out exact answer (64 questions, greedy) | before | after | wall | peak RSS |",
             "|---|---|---|---|---|",
             f"| two-digit sums, \"Answer with the number only.\" | {result['before']:.1%} | "
             f"{result['after']:.1%} | {wall / 60:.1f} min | {peak_gb:.1f} GB |", "",
             "Held-out reward at each evaluation: "
             + ", ".join(f"step {s}: {v:.3f}" for s, v in result["evaluations"]) + ".", "",
             "A round (median, after the first): generation "
             f"{result['seconds_a_round']['generation']} s, scoring "
             f"{result['seconds_a_round']['scoring']} s, update "
             f"{result['seconds_a_round']['update']} s. Largest sampler/trainer log-probability "
             f"difference: {result['sampler_logp_diff_max']:.2e} nats.", "",
             "| general question | before | after |", "|---|---|---|"]
    for b, a in zip(result["general"]["before"], result["general"]["after"]):
        lines.append(f"| {b['question']} | {_cell(b['answer'])} | {_cell(a['answer'])} |")
    lines += ["", f"![reward over steps]({name}_reward.png)"]
    print(results.write(name, result, lines, Path(args.out)), end="")
    return 0


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    sys.exit(main())
