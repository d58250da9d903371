"""`jax-llama bench --llama-bench FILE`: the two numbers llama.cpp's llama-bench reports, for
jax-llama and for llama.cpp on the same GGUF file, side by side.

- **pp512**: a prompt of 512 tokens processed at batch 1, from an empty cache. Ours:
  `jax_llama.generate` of one token after the prompt (the prefill, and the first token picked
  from its logits: what a chat, `eval` or the server's prefill waits for); llama.cpp:
  `Llama.eval` of the same 512 tokens (llama-cpp-python, its batch 512: one pass).
- **tg128**: 128 tokens generated one at a time. Ours: `generate` of 129 tokens after a 1-token
  prompt less `generate` of 1 (greedy, each token the argmax on the device); llama.cpp: the 1-token
  prompt evaluated, then 128 single-token `eval`s, each token the argmax of its logits.

Tokens are random ids (as llama-bench's are), the same for both. Each side runs in a worker
process of its own, `rounds` times in alternating order, `repeats` timed runs each after one
untimed run (which compiles ours); the table gives the mean and standard deviation of tokens/s
over every timed run, as llama-bench does, and ours over llama.cpp's (the ratio of the means).
Our model loads as the commands load it (bridge.layout's "auto": a quantised file as stored) or
as `quantize` says; llama.cpp runs the file as it is, on every core, built as installed
(llama_twins.llama_cpp_reference: without weight repacking where it was built with AMX).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from .. import results
from .common import (JAX, LLAMA_CPP, Spec, code_paths, code_paths_line, run_variant_rounds, say,
                     timed)

BENCH = "llama-bench"
PP, TG = 512, 128


def _ids(spec: Spec, n: int) -> list[int]:
    """n random token ids below the vocabulary's size, the same in every worker."""
    import numpy as np
    return np.random.default_rng(0).integers(0, spec.config.vocab_size, n).tolist()


def _ours(spec: Spec):
    """run(prompt, n): jax_llama.generate of n greedy tokens after `prompt`, as loaded by the
    commands (spec.quantize None: bridge.layout's "auto"; "float": float32)."""
    import jax_llama
    from jax_llama.inference.generate import generate

    if spec.quantize == "float":
        model, params = jax_llama.load(spec.weights, "float32")
    else:
        model, params = jax_llama.load(spec.weights, quantize=spec.quantize or "auto")
    return lambda prompt, n: generate(model, params, [prompt], n)


def _llama_cpp(spec: Spec):
    """run(prompt, n): llama.cpp's eval of `prompt` from an empty cache, then n - 1 single-token
    evals, each token the argmax of the last logits (llama-cpp-python)."""
    import numpy as np

    from llama_twins.llama_cpp_reference import last_logits, open_model

    llm = open_model(spec.gguf, spec.prompt_len + spec.new_tokens + 8, n_batch=spec.prompt_len,
                     n_ubatch=spec.prompt_len)

    def run(prompt, n):
        llm.reset()
        llm.eval(prompt)
        token = int(np.argmax(last_logits(llm)))
        for _ in range(n - 1):
            llm.eval([token])
            token = int(np.argmax(last_logits(llm)))
        return token
    return run


def measure(impl: str, spec: Spec) -> dict[str, list[float]]:
    """In a worker: {"pp": seconds of each prompt run, "tg1": of each 1-token run, "tg": of each
    (1 + new_tokens)-token run} (tg128's time is tg - tg1, pooled as medians by the parent)."""
    run = {JAX: _ours, LLAMA_CPP: _llama_cpp}[impl](spec)
    prompt, start = _ids(spec, spec.prompt_len), _ids(spec, 1)
    return {"pp": timed(lambda: run(prompt, 1), spec.warmup, spec.repeats),
            "tg1": timed(lambda: run(start, 1), spec.warmup, spec.repeats),
            "tg": timed(lambda: run(start, 1 + spec.new_tokens), spec.warmup, spec.repeats)}


def rates(times: dict[str, list[float]], spec: Spec) -> dict[str, list[float]]:
    """Tokens/s of each timed run: pp from each prompt run; tg from each generation run less the
    median 1-token run (its prompt and first token)."""
    one = statistics.median(times["tg1"])
    return {f"pp{spec.prompt_len}": [spec.prompt_len / t for t in times["pp"]],
            f"tg{spec.new_tokens}": [spec.new_tokens / max(t - one, 1e-9) for t in times["tg"]]}


