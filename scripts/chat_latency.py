"""`chat`'s time to the first token, turn by turn: the KV cache kept between turns against a
full prefill of the conversation at every turn (what `generate` on the whole conversation
does, and what a chat that keeps no cache does).

    python scripts/chat_latency.py [GGUF] [--rounds 3] [--new 48] [--out results/chat]

On SmolLM2 as shipped (float32 from its Q4_1 file, greedy, up to --new tokens a reply), an
8-turn conversation, both ways in one process, alternating, after one warm-up conversation of
each (so that every program is compiled before the clock runs): per turn the tokens prefilled and
the median time from the call to the first new token. Then the conversation once more through
`jax-llama chat --stats` in a fresh process, as a user meets it (JAX's persistent compilation
cache warm from the runs before). Writes OUT/chat_latency.{json,md} and OUT/chat_latency.png.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llama_twins import results
from llama_twins.bench.common import cpu_model, given_or_smollm2

TURNS = ["What is the capital of France?", "And of Germany?", "Which of the two is larger?",
         "Name a river that flows through it.", "How long is that river?",
         "Give me one fact about its source.", "Now summarise our conversation in one sentence.",
         "What did I ask first?"]


def conversation(new_session, conversation_cls, template, tokenizer, max_seq_len, new, full):
    """One pass over TURNS with a new session -> [(prompt ids, prefilled, seconds to the first
    token)]."""
    session = new_session()
    talk = conversation_cls(template, tokenizer, max_seq_len, new)
    stops = set(tokenizer.stop_ids)
    rows = []
    for text in TURNS:
        ids, _ = talk.ask(text)
        if full:
            session.forget()
        first = []
        start = time.perf_counter()
        reply = session.reply(ids, lambda row, token: first or first.append(time.perf_counter()))
        talk.answer(tokenizer.decode([t for t in reply if t not in stops]))
        rows.append((len(ids), session.prefilled, first[0] - start))
    return rows


def through_the_cli(path: str, new: int) -> list[dict]:
    """The same turns through `jax-llama chat --stats` in a fresh process -> its stats lines."""
    run = subprocess.run(["jax-llama", "chat", path, "--max-new-tokens", str(new), "--stats"],
                         input="".join(t + "\n" for t in TURNS), capture_output=True, text=True,
                         check=True)
    out = []
    for line in run.stderr.splitlines():
        if line.startswith("[prefilled"):
            parts = line.strip("[]").split("; ")
            out.append({"prefilled": int(parts[0].split()[1]),
                        "first_token_s": float(parts[1].split()[2])})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--out", default="results/chat")
    args = parser.parse_args(argv)
    path = given_or_smollm2(args.gguf)

    import jax_llama
    from bridge.chat import find_template
    from tasks.conversation import Conversation
    from bridge.formats import open_checkpoint
    from tasks.prompts import stop_ids
    from jax_llama.inference.generate import ChatSession

    ckpt = open_checkpoint(path)
    tokenizer = ckpt.own_tokenizer()
    template = find_template(ckpt, tokenizer)
    model, params = jax_llama.load(ckpt)
    stops = stop_ids(tokenizer)
    run = lambda full: conversation(  # noqa: E731
        lambda: ChatSession(model, params, args.new, stop_ids=stops), Conversation, template,
        tokenizer, model.config.max_seq_len, args.new, full)
    for full in (False, True):  # warm-up: every program compiled
        run(full)
    times = {"kept": [], "full": []}
    counts = {}
    for r in range(args.rounds):
        for mode in (("kept", "full") if r % 2 == 0 else ("full", "kept")):
            rows = run(mode == "full")
            times[mode].append([seconds for _, _, seconds in rows])
            counts[mode] = [(n, prefilled) for n, prefilled, _ in rows]
            print(f"round {r + 1} {mode}: " + " ".join(f"{s:.3f}" for s in times[mode][-1]),
                  file=sys.stderr, flush=True)
    median = {mode: [statistics.median(col) for col in zip(*runs)] for mode, runs in times.items()}
    cli = through_the_cli(str(path), args.new)

    lines = ["# `chat`: time to the first token, turn by turn\n",
             f"`python scripts/chat_latency.py --rounds {args.rounds} --new {args.new}`; "
             f"SmolLM2-135M-Instruct (float32 from its Q4_1 GGUF), greedy, up to {args.new} new "
             f"tokens a reply; {cpu_model()}. Kept: the KV cache kept between turns (a turn "
             "prefills what the cache lacks). Full: the whole conversation prefilled every turn. "
             f"Medians of {args.rounds} alternating rounds in one process, every program "
             "compiled first. The last columns: the same conversation through `jax-llama chat "
             "--stats` in a fresh process (the compilation cache warm on disk).\n",
             "| turn | prompt tokens | kept: prefilled | kept: first token | full: prefilled | "
             "full: first token | full / kept | CLI: prefilled | CLI: first token |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i in range(len(TURNS)):
        n, kept_n = counts["kept"][i]
        _, full_n = counts["full"][i]
        k, f = median["kept"][i], median["full"][i]
        c = cli[i] if i < len(cli) else {"prefilled": "-", "first_token_s": float("nan")}
        lines.append(f"| {i + 1} | {n} | {kept_n} | {k * 1e3:.0f} ms | {full_n} | "
                     f"{f * 1e3:.0f} ms | {f / k:.2f}x | {c['prefilled']} | "
                     f"{c['first_token_s'] * 1e3:.0f} ms |")
    out = Path(args.out)
    print(results.write("chat_latency", {
        "command": " ".join(["python scripts/chat_latency.py", *(argv or sys.argv[1:])]),
        "cpu": cpu_model(), "turns": TURNS, "new_tokens": args.new, "rounds": args.rounds,
        "first_token_s": times, "median_first_token_s": median, "prompt_and_prefilled": counts,
        "cli": cli}, lines, out), end="")
    plot(median, cli, out / "chat_latency.png")
    return 0


def plot(median: dict, cli: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    turns = range(1, len(median["kept"]) + 1)
    ax.plot(turns, [s * 1e3 for s in median["full"]], "o-", label="full prefill every turn")
    ax.plot(turns, [s * 1e3 for s in median["kept"]], "o-", label="KV cache kept (chat)")
    if cli:
        ax.plot(range(1, len(cli) + 1), [c["first_token_s"] * 1e3 for c in cli], "x--",
                label="jax-llama chat, fresh process")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("SmolLM2-135M chat: time to the first token")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
