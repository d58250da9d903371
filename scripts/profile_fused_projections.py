"""Would fusing projections speed up batch-1 decode? The 30 layers' projections of SmolLM2-135M
(dim 576, kv 192, ffn 1536; float32, one token) as seven GEMVs a layer against four (q|k|v and
gate|up concatenated), each jitted whole, rounds alternating; medians. Prints ms and GB/s.

    python scripts/profile_fused_projections.py [--rounds 3] [--calls 30]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from llama_twins.bench.common import cpu_model

L, D, KV, F = 30, 576, 192, 1536


def weights(seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return [jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02) for _ in range(L)]
    separate = dict(q=w(D, D), k=w(D, KV), v=w(D, KV), o=w(D, D), g=w(D, F), u=w(D, F),
                    d=w(F, D))
    fused = dict(qkv=[jnp.concatenate(x, -1) for x in zip(separate["q"], separate["k"],
                                                          separate["v"])],
                 o=separate["o"], gu=[jnp.concatenate(x, -1) for x in zip(separate["g"],
                                                                          separate["u"])],
                 d=separate["d"])
    return separate, fused


def layer_separate(x, p):
    q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
    h = x + (q + jnp.tile(k + v, 3)) @ p["o"]  # stands in for attention: uses q, k and v
    return h + (jax.nn.silu(h @ p["g"]) * (h @ p["u"])) @ p["d"]


def layer_fused(x, p):
    qkv = x @ p["qkv"]
    q, k, v = qkv[:, :D], qkv[:, D:D + KV], qkv[:, D + KV:]
    h = x + (q + jnp.tile(k + v, 3)) @ p["o"]
    gu = h @ p["gu"]
    return h + (jax.nn.silu(gu[:, :F]) * gu[:, F:]) @ p["d"]


def model(layer):
    def run(x, p):
        for i in range(L):
            x = layer(x, {k: v[i] for k, v in p.items()})
        return x
    return jax.jit(run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args(argv)
    separate, fused = weights()
    x = jnp.ones((1, D), jnp.float32)
    cases = {"separate (7 a layer)": (model(layer_separate), separate),
             "fused (4 a layer)": (model(layer_fused), fused)}
    times = {name: [] for name in cases}
    for fn, p in cases.values():
        fn(x, p).block_until_ready()
    for _ in range(args.rounds):
        for name, (fn, p) in cases.items():
            for _ in range(args.calls):
                t = time.perf_counter()
                fn(x, p).block_until_ready()
                times[name].append(time.perf_counter() - t)
    nbytes = sum(a.size * 4 for a in jax.tree.leaves(separate))
    print(f"{cpu_model()}; {nbytes / 1e6:.0f} MB of projection weights; medians of "
          f"{args.rounds} x {args.calls} calls")
    base = np.median(times["separate (7 a layer)"])
    for name, ts in times.items():
        t = np.median(ts)
        print(f"{name:22s} {t * 1e3:6.2f} ms  {nbytes / t / 1e9:5.1f} GB/s  {base / t:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
