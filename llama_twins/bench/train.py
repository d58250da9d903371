"""Train-step throughput of the JAX trainer against Hugging Face transformers, and compile time
against depth.

Same config, same batch: the jitted `train_step` (optax AdamW with clipping) against
`transformers.LlamaForCausalLM` + `torch.optim.AdamW` (+ clip_grad_norm_), and the torch twin with
`torch_llama.AdamW` for reference; in bfloat16, JAX computes in bfloat16 with float32 params and
both torch sides run under autocast. Each implementation is timed in a worker process of its own,
in alternating rounds (llama_twins.bench.common). MFU is against this machine's measured matmul peak.
Then the compile time of the train step for a shallow and a deep model, with and without
scan_layers (compiled from abstract shapes: nothing is allocated).

    python -m llama_twins.bench.train [--out DIR]     # writes DIR/train.{md,json} (DIR: .)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .common import (JAX, REFERENCE, TWIN, Spec, available, describe, missing_note, probe,
                     run_rounds, say, spawn, throughput_rows, throughput_table, timed,
                     torch_device, transformers_model, write_results)

OPTIMIZER = dict(steps=1000, lr=3e-4, warmup_steps=10)  # the rest: TrainConfig's defaults


def train_config(spec: Spec):
    from jax_llama.training.step import TrainConfig
    return TrainConfig(batch_size=spec.batch, seq_len=spec.seq_len, dtype=spec.dtype, **OPTIMIZER)


def batch(spec: Spec, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    windows = rng.integers(0, spec.config.vocab_size, (spec.batch, spec.seq_len + 1), dtype=np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:],
            "mask": np.ones((spec.batch, spec.seq_len), np.float32)}


def jax_step(spec: Spec, attention: str = "auto"):
    import jax

    import jax_llama
    from jax_llama.training.step import init_state, jit_train_step, lm_loss, make_optimizer
    tc = train_config(spec)
    model, params = jax_llama.init(spec.config, seed=0, dtype=spec.dtype, attention=attention)
    optimizer = make_optimizer(tc)
    holder = {"state": init_state(params, optimizer)}
    train_step = jit_train_step(lm_loss(model), optimizer, tc, holder["state"])
    device_batch = jax.device_put(batch(spec))

    def step():
        holder["state"], metrics = train_step(holder["state"], device_batch)
        jax.block_until_ready(metrics["loss"])
    return step, lambda: None


def torch_step(spec: Spec, impl: str, attention: str = "sdpa"):
    import torch

    tc = train_config(spec)
    device, sync = torch_device()
    if impl == REFERENCE:
        model = transformers_model(spec.config, attention).to(device).train()
        forward = lambda t: model(input_ids=t, use_cache=False).logits  # noqa: E731
        optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(tc.b1, tc.b2), eps=tc.eps,
                                      weight_decay=tc.weight_decay)
        clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)  # noqa: E731
    else:
        import torch_llama
        torch.manual_seed(0)
        model = forward = torch_llama.Llama(spec.config).to(device).train()
        params = list(model.parameters())
        optimizer = torch_llama.AdamW(
            [{"params": [p for p in params if p.ndim == 2], "weight_decay": tc.weight_decay},
             {"params": [p for p in params if p.ndim != 2], "weight_decay": 0.0}],
            lr=torch_llama.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.steps,
                                                        tc.lr * tc.end_lr_ratio),
            betas=(tc.b1, tc.b2), eps=tc.eps)
        clip = lambda: torch_llama.clip_by_global_norm(params, tc.grad_clip)  # noqa: E731
    return _torch_step(spec, device, forward, clip, optimizer), sync


def _torch_step(spec: Spec, device, forward, clip, optimizer):
    """One torch train step on the benchmark batch: forward (autocast in bfloat16), cross
    entropy, backward, clip, the optimizer's step."""
    import torch

    b = batch(spec)
    inputs = torch.as_tensor(b["inputs"], dtype=torch.long, device=device)
    targets = torch.as_tensor(b["targets"], dtype=torch.long, device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.dtype != "float32"):
            logits = forward(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def measure(impl: str, spec: Spec) -> dict[str, list[float]]:
    """In a worker: seconds per train step of `impl`."""
    step, sync = jax_step(spec) if impl == JAX else torch_step(spec, impl)
    return {"step": timed(step, spec.warmup, spec.repeats, sync)}


def summarize(times: dict[str, dict | None], spec: Spec, peak: float) -> dict:
    """times[impl] = measure()'s lists pooled over rounds (None: not run) -> the JSON entry."""
    from jax_llama.perf import train_flops_per_token
    n = spec.batch * spec.seq_len
    flops = train_flops_per_token(spec.config, spec.seq_len) * n
    return {"batch": spec.batch, "seq_len": spec.seq_len, "tokens": n, "flops": flops,
            "optimizer": OPTIMIZER,
            "rows": throughput_rows({impl: t and t["step"] for impl, t in times.items()}, n, flops, peak)}


def markdown(result: dict, dtype: str) -> list[str]:
    return [f"## Train step: batch {result['batch']} x {result['seq_len']} tokens, {dtype}, "
            f"AdamW with gradient clipping", "", *throughput_table(result["rows"], "step")]


# -- the LoRA train step ------------------------------------------------------------------------

# rank 16 on all seven projections (alpha 32), as llama_twins.bench.lora; peft's names for them
LORA_RANK, LORA_ALPHA = 16, 32.0
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def jax_lora_step(spec: Spec):
    import jax

    import jax_llama
    from bridge.lora import LoraConfig
    from jax_llama.lora import add_lora, count, trainable
    from jax_llama.training.step import init_state, jit_train_step, lm_loss, make_optimizer
    tc = train_config(spec)
    model, params = jax_llama.init(spec.config, seed=0, dtype=spec.dtype)
    model, params = add_lora(model, params, LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA), seed=0)
    optimizer = make_optimizer(tc, trainable)
    holder = {"state": init_state(params, optimizer)}
    train_step = jit_train_step(lm_loss(model), optimizer, tc, holder["state"],
                                trainable=trainable)
    device_batch = jax.device_put(batch(spec))

    def step():
        holder["state"], metrics = train_step(holder["state"], device_batch)
        jax.block_until_ready(metrics["loss"])
    return step, lambda: None, count(params, trainable(params))


