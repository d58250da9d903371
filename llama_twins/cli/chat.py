"""`jax-llama chat CKPT`: talk to a model over several turns, in its own chat template.

The conversation (tasks.conversation) is rendered whole for every turn; the twin's ChatSession
keeps the KV cache of what it has seen, so a turn prefills only its new tokens. This module holds
the loop a person (or a script, through a pipe) drives: lines in, replies streamed out.
"""

from __future__ import annotations

import argparse
import sys
import time

from bridge.errors import BridgeError

from .common import (EXIT_OK, add_command, add_model_arguments, add_sampling_arguments,
                     error_line, weights)
from .options import add_attention_argument, with_kernels

COMMANDS = {"/reset": "forget the conversation (the system message stays)",
            "/save FILE": "append the conversation to FILE as one line of the JSONL sft reads",
            "/exit": "end the chat (so does end of input, Ctrl-D)"}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def converse(conversation, session, tokenizer, stdin=None, stdout=None, stats: bool = False,
             parser=None) -> int:
    """Read user turns from stdin until its end or /exit, and stream each reply to stdout.

    From a terminal: a "> " prompt, and Ctrl-C stops the reply under way (what was said so far
    stays in the conversation), not the chat. From a pipe: each line is one user turn, and each
    reply is written followed by one empty line, so that a script can read them back. Notes
    (dropped turns, a prefill that could not reuse the cache, --stats) go to stderr."""
    from tasks.prompts import Streamer

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    interactive = stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 - input() then edits lines and keeps their history
        except ImportError:
            pass
        say("Type a message; " + "; ".join(f"{c}: {what}" for c, what in COMMANDS.items())
            + "; Ctrl-C stops a reply.")
    stops = set(tokenizer.stop_ids)
    reset = False  # the cache holds a conversation that /reset ended: no reuse is expected
    for turn in _turns(stdin, interactive):
        text = turn.rstrip("\r\n")
        if not text.strip():
            continue
        if text.startswith("/"):
            word, _, rest = text.partition(" ")
            if word == "/exit":
                break
            if word == "/reset":
                conversation.reset()
                reset = True
                say("(the conversation is reset)")
                continue
            if word == "/save":
                try:
                    if not rest.strip():
                        raise BridgeError("/save needs a file name: /save FILE")
                    say(f"(saved to {conversation.save(rest.strip())})")
                except BridgeError as e:
                    say(error_line(e, parser))
                continue
        try:
            ids, dropped = conversation.ask(text)
        except BridgeError as e:
            say(error_line(e, parser))
            continue
        if dropped:
            say(f"(the conversation outgrew the context of {conversation.max_seq_len} tokens: "
                f"its {dropped} oldest turns are dropped)")
        kept_before = 0 if reset else len(session.cached)
        reset = False
        stream, start, first = Streamer(tokenizer, out=stdout), time.perf_counter(), []

        def on_token(row: int, token: int) -> None:
            if not first:
                first.append(time.perf_counter() - start)
            stream(row, token)

        stopped = False
        try:
            new = session.reply(ids, on_token)
        except KeyboardInterrupt:
            new, stopped = list(stream.ids), True
        except BridgeError as e:
            conversation.withdraw()
            say(error_line(e, parser))
            continue
        seconds = time.perf_counter() - start
        conversation.answer(tokenizer.decode([t for t in new if t not in stops]))
        stdout.write("\n" if interactive else "\n\n")
        stdout.flush()
        if stopped:
            say("(stopped)")
        elif session.reused < kept_before and not dropped:
            # a template that renders earlier turns anew, or a reply that reads back as other
            # tokens than the model produced
            say(f"(the conversation so far renders as other tokens than the cache holds: "
                f"{session.prefilled} tokens prefilled again from token {session.reused})")
        if stats and not stopped:
            rate = (len(new) - 1) / (seconds - first[0]) if len(new) > 1 else float("nan")
            say(f"[prefilled {session.prefilled} tokens, {session.reused} from the cache; first "
                f"token {first[0]:.3f} s; {len(new)} tokens, {rate:.1f} tokens/s]")
    return EXIT_OK


