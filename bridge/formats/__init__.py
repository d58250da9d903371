"""On-disk checkpoint formats. Each reads and writes (canonical name, numpy array) pairs plus a
LlamaConfig; `open_checkpoint` detects which format a path holds."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import BridgeError
from .native import NativeCheckpoint, is_native, write_native

__all__ = ["NativeCheckpoint", "open_checkpoint", "write_native"]


def open_checkpoint(path: str | os.PathLike) -> NativeCheckpoint:
    """Open a checkpoint of any supported format for streaming reads (validated on open)."""
    path = Path(path)
    if not path.exists():
        raise BridgeError(f"{path}: no such file or directory")
    if is_native(path):
        return NativeCheckpoint(path)
    raise BridgeError(f"{path}: not a recognised checkpoint (supported: a native directory with "
                      f"config.json of LlamaConfig fields and model.safetensors)")
