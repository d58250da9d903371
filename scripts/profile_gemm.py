"""What limits the forward and train-step ratios on CPU: the speed of the matrix multiplications
themselves, XLA:CPU's against torch's (oneDNN / MKL), on the exact GEMMs of the benchmark config.

Each framework runs in a process of its own (torch's OpenMP threads would slow XLA's), float32,
median of 20 calls after warm-up. The shapes are those of one forward pass of `jax-llama bench`'s
default config (batch 8 x 256 tokens = 2048 rows; dim 512, kv dim 256, ffn 1376, vocab 32000), as
(M, K, N) for X (M, K) @ W (K, N); the backward pass multiplies the same sizes transposed.

    python scripts/profile_gemm.py [OUT]     # writes OUT/gemm.{md,json} (OUT: the current directory)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from llama_twins.bench.common import timed, write_results

M = 2048
SHAPES = {  # name: (M, K, N, calls per forward pass of the 8-layer config)
    "wq / wo": (M, 512, 512, 16),
    "wk / wv": (M, 512, 256, 16),
    "w1 / w3 (gate, up)": (M, 512, 1376, 16),
    "w2 (down)": (M, 1376, 512, 8),
    "output (LM head)": (M, 512, 32000, 1),
}


def measure(framework: str) -> dict[str, float]:
    """GFLOP/s per shape, in this process."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = {}
    for name, (m, k, n, _) in SHAPES.items():
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        if framework == "jax":
            import jax
            import jax.numpy as jnp
            x, w = jnp.asarray(a), jnp.asarray(b)
            f = jax.jit(jnp.matmul)
            call = lambda: f(x, w).block_until_ready()  # noqa: E731
        else:
            import torch
            x, w = torch.from_numpy(a), torch.from_numpy(b)
            call = lambda: torch.matmul(x, w)  # noqa: E731
        out[name] = 2 * m * k * n / statistics.median(timed(call, warmup=3, repeats=20)) / 1e9
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(measure(sys.argv[2])))
        return
    if len(sys.argv) > 2 or sys.argv[1:] and sys.argv[1].startswith("-"):
        # (an earlier run took `--help` for OUT and wrote its results into a folder of that name)
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        sys.exit(0 if sys.argv[1:] in (["--help"], ["-h"]) else 2)
    results = {}
    for framework in ("jax", "torch"):
        done = subprocess.run([sys.executable, __file__, "--worker", framework], check=True,
                              capture_output=True, text=True)
        results[framework] = json.loads(done.stdout.strip().splitlines()[-1])
    total = {fw: sum(2 * m * k * n * c for m, k, n, c in SHAPES.values()) /
             sum(2 * m * k * n * c / results[fw][name] for name, (m, k, n, c) in SHAPES.items())
             for fw in results}
    lines = ["# GEMM speed: XLA:CPU vs torch, the benchmark config's shapes\n",
             "`python scripts/profile_gemm.py`; float32, median of 20 calls, each framework in "
             "its own process.\n",
             "| GEMM | M x K x N | calls per forward | XLA GFLOP/s | torch GFLOP/s | XLA / torch |",
             "|---|---|---|---|---|---|"]
    for name, (m, k, n, c) in SHAPES.items():
        j, t = results["jax"][name], results["torch"][name]
        lines.append(f"| {name} | {m} x {k} x {n} | {c} | {j:.0f} | {t:.0f} | {j / t:.2f}x |")
    lines.append(f"| all, weighted by FLOPs | | | {total['jax']:.0f} | {total['torch']:.0f} | "
                 f"{total['jax'] / total['torch']:.2f}x |")
    write_results("gemm", lines, {"shapes": SHAPES, "gflops": results, "weighted": total},
                  sys.argv[1] if len(sys.argv) > 1 else ".")


if __name__ == "__main__":
    main()
