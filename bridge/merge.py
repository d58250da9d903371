"""A LoRA adapter as a checkpoint tool: merged into its base as the base streams to a new
checkpoint (`llama-bridge merge-lora`), and described on its own (`llama-bridge inspect`).

Merging adds scale * B @ A to each adapted projection as it passes through convert's streaming
writer, so memory stays about one tensor (plus the adapter, which is small), the output is written
atomically, and the base's tokenizer files travel along as in a conversion.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from .convert import stream_checkpoint
from .errors import BridgeError
from .formats import Checkpoint
from .formats.safetensors_dir import DEFAULT_MAX_SHARD_SIZE
from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, base_name, read_peft


def merge_lora(base: str | os.PathLike, adapter: str | os.PathLike, dst: str | os.PathLike,
               to: str = "native", *, from_format: str | None = None, dtype: str | None = None,
               max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, force: bool = False,
               progress: bool = True, **options) -> Path:
    """Write the checkpoint at `base` (any format the bridge reads) with the PEFT LoRA adapter
    directory `adapter` merged in (W + alpha / r * B @ A), as `to` at `dst`. The adapter is read
    against the base's config and refused, naming the tensor, when it does not fit it.

    Each adapted weight is merged in float32 (float64 when stored so) and rounded once, to its
    stored dtype or to `dtype`. The other arguments are convert's. Returns `dst`."""

    def prepare(ckpt: Checkpoint):
        lora = read_peft(adapter, ckpt.config)
        adapted = {base_name(name) for name in lora.tensors}

        def add_update(name: str, weight: np.ndarray) -> np.ndarray:
            if name not in adapted:
                return weight
            if dtype is not None:  # merge wide, so that the cast to dtype is the only rounding
                weight = weight.astype(np.float64 if weight.dtype == np.float64 else np.float32)
            return lora.merged(name, weight)
        return add_update

    return stream_checkpoint(base, dst, to, from_format=from_format, dtype=dtype,
                             max_shard_size=max_shard_size, force=force, progress=progress,
                             inputs=(adapter,), prepare=prepare, **options)


_LAYER = re.compile(r"\blayers\.(\d+)\.")


def describe_adapter(path: str | os.PathLike) -> dict:
    """What a PEFT LoRA adapter directory holds, without a base model and without reading its
    tensor data: path, rank, alpha, scale, target_modules, modules_to_save (modules trained
    whole, e.g. the embedding table), layers, tensors, parameters, dtypes, base_model. (Whether it fits a base is checked by read_peft, which needs the base's config.)"""
    from safetensors import safe_open

    path = Path(path)
    config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    try:
        d = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BridgeError(f"{config_file}: cannot read it as JSON ({e})") from None
    if not isinstance(d, dict) or d.get("peft_type") != "LORA":
        raise BridgeError(f"{config_file}: peft_type "
                          f"{d.get('peft_type') if isinstance(d, dict) else None!r}; only LORA "
                          f"adapters are supported")
    try:
        with safe_open(str(weights_file), framework="numpy") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            shapes = {name: s.get_shape() for name, s in slices.items()}
            dtypes = sorted({s.get_dtype() for s in slices.values()})
    except Exception as e:  # a missing file, or safetensors' own error types for a damaged one
        raise BridgeError(f"{weights_file}: cannot read it as safetensors ({e})") from None
    rank, alpha = d.get("r"), d.get("lora_alpha")
    numbers = all(isinstance(x, (int, float)) and x > 0 for x in (rank, alpha))
    return {
        "path": str(path), "format": "peft-lora", "rank": rank, "alpha": alpha,
        "scale": alpha / rank if numbers else None,
        "target_modules": d.get("target_modules"), "modules_to_save": d.get("modules_to_save"),
        "layers": len({m.group(1) for name in shapes if (m := _LAYER.search(name))}),
        "tensors": len(shapes),
        "parameters": sum(int(np.prod(shape)) for shape in shapes.values()),
        "dtypes": dtypes, "base_model": d.get("base_model_name_or_path"),
    }
