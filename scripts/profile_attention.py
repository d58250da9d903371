"""What limits the long-context train step on CPU: one layer's attention, forward and backward,
jax-llama's chunked implementation against torch's fused SDPA kernel, on the bench config's
attention shape at S = 8192 (B 2, 8 query heads / 4 kv heads of 64, causal, float32).

Each framework runs in a process of its own; median of 3 calls after a warm-up. A third line
times chunked's block matmuls alone (no mask, no softmax) against torch's whole forward: what is
left of the gap once the softmax is free.

    python scripts/profile_attention.py [--seq-len 8192] [--block 256]   # default: attention's own blocks
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys

from llama_twins.bench.common import timed as bench_timed

B, K, G, H = 2, 4, 2, 64


def measure(framework: str, S: int, block: int) -> dict:
    def timed(run) -> float:
        return statistics.median(bench_timed(run, warmup=1, repeats=3))

    if framework == "torch":
        import torch
        import torch.nn.functional as F
        q = torch.randn(B, K * G, S, H, requires_grad=True)
        k, v = (torch.randn(B, K, S, H, requires_grad=True) for _ in range(2))

        def forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def both():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        return {"forward_s": timed(forward), "forward_backward_s": timed(both)}
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_llama.model import attention
    if block:
        attention.QUERY_BLOCK = attention.KEY_BLOCK = block
    block = attention.QUERY_BLOCK
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, K, G, S, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.float32) for _ in range(2))
    mask = attention.AttentionMask.causal(S)
    forward = jax.jit(lambda q, k, v: attention.attend(q, k, v, mask, "chunked"))
    both = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention.attend(q, k, v, mask, "chunked")),
                            argnums=(0, 1, 2)))
    return {"forward_s": timed(lambda: jax.block_until_ready(forward(q, k, v))),
            "forward_backward_s": timed(lambda: jax.block_until_ready(both(q, k, v))),
            "forward_matmuls_only_s": timed(functools.partial(_matmuls_only(q, block), q, k, v)),
            "block": block}


def _matmuls_only(q, block: int):
    """The forward's two matmuls per (query block, key block) pair at or below the diagonal,
    laid out as chunked lays them out, and nothing else: no mask, no softmax. What XLA:CPU's
    GEMMs alone take for the work of the forward."""
    import jax
    import jax.numpy as jnp

    S = q.shape[3]
    n, M = S // block, block * G

    @jax.jit
    def run(q, k, v):
        rows, k_T = q.transpose(0, 1, 3, 2, 4), k.transpose(0, 1, 3, 2)

        def query_block(i):
            q_blk = jax.lax.dynamic_slice_in_dim(rows, i * block, block, axis=2).reshape(
                B, K, M, H)

            def key_block(j, acc):
                s = jnp.einsum("BKMH,BKHC->BKMC", q_blk,
                               jax.lax.dynamic_slice_in_dim(k_T, j * block, block, axis=3))
                return acc + jnp.einsum("BKMC,BKCH->BKMH", s,
                                        jax.lax.dynamic_slice_in_dim(v, j * block, block, axis=2))
            return jax.lax.fori_loop(0, i + 1, key_block, jnp.zeros((B, K, M, H), q.dtype))
        return jax.lax.map(query_block, jnp.arange(n))
    return lambda q, k, v: jax.block_until_ready(run(q, k, v))   # compiled once, then timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--block", type=int, default=0,
                        help="the forward's query and key block (default: attention.QUERY_BLOCK)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.seq_len, args.block)))
        return
    results = {}
    for framework in ("jax", "torch"):
        done = subprocess.run([sys.executable, __file__, "--worker", framework, "--seq-len",
                               str(args.seq_len), "--block", str(args.block)],
                              check=True, capture_output=True, text=True)
        results[framework] = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("forward_s", "forward_backward_s"):
        j, t = results["jax"][key], results["torch"][key]
        print(f"{key}: jax-llama chunked {j:.2f} s, torch SDPA {t:.2f} s, torch / chunked {t / j:.2f}x")
    mm, t = results["jax"]["forward_matmuls_only_s"], results["torch"]["forward_s"]
    block = results["jax"]["block"]
    flops = 2 * 2 * B * K * G * (block ** 2 * H) * sum(range(1, args.seq_len // block + 1))
    print(f"forward, matmuls only: jax-llama chunked's block matmuls without mask or softmax "
          f"{mm:.2f} s ({flops / mm / 1e9:.0f} GFLOP/s), torch SDPA's whole forward {t:.2f} s, "
          f"torch / matmuls {t / mm:.2f}x")


if __name__ == "__main__":
    main()
