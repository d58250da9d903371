"""LoRA memory: one train step of llama3.2-1b with rank-16 adapters on all seven projections, on
this machine, against what full fine-tuning of the same model would need.

The LoRA step runs in a worker process of its own, so that its peak RSS is that process's alone:
random weights built directly in bfloat16 (jax_llama.init jits the initialiser, so no float32 copy
of the weights is ever made), frozen; float32 adapters (rank 16, alpha 32) and their AdamW state;
remat and scan_layers; batch 1 x 256 random tokens. It reports the process's peak RSS (and the
peak of each phase: build, compile, steps), seconds per step (median of the timed steps, compile
timed apart), trainable parameters and the optimizer state's bytes. It then checks that XLA does
not compute the frozen weights' gradients: the step's temporary buffers are compared with those of
the same step where the frozen weights sit behind stop_gradient (autodiff never sees them).

Full fine-tuning is computed, never run (on a 24 GB machine it would exhaust the memory): bytes
per parameter for the weights, gradients and AdamW moments, and XLA's own plan for the float32
step, compiled from abstract shapes in a second worker (nothing allocated).

    python -m llama_twins.bench.lora [--quick] [--out DIR]   # or: jax-llama bench --only lora
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import sys
import time

from bridge.config import PRESETS, LlamaConfig
from bridge.lora import LoraConfig
from bridge.tensors import count_params

from .common import Spec, describe, say, spawn, timed

PRESET = "llama3.2-1b"
LORA = LoraConfig(rank=16, alpha=32.0)        # all seven targets (LoraConfig's default)
BATCH, SEQ_LEN = 1, 256
TARGET_RSS = 8e9                              # the target for the LoRA step, bytes
QUICK = dict(preset="tiny", seq_len=32, repeats=2)
GB = 1e9


# -- in the worker ----------------------------------------------------------------------------

def _rss() -> dict[str, int]:
    """This process's resident memory now (VmRSS) and at its peak since the last reset (VmHWM)."""
    found = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024
    return found


def _reset_peak() -> bool:
    """Start a new VmHWM (Linux: clear_refs 5), so the next phase's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _max_rss() -> int:
    """The process's peak resident memory since it started, bytes (ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _nbytes(tree) -> int:
    """Bytes of a pytree's arrays (or of their abstract shapes)."""
    import math

    import jax
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}


def train_config(spec: Spec, dtype: str):
    from jax_llama.train import TrainConfig
    return TrainConfig(batch_size=spec.batch, seq_len=spec.seq_len, dtype=dtype, steps=1000,
                       lr=1e-4, warmup_steps=0)


def frozen_behind_stop_gradient(loss):
    """`loss` with the frozen leaves behind stop_gradient: the step autodiff never takes through
    them, the reference for whether XLA drops their gradients from the real step."""
    import jax

    from jax_llama.lora import trainable

    def wrapped(params, batch, key):
        params = jax.tree.map(lambda p, t: p if t else jax.lax.stop_gradient(p), params,
                              trainable(params))
        return loss(params, batch, key)
    return wrapped


def measure(spec: Spec) -> dict:
    """In a worker: build, compile and time the LoRA step of spec.config; its memory."""
    import jax

    import jax_llama
    from jax_llama.lora import add_lora, count, trainable
    from jax_llama.train import init_state, jit_train_step, lm_loss, make_optimizer

    from .train import batch as random_batch

    phases, resets = {}, _reset_peak()
    started = time.perf_counter()
    model, params = jax_llama.init(spec.config, seed=0, dtype=spec.dtype, param_dtype=spec.dtype,
                                   remat=True, scan_layers=True)
    base_bytes = _nbytes(jax.block_until_ready(params))
    model, params = add_lora(model, params, LORA, seed=0)
    tc = train_config(spec, spec.dtype)
    optimizer = make_optimizer(tc, trainable)
    state = jax.block_until_ready(init_state(params, optimizer))
    labels = trainable(params)
    counts = {"total": count(params), "trainable": count(params, labels)}
    dtypes = sorted({str(x.dtype) for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(labels))
                     if not t})
    del params
    phases["build"] = {"seconds": time.perf_counter() - started, **_rss()}

    _reset_peak()
    step = jit_train_step(lm_loss(model), optimizer, tc, state, trainable=trainable)
    batch = jax.device_put(random_batch(spec))
    started = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - started
    phases["compile"] = {"seconds": compile_s, **_rss()}

    _reset_peak()
    holder, losses = {"state": state}, []
    del state

    def run():
        holder["state"], metrics = compiled(holder["state"], batch)
        losses.append(float(metrics["loss"]))  # waits for the step
    runs = timed(run, spec.warmup, spec.repeats)
    phases["steps"] = {"seconds": sum(runs), **_rss()}
    peak = _max_rss()
    opt_bytes = _nbytes(holder["state"].opt_state)

    # The same step with the frozen weights behind stop_gradient, compiled only (not run).
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), holder["state"])
    reference = jit_train_step(frozen_behind_stop_gradient(lm_loss(model)), optimizer, tc, shapes,
                               trainable=trainable).lower(shapes, batch).compile()
    step_memory, reference_memory = _memory(compiled), _memory(reference)
    return {"peak_rss_bytes": peak, "peak_rss_after_check_bytes": _max_rss(),
            "phases": phases if resets else None, "compile_s": compile_s, "runs_s": runs,
            "median_s": statistics.median(runs), "tokens_per_s": spec.batch * spec.seq_len /
            statistics.median(runs), "losses": losses, "parameters": counts,
            "base_bytes": base_bytes, "base_dtypes": dtypes, "optimizer_state_bytes": opt_bytes,
            "xla": {"step": step_memory, "frozen_behind_stop_gradient": reference_memory},
            # Computed, the frozen gradients would add buffers the size of the weights they
            # belong to; a difference under a tenth of the base's bytes means they are not.
            "frozen_gradients_dropped":
                step_memory["temp"] - reference_memory["temp"] < 0.1 * base_bytes}


