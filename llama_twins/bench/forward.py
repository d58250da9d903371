"""Forward (prefill) throughput: the jitted `model.apply` against `transformers.LlamaForCausalLM`
under `torch.inference_mode()`, and the torch twin, on the same config and random tokens.

Random weights (each its own; speed does not depend on their values), full logits (B, S, V) from
every implementation, no KV cache. MFU counts 2 x matmul parameters x tokens plus the attention
FLOPs (jax_llama.perf.forward_flops_per_token) against this machine's measured matmul peak.

    python -m llama_twins.bench.forward     # prints the table; `jax-llama bench` runs it with the rest
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from .common import (JAX, REFERENCE, TWIN, Spec, available, describe, missing_note, probe,
                     run_rounds, say, spawn, throughput_rows, throughput_table, timed,
                     torch_device, transformers_model)


def tokens(spec: Spec) -> np.ndarray:
    """(B, S) int32 random ids, the same in every worker."""
    rng = np.random.default_rng(0)
    return rng.integers(0, spec.config.vocab_size, (spec.batch, spec.seq_len), dtype=np.int32)


def _jax(spec: Spec) -> list[float]:
    import jax

    import jax_llama
    model, params = jax_llama.init(spec.config, seed=0, dtype=spec.dtype, param_dtype=spec.dtype)
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t))
    t_BS = jax.device_put(tokens(spec))
    return timed(lambda: forward(params, t_BS).block_until_ready(), spec.warmup, spec.repeats)


def _torch(spec: Spec, impl: str) -> list[float]:
    import torch

    device, sync = torch_device()
    if impl == REFERENCE:
        model = transformers_model(spec.config)
        call = lambda t: model(input_ids=t, use_cache=False).logits  # noqa: E731
    else:
        import torch_llama
        torch.manual_seed(0)
        model = call = torch_llama.Llama(spec.config)
    model = model.to(device=device, dtype=getattr(torch, spec.dtype)).eval()
    t_BS = torch.as_tensor(tokens(spec), dtype=torch.long, device=device)

    def run():
        with torch.inference_mode():
            call(t_BS)
    return timed(run, spec.warmup, spec.repeats, sync)


def measure(impl: str, spec: Spec) -> dict[str, list[float]]:
    """In a worker: seconds per forward pass of `impl`."""
    return {"step": _jax(spec) if impl == JAX else _torch(spec, impl)}


def summarize(times: dict[str, dict | None], spec: Spec, peak: float) -> dict:
    """times[impl] = measure()'s lists pooled over rounds (None: not run) -> the JSON entry."""
    from jax_llama.perf import forward_flops_per_token
    n = spec.batch * spec.seq_len
    flops = forward_flops_per_token(spec.config, spec.seq_len) * n
    return {"batch": spec.batch, "seq_len": spec.seq_len, "tokens": n, "flops": flops,
            "rows": throughput_rows({impl: t and t["step"] for impl, t in times.items()}, n, flops, peak)}


def markdown(result: dict, dtype: str) -> list[str]:
    return [f"## Forward (prefill): batch {result['batch']} x {result['seq_len']} tokens, full "
            f"logits, {dtype}, no cache", "", *throughput_table(result["rows"], "batch")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    spec, found = Spec(), probe()
    if missing_note(found):
        say(f"warning: {missing_note(found)}")
    impls = available(found)
    peak = spawn("machine", spec)["peak_flops"]
    times = run_rounds(("forward",), impls, spec, args.rounds)
    result = summarize({impl: times.get(impl, {}).get("forward") for impl in (JAX, TWIN, REFERENCE)},
                       spec, peak)
    print("\n".join([describe(spec.config), "", *markdown(result, spec.dtype)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
