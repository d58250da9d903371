"""`jax-llama bench`: every benchmark in one sitting, ours against transformers on the same config.

Forward (prefill) and train-step tokens/s with MFU, decode tokens/s at batch 1 and 8 with the
batch-1 bandwidth bound, conversion throughput and peak RSS against `cp -r`, and train-step compile
time against depth. This machine's matmul peak and read bandwidth are measured first, so that MFU
and bandwidth fractions are against what it can do, not a datasheet. Where transformers does not
import, our side runs alone and the table and stderr say so. Writes OUT/bench.md and
OUT/bench.json; the markdown also goes to stdout, progress to stderr.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bridge.config import LlamaConfig
from bridge.config import preset as lookup_preset
from bridge.errors import BridgeError
from bridge.tensors import count_params

from .. import results
from . import convert, decode, forward, long, lora, train
from .common import (CONFIG, IMPLEMENTATIONS, Spec, WorkerFailed, available, describe,
                     missing_note, probe, run_rounds, say, spawn)

BENCHES = ("forward", "train", "decode", "convert", "compile", "train-lora", "long", "lora")
# What runs without --only: "train-lora" (the LoRA step against peft), "long" (the train step up
# to 16K-token rows, ~an hour on a 2-core CPU) and "lora" (a LoRA step's memory at llama3.2-1b,
# minutes) run when named.
DEFAULT_BENCHES = BENCHES[:-3]
# one worker process per implementation and round
IN_WORKERS = ("forward", "train", "train-lora", "decode")
SUMMARIZE = {"forward": forward.summarize, "train": train.summarize,
             "train-lora": train.summarize_lora, "decode": decode.summarize}
MARKDOWN = {"forward": forward.markdown, "train": train.markdown,
            "train-lora": train.markdown_lora, "decode": decode.markdown}
# (full run, --quick): shapes, repetitions, compile depths, conversion model
DEFAULTS = {"batch": (8, 2), "seq_len": (256, 32), "prompt_len": (16, 8), "new_tokens": (128, 64),
            "warmup": (2, 1), "repeats": (3, 2), "rounds": (2, 1), "depths": ((4, 32), (2, 8)),
            "convert_preset": ("llama3.2-1b", None)}  # None: the benchmark's own preset


@dataclass(frozen=True)
class Plan:
    spec: Spec
    preset: str | None          # None: llama_twins.bench.common.CONFIG (56M parameters)
    benches: tuple[str, ...]
    rounds: int
    depths: tuple[int, int]
    convert_preset: str
    quick: bool

    def command(self, out: str) -> str:
        """The command line that runs exactly this plan again."""
        s = self.spec
        words = ["jax-llama", "bench", *(["--quick"] if self.quick else []),
                 *(["--preset", self.preset] if self.preset else []), "--dtype", s.dtype,
                 "--batch", str(s.batch), "--seq-len", str(s.seq_len), "--repeats", str(s.repeats),
                 "--rounds", str(self.rounds), "--only", ",".join(self.benches)]
        if "convert" in self.benches:
            words += ["--convert-preset", self.convert_preset]
        return shlex.join([*words, "--out", out])


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise BridgeError(f"must be a positive integer (got {value})", field=name)
    return value


def make_plan(args) -> Plan:
    """The Plan of `jax-llama bench` arguments; bad values raise BridgeError naming the option."""
    pick = lambda key: DEFAULTS[key][1 if args.quick else 0]  # noqa: E731
    given = lambda key: getattr(args, key) if getattr(args, key) is not None else pick(key)  # noqa: E731
    preset = args.preset or ("tiny" if args.quick else None)
    config = lookup_preset(preset) if preset else CONFIG
    benches = tuple(b.strip() for b in (args.only or ",".join(DEFAULT_BENCHES)).split(",")
                    if b.strip())
    unknown = [b for b in benches if b not in BENCHES]
    if unknown or not benches:
        raise BridgeError(f"unknown benchmark {unknown[0] if unknown else args.only!r}; "
                          f"valid: {', '.join(BENCHES)}", field="only")
    spec = Spec(config=config, dtype=args.dtype, batch=_positive("batch", given("batch")),
                seq_len=_positive("seq_len", given("seq_len")), prompt_len=pick("prompt_len"),
                new_tokens=pick("new_tokens"), warmup=pick("warmup"),
                repeats=_positive("repeats", given("repeats")))
    if spec.seq_len > config.max_seq_len:
        raise BridgeError(f"{spec.seq_len} exceeds the model's max_seq_len {config.max_seq_len}",
                          field="seq_len")
    if "decode" in benches and spec.prompt_len + spec.new_tokens > config.max_seq_len:
        raise BridgeError(f"decode needs {spec.prompt_len + spec.new_tokens} positions; "
                          f"{preset} has max_seq_len {config.max_seq_len}", field="preset")
    convert_preset = args.convert_preset or pick("convert_preset") or preset
    lookup_preset(convert_preset, field="convert_preset")
    return Plan(spec=spec, preset=preset,
                benches=tuple(b for b in BENCHES if b in benches),
                rounds=_positive("rounds", given("rounds")), depths=pick("depths"),
                convert_preset=convert_preset, quick=args.quick)


def run(plan: Plan, command: str) -> dict:
    """Measure this machine, then every benchmark of the plan; returns what bench.json holds."""
    started, spec = time.perf_counter(), plan.spec
    found = probe()
    note = missing_note(found)
    if note:
        print(f"warning: {note}", file=sys.stderr, flush=True)  # with or without progress
    say("measuring this machine: matmul peak and read bandwidth")
    machine = {**spawn("machine", spec), **found}
    say(f"matmul peak {machine['peak_flops'] / 1e9:.0f} GFLOP/s ({spec.dtype}), read bandwidth "
        f"{machine['read_bandwidth'] / 1e9:.1f} GB/s")
    against = {"forward": machine["peak_flops"], "train": machine["peak_flops"],
               "train-lora": machine["peak_flops"], "decode": machine["read_bandwidth"]}
    results = {}
    in_workers = tuple(b for b in IN_WORKERS if b in plan.benches)
    if in_workers:
        times = run_rounds(in_workers, available(found), spec, plan.rounds)
        for bench in in_workers:
            per_impl = {impl: times[impl][bench] if impl in times else None for impl in IMPLEMENTATIONS}
            if bench == "decode":  # and our twins on int8 weights, each in its own workers
                per_impl.update(decode.run_int8(spec, plan.rounds, found))
            results[bench] = SUMMARIZE[bench](per_impl, spec, against[bench])
    if "compile" in plan.benches:
        say(f"compiling the train step at {plan.depths[0]} and {plan.depths[1]} layers, with and "
            f"without scan_layers")
        results["compile"] = spawn("compile", spec, extra=("--depths", ",".join(map(str, plan.depths))))
    if "long" in plan.benches:
        say("long context: the train step at a fixed number of tokens as the rows grow")
        results["long"] = long.run(config=spec.config, dtype=spec.dtype, transformers=note is None,
                                   **(long.QUICK if plan.quick else {}))
    if "lora" in plan.benches:  # its own shapes: batch 1 x 256 of llama3.2-1b (--quick: tiny)
        preset = plan.preset or lora.PRESET
        results["lora"] = lora.run(lookup_preset(preset), preset,
                                   **({"seq_len": lora.QUICK["seq_len"]} if plan.quick else {}),
                                   repeats=spec.repeats)
    if "convert" in plan.benches:
        with tempfile.TemporaryDirectory(prefix="jax-llama-bench-") as workdir:
            results["convert"] = convert.bench_model(
                plan.convert_preset, lookup_preset(plan.convert_preset), Path(workdir),
                spec.repeats)
    return {"command": command, "machine": machine,
            "transformers": {"available": note is None, "note": note},
            "model": {"preset": plan.preset, "config": spec.config.to_dict(),
                      "parameters": count_params(spec.config)},
            "spec": {**{k: v for k, v in asdict(spec).items() if k != "config"},
                     "rounds": plan.rounds, "compile_depths": list(plan.depths)},
            "peak_flops": machine["peak_flops"], "read_bandwidth": machine["read_bandwidth"],
            "seconds": time.perf_counter() - started, "benchmarks": results}


def machine_line(m: dict) -> str:
    transformers = m["transformers"] or "not installed"
    return (f"Machine: {m['cpu']}, {m['cores']} cores, {m['os']}; JAX on {m['jax_device']}, torch "
            f"on {m['torch_device']}; Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, "
            f"flax {m['flax']}, torch {m['torch']}, transformers {transformers}")


def markdown(result: dict) -> str:
    m, s, b = result["machine"], result["spec"], result["benchmarks"]
    lines = ["# jax-llama bench", "", machine_line(m), "",
             f"Measured first: matmul peak {m['peak_flops'] / 1e9:,.0f} GFLOP/s ({m['peak_dtype']}, "
             f"2048 x 2048), read bandwidth {m['read_bandwidth'] / 1e9:.1f} GB/s", "",
             f"Model: {result['model']['preset'] or 'the default benchmark config'}: "
             f"{describe(LlamaConfig.from_dict(result['model']['config']))}, random weights, "
             f"{s['dtype']}", "",
             f"Method: each implementation in a worker process of its own, {s['rounds']} round(s) "
             f"in alternating order, {s['warmup']} warm-up and {s['repeats']} timed runs per "
             f"round; each figure is the median of all timed runs", ""]
    if not result["transformers"]["available"]:
        lines += [f"**{result['transformers']['note']}**: no ratios against it", ""]
    lines += [f"Reproduce: `{result['command']}`"]
    for bench in IN_WORKERS:
        if bench in b:
            lines += ["", *MARKDOWN[bench](b[bench], s["dtype"])]
    if "convert" in b:
        c = b["convert"]
        lines += ["", f"## Conversion: {c['model']}, a random bfloat16 HF checkpoint of "
                      f"{c['bytes'] / 1e9:.2f} GB; the reference is `cp -r`; each command "
                      f"followed by `sync`; peak RSS of the command", "",
                  convert.markdown([c])]
    if "compile" in b:
        lines += ["", *train.compile_markdown(b["compile"])]
    if "long" in b:
        lines += ["", *long.markdown(b["long"]), "", "![tokens/s and memory against S](long.png)"]
    if "lora" in b:
        lines += ["", *lora.markdown(b["lora"])]
    return "\n".join(lines) + "\n"


def _check_out(out: Path) -> None:
    """Refuse an --out that cannot become a directory now, not after minutes of measuring."""
    if out.exists() and not out.is_dir():
        raise BridgeError(f"{out} exists and is not a directory", field="out")
    parent = next(p for p in (out, *out.parents) if p.exists())
    if not os.access(parent, os.W_OK):
        raise BridgeError(f"{parent} is not writable", field="out")


def run_command(args) -> int:
    """`jax-llama bench`: exit 0, or 1 when a worker process failed."""
    plan = make_plan(args)
    _check_out(Path(args.out))
    command = plan.command(args.out)
    say(f"$ {command}")
    try:
        result = run(plan, command)
    except WorkerFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    # bench.json stamped with its provenance, bench.md made from it
    table = results.write("bench", result, lambda data: markdown(data).splitlines(), out)
    if "long" in result["benchmarks"]:
        long.plot(result["benchmarks"]["long"], out / "long.png")
    if "lora" in result["benchmarks"]:  # also on its own, as `python -m llama_twins.bench.lora`
        lora.write(result["benchmarks"]["lora"], command, out)
    sys.stdout.write(table)
    say(f"{out / 'bench.md'}, {out / 'bench.json'} ({result['seconds']:.0f} s)")
    return 0

