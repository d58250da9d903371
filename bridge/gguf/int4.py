"""llama.cpp's plain 4-bit blocks (Q4_0, Q4_1) as bridge.int4's layout, exactly.

A block holds 32 consecutive weights of a row (ggml-common.h, block_q4_0 / block_q4_1):
    Q4_0: float16 d, 16 bytes qs                 w = d * (q - 8)
    Q4_1: float16 d, float16 m, 16 bytes qs      w = d * q + m
where q[j] = qs[j] & 0xF and q[j + 16] = qs[j] >> 4 for j < 16. bridge.int4 keeps q in input order,
two a byte, with a float16 d and m per block: Q4_1's as they are, Q4_0's m = -8 d (exact in
float16, a power of two times d, for any |d| up to 8188; a tensor with a larger d is refused).
"""

from __future__ import annotations

import numpy as np

from ..errors import BridgeError
from ..int4 import GROUP

# bytes per block: the float16 fields, then the 16 bytes of nibbles
BLOCK_BYTES = {"Q4_0": 2 + GROUP // 2, "Q4_1": 4 + GROUP // 2}


def from_q4_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int], name: str = "weight"
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The raw blocks of a Q4_0 or Q4_1 tensor of canonical `shape` (out, in) - uint8, one row of
    blocks per output row, as gguf reads them - -> (packed (out, in / 2) uint8, d (out, in / 32)
    float16, m (out, in / 32) float16) that bridge.int4.dequantize_int4 turns into llama.cpp's
    numbers, bit for bit."""
    if kind not in BLOCK_BYTES:
        raise BridgeError(f"tensor '{name}': {kind} is not a 4-bit type held exactly "
                          f"({', '.join(BLOCK_BYTES)})")
    O, I = shape
    if I % GROUP:
        raise BridgeError(f"tensor '{name}': {I} input columns are not a multiple of {GROUP}")
    size = BLOCK_BYTES[kind]
    raw = np.ascontiguousarray(raw, np.uint8)
    if raw.size != O * (I // GROUP) * size:
        raise BridgeError(f"tensor '{name}': {raw.size} bytes of {kind} blocks, its shape "
                          f"{shape} needs {O * (I // GROUP) * size}")
    blocks = raw.reshape(O, I // GROUP, size)
    fields = blocks[..., :size - GROUP // 2].copy().view(np.float16)
    d = np.ascontiguousarray(fields[..., 0])
    if kind == "Q4_1":
        m = np.ascontiguousarray(fields[..., 1])
    else:
        if np.any(np.abs(d) > 8188):
            raise BridgeError(f"tensor '{name}': a Q4_0 scale beyond 8188, whose minimum -8 d "
                              f"float16 cannot hold")
        m = np.float16(-8) * d
    # Byte j of a block holds its inputs j and j + 16; bridge.int4's byte k holds 2k and 2k + 1.
    # So the first 8 bytes pair the low nibbles of bytes 2k and 2k + 1, the last 8 their high
    # nibbles: byte for byte, without the weights spread out one a byte in between.
    qs = blocks[..., size - GROUP // 2:]
    even, odd = qs[..., 0::2], qs[..., 1::2]
    packed = np.concatenate([(even & 0xF) | (odd << 4), (even >> 4) | (odd & 0xF0)], axis=-1)
    return packed.reshape(O, I // 2), d, m
