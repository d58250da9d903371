"""GRPO's rollouts against `generate` at the same batch: tokens/s, and the sampler's log-probs
against the trainer's.

    python scripts/grpo_rollouts.py [GGUF] [--rounds 3] [--batch 32] [--new 16] [--out results/grpo]

On SmolLM2 as shipped (float32, LoRA rank 16 with random adapters, as a run holds it), for the
demo's first round of prompts (batch / 8 prompts x 8 completions, --new tokens at temperature 1):
- "rollouts": what `jax-llama grpo` runs each round - the KV-cache generator on the LoRA model,
  recording each token's log_softmax(logits / T);
- "generate": the same call as `jax-llama generate` makes, the adapters merged in (a plain
  model), raw log-probs;
alternating, each round one of each, medians; every token counts until each row's stop. Then
the largest difference between the sampler's log-probability of a drawn token and the
trainer's recomputation (one forward over prompt and completion), float32 and bfloat16.
Writes results/grpo/rollouts.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from llama_twins import results
from llama_twins.bench.common import cpu_model, given_or_smollm2
from llama_twins.parity.judgement import budget


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--out", default="results/grpo")
    args = parser.parse_args(argv)

    import jax_llama
    from bridge.chat import find_template
    from bridge.formats import open_checkpoint
    from bridge.lora import LoraConfig
    from bridge.sampling import Sampler
    from jax_llama.inference.generate import generate
    from jax_llama.lora import add_lora, merge_lora
    from jax_llama.training import grpo as grpo_lib

    path = given_or_smollm2(args.gguf)
    ckpt = open_checkpoint(path)
    tokenizer = ckpt.own_tokenizer()
    template = find_template(ckpt, tokenizer)
    G = 8
    records = grpo_lib.demo_prompts(args.batch // G, seed=0)
    ids = [template.encode(r["prompt"], tokenizer, add_generation_prompt=True)
           for _, r in records]
    prompts = [p for p in ids for _ in range(G)]
    rows = {}
    for dtype in ("float32", "bfloat16"):
        model, params = jax_llama.load(ckpt, dtype=dtype)
        lora_model, lora_params = add_lora(model, params, LoraConfig(rank=16), seed=0)
        # B random (a trained adapter), not zero: the adapters then change the logits
        key = jax.random.key(1)
        lora_params = jax.tree_util.tree_map_with_path(
            lambda p, x: 0.01 * jax.random.normal(jax.random.fold_in(key, hash(str(p)) % 2**31),
                                                  x.shape, x.dtype)
            if "lora_b" in str(p) else x, lora_params)
        merged_model, merged = merge_lora(lora_model, lora_params)
        sampler = Sampler(temperature=1.0)
        stops = tuple(tokenizer.stop_ids)

        def rollouts():
            return generate(lora_model, lora_params, prompts, args.new, sampler, stops,
                            key=jax.random.key(0), tempered_logprobs=True)

        def plain():
            return generate(merged_model, merged, prompts, args.new, sampler, stops, seed=0)
        times = {"rollouts": [], "generate": []}
        tokens = {}
        for fn, name in ((rollouts, "rollouts"), (plain, "generate")):
            out = fn()  # compiled, not timed
            tokens[name] = sum(len(t) for t in out.tokens)
        for r in range(args.rounds):
            for fn, name in ((rollouts, "rollouts"), (plain, "generate"))[::1 if r % 2 == 0
                                                                          else -1]:
                started = time.perf_counter()
                out = fn()
                times[name].append(time.perf_counter() - started)
                tokens[name] = sum(len(t) for t in out.tokens)
        speed = {name: tokens[name] / statistics.median(t) for name, t in times.items()}
        out = rollouts()
        P, N = max(map(len, prompts)), args.new
        tok = np.zeros((len(prompts), P + N), np.int32)
        att = np.zeros_like(tok)
        mask = np.zeros((len(prompts), N), bool)
        sampled = np.zeros((len(prompts), N), np.float32)
        for i, (p, t, lp) in enumerate(zip(prompts, out.tokens, out.logprobs)):
            tok[i, P - len(p):P], tok[i, P:P + len(t)] = p, t
            att[i, P - len(p):P + len(t)] = 1
            mask[i, :len(t)] = True
            sampled[i, :len(t)] = lp
        batch = {"inputs": tok[:, :-1], "attention": att[:, :-1], "completion": tok[:, P:]}
        trainer = np.asarray(jax.jit(lambda p, b: grpo_lib.token_logps(
            lora_model, p, b, 1.0)[0])(lora_params, batch))
        diff = np.abs(trainer - sampled)[mask]
        # the parity report's rounding budget for logits (per block and the head), for each of
        # the two computations, relative to the largest logit; a log_softmax moves by at most
        # twice its inputs' largest change: |d logp| <= 2 x 2 x budget x max|logit| / T
        logits = np.asarray(jax.jit(lambda p, b: lora_model.apply(
            {"params": p}, b["inputs"], attention_mask=b["attention"], method="run",
            head_at=np.broadcast_to(np.arange(P - 1, P + N - 1), (len(prompts), N))).logits)(
                lora_params, batch))
        bound = 4 * budget(dtype, "logits", model.config.n_layers + 1) * np.abs(
            logits[mask]).max() / 1.0
        rows[dtype] = {"rollouts_tok_s": round(speed["rollouts"], 1),
                       "generate_tok_s": round(speed["generate"], 1),
                       "ratio": round(speed["rollouts"] / speed["generate"], 3),
                       "times_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
                       "tokens": tokens, "logp_diff_max": float(diff.max()),
                       "rounding_bound": float(bound), "within": bool(diff.max() <= bound),
                       "logp_diff_median": float(np.median(diff))}
        print(f"{dtype}: rollouts {speed['rollouts']:.1f} tok/s, generate "
              f"{speed['generate']:.1f} tok/s ({rows[dtype]['ratio']:.2f}x); sampler vs "
              f"trainer log-probs: max {diff.max():.2e}, median {np.median(diff):.2e} (rounding "
              f"bound {bound:.2e})", file=sys.stderr)
    result = {"cpu": cpu_model(), "model": str(path), "batch": len(prompts),
              "new_tokens": args.new, "rounds": args.rounds, "rows": rows}
    lines = [f"# GRPO rollouts against `generate`, {Path(str(path)).name}", "",
             f"{result['cpu']}; `python scripts/grpo_rollouts.py --rounds {args.rounds} --batch "
             f"{args.batch} --new {args.new}`: {len(prompts)} completions ({args.batch // G} "
             f"demo prompts x {G}), up to {args.new} new tokens at temperature 1, LoRA rank 16 "
             f"with random adapters; medians of {args.rounds}, alternating.", "",
             "| dtype | rollouts (tok/s) | generate, merged (tok/s) | ratio | sampler vs trainer "
             "log-prob, max | median | rounding bound |", "|---|---|---|---|---|---|---|"]
    for dtype, r in rows.items():
        lines.append(f"| {dtype} | {r['rollouts_tok_s']} | {r['generate_tok_s']} | "
                     f"{r['ratio']:.2f}x | {r['logp_diff_max']:.2e} | "
                     f"{r['logp_diff_median']:.2e} | {r['rounding_bound']:.2e} |")
    lines += ["", "Rounding bound: each computation's logits may be off by the parity report's "
              "budget (llama_twins.parity.judgement: per block and the head, relative to the "
              "largest logit); a log-probability then by at most twice that, for each of the "
              "two: 4 x budget x max|logit| / T."]
    print(results.write("rollouts", result, lines, Path(args.out)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
