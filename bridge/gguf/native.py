"""Compiled helpers a twin may hand the GGUF reader for the passes a load makes over every byte.

The reader's own are numpy's, a dozen whole-array passes over each chunk of rows; a twin that has
compiled code at hand (the jax twin's kernel library, jax_llama.model.kernels.gguf_helpers) hands
over the same arithmetic done in one pass, for the length of its load:

    with using(helpers):           # Helpers(from_q4_blocks=..., int8_rows=...)
        ...                        # bridge.gguf.int4.from_q4_blocks, GGUFCheckpoint.int8_rows

Each helper writes the very bytes numpy's code would (tests/test_kernels.py holds them equal) and
is called on a chunk of rows from bridge.parallel's threads (ctypes lets go of Python's lock).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

import numpy as np


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


# the block types int8_rows reads: (weights, bytes) a block
INT8_ROWS_KINDS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q6_K": (256, 210), "Q4_K": (256, 144)}
_HELPERS: ContextVar[Helpers] = ContextVar("gguf_helpers", default=Helpers())


def helpers() -> Helpers:
    """The helpers handed over by an enclosing `using`, else none (numpy's code)."""
    return _HELPERS.get()


@contextmanager
def using(given: Helpers | None):
    """Within this block, the GGUF reader runs `given`'s helpers (None: numpy's code)."""
    token = _HELPERS.set(given or Helpers())
    try:
        yield
    finally:
        _HELPERS.reset(token)
