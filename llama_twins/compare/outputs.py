"""The outputs section of `llama-bridge compare A B`: both models run over the same text, and the
figures llama.cpp's `llama-perplexity --kl-divergence` reports for a quantised model against its
base - per-token KL(A || B) (mean, 99th percentile, max), how often the two agree on the most
likely token, and each model's perplexity.

The text is cut as llama-perplexity cuts it: windows of WINDOW tokens one after another (BOS
first where A's tokenizer adds it), the second half of each window scored, so that every scored
token has at least half a window of context. A text shorter than one window is one window.

One model is in memory at a time: A runs over every window and keeps the log-probabilities of
its scored tokens (float32, tokens x vocabulary: 250 MB for 1,280 tokens of a 49k vocabulary),
then A is dropped and B runs over the same windows, each window's KL taken as it comes.

What the figures mean is judged against the pair's storage type (storage_type): two float32
checkpoints of one model compute the same sums, so they must be the same (SAME_MEAN_KL); a
quantised one may differ by what llama.cpp measured for its type on LLaMA 3 8B (REFERENCE), times
MARGIN (and same top-1 within TOP1_MARGIN times the reference's shortfall from 100%), for a
small model on a short text is hurt more than an 8B model on Wikitext.
"""

from __future__ import annotations

import gc
from typing import Callable

import numpy as np

from bridge.compare.report import DIFFERENT, SAME, SKIPPED, WITHIN, Finding
from bridge.errors import BridgeError

WINDOW = 512

# llama.cpp's published figures for LLaMA 3 8B against its FP16 logits, per quantisation type:
# (mean KLD, same top-1 % where published). The K types are their _M mixes (Q4_K_M's tensors are
# mostly Q4_K). Source: REFERENCE_URL, the tables "LLaMA 3 8b Scoreboard" and the comparison of
# LLaMA 2 7b and 3 8b.
REFERENCE_URL = "https://github.com/ggml-org/llama.cpp/blob/master/tools/perplexity/README.md"
REFERENCE = {"F16": (0.000551, None), "Q8_0": (0.001355, 97.674), "Q6_K": (0.005452, 96.031),
             "Q5_K": (0.010762, None), "Q5_1": (0.018045, None), "Q5_0": (0.022239, None),
             "Q4_K": (0.031273, 91.901), "Q4_1": (0.071683, None), "Q4_0": (0.071940, None),
             "Q3_K": (0.101913, None), "Q2_K": (0.445132, 71.138)}
# Our own storage types, each judged as the llama.cpp type of the same bits: bfloat16 keeps 8
# bits of mantissa, as Q8_0 does; float16 11, which llama.cpp's F16 row bounds; int8 rows are
# Q8_0's rounding with one scale a row.
AS_TYPE = {"bfloat16": "Q8_0", "float16": "F16", "int8": "Q8_0", "int4": "Q4_1"}
# How far beyond llama.cpp's 8B figure a faithful pair may be: a small model is hurt more by the
# same rounding, and a short text's mean is noisier than Wikitext's. On the default text,
# SmolLM2-135M's float32 export re-exported as Q8_0 measures 3.5x Q8_0's figure (same top-1 95%
# against 97.7%), as Q4_0 3.6x Q4_0's (docs/how-to/compare.md).
MARGIN, TOP1_MARGIN = 5.0, 3.0
# Same within float rounding: two float32 runs of the same weights differ in the order of their
# sums at most, logits by ~1e-5, and KL ~ (difference)^2 / 2 ~ 1e-10 per token; any changed
# weight (even bfloat16 rounding) gives 1e-4 or more. The max keeps one broken position from
# hiding in the mean.
SAME_MEAN_KL, SAME_MAX_KL = 1e-6, 1e-4


