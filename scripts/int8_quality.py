"""What int8 weight-only quantisation costs in quality, measured three ways (issue 17, part 2).

    python scripts/int8_quality.py --model runs/main/model --data VAL_DIR [--out results/quality]

1. Perplexity of `--model` on the held-out text in `--data` (e.g. the validation split of the
   main job's run, written by scripts/embedded_validation.py), float32 against int8 per output
   channel and int8 in groups of --group-size input columns, in both twins (jax_llama.eval and
   torch_llama.eval: sliding windows, tasks.evaluation).
2. Greedy agreement: 20 prompts (the first --prompt-len tokens of 20 evenly spaced places in the
   held-out text), 64 new tokens each, float32 against int8, in JAX; and whether the two twins'
   int8 continuations are identical.
3. A random-weight model of the benchmark config (llama_twins.bench.common.CONFIG, 56M
   parameters): mean KL(float32 || int8) of the next-token distributions over 4 x 128 random
   tokens, and how often the top-1 token is the same.

Writes OUT/int8_quality.{md,json}. Float32 throughout; CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from llama_twins import results

N_PROMPTS, NEW_TOKENS = 20, 64


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def perplexities(model_dir: str, data: list[str], group_size: int, seq_len: int | None) -> list:
    import jax_llama
    import torch_llama
    from tasks.evaluation import read_texts, tokenize, window_settings
    from bridge.tokenizer import find_tokenizer
    from jax_llama.eval import evaluate as jax_evaluate
    from torch_llama.eval import evaluate as torch_evaluate

    documents = tokenize(read_texts(data), find_tokenizer(model_dir))
    model, params = jax_llama.load(model_dir)
    seq_len, stride = window_settings(model.config.max_seq_len, seq_len)
    rows = []
    for label, quantize in (("float32", None), ("int8 per channel", None),
                            (f"int8 group {group_size}", group_size)):
        started = time.perf_counter()
        p = params if label == "float32" else jax_llama.quantize(params, quantize)
        jax_report = jax_evaluate(model, p, documents, seq_len, stride, progress=True)
        tmodel = torch_llama.load(model_dir, device="cpu")
        if label != "float32":
            torch_llama.quantize(tmodel, quantize)
        torch_report = torch_evaluate(tmodel, documents, seq_len, stride, progress=True)
        rows.append({"weights": label, "tokens": jax_report["tokens"],
                     "jax": {k: jax_report[k] for k in ("perplexity", "nll_per_token",
                                                        "bits_per_byte")},
                     "torch": {k: torch_report[k] for k in ("perplexity", "nll_per_token",
                                                            "bits_per_byte")},
                     "seconds": time.perf_counter() - started})
        print(f"{label}: perplexity {jax_report['perplexity']:.4f} (jax), "
              f"{torch_report['perplexity']:.4f} (torch)", file=sys.stderr)
    return rows, seq_len, stride


def greedy_agreement(model_dir: str, data: list[str], prompt_len: int) -> dict:
    import jax_llama
    import torch_llama
    from tasks.evaluation import read_texts, tokenize
    from bridge.tokenizer import find_tokenizer

    ids = np.concatenate([d.ids for d in tokenize(read_texts(data), find_tokenizer(model_dir))])
    starts = np.linspace(0, len(ids) - prompt_len - 1, N_PROMPTS).astype(int)
    prompts = [ids[s:s + prompt_len].tolist() for s in starts]
    model, params = jax_llama.load(model_dir)
    exact = jax_llama.generate(model, params, prompts, NEW_TOKENS).tokens
    int8 = jax_llama.generate(model, jax_llama.quantize(params), prompts, NEW_TOKENS).tokens
    tmodel = torch_llama.quantize(torch_llama.load(model_dir, device="cpu"))
    torch_int8 = torch_llama.generate(tmodel, prompts, NEW_TOKENS).tokens

    def first_difference(a, b) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    same_at = [first_difference(a, b) for a, b in zip(exact, int8)]
    matching = [np.mean([x == y for x, y in zip(a, b)]) for a, b in zip(exact, int8)]
    return {"prompts": N_PROMPTS, "prompt_len": prompt_len, "new_tokens": NEW_TOKENS,
            "identical": sum(a == b for a, b in zip(exact, int8)),
            "mean_tokens_before_first_difference": float(np.mean(same_at)),
            "position_wise_agreement": float(np.mean(matching)),
            "twins_int8_identical": sum(a == b for a, b in zip(int8, torch_int8))}


def random_model_kl(group_size: int, seed: int = 0) -> dict:
    import jax_llama
    from llama_twins.bench.common import CONFIG, describe

    model, params = jax_llama.init(CONFIG, seed=seed)
    tokens = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (4, 128), dtype=np.int32)
    exact = log_softmax(np.asarray(model.apply({"params": params}, tokens), np.float64))
    rows = {}
    for label, group in (("int8 per channel", None), (f"int8 group {group_size}", group_size)):
        int8 = log_softmax(np.asarray(model.apply({"params": jax_llama.quantize(params, group)},
                                                  tokens), np.float64))
        kl = (np.exp(exact) * (exact - int8)).sum(-1)
        rows[label] = {"mean_kl_nats": float(kl.mean()), "max_kl_nats": float(kl.max()),
                       "top1_agreement": float((exact.argmax(-1) == int8.argmax(-1)).mean())}
    return {"model": describe(CONFIG), "tokens": "4 x 128 random", "rows": rows}


def markdown(result: dict) -> list[str]:
    """The table of a result this script wrote (its JSON), CPU and commit in the line that
    llama_twins.results adds."""
    p, g, r = result["perplexity"], result["greedy"], result["random"]
    lines = [f"int8 weight-only quality, `{result['command']}`", "",
             f"**Perplexity of {result['model']} on {p['tokens']:,} held-out tokens** (sliding "
             f"windows of {p['seq_len']}, stride {p['stride']})", "",
             "| weights | perplexity (JAX) | perplexity (torch) | NLL/token (JAX) | NLL/token "
             "(torch) | change from float32 (nats/token, JAX) | bits/byte (JAX) | seconds (both "
             "twins) |", "|---|---|---|---|---|---|---|---|"]
    base = p["rows"][0]["jax"]["nll_per_token"]
    for row in p["rows"]:
        j, t = row["jax"], row["torch"]
        lines.append(f"| {row['weights']} | {j['perplexity']:.4f} | {t['perplexity']:.4f} | "
                     f"{j['nll_per_token']:.7f} | {t['nll_per_token']:.7f} | "
                     f"{j['nll_per_token'] - base:+.1e} | {j['bits_per_byte']:.5f} | "
                     f"{row['seconds']:.0f} |")
    lines += ["", f"**Greedy agreement**, {g['prompts']} prompts of {g['prompt_len']} held-out "
                  f"tokens, {g['new_tokens']} new tokens (JAX, float32 vs int8 per channel): "
                  f"{g['identical']}/{g['prompts']} continuations identical; on average "
                  f"{g['mean_tokens_before_first_difference']:.1f} tokens before the first "
                  f"difference; {g['position_wise_agreement']:.1%} of positions equal. The two "
                  f"twins' int8 continuations: {g['twins_int8_identical']}/{g['prompts']} "
                  f"identical.", "",
              f"**Random-weight model** ({r['model']}), {r['tokens']} tokens, float32 vs int8:", "",
              "| weights | mean KL (nats) | max KL (nats) | top-1 agreement |", "|---|---|---|---|"]
    for label, x in r["rows"].items():
        lines.append(f"| {label} | {x['mean_kl_nats']:.2e} | {x['max_kl_nats']:.2e} | "
                     f"{x['top1_agreement']:.2%} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint with its tokenizer")
    parser.add_argument("--data", nargs="+", required=True, help="held-out text files / dirs")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, help="eval window (default: tasks.evaluation's)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--out", default="results/quality")
    parser.add_argument("--render", metavar="JSON", help="only rewrite the table from a JSON "
                                                         "this script wrote")
    args = parser.parse_args(argv)
    if args.render:
        text = results.to_markdown(json.loads(Path(args.render).read_text()), markdown)
        Path(args.out, "int8_quality.md").write_text(text)
        print(text, end="")
        return 0
    command = "python scripts/int8_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows, seq_len, stride = perplexities(args.model, args.data, args.group_size, args.seq_len)
    result = {"command": command, "model": args.model,
              "perplexity": {"seq_len": seq_len, "stride": stride, "tokens": rows[0]["tokens"],
                             "rows": rows},
              "greedy": greedy_agreement(args.model, args.data, args.prompt_len),
              "random": random_model_kl(args.group_size)}
    print(results.write("int8_quality", result, markdown, args.out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
