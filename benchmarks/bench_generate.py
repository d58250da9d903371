"""Decode speed of both twins against `transformers` generate, with their KV caches, in one run.

Same weights (the 56M config of the training benchmark, random init), fp32, a 16-token prompt and
128 new tokens, batch 1 and batch 8, greedy. Each implementation is timed in a worker process of
its own (so that torch's spinning OpenMP threads do not slow XLA's), in alternating rounds.
Time to first token (prefill + one token) is reported apart from decode: decode tokens/s =
127 x batch / (time for 128 tokens - time for 1). The bandwidth bound is this machine's measured
read bandwidth / the weight bytes a decode step reads.

    python benchmarks/bench_generate.py      # writes benchmarks/results/generate.{md,json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_train import CONFIG  # noqa: E402

PROMPT, NEW = list(range(1, 17)), 128
IMPLEMENTATIONS = ("jax-llama generate", "torch_llama generate", "transformers generate")


def jax_runner():
    import jax_llama
    from jax_llama.generate import generate
    model, params = jax_llama.init(CONFIG, seed=0)
    return lambda batch, n: generate(model, params, [PROMPT] * batch, n)


def twin_runner():
    import torch
    import torch_llama
    torch.manual_seed(0)
    model = torch_llama.Llama(CONFIG).eval()
    return lambda batch, n: torch_llama.generate(model, [PROMPT] * batch, n)


def transformers_runner():
    import torch
    import transformers
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        hidden_size=CONFIG.dim, intermediate_size=CONFIG.ffn_dim, num_hidden_layers=CONFIG.n_layers,
        num_attention_heads=CONFIG.n_heads, num_key_value_heads=CONFIG.n_kv_heads,
        vocab_size=CONFIG.vocab_size, max_position_embeddings=CONFIG.max_seq_len,
        rms_norm_eps=CONFIG.norm_eps, rope_theta=CONFIG.rope_theta, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(hf_config).eval()

    def run(batch, n):
        ids = torch.tensor([PROMPT] * batch)
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, use_cache=True,
                                  pad_token_id=0, eos_token_id=None)
    return run


def worker(label: str, repeats: int) -> None:
    run = {"jax-llama generate": jax_runner, "torch_llama generate": twin_runner,
           "transformers generate": transformers_runner}[label]()
    result = {}
    for batch in (1, 8):
        for n in (1, NEW):
            run(batch, n)  # warm-up (and, for JAX, the one compilation per bucket)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run(batch, n)
                times.append(time.perf_counter() - start)
            result[f"{batch}/{n}"] = times
    print(json.dumps(result))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/generate")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.repeats)
        return 0
    from jax_llama.perf import decode_bytes_per_token, measure_read_bandwidth
    bandwidth = measure_read_bandwidth()
    bound = bandwidth / decode_bytes_per_token(CONFIG)
    times = {label: {} for label in IMPLEMENTATIONS}
    for r in range(args.rounds):
        for label in IMPLEMENTATIONS[::1 if r % 2 == 0 else -1]:
            print(f"round {r + 1}/{args.rounds}: {label}", file=sys.stderr)
            out = subprocess.run([sys.executable, __file__, "--worker", label, "--repeats",
                                  str(args.repeats)], capture_output=True, text=True, check=True)
            for key, runs in json.loads(out.stdout.strip().splitlines()[-1]).items():
                times[label].setdefault(key, []).extend(runs)
    rows = {}
    for label, t in times.items():
        rows[label] = {}
        for batch in (1, 8):
            first, full = statistics.median(t[f"{batch}/1"]), statistics.median(t[f"{batch}/{NEW}"])
            rows[label][batch] = {"ttft_s": first, "decode_tokens_per_s": (NEW - 1) * batch / (full - first)}
    base = rows["transformers generate"]
    lines = [f"Decode, fp32, dim {CONFIG.dim}, {CONFIG.n_layers} layers, vocab {CONFIG.vocab_size} "
             f"(56M parameters), {len(PROMPT)}-token prompt, {NEW} new tokens, greedy; measured read "
             f"bandwidth {bandwidth / 1e9:.1f} GB/s, so the batch-1 bound is {bound:.0f} tokens/s; "
             f"medians of {args.rounds} rounds x {args.repeats} runs, each implementation in its "
             f"own process", "",
             "| implementation | batch | time to first token | decode tokens/s | vs transformers | of bandwidth bound |",
             "|---|---|---|---|---|---|"]
    for label, r in rows.items():
        for batch in (1, 8):
            x = r[batch]
            of_bound = f"{x['decode_tokens_per_s'] / bound:.0%}" if batch == 1 else "-"
            lines.append(f"| {label} | {batch} | {x['ttft_s'] * 1000:.0f} ms | "
                         f"{x['decode_tokens_per_s']:,.1f} | "
                         f"{x['decode_tokens_per_s'] / base[batch]['decode_tokens_per_s']:.2f}x | {of_bound} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps({"bandwidth": bandwidth, "bound": bound,
                                                    "rows": rows, "times": times}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
