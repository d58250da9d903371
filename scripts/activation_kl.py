"""How far a quantised GGUF's logits lie from the float path: ours, with float32 and bfloat16
activations, beside llama.cpp's on the same file (issue 81: the default layout stays as close to
the float path as llama.cpp is).

    python scripts/activation_kl.py QUANT.gguf F32.gguf [QUANT2.gguf ...] [--windows 4]
        [--window 121] [--out results/quality]

F32.gguf holds the same weights as float32 (e.g. `llama-bridge convert QUANT.gguf F32.gguf --to
gguf --dtype f32` of the file the quantised ones were made from): jax_llama runs it as the float
path. For each quantised file, rows: jax_llama's default layout of it (quantize="auto", as the
commands load it) with float32 activations and with bfloat16 ones (generation's default,
bridge.int4.GENERATION_DEFAULT; 4-bit and int8 projections round x), and llama.cpp
(llama-cpp-python) on the file. Each row: the mean and largest per-token KL(float || row) and
how often the two agree on the most likely token, over --windows windows of --window tokens of
../shared/data/sst/dev.txt (each window scored from its first token). Writes
OUT/activation_kl.{md,json}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def jax_logps(path: str, chunks, activations: str, quantize: str | None) -> list[np.ndarray]:
    import jax

    import jax_llama
    from bridge.int4 import using_activations

    model, params = jax_llama.load(path, quantize=quantize)
    with using_activations(activations):  # read when traced: one program per choice
        run = jax.jit(lambda p, t: model.apply({"params": p}, t))
        return [log_softmax(np.asarray(run(params, np.asarray([c], np.int32))[0], np.float32))
                for c in chunks]


def llama_cpp_logps(path: str, chunks) -> list[np.ndarray]:
    import llama_cpp

    from llama_twins.llama_cpp_reference import _quiet

    size = len(chunks[0])
    with _quiet():
        llm = llama_cpp.Llama(model_path=path, n_ctx=size, n_batch=size, logits_all=True,
                              verbose=False)
    out = []
    for c in chunks:
        llm.reset()
        llm.eval(c)
        out.append(log_softmax(np.asarray(llm.scores[:len(c)], np.float64)))
    return out


def against(reference: list[np.ndarray], rows: list[np.ndarray]) -> dict:
    kl = np.concatenate([np.sum(np.exp(a) * (a - b), axis=-1) for a, b in zip(reference, rows)])
    same = np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(reference, rows)])
    return {"tokens": int(kl.size), "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "same_top1": float(100 * same.mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("quantised", nargs="+", help="QUANT.gguf F32.gguf [QUANT2.gguf ...]")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=121)
    ap.add_argument("--out", default="results/quality")
    args = ap.parse_args()
    if len(args.quantised) < 2:
        raise SystemExit("expected QUANT.gguf F32.gguf [QUANT2.gguf ...]")
    float_path, files = args.quantised[1], [args.quantised[0], *args.quantised[2:]]

    from bridge.tokenizer import find_tokenizer
    from llama_twins.bench.common import cpu_model, sst_windows, write_results
    from llama_twins.llama_cpp_reference import unavailable

    chunks = sst_windows(find_tokenizer(float_path), args.windows, args.window)
    reference = jax_logps(float_path, chunks, "float32", None)
    rows = []
    for path in files:
        for label, run in (
                ("jax-llama, float32 activations", lambda: jax_logps(path, chunks, "float32", "auto")),
                ("jax-llama, bfloat16 activations (generation)",
                 lambda: jax_logps(path, chunks, "bfloat16", "auto")),
                ("llama.cpp", None if unavailable() else lambda: llama_cpp_logps(path, chunks))):
            if run is None:
                continue
            rows.append({"file": Path(path).name, "row": label, **against(reference, run())})
            r = rows[-1]
            print(f"{r['file']} {label}: mean KL {r['mean_kl']:.3e}, max {r['max_kl']:.3e}, "
                  f"same top-1 {r['same_top1']:.1f}% over {r['tokens']} tokens", flush=True)
    command = "python scripts/activation_kl.py " + " ".join(
        [Path(p).name for p in args.quantised]
        + [f"--{k} {v}" for k, v in vars(args).items() if k != "quantised"])
    lines = ["# Per-token KL from the float path: our default layout's activations beside "
             "llama.cpp", "", f"`{command}`; {cpu_model()}; the float path: "
             f"{Path(float_path).name} as float32 in jax_llama.", "",
             "| file | row | tokens | mean KL | max KL | same top-1 |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['file']} | {r['row']} | {r['tokens']} | {r['mean_kl']:.2e} | "
              f"{r['max_kl']:.2e} | {r['same_top1']:.1f}% |" for r in rows]
    write_results("activation_kl", lines, dict(command=command, machine=cpu_model(),
                                               float_path=Path(float_path).name, rows=rows),
                  args.out)

if __name__ == "__main__":
    main()
