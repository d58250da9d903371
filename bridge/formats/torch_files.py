"""Reading torch.save files without running code, and torch <-> numpy without a float32 detour.

Shared by the Meta (.pth) and llama2.c (.pt) readers. torch is imported inside the functions so
that the bridge package stays importable without it.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import BridgeError


def load_weights_only(path: Path):
    """torch.load with weights_only=True and mmap=True: tensors, dicts, lists and numbers only;
    a pickle that would call anything is refused. One-line BridgeError naming `path` otherwise."""
    import torch

    if not zipfile.is_zipfile(path):  # the format torch.save writes since 1.6, and what mmap needs
        raise BridgeError(f"{path}: not a plain tensor checkpoint (not a torch.save zip archive)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # UnpicklingError for refused globals, RuntimeError for a broken zip
        raise BridgeError(f"{path}: not a plain tensor checkpoint ({_reason(e)})") from None


def _reason(error: Exception) -> str:
    """The informative sentence of torch.load's long message: not its advice to retry with
    weights_only=False (which would run the pickle), nor C++ source locations."""
    text = str(error).split("WeightsUnpickler error: ")[-1]
    text = re.sub(r"^\s*\[enforce fail at [^\]]*\][\s.]*", "", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [type(error).__name__]
    line = next((line for line in lines if "Unsupported global" in line), lines[0])
    return line.split(". ")[0][:200]


def to_numpy(tensor) -> np.ndarray:
    """A numpy array of a torch tensor (moved to the CPU; a view when it already is there);
    torch.bfloat16 becomes ml_dtypes.bfloat16 bit for bit."""
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    try:
        return tensor.numpy()
    except TypeError:
        raise BridgeError(f"tensor dtype {tensor.dtype} has no numpy equivalent") from None


def from_numpy(array: np.ndarray):
    """A torch tensor sharing `array`'s memory; ml_dtypes.bfloat16 becomes torch.bfloat16."""
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes (unlike ==, NaN matches NaN and -0.0 does not match 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return np.array_equal(*(np.ascontiguousarray(x).view(np.uint8) for x in (a, b)))
