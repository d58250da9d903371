"""How long a decode step's attention over the KV cache takes in the decode kernel: one call a
layer, each query depending on the last output (as a decode step's do), batch 1, in a cache far
longer than what is filled (a chat's 1,024 slots, LLaMA 3 8B's 8k context).

    python scripts/decode_attention.py [--shapes smollm2,llama3-8b] [--rounds 3]
        [--incumbent DIR] [--out results/kernels/attention]

Each row runs in its own process (random keys and values; the first `filled` slots valid), the
median of 20 steps; with --incumbent DIR (a checkout, e.g. `git worktree add /tmp/before
HEAD~1`) every row also runs from DIR, alternating, and the median of the rounds' ratios is
beside it. Writes OUT/decode_attention.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

# name -> (layers, kv heads, queries per kv head, head dim, cache slots, slots filled)
SHAPES = {"smollm2": (30, 3, 3, 64, 1024, 60), "llama3-8b": (32, 8, 4, 128, 8192, 21)}

WORKER = r"""
import json, sys, time, numpy as np, jax, jax.numpy as jnp
from jax_llama.model import kernels
from jax_llama.model.attention import AttentionMask
L, K, G, H, T, filled = (int(a) for a in sys.argv[1:7])
rng = np.random.default_rng(0)
k = jnp.asarray(rng.standard_normal((L, 1, K, T, H), dtype=np.float32))
v = jnp.asarray(rng.standard_normal((L, 1, K, T, H), dtype=np.float32))
valid = np.zeros((1, T), bool)
valid[:, :filled] = True
mask = AttentionMask(jnp.array([filled - 1], jnp.int32), jnp.asarray(valid))
q = jnp.asarray(rng.standard_normal((1, K, G, 1, H), dtype=np.float32))
@jax.jit
def step(q):
    for layer in range(L):
        q = q + 1e-30 * kernels.attend_cache(q, k, v, layer, mask)
    return q
step(q).block_until_ready()
times = []
for _ in range(20):
    t = time.perf_counter(); step(q).block_until_ready(); times.append(time.perf_counter() - t)
print(json.dumps({"step_s": float(np.median(times))}))
"""


def measure(tree: str | None, shape: str) -> float:
    from llama_twins.bench.common import run_in_tree
    return run_in_tree(WORKER, [str(n) for n in SHAPES[shape]], tree, what=shape)["step_s"]


def render(r: dict) -> list[str]:
    from llama_twins.bench.common import incumbent_clause, speed_up
    cpu = (r.get("cpu") or {}).get("model_name") or "CPU unrecorded"
    lines = ["# A decode step's attention over a long KV cache, in the decode kernel", "",
             f"{cpu}; batch 1; one call a layer, each query depending on the last output; median "
             f"of 20 steps a process, then of {r['rounds']} rounds"
             + incumbent_clause(r) + ".", ""]
    head = "| shape | layers | kv heads x queries | head dim | slots | filled | step (ms) |"
    rule = "|---|---|---|---|---|---|---|"
    if r["incumbent"]:
        head += " incumbent (ms) | speed-up (rounds) |"
        rule += "---|---|"
    lines += [head, rule]
    for row in r["rows"]:
        L, K, G, H, T, filled = SHAPES[row["shape"]]
        line = (f"| {row['shape']} | {L} | {K} x {G} | {H} | {T} | {filled} | "
                f"{statistics.median(row['rounds_s']) * 1e3:.3f} |")
        if r["incumbent"]:
            line += (f" {statistics.median(row['incumbent_s']) * 1e3:.3f} | "
                     f"{speed_up(row['incumbent_s'], row['rounds_s'])} |")
        lines.append(line)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--incumbent", default=None, help="a checkout to compare with")
    parser.add_argument("--out", default="results/kernels/attention")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    from llama_twins.bench.common import not_a_checkout, unknown_choice
    from llama_twins.results import commit, write
    if refused := unknown_choice("--shapes", shapes, SHAPES) or not_a_checkout(args.incumbent):
        print(refused, file=sys.stderr)
        return 2
    incumbent = str(Path(args.incumbent).resolve()) if args.incumbent else None

    rows = {s: {"shape": s, "rounds_s": [], "incumbent_s": []} for s in shapes}
    for k in range(args.rounds):
        for s in shapes:
            rows[s]["rounds_s"].append(measure(None, s))
            if incumbent:
                rows[s]["incumbent_s"].append(measure(incumbent, s))
            print(f"round {k + 1}: {s}: {rows[s]['rounds_s'][-1] * 1e3:.3f} ms"
                  + (f", incumbent {rows[s]['incumbent_s'][-1] * 1e3:.3f} ms" if incumbent
                     else ""), file=sys.stderr, flush=True)
    data = {"rows": list(rows.values()), "rounds": args.rounds, "incumbent": args.incumbent,
            "incumbent_commit": commit(incumbent) if incumbent else None,
            "command": "python scripts/decode_attention.py " + " ".join(argv or sys.argv[1:])}
    print(write("decode_attention", data, render, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
