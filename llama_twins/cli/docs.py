"""The three commands' argparse parsers as data: every (sub)command with its options, for the
generated command-line reference (docs/hooks.py writes reference/cli.md from it) and for the test
that every option says what it does and what its default is (tests/test_cli_help.py).

Read from the parser objects themselves, never from `--help` text, so the reference cannot drift
from the flags the commands accept.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Iterator

# prog -> where its parser is built (imported lazily: the parsers import only argparse-level code)
PARSERS: dict[str, str] = {
    "llama-bridge": "llama_twins.cli.bridge_main",
    "jax-llama": "llama_twins.cli.main",
    "torch-llama": "llama_twins.cli.torch_main",
}


def build_parsers() -> dict[str, argparse.ArgumentParser]:
    """prog -> the top-level parser of each command, freshly built."""
    import importlib

    return {prog: importlib.import_module(module).build_parser()
            for prog, module in PARSERS.items()}


@dataclass(frozen=True)
class Command:
    """One parser in a command tree: `jax-llama train` is path ("jax-llama", "train")."""
    path: tuple[str, ...]
    parser: argparse.ArgumentParser
    summary: str | None  # the one-line help its parent lists it with

    @property
    def name(self) -> str:
        return " ".join(self.path)


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] | None = None,
         summary: str | None = None) -> Iterator[Command]:
    """The parser and every subcommand below it, depth first, in the order they were added."""
    path = path or (parser.prog,)
    yield Command(path, parser, summary)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                yield from walk(child, (*path, name), helps.get(name))


@dataclass(frozen=True)
class Option:
    """One argument of a command as the reference shows it."""
    flags: str         # "--batch-size" or "-q, --quiet", or the positional's name
    metavar: str       # "N", "{a,b}", "" for a switch
    help: str          # with argparse's %-escapes expanded
    default: object
    required: bool
    action: argparse.Action


def _metavar(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    """The value an option takes as --help writes it ("N", "{a,b}", "DATA [DATA ...]"); "" for a
    switch, and for a positional (its name is its flag)."""
    if action.nargs == 0 or not action.option_strings:
        return ""
    return formatter._format_args(action, action.dest.upper())


def usage(parser: argparse.ArgumentParser, width: int = 88) -> str:
    """The usage line, wrapped at `width` whatever the terminal (so the reference is the same on
    every machine), without the "usage: " prefix."""
    formatter = parser.formatter_class(prog=parser.prog, width=width)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def options(parser: argparse.ArgumentParser) -> list[Option]:
    """The arguments of one parser (its subcommands and -h/--help left out)."""
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        help_text = formatter._expand_help(action) if action.help else ""
        rows.append(Option(flags=", ".join(action.option_strings) or action.metavar or action.dest,
                           metavar=_metavar(action, formatter), help=help_text,
                           default=action.default,
                           required=action.required or not action.option_strings,
                           action=action))
    return rows


def trivial_default(action: argparse.Action) -> bool:
    """A default that needs no mention: nothing (None, an empty list), a switch's off state, or
    a positional's (which is always given)."""
    if action.nargs == 0:  # store_true / store_false / store_const / count: the flag is the text
        return True
    if not action.option_strings or action.required:
        return True
    return action.default is None or action.default is argparse.SUPPRESS or action.default == []


def default_spellings(value: object) -> set[str]:
    """How a help text may write a default: 0.1 as 0.1, 1e-3 as 0.001 or 1e-3, 3.0 as 3."""
    spellings = {str(value)}
    if isinstance(value, float):
        spellings |= {f"{value:g}", repr(value)}
        if value == int(value):
            spellings.add(str(int(value)))
    return spellings


def help_problems(parser: argparse.ArgumentParser) -> list[str]:
    """One line for each option of the tree under `parser` that has no help, or whose default is
    not trivial and not written in its help next to the word "default"."""
    problems = []
    for command in walk(parser):
        for option in options(command.parser):
            where = f"{command.name} {option.flags}"
            if not option.help.strip():
                problems.append(f"{where}: no help")
            elif not trivial_default(option.action):
                if "default" not in option.help or not any(
                        s in option.help for s in default_spellings(option.default)):
                    problems.append(f"{where}: default {option.default!r} not in its help "
                                    f"({option.help!r})")
    return problems


def markdown_table(rows: list[list[str]], header: list[str]) -> str:
    """A GitHub-flavoured table, with | in cells escaped."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def command_reference(parser: argparse.ArgumentParser,
                      heading: Callable[[int], str] = lambda depth: "#" * (depth + 1)) -> str:
    """Markdown for a whole command tree: per command its usage line, description and a table of
    its options (flags, value, help)."""
    parts = []
    for command in walk(parser):
        depth = len(command.path)
        parts.append(f"{heading(depth)} `{command.name}`\n")
        parts.append(f"```text\n{usage(command.parser)}\n```\n")
        text = command.parser.description or command.summary
        if text:
            parts.append(_escape(text) + "\n")
        subcommands = [c for c in walk(command.parser) if len(c.path) == depth + 1]
        if subcommands:
            parts.append(markdown_table(
                [[f"[`{c.path[-1]}`](#{anchor(c.name)})", _escape(c.summary or "")]
                 for c in subcommands], ["command", "what it does"]) + "\n")
        rows = [[f"`{o.flags}`", f"`{o.metavar}`" if o.metavar else "",
                 _escape(o.help) + (" (required)" if o.required and o.action.option_strings
                                    else "")]
                for o in options(command.parser)]
        if rows:
            parts.append(markdown_table(rows, ["option", "value", "help"]) + "\n")
    return "\n".join(parts)


def anchor(name: str) -> str:
    """The id MkDocs' toc gives a heading `` `jax-llama train` ``."""
    return name.replace(" ", "-").lower()


def _escape(text: str) -> str:
    """Plain text safe inside Markdown: the characters Markdown would take as markup escaped."""
    for ch in "\\`*_[]<>":
        text = text.replace(ch, "\\" + ch)
    return text
