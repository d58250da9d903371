"""4-bit weights: the arithmetic both twins share (issue 57, its first step).

A weight W (out, in) is cut into groups of GROUP = 32 consecutive input columns; each group of
each row has a float32 scale d and a float32 minimum m, and each weight a 4-bit q in 0..15:

    d = (max - min) / 15,  m = min                    (d = 1 where a group is constant)
    q = round((W - m) / d)                            in 0..15, ties to even
    W ~ q * d + m                                     |error| <= d / 2 per weight, before rounding

This is llama.cpp's Q4_1 (ggml-quants.c, quantize_row_q4_1_ref), whose d and m are float16 there
and float32 here. It holds both of llama.cpp's plain 4-bit types exactly (bridge.gguf.int4):
Q4_1 (d * q + m) as it is, and Q4_0 (d * (q - 8)) with m = -8 d, since d * q and -8 d are exact in
float32 for a float16 d and their sum, d * (q - 8), is too.

Two q share a byte, along the inputs: byte j of row o holds q[o, 2j] in its low nibble and
q[o, 2j + 1] in its high one, so the packed weight is (out, in / 2) uint8, and (in / 2, out) in
the Flax layout, its transpose. Dequantised, q * d + m is computed in float32, then rounded to the
compute dtype. For a d read from a float16 file the product is exact (11 bits times 4), so the
result is rounded once, whatever the order of the operations (fused or not); for a d computed
here it may round twice, and the twins' sums may differ in their last bit.
"""

from __future__ import annotations

import numpy as np

from .errors import BridgeError

GROUP = 32            # inputs per scale and minimum
LEVELS = 15           # q in 0..LEVELS
MIN_SUFFIX = "_min"   # <name>_min beside <name> and <name>_scale


def check_int4(w_OI: np.ndarray, name: str = "weight") -> None:
    """Refuse a weight that is not 2-D with a multiple of GROUP input columns, naming it."""
    if w_OI.ndim != 2:
        raise BridgeError(f"tensor '{name}': expected a 2-D weight, got shape {w_OI.shape}")
    if w_OI.shape[1] % GROUP:
        raise BridgeError(f"tensor '{name}': {w_OI.shape[1]} input columns are not a multiple "
                          f"of the 4-bit group size {GROUP}")


def pack(q_OI: np.ndarray) -> np.ndarray:
    """q (out, in) in 0..15 -> (out, in / 2) uint8: q[o, 2j] | q[o, 2j + 1] << 4."""
    q = np.asarray(q_OI, np.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack(packed_OJ: np.ndarray) -> np.ndarray:
    """(out, in / 2) uint8 -> q (out, in) uint8 in 0..15."""
    packed = np.asarray(packed_OJ, np.uint8)
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def quantize_int4(w_OI: np.ndarray, name: str = "weight"
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W (out, in) float -> (packed (out, in / 2) uint8, d (out, in / 32) float32, m (out,
    in / 32) float32), computed in float32 (float64 for a float64 W)."""
    w = np.asarray(w_OI)
    check_int4(w, name)
    wide = np.float64 if w.dtype == np.float64 else np.float32
    O, I = w.shape
    blocks = w.astype(wide).reshape(O, I // GROUP, GROUP)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    d = np.where(high > low, (high - low) / LEVELS, 1).astype(np.float32)
    m = low.astype(np.float32)
    q = np.rint((blocks - m[..., None].astype(wide)) / d[..., None].astype(wide))
    q = np.clip(q, 0, LEVELS).astype(np.uint8).reshape(O, I)
    return pack(q), d, m


def dequantize_int4(packed_OJ: np.ndarray, d_OG: np.ndarray, m_OG: np.ndarray,
                    dtype=np.float32) -> np.ndarray:
    """The weight (out, in) in `dtype`: q * d + m in float32, rounded once to `dtype`."""
    q = unpack(packed_OJ)
    O, I = q.shape
    w = (q.reshape(O, I // GROUP, GROUP).astype(np.float32) * d_OG[..., None].astype(np.float32)
         + m_OG[..., None].astype(np.float32))
    return w.reshape(O, I).astype(dtype)


def int4_reader(checkpoint, get, config):
    """name -> the quantised form of each weight a 4-bit model quantises, None for the rest:
    (packed, scale, min) of each projection (the layers' wq ... w3 and an untied LM head): the
    checkpoint's own 4-bit blocks where it has them exactly (Checkpoint.int4_tensor), else
    quantize_int4 of get(name), one tensor at a time; and (q, scale) of a tied LM head, the token
    embedding, in int8 with one scale per row (bridge.quantize.quantize_weight), which the decode
    kernels read row by row. Input widths are checked first."""
    from .quantize import quantize_weight, quantized_names
    from .tensors import canonical_shapes

    shapes = canonical_shapes(config)
    names = set(quantized_names(config))
    for name in names - {TIED_HEAD}:
        if shapes[name][1] % GROUP:
            raise BridgeError(f"tensor '{name}': {shapes[name][1]} input columns are not a "
                              f"multiple of the 4-bit group size {GROUP}", field="int4")

    def read(name: str):
        if name not in names:
            return None
        if name == TIED_HEAD:
            return quantize_weight(get(name), None, name)
        held = checkpoint.int4_tensor(name)
        return held if held is not None else quantize_int4(get(name), name)
    return read


TIED_HEAD = "tok_embeddings.weight"  # in quantized_names only where the LM head is tied to it
