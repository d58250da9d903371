"""`torch-llama`: the PyTorch twin's jobs. Each command is filled in by the issue that builds it."""

from __future__ import annotations

import argparse
import sys

from bridge.cli import add_planned, cli_main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torch-llama", description="The PyTorch twin of jax-llama "
                                     "(CUDA, MPS, CPU).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_planned(parser, sub, [("generate", "sample from a checkpoint with a KV cache",
                               "the generation issue")])
    return parser


main = cli_main(build_parser)


if __name__ == "__main__":
    sys.exit(main())