def storage_type(ckpt) -> str:
    """The coarsest storage of a checkpoint's weights, as the tables above name it: of a GGUF's
    quantised types, the one with the largest reference (Q4_K for Q4_K_M's mix of Q4_K and Q6_K,
    and for SmolLM2's, whose 576-wide rows fall back to Q5_0 and Q8_0), else its most common;
    "int8" / "int4" for a native quantised checkpoint; else its float dtype."""
    quantised = [kind.upper() for kind in (ckpt.tensor_types or {})
                 if not kind.upper().startswith(("F32", "F16", "BF16", "F64"))]
    if quantised:
        known = [kind for kind in quantised if kind in REFERENCE]
        return max(known, key=lambda k: REFERENCE[k][0]) if known else quantised[0]
    if ckpt.quantization is not None:
        return ckpt.quantization.method
    if ckpt.tensor_types and "F16" in ckpt.tensor_types:
        return "float16"
    if ckpt.tensor_types and "BF16" in ckpt.tensor_types:
        return "bfloat16"
    return ckpt.stored_dtype()


def reference_for(a_type: str, b_type: str) -> tuple[str, float, float | None] | None:
    """(the pair's type, its reference mean KLD, its same top-1 % or None) for the coarser of the
    two types, None when both are float32 (nothing explains a difference)."""
    known = [(t, REFERENCE[AS_TYPE.get(t, t)]) for t in (a_type, b_type)
             if AS_TYPE.get(t, t) in REFERENCE]
    if not known:
        return None
    kind, (kld, top1) = max(known, key=lambda k: k[1][0])
    return kind, kld, top1


def windows(ids: list[int], bos: int | None, size: int = WINDOW) -> list[np.ndarray]:
    """The text's windows as llama-perplexity cuts them: whole windows of `size` tokens (BOS,
    when given, as each one's first), or the whole text as one window when it is shorter."""
    body = size - (bos is not None)
    if len(ids) < body:
        return [np.asarray(([bos] if bos is not None else []) + ids, np.int32)]
    return [np.asarray(([bos] if bos is not None else []) + ids[k:k + body], np.int32)
            for k in range(0, len(ids) - body + 1, body)]


def _log_probs(model, params, window: np.ndarray, run) -> np.ndarray:
    """log_softmax of the logits at the window's scored positions (its second half, less the
    last, which predicts nothing), float32 (positions, V)."""
    logp = np.asarray(run(params, window[None])[0], np.float32)
    first = len(window) // 2
    return logp[max(first - 1, 0):-1]


def _load(ckpt, adapter=None):
    """jax_llama.load as the commands load: a quantised file runs as stored; a float one with
    its blocks scanned, which compiles one block instead of every one (most of the time a
    small model takes here)."""
    import jax_llama

    scan = storage_type(ckpt) in ("float32", "bfloat16", "float16") or adapter is not None
    return jax_llama.load(ckpt, quantize=None if scan else "auto", adapter=adapter,
                          scan_layers=scan)


def _runner(model):
    import jax

    return jax.jit(lambda params, tokens: jax.nn.log_softmax(
        model.apply({"params": params}, tokens).astype("float32"), axis=-1))


