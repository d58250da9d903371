"""Serving throughput: `jax-llama serve`'s batching against the same requests one at a time.

The server runs in this process on a loopback port (the same Server and engine `jax-llama serve`
starts); clients are the `openai` package's, streaming /v1/chat/completions greedily. Each round
sends the requests one after another, then all at once (the order alternating between rounds);
the figures are medians over rounds: generated tokens per second of wall time, and the time to
each request's first streamed text.

    python -m llama_twins.bench.serve CHECKPOINT [--requests 32] [--max-batch 8]
        [--new-tokens 64] [--rounds 2] [--out DIR]     # writes DIR/serve.{md,json} (DIR: .)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import cpu_model, say, write_results

QUESTIONS = ["What is the capital of {}?", "Name a famous person from {}.",
             "Describe the weather in {} in two sentences.", "What food is {} known for?"]
PLACES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Norway", "Peru"]


def prompts(n: int) -> list[str]:
    asks = [q.format(p) for q in QUESTIONS for p in PLACES]
    return [asks[i % len(asks)] for i in range(n)]


def start(checkpoint: str, max_batch: int):
    """(base URL, Server, stop()) for a server on a free loopback port, in a thread."""
    import jax_llama
    from bridge.chat import find_template
    from bridge.tokenizer import find_tokenizer
    from jax_llama.inference.serving import Engine

    from ..server import Server, serve_in_thread

    tokenizer = find_tokenizer(checkpoint)
    model, params = jax_llama.load(checkpoint)
    engine = Engine(model, params, max_batch=max_batch)
    server = Server(engine, model, params, tokenizer, find_template(checkpoint, tokenizer, None),
                    "bench")
    url, stop = serve_in_thread(server)
    return url + "/v1", server, stop


def one(client, question: str, new_tokens: int) -> dict:
    """A streamed greedy chat request: its tokens, text, and seconds to the first text."""
    started, first, text, tokens = time.perf_counter(), None, "", 0
    for chunk in client.chat.completions.create(
            model="bench", messages=[{"role": "user", "content": question}],
            max_tokens=new_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - started
            text += chunk.choices[0].delta.content
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return {"tokens": tokens, "text": text, "first_s": first}


def measure(client, questions: list[str], new_tokens: int, together: bool) -> dict:
    started = time.perf_counter()
    if together:
        with ThreadPoolExecutor(len(questions)) as pool:
            results = list(pool.map(lambda q: one(client, q, new_tokens), questions))
    else:
        results = [one(client, q, new_tokens) for q in questions]
    wall = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "first_s_median": statistics.median(r["first_s"] or wall for r in results),
            "texts": [r["text"] for r in results]}


def run(checkpoint: str, n_requests: int = 32, max_batch: int = 8, new_tokens: int = 64,
        rounds: int = 2) -> dict:
    import openai

    url, server, stop = start(checkpoint, max_batch)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    questions = prompts(n_requests)
    try:
        say("warming up: one request alone, then a full batch (compiles every shape used)")
        measure(client, questions[:1], new_tokens, False)
        measure(client, questions[:max_batch], new_tokens, True)
        runs = {"one at a time": [], "all at once": []}
        for r in range(rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                m = measure(client, questions, new_tokens, name == "all at once")
                runs[name].append(m)
                say(f"round {r + 1}/{rounds}: {name}: {m['tokens_per_s']:.1f} tokens/s "
                    f"({m['tokens']} tokens in {m['wall_s']:.1f} s)")
        sizes = server.engine.batch_sizes
    finally:
        stop()
    same = all(a == b for a, b in zip(runs["one at a time"][0]["texts"],
                                      runs["all at once"][0]["texts"]))
    rows = {name: {"tokens_per_s": statistics.median(m["tokens_per_s"] for m in ms),
                   "wall_s": statistics.median(m["wall_s"] for m in ms),
                   "first_s_median": statistics.median(m["first_s_median"] for m in ms),
                   "tokens": ms[0]["tokens"]} for name, ms in runs.items()}
    return {"checkpoint": Path(checkpoint).name, "cpu": cpu_model(), "cores": os.cpu_count(),
            "requests": n_requests, "max_batch": max_batch, "new_tokens": new_tokens,
            "rounds": rounds, "rows": rows, "same_answers": same,
            "largest_batch": max(sizes) if sizes else 0}


def markdown(result: dict) -> list[str]:
    base = result["rows"]["one at a time"]["tokens_per_s"]
    lines = [f"## Serving {result['checkpoint']}: {result['requests']} streamed greedy chat "
             f"requests of up to {result['new_tokens']} new tokens, `--max-batch "
             f"{result['max_batch']}`", "",
             f"{result['cpu']}, {result['cores']} cores; server and clients in one process, "
             f"loopback; medians of {result['rounds']} rounds", "",
             "| requests | generated tokens/s | vs one at a time | wall (s) | first text, median (s) |",
             "|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | "
                     f"{r['wall_s']:.1f} | {r['first_s_median']:.2f} |")
    lines += ["", f"Answers all at once equal to the ones one at a time: "
                  f"{'yes' if result['same_answers'] else 'NO'}; the largest batch decoded: "
                  f"{result['largest_batch']} rows"]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    result = run(args.checkpoint, args.requests, args.max_batch, args.new_tokens, args.rounds)
    command = (f"python -m llama_twins.bench.serve <{Path(args.checkpoint).name}> --requests "
               f"{args.requests} --max-batch {args.max_batch} --new-tokens {args.new_tokens} "
               f"--rounds {args.rounds}")
    write_results("serve", ["# jax-llama serve", "", f"Reproduce: `{command}`", "",
                            *markdown(result)], {**result, "command": command}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
