"""Decode speed of both twins against `transformers` generate, with their KV caches.

Same config (random weights), a prompt of `prompt_len` tokens and `new_tokens` new ones, greedy,
at each batch size; each implementation in a worker process of its own, in alternating rounds
(llama_twins.bench.common). Time to first token (prefill + one token) is reported apart from decode:
decode tokens/s = (new_tokens - 1) x batch / (time for new_tokens - time for 1). The bandwidth
bound of batch 1 is this machine's measured read bandwidth over the weight bytes a decode step
reads (jax_llama.perf.decode_bytes_per_token). The int8 rows run our twins on int8 weights
(jax_llama.quantize / torch_llama.quantize, per output channel), in the bench's dtype and with
bfloat16 activations, each against its own bound (int8 bytes); transformers' own int8 path runs
beside them where torchao is installed (`pip install -e '.[bench]'`): the same model with
torchao's int8 weight-only quantisation (Int8WeightOnlyConfig, what transformers'
TorchAoConfig("int8_weight_only") applies; per output channel too).

    python -m llama_twins.bench.decode [--out DIR]    # writes DIR/generate.{md,json} (DIR: .)

With --weights CKPT (a real model, any format the bridge reads) every row decodes those weights
instead, beside a row of JAX streaming each token through the CLI's Streamer (what `jax-llama
generate` does with one prompt) and, where llama-cpp-python imports, llama.cpp at batch 1 on the
same weights as F32 and Q8_0 GGUF files (and on CKPT itself when it is a GGUF of another type),
and JAX's float32 and int8 rows without its decode kernels (`--kernels xla`: XLA's matmuls). Every one of those
rows runs once a round, llama.cpp's too, so rows compared with each other are measured over the
same stretches of time. --cold-start adds a cold `jax-llama generate` with and without the persistent compilation cache.
Writes DIR/generate_weights.{md,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

from bridge.dtypes import numpy_dtype

from .common import (JAX, LLAMA_CPP, REFERENCE, TWIN, Spec, add_ratios, available, describe,
                     missing_note, probe, ratio, run_rounds, run_variant_rounds, say, spawn, timed,
                     torch_device, transformers_model, write_results)


def prompt(spec: Spec) -> list[int]:
    return [1 + i % (spec.config.vocab_size - 1) for i in range(spec.prompt_len)]


def jax_runner(spec: Spec):
    os.environ["JAX_LLAMA_KERNELS"] = "1"  # whatever the caller set: the rows choose below
    from bridge.int4 import ACTIVATIONS_ENV
    os.environ[ACTIVATIONS_ENV] = spec.activations  # a worker process of its own
    import jax_llama
    from jax_llama.inference.generate import generate
    kernels = "auto" if spec.kernels else "xla"  # the model's `kernels`, as --kernels sets it
    four = spec.quantize == "int4" and bool(spec.weights)  # a Q4 GGUF's blocks as they are
    if spec.weights:
        model, params = jax_llama.load(spec.weights, dtype=spec.dtype, kernels=kernels, int4=four)
    else:
        model, params = jax_llama.init(spec.config, seed=0, dtype=spec.dtype, param_dtype=spec.dtype,
                                       kernels=kernels)
    if spec.quantize and not four:
        params = jax_llama.quantize(params, method=spec.quantize)
    if not spec.stream:
        return lambda batch, n: generate(model, params, [prompt(spec)] * batch, n), lambda: None
    # what `jax-llama generate` does with one prompt: each token through the CLI's Streamer
    import io

    from tasks.prompts import Streamer
    from bridge.tokenizer import find_tokenizer
    tokenizer = find_tokenizer(spec.weights)
    return (lambda batch, n: generate(model, params, [prompt(spec)] * batch, n,
                                      on_token=Streamer(tokenizer, io.StringIO())), lambda: None)


def twin_runner(spec: Spec):
    import torch

    import torch_llama

    device, sync = torch_device()
    four = spec.quantize == "int4" and bool(spec.weights)
    if spec.weights:
        model = torch_llama.load(spec.weights, device=device, dtype=spec.dtype, int4=four)
    else:
        torch.manual_seed(0)
        model = torch_llama.Llama(spec.config).to(device=device,
                                                  dtype=getattr(torch, spec.dtype)).eval()
    if spec.quantize and not four:
        torch_llama.quantize(model, method=spec.quantize)
    return lambda batch, n: torch_llama.generate(model, [prompt(spec)] * batch, n), sync


def llama_cpp_runner(spec: Spec):
    """llama-cpp-python on spec.gguf, batch 1: the prompt evaluated, then one token at a time
    through its KV cache, each the argmax of its logits (as the greedy loop of every other row).
    All cores; where llama.cpp was built with AMX, without its weight repacking (it crashes
    there: llama_twins.llama_cpp_reference.repacks_safely)."""
    import numpy as np

    from llama_twins.llama_cpp_reference import last_logits, open_model

    llm = open_model(spec.gguf, spec.prompt_len + spec.new_tokens,
                     n_batch=spec.prompt_len + spec.new_tokens)

    def run(batch, n):
        assert batch == 1, "llama.cpp rows decode one sequence"
        llm.reset()
        llm.eval(prompt(spec))
        out = []
        for _ in range(n):
            out.append(int(np.argmax(last_logits(llm))))
            if len(out) < n:
                llm.eval([out[-1]])
        return out
    return run, lambda: None


def transformers_runner(spec: Spec):
    import torch

    device, sync = torch_device()
    if spec.hf_weights:
        import transformers
        model = transformers.LlamaForCausalLM.from_pretrained(spec.hf_weights, dtype=torch.float32)
        model = model.to(device=device, dtype=getattr(torch, spec.dtype)).eval()
    else:
        model = transformers_model(spec.config).to(device=device,
                                                   dtype=getattr(torch, spec.dtype)).eval()
    if spec.quantize:  # int8: torchao's weight-only path, as transformers' TorchAoConfig runs it
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        quantize_(model, Int8WeightOnlyConfig())

    def run(batch, n):
        ids = torch.tensor([prompt(spec)] * batch, device=device)
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, use_cache=True,
                                  pad_token_id=0, eos_token_id=None)
    return run, sync


def measure(impl: str, spec: Spec) -> dict[str, list[float]]:
    """In a worker: {"batch/n": seconds of each run} for n = 1 and new_tokens at each batch."""
    run, sync = {JAX: jax_runner, TWIN: twin_runner, REFERENCE: transformers_runner,
                 LLAMA_CPP: llama_cpp_runner}[impl](spec)
    result = {}
    for batch in spec.decode_batches:
        for n in (1, spec.new_tokens):  # the warm-up also compiles JAX's (batch, cache) bucket
            result[f"{batch}/{n}"] = timed(lambda: run(batch, n), spec.warmup, spec.repeats, sync)
    return result


# JAX's rows without jax_llama.model.kernels (`--kernels xla`: XLA's matmuls, what the kernels
# replace); the other JAX rows run --kernels auto, the decode kernels wherever they serve.
# (Results written before the flag had a name call these rows "jax-llama XLA" and
# "jax-llama int8 XLA".)
JAX_INT8_XLA = f"{JAX} int8 --kernels xla"
JAX_XLA = f"{JAX} --kernels xla"


def int8_variants(spec: Spec) -> dict[str, Spec]:
    """The int8 rows: our twins and transformers (through torchao) on int8 weights (per channel)
    in the bench's dtype, JAX also without its decode kernels (JAX_INT8_XLA), and, where the
    dtype is not bfloat16 already, with bfloat16 activations too: the dtype torch's int8 weight
    kernel (torch._weight_int8pack_mm) multiplies in."""
    impls = (JAX, TWIN, REFERENCE)
    variants = {f"{impl} int8": dataclasses.replace(spec, quantize="int8") for impl in impls}
    variants[JAX_INT8_XLA] = dataclasses.replace(spec, quantize="int8", kernels=False)
    if spec.dtype != "bfloat16":
        variants.update({f"{impl} int8 bf16": dataclasses.replace(spec, quantize="int8",
                                                                  dtype="bfloat16")
                         for impl in impls})
    return variants


def run_int8(spec: Spec, rounds: int, found: dict) -> dict[str, dict | None]:
    """times[label] of each int8 variant, each in its own worker processes; None for the
    transformers rows where transformers or torchao does not import."""
    times = {}
    for label, variant in int8_variants(spec).items():
        impl = label.split(" ")[0]
        if impl == REFERENCE and not (found["transformers"] and found.get("torchao")):
            times[label] = None
            continue
        times[label] = run_rounds(("decode",), (impl,), variant, rounds)[impl]["decode"]
    return times


def bytes_per_token(spec: Spec, label: str) -> int:
    """The weight bytes a decode step of row `label` reads (int8 rows: their own)."""
    from bridge.quantize import Quantization
    from jax_llama.perf import decode_bytes_per_token
    variant = int8_variants(spec).get(label, spec)
    return decode_bytes_per_token(variant.config, numpy_dtype(variant.dtype).itemsize,
                                  Quantization(variant.quantize) if variant.quantize else None)


def summarize(times: dict[str, dict | None], spec: Spec, bandwidth: float,
              row_bytes: dict[str, int] | None = None) -> dict:
    """times[impl] = measure()'s lists pooled over rounds (None: not run) -> the JSON entry.
    Rows named in int8_variants are measured against their own (int8) bandwidth bound, rows in
    row_bytes against those bytes per token."""
    row_bytes = row_bytes or {}
    weight_bytes = bytes_per_token(spec, JAX)
    bound = bandwidth / weight_bytes
    new, rows = spec.new_tokens, {}
    for impl, t in times.items():
        rows[impl] = None if t is None else {}
        for batch in [b for b in spec.decode_batches if t and f"{b}/1" in t]:  # llama.cpp: 1
            first, full = statistics.median(t[f"{batch}/1"]), statistics.median(t[f"{batch}/{new}"])
            # None where decoding is too fast to tell from the noise of the first token's time
            rate = (new - 1) * batch / (full - first) if full > first else None
            rows[impl][str(batch)] = {"ttft_s": first, "decode_tokens_per_s": rate,
                                      "runs_first_s": t[f"{batch}/1"], "runs_full_s": t[f"{batch}/{new}"]}
    for batch in spec.decode_batches:
        per_batch = {impl: r and r.get(str(batch)) for impl, r in rows.items()}
        add_ratios(per_batch, "decode_tokens_per_s")
    int8_bound = {}
    for label, r in rows.items():
        if r and "1" in r:
            rate = r["1"]["decode_tokens_per_s"]
            row_bound = bandwidth / (row_bytes.get(label) or bytes_per_token(spec, label))
            r["1"]["bound_tokens_per_s"] = row_bound
            r["1"]["of_bandwidth_bound"] = None if rate is None else rate / row_bound
            if label in int8_variants(spec) and label not in row_bytes:
                int8_bound[label] = row_bound
    return {"prompt_len": spec.prompt_len, "new_tokens": new, "batches": list(spec.decode_batches),
            "weight_bytes_per_token": weight_bytes, "bound_tokens_per_s": bound,
            "int8_bound_tokens_per_s": int8_bound, "rows": rows}


def markdown(result: dict, dtype: str) -> list[str]:
    lines = [f"## Decode: {result['prompt_len']}-token prompt, {result['new_tokens']} new tokens, "
             f"greedy, KV cache, {dtype}; batch 1 cannot exceed {result['bound_tokens_per_s']:,.0f} "
             f"tokens/s (read bandwidth / {result['weight_bytes_per_token'] / 1e6:.3g} MB of "
             f"weights per step)", "",
             "| implementation | batch | time to first token | decode tokens/s | vs transformers | "
             "of bandwidth bound |", "|---|---|---|---|---|---|"]
    int8_bounds = {round(b) for b in result.get("int8_bound_tokens_per_s", {}).values()}
    if int8_bounds:  # the same bytes in every int8 row (bfloat16 changes only the embedding row)
        lines[0] += (f"; with int8 weights, {' / '.join(f'{b:,.0f}' for b in sorted(int8_bounds))} "
                     f"tokens/s (the int8 rows' own bound)")
    if any(r and (r.get("1", {}).get("of_bandwidth_bound") or 0) > 1 for r in result["rows"].values()):
        lines[0] += " (above 100%: the weights fit in a cache, so memory bandwidth does not bind)"
    for impl, r in result["rows"].items():
        if r is None:
            missing = "torchao " if impl.startswith(f"{REFERENCE} int8") else ""
            lines.append(f"| {impl} | | {missing}not installed | | | |")
            continue
        for batch, x in r.items():
            of_bound = f"{x['of_bandwidth_bound']:.0%}" if x.get("of_bandwidth_bound") else "-"
            rate = x["decode_tokens_per_s"]
            rate = "too fast to time" if rate is None else f"{rate:,.1f}"
            lines.append(f"| {impl} | {batch} | {x['ttft_s'] * 1000:.1f} ms | {rate} | "
                         f"{ratio(x['vs_transformers'])} | {of_bound} |")
    return lines


# -- on real weights, with llama.cpp beside ------------------------------------------------------

STREAMED = f"{JAX} streamed"  # the `jax-llama generate` path: one prompt, each token streamed
# What llama.cpp runs beside: the same weights exported by the bridge as F32 (the float32 rows'
# bytes), Q8_0 (int8 with a scale per 32 weights, what the int8 rows compare with) and Q4_0
# (4 bits with a float16 scale per 32 weights, which the 4-bit rows read exactly).
LLAMA_CPP_TYPES = ("f32", "q8_0", "q4_0")
# The 4-bit row reads the Q4_0 file's blocks (load(quantize="int4")), batch 1 and 8. (The torch twin's
# 4-bit Linear dequantises every weight per call: 2.9 tokens/s on SmolLM2, 4 minutes a round, so
# it has no row here.)
# q8: 8-bit activations, bf16: bfloat16 ones (bridge.int4.activations)
INT4_ROWS = {f"{JAX} int4": "float32", f"{JAX} int4 q8": "int8", f"{JAX} int4 bf16": "bfloat16"}


def real_weights(spec: Spec, source: str, rounds: int, found: dict, work,
                 only: list[str] | None = None) -> tuple[dict, Spec, dict]:
    """Decode on the weights of checkpoint `source` (any format the bridge reads): our twins and
    transformers in float32 and int8 at each batch size, JAX streamed at batch 1, and
    llama.cpp at batch 1 on the same weights as F32 and Q8_0 GGUF files (and on `source` itself
    when it is a GGUF of another type) where llama-cpp-python imports. The conversions go into
    the directory `work`. Returns (times per row, the Spec, weight bytes per token of the
    llama.cpp rows: all their tensors' bytes, what a tied model reads per token)."""
    from pathlib import Path

    from bridge.convert import convert
    from bridge.formats import open_checkpoint
    from bridge.gguf.container import is_gguf, read_gguf
    from jax_llama.perf import int4_bytes_per_token

    work = Path(work)
    say(f"converting {source} to native float32, HF and GGUF for the decode rows")
    native = convert(source, work / "native", to="native", dtype="float32", progress=False)
    hf = convert(native, work / "hf", to="hf", progress=False)
    config = open_checkpoint(native).config
    spec = dataclasses.replace(spec, config=config, weights=str(native), hf_weights=str(hf))
    # Every row alternates with every other in each round (llama.cpp's too), so that the ratios
    # below compare rows measured over the same stretches of time.
    one = dataclasses.replace(spec, decode_batches=(1,))
    variants = {impl: (impl, spec) for impl in available(found)}
    variants[JAX_XLA] = (JAX, dataclasses.replace(spec, kernels=False))
    for label in (f"{JAX} int8", JAX_INT8_XLA, f"{TWIN} int8"):
        variants[label] = (label.split(" ")[0], int8_variants(spec)[label])
    variants[STREAMED] = (JAX, dataclasses.replace(one, stream=True))
    row_bytes = {}
    files = {t.upper(): convert(native, work / f"model-{t}.gguf", to="gguf", dtype=t,
                                progress=False) for t in LLAMA_CPP_TYPES}
    for label, kind in INT4_ROWS.items():  # the Q4_0 file's blocks as they are
        variants[label] = (label.split(" ")[0], dataclasses.replace(
            spec, quantize="int4", weights=str(files["Q4_0"]), activations=kind))
        row_bytes[label] = int4_bytes_per_token(config, minima=False)  # Q4_0: none held
    if found.get("llama_cpp"):
        say(f"warning: no llama.cpp rows: {found['llama_cpp']}")
    else:
        if is_gguf(source):
            files.setdefault(gguf_file_type(source), Path(source))
        for kind, path in files.items():
            variants[f"{LLAMA_CPP} {kind}"] = (LLAMA_CPP, dataclasses.replace(one, gguf=str(path)))
            row_bytes[f"{LLAMA_CPP} {kind}"] = sum(t.n_bytes for t in read_gguf(path).tensors)
    if only:  # --rows: these rows alone (named as in the table)
        unknown = sorted(set(only) - set(variants))
        if unknown:
            raise SystemExit(f"error: --rows: no row {unknown[0]!r} (rows: {', '.join(variants)})")
        variants = {label: variants[label] for label in only}
    times = run_variant_rounds(("decode",), variants, rounds)
    per_row = {label: times[label]["decode"] for label in variants}
    for impl in (JAX, TWIN, REFERENCE) if not only else ():
        per_row.setdefault(impl, None)
    return per_row, spec, row_bytes


def gguf_file_type(path) -> str:
    """A GGUF file's general.file_type as llama.cpp names it: F32, Q8_0, Q4_1, ..."""
    import gguf

    from bridge.gguf.container import read_gguf
    name = gguf.LlamaFileType(read_gguf(path).fields["general.file_type"]).name
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


# (our row, llama.cpp's row, the target ratio): float32 against F32, int8 against Q8_0, 4-bit
# against Q4_0 on the same blocks (issue 57's targets: 1.0x, 1.2x, 1.0x)
AGAINST_LLAMA_CPP = ((JAX, f"{LLAMA_CPP} F32", 1.0), (JAX_XLA, f"{LLAMA_CPP} F32", 1.0),
                     (f"{JAX} int8", f"{LLAMA_CPP} Q8_0", 1.2),
                     (JAX_INT8_XLA, f"{LLAMA_CPP} Q8_0", 1.2),
                     (f"{JAX} int4", f"{LLAMA_CPP} Q4_0", 1.0),
                     (f"{JAX} int4 q8", f"{LLAMA_CPP} Q4_0", 1.0),
                     (f"{JAX} int4 bf16", f"{LLAMA_CPP} Q4_0", 1.0), (STREAMED, JAX, 0.9))


def round_rates(row: dict, rounds: int, new_tokens: int) -> list[float]:
    """A batch-1 row's decode tokens/s in each round: its runs come `repeats` to a round, in
    order (run_variant_rounds), so round r's median first-token and full times give its rate."""
    first, full = row["runs_first_s"], row["runs_full_s"]
    per = len(full) // rounds
    rates = []
    for r in range(rounds):
        a = statistics.median(first[r * per:(r + 1) * per])
        b = statistics.median(full[r * per:(r + 1) * per])
        rates.append((new_tokens - 1) / (b - a) if b > a else float("nan"))
    return rates


def against_llama_cpp(result: dict, rounds: int = 1) -> list[str]:
    """The batch-1 ratios the real-weight rows are judged by, as markdown: each the median of the
    rounds' ratios (the two rows' rates in the same round), with their spread."""
    rows, new = result["rows"], result["new_tokens"]

    def row(label):
        return (rows.get(label) or {}).get("1")
    lines = ["| batch-1 decode | tokens/s | against | its tokens/s | ratio (median of rounds) | "
             "rounds' ratios | target |", "|---|---|---|---|---|---|---|"]
    for ours, theirs, target in AGAINST_LLAMA_CPP:
        a, b = row(ours), row(theirs)
        if not (a and b and a["decode_tokens_per_s"] and b["decode_tokens_per_s"]):
            continue
        ratios = [x / y for x, y in zip(round_rates(a, rounds, new), round_rates(b, rounds, new))]
        mid = statistics.median(ratios)
        lines.append(f"| {ours} | {a['decode_tokens_per_s']:,.1f} | {theirs} | "
                     f"{b['decode_tokens_per_s']:,.1f} | {mid:.2f}x | "
                     f"{min(ratios):.2f}-{max(ratios):.2f}x | "
                     f"{target:.1f}x: {'met' if mid >= target else 'not met'} |")
    return lines if len(lines) > 2 else []


def cold_start(checkpoint: str, runs: int = 2) -> dict:
    """A cold `jax-llama generate CKPT --chat --max-new-tokens 16` in a fresh process, by
    stdout's first byte (time to first token, process start included) and its exit: without
    the persistent compilation cache, with it empty (the run fills it) and with it warm.
    Medians of `runs` each."""
    import tempfile

    from .common import first_byte_and_exit

    command = [sys.executable, "-m", "llama_twins.cli.main", "generate", checkpoint, "--chat",
               "--prompt", "What is the capital of France?", "--max-new-tokens", "16"]
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_LLAMA_COMPILE_CACHE")}

    result = {}
    with tempfile.TemporaryDirectory(prefix="jax-llama-cache-") as tmp:
        cases = {"no cache": lambda i: {**base, "JAX_LLAMA_COMPILE_CACHE": "off"},
                 "cache empty": lambda i: {**base, "JAX_LLAMA_COMPILE_CACHE": f"{tmp}/{i}"},
                 "cache warm": lambda i: {**base, "JAX_LLAMA_COMPILE_CACHE": f"{tmp}/{i}"}}
        for case, env in cases.items():
            say(f"cold start: {case}")
            times = [first_byte_and_exit(command, env(i)) for i in range(runs)]
            result[case] = {"first_token_s": statistics.median(t[0] for t in times),
                            "total_s": statistics.median(t[1] for t in times),
                            "runs": times}
    return result


def cold_start_lines(result: dict) -> list[str]:
    lines = ["| cold `jax-llama generate --chat --max-new-tokens 16` | time to first token | "
             "exit |", "|---|---|---|"]
    for case, r in result.items():
        lines.append(f"| {case} | {r['first_token_s']:.2f} s | {r['total_s']:.2f} s |")
    saved = result["no cache"]["total_s"] - result["cache warm"]["total_s"]
    lines += ["", f"Compilation, as the warm cache removes it: {saved:.1f} s of "
                  f"{result['no cache']['total_s']:.1f} s."]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=".", help="directory for generate.{md,json} (default .)")
    parser.add_argument("--no-int8", action="store_true", help="skip the int8 rows")
    parser.add_argument("--weights", metavar="CKPT",
                        help="decode these weights (any format the bridge reads) instead of the "
                             "random benchmark model, with JAX streamed and llama.cpp rows: "
                             "writes DIR/generate_weights.{md,json}")
    parser.add_argument("--rows", help="with --weights: only these rows, comma-separated, named "
                                       "as in the table (e.g. 'jax-llama int4,llama.cpp Q4_0')")
    parser.add_argument("--cold-start", action="store_true",
                        help="with --weights: also time a cold `jax-llama generate` with and "
                             "without the persistent compilation cache")
    args = parser.parse_args(argv)
    spec, found = Spec(warmup=1, repeats=args.repeats), probe()
    if missing_note(found):
        say(f"warning: {missing_note(found)}")
    bandwidth = spawn("machine", spec)["read_bandwidth"]
    if args.weights:
        return main_weights(args, spec, found, bandwidth)
    times = run_rounds(("decode",), available(found), spec, args.rounds)
    per_row = {impl: times.get(impl, {}).get("decode") for impl in (JAX, TWIN, REFERENCE)}
    if not args.no_int8:
        per_row.update(run_int8(spec, args.rounds, found))
    result = summarize(per_row, spec, bandwidth)
    lines = [f"{describe(spec.config)}; measured read bandwidth {bandwidth / 1e9:.1f} GB/s; "
             f"medians of {args.rounds} rounds x {args.repeats} runs, each implementation in its "
             f"own process", "", *markdown(result, spec.dtype)]
    write_results("generate", lines, {"bandwidth": bandwidth, "decode": result}, args.out)
    return 0