def torch_lora_step(spec: Spec, impl: str):
    """The torch twin with torch_llama.add_lora and its AdamW, or transformers'
    LlamaForCausalLM with peft's get_peft_model and torch.optim.AdamW: the adapters train."""
    import torch

    tc = train_config(spec)
    device, sync = torch_device()
    torch.manual_seed(0)
    if impl == REFERENCE:
        import peft
        model = peft.get_peft_model(transformers_model(spec.config).to(device), peft.LoraConfig(
            r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=PEFT_TARGETS, lora_dropout=0.0))
        forward = lambda t: model(input_ids=t, use_cache=False).logits  # noqa: E731
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=(tc.b1, tc.b2), eps=tc.eps,
                                      weight_decay=tc.weight_decay)
        clip = lambda: torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)  # noqa: E731
    else:
        import torch_llama
        from bridge.lora import LoraConfig
        model = forward = torch_llama.add_lora(torch_llama.Llama(spec.config).to(device),
                                               LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA))
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch_llama.AdamW([{"params": params, "weight_decay": tc.weight_decay}],
                                      lr=tc.lr, betas=(tc.b1, tc.b2), eps=tc.eps)
        clip = lambda: torch_llama.clip_by_global_norm(params, tc.grad_clip)  # noqa: E731
    model.train()
    return (_torch_step(spec, device, forward, clip, optimizer), sync,
            sum(p.numel() for p in params))


def measure_lora(impl: str, spec: Spec) -> dict[str, list[float]]:
    """In a worker: seconds per LoRA train step of `impl`, and its trainable parameters (the
    same in every implementation, or they would not train the same adapters)."""
    step, sync, trained = jax_lora_step(spec) if impl == JAX else torch_lora_step(spec, impl)
    return {"step": timed(step, spec.warmup, spec.repeats, sync), "trainable": [trained]}


