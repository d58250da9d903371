"""LoRA memory: one train step of llama3.2-1b with rank-16 adapters on all seven projections, on
this machine, against what full fine-tuning of the same model would need.

The LoRA step runs in a worker process of its own, so that its peak RSS is that process's alone:
random weights built in bfloat16 one tensor at a time and frozen; float32 adapters (rank 16, alpha
32) and their AdamW state; remat and scan_layers; batch 1 x 256 random tokens. Reported: the
process's peak RSS and each phase's (build, compile, steps), seconds per step (the median of the
timed steps; compile timed apart), trainable parameters, the optimizer state's bytes, XLA's buffer
plan; and whether XLA computes the frozen weights' gradients, found by comparing the step's
temporaries with those of the same step where the frozen weights sit behind stop_gradient. The
step runs twice, each in its own worker: as jax_llama.training.step.jit_train_step compiles it, and with
XLA's defaults (VARIANTS says why).

Full fine-tuning is computed, never run: bytes per parameter for weights, gradients and AdamW's
moments, and XLA's own plan for the float32 step, compiled from abstract shapes in a third worker
(nothing allocated), each against this machine's memory.

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

from .common import Spec, cpu_model, describe, say, spawn, timed

PRESET = "llama3.2-1b"
LORA = LoraConfig(rank=16, alpha=32.0)        # all seven targets (LoraConfig's default)
BATCH, SEQ_LEN = 1, 256
TARGET_RSS = 8e9                              # the target for the LoRA step, bytes
QUICK = dict(preset="tiny", seq_len=32, repeats=2)
# XLA's CPU backend computes bfloat16 dots in float32; with its defaults, its while-loop invariant
# code motion then converts each stacked weight whole, outside the layer loop: a float32 copy of
# the frozen layers among the step's temporaries. jit_train_step compiles bfloat16 params on the
# CPU without that pass (jax_llama.training.step.compiler_options); the XLA-defaults step shows what that
# saves.
VARIANTS = ("jit_train_step", "XLA defaults")
GB = 1e9


# -- in the worker ----------------------------------------------------------------------------

def _rss() -> dict[str, int | None]:
    """This process's resident memory now (VmRSS) and at its peak since the last reset (VmHWM);
    without /proc, the peak since it started and no current figure."""
    found = {"VmRSS": None, "VmHWM": None}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in found:
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return {"VmRSS": found["VmRSS"], "VmHWM": found["VmHWM"] or _max_rss()}


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
    from jax_llama.training.step import TrainConfig
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


EMBEDDING = ("tok_embeddings", "embedding")
EMBEDDING_STD = 0.02  # jax_llama.model's N(0, 0.02) of the embedding table


def random_weights(model, seed: int = 0, block_rows: int = 8192):
    """Random params for `model`, built so that the peak is the weights plus one tensor's worth:
    one jitted program per leaf (model.init, of which XLA builds that leaf alone: the same values
    as jax_llama.init), and the embedding table drawn N(0, 0.02) `block_rows` rows at a time into
    a donated buffer (other values than jax_llama.init's, the same distribution). Drawn whole, as
    jax_llama.init draws it, jax.random.normal holds 8 bytes of temporaries per element: 4.2 GB
    for llama3.2-1b's table, beside 2.5 GB of bfloat16 weights."""
    import jax
    import jax.numpy as jnp
    from flax import traverse_util

    key, tokens = jax.random.key(seed), jnp.zeros((1, 1), jnp.int32)
    shapes = traverse_util.flatten_dict(jax.eval_shape(model.init, key, tokens)["params"])
    leaf = lambda key, path: traverse_util.flatten_dict(model.init(key, tokens)["params"])[path]  # noqa: E731
    params = {path: jax.block_until_ready(jax.jit(leaf, static_argnums=1)(key, path))
              for path in shapes if path != EMBEDDING}
    if EMBEDDING in shapes:
        (V, D), dtype = shapes[EMBEDDING].shape, shapes[EMBEDDING].dtype
        rows = min(block_rows, V)

        def put(table_VD, i):  # rows [i * rows, (i + 1) * rows), the last block clamped to V
            block = jax.random.normal(jax.random.fold_in(key, i), (rows, D), jnp.float32)
            return jax.lax.dynamic_update_slice(table_VD, (block * EMBEDDING_STD).astype(dtype),
                                                (i * rows, 0))
        put = jax.jit(put, donate_argnums=0)
        table_VD = jnp.zeros((V, D), dtype)
        for i in range(-(-V // rows)):
            table_VD = put(table_VD, i)
        params[EMBEDDING] = jax.block_until_ready(table_VD)
    return traverse_util.unflatten_dict(params)


def measure(spec: Spec, variant: str = VARIANTS[0]) -> dict:
    """In a worker: build, compile and time the LoRA step of spec.config; its memory. variant:
    the step as jit_train_step compiles it, or "XLA defaults" (jitted with no compiler options)."""
    import jax
    import jax.numpy as jnp

    import jax_llama
    from jax_llama.lora import add_lora, count, trainable
    from jax_llama.training.step import (compiler_options, init_state, jit_train_step, lm_loss,
                                 lr_schedule, make_optimizer, make_train_step)

    from .train import batch as random_batch

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    phases, resets = {}, _reset_peak()
    started = time.perf_counter()
    dtype = jnp.dtype(spec.dtype)
    model = jax_llama.Llama(spec.config, dtype=dtype, param_dtype=dtype, remat=True, scan_layers=True)
    params = random_weights(model, seed=0)
    base_bytes, layer_bytes = _nbytes(params), _nbytes(params.get("layers", {}))
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
    def jitted(loss, state):
        if variant == "XLA defaults":
            return jax.jit(make_train_step(loss, optimizer, lr_schedule(tc), tc.grad_accum, tc.seed,
                                           trainable), donate_argnums=0)
        return jit_train_step(loss, optimizer, tc, state, trainable=trainable)
    options = None if variant == "XLA defaults" else compiler_options(state.params)
    step = jitted(lm_loss(model), state)
    batch = jax.device_put(random_batch(spec))
    started = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - started
    phases["compile"] = {"seconds": compile_s, **_rss()}

    _reset_peak()
    holder, losses, cpu_runs = {"state": state}, [], []
    del state

    def run():  # CPU seconds too (all threads): less swayed than wall time by other processes
        cpu = sum(os.times()[:2])
        holder["state"], metrics = compiled(holder["state"], batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        cpu_runs.append(sum(os.times()[:2]) - cpu)
    runs = timed(run, spec.warmup, spec.repeats)
    cpu_runs = cpu_runs[spec.warmup:]
    phases["steps"] = {"seconds": sum(runs), **_rss()}
    # clear_refs resets ru_maxrss too: the process's peak is the largest of its phases'
    peak = max([_max_rss(), *(ph["VmHWM"] for ph in phases.values())])
    opt_bytes = _nbytes(holder["state"].opt_state)

    # The same step with the frozen weights behind stop_gradient, compiled only (not run).
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), holder["state"])
    reference = jitted(frozen_behind_stop_gradient(lm_loss(model)), shapes).lower(shapes,
                                                                                 batch).compile()
    step_memory, reference_memory = _memory(compiled), _memory(reference)
    return {"variant": variant, "compiler_options": options, "peak_rss_bytes": peak,
            "step_peak_rss_bytes": phases["steps"]["VmHWM"] if resets else None,
            "phases": phases if resets else None, "compile_s": compile_s, "runs_s": runs,
            "median_s": statistics.median(runs), "cpu_runs_s": cpu_runs,
            "median_cpu_s": statistics.median(cpu_runs), "tokens_per_s": spec.batch * spec.seq_len /
            statistics.median(runs), "losses": losses, "parameters": counts,
            "base_bytes": base_bytes, "base_layer_bytes": layer_bytes, "base_dtypes": dtypes,
            "optimizer_state_bytes": opt_bytes,
            "xla": {"step": step_memory, "frozen_behind_stop_gradient": reference_memory},
            # Computed, the frozen gradients would add buffers the size of the weights they
            # belong to; a difference under a tenth of the base's bytes means they are not.
            "frozen_gradients_dropped":
                step_memory["temp"] - reference_memory["temp"] < 0.1 * base_bytes}


def full_plan(spec: Spec, variant: str | None = None) -> dict:
    """In a worker: XLA's memory plan for the full fine-tuning step in float32 (params, grads and
    AdamW state float32, no frozen leaves), compiled from abstract shapes: nothing allocated."""
    import jax
    import jax.numpy as jnp

    import jax_llama
    from jax_llama.training.step import init_state, jit_train_step, lm_loss, make_optimizer

    from .train import batch as random_batch
    tc = train_config(spec, "float32")
    model = jax_llama.Llama(spec.config, dtype=jnp.float32, remat=True, scan_layers=True)
    optimizer = make_optimizer(tc)
    state = jax.eval_shape(lambda: init_state(
        jax_llama.init(spec.config, scan_layers=True, remat=True)[1], optimizer))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), random_batch(spec))
    started = time.perf_counter()
    compiled = jit_train_step(lm_loss(model), optimizer, tc, state).lower(state, batch).compile()
    return {"compile_s": time.perf_counter() - started, "state_bytes": _nbytes(state),
            "seq_len": spec.seq_len, "xla": _memory(compiled), "peak_rss_bytes": _max_rss()}


