"""load / save for the torch twin: the state_dict already uses the canonical names, so the only
work is numpy <-> torch (bfloat16 included) and choosing a device."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import torch

from bridge.errors import BridgeError
from bridge.formats import open_checkpoint, write_native
from bridge.formats.torch_files import from_numpy as to_torch
from bridge.formats.torch_files import to_numpy

from .model import Llama, LlamaClassifier

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
                 torch.float16: np.dtype(np.float16)}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' picks CUDA, then MPS, then CPU; anything else is passed to torch.device."""
    if str(device) != "auto":
        try:
            return torch.device(device)
        except RuntimeError as e:
            raise BridgeError(f"device: {e}") from None
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_dtype(dtype) -> torch.dtype:
    """A torch dtype from a torch dtype or its name ('float32', 'bfloat16', 'float16')."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise BridgeError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


def load(path: str | os.PathLike, device: str | torch.device = "auto", dtype=None) -> Llama:
    """A Llama in eval mode from a checkpoint of any supported format.

    dtype None keeps the stored dtype (float32 when tensors are mixed). Tensors are read and moved
    to the device one at a time; the module is built on the meta device so nothing is allocated
    twice.
    """
    ckpt = open_checkpoint(path)
    device = resolve_device(device)
    dtype = resolve_dtype(ckpt.stored_dtype() if dtype is None else dtype)
    with torch.device("meta"):
        model = Llama(ckpt.config)
    state = {name: to_torch(array).to(device=device, dtype=dtype) for name, array in ckpt}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def save(path: str | os.PathLike, model: Llama, *, overwrite: bool = False,
         max_shard_size: int | None = None) -> None:
    """Write `model` as a native checkpoint at `path` (atomically; tensors in their own dtype)."""
    if not isinstance(model, Llama):
        raise BridgeError(f"model: expected a torch_llama.Llama, got {type(model).__name__}")
    state = model.state_dict()
    for name, t in state.items():
        if t.dtype not in _NUMPY_DTYPES:
            raise BridgeError(f"tensor '{name}': dtype {t.dtype} cannot be saved")
    specs = {name: (tuple(t.shape), _NUMPY_DTYPES[t.dtype]) for name, t in state.items()}
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    write_native(path, model.config, specs, lambda name: to_numpy(state[name]), overwrite=overwrite,
                 **kwargs)


def load_classifier(path: str | os.PathLike, device: str | torch.device = "auto", dtype=None):
    """(LlamaClassifier in eval mode, classifier.json's contents) from a classifier directory
    written by `jax-llama finetune`: the backbone as `load` reads it, the head from
    classifier.safetensors."""
    from bridge.classification import read_head

    backbone = load(path, device=device, dtype=dtype)
    meta, weight, bias = read_head(path, backbone.config)
    param = next(backbone.parameters())
    with torch.device("meta"):
        model = LlamaClassifier(backbone.config, len(meta["labels"]), float(meta.get("dropout", 0.0)))
    model.llama = backbone
    model.classifier.weight = torch.nn.Parameter(to_torch(weight).to(param.device, param.dtype))
    model.classifier.bias = torch.nn.Parameter(to_torch(bias).to(param.device, param.dtype))
    return model.eval(), meta