def compare_outputs(a, b, text: str, adapter=None,
                    progress: Callable[[str], object] | None = None) -> Finding:
    """Run A (with `adapter` merged, when given) and B over `text`, tokenised by A's tokenizer,
    and judge the figures (see the module's docstring). a, b: opened checkpoints
    (bridge.formats.open_checkpoint)."""
    from bridge.tokenizer import find_tokenizer

    heard = progress or (lambda message: None)
    if a.config.vocab_size != b.config.vocab_size:
        return Finding("outputs", SKIPPED, f"not run: the vocabularies differ in size "
                       f"({a.config.vocab_size} in A, {b.config.vocab_size} in B)")
    try:
        tokenizer = find_tokenizer(a)
    except BridgeError as e:
        return Finding("outputs", SKIPPED, f"not run: A's text cannot be tokenised ({e})")
    ids = tokenizer.encode(text)
    cut = windows(ids, tokenizer.bos_id if tokenizer.add_bos else None)
    targets = [w[max(len(w) // 2, 1):] for w in cut]

    heard(f"outputs: A over {len(cut)} window(s) of up to {WINDOW} tokens")
    model, params = _load(a, adapter)
    run = _runner(model)
    kept = [_log_probs(model, params, w, run) for w in cut]
    del model, params, run
    gc.collect()

    heard("outputs: B over the same windows")
    model, params = _load(b)
    run = _runner(model)
    kl, same, nll_a, nll_b = [], [], [], []
    for w, y, logp_a in zip(cut, targets, kept):
        logp_b = _log_probs(model, params, w, run)
        kl.append(np.sum(np.exp(logp_a) * (logp_a - logp_b), axis=-1, dtype=np.float64))
        same.append(logp_a.argmax(-1) == logp_b.argmax(-1))
        rows = np.arange(len(y))
        nll_a.append(-logp_a[rows, y])
        nll_b.append(-logp_b[rows, y])
    del model, params, run, kept
    kl, same = np.concatenate(kl), np.concatenate(same)
    figures = {"tokens": int(kl.size), "windows": len(cut),
               "mean_kl": float(kl.mean()), "p99_kl": float(np.percentile(kl, 99)),
               "max_kl": float(kl.max()), "same_top1": float(100 * same.mean()),
               "ppl_a": float(np.exp(np.concatenate(nll_a).mean())),
               "ppl_b": float(np.exp(np.concatenate(nll_b).mean()))}
    return judge(figures, storage_type(a), storage_type(b))


def judge(figures: dict, a_type: str, b_type: str) -> Finding:
    """The outputs Finding for `figures` (compare_outputs') of a pair stored as a_type, b_type."""
    f = figures
    lines = [f"{f['tokens']} tokens scored in {f['windows']} window(s) of up to {WINDOW}",
             f"KL(A||B) per token: mean {f['mean_kl']:.6f}, 99% {f['p99_kl']:.6f}, "
             f"max {f['max_kl']:.6f} nats",
             f"same top-1 token: {f['same_top1']:.2f}%",
             f"perplexity: A {f['ppl_a']:.4f}, B {f['ppl_b']:.4f}"]
    ref = reference_for(a_type, b_type)
    f.update(types=[a_type, b_type])
    if f["mean_kl"] < SAME_MEAN_KL and f["max_kl"] < SAME_MAX_KL:
        return Finding("outputs", SAME, f"the same within float rounding (mean KL "
                       f"{f['mean_kl']:.2e} < {SAME_MEAN_KL:g})", lines, figures=f)
    if ref is None:
        return Finding("outputs", DIFFERENT,
                       f"B's outputs differ (mean KL {f['mean_kl']:.6f}) and both are "
                       f"{a_type}: no rounding explains it", lines,
                       cause=f"the outputs (mean KL {f['mean_kl']:.6f} between two {a_type} "
                             f"checkpoints)",
                       check_next="the block where they part (below), then the config's "
                                  "RoPE and norm fields", figures=f)
    kind, kld, top1 = ref
    bound = MARGIN * kld
    top1_floor = None if top1 is None else 100 - TOP1_MARGIN * (100 - top1)
    said = (f"{kind}'s reference (llama.cpp, LLaMA 3 8B as {AS_TYPE.get(kind, kind)}): mean KLD "
            f"{kld:.6f}" + ("" if top1 is None else f", same top-1 {top1:.3f}%") +
            f"; within {MARGIN:g}x: mean KL <= {bound:.6f}" +
            ("" if top1_floor is None else f", same top-1 >= {top1_floor:.2f}%") +
            f" ({REFERENCE_URL})")
    lines.append(said)
    f.update(reference={"type": kind, "mean_kl": kld, "same_top1": top1, "margin": MARGIN,
                        "url": REFERENCE_URL})
    if f["mean_kl"] <= bound and (top1_floor is None or f["same_top1"] >= top1_floor):
        return Finding("outputs", WITHIN, f"within what {kind} explains (mean KL "
                       f"{f['mean_kl']:.6f}, reference {kld:.6f})", lines, figures=f)
    return Finding("outputs", DIFFERENT,
                   f"beyond what {kind} explains (mean KL {f['mean_kl']:.6f} > {bound:.6f})",
                   lines, cause=f"the outputs (mean KL {f['mean_kl']:.6f}, {kind} explains "
                                f"{bound:.6f} at most)",
                   check_next="the block where they part (below), and the weights section's "
                              "worst tensor", figures=f)
