"""Train-step throughput of the JAX trainer against Hugging Face transformers, in one process.

Same config, same batch, float32, this machine: the jitted `train_step` (optax AdamW with
clipping) against `transformers.LlamaForCausalLM` + `torch.optim.AdamW` (+ clip_grad_norm_), and
the torch twin with `torch_llama.AdamW` for reference. Each implementation is timed in a worker
process of its own (torch's OpenMP threads keep spinning after each op and would slow XLA's
threads in a shared process), and the workers run in alternating rounds so that all see the same
machine conditions. Each figure is the median over all timed steps of all rounds, after warm-up. MFU is against this machine's measured float32 matmul peak. Then the compile
time of the train step for 4 vs 32 layers, with and without scan_layers (compiled from abstract
shapes: nothing is allocated).

    python benchmarks/bench_train.py            # writes benchmarks/results/train.{md,json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import torch

import jax_llama
from bridge.config import LlamaConfig
from jax_llama.perf import measure_matmul_peak, train_flops_per_token
from jax_llama.train import TrainConfig, init_state, lr_schedule, make_optimizer, make_train_step

CONFIG = LlamaConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1376, vocab_size=32000,
                     max_seq_len=1024, rope_theta=10000.0)
TRAIN = TrainConfig(steps=1000, batch_size=8, seq_len=256, lr=3e-4, warmup_steps=10)


def batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    windows = rng.integers(0, CONFIG.vocab_size, (TRAIN.batch_size, TRAIN.seq_len + 1), dtype=np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:],
            "mask": np.ones((TRAIN.batch_size, TRAIN.seq_len), np.float32)}


def timed(step, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def jax_step(b) -> callable:
    model, params = jax_llama.init(CONFIG, seed=0)
    optimizer = make_optimizer(TRAIN)
    train_step = jax.jit(make_train_step(model, optimizer, lr_schedule(TRAIN)), donate_argnums=0)
    holder = {"state": init_state(params, optimizer)}
    device_batch = jax.device_put(b)

    def step():
        holder["state"], metrics = train_step(holder["state"], device_batch)
        jax.block_until_ready(metrics["loss"])
    return step


def transformers_step(b) -> callable:
    import transformers
    hf_config = transformers.LlamaConfig(
        hidden_size=CONFIG.dim, intermediate_size=CONFIG.ffn_dim, num_hidden_layers=CONFIG.n_layers,
        num_attention_heads=CONFIG.n_heads, num_key_value_heads=CONFIG.n_kv_heads,
        vocab_size=CONFIG.vocab_size, max_position_embeddings=CONFIG.max_seq_len,
        rms_norm_eps=CONFIG.norm_eps, rope_theta=CONFIG.rope_theta, tie_word_embeddings=False,
        attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(hf_config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN.lr, betas=(TRAIN.b1, TRAIN.b2),
                                  eps=TRAIN.eps, weight_decay=TRAIN.weight_decay)
    inputs, targets = torch.as_tensor(b["inputs"], dtype=torch.long), torch.as_tensor(b["targets"], dtype=torch.long)

    def step():
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def twin_step(b) -> callable:
    import torch_llama
    torch.manual_seed(0)
    model = torch_llama.Llama(CONFIG).train()
    params = list(model.parameters())
    optimizer = torch_llama.AdamW(
        [{"params": [p for p in params if p.ndim == 2], "weight_decay": TRAIN.weight_decay},
         {"params": [p for p in params if p.ndim != 2], "weight_decay": 0.0}],
        lr=torch_llama.warmup_cosine_decay_schedule(0.0, TRAIN.lr, TRAIN.warmup_steps, TRAIN.steps,
                                                    TRAIN.lr * TRAIN.end_lr_ratio),
        betas=(TRAIN.b1, TRAIN.b2), eps=TRAIN.eps)
    inputs, targets = torch.as_tensor(b["inputs"]), torch.as_tensor(b["targets"], dtype=torch.long)

    def step():
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        torch_llama.clip_by_global_norm(params, TRAIN.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def compile_seconds(n_layers: int, scan_layers: bool) -> float:
    """Lowering + XLA compile of the train step, from abstract shapes only."""
    config = CONFIG.replace(n_layers=n_layers)
    model = jax_llama.Llama(config, scan_layers=scan_layers)
    optimizer = make_optimizer(TRAIN)
    state = jax.eval_shape(lambda: init_state(
        jax_llama.init(config, scan_layers=scan_layers)[1], optimizer))
    b = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch())
    start = time.perf_counter()
    jax.jit(make_train_step(model, optimizer, lr_schedule(TRAIN))).lower(state, b).compile()
    return time.perf_counter() - start


IMPLEMENTATIONS = {"jax-llama (jit, optax AdamW)": "jax_step",
                   "transformers + torch.optim.AdamW": "transformers_step",
                   "torch_llama twin + torch_llama.AdamW": "twin_step"}


def worker(label: str, warmup: int, repeats: int) -> None:
    """Time one implementation in this process; print the step times as JSON."""
    step = globals()[IMPLEMENTATIONS[label]](batch())
    print(json.dumps(timed(step, warmup, repeats)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/train")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.warmup, args.repeats)
        return 0
    tokens = TRAIN.batch_size * TRAIN.seq_len
    peak = measure_matmul_peak("float32")
    flops = train_flops_per_token(CONFIG, TRAIN.seq_len) * tokens
    times = {label: [] for label in IMPLEMENTATIONS}
    for r in range(args.rounds):
        order = list(IMPLEMENTATIONS)[::1 if r % 2 == 0 else -1]
        for label in order:
            print(f"round {r + 1}/{args.rounds}: {label}", file=sys.stderr)
            result = subprocess.run([sys.executable, __file__, "--worker", label, "--warmup",
                                     str(args.warmup), "--repeats", str(args.repeats)],
                                    capture_output=True, text=True, check=True)
            times[label] += json.loads(result.stdout.strip().splitlines()[-1])
    rows = {}
    for label, runs in times.items():
        median = statistics.median(runs)
        rows[label] = {"median_s": median, "tokens_per_s": tokens / median,
                       "mfu": flops / median / peak, "runs_s": runs}
    base = rows["transformers + torch.optim.AdamW"]["tokens_per_s"]
    compile_times = {f"{n} layers, scan_layers={s}": compile_seconds(n, s)
                     for s in (True, False) for n in (4, 32)}
    lines = [f"Train step, float32, batch {TRAIN.batch_size} x {TRAIN.seq_len}, dim {CONFIG.dim}, "
             f"{CONFIG.n_layers} layers, {CONFIG.n_heads}/{CONFIG.n_kv_heads} heads, ffn {CONFIG.ffn_dim}, "
             f"vocab {CONFIG.vocab_size}; matmul peak {peak / 1e9:.0f} GFLOP/s (measured); median of "
             f"{args.rounds} rounds x {args.repeats} steps, each implementation in its own process",
             "", "| implementation | s/step | tokens/s | vs transformers | MFU | all steps (s) |",
             "|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['median_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s'] / base:.2f}x | {r['mfu']:.1%} | "
                     f"{', '.join(f'{t:.2f}' for t in r['runs_s'])} |")
    lines += ["", "| train-step compile | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in compile_times.items()]
    for s in (True, False):
        ratio = compile_times[f"32 layers, scan_layers={s}"] / compile_times[f"4 layers, scan_layers={s}"]
        lines.append(f"| 32 / 4 layers, scan_layers={s} | {ratio:.2f}x |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps(
        {"peak_flops": peak, "rows": rows, "compile_s": compile_times}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
