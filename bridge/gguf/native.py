"""The GGUF reader's passes over every byte of a quantised tensor, compiled or numpy's.

numpy's (bridge.gguf.int4, bridge.gguf.read, bridge.quantize) make a dozen whole-array passes over
each chunk of rows; bridge/native/loading.cc does the same arithmetic in one, where `jax-llama
kernels build` has built it (bridge.native). The reader asks `helpers()` for them: the compiled
ones where the library is built and not turned off (JAX_LLAMA_KERNELS=0), else none (numpy's
code). Each writes the very bytes numpy's code would (tests/test_native.py holds them equal) and is
called on a chunk of rows from bridge.parallel's threads (ctypes lets go of Python's lock).

    with using(Helpers()):        # numpy's code within the block, whatever is built
        ...
"""

from __future__ import annotations

import ctypes
import functools
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import native


@dataclass(frozen=True)
class Helpers:
    # (blocks (rows, G, size) uint8, packed (rows, G, 16) uint8, d (rows, G) float16, m (rows, G)
    # float16 or None) -> None: Q4_0 / Q4_1 blocks into bridge.int4's layout
    # (bridge.gguf.int4.from_q4_blocks's numbers)
    from_q4_blocks: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None], None] | None = None
    # (blocks (rows, bytes a row) uint8, kind (INT8_ROWS_KINDS), q (rows, I) int8, scale (rows, 1)
    # float32) -> (squared change, squared weights): int8 rows with one scale a row, as
    # bridge.quantize.quantize_weight makes them from the dequantised rows
    int8_rows: Callable[[np.ndarray, str, np.ndarray, np.ndarray], tuple[float, float]] | None = None
    # (blocks (rows, n, 144) uint8, packed (rows, I / 2) uint8, scale, min (rows, 8 n) float16)
    # -> (squared change, squared weights, all finite): Q4_K super-blocks into bridge.int4's
    # layout, the scales and minima rounded to float16 (bridge.gguf.int4.from_q4_k_blocks's)
    from_q4_k_blocks: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                               tuple[float, float, bool]] | None = None
    # (data (the file's bytes) uint8, at, n) -> ends (n,) int64, or None where a string runs past
    # the end: where each of the n length-prefixed strings from `at` ends (a GGUF string array)
    string_ends: Callable[[np.ndarray, int, int], np.ndarray | None] | None = None


# the block types int8_rows reads: (weights, bytes) a block
INT8_ROWS_KINDS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q6_K": (256, 210), "Q4_K": (256, 144)}
_CHOSEN: ContextVar[Helpers | None] = ContextVar("gguf_helpers", default=None)


def helpers() -> Helpers:
    """An enclosing `using`'s helpers, else the compiled ones where bridge.native's library is
    built and on, else none (numpy's code)."""
    chosen = _CHOSEN.get()
    if chosen is not None:
        return chosen
    lib = native.library()
    return Helpers() if lib is None else _compiled(lib)


@contextmanager
def using(given: Helpers):
    """Within this block, the GGUF reader runs `given`'s helpers (Helpers(): numpy's code)."""
    token = _CHOSEN.set(given)
    try:
        yield
    finally:
        _CHOSEN.reset(token)


@functools.cache
def _compiled(lib: ctypes.CDLL) -> Helpers:
    """loading.cc's functions as Helpers, each checking the buffers it is handed."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    repack = lib.bridge_from_q4_blocks
    repack.argtypes, repack.restype = [pointer, size, size, pointer, pointer, pointer], None
    rows = lib.bridge_int8_rows
    rows.argtypes = [pointer, size, size, ctypes.c_int, pointer, pointer, pointer]
    rows.restype = None
    q4_k = lib.bridge_from_q4_k_blocks
    q4_k.argtypes, q4_k.restype = [pointer, size, pointer, pointer, pointer, pointer], ctypes.c_int
    walk = lib.bridge_string_ends
    walk.argtypes, walk.restype = [pointer, size, size, size, pointer], ctypes.c_int

    def from_q4_blocks(blocks, packed, d, m) -> None:
        O, G, block = blocks.shape
        _check_c_order(blocks, packed, d, m)
        assert packed.shape == (O, G, 16) and d.shape == (O, G), (packed.shape, d.shape)
        repack(blocks.ctypes.data, O * G, block, packed.ctypes.data, d.ctypes.data,
               None if m is None else m.ctypes.data)

    def int8_rows(blocks, kind, q, scale) -> tuple[float, float]:
        (O, I), (weights, size) = q.shape, INT8_ROWS_KINDS[kind]
        _check_c_order(blocks, q, scale)
        assert blocks.shape == (O, I // weights * size) and scale.shape == (O, 1)
        sums = (ctypes.c_double * 2)()
        rows(blocks.ctypes.data, O, I, list(INT8_ROWS_KINDS).index(kind), q.ctypes.data,
             scale.ctypes.data, sums)
        return sums[0], sums[1]

    def from_q4_k_blocks(blocks, packed, scale, low) -> tuple[float, float, bool]:
        O, n, _ = blocks.shape
        _check_c_order(blocks, packed, scale, low)
        assert packed.shape == (O, n * 128) and scale.shape == low.shape == (O, n * 8)
        sums = (ctypes.c_double * 2)()
        finite = q4_k(blocks.ctypes.data, O * n, packed.ctypes.data, scale.ctypes.data,
                      low.ctypes.data, sums)
        return sums[0], sums[1], bool(finite)

    def string_ends(data, at, n) -> np.ndarray | None:
        assert data.dtype == np.uint8 and data.ndim == 1
        ends = np.empty(n, np.int64)
        return ends if walk(data.ctypes.data, data.size, at, n, ends.ctypes.data) == 0 else None

    return Helpers(from_q4_blocks=from_q4_blocks, int8_rows=int8_rows,
                   from_q4_k_blocks=from_q4_k_blocks, string_ends=string_ends)


def _check_c_order(*arrays) -> None:
    """The compiled helpers read and write whole C-ordered buffers."""
    for a in arrays:
        if a is not None and not a.flags.c_contiguous:
            raise ValueError(f"expected a C-ordered array, got strides {a.strides}")
