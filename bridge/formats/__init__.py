"""On-disk checkpoint formats. Each module reads a checkpoint as a LlamaConfig plus canonical
tensors (bridge.formats.base.Checkpoint) and writes one from (specs, fetch):

  native   directory: config.json (LlamaConfig fields) + safetensors, canonical names
  hf       directory: Hugging Face config.json + safetensors, HF names, q/k permuted for half-split RoPE
  meta     directory: params.json + consolidated.NN.pth (one per model-parallel rank)
  llama2c  file: llama2.c's .bin export (v0 / v1 headers) or its .pt training checkpoint
  gguf     file: llama.cpp's GGUF (float tensors, and every quantised type gguf dequantises;
           written in F32 ... Q8_0, Q4_0 ... Q5_1 and llama.cpp's K-quants), llama.cpp's names;
           its wing (container, tokenizer, quantiser) is the package bridge.gguf, which builds on
           this package's base and is named here, not imported

Detection looks only at file names and small headers; the format modules are imported when used.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..config import LlamaConfig
from ..errors import BridgeError
from ..locate import resolve_model
from .base import Checkpoint, Spec
from .hf import is_hf
from .native import NativeCheckpoint, is_native, read_json, write_native
from .safetensors_dir import DEFAULT_MAX_SHARD_SIZE

__all__ = ["FORMATS", "Checkpoint", "NativeCheckpoint", "detect_format", "open_checkpoint",
           "write_checkpoint", "write_native"]

FORMATS = ("native", "hf", "meta", "llama2c", "gguf")
# format -> ((module, reader class), (module, writer function)); a module relative to bridge
_MODULES = {
    "native": (("formats.native", "NativeCheckpoint"), ("formats.native", "write_native")),
    "hf": (("formats.hf", "HFCheckpoint"), ("formats.hf", "write_hf")),
    "meta": (("formats.meta", "MetaCheckpoint"), ("formats.meta", "write_meta")),
    "llama2c": (("formats.llama2c", "Llama2cCheckpoint"), ("formats.llama2c", "write_llama2c")),
    "gguf": (("gguf.read", "GGUFCheckpoint"), ("gguf.write", "write_gguf")),
}
_SHARDED = ("native", "hf")  # formats that honour max_shard_size


def _member(fmt: str, index: int):
    module, name = _MODULES[fmt][index]
    return getattr(importlib.import_module(f"..{module}", __package__), name)


def detect_format(path: str | os.PathLike) -> str:
    """Which format `path` holds, from file names and config keys; BridgeError if none. `path`
    may be a model's name (bridge.locate.resolve_model)."""
    return _detect(resolve_model(path))[0]


def _detect(path: str | os.PathLike) -> tuple[str, dict | None]:
    """(format, config.json's fields): detect_format, with the fields it read to tell a native
    directory from a Hugging Face one (None for the other formats), which the reader is given so
    that config.json is read once."""
    path = Path(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            fields = read_json(path / "config.json")  # an unreadable config.json is named as such
            if is_native(fields):
                return "native", fields
            if is_hf(fields):
                return "hf", fields
        if (path / "params.json").is_file() and any(path.glob("consolidated.*.pth")):
            return "meta", None
    elif path.suffix in (".bin", ".pt", ".pth"):
        return "llama2c", None
    elif path.suffix == ".gguf":
        return "gguf", None
    raise BridgeError(f"{path}: not a recognised checkpoint (expected a native or Hugging Face "
                      f"directory with config.json, a Meta directory with params.json and "
                      f"consolidated.*.pth, a llama2.c .bin / .pt file or a .gguf file)")


def open_checkpoint(path: str | os.PathLike, format: str | None = None) -> Checkpoint:
    """Open a checkpoint for streaming reads (validated on open); `format` None = detect. `path`
    may also be a model's name: a Hugging Face id in the hub cache, `ID:TAG` for one of its .gguf
    files, a .gguf an installed package ships (bridge.locate.resolve_model; a path that exists is
    taken as it is, at no cost)."""
    fields = None
    if format is not None and format not in FORMATS:
        raise BridgeError(f"format: unknown format {format!r}; known: {', '.join(FORMATS)}")
    path = resolve_model(path)
    if format is None:
        format, fields = _detect(path)
    reader = _member(format, 0)
    return reader(path) if fields is None else reader(path, fields)


def write_checkpoint(format: str, path: str | os.PathLike, config: LlamaConfig,
                     specs: dict[str, Spec], fetch: Callable[[str], np.ndarray], *,
                     max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False,
                     progress: Callable[[int], object] | None = None,
                     extra_files: Iterable[Path] = (), **options) -> Path:
    """Write canonical tensors (`specs`: name -> (shape, dtype); `fetch(name)` -> array) in
    `format` at `path`, atomically. `options` are format-specific (e.g. llama2c version)."""
    if format not in FORMATS:
        raise BridgeError(f"unknown format {format!r}; known: {', '.join(FORMATS)}", field="format")
    if format in _SHARDED:
        options["max_shard_size"] = max_shard_size
    return _member(format, 1)(path, config, specs, fetch, overwrite=overwrite, progress=progress,
                              extra_files=extra_files, **options)
