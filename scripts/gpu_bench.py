"""Train-step MFU and decode's fraction of the HBM bound on an NVIDIA GPU, for llama3.2-1b shapes
(random weights), jax-llama against the torch twin and transformers on the same work.

- machine: the GPU, its bfloat16 matmul rate (8192^3, measured through JAX) and its memory
  bandwidth (a read-only sum and a matrix-vector product over 4 GiB, and a copy);
- train: one AdamW step (clipping, warmup-cosine schedule) on a batch of 2,048-token rows in
  bfloat16 compute with float32 params (autocast on the torch side), the largest of --batches
  that fits; tokens/s and MFU = the PaLM-appendix FLOPs (llama_twins.bench.train) over the chip's
  dense bfloat16 peak (989.4 TFLOP/s, the H100 / H200 SXM datasheet) and over the measured rate;
- decode: greedy after a 16-token prompt, batch 1 and 32, bfloat16 and int8 weights; a step's
  time is that of 240 new tokens less that of 120, over 120; tokens/s and the fraction of the HBM
  bound (the bytes a step must read - weights and KV cache - over the measured read bandwidth).

Each measurement runs in a process of its own (JAX and torch each take the GPU's memory), killed
past --job-timeout. Writes OUT/gpu.json (every figure, the command, the commit) and OUT/gpu.md.

    python scripts/gpu_bench.py --out DIR [--only machine,train,decode] [--batches 16,8,4]
    python scripts/gpu_bench.py --render results/gpu/gpu.json   # results/gpu/gpu.md from it
    python scripts/gpu_bench.py --out DIR --preset tiny --seq-len 64 --batches 2 --attention xla
                                                            # a smoke run on a CPU: seconds
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpu_profile import pack_profiles, summarise_trace
from llama_twins import results

DATASHEET_BF16_FLOPS = 989.4e12  # dense bfloat16, H100 / H200 SXM (NVIDIA's datasheet)
# the shape measured; --preset / --seq-len change it (a smoke run on a CPU), for the jobs too
PRESET, SEQ_LEN = os.environ.get("GPU_BENCH_SHAPE", "llama3.2-1b,2048").split(",")
SEQ_LEN = int(SEQ_LEN)
DECODE_BATCHES = (1, 32)
DECODE_SHORT, DECODE_LONG = 120, 240  # new tokens after the 16-token prompt: one 256-slot cache
IMPLS = ("jax-llama", "torch_llama", "transformers")


def say(message: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def spec(**changes):
    from bridge.config import PRESETS
    from llama_twins.bench.common import Spec
    base = dict(config=PRESETS[PRESET], dtype="bfloat16", seq_len=SEQ_LEN, batch=8, warmup=2,
                repeats=5, prompt_len=16, new_tokens=128, decode_batches=DECODE_BATCHES)
    return Spec(**{**base, **changes})


# -- jobs, each in its own process ---------------------------------------------------------------

def job_machine(_: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    from jax_llama.perf import measure_matmul_peak, measure_read_bandwidth
    gpu = jax.default_backend() == "gpu"  # else a smoke run: sizes a CPU does in seconds
    x = jnp.ones((2**30 if gpu else 2**26,), jnp.float32)  # 4 GiB, well past the 60 MB L2
    copy = jax.jit(lambda a: a + 1.0)
    copy(x).block_until_ready()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "torch": torch.__version__,
            "torch_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "bf16_matmul_flops": measure_matmul_peak("bfloat16", n=8192 if gpu else 1024, repeats=10),
            "read_bytes_per_s": measure_read_bandwidth(nbytes=x.nbytes, repeats=10),
            "copy_bytes_per_s": 2 * x.nbytes / statistics.median(times)}


def job_train(args: dict) -> dict:
    from llama_twins.bench.common import timed
    from llama_twins.bench.train import jax_step, torch_step
    s = spec(batch=args["batch"], repeats=5)
    if args["impl"] == "jax-llama":
        import jax
        step, sync = jax_step(s, attention=args.get("attention", "auto"))
        times = timed(step, s.warmup, s.repeats, sync)
        peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    else:
        import torch
        step, sync = torch_step(s, args["impl"])
        times = timed(step, s.warmup, s.repeats, sync)
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {"step_s": times, "peak_bytes": peak}


def job_decode(args: dict) -> dict:
    """Seconds of generating DECODE_SHORT and DECODE_LONG new tokens at one batch: both lengths
    fill the same 256-slot KV cache, so JAX compiles one prefill and one decode program for the
    two, and the difference of the two is decoding alone. The first call (compiling) is timed
    apart; then short and long alternate. Each phase is said on stderr as it ends, so a job
    killed at its limit leaves where it was."""
    from llama_twins.bench.decode import jax_runner, transformers_runner, twin_runner
    start = time.perf_counter()
    if args.get("init") == "device":  # random params leaf by leaf on the GPU: seconds
        import jax_llama
        jax_llama.init = random_init(jax_llama.init)
        if args.get("quantize") == "int4":  # random 4-bit params of quantize's layout
            jax_llama.quantize = random_int4
    elif args.get("init") == "host":  # random params made on the CPU, then put on the GPU
        import jax

        import jax_llama
        made_on_device = jax_llama.init

        def init_on_host(*a, **k):
            with jax.default_device(jax.devices("cpu")[0]):
                model, params = made_on_device(*a, **k)
            return model, jax.device_put(params, jax.devices()[0])
        jax_llama.init = init_on_host
    if args.get("fuse"):  # an experiment: q|k|v and gate|up each one matmul
        fuse_projections()
    s = spec(quantize=args.get("quantize"))
    run, sync = {"jax-llama": jax_runner, "torch_llama": twin_runner,
                 "transformers": transformers_runner}[args["impl"]](s)
    sync()
    build = time.perf_counter() - start
    say(f"  model built in {build:.1f} s")
    batch = args["batch"]

    def seconds(n: int) -> float:
        begin = time.perf_counter()
        run(batch, n)
        sync()
        return time.perf_counter() - begin

    first = seconds(DECODE_SHORT)
    say(f"  first call ({DECODE_SHORT} new tokens, compiling): {first:.1f} s")
    short, long = [], []
    for _ in range(2):
        short.append(seconds(DECODE_SHORT))
        long.append(seconds(DECODE_LONG))
        say(f"  {DECODE_SHORT} new tokens {short[-1]:.3f} s, {DECODE_LONG}: {long[-1]:.3f} s")
    peak = profile = None
    if args["impl"] == "jax-llama":
        import jax
        peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        if args.get("profile"):  # one more long call under JAX's profiler
            folder = Path(args["profile"])
            with jax.profiler.trace(str(folder)):
                seconds(DECODE_LONG)
            profile = summarise_trace(folder, DECODE_LONG)
            say(f"  profiled: {json.dumps(profile['per_step'])}")
    return {"build_s": build, "first_call_s": first, "short_s": short, "long_s": long,
            "peak_bytes": peak, "profile": profile}


def random_init(init):
    """jax_llama.init's model with random params made leaf by leaf on the default device: N(0,
    0.02) weights, norms at one. (jax_llama.init of llama3.2-1b compiles its whole random
    initialisation as one program on a GPU: more than 76 s, results/gpu/gpu_probe.md.)"""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def normal(key, shape, dtype):
        return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)

    def made(config, seed=0, **kw):
        box = {}

        def shapes():
            box["model"], params = init(config, seed, **kw)
            return params
        tree = jax.eval_shape(shapes)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        key = jax.random.key(seed)
        arrays = [jnp.ones(s.shape, s.dtype) if "norm" in jax.tree_util.keystr(path)
                  else normal(jax.random.fold_in(key, i), s.shape, s.dtype)
                  for i, (path, s) in enumerate(leaves)]
        return box["model"], jax.tree_util.tree_unflatten(treedef, arrays)
    return made


def fuse_projections():
    """Make the model run the projections that read the same input (q, k, v; gate, up) as one
    matmul of their kernels side by side, as params saying so hold them ("wq+wk+wv", "w1+w3"),
    and make jax_llama.init's params so: fewer, larger kernels per layer."""
    import jax.numpy as jnp
    import numpy as np

    import jax_llama
    from jax_llama.model import llama
    separate, init = llama.project, jax_llama.init

    def project(module, x_MD, kernel_init, **features):
        params = module.variables.get("params", {})
        name = "+".join(features)
        if name not in params:
            return separate(module, x_MD, kernel_init, **features)
        y = jnp.dot(x_MD.astype(module.dtype), params[name]["kernel"].astype(module.dtype))
        return jnp.split(y, np.cumsum(list(features.values()))[:-1].tolist(), axis=-1)

    def fused(node):
        if not isinstance(node, dict):
            return node
        node = {k: fused(v) for k, v in node.items()}
        for group in (("wq", "wk", "wv"), ("w1", "w3")):
            if all(g in node and set(node[g]) == {"kernel"} for g in group):
                kernel = jnp.concatenate([node.pop(g)["kernel"] for g in group], axis=-1)
                node["+".join(group)] = {"kernel": kernel}
        return node

    def made(*a, **k):
        model, params = init(*a, **k)
        return model, fused(params)
    llama.project, jax_llama.init = project, made


