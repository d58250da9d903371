"""FLOP counts and this machine's measured matmul peak, for honest MFU figures."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from bridge.config import LlamaConfig
from bridge.tensors import count_params


def matmul_params(config: LlamaConfig) -> int:
    """Parameters that take part in a matmul per token: all but the embedding lookup table
    (which is a gather), the LM head included (it is the embedding itself when tied)."""
    n = count_params(config)
    return n if config.tie_embeddings else n - config.vocab_size * config.dim


def train_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token, the PaLM appendix-B way: 6 N for the weights plus
    12 L H_total S for attention scores and values (causal masking not discounted)."""
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * seq_len
    return 6 * matmul_params(config) + attention


def forward_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    return train_flops_per_token(config, seq_len) / 3


def measure_matmul_peak(dtype="float32", n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a square n x n matmul on the default device: median of `repeats` timed runs
    after a warm-up. The denominator of MFU: what this machine can actually do."""
    a = jnp.ones((n, n), dtype=dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / float(np.median(times))


def measure_read_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a jitted sum over an array larger than the caches: the memory bandwidth a
    decode step, which reads every weight once per token, can hope for."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return nbytes / float(np.median(times))


def decode_bytes_per_token(config: LlamaConfig, dtype_bytes: int = 4) -> int:
    """Weight bytes one decode step must read: every matmul weight, plus one embedding row."""
    return (matmul_params(config) + config.dim) * dtype_bytes
