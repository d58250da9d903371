"""FLOP counts and this machine's measured matmul peak, for honest MFU figures."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bridge.config import LlamaConfig
from bridge.quantize import Quantization, quantized_names, scale_shapes
from bridge.tensors import canonical_shapes, count_params


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
    """Forward-only FLOPs per token (a prefill): 2 N for the weights plus 4 L H_total S for
    attention scores and values, a third of train_flops_per_token (the backward pass is twice the
    forward)."""
    attention = 4 * config.n_layers * config.n_heads * config.head_dim * seq_len
    return 2 * matmul_params(config) + attention


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


def measure_read_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 7) -> float:
    """Bytes/s this machine streams from memory: the better of a jitted sum over an array and a
    matrix-vector product over a matrix, each larger than the caches (median of `repeats`). The
    matrix-vector product is the decode step's own operation, so the bound is one it can reach."""
    side = int((nbytes // 4) ** 0.5)
    x, w, v = jnp.ones((nbytes // 4,), jnp.float32), jnp.ones((side, side), jnp.float32), jnp.ones((side,))
    best = 0.0
    for fn, args, size in ((jax.jit(jnp.sum), (x,), x.nbytes), (jax.jit(jnp.dot), (w, v), w.nbytes)):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        best = max(best, size / float(np.median(times)))
    return best


def decode_bytes_per_token(config: LlamaConfig, dtype_bytes: int = 4,
                           quantization: Quantization | None = None) -> int:
    """Weight bytes one decode step must read: every matmul weight, plus one embedding row; with
    int8 `quantization`, one byte per projection and LM head weight (a tied head included: the
    int8 embedding) plus its float32 scales."""
    if quantization is None:
        return (matmul_params(config) + config.dim) * dtype_bytes
    shapes = canonical_shapes(config)
    int8 = sum(math.prod(shapes[name]) for name in quantized_names(config))
    scales = sum(math.prod(shape) for shape in scale_shapes(config, quantization).values())
    return int8 + 4 * scales + (matmul_params(config) - int8 + config.dim) * dtype_bytes


def int4_bytes_per_token(config: LlamaConfig, minima: bool = True) -> int:
    """Weight bytes one decode step of a 4-bit model (bridge.int4, as jax_llama.load(...,
    quantize="int4") holds it) must read: half a byte per projection weight plus a float16 scale and
    minimum per 32 (minima=False: a scale alone, as a Q4_0 file's weights are held); a tied
    head's int8 rows with a float32 scale each (an untied head is 4-bit); one embedding row."""
    from bridge.int4 import EMBEDDING, GROUP

    shapes = canonical_shapes(config)
    total = 0
    for name in quantized_names(config):
        out, inputs = shapes[name]
        if name == EMBEDDING:
            total += out * inputs + 4 * out
        else:
            total += out * inputs // 2 + (4 if minima else 2) * out * inputs // GROUP
    return total + config.dim * (1 if config.tie_embeddings else 4)


# -- compilation across processes ----------------------------------------------------------------

COMPILE_CACHE_OFF = ("0", "off", "false", "no")


def use_compile_cache(directory: str | os.PathLike | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache, so that a second `jax-llama generate` (or any
    command) of the same model and shapes loads its programs instead of compiling them: on
    SmolLM2-135M a cold `generate` takes about half the time with the cache warm
    (results/decode/generate_smollm2.md). The directory: `directory`, else $JAX_LLAMA_COMPILE_CACHE, else
    $XDG_CACHE_HOME/jax-llama/xla (~/.cache/jax-llama/xla); JAX_LLAMA_COMPILE_CACHE=off leaves
    it off. A cache already configured (JAX_COMPILATION_CACHE_DIR, jax.config) is kept as it is.
    Generation's programs are then also kept whole in its `programs/` folder
    (jax_llama.inference.programs). Returns the directory in use, or None."""
    global _keep_programs
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        _keep_programs = True
        return configured
    setting = os.environ.get("JAX_LLAMA_COMPILE_CACHE", "")
    if directory is None and setting.lower() in COMPILE_CACHE_OFF:
        return None
    if directory is None:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        directory = setting or base / "jax-llama" / "xla"
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # programs that compile in under a second are not worth a file each
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    _keep_programs = True
    return str(directory)


_keep_programs = False


def keep_programs() -> bool:
    """Whether use_compile_cache put a cache in place, and with it generation's programs kept
    whole beside it (jax_llama.inference.programs)."""
    return _keep_programs