def full_plan(spec: Spec) -> dict:
    """In a worker: XLA's memory plan for the full fine-tuning step in float32 (params, grads and
    AdamW state float32, no frozen leaves), compiled from abstract shapes: nothing allocated."""
    import jax
    import jax.numpy as jnp

    import jax_llama
    from jax_llama.train import init_state, lm_loss, lr_schedule, make_optimizer, make_train_step

    from .train import batch as random_batch
    tc = train_config(spec, "float32")
    model = jax_llama.Llama(spec.config, dtype=jnp.float32, remat=True, scan_layers=True)
    optimizer = make_optimizer(tc)
    state = jax.eval_shape(lambda: init_state(
        jax_llama.init(spec.config, scan_layers=True, remat=True)[1], optimizer))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), random_batch(spec))
    started = time.perf_counter()
    compiled = jax.jit(make_train_step(lm_loss(model), optimizer, lr_schedule(tc)),
                       donate_argnums=0).lower(state, batch).compile()
    return {"compile_s": time.perf_counter() - started, "state_bytes": _nbytes(state),
            "xla": _memory(compiled), "peak_rss_bytes": _max_rss()}


JOBS = {"lora": measure, "lora-full": full_plan}


# -- in the parent ----------------------------------------------------------------------------

def memory_total() -> int:
    """MemTotal of /proc/meminfo, bytes (the physical pages where there is no /proc)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def full_finetune(config: LlamaConfig, plan: dict, memory: int) -> list[dict]:
    """What full fine-tuning would hold, computed: per parameter, weights + gradients + AdamW's two
    moments; and XLA's plan for the float32 step (state, its temporaries, the outputs it cannot
    write in place). Each against this machine's memory."""
    n, x = count_params(config), plan["xla"]
    rows = [{"setup": "float32 weights, gradients and AdamW moments", "bytes_per_param": 16,
             "need_bytes": 16 * n},
            {"setup": "bfloat16 weights and gradients, float32 AdamW moments",
             "bytes_per_param": 12, "need_bytes": 12 * n},
            {"setup": "XLA's plan for the float32 step (state + temporaries + outputs not "
                      "written in place)", "bytes_per_param": None,
             "need_bytes": x["argument"] + x["temp"] + x["output"] - x["alias"]}]
    for row in rows:
        row["fits"] = row["need_bytes"] <= memory
    return rows


def run(config: LlamaConfig = PRESETS[PRESET], preset: str = PRESET, seq_len: int = SEQ_LEN,
        warmup: int = 1, repeats: int = 3) -> dict:
    """The LoRA step in one worker, the full fine-tuning plan in another; returns the JSON."""
    from .worker import cpu_model

    spec = Spec(config=config, dtype="bfloat16", batch=BATCH, seq_len=min(seq_len, config.max_seq_len),
                warmup=warmup, repeats=repeats)
    load_before, started = os.getloadavg(), time.perf_counter()
    say(f"LoRA: one train step of {preset} (rank {LORA.rank}, {len(LORA.targets)} targets, "
        f"batch {spec.batch} x {spec.seq_len}) in a worker process")
    step = spawn("lora", spec)
    say(f"LoRA step: peak RSS {step['peak_rss_bytes'] / GB:.2f} GB, {step['median_s']:.2f} s/step "
        f"({time.perf_counter() - started:.0f} s)")
    load_after = os.getloadavg()
    say("full fine-tuning: XLA's plan for the float32 step, from abstract shapes")
    plan = spawn("lora-full", spec)
    memory = memory_total()
    return {"preset": preset, "config": config.to_dict(), "dtype": spec.dtype,
            "batch": spec.batch, "seq_len": spec.seq_len, "warmup": warmup, "repeats": repeats,
            "lora": LORA.to_dict(), "remat": True, "scan_layers": True,
            "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "memory_total_bytes": memory, "load_average": {"before": load_before[0],
                                                           "after": load_after[0]},
            "target_rss_bytes": TARGET_RSS, "step": step,
            "full_finetune": {"plan": plan, "rows": full_finetune(config, plan, memory)},
            "seconds": time.perf_counter() - started}