def llama_cpp_line(found: dict) -> str:
    """What the llama.cpp rows ran: the build's own features line, and whether its weights were
    repacked for this CPU (not where it was built with AMX: llama_cpp_reference.repacks_safely)."""
    how = ("its weights repacked for this CPU (its extra buffer types)" if found["llama_cpp_repacks"]
           else "without repacking its weights (built with AMX, whose repacked matmul crashes: "
                "rebuild it without AMX for llama.cpp's full speed, see the performance page)")
    return f"llama.cpp as built: `{found['llama_cpp_build']}`; {how}."


def main_weights(args, spec: Spec, found: dict, bandwidth: float) -> int:
    import tempfile

    from .common import code_paths, code_paths_line, cpu_model
    with tempfile.TemporaryDirectory(prefix="jax-llama-bench-") as work:
        per_row, spec, row_bytes = real_weights(spec, args.weights, args.rounds, found, work,
                                                args.rows.split(",") if args.rows else None)
        result = summarize(per_row, spec, bandwidth, row_bytes)
        cold = cold_start(spec.weights) if args.cold_start else None
    rows = f" --rows '{args.rows}'" if args.rows else ""
    lines = [f"{cpu_model()}; {describe(spec.config)}; the weights of {args.weights}; measured "
             f"read bandwidth {bandwidth / 1e9:.1f} GB/s; medians of {args.rounds} rounds x "
             f"{args.repeats} runs, each row in its own process" + code_paths_line(code_paths()), "",
             f"Reproduce: `python -m llama_twins.bench.decode --weights {args.weights} --rounds "
             f"{args.rounds} --repeats {args.repeats}{' --cold-start' if cold else ''}{rows}`", "",
             *markdown(result, spec.dtype), "", *against_llama_cpp(result, args.rounds)]
    if found.get("llama_cpp_build") and any(r.startswith(LLAMA_CPP) for r in result.get("rows", {})):
        lines += ["", llama_cpp_line(found)]
    if cold:
        lines += ["", *cold_start_lines(cold)]
    write_results("generate_weights", lines, {"bandwidth": bandwidth, "cpu": cpu_model(),
                                              "decode": result, "cold_start": cold,
                                              "paths": code_paths()}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
