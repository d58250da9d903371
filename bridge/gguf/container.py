"""The GGUF container, read straight from the file: its key / value metadata and its tensors' names,
types, shapes and bytes (views of one memory map).

gguf's own GGUFReader reads the same, but it makes a numpy view of every string it meets: 2.2 s
for SmolLM2's 49k tokens and 49k merges, ~13 s for a 256k-token vocabulary, paid by every
command that opens the file. This reads them with `struct` from one memory map in a fiftieth of
that. gguf still supplies the type table (GGMLQuantizationType, GGML_QUANT_SIZES), dequantisation
and the writer; the tests read every file we write with GGUFReader as the independent check.

The layout (ggml's docs/gguf.md, versions 2 and 3, little-endian): magic "GGUF", u32 version, u64
tensor count, u64 key count; each key a string (u64 length + UTF-8), a u32 value type and the
value (an array: u32 item type, u64 count, the items); each tensor a string name, u32 dims, u64
each dim (the fastest-varying first), u32 type, u64 offset from the data section, which starts at
the next multiple of general.alignment (default 32) after the last tensor's entry.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import BridgeError

MAGIC, VERSIONS, DEFAULT_ALIGNMENT = b"GGUF", (2, 3), 32
STRING, ARRAY = 8, 9
# GGUF value type -> struct format (gguf's GGUFValueType numbering)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int              # the GGML type number (gguf.GGMLQuantizationType's value)
    shape: tuple[int, ...]    # numpy order, rows first (GGUF lists the fastest-varying dim first)
    start: int                # absolute byte offset of the data in the file
    n_bytes: int


@dataclass
class GGUFFile:
    """A GGUF file's version, metadata (key -> Python value: int, float, bool, str or a list)
    and tensor entries, in file order; `raw(t)` is a tensor's bytes.

    The file is opened once: the memory map it was parsed from stays open as long as this object
    (or a view of it) lives, and every tensor is a view of it - SmolLM2's 272 tensors cost no
    more opens of the file than its metadata did."""

    path: Path
    version: int
    fields: dict[str, object]
    tensors: list[TensorInfo]
    size: int
    data: mmap.mmap = field(repr=False)

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes, uint8 (n_bytes,), a read-only view of the file's memory map."""
        return np.frombuffer(self.data, np.uint8, count=t.n_bytes, offset=t.start)

    def release(self, t: TensorInfo, first: int = 0, stop: int | None = None) -> None:
        """Let go of the pages holding the tensor's bytes [first, stop) (default all of them) in
        this process, once they have been read into an array of its own: the file stays in the
        page cache, and a later read of them maps them again (madvise MADV_DONTNEED on a
        read-only map of a file changes no byte). Pages read through the map count in the
        process's memory (its RSS) until then: a load that turned LLaMA 3 8B's Q4_0 blocks into
        weights of its own held the 4.6 GiB file beside them (9.8 GiB at its peak). Whole pages
        only; a no-op where Python has no madvise."""
        stop = t.n_bytes if stop is None else stop
        page = mmap.PAGESIZE
        begin = -(-(t.start + first) // page) * page
        end = (t.start + stop) // page * page
        if end > begin and hasattr(self.data, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self.data.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def is_gguf(path: str | Path) -> bool:
    """True for a file that starts with GGUF's magic (whatever its name); False for anything
    else, a directory or a missing path included."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def read_gguf(path: str | Path) -> GGUFFile:
    """Read a GGUF file's metadata and tensor entries; BridgeError naming the file for one that is
    not a little-endian GGUF v2 / v3, is truncated or corrupt."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise BridgeError(f"{path}: not a file")
    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise BridgeError(f"{path}: not a GGUF file (no GGUF magic)")
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise BridgeError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return _parse(path, data, gguf)
    except (struct.error, KeyError, UnicodeDecodeError, ValueError, OverflowError) as e:
        data.close()
        raise BridgeError(f"{path}: truncated or corrupt GGUF file "
                          f"({type(e).__name__}: {str(e)[:100]})") from None
    except BridgeError:
        data.close()
        raise


def _strings(data: mmap.mmap, at: int, n: int) -> tuple[list[str], int] | None:
    """n length-prefixed strings from `at` (a GGUF string array) and the offset past them, where
    bridge/native's string_ends is built: the array's bytes with each 8-byte length zeroed,
    decoded at once and split at those runs of 8 zeros. None where it is not built, a string runs
    past the end, one is not UTF-8 or one holds a zero byte: the caller's loop then reads them
    (and says which fault)."""
    from .native import helpers

    walk = helpers().string_ends
    raw = np.frombuffer(data, np.uint8)
    ends = None if walk is None or n == 0 else walk(raw, at, n)
    if ends is None:
        return None
    region = raw[at:ends[-1]].copy()
    lengths_at = np.concatenate([[0], ends[:-1] - at])  # each length's first byte in region
    region[(lengths_at[:, None] + np.arange(8)).ravel()] = 0
    if np.count_nonzero(region == 0) != 8 * n:  # a zero byte within a string
        return None
    try:
        parts = region.tobytes().decode("utf-8").split("\0" * 8)
    except UnicodeDecodeError:
        return None
    return (parts[1:], int(ends[-1])) if len(parts) == n + 1 and not parts[0] else None


def _parse(path: Path, data: mmap.mmap, gguf) -> GGUFFile:
    size = len(data)
    (version,) = struct.unpack_from("<I", data, 4)
    if version & 0xFFFF == 0 and version >> 16 in VERSIONS:
        raise BridgeError(f"{path}: a big-endian GGUF file; only little-endian is read")
    if version not in VERSIONS:
        raise BridgeError(f"{path}: GGUF version {version}; versions 2 and 3 are read")
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    at, fields = 24, {}

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, at)
        if at + 8 + n > size:
            raise ValueError("a string runs past the end")
        return data[at + 8:at + 8 + n].decode("utf-8"), at + 8 + n

    def value(kind: int, at: int) -> tuple[object, int]:
        if kind == STRING:
            return string(at)
        if kind != ARRAY:
            fmt = "<" + SCALARS[kind]
            return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)
        item, n = struct.unpack_from("<IQ", data, at)
        at += 12
        if n > size - at:  # every item takes a byte at least
            raise ValueError(f"an array of {n} items runs past the end")
        if item in SCALARS:
            fmt = f"<{n}{SCALARS[item]}"
            return list(struct.unpack_from(fmt, data, at)), at + struct.calcsize(fmt)
        out = []
        if item == STRING and (found := _strings(data, at, n)) is not None:
            return found
        if item == STRING:  # a vocabulary: inlined, it is most of the reading
            for _ in range(n):
                length = int.from_bytes(data[at:at + 8], "little")
                out.append(data[at + 8:at + 8 + length].decode("utf-8"))
                at += 8 + length
            if at > size:
                raise ValueError("a string runs past the end")
            return out, at
        for _ in range(n):
            v, at = value(item, at)
            out.append(v)
        return out, at

    for _ in range(n_kv):
        key, at = string(at)
        (kind,) = struct.unpack_from("<I", data, at)
        fields[key], at = value(kind, at + 4)

    entries = []
    for _ in range(n_tensors):
        name, at = string(at)
        (n_dims,) = struct.unpack_from("<I", data, at)
        dims = struct.unpack_from(f"<{n_dims}Q", data, at + 4)
        type_id, offset = struct.unpack_from("<IQ", data, at + 4 + 8 * n_dims)
        at += 4 + 8 * n_dims + 12
        entries.append((name, type_id, tuple(int(d) for d in reversed(dims)), offset))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise BridgeError(f"{path}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-at // alignment) * alignment

    tensors = []
    for name, type_id, shape, offset in entries:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise BridgeError(f"{path}: tensor {name!r} has GGML type {type_id}, which gguf "
                              f"does not know") from None
        elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if shape and shape[-1] % block:
            raise BridgeError(f"{path}: tensor {name!r}: rows of {shape[-1]} are not whole "
                              f"blocks of {block}")
        start = data_start + offset
        tensors.append(TensorInfo(name, type_id, shape, start, elements // block * type_size))
        if start + tensors[-1].n_bytes > size:
            raise BridgeError(f"{path}: truncated: tensor {name!r} ends at byte "
                              f"{start + tensors[-1].n_bytes}, the file has {size}")
    return GGUFFile(path, version, fields, tensors, size, data)
