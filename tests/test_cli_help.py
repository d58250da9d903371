"""Every option of the three commands says what it does and, when it has one, its default: the
command-line reference (docs/reference/cli.md) is generated from the same parser objects, so a
help line missing here is a hole in the docs too."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from llama_twins.cli.docs import build_parsers, command_reference, help_problems, walk


@pytest.fixture(scope="module")
def parsers():
    return build_parsers()


def test_every_option_has_help_with_its_default(parsers):
    problems = [line for parser in parsers.values() for line in help_problems(parser)]
    assert not problems, "\n".join(problems)


def test_walk_reaches_every_subcommand(parsers):
    names = {c.name for parser in parsers.values() for c in walk(parser)}
    # one deep enough in each tree that a walk stopping at the top would miss it
    assert {"jax-llama train", "jax-llama bench", "torch-llama eval", "llama-bridge merge-lora",
            "llama-bridge parity"} <= names
    assert len(names) > 20


def test_the_check_catches_a_planted_option():
    """Negative cases: an option without help, and one whose help does not state its default."""
    parser = argparse.ArgumentParser(prog="planted")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("run", help="a subcommand")
    p.add_argument("--quiet", action="store_true", help="no progress bar")  # a switch: fine
    p.add_argument("--out", help="a directory")  # default None: nothing to state
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order (default 0)")
    problems = help_problems(parser)
    assert len(problems) == 2, problems
    assert problems[0].startswith("planted run --steps: no help")
    assert problems[1].startswith("planted run --lr: default 0.003 not in its help")


def test_train_defaults_are_train_configs():
    """The training flags' help states TrainConfig's defaults, written beside TRAIN_OPTIONS (the
    CLI does not import JAX for --help); they must be TrainConfig's own."""
    from jax_llama.training.step import TrainConfig
    from llama_twins.cli.train import TRAIN_OPTIONS

    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert {name: default for name, _, default, _ in TRAIN_OPTIONS} == {
        name: fields[name] for name, *_ in TRAIN_OPTIONS}


def test_reference_lists_every_option(parsers):
    """The generated reference has a row for every option of every command."""
    text = command_reference(parsers["jax-llama"])
    assert "## `jax-llama train`" in text and "| `--lr` | `LR` |" in text
    assert "(default 3e-3)" in text or "(default 0.003)" in text
    for command in walk(parsers["jax-llama"]):
        for action in command.parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in text or f", {flag}" in text, (command.name, flag)