def _turns(stdin, interactive: bool):
    """The lines typed (after a "> " prompt) or piped in, until the input ends."""
    while True:
        try:
            line = input("> ") if interactive and stdin is sys.stdin else stdin.readline()
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print(file=sys.stderr)
            return
        if not interactive and not line:
            return
        yield line


def run_chat(args, open_session) -> int:
    """What both chat commands do, refusing bad input before the weights are read: open the
    checkpoint (once), find its tokenizer and chat template, then open_session(checkpoint,
    sampler, stop ids) -> (a twin's ChatSession, the model's LlamaConfig), and converse."""
    from bridge.chat import find_template
    from tasks.conversation import Conversation
    from bridge.formats import open_checkpoint
    from tasks.prompts import stop_ids
    from bridge.resources import gc_paused
    from bridge.sampling import Sampler
    from bridge.tokenizer import find_tokenizer

    sampler = Sampler(args.temperature, args.top_k, args.top_p)
    with gc_paused():  # many long-lived objects, no cycles (bridge.resources)
        checkpoint = open_checkpoint(args.checkpoint)
        tokenizer = find_tokenizer(checkpoint, args.tokenizer)
        template = find_template(checkpoint, tokenizer, args.chat_template)
        max_seq_len = checkpoint.config.max_seq_len
        if args.max_new_tokens >= max_seq_len:
            raise BridgeError(f"must be less than the context, {max_seq_len} tokens",
                              field="max_new_tokens")
        session, config = open_session(checkpoint, sampler, stop_ids(tokenizer, args.stop))
    conversation = Conversation(template, tokenizer, config.max_seq_len, args.max_new_tokens,
                                system=args.system)
    return converse(conversation, session, tokenizer, stats=args.stats,
                    parser=args.command_parser)


def cmd_chat(args) -> int:
    from jax_llama.checkpoint import load
    from jax_llama.inference.generate import ChatSession

    def open_session(checkpoint, sampler, stops):
        model, params = with_kernels(args, lambda: load(
            checkpoint, attention=args.attention, adapter=args.adapter, kernels=args.kernels,
            progress=args.progress, **weights(args)), say=args.stats)
        return (ChatSession(model, params, args.max_new_tokens, sampler, stops, args.seed),
                model.config)

    return run_chat(args, open_session)


def add_chat_command(sub, run) -> argparse.ArgumentParser:
    """The chat subparser, whose handler is `run` (each twin's own)."""
    p = add_command(sub, "chat", run,
                    help="talk to a model over several turns in its chat template; the KV cache "
                         "is kept between turns, so a turn prefills only its new tokens",
                    description="Talk to a model over several turns. From a terminal: type a "
                                "message after '> '; "
                                + "; ".join(f"{c}: {what}" for c, what in COMMANDS.items())
                                + "; Ctrl-C stops a reply, not the chat. From a pipe: each line "
                                  "is a user turn, and each reply is written to stdout followed "
                                  "by an empty line.")
    p.add_argument("checkpoint", metavar="CKPT", help="any checkpoint the bridge reads")
    p.add_argument("--system", help="a system message at the start of the conversation")
    p.add_argument("--chat-template", help="llama3, llama2 or a jinja file (default: the "
                                           "checkpoint's own, else the one its tokenizer implies)")
    add_sampling_arguments(p, max_new_tokens=512)
    add_model_arguments(p)
    p.add_argument("--stats", action="store_true",
                   help="after each reply, on stderr: tokens prefilled and taken from the cache, "
                        "the time to the first token, tokens/s")
    return p


def add_commands(sub) -> None:
    """The subparser of `jax-llama chat`."""
    add_attention_argument(add_chat_command(sub, cmd_chat))