def summarize_lora(times: dict[str, dict | None], spec: Spec, peak: float) -> dict:
    """As summarize; the FLOPs are a frozen-base step's: train_flops_per_token less the weight
    gradients (2 N a token; the adapters' few left out)."""
    from jax_llama.perf import matmul_params, train_flops_per_token
    n = spec.batch * spec.seq_len
    flops = (train_flops_per_token(spec.config, spec.seq_len)
             - 2 * matmul_params(spec.config)) * n
    return {"batch": spec.batch, "seq_len": spec.seq_len, "tokens": n, "flops": flops,
            "optimizer": OPTIMIZER, "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA,
                                             "targets": PEFT_TARGETS},
            "trainable": {impl: t and int(t["trainable"][0]) for impl, t in times.items()},
            "rows": throughput_rows({impl: t and t["step"] for impl, t in times.items()}, n, flops,
                                    peak)}


def markdown_lora(result: dict, dtype: str) -> list[str]:
    return [f"## LoRA train step: batch {result['batch']} x {result['seq_len']} tokens, {dtype}, "
            f"rank {LORA_RANK} on all seven projections, AdamW on the adapters with clipping "
            f"(transformers: peft's get_peft_model; the torch twin: torch_llama.add_lora); MFU "
            f"counts the forward and the backward through the activations", "",
            *throughput_table(result["rows"], "step"), "",
            "Trainable parameters: " + ", ".join(f"{impl} {n:,}" for impl, n in
                                                 result["trainable"].items() if n)]


# -- compile time against depth ---------------------------------------------------------------

def compile_seconds(spec: Spec, n_layers: int, scan_layers: bool) -> float:
    """Lowering + XLA compile of the train step, from abstract shapes only (nothing allocated)."""
    import jax

    import jax_llama
    from jax_llama.training.step import init_state, lm_loss, lr_schedule, make_optimizer, make_train_step
    config, tc = spec.config.replace(n_layers=n_layers), train_config(spec)
    model = jax_llama.Llama(config, dtype=spec.dtype, scan_layers=scan_layers)
    optimizer = make_optimizer(tc)
    state = jax.eval_shape(lambda: init_state(
        jax_llama.init(config, dtype=spec.dtype, scan_layers=scan_layers)[1], optimizer))
    b = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch(spec))
    start = time.perf_counter()
    jax.jit(make_train_step(lm_loss(model), optimizer, lr_schedule(tc))).lower(state, b).compile()
    return time.perf_counter() - start


def compile_times(spec: Spec, depths: tuple[int, int]) -> dict:
    """In a worker: {"scan_layers=True": {"layers": {depth: s}, "ratio": deep / shallow}, ...}."""
    rows = {}
    for scan in (True, False):
        seconds = {str(n): compile_seconds(spec, n, scan) for n in depths}
        rows[f"scan_layers={scan}"] = {"layers": seconds,
                                       "ratio": seconds[str(depths[1])] / seconds[str(depths[0])]}
    return {"depths": list(depths), "rows": rows}


def compile_markdown(result: dict) -> list[str]:
    shallow, deep = result["depths"]
    lines = ["## Compile time against depth: the train step, lowered and compiled from abstract "
             "shapes", "", f"| train-step compile | {shallow} layers (s) | {deep} layers (s) | "
             f"{deep} / {shallow} layers |", "|---|---|---|---|"]
    for label, r in result["rows"].items():
        lines.append(f"| {label} | {r['layers'][str(shallow)]:.1f} | {r['layers'][str(deep)]:.1f} | "
                     f"{r['ratio']:.2f}x |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=".", help="directory for train.{md,json} (default .)")
    args = parser.parse_args(argv)
    spec, found = Spec(warmup=args.warmup, repeats=args.repeats), probe()
    if missing_note(found):
        say(f"warning: {missing_note(found)}")
    peak = spawn("machine", spec)["peak_flops"]
    times = run_rounds(("train",), available(found), spec, args.rounds)
    result = summarize({impl: times.get(impl, {}).get("train") for impl in (JAX, TWIN, REFERENCE)},
                       spec, peak)
    compiled = spawn("compile", spec, extra=("--depths", "4,32"))
    lines = [f"{describe(spec.config)}; matmul peak {peak / 1e9:.0f} GFLOP/s (measured); median of "
             f"{args.rounds} rounds x {args.repeats} steps, each implementation in its own "
             f"process", "", *markdown(result, spec.dtype), "", *compile_markdown(compiled)]
    write_results("train", lines, {"peak_flops": peak, "train": result, "compile": compiled},
                  args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
