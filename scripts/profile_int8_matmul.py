"""Why int8 weights do not speed up decoding on this CPU: the batch-1 matmuls of the benchmark
config, float32 weights against int8 weights, in each framework's own process.

    python scripts/profile_int8_matmul.py [--out results/decode]

For each weight shape of a decode step (K x N, x of 1 or 8 rows) it times, median of 50 calls:
  JAX    x @ W (float32); jax_llama.model.projections.int8_matmul, what the JAX twin runs
         (x @ Q * s, Q converted to float32 64 rows at a time in a loop, or whole for small
         weights); and an elementwise int8 -> float32 convert of the whole weight alone
  torch  F.linear (float32); torch_llama.projections.int8_linear on float32 x (Q converted per call);
         the same on bfloat16 x (torch._weight_int8pack_mm, torch's int8 weight kernel)
An int8 matmul can only win if the convert is fused into the matmul's read of the weight; the
convert column shows what it costs when it is not. Writes OUT/int8_matmul.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from llama_twins.bench.common import timed

# (K, N) of the benchmark config's projections (llama_twins.bench.common.CONFIG) and its LM head
SHAPES = [(512, 512), (512, 256), (512, 1376), (1376, 512), (512, 32000)]
ROWS = (1, 8)


def median_seconds(fn, repeats: int = 50) -> float:
    return statistics.median(timed(fn, warmup=1, repeats=repeats))


def measure_jax() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_llama.model.projections import int8_matmul

    f32 = jax.jit(lambda x, w: x @ w)
    int8 = jax.jit(lambda x, q, s: int8_matmul(x, q, s, jnp.float32))
    convert = jax.jit(lambda q: q.astype(jnp.float32))
    out = {}
    for K, N in SHAPES:
        rng = np.random.default_rng(0)
        w = jnp.asarray(rng.normal(size=(K, N)).astype(np.float32))
        q = jnp.asarray(rng.integers(-127, 128, (K, N)).astype(np.int8))
        s = jnp.ones((1, N), jnp.float32)
        for B in ROWS:
            x = jnp.ones((B, K), jnp.float32)
            out[f"{K}x{N}/{B}"] = {
                "float32": median_seconds(lambda: f32(x, w).block_until_ready()),
                "int8": median_seconds(lambda: int8(x, q, s).block_until_ready()),
                "convert": median_seconds(lambda: convert(q).block_until_ready())}
    return out


def measure_torch() -> dict:
    import torch
    import torch.nn.functional as F

    from torch_llama.projections import int8_linear

    out = {}
    with torch.inference_mode():
        for K, N in SHAPES:
            w = torch.randn(N, K)
            q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
            s = torch.ones(N, 1)
            for B in ROWS:
                x = torch.ones(B, K)
                xb = x.bfloat16()
                out[f"{K}x{N}/{B}"] = {
                    "float32": median_seconds(lambda: F.linear(x, w)),
                    "int8": median_seconds(lambda: int8_linear(x, q, s)),
                    "int8_bf16": median_seconds(lambda: int8_linear(xb, q, s))}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/decode")
    parser.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure_jax() if args.worker == "jax" else measure_torch()))
        return 0
    from llama_twins import results as writer
    from llama_twins.bench.common import cpu_model

    results = {}
    for worker in ("jax", "torch"):  # each framework in a process of its own
        done = subprocess.run([sys.executable, __file__, "--worker", worker], check=True,
                              capture_output=True, text=True)
        results[worker] = json.loads(done.stdout.strip().splitlines()[-1])
    lines = [f"`python scripts/profile_int8_matmul.py`; {cpu_model()}; median of 50 calls, "
             f"microseconds; speed-up = float32 time / int8 time", "",
             "| K x N | rows | JAX float32 | JAX int8 | speed-up | JAX int8->f32 convert alone "
             "| torch float32 | torch int8 (f32 x) | speed-up | torch int8 (bf16 x, int8 kernel) "
             "| speed-up |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in results["jax"]:
        shape, rows = key.split("/")
        j, t = results["jax"][key], results["torch"][key]
        lines.append(f"| {shape} | {rows} | {j['float32'] * 1e6:.0f} | {j['int8'] * 1e6:.0f} | "
                     f"{j['float32'] / j['int8']:.2f}x | {j['convert'] * 1e6:.0f} | "
                     f"{t['float32'] * 1e6:.0f} | {t['int8'] * 1e6:.0f} | "
                     f"{t['float32'] / t['int8']:.2f}x | {t['int8_bf16'] * 1e6:.0f} | "
                     f"{t['float32'] / t['int8_bf16']:.2f}x |")
    print(writer.write("int8_matmul", results, lines, args.out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
