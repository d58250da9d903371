"""The independent references a report may add beside the twins (--reference): transformers'
LlamaForCausalLM, through the same forward figures as the torch twin, and llama.cpp, its logits
and greedy tokens against the float64 answer and the JAX twin."""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

import numpy as np

from bridge.dtypes import dtype_name
from bridge.sampling import Sampler

from .forward import HF_SUBLAYERS, _capture, _capture_parts
from .judgement import NEAR_TIE, _check, _f64

REFERENCES = ("transformers", "llama.cpp")
# llama.cpp's logits (--reference llama.cpp) against the float64 answer (JAX's without it),
# relative to their scale, per report dtype. It is not float32 inside: its KV cache is F16 (11
# bits of mantissa) and a BF16 file's products take BF16 activations. Measured on SmolLM2-135M
# (30 layers, logits up to ~36): F32 1.2e-3, BF16 0.12 against JAX's bfloat16 run; the
# bounds sit ~8x and ~2x above, far below a wrong RoPE or q/k row order (O(1)). See
# results/parity/parity_memory.md.
LLAMA_CPP_LOGITS = {"float32": 1e-2, "bfloat16": 0.25}


def _import_error(module: str) -> str | None:
    """Why `module` cannot be imported, or None when it can."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        return str(e)
    return None


def _transformers_forward(path, dtype: str, tokens, mask):
    """(hidden, logits, parts) as forward._torch_forward gives them, for
    transformers.LlamaForCausalLM, from the checkpoint as the bridge's HF writer
    writes it (a temporary directory). Hooks on the decoder layers rather than
    output_hidden_states, whose last entry has the final norm applied."""
    import torch
    import transformers

    from bridge.convert import convert

    with tempfile.TemporaryDirectory(prefix="llama-bridge-parity-") as tmp:
        # float32 on disk, which every transformers version loads as float32; then the parameters
        # (not RoPE's inv_freq buffer) are rounded to `dtype` to nearest even, as the twins do.
        hf_dir = convert(path, Path(tmp) / "hf", to="hf", dtype="float32", progress=False)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()  # the family's class
    for p in hf.parameters():
        p.data = p.data.to(getattr(torch, dtype_name(dtype)))
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)  # real tokens counted, as the twins do
    with torch.inference_mode(), _capture(hf.model.layers) as hidden, \
            _capture_parts(hf.model.layers, HF_SUBLAYERS) as parts:
        logits = hf(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                    attention_mask=torch.as_tensor(mask, dtype=torch.long),
                    position_ids=torch.as_tensor(positions, dtype=torch.long)).logits
    return hidden, _f64(logits), parts


def _llama_cpp_checks(path, dtype: str, model, params, tokens, real, n_new: int, jax_logits,
                      truth) -> list[dict]:
    """llama.cpp (llama_twins.llama_cpp_reference) on each row's real tokens: its logits against
    the float64 answer (or JAX's) within LLAMA_CPP_LOGITS[dtype], and its greedy continuation
    against JAX's, a first difference passing only at a near-tie of JAX's own logits."""
    from .. import llama_cpp_reference

    prompts = [row[keep].tolist() for row, keep in zip(tokens, real)]
    theirs, greedy = llama_cpp_reference.run(path, dtype, prompts, n_new)
    ours = jax_logits[real]
    exact = truth.logits[real] if truth is not None else ours
    theirs = np.concatenate(theirs).astype(np.float64)
    scale = float(np.abs(exact).max())
    bound = LLAMA_CPP_LOGITS[dtype]
    off = float(np.abs(theirs - exact).max()) / scale
    errors = None if truth is None else {"JAX": float(np.abs(ours - exact).max()) / scale,
                                         "llama.cpp": off}
    against = "float64" if truth is not None else "JAX"
    logits = dict(_check("logits", "llama.cpp vs JAX", float(np.abs(theirs - ours).max()) / scale,
                         bound, off <= bound,
                         detail=f"llama.cpp's own bound ({dtype_name(dtype)} GGUF, F16 KV "
                                f"cache), on its error against {against}: {off:.2e}; it gives "
                                f"logits only, so no block or part can be named",
                         culprit=None if off <= bound else
                         "llama.cpp" if truth is not None else "llama.cpp or JAX"),
                  kind="llama.cpp", errors=errors, margin=bound / off if off > 0 else None)
    rows = [logits]
    if n_new > 0:
        import jax_llama  # noqa: F401  (the JAX twin's greedy run, as in the twins' check)
        from jax_llama.inference.generate import generate as jax_generate

        mine = jax_generate(model, params, prompts, n_new, Sampler(), ()).tokens
        allowed, notes, ok, firsts = NEAR_TIE * bound * scale, [], True, []
        for i, (prompt, a, b) in enumerate(zip(prompts, mine, greedy)):
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if k is None:
                continue
            firsts.append(k)
            prefix = np.asarray([prompt + list(a[:k])], np.int32)
            last = _f64(model.apply({"params": params}, prefix))[0, -1, [a[k], b[k]]]
            gap = abs(last[0] - last[1])
            ok = ok and gap <= allowed
            notes.append(f"row {i} at token {k}: JAX {a[k]} vs llama.cpp {b[k]}, JAX's logit gap "
                         f"{gap:.2e}")
        detail = ("; ".join(notes) + f" (a near-tie if the gap <= {allowed:.1e})" if notes
                  else f"all {len(prompts)} rows agree on {n_new} tokens")
        rows.append(_check("greedy tokens, first difference", "llama.cpp vs JAX",
                           min(firsts) if firsts else None, "near-tie", ok=ok, detail=detail,
                           culprit=None if ok else
                           "llama.cpp" if truth is not None else "llama.cpp or JAX"))
    return rows
