"""Shared fixtures. Sizes are deliberately distinct (dim 48, 6 heads, 2 kv heads, head_dim 8,
ffn 80, vocab 97) so that a swapped axis cannot pass by accident."""

from __future__ import annotations

import numpy as np
import pytest

from bridge.config import LlamaConfig, RopeScaling

# Exercises all three llama3 bands with head_dim 8 and rope_theta 100: wavelengths 6.3 (kept),
# 19.9 (interpolated between 32/4 = 8 and 32/1 = 32) and 62.8, 199 (divided by the factor).
SCALING = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32)


def small_config(**changes) -> LlamaConfig:
    base = dict(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=80, vocab_size=97,
                max_seq_len=64, norm_eps=1e-5, rope_theta=10000.0)
    base.update(changes)
    return LlamaConfig(**base)


ATTENTION_KINDS = {"mha": 6, "gqa": 2, "mqa": 1}


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def random_tokens(config: LlamaConfig, batch: int = 3, seq_len: int = 11, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq_len), dtype=np.int32)