def markdown(result: dict) -> list[str]:
    s, config = result["step"], LlamaConfig.from_dict(result["config"])
    p, lora = s["parameters"], LoraConfig.from_dict(result["lora"])
    memory = result["memory_total_bytes"]
    met = "met" if s["peak_rss_bytes"] <= result["target_rss_bytes"] else "**not met**"
    step_x, ref_x = s["xla"]["step"], s["xla"]["frozen_behind_stop_gradient"]
    lines = [f"## LoRA: one train step of {result['preset']} on this machine, against full "
             f"fine-tuning", "",
             f"Machine: {result['cpu']}, {result['cores']} cores, {memory / GB:.1f} GB memory "
             f"(MemTotal); load average {result['load_average']['before']:.1f} before the step's "
             f"worker, {result['load_average']['after']:.1f} after", "",
             f"Model: {result['preset']}: {describe(config)}, random weights; base "
             f"{'/'.join(s['base_dtypes'])} and frozen, compute {result['dtype']}, remat, "
             f"scan_layers", "",
             f"LoRA: rank {lora.rank}, alpha {lora.alpha:g}, on {', '.join(lora.targets)}; adapters "
             f"and their AdamW state float32. Step: batch {result['batch']} x {result['seq_len']} "
             f"random tokens, AdamW with clipping (jax_llama.train, the frozen weights partitioned "
             f"out by optax.multi_transform), in a worker process of its own: compiled, "
             f"{result['warmup']} warm-up and {result['repeats']} timed steps (the median)", "",
             "| LoRA step | measured |", "|---|---|",
             f"| peak RSS of the process | {s['peak_rss_bytes'] / GB:.2f} GB (target at most "
             f"{result['target_rss_bytes'] / GB:.0f} GB: {met}) |"]
    if s["phases"]:
        lines.append("| peak RSS by phase | " + ", ".join(
            f"{name} {ph['VmHWM'] / GB:.2f} GB" for name, ph in s["phases"].items()) + " |")
    lines += [f"| s/step | {s['median_s']:.2f} (runs: {', '.join(f'{t:.2f}' for t in s['runs_s'])}) |",
              f"| tokens/s | {s['tokens_per_s']:,.1f} |",
              f"| compile (s) | {s['compile_s']:.1f} |",
              f"| trainable parameters | {p['trainable']:,} of {p['total']:,} "
              f"({p['trainable'] / p['total']:.2%}) |",
              f"| optimizer state | {s['optimizer_state_bytes'] / 1e6:,.1f} MB "
              f"({s['optimizer_state_bytes'] / p['trainable']:.2f} bytes per trainable parameter) |",
              f"| base weights | {s['base_bytes'] / GB:.2f} GB |",
              f"| XLA's temporaries: the step / frozen weights behind stop_gradient | "
              f"{step_x['temp'] / GB:.3f} GB / {ref_x['temp'] / GB:.3f} GB: frozen gradients "
              f"{'not computed' if s['frozen_gradients_dropped'] else '**computed**'} |",
              f"| losses | {', '.join(f'{x:.4f}' for x in s['losses'])} |",
              "", f"Full fine-tuning of {result['preset']} ({count_params(config):,} parameters): "
              f"computed, not run", "",
              f"| full fine-tuning | bytes/param | need | against {memory / GB:.1f} GB |",
              "|---|---|---|---|"]
    for row in result["full_finetune"]["rows"]:
        per = "-" if row["bytes_per_param"] is None else str(row["bytes_per_param"])
        verdict = ("fits on paper (not run)" if row["fits"] else "does not fit")
        lines.append(f"| {row['setup']} | {per} | {row['need_bytes'] / GB:.1f} GB | {verdict} |")
    return lines


def write(result: dict, command: str, directory) -> str:
    """DIRECTORY/lora_bench.json (the figures and the command) and DIRECTORY/lora_bench.md;
    returns the markdown."""
    import json
    from pathlib import Path

    from bridge.atomic import write_text
    text = "\n".join(["# LoRA memory", "", f"Reproduce: `{command}`", "", *markdown(result)]) + "\n"
    write_text(Path(directory) / "lora_bench.json",
               json.dumps({"command": command, **result}, indent=2) + "\n")
    write_text(Path(directory) / "lora_bench.md", text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny preset, 32 tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--out", default=".", help="directory for lora_bench.{md,json} (default .)")
    args = parser.parse_args(argv)
    kw = dict(QUICK, repeats=min(args.repeats, QUICK["repeats"])) if args.quick else \
        dict(preset=PRESET, repeats=args.repeats)
    preset = kw.pop("preset")
    command = shlex.join(["python", "-m", "llama_twins.bench.lora",
                          *(["--quick"] if args.quick else []), "--repeats", str(kw["repeats"]),
                          "--out", args.out])
    say(f"$ {command}")
    sys.stdout.write(write(run(PRESETS[preset], preset, **kw), command, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