JOBS = {"lora": measure, "lora-full": full_plan}


# -- in the parent ----------------------------------------------------------------------------

def memory_total() -> int:
    """This machine's memory, bytes (MemTotal)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def planned(x: dict[str, int]) -> int:
    """What a compiled step holds at once by XLA's plan: its arguments, temporaries, and outputs
    not written in place of a donated argument."""
    return x["argument"] + x["temp"] + x["output"] - x["alias"]


def full_finetune(config: LlamaConfig, plan: dict, memory: int, runtime: int) -> list[dict]:
    """What full fine-tuning would hold, computed: per parameter, weights + gradients + AdamW's two
    moments; and XLA's plan for the float32 step plus `runtime` (what the LoRA worker held beyond
    its step's plan: Python, JAX, the compiled code). Each against this machine's memory."""
    n = count_params(config)
    rows = [{"setup": "float32 weights, gradients and AdamW moments", "bytes_per_param": 16,
             "need_bytes": 16 * n},
            {"setup": "bfloat16 weights and gradients, float32 AdamW moments",
             "bytes_per_param": 12, "need_bytes": 12 * n},
            {"setup": f"XLA's plan for the float32 step (batch 1 x {plan['seq_len']}, remat) + "
                      f"the runtime ({runtime / GB:.1f} GB, as measured in the LoRA worker)",
             "bytes_per_param": None, "need_bytes": planned(plan["xla"]) + runtime}]
    for row in rows:
        row["spare_bytes"] = memory - row["need_bytes"]
        row["fits"] = row["spare_bytes"] >= 0
    return rows


def run(config: LlamaConfig = PRESETS[PRESET], preset: str = PRESET, seq_len: int = SEQ_LEN,
        warmup: int = 1, repeats: int = 3) -> dict:
    """The LoRA step in one worker per variant, the full fine-tuning plan in another; returns the
    JSON."""
    spec = Spec(config=config, dtype="bfloat16", batch=BATCH, seq_len=min(seq_len, config.max_seq_len),
                warmup=warmup, repeats=repeats)
    started, steps = time.perf_counter(), {}
    for name in VARIANTS:
        say(f"LoRA: one train step of {preset} (rank {LORA.rank}, {len(LORA.targets)} targets, "
            f"batch {spec.batch} x {spec.seq_len}), {name}, in a worker process")
        load_before, begun = os.getloadavg()[0], time.perf_counter()
        steps[name] = spawn("lora", spec, extra=("--variant", name))
        steps[name]["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
        say(f"LoRA step, {name}: peak RSS {steps[name]['peak_rss_bytes'] / GB:.2f} GB, "
            f"{steps[name]['median_s']:.2f} s/step ({time.perf_counter() - begun:.0f} s)")
    say("full fine-tuning: XLA's plan for the float32 step, from abstract shapes")
    plan = spawn("lora-full", spec)
    memory, first = memory_total(), next(iter(steps.values()))
    runtime = max((first["step_peak_rss_bytes"] or first["peak_rss_bytes"])
                  - planned(first["xla"]["step"]), 0)
    return {"preset": preset, "config": config.to_dict(), "dtype": spec.dtype,
            "batch": spec.batch, "seq_len": spec.seq_len, "warmup": warmup, "repeats": repeats,
            "lora": LORA.to_dict(), "remat": True, "scan_layers": True,
            "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "memory_total_bytes": memory, "target_rss_bytes": TARGET_RSS, "steps": steps,
            "full_finetune": {"plan": plan, "runtime_bytes": runtime,
                              "rows": full_finetune(config, plan, memory, runtime)},
            "seconds": time.perf_counter() - started}


def markdown(result: dict) -> list[str]:
    config, lora = LlamaConfig.from_dict(result["config"]), LoraConfig.from_dict(result["lora"])
    steps, memory, target = result["steps"], result["memory_total_bytes"], result["target_rss_bytes"]
    first = next(iter(steps.values()))
    p = first["parameters"]
    row = lambda label, cell: f"| {label} | " + " | ".join(cell(s) for s in steps.values()) + " |"  # noqa: E731
    lines = [f"## LoRA: one train step of {result['preset']} on this machine, against full "
             f"fine-tuning", "",
             f"Machine: {result['cpu']}, {result['cores']} cores, {memory / GB:.1f} GB memory "
             f"(MemTotal)", "",
             f"Model: {result['preset']}: {describe(config)}, random weights (built one tensor at "
             f"a time, the embedding table in blocks of rows); base "
             f"{'/'.join(first['base_dtypes'])} and frozen, compute {result['dtype']}, remat, "
             f"scan_layers", "",
             f"LoRA: rank {lora.rank}, alpha {lora.alpha:g}, on {', '.join(lora.targets)}; "
             f"adapters and their AdamW state float32. Step: batch {result['batch']} x "
             f"{result['seq_len']} random tokens, AdamW with clipping (jax_llama.training.step; the frozen "
             f"weights partitioned out by optax.multi_transform), each column in a worker process "
             f"of its own: compiled, {result['warmup']} warm-up and {result['repeats']} timed "
             f"steps (the median)", "",
             "| LoRA step | " + " | ".join(steps) + " |", "|---|" + "---|" * len(steps),
             row("compiler options", lambda s: ", ".join(
                 f"`{k}={v}`" for k, v in (s["compiler_options"] or {}).items()) or "none"),
             row("peak RSS of the process", lambda s: f"{s['peak_rss_bytes'] / GB:.2f} GB "
                 f"(target {target / GB:.0f} GB: "
                 f"{'met' if s['peak_rss_bytes'] <= target else '**not met**'})")]
    if all(s["phases"] for s in steps.values()):
        lines.append(row("peak RSS by phase", lambda s: ", ".join(
            f"{name} {ph['VmHWM'] / GB:.2f} GB" for name, ph in s["phases"].items())))
    lines += [row("XLA's buffers: arguments / temporaries", lambda s: (
                  f"{s['xla']['step']['argument'] / GB:.2f} GB / {s['xla']['step']['temp'] / GB:.2f} GB")),
              row("frozen weights' gradients", lambda s: (
                  "not computed" if s["frozen_gradients_dropped"] else "**computed**") +
                  f" (temporaries with the frozen weights behind stop_gradient: "
                  f"{s['xla']['frozen_behind_stop_gradient']['temp'] / GB:.2f} GB)"),
              row("s/step", lambda s: f"{s['median_s']:.2f} (runs "
                  f"{', '.join(f'{t:.2f}' for t in s['runs_s'])})"),
              row("tokens/s", lambda s: f"{s['tokens_per_s']:,.1f}"),
              row("CPU s/step (user + system, all threads)", lambda s: f"{s['median_cpu_s']:.1f} "
                  f"(runs {', '.join(f'{t:.1f}' for t in s['cpu_runs_s'])})"),
              row("compile (s)", lambda s: f"{s['compile_s']:.1f}"),
              row("load average before, after", lambda s: f"{s['load_average']['before']:.1f}, "
                  f"{s['load_average']['after']:.1f}"),
              row("losses (warm-up, timed)", lambda s: ", ".join(f"{x:.4f}" for x in s["losses"])),
              *_contention(steps, result["cores"]), *_diagnosis(steps),
              "", f"Trainable parameters: {p['trainable']:,} of {p['total']:,} "
              f"({p['trainable'] / p['total']:.2%}); optimizer state "
              f"{first['optimizer_state_bytes'] / 1e6:,.1f} MB "
              f"({first['optimizer_state_bytes'] / p['trainable']:.2f} bytes per trainable "
              f"parameter); base weights {first['base_bytes'] / GB:.2f} GB", "",
              f"Full fine-tuning of {result['preset']} ({count_params(config):,} parameters): "
              f"computed, not run", "",
              f"| full fine-tuning | bytes/param | need | against {memory / GB:.2f} GB |",
              "|---|---|---|---|"]
    for r in result["full_finetune"]["rows"]:
        per = "-" if r["bytes_per_param"] is None else str(r["bytes_per_param"])
        verdict = (f"fits on paper, {r['spare_bytes'] / GB:.2f} GB to spare (not run)" if r["fits"]
                   else f"does not fit ({-r['spare_bytes'] / GB:.2f} GB short)")
        lines.append(f"| {r['setup']} | {per} | {r['need_bytes'] / GB:.2f} GB | {verdict} |")
    return lines


def _contention(steps: dict, cores: int) -> list[str]:
    """A paragraph when other processes shared the CPU (a load average above the cores)."""
    load = max(max(s["load_average"].values()) for s in steps.values())
    if load <= cores:
        return []
    return ["", f"Other processes shared the CPU during these steps (load average up to "
                f"{load:.1f} on {cores} cores): the wall times are inflated, and the CPU seconds "
                f"per step are the steadier figure to compare."]


def _diagnosis(steps: dict) -> list[str]:
    """What the XLA settings' difference in temporaries is, when it is the float32 copy of the
    stacked layer weights (within 5%): a paragraph; else nothing."""
    temps = {name: s["xla"]["step"]["temp"] for name, s in steps.items()}
    (default, most), (name, least) = max(temps.items(), key=lambda kv: kv[1]), min(
        temps.items(), key=lambda kv: kv[1])
    copy = 2 * next(iter(steps.values()))["base_layer_bytes"]  # bfloat16 -> float32
    if copy == 0 or abs((most - least) - copy) > 0.05 * copy:
        return []
    return ["", f"Why the {default} step holds {(most - least) / GB:.2f} GB more temporaries "
                f"than the {name} one: XLA's CPU backend computes bfloat16 dots in float32, "
                f"and its while-loop invariant code motion converts each stacked layer weight "
                f"whole, outside the layer loop: a float32 copy of all the frozen layers "
                f"({copy / GB:.2f} GB) held through the step. Without that pass the conversion "
                f"stays in the loop, one layer at a time."]


def write(result: dict, command: str, directory) -> str:
    """DIRECTORY/lora_bench.json (the figures and the command, stamped by llama_twins.results)
    and DIRECTORY/lora_bench.md made from it; returns the markdown."""
    from .. import results

    lines = ["# LoRA memory", "", f"Reproduce: `{command}`", "", *markdown(result)]
    return results.write("lora_bench", {"command": command, **result}, lines, directory)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny preset, 32 tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--out", default=".", help="directory for lora_bench.{md,json} (default .)")
    args = parser.parse_args(argv)
    preset = QUICK["preset"] if args.quick else PRESET
    repeats = min(args.repeats, QUICK["repeats"]) if args.quick else args.repeats
    command = shlex.join(["python", "-m", "llama_twins.bench.lora",
                          *(["--quick"] if args.quick else []), "--repeats", str(repeats),
                          "--out", args.out])
    say(f"$ {command}")
    result = run(PRESETS[preset], preset, repeats=repeats,
                 **({"seq_len": QUICK["seq_len"]} if args.quick else {}))
    sys.stdout.write(write(result, command, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
