"""Perplexity of 4-bit weights against llama.cpp's own (issue 57): the rise of jax-llama's int4
over float32 against the rise of llama.cpp's Q4_0 over its F32, on the same weights and text.

The weights: SmolLM2-135M-Instruct (the installed GGUF's, dequantised: the float32 model), written
by the bridge as an F32 GGUF and as a Q4_0 GGUF (gguf's Q4_0 rounding, llama.cpp's converter's).
The text: ../shared/data/sst/dev.txt's sentences (labels dropped), joined by newlines, tokenized by
the model's own tokenizer, cut into non-overlapping windows of --window tokens; each window is
scored alone from its first token (the NLL of tokens 2..window given those before).

Rows: llama.cpp (llama-cpp-python) on the F32 and the Q4_0 file; jax-llama float32 (the F32 file),
int4 reading the Q4_0 file's blocks exactly (jax_llama.load(..., quantize="int4"): llama.cpp's weights,
bit for bit), the same with JAX_LLAMA_INT4_ACTIVATIONS=int8 and =bfloat16, and int4 by our own quantiser
(bridge.int4.quantize_int4: a scale and a minimum per 32) from the float32 weights. Writes OUT/int4_perplexity.{md,json}.

    python scripts/int4_perplexity.py [--windows 16] [--window 512] [--out results/quality]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def with_activations(kind: str, run):
    """run() with JAX_LLAMA_INT4_ACTIVATIONS=kind (int8: x rounded to 8 bits per group of 32
    before each 4-bit product, as llama.cpp's Q4 types do; bfloat16: each input to bfloat16),
    the setting restored after."""
    import os

    from bridge.int4 import ACTIVATIONS_ENV
    before = os.environ.get(ACTIVATIONS_ENV)
    os.environ[ACTIVATIONS_ENV] = kind
    try:
        return run()
    finally:
        if before is None:
            del os.environ[ACTIVATIONS_ENV]
        else:
            os.environ[ACTIVATIONS_ENV] = before


def nll_jax(model, params, chunks) -> float:
    import jax
    import jax.numpy as jnp

    @jax.jit
    def window_nll(params, tokens):
        logits = model.apply({"params": params}, tokens[None, :-1])[0].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.sum(jnp.take_along_axis(logp, tokens[1:, None], axis=-1))
    total = sum(float(window_nll(params, jnp.asarray(c, jnp.int32))) for c in chunks)
    return total / sum(len(c) - 1 for c in chunks)


def nll_llama_cpp(path: Path, chunks) -> float:
    import llama_cpp

    from llama_twins.llama_cpp_reference import _quiet

    size = len(chunks[0])
    with _quiet():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=size, n_batch=size, logits_all=True,
                              verbose=False)
    total = 0.0
    for c in chunks:
        llm.reset()
        llm.eval(c)
        logits = np.asarray(llm.scores[:len(c) - 1], np.float64)
        top = logits.max(axis=-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
        total -= float(np.take_along_axis(logp, np.asarray(c[1:])[:, None], axis=-1).sum())
    return total / sum(len(c) - 1 for c in chunks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", default=str(ROOT / "results" / "quality"))
    args = parser.parse_args(argv)

    import jax_llama
    from bridge.convert import convert
    from bridge.tokenizer import find_tokenizer
    from jax_llama.quantize import quantize
    from llama_twins import results
    from llama_twins.bench.common import cpu_model, given_or_smollm2, sst_windows

    source = given_or_smollm2(None)
    tokenizer = find_tokenizer(source)
    chunks = sst_windows(tokenizer, args.windows, args.window)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="int4-ppl-") as tmp:
        files = {t: convert(source, Path(tmp) / f"smollm2-{t}.gguf", to="gguf", dtype=t,
                            progress=False) for t in ("f32", "q4_0")}
        for label, run in (
                ("llama.cpp F32", lambda: nll_llama_cpp(files["f32"], chunks)),
                ("llama.cpp Q4_0", lambda: nll_llama_cpp(files["q4_0"], chunks)),
                ("jax-llama float32", lambda: nll_jax(*jax_llama.load(files["f32"]), chunks)),
                ("jax-llama int4 (the Q4_0 file's blocks)",
                 lambda: nll_jax(*jax_llama.load(files["q4_0"], quantize="int4"), chunks)),
                ("jax-llama int4, 8-bit activations (the Q4_0 file's blocks)",
                 lambda: with_activations("int8", lambda: nll_jax(
                     *jax_llama.load(files["q4_0"], quantize="int4"), chunks))),
                ("jax-llama int4, bfloat16 activations (the Q4_0 file's blocks)",
                 lambda: with_activations("bfloat16", lambda: nll_jax(
                     *jax_llama.load(files["q4_0"], quantize="int4"), chunks))),
                ("jax-llama int4 (our quantiser, from float32)",
                 lambda: (lambda m, p: nll_jax(m, quantize(p, method="int4"), chunks))(
                     *jax_llama.load(files["f32"])))):
            start = time.perf_counter()
            nll = run()
            rows[label] = {"nll_per_token": nll, "perplexity": math.exp(nll),
                           "seconds": time.perf_counter() - start}
            print(f"{label}: perplexity {math.exp(nll):.3f}", file=sys.stderr, flush=True)
    base = {"llama.cpp": rows["llama.cpp F32"]["perplexity"],
            "jax-llama": rows["jax-llama float32"]["perplexity"]}
    for label, r in rows.items():
        r["rise_over_float32"] = r["perplexity"] / base[label.split(" ")[0]] - 1
    ours, theirs = (rows["jax-llama int4 (the Q4_0 file's blocks)"]["rise_over_float32"],
                    rows["llama.cpp Q4_0"]["rise_over_float32"])
    q8 = rows["jax-llama int4, 8-bit activations (the Q4_0 file's blocks)"]["rise_over_float32"]
    bf16 = rows["jax-llama int4, bfloat16 activations (the Q4_0 file's blocks)"][
        "rise_over_float32"]
    n = args.windows * (args.window - 1)
    lines = ["# 4-bit perplexity against llama.cpp's, SmolLM2-135M-Instruct", "",
             f"{cpu_model()}; `python scripts/int4_perplexity.py --windows {args.windows} "
             f"--window {args.window}`: {args.windows} windows of {args.window} tokens of SST dev "
             f"sentences ({n:,} scored tokens), each alone.", "",
             "| implementation | weights | perplexity | rise over its float32 |", "|---|---|---|---|"]
    for label, r in rows.items():
        impl, _, weights = label.partition(" ")
        lines.append(f"| {impl} | {weights} | {r['perplexity']:.4f} | "
                     f"{r['rise_over_float32']:+.2%} |")
    lines += ["", f"jax-llama's int4 rise on llama.cpp's Q4_0 weights: {ours:+.2%}, llama.cpp's: "
              f"{theirs:+.2%} (target: no larger: {'met' if ours <= theirs + 1e-4 else 'not met'}"
              f"; llama.cpp also rounds the activations to 8 bits, Q8_0, for its dot products, "
              f"which this project does only with JAX_LLAMA_INT4_ACTIVATIONS=int8: "
              f"{q8:+.2%}, {'met' if q8 <= theirs + 1e-4 else 'not met'} that way; with "
              f"bfloat16 activations {bf16:+.2%}, {'met' if bf16 <= theirs + 1e-4 else 'not met'})."]
    print(results.write("int4_perplexity", {"windows": args.windows, "window": args.window,
                                            "rows": rows}, lines, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
