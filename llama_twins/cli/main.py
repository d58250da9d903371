"""`jax-llama`: the JAX jobs - train, sft, dpo, grpo, generate, chat, serve, finetune, zero-shot, predict, eval,
split - and the two that also need the torch twin: `generate --compare-torch` and `bench`.

Each family of subcommands lives in its own module with its parser beside its handlers (train.py,
generate.py, serve.py, classify.py, evaluate.py, bench.py); this one assembles them. A handler
parses its flags, calls into jax_llama (imported when the subcommand runs, so that `--help` and
bad flags answer at once), and prints results to stdout; errors name flags.
"""

from __future__ import annotations

import argparse
import sys

from . import bench, chat, classify, evaluate, generate, kernels, models, serve, train
from .common import command_main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jax-llama", description="LLaMA in JAX: train, generate, "
                                     "fine-tune, benchmark.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train.add_commands(sub)         # train, sft, dpo, grpo
    generate.add_commands(sub)
    chat.add_commands(sub)
    serve.add_commands(sub)
    classify.add_commands(sub)      # finetune, zero-shot, predict
    evaluate.add_commands(sub)
    classify.add_split_command(sub)
    bench.add_commands(sub)
    models.add_commands(sub)
    kernels.add_commands(sub)
    return parser


_main = command_main(build_parser)
# Commands that measure compilation themselves (their workers are fresh processes anyway).
_UNCACHED = ("bench",)


def main(argv: list[str] | None = None) -> int:
    """`jax-llama`: every command but bench with JAX's persistent compilation cache on
    (jax_llama.perf.use_compile_cache: JAX_LLAMA_COMPILE_CACHE=off turns it off)."""
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] not in _UNCACHED and not words[0].startswith("-"):
        from jax_llama.perf import use_compile_cache
        use_compile_cache()
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
