"""Canonical tensor names and shapes (Meta's names, torch layout `(out_features, in_features)`).

This table is the contract between the twins and every on-disk format: the torch twin's
`state_dict()` has exactly these keys, the JAX adapter maps them to Flax params, and format
modules map them to their own names.
"""

from __future__ import annotations

import math
from .config import LlamaConfig

# Per-layer tensors as (name suffix, shape builder); w1 is the gate, w3 the up, w2 the down projection.
_LAYER_SHAPES = {
    "attention_norm.weight": lambda c: (c.dim,),
    "attention.wq.weight": lambda c: (c.n_heads * c.head_dim, c.dim),
    "attention.wk.weight": lambda c: (c.n_kv_heads * c.head_dim, c.dim),
    "attention.wv.weight": lambda c: (c.n_kv_heads * c.head_dim, c.dim),
    "attention.wo.weight": lambda c: (c.dim, c.n_heads * c.head_dim),
    "ffn_norm.weight": lambda c: (c.dim,),
    "feed_forward.w1.weight": lambda c: (c.ffn_dim, c.dim),
    "feed_forward.w2.weight": lambda c: (c.dim, c.ffn_dim),
    "feed_forward.w3.weight": lambda c: (c.ffn_dim, c.dim),
}
LAYER_SUFFIXES = tuple(_LAYER_SHAPES)
# Tensors only a config with the delta has: (name suffix, shape builder), after attention.wv.
_DELTA_SHAPES = {
    "qkv_bias": {"attention.wq.bias": lambda c: (c.n_heads * c.head_dim,),
                 "attention.wk.bias": lambda c: (c.n_kv_heads * c.head_dim,),
                 "attention.wv.bias": lambda c: (c.n_kv_heads * c.head_dim,)},
    "qk_norm": {"attention.q_norm.weight": lambda c: (c.head_dim,),
                "attention.k_norm.weight": lambda c: (c.head_dim,)},
}


def layer_shapes(config: LlamaConfig) -> dict:
    """(name suffix, shape builder) of each tensor of one layer of `config`, in a stable order."""
    shapes = dict(_LAYER_SHAPES)
    for delta in config.deltas:
        shapes.update(_DELTA_SHAPES.get(delta, {}))  # sliding_window: no tensor of its own
    return shapes


def canonical_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` holds, in a stable order, with its shape."""
    shapes = {"tok_embeddings.weight": (config.vocab_size, config.dim)}
    for i in range(config.n_layers):
        for suffix, shape in layer_shapes(config).items():
            shapes[f"layers.{i}.{suffix}"] = shape(config)
    shapes["norm.weight"] = (config.dim,)
    if not config.tie_embeddings:
        shapes["output.weight"] = (config.vocab_size, config.dim)
    return shapes


def count_params(config: LlamaConfig) -> int:
    """Number of parameters, computed from the shapes alone (no memory touched)."""
    return sum(math.prod(s) for s in canonical_shapes(config).values())
