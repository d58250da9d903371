"""SFT from a real pretrained chat model (SmolLM2-135M-Instruct) on the embedded demo task, in
its own ChatML template: the task learned (held-out exact match before and after) and the
model's general answers kept (a few fixed questions before and after, side by side). Writes
results/sft_pretrained.{json,md}.

    python scripts/sft_pretrained.py CHECKPOINT [--steps 150] [--out results] [--work DIR]

The run is the plain command `jax-llama sft --init CHECKPOINT --lora-rank 16 ...` (no --data:
the demo task; no --chat-template: the checkpoint's own), resumed where --work holds a finished
one. The answers are greedy, from the base and from the run's model/ (the adapter merged).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from llama_twins.bench.common import cpu_model

QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "Write a haiku about the sea.", "Give me one tip for sleeping better.",
             "What is 7 plus 8?", "Spell the word garden backwards."]


def answers(checkpoint: str, new_tokens: int) -> list[str]:
    import jax_llama
    from bridge.chat import find_template
    from bridge.prompts import encode_prompts, stop_ids
    from bridge.tokenizer import find_tokenizer

    tokenizer = find_tokenizer(checkpoint)
    prompts = encode_prompts(tokenizer, QUESTIONS, 8192, chat=find_template(checkpoint, tokenizer))
    model, params = jax_llama.load(checkpoint)
    stops = set(stop_ids(tokenizer))
    out = jax_llama.generate(model, params, prompts, new_tokens, stop_ids=list(stops)).tokens
    return [tokenizer.decode([t for t in ids if t not in stops]) for ids in out]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--out", default="results")
    p.add_argument("--work", default="runs/sft-pretrained")
    args = p.parse_args(argv)

    work = Path(args.work)
    command = ["jax-llama", "sft", "--init", args.checkpoint, "--lora-rank", str(args.lora_rank),
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len",
               str(args.seq_len), "--lr", str(args.lr), "--eval-every", str(args.steps),
               "--checkpoint-every", str(args.steps), "--out", str(work)]
    seconds = None
    if not (work / "exact_match.json").exists():
        print("$ " + " ".join(command), file=sys.stderr, flush=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "llama_twins.jax_cli", *command[1:]], check=True)
        seconds = time.perf_counter() - started
    scores = json.loads((work / "exact_match.json").read_text())
    metrics = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "loss" in m]
    from bridge.convert import convert
    base = work / "base"
    if not base.exists():
        convert(args.checkpoint, base, to="native", dtype="float32", progress=False)
    before, after = answers(str(base), args.new_tokens), answers(str(work / "model"), args.new_tokens)
    result = {"checkpoint": args.checkpoint, "cpu": cpu_model(), "cores": os.cpu_count(),
              "command": " ".join(command), "seconds": seconds,
              "exact_match": {k: scores[k]["exact_match"] for k in ("before", "after")},
              "unseen_exact_match": {k: scores[k].get("unseen_exact_match")
                                     for k in ("before", "after")},
              "n_eval": scores["after"]["n"],
              "first_loss": train[0]["loss"] if train else None,
              "last_loss": train[-1]["loss"] if train else None,
              "answers": [{"question": q, "before": b, "after": a}
                          for q, b, a in zip(QUESTIONS, before, after)]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sft_pretrained.json").write_text(json.dumps(result, indent=2) + "\n")
    em = result["exact_match"]
    wall = f"{seconds / 60:.1f} minutes" if seconds else "wall time in an earlier run"
    lines = [f"# SFT from {Path(args.checkpoint).name} on the demo task", "",
             f"{result['cpu']}, {result['cores']} cores; `python scripts/sft_pretrained.py "
             f"{args.checkpoint}` runs `{result['command']}` ({wall}).", "",
             f"Held-out exact match ({result['n_eval']} chats of the demo task): "
             f"{em['before']:.1%} before, **{em['after']:.1%}** after; training loss "
             f"{result['first_loss']:.3f} -> {result['last_loss']:.3f}.", "",
             f"Greedy answers to fixed questions ({args.new_tokens} new tokens at most), through "
             f"the model's own ChatML template:", "",
             "| question | before | after |", "|---|---|---|"]
    for r in result["answers"]:
        lines.append(f"| {r['question']} | {r['before']!r} | {r['after']!r} |")
    (out / "sft_pretrained.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
