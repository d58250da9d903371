"""The input rules both twins enforce before running a model, and how rows of token ids of
different lengths become padded batches of similar length; framework-neutral."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import BridgeError


def check_inputs(tokens_shape, is_integer: bool, vocab_size: int, *, ids: np.ndarray | None = None,
                 positions_shape=None, mask_shape=None, segments_shape=None,
                 segments_integer: bool = True) -> None:
    """Refuse malformed model inputs with one clear line naming the input.

    tokens must be (B, S) integers with B, S > 0; attention_mask (B, S); positions (S,) or (B, S);
    segment_ids (B, S) integers.
    Token values are checked when `ids` is given: the twins pass the ids when they are on the
    host already (numpy, a CPU tensor or array), never by copying them off a device - a traced
    value has none, and ids on an accelerator were put there by a caller who checked them (as
    both generate functions do, on the host, once per call) or sampled there by the model.
    """
    shape = tuple(tokens_shape)
    if len(shape) != 2:
        raise BridgeError(f"expected shape (batch, seq_len), got {shape}", field="tokens")
    if 0 in shape:
        raise BridgeError(f"empty batch (shape {shape})", field="tokens")
    if not is_integer:
        raise BridgeError("expected integer ids", field="tokens")
    if mask_shape is not None and tuple(mask_shape) != shape:
        raise BridgeError(f"shape {tuple(mask_shape)} does not match tokens {shape}",
                          field="attention_mask")
    if positions_shape is not None and tuple(positions_shape) not in (shape, shape[1:]):
        raise BridgeError(f"shape {tuple(positions_shape)}, expected {shape} or {shape[1:]}",
                          field="positions")
    if segments_shape is not None and tuple(segments_shape) != shape:
        raise BridgeError(f"shape {tuple(segments_shape)} does not match tokens {shape}",
                          field="segment_ids")
    if segments_shape is not None and not segments_integer:
        raise BridgeError("expected integer segment ids", field="segment_ids")
    if ids is not None:
        check_ids(ids, vocab_size)


def check_ids(ids, vocab_size: int, field: str = "tokens") -> None:
    """Every id of `ids` (an array or nested lists on the host) within [0, vocab_size)."""
    ids = np.asarray(ids)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise BridgeError(f"id {int(bad[0])} is outside the vocabulary [0, {vocab_size}) "
                          f"({bad.size} such ids)", field=field)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def pad_rows(rows: Sequence[Sequence[int]], length: int | None = None, *, side: str = "right",
             batch_size: int | None = None, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (B, length) int32, mask (B, length) bool, True on real tokens): each row padded
    with pad_id on `side` ("right", or "left" so that the last column holds every row's last
    token, as generation wants). length defaults to the longest row. Rows beyond len(rows) up to
    batch_size are filler: a single real token (pad_id) at the unpadded end, so that every row
    has a last real token to read."""
    B, S = batch_size or len(rows), length or max(map(len, rows))
    tokens = np.full((B, S), pad_id, np.int32)
    mask = np.zeros((B, S), bool)
    mask[len(rows):, 0 if side == "right" else -1] = True
    for i, ids in enumerate(rows):
        where = slice(0, len(ids)) if side == "right" else slice(S - len(ids), S)
        tokens[i, where], mask[i, where] = ids, True
    return tokens, mask


def length_batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator | None,
                   pool: int = 50) -> list[np.ndarray]:
    """Index batches of similar length. With rng (training): shuffle, sort within pools of
    `pool` batches, and shuffle the batch order; without (evaluation): sorted by length."""
    if rng is None:
        order = np.argsort(lengths, kind="stable")
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    order = rng.permutation(len(lengths))
    batches = []
    for start in range(0, len(order), batch_size * pool):
        chunk = order[start:start + batch_size * pool]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches
