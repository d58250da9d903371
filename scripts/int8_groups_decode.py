"""Decoding with int8 weights in groups (`--quantize int8 --group-size N`): the decode kernels
against XLA's product, beside one scale an output.

    python scripts/int8_groups_decode.py [--model FILE] [--group-size 32] [--new-tokens 64]
        [--rounds 3] [--out results/decode]

The model (default: the installed SmolLM2 GGUF) is loaded as int8 per output channel and as int8
with a scale per --group-size inputs (jax_llama.load(..., quantize="int8", group_size=N)); each
generates --new-tokens greedy tokens after a 20-token prompt with kernels="auto" (the decode
kernels, which serve grouped scales since 2026-12-08) and kernels="xla" (XLA's product: what a
grouped model ran before, each group's weights dequantised per call), in alternating rounds.
Reports decode tokens/s (the median over rounds, the prefill's time excluded: a 1-token run is
subtracted) and whether the two implementations' tokens agree, with the CPU; writes
OUT/int8_groups_decode.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results/decode")
    args = ap.parse_args()

    import jax_llama
    from jax_llama.inference.generate import generate
    from llama_twins.bench.common import cpu_model, given_or_smollm2, write_results

    path = given_or_smollm2(args.model)
    prompt = [[(7 * i) % 1000 + 10 for i in range(20)]]
    models = {}
    for label, group in (("int8 per channel", None), (f"int8 group {args.group_size}",
                                                       args.group_size)):
        model, params = jax_llama.load(path, quantize="int8", group_size=group)
        for kernels in ("auto", "xla"):
            m = model.clone(projections=model.projections.replace(kernels=kernels))
            generate(m, params, prompt, args.new_tokens)  # compile both lengths
            generate(m, params, prompt, 1)
            models[(label, kernels)] = (m, params)
    times = {key: [] for key in models}
    tokens = {}
    for _ in range(args.rounds):
        for key, (m, params) in models.items():
            t = time.perf_counter()
            tokens[key] = generate(m, params, prompt, args.new_tokens).tokens
            whole = time.perf_counter() - t
            t = time.perf_counter()
            generate(m, params, prompt, 1)
            times[key].append((args.new_tokens - 1) / (whole - (time.perf_counter() - t)))
    rows = []
    for label in dict.fromkeys(label for label, _ in models):
        auto, xla = (statistics.median(times[(label, k)]) for k in ("auto", "xla"))
        rows.append(dict(weights=label, kernels_tps=auto, xla_tps=xla, ratio=auto / xla,
                         same_tokens=tokens[(label, "auto")] == tokens[(label, "xla")]))
        r = rows[-1]
        print(f"{label}: kernels {auto:.1f} tokens/s, xla {xla:.1f}, {r['ratio']:.2f}x, "
              f"same tokens: {r['same_tokens']}", flush=True)
    command = "python scripts/int8_groups_decode.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)
    lines = ["# Decoding int8 weights in groups: the decode kernels against XLA", "",
             f"`{command}`; {cpu_model()}; {Path(path).name}, batch 1, {args.new_tokens} greedy "
             f"tokens after 20, median tokens/s of {args.rounds} alternating rounds.", "",
             "| weights | kernels tokens/s | xla tokens/s | kernels / xla | same tokens |",
             "|---|---:|---:|---:|---|"]
    lines += [f"| {r['weights']} | {r['kernels_tps']:.1f} | {r['xla_tps']:.1f} | "
              f"{r['ratio']:.2f}x | {r['same_tokens']} |" for r in rows]
    write_results("int8_groups_decode", lines, dict(command=command, machine=cpu_model(),
                                                    model=Path(path).name, rows=rows), args.out)

if __name__ == "__main__":
    main()
