"""How fast the float32 and int8 decode kernels stream a model's projections and its tied head.

    python scripts/float_stream.py [--weights float32,int8] [--batch 1,2] [--rounds 3]
        [--incumbent DIR] [--out results/kernels]

Each (weights, batch) row runs in its own process: random weights in SmolLM2's shapes (30
layers: q/k/v in one call, o, gate/up in one call, down, each (in, out) as the model holds them)
and its tied head (49,152 x 576 rows, float32 for float32 weights, int8 rows with a scale each
for int8), then one jitted program of `--chain` passes over them, each call's input depending on
the last output (as a decode step's do, so XLA runs no two calls at once). It reports the time of
a pass and the weight bytes it read per second. With --incumbent DIR (a checkout, e.g. `git
worktree add /tmp/before HEAD~1`), every row also runs from DIR, alternating, and the median of
the rounds' ratios is beside it. Writes OUT/float_stream.{json,md}. int4_stream.py is the 4-bit
kernel's counterpart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from llama_twins.bench.common import code_paths, code_paths_line

WEIGHTS = ("float32", "int8")
DIM, FFN, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152  # SmolLM2-135M

WORKER = r"""
import json, sys, time, numpy as np, jax, jax.numpy as jnp
from jax_llama.model import kernels as K
kind, M, chain, repeats = sys.argv[1], *(int(a) for a in sys.argv[2:5])
D, F, KV, L, V = (int(a) for a in sys.argv[5:10])
calls = [(D, [D, KV, KV]), (D, [D]), (D, [F, F]), (F, [D])]
rng = np.random.default_rng(0)
def weight(I, O):
    if kind == "float32":
        return jnp.asarray(rng.standard_normal((I, O), dtype=np.float32) * 0.02)
    return (jnp.asarray(rng.integers(-127, 128, (I, O), dtype=np.int8)),
            jnp.asarray(rng.random((1, O), dtype=np.float32)))
ws = [[[weight(I, O) for O in outs] for I, outs in calls] for _ in range(L)]
if kind == "float32":
    head = (jnp.asarray(rng.standard_normal((V, D), dtype=np.float32) * 0.02), None)
else:
    head = (jnp.asarray(rng.integers(-127, 128, (V, D), dtype=np.int8)),
            jnp.asarray(rng.random((V, 1), dtype=np.float32)))
x = jnp.asarray(rng.standard_normal((M, D), dtype=np.float32))
xf = jnp.asarray(rng.standard_normal((M, F), dtype=np.float32))
@jax.jit
def run(x, xf, ws, head):
    def body(i, acc):
        for layer in ws:
            for (I, outs), w in zip(calls, layer):
                xi = (xf if I == F else x) + acc * 1e-30
                ys = K.matvec_f32(xi, w) if kind == "float32" else K.matvec_int8(xi, w)
                acc = acc + sum(y[0, 0] for y in ys)
        return acc + K.matvec_rows(x + acc * 1e-30, *head)[0, 0]
    return jax.lax.fori_loop(0, chain, body, jnp.float32(0))
run(x, xf, ws, head).block_until_ready()
times = []
for _ in range(repeats):
    t = time.perf_counter(); run(x, xf, ws, head).block_until_ready()
    times.append((time.perf_counter() - t) / chain)
