"""The native format: `config.json` (LlamaConfig fields) + safetensors under canonical names.

Tensors are stored exactly as the torch twin's state_dict: canonical names, (out, in) layout,
interleaved-pair RoPE layout for wq/wk, dtype as given.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..atomic import atomic_directory, copy_files
from ..config import LlamaConfig
from ..errors import BridgeError
from ..quantize import Quantization
from .base import (Checkpoint, Spec, check_inside, check_specs, find_extra_files,
                   payload_bytes)
from .safetensors_dir import (DEFAULT_MAX_SHARD_SIZE, OpenFiles, read_tensor, read_tensor_infos,
                              read_tensor_slice, write_safetensors_dir)

CONFIG_FILE = "config.json"


def read_json(path: Path) -> dict:
    """A JSON object from `path`, or a BridgeError naming the file."""
    if path.is_file():
        check_inside(path, path.parent)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise BridgeError(f"{path}: missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BridgeError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise BridgeError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def is_native(fields: dict) -> bool:
    """True when a config.json's `fields` are LlamaConfig's: a native checkpoint's."""
    return {"dim", "n_layers", "n_heads"} <= set(fields)


class NativeCheckpoint(Checkpoint):
    """A native directory. `fields`: its config.json's, when the caller has read them already
    (format detection does), so that the file is read once."""

    format = "native"

    def __init__(self, path: str | os.PathLike, fields: dict | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise BridgeError(f"{self.path}: not a checkpoint directory")
        config_path = self.path / CONFIG_FILE
        fields = dict(read_json(config_path) if fields is None else fields)
        quantization = fields.pop("quantization", None)
        try:
            self.config = LlamaConfig.from_dict(fields)
            if quantization is not None:
                self.quantization = Quantization.from_dict(quantization, str(config_path))
        except BridgeError as e:
            raise BridgeError(f"{config_path}: {e}") from None
        self.infos = read_tensor_infos(self.path)
        self._open_files = OpenFiles()
        try:
            self.specs = check_specs(self.config,
                                     {n: (i.shape, i.dtype) for n, i in self.infos.items()},
                                     self.path, source="config.json",
                                     quantization=self.quantization)
        except BridgeError as e:
            if e.field is None:
                raise
            raise BridgeError(f"{config_path}: quantization.{e.field}: {e.message}") from None
        self.files = sorted({info.file for info in self.infos.values()})
        self.notes = []
        self.extra_files = find_extra_files(self.path)

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.infos:
            raise BridgeError(f"{self.path}: no tensor '{name}'")
        return read_tensor(self.infos[name], self._open_files)

    def tensor_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if name not in self.infos:
            raise BridgeError(f"{self.path}: no tensor '{name}'")
        return read_tensor_slice(self.infos[name], index)


def write_native(path: str | os.PathLike, config: LlamaConfig, specs: dict[str, Spec],
                 fetch: Callable[[str], np.ndarray], *,
                 max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False,
                 progress: Callable[[int], object] | None = None,
                 extra_files: Iterable[Path] = (),
                 write_extra: Callable[[Path], object] | None = None,
                 quantization: Quantization | None = None) -> Path:
    """Write a native checkpoint atomically.

    `specs` maps every canonical name to (shape, numpy dtype); `fetch(name)` returns that tensor
    as a numpy array when it is written, so only one tensor need be in memory at a time. The
    names and shapes are checked against `config` before anything is written; `extra_files`
    (tokenizer files) are copied alongside, and `write_extra(directory)` may add more files (a
    classification head) inside the same atomic write. `quantization`: the projections in
    `specs` are int8 with their scales (bridge.quantize), declared in config.json.
    """
    ordered = check_specs(config, specs, "tensors to write", quantization=quantization)
    fields = config.to_dict()
    if quantization is not None:
        fields["quantization"] = quantization.to_dict()
    extra_files = list(extra_files)
    with atomic_directory(path, overwrite=overwrite,
                          needed_bytes=payload_bytes(ordered, extra_files)) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(fields, indent=2) + "\n")
        write_safetensors_dir(tmp, ordered, fetch, max_shard_size=max_shard_size, progress=progress)
        copy_files(extra_files, tmp)
        if write_extra is not None:
            write_extra(tmp)
    return Path(path)