def file_facts(path: str) -> dict:
    """The model's name as llama-bench writes it, the file's size and its parameter count."""
    from bridge.formats import open_checkpoint
    from bridge.tensors import count_params
    from llama_twins.bench.decode import gguf_file_type

    ckpt = open_checkpoint(path)
    return {"file": str(path), "type": gguf_file_type(path), "bytes": Path(path).stat().st_size,
            "params": count_params(ckpt.config), "config": ckpt.config}


def run(path: str, rounds: int = 2, repeats: int = 3, prompt_len: int = PP,
        new_tokens: int = TG, quantize: str | None = None) -> dict:
    """Both sides on `path` (ours alone where llama-cpp-python does not import, with the reason):
    {"cpu", "cores", "code_paths", "file", ..., "rows": {impl: {test: {"mean", "std", "runs"}}},
    "ratios": {test: ours / llama.cpp}}."""
    from llama_twins.llama_cpp_reference import build_features, unavailable

    facts = file_facts(path)
    spec = Spec(config=facts.pop("config"), prompt_len=prompt_len, new_tokens=new_tokens,
                weights=str(path), gguf=str(path), quantize=quantize, warmup=1, repeats=repeats)
    missing = unavailable()
    variants = {JAX: (JAX, spec)}
    if missing is None:
        variants[LLAMA_CPP] = (LLAMA_CPP, spec)
    say(f"{BENCH}: {Path(path).name}, {', '.join(variants)}, {rounds} round(s) of "
        f"{repeats} runs each")
    times = run_variant_rounds((BENCH,), variants, rounds)
    rows = {}
    for label in variants:
        rows[label] = {test: {"mean": statistics.fmean(r), "std": statistics.pstdev(r),
                              "runs": r}
                       for test, r in rates(times[label][BENCH], spec).items()}
    ratios = ({test: rows[JAX][test]["mean"] / rows[LLAMA_CPP][test]["mean"]
               for test in rows[JAX]} if LLAMA_CPP in rows else {})
    return {**facts, "cpu": results.cpu(), "cores": len(os.sched_getaffinity(0)),
            "code_paths": code_paths(), "layout": quantize or "auto (as the commands load it)",
            "llama_cpp": missing or build_features(), "rounds": rounds, "repeats": repeats,
            "rows": rows, "ratios": ratios}


def markdown(result: dict) -> list[str]:
    """llama-bench's table, a row per implementation and test, with ours over llama.cpp's."""
    r = result
    size = f"{r['bytes'] / 2**30:.2f} GiB"
    params = f"{r['params'] / 1e9:.2f} B" if r["params"] >= 1e9 else f"{r['params'] / 1e6:.0f} M"
    lines = [f"CPU: {results.cpu_words(r['cpu'])}, {r['cores']} cores."
             f"{code_paths_line(r['code_paths'])}",
             f"File: {Path(r['file']).name} ({r['type']}); ours loaded "
             f"{r['layout']}; llama.cpp: "
             + (r["llama_cpp"] if r["ratios"] or LLAMA_CPP in r["rows"] else
                f"not run ({r['llama_cpp']})"),
             f"{r['rounds']} round(s) of one process each, alternating, {r['repeats']} timed runs "
             f"a round; t/s: mean ± standard deviation over the runs, as llama-bench reports.",
             "",
             "| model | size | params | implementation | threads | test | t/s | ours / llama.cpp |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for impl, tests in r["rows"].items():
        for test, t in tests.items():
            ratio = r["ratios"].get(test) if impl == JAX else None
            lines.append(f"| llama {params} {r['type']} | {size} | {params} | {impl} | "
                         f"{r['cores']} | {test} | {t['mean']:.2f} ± {t['std']:.2f} | "
                         + (f"{ratio:.2f}x" if ratio else "") + " |")
    return lines


def write(result: dict, out: str) -> str:
    """OUT/llama_bench.json (the figures, stamped: llama_twins.results) and OUT/llama_bench.md;
    returns the markdown."""
    Path(out).mkdir(parents=True, exist_ok=True)
    return results.write("llama_bench", result, markdown, out)


__all__ = ["BENCH", "PP", "TG", "markdown", "measure", "rates", "run", "write"]