size = 4 if kind == "float32" else 1
weights = sum(I * O for I, outs in calls for O in outs) * L + V * D
print(json.dumps({"pass_s": float(np.median(times)), "bytes": weights * size}))
"""


def measure(tree: str | None, weights: str, batch: int, args) -> dict:
    from llama_twins.bench.common import run_in_tree
    return run_in_tree(WORKER, [weights, str(batch), str(args.chain), str(args.repeats),
                                *(str(n) for n in (DIM, FFN, KV, LAYERS, VOCAB))], tree, None,
                       f"{weights} batch {batch}")


def render(r: dict) -> list[str]:
    from llama_twins.bench.common import incumbent_clause, speed_up
    cpu = (r.get("cpu") or {}).get("model_name") or "CPU unrecorded"
    lines = ["# The float32 and int8 decode kernels streaming SmolLM2's projections and head", "",
             f"{cpu}; a pass is one decode step's projection calls over {LAYERS} layers and the "
             f"tied head, {r['chain']} passes in one program, median of {r['repeats']} programs a "
             f"process, then the median of {r['rounds']} rounds"
             + incumbent_clause(r)
             + ". GB/s: the weights' bytes (4 a float32 weight, 1 an int8 one) over a pass."
             + code_paths_line(r.get("paths")), ""]
    head = "| weights | batch | pass (ms) | GB/s |"
    rule = "|---|---|---|---|"
    if r["incumbent"]:
        head += " incumbent pass (ms) | speed-up (rounds) |"
        rule += "---|---|"
    lines += [head, rule]
    for row in r["rows"]:
        line = (f"| {row['weights']} | {row['batch']} | {row['pass_s'] * 1e3:.2f} | "
                f"{row['bytes'] / row['pass_s'] / 1e9:.1f} |")
        if r["incumbent"]:
            line += (f" {statistics.median(row['incumbent_s']) * 1e3:.2f} | "
                     f"{speed_up(row['incumbent_s'], row['rounds_s'])} |")
        lines.append(line)
    lines += ["", "Passes by round (ms): " + "; ".join(
        f"{row['weights']} batch {row['batch']} "
        + ", ".join(f"{t * 1e3:.2f}" for t in row["rounds_s"])
        + (" (incumbent " + ", ".join(f"{t * 1e3:.2f}" for t in row["incumbent_s"]) + ")"
           if r["incumbent"] else "") for row in r["rows"])]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default=",".join(WEIGHTS))
    parser.add_argument("--batch", default="1,2", help="rows of x, comma-separated (1 to 8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="programs timed a process")
    parser.add_argument("--chain", type=int, default=5, help="passes in one program")
    parser.add_argument("--incumbent", default=None, help="a checkout to compare with")
    parser.add_argument("--out", default="results/kernels")
    args = parser.parse_args(argv)
    kinds = args.weights.split(",")
    from llama_twins.bench.common import against_incumbent, not_a_checkout, unknown_choice
    from llama_twins.results import commit, write
    batches = args.batch.split(",")
    if refused := (unknown_choice("--weights", kinds, WEIGHTS)
                   or unknown_choice("--batch", batches, [str(m) for m in range(1, 9)])
                   or not_a_checkout(args.incumbent)):
        print(refused, file=sys.stderr)
        return 2
    incumbent = str(Path(args.incumbent).resolve()) if args.incumbent else None
    keys = [(kind, batch) for kind in kinds for batch in map(int, batches)]
    runs = against_incumbent(
        keys, incumbent, args.rounds, lambda tree, key: measure(tree, *key, args),
        lambda key, tree, got: f"{key[0]} batch {key[1]} {'incumbent' if tree else 'this'}: "
                               f"{got['pass_s'] * 1e3:.2f} ms")
    rows = []
    for kind, batch in keys:
        done = runs[((kind, batch), None)]
        row = {"weights": kind, "batch": batch, "bytes": done[0]["bytes"],
               "pass_s": statistics.median(x["pass_s"] for x in done),
               "rounds_s": [x["pass_s"] for x in done]}
        if incumbent:
            row["incumbent_s"] = [x["pass_s"] for x in runs[((kind, batch), incumbent)]]
        rows.append(row)
    data = {"rows": rows, "rounds": args.rounds, "repeats": args.repeats, "chain": args.chain,
            "paths": code_paths(),
            "incumbent": args.incumbent,
            "incumbent_commit": commit(incumbent) if incumbent else None,
            "command": "python scripts/float_stream.py " + " ".join(argv or sys.argv[1:])}
    print(write("float_stream", data, render, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
