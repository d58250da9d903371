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
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from bridge.dtypes import numpy_dtype

from .common import (JAX, REFERENCE, TWIN, Spec, add_ratios, available, describe, missing_note,
                     probe, ratio, run_rounds, say, spawn, timed, torch_device, transformers_model,
                     write_results)


def prompt(spec: Spec) -> list[int]:
    return [1 + i % (spec.config.vocab_size - 1) for i in range(spec.prompt_len)]


def jax_runner(spec: Spec):
    import jax_llama
    from jax_llama.generate import generate
    model, params = jax_llama.init(spec.config, seed=0, dtype=spec.dtype, param_dtype=spec.dtype)
    if spec.quantize:
        params = jax_llama.quantize(params, method=spec.quantize)
    return lambda batch, n: generate(model, params, [prompt(spec)] * batch, n), lambda: None


def twin_runner(spec: Spec):
    import torch

    import torch_llama

    device, sync = torch_device()
    torch.manual_seed(0)
    model = torch_llama.Llama(spec.config).to(device=device, dtype=getattr(torch, spec.dtype)).eval()
    if spec.quantize:
        torch_llama.quantize(model, method=spec.quantize)
    return lambda batch, n: torch_llama.generate(model, [prompt(spec)] * batch, n), sync


def transformers_runner(spec: Spec):
    import torch

    device, sync = torch_device()
    model = transformers_model(spec.config).to(device=device, dtype=getattr(torch, spec.dtype)).eval()
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
    run, sync = {JAX: jax_runner, TWIN: twin_runner, REFERENCE: transformers_runner}[impl](spec)
    result = {}
    for batch in spec.decode_batches:
        for n in (1, spec.new_tokens):  # the warm-up also compiles JAX's (batch, cache) bucket
            result[f"{batch}/{n}"] = timed(lambda: run(batch, n), spec.warmup, spec.repeats, sync)
    return result


def int8_variants(spec: Spec) -> dict[str, Spec]:
    """The int8 rows: our twins and transformers (through torchao) on int8 weights (per channel)
    in the bench's dtype, and, where that is not bfloat16 already, with bfloat16 activations too:
    the dtype torch's int8 weight kernel (torch._weight_int8pack_mm) multiplies in."""
    impls = (JAX, TWIN, REFERENCE)
    variants = {f"{impl} int8": dataclasses.replace(spec, quantize="int8") for impl in impls}
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


def summarize(times: dict[str, dict | None], spec: Spec, bandwidth: float) -> dict:
    """times[impl] = measure()'s lists pooled over rounds (None: not run) -> the JSON entry.
    Rows named in int8_variants are measured against their own (int8) bandwidth bound."""
    weight_bytes = bytes_per_token(spec, JAX)
    bound = bandwidth / weight_bytes
    new, rows = spec.new_tokens, {}
    for impl, t in times.items():
        rows[impl] = None if t is None else {}
        for batch in spec.decode_batches if t else ():
            first, full = statistics.median(t[f"{batch}/1"]), statistics.median(t[f"{batch}/{new}"])
            # None where decoding is too fast to tell from the noise of the first token's time
            rate = (new - 1) * batch / (full - first) if full > first else None
            rows[impl][str(batch)] = {"ttft_s": first, "decode_tokens_per_s": rate,
                                      "runs_first_s": t[f"{batch}/1"], "runs_full_s": t[f"{batch}/{new}"]}
    for batch in spec.decode_batches:
        per_batch = {impl: r and r[str(batch)] for impl, r in rows.items()}
        add_ratios(per_batch, "decode_tokens_per_s")
    int8_bound = {}
    for label, r in rows.items():
        if r and "1" in r:
            rate = r["1"]["decode_tokens_per_s"]
            row_bound = bandwidth / bytes_per_token(spec, label)
            r["1"]["bound_tokens_per_s"] = row_bound
            r["1"]["of_bandwidth_bound"] = None if rate is None else rate / row_bound
            if label in int8_variants(spec):
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=".", help="directory for generate.{md,json} (default .)")
    parser.add_argument("--no-int8", action="store_true", help="skip the int8 rows")
    args = parser.parse_args(argv)
    spec, found = Spec(warmup=1, repeats=args.repeats), probe()
    if missing_note(found):
        say(f"warning: {missing_note(found)}")
    bandwidth = spawn("machine", spec)["read_bandwidth"]
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


if __name__ == "__main__":
    sys.exit(main())