def random_int4(params, group_size=None, method="int4", progress=False):
    """Random 4-bit params in jax_llama.quantize(params, method="int4")'s layout, made on the
    device (quantising 1.2 B weights on the host takes about a minute): each projection's kernel
    (in, out) becomes random uint8 (out, in / 2) with float16 scale and min (out, in / 32); a tied
    embedding (vocab, dim) int8 with a float32 scale (vocab, 1). The decode's speed does not
    depend on the values."""
    import jax
    import jax.numpy as jnp

    from bridge.int4 import GROUP
    key = jax.random.key(1)

    def four(node, depth=0):
        if not isinstance(node, dict):
            return node
        if set(node) == {"kernel"} and node["kernel"].ndim == 2:
            inputs, out = node["kernel"].shape
            k = jax.random.fold_in(key, inputs * 131071 + out + depth)
            scale = jnp.full((out, inputs // GROUP), 0.02 / 8, jnp.float16)
            return {"kernel": jax.random.bits(k, (out, inputs // 2), jnp.uint8),
                    "scale": scale, "min": -8 * scale}
        if set(node) == {"embedding"}:
            vocab, dim = node["embedding"].shape
            q = jax.random.randint(key, (vocab, dim), -127, 128, jnp.int8)
            return {"embedding": q, "scale": jnp.full((vocab, 1), 0.02 / 127, jnp.float32)}
        return {name: four(child, depth + 1) for name, child in node.items()}
    return four(params)


def job_init(args: dict) -> dict:
    """Where jax_llama.init's time goes on this device: lowering, compiling, running."""
    import jax
    import jax.numpy as jnp

    from jax_llama.model.llama import Llama
    s = spec()
    model = Llama(s.config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    times = {}
    start = time.perf_counter()
    lowered = jax.jit(model.init).lower(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    times["lower_s"] = time.perf_counter() - start
    say(f"  lowered in {times['lower_s']:.1f} s")
    start = time.perf_counter()
    compiled = lowered.compile()
    times["compile_s"] = time.perf_counter() - start
    say(f"  compiled in {times['compile_s']:.1f} s")
    start = time.perf_counter()
    jax.block_until_ready(compiled(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    times["run_s"] = time.perf_counter() - start
    say(f"  ran in {times['run_s']:.1f} s")
    return times


JOBS = {"machine": job_machine, "train": job_train, "decode": job_decode, "init": job_init}


def run_job(name: str, args: dict, timeout: float) -> dict:
    """The job's JSON, or {"error": why, with the last lines it said}. Its stderr goes to a file
    as it runs and is echoed after, so a job killed at its limit still tells where it was."""
    import tempfile
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.92", PYTHONUNBUFFERED="1")
    if args.get("xla_flags"):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {args['xla_flags']}".strip()
    command = [sys.executable, __file__, "--job", name, "--args", json.dumps(args)]
    say(f"{name} {args}")
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        try:
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=err, text=True,
                                  timeout=timeout, env=env)
            failure = None if done.returncode == 0 else f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"killed after {timeout:.0f} s"
        err.seek(0)
        said = err.read().strip().splitlines()
    sys.stderr.write("".join(f"    {line}\n" for line in said[-20:]))
    say(f"  {time.perf_counter() - start:.0f} s, {failure or 'done'}")
    if failure:
        return {"error": "; ".join([failure, *said[-6:]])}
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the figures -------------------------------------------------------------------------------

def train_row(result: dict, batch: int, machine: dict) -> dict:
    from jax_llama.perf import train_flops_per_token
    if "error" in result:
        return {"batch": batch, **result}
    s = spec(batch=batch)
    tokens = batch * SEQ_LEN
    step = statistics.median(result["step_s"])
    flops = train_flops_per_token(s.config, SEQ_LEN) * tokens / step
    return {"batch": batch, "step_s": step, "runs_s": result["step_s"],
            "tokens_per_s": tokens / step, "model_flops_per_s": flops,
            "mfu": flops / DATASHEET_BF16_FLOPS,
            "mfu_of_measured_peak": flops / machine["bf16_matmul_flops"] if machine else None,
            "peak_bytes": result.get("peak_bytes")}


def step_bytes(quantize: str | None, batch: int) -> float:
    """Bytes one decode step must read: the weights (jax_llama.perf) and each row's KV cache at
    the mean context of the timed steps (bfloat16)."""
    from bridge.quantize import Quantization
    from jax_llama.perf import decode_bytes_per_token, int4_bytes_per_token
    s = spec()
    c = s.config
    weights = (int4_bytes_per_token(c) if quantize == "int4" else
               decode_bytes_per_token(c, 2, Quantization(quantize) if quantize else None))
    context = s.prompt_len + (DECODE_SHORT + DECODE_LONG) / 2
    return weights + batch * 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2 * context


def decode_row(result: dict, quantize: str | None, batch: int, machine: dict) -> dict:
    if "error" in result:
        return result
    short, long = statistics.median(result["short_s"]), statistics.median(result["long_s"])
    step = (long - short) / (DECODE_LONG - DECODE_SHORT)
    rate, nbytes = batch / step, step_bytes(quantize, batch)
    bound = batch * machine["read_bytes_per_s"] / nbytes if machine else None
    return {"tokens_per_s": rate, "step_s": step, "bytes_per_step": nbytes,
            "hbm_bound_tokens_per_s": bound, "hbm_fraction": rate / bound if bound else None,
            "first_call_s": result["first_call_s"], "build_s": result["build_s"],
            "peak_bytes": result.get("peak_bytes"),
            "runs_s": {str(DECODE_SHORT): result["short_s"], str(DECODE_LONG): result["long_s"]}}


def markdown(report: dict) -> str:
    m = report.get("machine", {})
    lines = [f"# {PRESET} on {m.get('device', '?')} (jax {m.get('jax')}, torch {m.get('torch')})", "",
             f"`{report.get('command')}` at commit {report.get('commit')}, {report.get('date')}; "
             f"every figure in the JSON beside this file, from which this page is written.", ""]
    if "bf16_matmul_flops" in m:
        lines += [f"Measured: bfloat16 matmul {m['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s "
                  f"(datasheet {DATASHEET_BF16_FLOPS / 1e12:.0f}), read bandwidth "
                  f"{m['read_bytes_per_s'] / 1e12:.2f} TB/s, copy {m['copy_bytes_per_s'] / 1e12:.2f} "
                  f"TB/s (read + written)", ""]
    if report.get("train"):
        lines += [f"## Train step: {SEQ_LEN}-token rows, bfloat16 compute, float32 params, AdamW", "",
                  "| implementation | batch | step (s) | tokens/s | MFU (datasheet) | MFU (measured "
                  "peak) | peak memory (GB) |", "|---|---|---|---|---|---|---|"]
        for name, r in report["train"].items():
            if "error" in r:
                lines.append(f"| {name} | {r['batch']} | failed: {r['error'].splitlines()[-1][:120]} "
                             f"| | | | |")
                continue
            lines.append(f"| {name} | {r['batch']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                         f"{r['mfu']:.1%} | {r['mfu_of_measured_peak']:.1%} | "
                         f"{(r['peak_bytes'] or 0) / 1e9:.1f} |")
    if report.get("decode"):
        lines += ["", f"## Decode: greedy after a 16-token prompt, batch 1 and {DECODE_BATCHES[-1]}", "",
                  report.get("decode_method", f"A step: the time of {DECODE_LONG} new tokens less "
                             f"that of {DECODE_SHORT}, over {DECODE_LONG - DECODE_SHORT}."), "",
                  "| implementation | batch | tokens/s | of the HBM bound | bytes read / step (GB) |",
                  "|---|---|---|---|---|"]
        for name, rows in report["decode"].items():
            if "error" in rows:  # an earlier layout: one job for every batch
                rows = {"": rows}
            for batch, r in rows.items():
                if "error" in r:
                    lines.append(f"| {name} | {batch} | failed: {r['error'][:160]} | | |")
                    continue
                lines.append(f"| {name} | {batch} | {r['tokens_per_s']:,.1f} | "
                             f"{r['hbm_fraction']:.1%} | {r['bytes_per_step'] / 1e9:.2f} |")
    if report.get("probe"):
        lines += ["", "## Probes (one job each)", ""]
        for label, rows in report["probe"].items():
            for batch, r in rows.items():
                shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                         if k not in ("runs_s", "job")}
                lines.append(f"- {label}{f', batch {batch}' if batch else ''}: {shown}")
    if report.get("profile"):
        lines += ["", "## Batch-1 bfloat16 decode under XLA's options, profiled", "",
                  "Per decode step, from JAX's profiler over one call of 240 new tokens: the "
                  "kernels the GPU ran and their busy time, against the step's time.", "",
                  "| XLA options | tokens/s | of the HBM bound | step (us) | kernels / step | "
                  "kernel time / step (us) |", "|---|---|---|---|---|---|"]
        for label, r in report["profile"].items():
            if "error" in r:
                lines.append(f"| {label} | failed: {r['error'][:160]} | | | | |")
                continue
            per_step = r.get("per_step") or {}
            streams = [v for k, v in per_step.items() if not k.startswith("module")]
            kernels = sum(v["kernels"] for v in streams)
            busy = sum(v["busy_us"] for v in streams)
            flags = f" (`{r['xla_flags']}`)" if r.get("xla_flags") else ""
            fraction = "?" if r["hbm_fraction"] is None else f"{r['hbm_fraction']:.1%}"
            lines.append(f"| {label}{flags} | "
                         f"{r['tokens_per_s']:,.1f} | {fraction} | "
                         f"{r['step_s'] * 1e6:.0f} | "
                         f"{kernels:.0f} | {busy:.0f} |")
    if report.get("tests"):
        lines += ["", f"## Tests on the GPU: {report['tests']['command']}", ""]
        lines += [f"- {name}: {outcome}" for name, outcome in report["tests"]["results"].items()]
        lines += [f"- measured: {note}" for note in report["tests"].get("measured", [])]
    if report.get("chat"):
        lines += ["", f"## SmolLM2-135M-Instruct (Q4_1 GGUF), greedy chat: {report['chat']['command']}",
                  "", *[f"- {k}: {v}" for k, v in report["chat"]["results"].items()]]
    if report.get("targets"):
        lines += ["", "## Targets", "", *[f"- {k}: {v}" for k, v in report["targets"].items()]]
    if report.get("failed"):
        lines += ["", "## What failed on the device, and why", "",
                  *[f"- {k}: {v}" for k, v in report["failed"].items()]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=JOBS, help=argparse.SUPPRESS)
    parser.add_argument("--render", metavar="JSON",
                        help="write the markdown beside a report (JSON.md) from it, and stop")
    parser.add_argument("--args", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=".", help="directory for NAME.json and NAME.md")
    parser.add_argument("--name", default="gpu")
    parser.add_argument("--only", default="machine,train,decode")
    parser.add_argument("--batches", default="16,8,4",
                        help="train batches to try, largest first; the first that fits is used")
    parser.add_argument("--attention", default="cudnn", help="JAX's attention in the train step")
    parser.add_argument("--preset", default=PRESET)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--machine-from", help="an earlier report's JSON whose machine figures "
                        "(matmul rate, bandwidth) to use instead of measuring them again")
    parser.add_argument("--job-timeout", type=float, default=240.0)
    args = parser.parse_args(argv)
    if args.job:
        print(json.dumps(JOBS[args.job](json.loads(args.args))))
        return 0
    if args.render:
        results.regenerate(args.render, lambda data: markdown(data).splitlines())
        return 0
    if (args.preset, args.seq_len) != (PRESET, SEQ_LEN):  # this process and its jobs
        os.environ["GPU_BENCH_SHAPE"] = f"{args.preset},{args.seq_len}"
        return subprocess.run([sys.executable, *sys.argv]).returncode

    only = set(args.only.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the commit, the CPU and the date are stamped by llama_twins.results
    report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "preset": PRESET,
              "seq_len": SEQ_LEN,
              "datasheet_bf16_flops": DATASHEET_BF16_FLOPS}

    def save():
        results.write(args.name, report, lambda data: markdown(data).splitlines(), out)

    machine = {}
    if args.machine_from and Path(args.machine_from).is_file():
        machine = json.loads(Path(args.machine_from).read_text()).get("machine", {})
        report["machine"] = {**machine, "from": args.machine_from}
        only.discard("machine")
    if "machine" in only:
        machine = run_job("machine", {}, args.job_timeout)
        report["machine"] = machine
        if "error" in machine:
            machine = {}
        save()
    if "train" in only:
        report["train"] = {}
        batch = None
        for b in map(int, args.batches.split(",")):
            r = run_job("train", {"impl": "jax-llama", "batch": b, "attention": args.attention},
                        args.job_timeout)
            report["train"][f"jax-llama {args.attention} (batch {b})"] = train_row(r, b, machine)
            save()
            if "error" not in r:
                batch = b
                break
        if batch is not None:
            for impl in IMPLS[1:]:
                b = batch
                r = run_job("train", {"impl": impl, "batch": b}, args.job_timeout)
                if "error" in r and "out of memory" in r["error"].lower() and b > 1:
                    b //= 2
                    r = run_job("train", {"impl": impl, "batch": b}, args.job_timeout)
                report["train"][impl] = train_row(r, b, machine)
                save()
            if args.attention != "chunked":  # what attention="auto" picks for long rows today
                report["train"]["jax-llama chunked"] = train_row(
                    run_job("train", {"impl": "jax-llama", "batch": batch, "attention": "chunked"},
                            args.job_timeout), batch, machine)
    if "decode" in only:
        report["decode"] = {}
        # batch 1 of jax-llama first (the target), then the rest by how much each tells;
        # transformers' int8 path needs torchao, which the GPU image lacks
        order = [("jax-llama", None, 1), ("jax-llama", "int8", 1), ("jax-llama", None, 32),
                 ("jax-llama", "int8", 32), ("torch_llama", None, 1), ("torch_llama", "int8", 1),
                 ("transformers", None, 1), ("torch_llama", None, 32), ("torch_llama", "int8", 32),
                 ("transformers", None, 32)]
        for impl, quantize, batch in order:
            if batch not in DECODE_BATCHES:
                continue
            r = run_job("decode", {"impl": impl, "quantize": quantize, "batch": batch},
                        args.job_timeout)
            name = f"{impl} {quantize or 'bfloat16'}"
            report["decode"].setdefault(name, {})[str(batch)] = decode_row(r, quantize, batch,
                                                                         machine)
            save()
    if "probe" in only:  # after the first run: int8 on a GPU, CUDA graphs, init's time
        report["probe"] = {}
        graphs = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                  "WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1")
        for label, name, job in (
                ("jax-llama int8 (one dot a projection on a GPU)", "decode",
                 {"impl": "jax-llama", "quantize": "int8", "batch": 1, "init": "host"}),
                ("jax-llama bfloat16, CUDA graphs for the loop", "decode",
                 {"impl": "jax-llama", "quantize": None, "batch": 1, "init": "host",
                  "xla_flags": graphs}),
                ("jax-llama int8 (one dot a projection on a GPU)", "decode",
                 {"impl": "jax-llama", "quantize": "int8", "batch": 32, "init": "host"}),
                ("jax_llama.init on the device", "init", {})):
            r = run_job(name, job, args.job_timeout)
            if name == "decode":
                r = decode_row(r, job["quantize"], job["batch"], machine)
            report["probe"].setdefault(label, {})[str(job.get("batch", ""))] = {**r, "job": job}
            save()
    if "profile" in only:  # batch-1 bfloat16 decode under XLA's options, each profiled
        report["profile"] = {}
        dump = ("--xla_dump_to=/tmp/gpu-profile/hlo --xla_dump_hlo_as_text "
                "--xla_dump_hlo_module_re=.*decode.*")
        for i, (label, flags, changes) in enumerate(PROFILE_VARIANTS):
            job = {"impl": "jax-llama", "quantize": None, "batch": 1, "init": "device",
                   "profile": f"/tmp/gpu-profile/{i}",
                   "xla_flags": f"{flags} {dump}" if i == 0 else flags, **changes}
            r = run_job("decode", job, args.job_timeout)
            row = decode_row(r, None, 1, machine)
            if r.get("profile"):
                row["per_step"] = r["profile"].get("per_step")
                ops = [v for k, v in r["profile"].get("lines", {}).items() if "XLA Ops" in k]
                row["top_ops_us"] = ops[0]["top"][:20] if ops else None
            report["profile"][label] = {**row, "xla_flags": flags, **changes}
            save()
        pack_profiles(out / "gpu_profile_traces.tgz")
    if "rows" in only:  # the decode rows the first run did not reach, and 4-bit weights
        report.setdefault("decode", {})
        for impl, quantize, batch, init in (("jax-llama", "int4", 1, "device"),
                                            ("jax-llama", "int4", 32, "device"),
                                            ("torch_llama", "int8", 1, None),
                                            ("transformers", None, 1, None)):
            r = run_job("decode", {"impl": impl, "quantize": quantize, "batch": batch,
                                   "init": init}, args.job_timeout)
            report["decode"].setdefault(f"{impl} {quantize or 'bfloat16'}", {})[str(batch)] = \
                decode_row(r, quantize, batch, machine)
            save()
    save()
    print(markdown(report))
    return 0


# batch-1 decode under these XLA options and job changes (--only profile): the defaults first
PROFILE_VARIANTS = (("XLA's defaults", "", {}),
                    ("no Triton GEMMs (cuBLAS)", "--xla_gpu_enable_triton_gemm=false", {}),
                    ("no command buffers (CUDA graphs)", "--xla_gpu_enable_command_buffer=", {}),
                    ("q, k, v and gate, up as one matmul each", "", {"fuse": True}),
                    ("those, and cuBLAS", "--xla_gpu_enable_triton_gemm=false", {"fuse": True}))


if __name__ == "__main__":
    sys.exit(main())
