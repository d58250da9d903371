"""How fast the 4-bit decode kernel streams a model's projections: a decode step's calls.

    python scripts/int4_stream.py [--shapes smollm2,llama3.2-1b,llama3-8b] [--rounds 3]
        [--activations int8,float32] [--scales float16] [--incumbent DIR]
        [--incumbent-scales float32] [--minima held|none] [--incumbent-minima held|none]
        [--out results/kernels]

Each (shape, activations) row runs in its own process: random 4-bit weights for L layers of the
model's shape (fused q/k/v, o, fused gate/up, down, as jax_llama.model.projections calls them),
then one jitted program of `--chain` passes over them, each call's input depending on the last
output (as a decode step's do, so XLA runs no two calls at once), batch 1. It reports the time of
a pass and the weight bytes it read per second: half a byte a weight plus a scale and a minimum
per 32, float16 (0.625 bytes a weight, as 4-bit weights are held since 2026-12-05) or float32
(0.75, `--scales float32`, as before). With --incumbent DIR (a checkout, e.g. `git worktree add
/tmp/before HEAD~1`), every row also runs from DIR, alternating, and the ratio of the medians is
beside it. Writes OUT/int4_stream.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bridge.int4 import ACTIVATIONS
from llama_twins.bench.common import code_paths, code_paths_line

# name -> (dim, ffn hidden, kv heads x head dim, layers timed): the layers keep the weights
# (0.75 bytes a weight) well beyond the last-level cache
SHAPES = {"smollm2": (576, 1536, 192, 30), "llama3.2-1b": (2048, 8192, 512, 16),
          "llama3-8b": (4096, 14336, 1024, 8)}

WORKER = r"""
import json, sys, time, numpy as np, jax, jax.numpy as jnp
from jax_llama.model import kernels as K
D, F, KV, L, chain, repeats = (int(a) for a in sys.argv[1:7])
scales = np.dtype(sys.argv[7])
minima = sys.argv[8] == "held"  # else none: Q4_0's form, m = -8 d
calls = [(D, [D + 2 * KV]), (D, [D]), (D, [F, F]), (F, [D])]
rng = np.random.default_rng(0)
def weight(I, O):
    return (jnp.asarray(rng.integers(0, 256, (O, I // 2), dtype=np.uint8)),
            jnp.asarray(rng.random((O, I // 32), dtype=np.float32).astype(scales)),
            jnp.asarray((rng.random((O, I // 32), dtype=np.float32) - 0.5).astype(scales))
            if minima else None)
ws = [[[weight(I, O) for O in outs] for I, outs in calls] for _ in range(L)]
x = jnp.asarray(rng.standard_normal((1, D), dtype=np.float32))
xf = jnp.asarray(rng.standard_normal((1, F), dtype=np.float32))
@jax.jit
def run(x, xf, ws):
    def body(i, acc):
        for layer in ws:
            for (I, outs), w in zip(calls, layer):
                ys = K.matvec_int4((xf if I == F else x) + acc * 1e-30, w)
                acc = acc + sum(y[0, 0] for y in ys)
        return acc
    return jax.lax.fori_loop(0, chain, body, jnp.float32(0))
run(x, xf, ws).block_until_ready()
times = []
for _ in range(repeats):
    t = time.perf_counter(); run(x, xf, ws).block_until_ready()
    times.append((time.perf_counter() - t) / chain)
weights = sum(I * O for I, outs in calls for O in outs) * L
print(json.dumps({"pass_s": float(np.median(times)), "weights": weights}))
"""


def bytes_per_weight(scales: str, minima: str = "held") -> float:
    """Half a byte, plus a scale and a minimum (none: Q4_0's form) per 32 weights."""
    return 0.5 + (2 if minima == "held" else 1) * (2 if scales == "float16" else 4) / 32


def measure(tree: str | None, shape: str, activations: str, args) -> dict:
    from llama_twins.bench.common import run_in_tree
    D, F, KV, L = SHAPES[shape]
    scales = args.incumbent_scales if tree is not None else args.scales
    minima = args.incumbent_minima if tree is not None else args.minima
    out = run_in_tree(WORKER, [str(D), str(F), str(KV), str(L), str(args.chain),
                               str(args.repeats), scales, minima], tree,
                      {"JAX_LLAMA_INT4_ACTIVATIONS": activations}, f"{shape} {activations}")
    return {**out, "scales": scales, "minima": minima,
            "gb_s": bytes_per_weight(scales, minima) * out["weights"] / out["pass_s"] / 1e9}


def render(r: dict) -> list[str]:
    from llama_twins.bench.common import incumbent_clause, speed_up
    cpu = (r.get("cpu") or {}).get("model_name") or "CPU unrecorded"
    lines = ["# The 4-bit decode kernel streaming a model's projections", "",
             f"{cpu}; batch 1; a pass is one decode step's 4-bit calls over the layers timed,"
             f" {r['chain']} passes in one program, median of {r['repeats']} programs a "
             f"process, then the median of {r['rounds']} rounds"
             + incumbent_clause(r)
             + ". GB/s: the weights' bytes (half a byte a weight, a scale and a minimum per 32: "
             f"float16 scales 0.625 bytes a weight, float32 ones 0.75); scales here "
             f"{r.get('scales', 'float32')}, minima {r.get('minima', 'held')}"
             + (f", the incumbent's {r.get('incumbent_scales', 'float32')}, minima "
                f"{r.get('incumbent_minima') or 'held'}" if r["incumbent"] else "")
             + " (none: Q4_0's form, m = -8 d, 0.5625 bytes a weight with float16 scales)."
             + code_paths_line(r.get("paths")), ""]
    head = "| shape | layers | activations | pass (ms) | GB/s |"
    rule = "|---|---|---|---|---|"
    if r["incumbent"]:
        head += " incumbent pass (ms) | incumbent GB/s | speed-up (rounds) |"
        rule += "---|---|---|"
    lines += [head, rule]
    for row in r["rows"]:
        line = (f"| {row['shape']} | {row['layers']} | {row['activations']} | "
                f"{row['pass_s'] * 1e3:.2f} | {row['gb_s']:.1f} |")
        if r["incumbent"]:
            inc = row["incumbent"]
            line += (f" {inc['pass_s'] * 1e3:.2f} | {inc['gb_s']:.1f} | "
                     f"{speed_up(inc['rounds_s'], row['rounds_s'])} |")
        lines.append(line)
    lines += ["", "Each row's passes by round (ms): " + "; ".join(
        f"{row['shape']} {row['activations']} "
        + ", ".join(f"{t * 1e3:.2f}" for t in row["rounds_s"])
        + (" (incumbent " + ", ".join(f"{t * 1e3:.2f}" for t in row["incumbent"]["rounds_s"])
           + ")" if r["incumbent"] else "") for row in r["rows"])]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--activations", default="int8,float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="programs timed a process")
    parser.add_argument("--chain", type=int, default=10, help="passes in one program")
    parser.add_argument("--incumbent", default=None, help="a checkout to compare with")
    parser.add_argument("--scales", default="float16", choices=("float16", "float32"),
                        help="the dtype of this checkout's scales and minima")
    parser.add_argument("--incumbent-scales", default="float32", choices=("float16", "float32"),
                        help="the incumbent's (float32 before 2026-12-05)")
    parser.add_argument("--minima", default="held", choices=("held", "none"),
                        help="none: no minima held or read (Q4_0's form, m = -8 d)")
    parser.add_argument("--incumbent-minima", default="held", choices=("held", "none"))
    parser.add_argument("--out", default="results/kernels")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    acts = args.activations.split(",")
    from llama_twins.bench.common import against_incumbent, not_a_checkout, unknown_choice
    from llama_twins.results import commit, write
    if refused := (unknown_choice("--shapes", shapes, SHAPES)
                   or unknown_choice("--activations", acts, ACTIVATIONS)
                   or not_a_checkout(args.incumbent)):
        print(refused, file=sys.stderr)
        return 2
    incumbent = str(Path(args.incumbent).resolve()) if args.incumbent else None

    runs = against_incumbent(
        [(shape, a) for shape in shapes for a in acts], incumbent, args.rounds,
        lambda tree, key: measure(tree, *key, args),
        lambda key, tree, got: f"{key[0]} {key[1]} {'incumbent' if tree else 'this'}: "
                               f"{got['pass_s'] * 1e3:.2f} ms, {got['gb_s']:.1f} GB/s")

    def summary(done: list[dict]) -> dict:
        t = statistics.median(x["pass_s"] for x in done)
        return {"pass_s": t, "gb_s": bytes_per_weight(done[0]["scales"], done[0]["minima"])
                * done[0]["weights"] / t / 1e9,
                "rounds_s": [x["pass_s"] for x in done]}
    rows = []
    for shape in shapes:
        for a in acts:
            row = {"shape": shape, "layers": SHAPES[shape][3], "activations": a,
                   **summary(runs[((shape, a), None)])}
            if incumbent:
                row["incumbent"] = summary(runs[((shape, a), incumbent)])
            rows.append(row)
    data = {"rows": rows, "rounds": args.rounds, "repeats": args.repeats, "chain": args.chain,
            "incumbent": args.incumbent, "scales": args.scales,
            "incumbent_scales": args.incumbent_scales if incumbent else None,
            "minima": args.minima,
            "incumbent_minima": args.incumbent_minima if incumbent else None,
            "incumbent_commit": commit(incumbent) if incumbent else None,
            "paths": code_paths(),
            "command": "python scripts/int4_stream.py " + " ".join(argv or sys.argv[1:])}
    print(write("int4_stream", data, render, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
