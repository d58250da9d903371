"""The default model at its size (issue 57, part 3): LLaMA 3 8B's layout, synthesised tensor by
tensor into a Q4_0 GGUF file (random weights at realistic scales, written as blocks: no float copy
of the model is ever made), then, each in a process of its own so that its peak RSS is its own:

  - int4:    jax_llama.load(FILE, quantize="stored") - the Q4_0 projections as 4-bit weights exactly, the
             Q8_0 head and the Q4_0 embedding as int8 rows - then batch-1 greedy decoding with a KV
             cache of 8,192 slots (the context the 8k figure is about), time to first token and
             tokens/s;
  - int4-q8: the same with JAX_LLAMA_INT4_ACTIVATIONS=int8 (x rounded to 8 bits per group of 32
             before each 4-bit product, each group summed as integers: llama.cpp's arithmetic;
             the int4 row sets float32);
  - int4-bf16: the same with JAX_LLAMA_INT4_ACTIVATIONS=bfloat16 (x rounded to bfloat16, pairs
             multiplied by vdpbf16ps where the CPU has AVX512_BF16);
  - int8:    jax_llama.load(FILE, quantize="int8") - each projection quantised to int8 as it is read -
             and the same decoding;
  - llama.cpp on the same file (llama-cpp-python), the same prompt and greedy decoding;
  - qlora:   a LoRA train step (rank 16 on every projection, AdamW, layers rematerialised) at
             batch 1 x 512 on the 4-bit base: the base stays 4-bit, its gradient dequantises each
             weight again (jax_llama.model.projections.int4_matmul).

The memory each needs is estimated and printed before it loads. Results: OUT/llama8b.{md,json}.

    python scripts/llama8b_int4.py [--file PATH] [--new 16] [--seq 512] [--rounds 1]
        [--only int4,int4-q8,int4-bf16,int8,llama.cpp,qlora] [--out results/llama8b]

The file (4.7 GB) is written to a temporary directory and removed at the end, unless --file names
one to keep (an existing file is used as it is).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

PRESET = "llama3-8b"
PROMPT = [128000] + [1000 + 37 * i for i in range(15)]  # 16 tokens
CACHE = 8192
REMAT = os.environ.get("QLORA_REMAT", "1") == "1"  # 0: without (an experiment's switch)
GIB = 2 ** 30


def config():
    from bridge.config import preset
    return preset(PRESET)


# -- the file ---------------------------------------------------------------------------------------

def synthesise(path: Path, seed: int = 0) -> dict:
    """Write LLaMA 3 8B's tensors as a Q4_0 GGUF (bridge.gguf.write: its file rules - the output
    projection Q8_0, 1-D tensors F32), each drawn as its blocks: 4-bit q uniform in 0..15 with
    float16 scales d about 0.0043 (so w = d (q - 8) has a standard deviation about 0.02, the
    init's; wo and w2 1 / sqrt(2 L) of that), Q8_0's int8 q with d about 0.02 / 73; norms 1. One
    tensor in memory at a time."""
    import ml_dtypes  # noqa: F401  (float16 scales via numpy)

    from bridge.gguf.write import Encoded, write_gguf
    from bridge.tensors import canonical_shapes
    from bridge.tokenizer import load_tokenizer

    c = config()
    shapes = canonical_shapes(c)
    rng = np.random.default_rng(seed)

    def blocks(shape, kind: str, scale: float = 1.0) -> Encoded:
        rows, cols = shape
        n = cols // 32
        if kind == "Q4_0":
            d = (0.0043 * scale * rng.uniform(0.5, 1.5, (rows, n))).astype(np.float16)
            data = np.empty((rows, n, 18), np.uint8)
            data[..., 2:] = rng.integers(0, 256, (rows, n, 16), np.uint8)
        else:  # Q8_0
            d = (0.02 / 73 * rng.uniform(0.5, 1.5, (rows, n))).astype(np.float16)
            data = np.empty((rows, n, 34), np.uint8)
            data[..., 2:] = rng.integers(-127, 128, (rows, n, 32), np.int8).view(np.uint8)
        data[..., :2] = d[..., None].view(np.uint8)
        return Encoded(data.reshape(rows, -1), kind)

    def fetch(name: str):
        shape = shapes[name]
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        if name == head:
            return blocks(shape, "Q8_0")
        # the projections into the residual stream scaled by 1 / sqrt(2 L), as GPT-2's init
        # does, so that 32 random layers keep it within float16 (llama.cpp's KV cache)
        out = name.endswith(("attention.wo.weight", "feed_forward.w2.weight"))
        return blocks(shape, "Q4_0", 1 / math.sqrt(2 * c.n_layers) if out else 1.0)

    head = "output.weight" if "output.weight" in shapes else "tok_embeddings.weight"  # tied
    specs = {name: (shape, np.dtype(np.float32)) for name, shape in shapes.items()}
    tokenizer = load_tokenizer(ROOT.parent / "shared" / "tokenizers" / "llama3" / "tokenizer.model")
    start = time.perf_counter()
    write_gguf(path, c, specs, fetch, dtype="q4_0", tokenizer=tokenizer, overwrite=True)
    return {"seconds": time.perf_counter() - start, "bytes": path.stat().st_size}


# -- estimates --------------------------------------------------------------------------------------

def estimates() -> dict:
    """Bytes each process should need: its params as held (4-bit: half a byte a weight with a
    float16 scale per 32, Q4_0's blocks held without their minima, -8 d; int8 rows: a byte a
    weight and a float32 scale a row), and the float32 KV cache of 8,192 slots at batch 1."""
    from bridge.tensors import canonical_shapes

    c = config()
    int4 = int8 = 0
    for name, shape in canonical_shapes(c).items():
        n = math.prod(shape)
        if len(shape) == 1:
            int4, int8 = int4 + 4 * n, int8 + 4 * n
        elif name in ("output.weight", "tok_embeddings.weight"):
            rows = shape[0]
            int4 += n + 4 * rows
            int8 += n + 4 * rows if name == "output.weight" else 4 * n  # int8: a float table
        else:
            int4 += n // 2 + 2 * (n // 32)
            int8 += n + 4 * shape[0]
    kv = 2 * c.n_layers * c.n_kv_heads * CACHE * c.head_dim * 4
    return {"int4_params": int4, "int8_params": int8, "kv_cache_8k": kv,
            "kv_cache_8k_bfloat16": kv // 2}


# -- the workers (each in a process of its own) ----------------------------------------------------

def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def decode_jax(mode: str, path: str, new: int) -> dict:
    import jax
    import jax.numpy as jnp

    import jax_llama
    from bridge.sampling import Sampler
    from jax_llama.inference import generate as g

    start = time.perf_counter()
    model, params = jax_llama.load(path, **{mode: True})
    jax.block_until_ready(params)
    loaded, rss_loaded = time.perf_counter() - start, peak_rss()
    held = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    tokens, mask = np.asarray([PROMPT], np.int32), np.ones((1, len(PROMPT)), bool)
    stops = np.full((8,), -1, np.int32)
    static = dict(model=model, sampler=Sampler(), tempered=False)

    def run(n):  # the prompt into a cache of CACHE slots, then n - 1 more tokens
        t = time.perf_counter()
        d = g._prefill(params, tokens, mask, stops, jax.random.key(0), cache_len=CACHE, **static)
        if n > 1:
            d = g._decode(params, d, jnp.int32(n), stops, **static)[0]
        ids = np.asarray(d.tokens_BN)[0, :n].tolist()
        return time.perf_counter() - t, ids
    run(2)  # compiles both programs
    first, _ = run(1)
    full, ids = run(new)
    return {"load_s": loaded, "params_bytes": held, "rss_after_load": rss_loaded,
            "first_token_s": first, "decode_tokens_per_s": (new - 1) / (full - first),
            "tokens": ids, "peak_rss": peak_rss()}


def decode_llama_cpp(path: str, new: int) -> dict:
    """llama.cpp on the same file, its weights repacked for this CPU unless it was built with
    AMX (whose repacked matmul crashes on this file: llama_cpp_reference.repacks_safely)."""
    import contextlib

    import llama_cpp

    from llama_twins.llama_cpp_reference import (build_features, last_logits, plain_cpu_kernels,
                                                 repacks_safely)

    repacks = repacks_safely()
    start = time.perf_counter()
    with contextlib.nullcontext() if repacks else plain_cpu_kernels():
        llm = llama_cpp.Llama(model_path=path, n_ctx=CACHE, n_batch=512, verbose=False,
                              n_threads=len(os.sched_getaffinity(0)))
    loaded = time.perf_counter() - start

    def run(n):
        t = time.perf_counter()
        llm.reset()
        llm.eval(PROMPT)
        out = []
        for _ in range(n):
            out.append(int(np.argmax(last_logits(llm))))
            if len(out) < n:
                llm.eval([out[-1]])
        return time.perf_counter() - t, out
    run(2)
    first, _ = run(1)
    full, ids = run(new)
    return {"load_s": loaded, "first_token_s": first,
            "decode_tokens_per_s": (new - 1) / (full - first), "tokens": ids,
            "peak_rss": peak_rss(), "build": build_features(), "repacked": repacks}


def qlora_step(path: str, seq: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import jax_llama
    from bridge.lora import LoraConfig
    from jax_llama.lora import add_lora, combine, count, split

    model, params = jax_llama.load(path, quantize="stored")
    lora = LoraConfig(rank=16, alpha=32.0,
                      targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
    model, params = add_lora(model.clone(remat=REMAT), params, lora)
    weights, adapters = split(params)
    optimizer = optax.adamw(1e-4)
    opt_state = optimizer.init(adapters)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 128000, (1, seq + 1)), jnp.int32)

    def loss(adapters, weights):
        logits = model.apply({"params": combine(weights, adapters)}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit  # the base weights an argument, not constants captured in the program (a copy)
    def step(adapters, opt_state, weights):
        value, grads = jax.value_and_grad(loss)(adapters, weights)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    t = time.perf_counter()
    compiled = step.lower(adapters, opt_state, weights).compile()
    compile_s = time.perf_counter() - t
    temp = compiled.memory_analysis().temp_size_in_bytes
    t = time.perf_counter()
    adapters, opt_state, value = compiled(adapters, opt_state, weights)
    value = float(value)
    step_s = time.perf_counter() - t
    return {"adapter_params": count(adapters), "compile_s": compile_s, "step_s": step_s,
            "tokens_per_s": seq / step_s, "loss": value, "xla_temp_bytes": temp,
            "peak_rss": peak_rss()}


def worker(name: str, path: str, args) -> None:
    if name == "synth":
        result = synthesise(Path(path))
    elif name in ("int4", "int4-q8", "int4-bf16", "int8"):
        from bridge.int4 import ACTIVATIONS_ENV  # int4-q8: x rounded to 8 bits per group of
        # 32, integer sums; int4-bf16: x rounded to bfloat16; int4: x as it is, float32
        os.environ[ACTIVATIONS_ENV] = {"int4-q8": "int8", "int4-bf16": "bfloat16"}.get(name,
                                                                                     "float32")
        result = decode_jax("int8" if name == "int8" else "nearest", path, args.new)
    elif name == "llama.cpp":
        result = decode_llama_cpp(path, args.new)
    else:
        result = qlora_step(path, args.seq)
    result["peak_rss"] = peak_rss()
    print(json.dumps(result))


def spawn(name: str, path: Path, args) -> dict | str:
    print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, "--worker", name, "--file", str(path),
                           "--new", str(args.new), "--seq", str(args.seq), "--preset", args.preset],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(r: dict, cpu: str, memory: int) -> list[str]:
    from llama_twins.bench.common import code_paths_line

    e = r["estimates"]

    def gb(x):
        return f"{x / GIB:.2f} GiB"

    types = r["synth"].get("types") or {"Q4_0": 1}  # the file's types, most common first
    quantised = [t for t in types if t not in ("F32", "F16", "BF16")]
    kind = quantised[0] if quantised else "Q4_0"
    blocks = ", ".join(f"{t} x{n}" for t, n in types.items()) if r["synth"].get("types") else kind

    lines = [f"# LLaMA 3 8B's layout at its size: 4-bit and int8 on a {memory / GIB:.0f} GiB machine",
             "", f"{cpu}; `python scripts/llama8b_int4.py --new {r['new']} --seq {r['seq']} "
             f"--rounds {r.get('rounds', 1)}`; "
             f"random weights at realistic scales written as {blocks} blocks "
             f"({gb(r['synth']['bytes'])}"
             + (" on disk, the file an earlier run wrote, reused)." if r["synth"].get("reused") else
                f" on disk, written in {r['synth']['seconds']:.0f} s, peak RSS "
                f"{gb(r['synth']['peak_rss'])}).") + code_paths_line(r.get("paths")), "",
             "| process | estimate before loading | params held | peak RSS | load | first token "
             "| decode tokens/s |", "|---|---|---|---|---|---|---|"]
    for name, estimate in (("int4", e["int4_params"] + e["kv_cache_8k"]),
                           ("int4-q8", e["int4_params"] + e["kv_cache_8k"]),
                           ("int4-bf16", e["int4_params"] + e["kv_cache_8k"]),
                           ("int8", e["int8_params"] + e["kv_cache_8k"]), ("llama.cpp", None)):
        x = r.get(name, "not run")
        if isinstance(x, str):
            lines.append(f"| {name} | | {x} | | | | |")
            continue
        lines.append(f"| {name} | {gb(estimate) if estimate else '-'} | "
                     f"{gb(x['params_bytes']) if 'params_bytes' in x else '-'} | "
                     f"{gb(x['peak_rss'])} | {x['load_s']:.1f} s | {x['first_token_s']:.2f} s | "
                     f"{x['decode_tokens_per_s']:.2f} |")
    q = r["qlora"]
    lines += ["", "Estimates: params as held plus the float32 KV cache of 8,192 slots at batch 1 "
              f"({gb(e['kv_cache_8k'])}; bfloat16 would be {gb(e['kv_cache_8k_bfloat16'])}); "
              "the JAX rows decode with a cache of that size."]
    lines += ["", "int4-q8: the int4 process with JAX_LLAMA_INT4_ACTIVATIONS=int8 (x rounded to 8 "
              "bits per group of 32 before each 4-bit product, each group summed as integers, as "
              "llama.cpp's Q4_0 does); int4-bf16: with =bfloat16 (x rounded to bfloat16)."]
    if r.get("rounds", 1) > 1:
        lines += ["", f"{r['rounds']} rounds, each process in its own round in turn; a row shows "
                  "its median round, and decode tokens/s by round: "
                  + "; ".join(f"{n} {', '.join(f'{t:.2f}' for t in r['by_round'][n])}"
                              for n in r["by_round"])]
    for name in ("int4", "int4-q8", "int4-bf16"):
        x, lcpp = r.get(name), r["llama.cpp"]
        if not (isinstance(x, dict) and isinstance(lcpp, dict)):
            continue
        ratios = ([a / b for a, b in zip(r["by_round"][name], r["by_round"]["llama.cpp"])]
                  if r.get("rounds", 1) > 1 else
                  [x["decode_tokens_per_s"] / lcpp["decode_tokens_per_s"]])
        ratio = float(np.median(ratios))
        same = x["tokens"] == lcpp["tokens"]
        spread = f" (rounds {min(ratios):.2f}-{max(ratios):.2f}x)" if len(ratios) > 1 else ""
        lines += ["", f"{name} against llama.cpp {kind} on the same file: {ratio:.2f}x{spread} "
                  f"(target 0.9x: {'met' if ratio >= 0.9 else 'not met'}); greedy tokens "
                  f"{'the same' if same else 'differ'} ({x['tokens'][:8]} ... against "
                  f"{lcpp['tokens'][:8]} ...)."]
    lcpp = r.get("llama.cpp")
    if isinstance(lcpp, dict) and "build" in lcpp:
        lines += ["", f"llama.cpp as built: `{lcpp['build']}`; "
                  + ("its weights repacked for this CPU." if lcpp["repacked"] else
                     "without repacking its weights (built with AMX, whose repacked matmul "
                     "crashes on this file).")]
    if isinstance(q, dict):
        lines += ["", f"QLoRA: rank 16 on all seven projections ({q['adapter_params']:,} "
                  f"parameters), AdamW, batch 1 x {r['seq']}, layers rematerialised: a step in "
                  f"{q['step_s']:.0f} s ({q['tokens_per_s']:.2f} tokens/s; compiling it "
                  f"{q['compile_s']:.0f} s, XLA's temporaries {gb(q['xla_temp_bytes'])}), peak "
                  f"RSS {gb(q['peak_rss'])}; loss {q['loss']:.3f} (random weights and tokens)."]
    else:
        lines += ["", f"QLoRA: {q}"]
    return lines


def main(argv=None) -> int:
    global PRESET
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", help="the GGUF to use (a Q4_0 one written there if absent, and "
                                       "kept; load_speed.py --write-q4-k makes a Q4_K one from it)")
    parser.add_argument("--new", type=int, default=16, help="tokens decoded (default 16)")
    parser.add_argument("--seq", type=int, default=512, help="tokens of the QLoRA step (512)")
    parser.add_argument("--out", default=str(ROOT / "results" / "llama8b"))
    parser.add_argument("--only", default="int4,int4-q8,int4-bf16,int8,llama.cpp,qlora")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each process runs, in turn (default 1)")
    parser.add_argument("--preset", default=PRESET, help=argparse.SUPPRESS)  # a smaller trial
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    PRESET = args.preset
    if args.worker:
        worker(args.worker, args.file, args)
        return 0
    from llama_twins import results
    from llama_twins.bench.common import code_paths, cpu_model

    with tempfile.TemporaryDirectory(prefix="llama8b-") as tmp:
        path = Path(args.file) if args.file else Path(tmp) / f"{args.preset}-q4_0.gguf"
        r = {"new": args.new, "seq": args.seq, "estimates": estimates()}
        e = r["estimates"]
        print(f"estimates: int4 params {e['int4_params'] / GIB:.2f} GiB, int8 params "
              f"{e['int8_params'] / GIB:.2f} GiB, KV cache of {CACHE} slots "
              f"{e['kv_cache_8k'] / GIB:.2f} GiB (float32)", file=sys.stderr)
        if path.exists():
            from bridge.formats import open_checkpoint
            r["synth"] = {"reused": True, "bytes": path.stat().st_size,
                          "types": open_checkpoint(path).tensor_types}
        else:
            r["synth"] = spawn("synth", path, args)
            if isinstance(r["synth"], str):
                print(f"synth: {r['synth']}", file=sys.stderr)
                return 1
        names = ("int4", "int4-q8", "int4-bf16", "int8", "llama.cpp", "qlora")
        runs = {name: [] for name in names}
        for round_ in range(args.rounds):  # each process once a round, in turn
            for name in names:
                if name in args.only.split(","):
                    runs[name].append(spawn(name, path, args))
                    print(f"{name}: {runs[name][-1]}", file=sys.stderr, flush=True)
        r["rounds"], r["by_round"] = args.rounds, {}
        for name in names:
            done = [x for x in runs[name] if isinstance(x, dict)]
            if not runs[name]:
                r[name] = "not run"
            elif not done:
                r[name] = runs[name][0]
            elif "decode_tokens_per_s" in done[0]:
                r["by_round"][name] = [x["decode_tokens_per_s"] for x in done]
                r[name] = sorted(done, key=lambda x: x["decode_tokens_per_s"])[len(done) // 2]
            else:
                r[name] = done[0]
    r["memory"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    r["cpu_model"] = cpu_model()
    r["paths"] = code_paths()
    print(results.write("llama8b", r, render, args.out))
    return 0


def render(r: dict) -> list[str]:
    return markdown(r, r["cpu_model"], r["memory"])


if __name__ == "__main__":
    sys.exit(main())
