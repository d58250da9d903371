"""llama.cpp's plain 4-bit blocks (Q4_0, Q4_1) as bridge.int4's layout, exactly.

A block holds 32 consecutive weights of a row (ggml-common.h, block_q4_0 / block_q4_1):
    Q4_0: float16 d, 16 bytes qs                 w = d * (q - 8)
    Q4_1: float16 d, float16 m, 16 bytes qs      w = d * q + m
where q[j] = qs[j] & 0xF and q[j + 16] = qs[j] >> 4 for j < 16. bridge.int4 keeps q in input order,
two a byte, with a float16 d and m per block: Q4_1's as they are; Q4_0's m is -8 d, which is not
made (None: the readers hold Q4_0's weights without minima, bridge.int4.minima_implied); it is
exact in float16 wherever it must be written (a power of two times d, for any |d| up to 8188; a
tensor with a larger d is refused).
"""

from __future__ import annotations

import sys

import numpy as np

from ..errors import BridgeError
from ..int4 import GROUP
from ..parallel import by_chunks
from ..resources import aligned_empty
from .native import helpers

# bytes per block: the float16 fields, then the 16 bytes of nibbles
BLOCK_BYTES = {"Q4_0": 2 + GROUP // 2, "Q4_1": 4 + GROUP // 2}
CHUNK_BYTES = 1 << 20  # blocks repacked at a time by from_q4_blocks


def from_q4_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int], name: str = "weight",
                   chunk_bytes: int = CHUNK_BYTES
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The raw blocks of a Q4_0 or Q4_1 tensor of canonical `shape` (out, in) - uint8, one row of
    blocks per output row, as gguf reads them - -> (packed (out, in / 2) uint8, d (out, in / 32)
    float16, m (out, in / 32) float16, or None for Q4_0's -8 d) that
    bridge.int4.dequantize_int4 turns into llama.cpp's numbers, bit for bit. Rows about
    chunk_bytes of blocks at a time, so that the temporaries stay in cache, the chunks on the CPU's
    cores (bridge.parallel), each by bridge/native's compiled pass where it is built
    (bridge.gguf.native), else by numpy. The outputs are aligned for XLA to hold as they are
    (bridge.resources.aligned_empty)."""
    if kind not in BLOCK_BYTES:
        raise BridgeError(f"tensor '{name}': {kind} is not a 4-bit type held exactly "
                          f"({', '.join(BLOCK_BYTES)})")
    O, I = shape
    if I % GROUP:
        raise BridgeError(f"tensor '{name}': {I} input columns are not a multiple of {GROUP}")
    size, G = BLOCK_BYTES[kind], I // GROUP
    raw = np.ascontiguousarray(raw, np.uint8)
    if raw.size != O * G * size:
        raise BridgeError(f"tensor '{name}': {raw.size} bytes of {kind} blocks, its shape "
                          f"{shape} needs {O * G * size}")
    blocks = raw.reshape(O, G, size)
    head = size - GROUP // 2  # the float16 fields' bytes
    packed = aligned_empty((O, G, GROUP // 2), np.uint8)
    d = aligned_empty((O, G), np.float16)
    m = aligned_empty((O, G), np.float16) if kind == "Q4_1" else None
    compiled = helpers().from_q4_blocks  # read here: the chunks run on other threads

    def repack(start: int, stop: int) -> bool:  # whether the rows' Q4_0 scales all hold -8 d
        b = blocks[start:stop]
        if compiled is not None:
            compiled(b, packed[start:stop], d[start:stop], None if m is None else m[start:stop])
        else:
            fields = b[..., :head].copy().view(np.float16)  # (rows, G, 1 or 2)
            d[start:stop] = fields[..., 0]
            if m is not None:
                m[start:stop] = fields[..., 1]
            _repacked(b[..., head:], out=packed[start:stop])
        if m is not None:
            return True
        # |d| beyond 8188 (and not NaN), on the bits: numpy's float16 arithmetic is slow
        magnitude = d[start:stop].view(np.uint16) & np.uint16(0x7FFF)
        return not np.any((magnitude > _F16_8188) & (magnitude <= _F16_INF))

    held = by_chunks(repack, O, chunk_bytes // max(1, G * size))
    if kind == "Q4_1":
        return packed.reshape(O, I // 2), d, m
    if not all(held):
        raise BridgeError(f"tensor '{name}': a Q4_0 scale beyond 8188, whose minimum -8 d "
                          f"float16 cannot hold")
    return packed.reshape(O, I // 2), d, None


# float16 bits: 8188 (the largest d whose -8 d float16 holds) and infinity
_F16_8188, _F16_INF = np.float16(8188).view(np.uint16), np.float16(np.inf).view(np.uint16)


# bits 4-7 of each 16-bit lane of a 64-bit word: its low byte's high nibble
_MIDDLE, _4 = np.uint64(0x00F000F000F000F0), np.uint64(4)


def _repacked(qs: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Runs of 2n bytes of nibbles (..., 2n) -> bridge.int4's bytes, written into `out` (the
    same shape) where given: a Q4_0 / Q4_1 block's 16 (n = 16 weights a half), or 32 of a Q4_K
    super-block's (n = 32). Byte j of a run holds its inputs j and j + n; bridge.int4's byte k
    holds 2k and 2k + 1. So byte k < n / 2 pairs the low nibbles of bytes 2k and 2k + 1, and byte
    n / 2 + k their high nibbles: in 64-bit words, each 16-bit lane (bytes 2k, 2k + 1: nibbles
    b_hi b_lo a_hi a_lo from the top) has its middle two nibbles swapped (b_hi a_hi b_lo a_lo: its
    low byte is byte k's value, its high byte byte n / 2 + k's), and the lanes' bytes are then
    split into the two halves. Little-endian words (every CPU numpy runs on here); else byte by
    byte, the same numbers."""
    out = np.empty(qs.shape, np.uint8) if out is None else out
    assert out.flags.c_contiguous  # written through a reshaped view of it
    if sys.byteorder != "little":
        even, odd = qs[..., 0::2], qs[..., 1::2]
        out[...] = np.concatenate([(even & 0xF) | (odd << 4), (even >> 4) | (odd & 0xF0)],
                                  axis=-1)
        return out
    words = np.ascontiguousarray(qs).view(np.uint64)  # (..., 2n / 8)
    swap = ((words >> _4) ^ words) & _MIDDLE  # b_lo ^ a_hi, where a_hi is
    both = (words ^ swap ^ (swap << _4)).view(np.uint8)
    half = qs.shape[-1] // 2
    out.reshape(*qs.shape[:-1], 2, half)[...] = both.reshape(
        *qs.shape[:-1], half, 2).swapaxes(-1, -2)
    return out


# -- Q4_K: its 4-bit q kept, its scales and minima rounded to float16 --------------------------------

Q4_K_BYTES = 144  # a super-block of 256 weights: float16 d and dmin, 12 bytes of scales, 128 of q


def from_q4_k_blocks(raw: np.ndarray, shape: tuple[int, int], name: str = "weight",
                     chunk_bytes: int = CHUNK_BYTES, scale_dtype=np.float16
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """The raw blocks of a Q4_K tensor of canonical `shape` (out, in) -> (packed (out, in / 2)
    uint8, scale, min (out, in / 32) in `scale_dtype`, the squared sums of the change and of the
    weights).

    A Q4_K super-block (ggml-common.h, block_q4_K) is eight groups of 32 weights, w = d sc_j q -
    dmin m_j, with 6-bit sc_j and m_j (unpacked by gguf's own Q4_K.get_scale_min) and each 64
    weights' 32 bytes holding the first group's q in their low nibbles and the second's in their
    high ones: bridge.int4's layout with scale d sc_j and minimum -dmin m_j. Those are exact in
    float32 (a float16 times six bits), where bridge.int4.dequantize_int4 gives llama.cpp's
    numbers bit for bit; rounded to float16 (the layout's scales) they change each weight by at
    most q |d sc_j| 2^-11 + |dmin m_j| 2^-11, and the sums say by how much in all. Rows about
    chunk_bytes of blocks at a time, on the CPU's cores (bridge.parallel), by the compiled helper
    where it is built (bridge.gguf.native; float16 scales), else by numpy."""
    O, I = shape
    if I % 256:
        raise BridgeError(f"tensor '{name}': {I} input columns are not whole Q4_K super-blocks "
                          f"of 256")
    n = I // 256
    raw = np.ascontiguousarray(raw, np.uint8)
    if raw.size != O * n * Q4_K_BYTES:
        raise BridgeError(f"tensor '{name}': {raw.size} bytes of Q4_K blocks, its shape {shape} "
                          f"needs {O * n * Q4_K_BYTES}")
    blocks = raw.reshape(O, n, Q4_K_BYTES)
    packed = aligned_empty((O, I // 2), np.uint8)
    scale, low = (aligned_empty((O, n * 8), scale_dtype) for _ in range(2))

    compiled = helpers().from_q4_k_blocks if scale_dtype == np.float16 else None

    def convert(start: int, stop: int) -> tuple[float, float, bool]:
        if compiled is not None:
            return compiled(blocks[start:stop], packed[start:stop], scale[start:stop],
                            low[start:stop])
        b = blocks[start:stop].reshape(-1, Q4_K_BYTES)
        d_exact, m_exact = (a.astype(np.float64) for a in q4_k_groups(b))  # (blocks, 8)
        m_exact = -m_exact
        qs = b[:, 16:].reshape(-1, 4, 32)  # 4 x 64 weights: the first 32's q in the low nibbles
        rows = stop - start
        _repacked(qs, out=packed[start:stop].reshape(-1, 4, 32))
        d_held, m_held = d_exact.astype(scale_dtype), m_exact.astype(scale_dtype)
        scale[start:stop], low[start:stop] = (a.reshape(rows, n * 8) for a in (d_held, m_held))
        # each group's sums of q and q^2 give both squared sums: sum (q d + m)^2 over a group is
        # d^2 S2 + 2 d m S1 + 32 m^2, and the change's likewise with d and m the rounding's
        s1, s2 = _group_sums(qs)

        def squares(dg, mg):
            return float(np.sum(dg * dg * s2 + 2 * dg * mg * s1 + 32 * mg * mg))

        dd = d_held.astype(np.float64) - d_exact
        dm = m_held.astype(np.float64) - m_exact
        finite = bool(np.all(np.isfinite(d_held)) and np.all(np.isfinite(m_held)))
        return (squares(dd, dm) if finite else 0.0), squares(d_exact, m_exact), finite

    sums = by_chunks(convert, O, chunk_bytes // max(1, n * Q4_K_BYTES))
    if not all(finite for _, _, finite in sums):
        raise BridgeError(f"tensor '{name}': a Q4_K scale or minimum beyond float16's range, or "
                          f"not finite")
    return packed, scale, low, sum(c for c, _, _ in sums), sum(w for _, w, _ in sums)


def q4_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K super-blocks (n, 144) uint8 -> each group's scale d sc_j and the minimum dmin m_j it
    subtracts, (n, 8) float32, exact (a float16 times six bits): w = d sc_j q - dmin m_j. The 6-bit
    sc_j and m_j are unpacked by gguf's own Q4_K.get_scale_min."""
    import gguf

    d_dmin = blocks[:, :4].copy().view(np.float16).astype(np.float32)  # (n, 2)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    return d_dmin[:, :1] * sc.astype(np.float32), d_dmin[:, 1:] * m.astype(np.float32)


def _group_sums(qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of 32 bytes of Q4_K nibbles (..., 32), each holding a group's q in its low nibbles and
    the next group's in its high ones -> the groups' sums of q and of q^2 (-1, 8) in float64,
    groups in order. Summed down the columns of the runs' transpose: numpy adds 32 long rows
    where summing along each run of 32 would cost a loop a group (3x as long)."""
    runs_T = np.ascontiguousarray(qs.reshape(-1, 32).T)  # (32, runs)
    sums = []
    for q in (runs_T & np.uint8(0xF), runs_T >> np.uint8(4)):  # q <= 15: q^2 fits a byte
        first = q.sum(axis=0, dtype=np.uint16)
        sums.append((first, np.multiply(q, q, out=q).sum(axis=0, dtype=np.uint16)))
    (s1_low, s2_low), (s1_high, s2_high) = sums
    s1 = np.stack([s1_low, s1_high], axis=-1).reshape(-1, 8).astype(np.float64)
    s2 = np.stack([s2_low, s2_high], axis=-1).reshape(-1, 8).astype(np.float64)
    return s1, s2
