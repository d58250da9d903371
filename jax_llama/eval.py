"""Sliding-window perplexity in JAX: tasks.evaluation plans the windows and writes the report;
this module scores a batch of windows with one jitted forward pass.

    report = evaluate(model, params, documents, seq_len=1024, stride=512, batch_size=8)

The scorer is jitted once per call of `evaluate`; jax.jit compiles it once per batch shape, and
tasks.evaluation pads batches to powers of two, so a run compiles a handful of times at most
(once when every document is longer than a window and its window count a multiple of the batch).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tasks.evaluation import DEFAULT_BATCH_SIZE, Document, WindowBatch, run_evaluation

from .model.llama import Llama


def token_log_probs(model: Llama, params, tokens_BS, targets_BS) -> tuple[jax.Array, jax.Array]:
    """(log_softmax of the float32 logits (B, S, V), each target's log-probability (B, S)) for
    tokens and targets (B, S) int32."""
    logits_BSV = model.apply({"params": params}, tokens_BS).astype(jnp.float32)
    logp_BSV = jax.nn.log_softmax(logits_BSV, axis=-1)
    return logp_BSV, jnp.take_along_axis(logp_BSV, targets_BS[..., None], axis=-1)[..., 0]


def window_nll(model: Llama, params, tokens_BS, targets_BS, weights_BS) -> jax.Array:
    """(B,) float32: the NLL (nats) of each row's weighted targets, from log_softmax of the
    float32 logits. tokens, targets (B, S) int32; weights (B, S) float32, 0 where not scored."""
    _, logp_BS = token_log_probs(model, params, tokens_BS, targets_BS)
    return -jnp.sum(logp_BS * weights_BS, axis=-1)


def evaluate(model: Llama, params, documents: Sequence[Document], seq_len: int, stride: int,
             batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = False) -> dict:
    """tasks.evaluation.run_evaluation with this model: per-file and overall nll_per_token,
    perplexity, tokens, bits_per_byte and seconds (a dict, ready for JSON)."""
    score = jax.jit(lambda p, t, y, w: window_nll(model, p, t, y, w))

    def score_batch(batch: WindowBatch) -> np.ndarray:
        return np.asarray(score(params, batch.tokens, batch.targets, batch.weights))
    return run_evaluation(score_batch, documents, seq_len, stride, batch_size, progress)
