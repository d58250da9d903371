"""What `llama-bridge inspect` reports about a checkpoint: its description, and a scan of every
tensor for NaN and Inf values, one tensor in memory at a time."""

from __future__ import annotations

import math

import numpy as np

from .errors import BridgeError
from .int4 import quantised_layouts
from .formats import Checkpoint
from .tensors import count_params

_SCAN_CHUNK = 1 << 24  # elements per NaN / Inf count: 16 MiB of booleans at a time


def describe(ckpt: Checkpoint) -> dict:
    """path, format, family (llama, mistral, qwen2, qwen3) and its deltas from LLaMA's decoder
    (LlamaConfig.deltas), config, parameters, tensors, files, dtypes, bytes, quantization, tensor
    types (as a GGUF file names them, with counts; else None), loads_as (what the inference
    commands make of its quantised tensors by default: bridge.int4.quantised_layouts; None for
    a float or int8 checkpoint), tokenizer (describe_tokenizer) and notes, as JSON values."""
    return {
        "path": str(ckpt.path),
        "format": ckpt.format,
        "family": ckpt.config.family,
        "deltas": ckpt.config.deltas,
        "config": ckpt.config.to_dict(),
        "parameters": count_params(ckpt.config),
        "tensors": len(ckpt.specs),
        "files": [str(f.relative_to(ckpt.path)) if f != ckpt.path else f.name for f in ckpt.files],
        "dtypes": sorted({dtype.name for _, dtype in ckpt.specs.values()}),
        "bytes": ckpt.nbytes,
        "quantization": None if ckpt.quantization is None else ckpt.quantization.to_dict(),
        "tensor_types": ckpt.tensor_types,
        "loads_as": quantised_layouts(ckpt) or None,
        "tokenizer": describe_tokenizer(ckpt),
        "notes": ckpt.notes + ([] if ckpt.quantization is None else [_quantized_note(ckpt)]),
    }


def describe_tokenizer(ckpt: Checkpoint) -> dict | None:
    """The checkpoint's tokenizer: kind, BOS / EOS tokens, whether an encoded text gets them and
    what decided that (bridge.tokenizer.bos_eos); None without a tokenizer, {"error": ...} for
    one that does not load. A GGUF file's own vocabulary comes from what opening it read."""
    from .tokenizer import find_tokenizer

    directory = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    if ckpt.format != "gguf" and not any(
            (directory / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return None
    try:
        tok = find_tokenizer(ckpt)
    except BridgeError as e:
        return {"error": str(e)}
    names = {i: name for name, i in tok.special_tokens.items()}
    return {"kind": tok.kind, "vocab_size": tok.vocab_size,
            "bos": names.get(tok.bos_id, tok.bos_id), "eos": names.get(tok.eos_id, tok.eos_id),
            "add_bos": tok.add_bos, "add_eos": tok.add_eos, "decided_by": tok.decided_by}


def _quantized_note(ckpt: Checkpoint) -> str:
    q = ckpt.quantization
    runs = "the jax-llama and torch-llama commands run it, conversions refuse it"
    if q.method == "int4":
        head = "; the tied LM head (the embedding) int8 rows" if ckpt.config.tie_embeddings else ""
        mins = [spec[1] for name, spec in ckpt.specs.items() if name.endswith("_min")]
        held = np.dtype(mins[0]).name if mins else "float16"  # float32: saved before 2026-12-05
        return (f"int4 weight-only: the projections 4-bit, a {held} scale and minimum per "
                f"{q.group_size} input columns{head}; {runs}")
    per = "output channel" if q.group_size is None else f"{q.group_size} input columns"
    return (f"{q.method} weight-only: the projections and the LM head int8 with a float32 "
            f"scale per {per}; {runs}")


def scan_non_finite(ckpt: Checkpoint, progress: bool = True) -> dict[str, dict[str, int]]:
    """{tensor name: {"nan": n, "inf": m}} for every tensor holding a NaN or an infinity; empty
    when all are finite. Reads one tensor at a time, so memory is bounded by the largest one."""
    from .progress import bar as progress_bar

    bad = {}
    with progress_bar(total=ckpt.nbytes, unit="B", desc="scanning", leave=False,
                      enabled=progress) as bar:
        for name, (shape, dtype) in ckpt.specs.items():
            nan, inf = _count_non_finite(ckpt.tensor(name))  # the tensor is freed on return
            if nan or inf:
                bad[name] = {"nan": nan, "inf": inf}
            bar.update(math.prod(shape) * dtype.itemsize)
    return bad


def _count_non_finite(array: np.ndarray) -> tuple[int, int]:
    """(NaN count, Inf count) of an array, in chunks so that the boolean temporaries stay small."""
    flat, nan, inf = array.reshape(-1), 0, 0
    for start in range(0, flat.size, _SCAN_CHUNK):
        chunk = flat[start:start + _SCAN_CHUNK]
        nan += int(np.count_nonzero(np.isnan(chunk)))
        inf += int(np.count_nonzero(np.isinf(chunk)))
    return nan, inf
