"""RoPE inverse frequencies, shared by both twins so they rotate by bit-identical angles.

Only the (H/2,) frequency vector lives here: angles are computed from the positions actually
passed in, so nothing of size max_seq_len is ever built.
"""

from __future__ import annotations

import numpy as np

from .config import RopeScaling
from .errors import BridgeError


# --8<-- [start:inv_freq]
def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None,
                  dtype=np.float32) -> np.ndarray:
    """Inverse frequencies theta^(-2i/H) for i < H/2, of shape (H/2,) in `dtype`.

    Computed in float64 and rounded once to float32 (the default), so JAX and torch (and any
    device) agree exactly; the parity report's float64 reference keeps them exact.
    With `scaling` (LLaMA 3.1 "llama3" type) low frequencies are divided by `factor` and the
    band between low_freq_factor and high_freq_factor is interpolated, as Meta's apply_scaling.
    """
    if head_dim % 2:
        raise BridgeError(f"rope: head_dim must be even (got {head_dim})")
    inv_freq = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq.astype(dtype)
# --8<-- [end:inv_freq]


def _llama3_scale(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    wavelen = 2 * np.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    # 0 at the long-wavelength edge of the band (fully scaled), 1 at the short edge (unscaled).
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return np.where(wavelen < high_freq_wavelen, inv_freq,
                    np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, interpolated))
