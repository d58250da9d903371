"""The native format: `config.json` (LlamaConfig fields) + safetensors under canonical names.

Tensors are stored exactly as the torch twin's state_dict: canonical names, (out, in) layout,
interleaved-pair RoPE layout for wq/wk, dtype as given.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

import ml_dtypes
import numpy as np

from ..atomic import atomic_directory
from ..config import LlamaConfig
from ..errors import BridgeError
from ..tensors import canonical_shapes
from .safetensors_dir import (DEFAULT_MAX_SHARD_SIZE, TensorInfo, read_tensor, read_tensor_infos,
                              write_safetensors_dir)

CONFIG_FILE = "config.json"
_FLOAT_DTYPES = {np.dtype(t) for t in (np.float32, np.float16, np.float64, ml_dtypes.bfloat16)}


def is_native(path: str | os.PathLike) -> bool:
    """True when `path` is a directory whose config.json holds LlamaConfig fields."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        return False
    try:
        d = json.loads(config_path.read_text())
    except ValueError:
        return False
    return isinstance(d, dict) and {"dim", "n_layers", "n_heads"} <= set(d)


class NativeCheckpoint:
    """A native checkpoint opened for reading; tensors are loaded one at a time on request.

    Opening validates everything that can be checked without reading tensor data: config.json
    against LlamaConfig's rules, and every tensor's presence, shape and dtype against the config.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise BridgeError(f"{self.path}: not a checkpoint directory")
        self.config = read_config(self.path / CONFIG_FILE)
        self.infos: dict[str, TensorInfo] = read_tensor_infos(self.path)
        self.shapes = canonical_shapes(self.config)
        check_tensors(self.shapes, self.infos, where=self.path)

    def stored_dtype(self) -> str:
        """The dtype the tensors are stored in ('float32', 'bfloat16', 'float16'); 'float32' when
        they are mixed or wider, so that no tensor loses precision by default."""
        dtypes = {info.dtype.name for info in self.infos.values()}
        return dtypes.pop() if len(dtypes) == 1 and dtypes <= {"bfloat16", "float16"} else "float32"

    def tensor(self, name: str) -> np.ndarray:
        """One tensor by canonical name, as a numpy array."""
        if name not in self.infos:
            raise BridgeError(f"{self.path}: no tensor '{name}'")
        return read_tensor(name, self.infos[name])

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        """(canonical name, array) pairs in canonical order, one tensor in memory at a time."""
        for name in self.shapes:
            yield name, self.tensor(name)


def read_config(config_path: Path) -> LlamaConfig:
    try:
        d = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise BridgeError(f"{config_path}: missing") from None
    except ValueError as e:
        raise BridgeError(f"{config_path}: not valid JSON ({e})") from None
    try:
        return LlamaConfig.from_dict(d)
    except ValueError as e:
        raise BridgeError(f"{config_path}: {e}") from None


def check_tensors(expected: dict[str, tuple[int, ...]], infos: dict[str, TensorInfo],
                  where: Path) -> None:
    """Refuse a missing, extra, wrongly shaped or non-float tensor, naming the first one."""
    missing = [n for n in expected if n not in infos]
    if missing:
        raise BridgeError(f"{where}: tensor '{missing[0]}' is missing "
                          f"({len(missing)} missing in all)")
    extra = sorted(n for n in infos if n not in expected)
    if extra:
        raise BridgeError(f"{where}: unexpected tensor '{extra[0]}' for this config.json "
                          f"({len(extra)} unexpected in all)")
    for name, shape in expected.items():
        info = infos[name]
        if info.shape != shape:
            raise BridgeError(f"{info.file}: tensor '{name}' has shape {info.shape}, but config.json "
                              f"implies {shape}")
        if info.dtype not in _FLOAT_DTYPES:
            raise BridgeError(f"{info.file}: tensor '{name}' has dtype {info.dtype}, "
                              f"expected a floating type")


def write_native(path: str | os.PathLike, config: LlamaConfig,
                 specs: dict[str, tuple[tuple[int, ...], np.dtype]],
                 fetch: Callable[[str], np.ndarray], *,
                 max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False,
                 progress: Callable[[Iterable], Iterable] = iter) -> Path:
    """Write a native checkpoint atomically.

    `specs` maps every canonical name to (shape, numpy dtype); `fetch(name)` returns that tensor
    as a numpy array when it is written, so only one tensor need be in memory at a time. The
    names and shapes are checked against `config` before anything is written.
    """
    expected = canonical_shapes(config)
    for name in specs:
        if name not in expected:
            raise BridgeError(f"tensor '{name}': not a tensor of this config")
    for name, shape in expected.items():
        if name not in specs:
            raise BridgeError(f"tensor '{name}': missing")
        if tuple(specs[name][0]) != shape:
            raise BridgeError(f"tensor '{name}': shape {tuple(specs[name][0])}, config implies {shape}")
    ordered = {name: specs[name] for name in expected}
    with atomic_directory(path, overwrite=overwrite) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        write_safetensors_dir(tmp, ordered, fetch, max_shard_size=max_shard_size,
                              progress=progress)
    return Path(path)
