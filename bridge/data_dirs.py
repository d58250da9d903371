"""A run's own output is never its input: the files of a data directory, leaving out what this
project writes (run directories, checkpoints, adapters, token caches), and the refusal of an
output directory that is, or holds, one of a run's inputs.

    files = files_under(Path("corpus"), {".txt", ".md"}, out=Path("corpus/runs/x"))
    # stderr: excluding runs/old (a run directory), runs/x (this run's output), token-cache
    #         (a token cache) from the data in corpus
    check_out_apart(Path("runs/x"), ["corpus", "chats.jsonl"])  # BridgeError(field="out") when
                                                               # runs/x is an input or holds one

Without this, a data directory holding an earlier run (or the run itself, when its output lies
inside the data) feeds that run's run.json, metrics.jsonl, tokenizer and checkpoint files into
training as if they were text.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable

from .errors import BridgeError

MAX_NAMED = 4  # excluded directories named in the one line; the rest are counted

# What this project writes into a directory, by file and directory names (a trailing "/" marks a
# directory), never by contents: any one set present makes the directory one of its outputs.
#   run.json, metrics.jsonl, tokenizer/, checkpoints/  jax_llama.training (train, sft, dpo, finetune)
#   metrics.jsonl, best/                               a finetune run from before it had run.json
#   config.json, model.safetensors[.index.json]        bridge.formats.native (and Hugging Face)
#   adapter_config.json, adapter_model.safetensors     PEFT adapters (bridge.lora)
OUTPUT_MARKERS = [
    ("a run directory", {"run.json", "metrics.jsonl"}),
    ("a run directory", {"run.json", "tokenizer/"}),       # one stopped before its first step
    ("a run directory", {"run.json", "checkpoints/"}),     # a finetune run likewise
    ("a fine-tuning run directory", {"metrics.jsonl", "best/"}),
    ("a checkpoint", {"config.json", "model.safetensors"}),
    ("a checkpoint", {"config.json", "model.safetensors.index.json"}),
    ("a LoRA adapter", {"adapter_config.json", "adapter_model.safetensors"}),
    ("an orbax checkpoint", {"_CHECKPOINT_METADATA"}),     # one step of orbax's tree
]
# jax_llama.training.data.tokenize_corpus: tokens-<key>.uint16 / .uint32 beside tokens-<key>.json
TOKEN_CACHE_FILE = re.compile(r"tokens-[0-9a-f]{16}\.(uint16|uint32)")


def output_kind(directory: Path) -> str | None:
    """What this project wrote `directory` as ("a run directory", "a checkpoint", "orbax
    checkpoints", "a token cache", ...), or None for any other directory."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return None
    names = {e.name + "/" if e.is_dir() else e.name for e in entries}
    for kind, markers in OUTPUT_MARKERS:
        if markers <= names:
            return kind
    if "checkpoints/" in names and _is_orbax_tree(Path(directory) / "checkpoints"):
        return "a run directory"
    if _is_orbax_tree(Path(directory)):
        return "orbax checkpoints"
    if any(TOKEN_CACHE_FILE.fullmatch(name) for name in names):
        return "a token cache"
    return None


def _is_orbax_tree(directory: Path) -> bool:
    """A directory of orbax steps: <step>/_CHECKPOINT_METADATA."""
    try:
        return any(e.is_dir() and e.name[:1].isdigit()
                   and (Path(e.path) / "_CHECKPOINT_METADATA").is_file()
                   for e in os.scandir(directory))
    except OSError:
        return False


def files_under(root: str | os.PathLike, suffixes: Iterable[str],
                out: str | os.PathLike | None = None,
                say: Callable[[str], None] | None = None) -> list[Path]:
    """The files under directory `root` whose suffix (lower-cased) is one of `suffixes`, sorted;
    hidden files and directories, `out` (the run's own output directory) and every directory
    this project wrote (output_kind) left out, and said so in one line (to stderr unless `say`).

    Refused (field "data"): a root that is itself such an output, and a root with nothing left
    once its outputs are left out. A root with no matching files at all gives [] (the caller
    names what it looked for)."""
    root, suffixes = Path(root), set(suffixes)
    kind = output_kind(root)
    if kind is not None:
        raise BridgeError(f"{root} is {kind} written by this project, not data (name its files "
                          f"to read them anyway)", field="data")
    own = Path(out).resolve() if out is not None else None
    files: list[Path] = []
    excluded: list[tuple[Path, str]] = []
    for here, dirs, names in os.walk(root):  # symbolic links to directories are not followed
        here = Path(here)
        kept = []
        for name in dirs:
            path = here / name
            if name.startswith("."):
                continue
            what = "this run's output" if own is not None and path.resolve() == own else (
                output_kind(path))
            if what is None:
                kept.append(name)
            else:
                excluded.append((path.relative_to(root), what))
        dirs[:] = kept
        files.extend(here / name for name in names if not name.startswith(".")
                     and Path(name).suffix.lower() in suffixes and (here / name).is_file())
    named = list(excluded)
    if own is not None and not own.exists() and own.is_relative_to(root.resolve()):
        named.append((own.relative_to(root.resolve()), "this run's output"))
    if named:
        shown = [f"{path} ({what})" for path, what in sorted(named)]
        more = f" and {len(shown) - MAX_NAMED} more" if len(shown) > MAX_NAMED else ""
        (say or (lambda m: print(m, file=sys.stderr)))(
            f"excluding {', '.join(shown[:MAX_NAMED])}{more} from the data in {root}")
    if not files and excluded:
        raise BridgeError(f"{root}: no data files are left once the run outputs in it are "
                          f"excluded ({', '.join(str(path) for path, _ in sorted(excluded))})",
                          field="data")
    return sorted(files)


def check_out_apart(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None]) -> None:
    """Refuse (field "out") an output directory that is one of `inputs` (files or directories;
    None skipped) or holds one: the run would read what it writes. Nothing is read or written."""
    own = Path(out).resolve()
    for given in inputs:
        if given is None:
            continue
        path = Path(given).resolve()
        if path == own:
            raise BridgeError(f"{out} is {given}, an input of the run; write the output to a "
                              f"directory of its own", field="out")
        if path.is_relative_to(own):
            raise BridgeError(f"{out} holds {given}, an input of the run; write the output to a "
                              f"directory of its own", field="out")
