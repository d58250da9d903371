"""A directory of safetensors files: `model.safetensors`, or shards plus the Hugging Face index.

The safetensors library validates each file (header, dtypes, offsets, no holes) when it is
opened. Tensor data is then read with one plain file read into a fresh array, not through the
library's memory map: a mapped page counts in the process's resident memory next to the copy, so
reading through the map would hold every tensor twice. Writing is streamed: the library's Python
API serialises only a whole dict at once, so each file's header is laid out here from the shapes
and dtypes first, and each tensor is fetched, written and dropped in turn. Peak memory is one
tensor, whatever the model size.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
from safetensors import safe_open

from ..errors import BridgeError
from .base import check_inside

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes; the Hugging Face default "5GB"

_CODES = {
    np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float64): "F64", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16", np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}
DTYPE_OF_CODE = {code: dt for dt, code in _CODES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, read from a safetensors header."""

    file: Path
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int  # of the first data byte, from the start of the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# -- reading ---------------------------------------------------------------------------------------

def read_tensor_infos(directory: Path) -> dict[str, TensorInfo]:
    """Name -> TensorInfo for every tensor in `directory` (single file or index + shards)."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        files = _files_from_index(index_path)
    elif (directory / SINGLE_FILE).is_file():
        files = {directory / SINGLE_FILE: None}
    else:
        raise BridgeError(f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}")

    infos: dict[str, TensorInfo] = {}
    for file, expected_names in files.items():
        if not file.is_file():
            raise BridgeError(f"{index_path}: lists shard {file.name}, which does not exist")
        check_inside(file, directory)
        for name, info in _read_file_infos(file).items():
            if name in infos:
                raise BridgeError(f"{file}: tensor {name!r} is also in {infos[name].file.name}")
            infos[name] = info
        if expected_names is not None:
            in_file = {n for n, i in infos.items() if i.file == file}
            missing = sorted(set(expected_names) - in_file)
            if missing:
                raise BridgeError(f"{index_path}: says tensor {missing[0]!r} is in {file.name}, "
                                  f"but it is not")
    return infos


def _read_file_infos(file: Path) -> dict[str, TensorInfo]:
    try:
        with safe_open(str(file), framework="numpy") as f:  # the library's validation
            names = list(f.keys())
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
    except Exception as e:  # the library raises its own types for malformed files
        raise BridgeError(f"{file}: not a readable safetensors file ({e})") from None
    infos = {}
    for name in names:
        entry = header[name]
        if entry["dtype"] not in DTYPE_OF_CODE:
            raise BridgeError(f"{file}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        infos[name] = TensorInfo(file, tuple(entry["shape"]), DTYPE_OF_CODE[entry["dtype"]],
                                 8 + header_len + entry["data_offsets"][0])
    return infos


def _files_from_index(index_path: Path) -> dict[Path, list[str]]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise BridgeError(f"{index_path}: not a valid index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise BridgeError(f"{index_path}: weight_map must be an object")
    files: dict[Path, list[str]] = {}
    for name, filename in weight_map.items():
        if not isinstance(filename, str) or Path(filename).name != filename or filename in ("", ".", ".."):
            raise BridgeError(f"{index_path}: tensor {name!r} points outside the directory "
                              f"({filename!r})")
        files.setdefault(index_path.parent / filename, []).append(name)
    return files


class OpenFiles:
    """A checkpoint's safetensors files, each opened once - on its first read - and kept open as
    long as this object: read_tensor then reads by position from the open file, so loading a
    model of 272 tensors opens its file once, not 272 times."""

    def __init__(self):
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._fds)

    def fd(self, file: Path) -> int:
        with self._lock:
            if file not in self._fds:
                try:
                    self._fds[file] = os.open(file, os.O_RDONLY)
                except OSError as e:
                    raise BridgeError(f"{file}: cannot read ({e.strerror or e})") from None
            return self._fds[file]


def _close_all(fds: dict[Path, int]) -> None:
    for fd in fds.values():
        os.close(fd)


def read_tensor(info: TensorInfo, files: OpenFiles | None = None) -> np.ndarray:
    """Load one tensor into memory as a numpy array (bfloat16 as ml_dtypes.bfloat16); from the
    file `files` holds open when given, else the file is opened for this read."""
    count = math.prod(info.shape)
    dtype = info.dtype.newbyteorder("<")
    if files is None or not hasattr(os, "preadv"):
        array = np.fromfile(info.file, dtype=dtype, count=count, offset=info.offset)
    else:
        array = np.empty(count, dtype)
        buffer, done, fd = array.view(np.uint8), 0, files.fd(info.file)
        while done < buffer.size:  # a read returns at most ~2 GB on Linux
            n = os.preadv(fd, [buffer[done:]], info.offset + done)
            if n == 0:
                array = array[:done // dtype.itemsize]
                break
            done += n
    if array.size != count:
        raise BridgeError(f"{info.file}: truncated while reading a tensor of shape {info.shape}")
    return array.reshape(info.shape)


_SLICE_BLOCK_BYTES = 16 << 20  # rows read at a time when a slice takes part of each row


def read_tensor_slice(info: TensorInfo, index: tuple[slice, ...]) -> np.ndarray:
    """Only tensor[index] (a tuple of slices) of a 2-D tensor: its rows, read in blocks of
    about 16 MB whose wanted columns are kept, so memory holds the part plus one block (a
    memory map would keep every page it touched resident). Other tensors are read whole."""
    index = tuple(index) + (slice(None),) * (len(info.shape) - len(index))
    start, stop, step = index[0].indices(info.shape[0]) if info.shape else (0, 0, 1)
    if len(info.shape) != 2 or step != 1 or math.prod(info.shape) == 0:
        return read_tensor(info)[index]
    dtype, width = info.dtype.newbyteorder("<"), info.shape[1]
    columns = range(*index[1].indices(width))
    out = np.empty((max(0, stop - start), len(columns)), info.dtype)
    block = max(1, _SLICE_BLOCK_BYTES // (width * dtype.itemsize))
    with open(info.file, "rb") as f:
        for at in range(start, stop, block):
            n = min(block, stop - at)
            f.seek(info.offset + at * width * dtype.itemsize)
            rows = np.fromfile(f, dtype=dtype, count=n * width)
            if rows.size != n * width:
                raise BridgeError(f"{info.file}: truncated while reading a tensor of shape "
                                  f"{info.shape}")
            out[at - start:at - start + n] = rows.reshape(n, width)[:, index[1]]
    return out


# -- writing ---------------------------------------------------------------------------------------

def write_safetensors_dir(directory: Path, specs: dict[str, tuple[tuple[int, ...], np.dtype]],
                          fetch: Callable[[str], np.ndarray],
                          max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                          progress: Callable[[int], object] | None = None) -> list[str]:
    """Write tensors named in `specs` (name -> (shape, dtype)), fetching each one when its turn comes.

    One file when everything fits in `max_shard_size` bytes, otherwise shards
    `model-0000i-of-0000N.safetensors` and an index. A tensor larger than the limit gets a shard
    of its own. `progress(nbytes)` is called after each tensor. Returns the file names written.
    """
    if max_shard_size <= 0:
        raise BridgeError(f"max_shard_size: must be positive (got {max_shard_size})")
    shards = _plan_shards(specs, max_shard_size)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    order = [(shard_no, name) for shard_no, shard in enumerate(shards) for name in shard]
    writer = None
    for shard_no, name in order:
        if writer is None or writer.path.name != names[shard_no]:
            if writer is not None:
                writer.close()
            writer = _ShardWriter(directory / names[shard_no], {n: specs[n] for n in shards[shard_no]})
        array = fetch(name)
        writer.write(name, array)
        if progress is not None:
            progress(array.nbytes)
        del array
    if writer is not None:
        writer.close()
    if len(shards) > 1:
        total = sum(math.prod(shape) * np.dtype(dt).itemsize for shape, dt in specs.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, shard in zip(names, shards) for n in shard}}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _plan_shards(specs, max_shard_size: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in specs.items():
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


class _ShardWriter:
    """Writes one safetensors file: the header up front, then each tensor's bytes in order."""

    def __init__(self, path: Path, specs: dict[str, tuple[tuple[int, ...], np.dtype]]):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, (shape, dtype) in specs.items():
            dtype = np.dtype(dtype)
            if dtype not in _CODES:
                raise BridgeError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the format pads the header so tensor data is 8-aligned
        self.path, self.specs, self.pending = path, specs, list(specs)
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, array: np.ndarray) -> None:
        shape, dtype = self.specs[name]
        if name != self.pending[0]:
            raise RuntimeError(f"{self.path.name}: expected tensor '{self.pending[0]}', got {name!r}")
        if tuple(array.shape) != tuple(shape) or np.dtype(array.dtype) != np.dtype(dtype):
            raise BridgeError(f"tensor {name!r}: got {array.dtype}{tuple(array.shape)}, "
                              f"expected {np.dtype(dtype)}{tuple(shape)}")
        np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<")).tofile(self.file)
        self.pending.pop(0)

    def close(self) -> None:
        if self.pending:
            raise RuntimeError(f"{self.path.name}: tensors never written: {self.pending}")
        self.file.close()
