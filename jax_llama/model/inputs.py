"""A model's inputs on the host: bridge.inputs.check_inputs on JAX values, and the padded length
of a batch of rows.

Rows of different lengths (texts to classify or score, prompts) are padded to a length `bucket`,
a power of two, so that a jitted function compiles once per bucket rather than once per length,
and grouped by bridge.inputs.length_batches so that little of each batch is padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bridge.inputs import check_inputs as _check_inputs


def check_inputs(tokens, vocab_size: int, positions=None, attention_mask=None,
                 segment_ids=None) -> None:
    """bridge.inputs.check_inputs on JAX values: shapes always, token values only where they are
    on the host already (a numpy array, or a concrete array on the CPU): never a traced value,
    and never a copy off an accelerator."""
    _check_inputs(jnp.shape(tokens), jnp.issubdtype(jnp.result_type(tokens), jnp.integer),
                  vocab_size, ids=tokens if _on_host(tokens) else None,
                  positions_shape=None if positions is None else jnp.shape(positions),
                  mask_shape=None if attention_mask is None else jnp.shape(attention_mask),
                  segments_shape=None if segment_ids is None else jnp.shape(segment_ids),
                  segments_integer=segment_ids is None
                  or jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer))


def _on_host(x) -> bool:
    """Values readable without a transfer: numpy data, or a concrete array on the CPU."""
    if isinstance(x, (np.ndarray, np.generic, list, tuple)):
        return True
    return (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
            and all(device.platform == "cpu" for device in x.devices()))


_MIN_BUCKET = 16


def bucket(n: int, cap: int) -> int:
    """The power of two >= n (at least 16), but no more than cap: the padded length of a batch
    whose longest row is n, so that few lengths (and compilations) occur."""
    return min(max(_MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()), cap)
