"""`jax-llama`: the JAX jobs. Each command is filled in by the issue that builds it."""

from __future__ import annotations

import argparse
import sys

from bridge.cli import add_planned, cli_main

COMMANDS = [
    ("train", "train or continue training with optax AdamW", "the training issue"),
    ("generate", "sample from a checkpoint with a KV cache", "the generation issue"),
    ("finetune", "fine-tune a classification head end to end", "the classification issue"),
    ("zero-shot", "classify by prompting, no training", "the classification issue"),
    ("predict", "write a fine-tuned classifier's predictions", "the classification issue"),
    ("bench", "benchmarks side by side with transformers", "the benchmark issue"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jax-llama", description="LLaMA in JAX: train, generate, "
                                     "fine-tune, benchmark.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_planned(parser, sub, COMMANDS)
    return parser


main = cli_main(build_parser)


if __name__ == "__main__":
    sys.exit(main())
