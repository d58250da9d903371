"""A prompt's rows through 4-bit or int8 weights: the prompt kernel against XLA's product.

    python scripts/prompt_int4.py [--weights int4|int8] [--shapes smollm2,llama3-8b]
        [--rows 512] [--rounds 7] [--out results/kernels]

For each model's projections (fused q/k/v, o, fused gate/up, down, as
jax_llama.model.projections calls them) with random weights, `--rows` rows of x (a prompt) with
bfloat16 activations (generation's default) go through both implementations in alternating
calls: "xla", what a prefill ran before the prompt kernels (int4: projections.int4_matmul, x
rounded to bfloat16, the weight dequantised to float32 and multiplied by XLA's dot; int8:
projections.int8_matmul on the rounded x, XLA's float32 product by blocks of columns), and
"kernel" (kernels.matvec_int4 or matvec_int8, which take PROMPT_ROWS rows or more to
"jax_llama_prompt_int4_bf16" / "jax_llama_prompt_int8_bf16" where the library has AVX512_BF16).
The 4-bit weights are Q4_0's form (float16 scales, no minima), the int8 ones have one float32
scale an output (a Q8_0 or Q6_K file's int8 rows). Reports the medians, GFLOP/s and xla /
kernel, with the CPU; writes OUT/prompt_<weights>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SHAPES = {"smollm2": (576, 1536, 192), "llama3.2-1b": (2048, 8192, 512),
          "llama3-8b": (4096, 14336, 1024)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", choices=("int4", "int8"), default="int4")
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="results/kernels")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from bridge.int4 import using_activations
    from jax_llama.model import kernels
    from jax_llama.model.projections import int4_matmul, int8_input, int8_matmul
    from llama_twins.bench.common import code_paths, code_paths_line, cpu_model

    if not kernels.prompt_bf16():
        raise SystemExit("the prompt kernel does not run here (needs the kernels built with "
                         "AVX512_BF16: jax-llama kernels build)")
    rng = np.random.default_rng(0)
    rows = []
    for name in args.shapes.split(","):
        D, F, KV = SHAPES[name]
        for I, outs in ((D, [D, KV, KV]), (D, [D]), (D, [F, F]), (F, [D])):
            if args.weights == "int4":
                ws = [(jnp.asarray(rng.integers(0, 256, (O, I // 2), dtype=np.uint8)),
                       jnp.asarray((rng.random((O, I // 32)) * 0.01 + 1e-3).astype(np.float16)),
                       None) for O in outs]
            else:
                ws = [(jnp.asarray(rng.integers(-127, 128, (I, O), dtype=np.int8)),
                       jnp.asarray((rng.random((1, O)) * 0.01 + 1e-4).astype(np.float32)))
                      for O in outs]
            x = jnp.asarray(rng.standard_normal((args.rows, I)).astype(np.float32))
            with using_activations("bfloat16"):
                if args.weights == "int4":
                    xla = jax.jit(lambda x, ws: [int4_matmul(x, q, d, m, jnp.float32)
                                                 for q, d, m in ws])
                    kernel = jax.jit(kernels.matvec_int4)
                else:
                    xla = jax.jit(lambda x, ws: [int8_matmul(int8_input(x), q, s, jnp.float32)
                                                 for q, s in ws])
                    kernel = jax.jit(lambda x, ws: kernels.matvec_int8(int8_input(x), ws))
                a, b = xla(x, ws), kernel(x, ws)
            err = max(float(jnp.abs(u - v).max() / jnp.abs(u).max()) for u, v in zip(a, b))
            times = {"xla": [], "kernel": []}
            for _ in range(args.rounds):
                for which, f in (("xla", xla), ("kernel", kernel)):
                    t = time.perf_counter()
                    jax.block_until_ready(f(x, ws))
                    times[which].append(time.perf_counter() - t)
            flops = 2 * args.rows * I * sum(outs)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append(dict(model=name, call=f"{I} -> {'+'.join(map(str, outs))}",
                             xla_ms=med["xla"] * 1e3, kernel_ms=med["kernel"] * 1e3,
                             xla_gflops=flops / med["xla"] / 1e9,
                             kernel_gflops=flops / med["kernel"] / 1e9,
                             ratio=med["xla"] / med["kernel"], max_rel_diff=err))
            r = rows[-1]
            print(f"{name} {r['call']}: xla {r['xla_ms']:.1f} ms ({r['xla_gflops']:.0f} GFLOP/s), "
                  f"kernel {r['kernel_ms']:.1f} ms ({r['kernel_gflops']:.0f}), "
                  f"{r['ratio']:.2f}x, max diff {err:.1e} of the largest", flush=True)
    machine = cpu_model() + code_paths_line(code_paths())
    command = "python scripts/prompt_int4.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"prompt_{args.weights}.json").write_text(json.dumps(dict(command=command, machine=machine,
                                                          rows=rows), indent=1) + "\n")
    kind = "4-bit" if args.weights == "int4" else "int8"
    lines = [f"# {args.rows} prompt rows through {kind} weights: the prompt kernel against XLA",
             "", f"`{command}`; {machine}; medians of {args.rounds} alternating calls.", "",
             "| model | call (in -> outs) | xla ms | kernel ms | xla GFLOP/s | kernel GFLOP/s "
             "| xla / kernel |", "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['call']} | {r['xla_ms']:.1f} | {r['kernel_ms']:.1f} | "
              f"{r['xla_gflops']:.0f} | {r['kernel_gflops']:.0f} | {r['ratio']:.2f}x |"
              for r in rows]
    (out / f"prompt_{args.weights}.md").write_text("\n".join(lines) + "\n")
    print(f"written: {out / f'prompt_{args.weights}.md'}, {out / f'prompt_{args.weights}.json'}")


if __name__ == "__main__":
    main()
