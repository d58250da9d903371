"""The input rules both twins enforce before running a model, framework-neutral."""

from __future__ import annotations

import numpy as np

from .errors import BridgeError


def check_inputs(tokens_shape, is_integer: bool, vocab_size: int, *, ids: np.ndarray | None = None,
                 positions_shape=None, mask_shape=None) -> None:
    """Refuse malformed model inputs with one clear line naming the input.

    tokens must be (B, S) integers with B, S > 0; attention_mask (B, S); positions (S,) or (B, S).
    Token values are checked when `ids` (the tokens on the host) is given: a traced value has none.
    """
    shape = tuple(tokens_shape)
    if len(shape) != 2:
        raise BridgeError(f"tokens: expected shape (batch, seq_len), got {shape}")
    if 0 in shape:
        raise BridgeError(f"tokens: empty batch (shape {shape})")
    if not is_integer:
        raise BridgeError("tokens: expected integer ids")
    if mask_shape is not None and tuple(mask_shape) != shape:
        raise BridgeError(f"attention_mask: shape {tuple(mask_shape)} does not match tokens {shape}")
    if positions_shape is not None and tuple(positions_shape) not in (shape, shape[1:]):
        raise BridgeError(f"positions: shape {tuple(positions_shape)}, expected {shape} or {shape[1:]}")
    if ids is not None:
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise BridgeError(f"tokens: id {int(bad[0])} is outside the vocabulary [0, {vocab_size})"
                              f" ({bad.size} such ids)")
