"""`jax-llama models` (and `llama-bridge models`): the models a command can be given by name -
the Hugging Face hub cache's and the installed packages' (bridge.locate, bridge.models)."""

from __future__ import annotations

import json
import sys

from .common import EXIT_OK, add_command

COLUMNS = ("NAME", "FORMAT", "SIZE", "PARAMS", "TENSOR TYPES", "CHAT", "WHERE")


def cmd_models(args) -> int:
    from bridge.locate import hub_cache_dir
    from bridge.models import list_models

    rows = list_models(args.hub_cache)
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    print(f"searched the Hugging Face hub cache {hub_cache_dir(args.hub_cache)} and the "
          f"installed packages: {len(rows)} model{'s' * (len(rows) != 1)}", file=sys.stderr)
    if rows:
        table = [COLUMNS] + [_cells(row) for row in rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS) - 1)]
        for line in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1])
    return EXIT_OK


def _cells(row: dict) -> tuple[str, ...]:
    if row["unreadable"] is not None:
        return (row["name"], "-", "-", "-", f"not readable: {row['unreadable']}", "-", row["where"])
    return (row["name"], row["format"], _size(row["bytes"]), _count(row["parameters"]),
            ",".join(row["tensor_types"]), "yes" if row["chat_template"] else "no", row["where"])


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n:,}"


def add_commands(sub) -> None:
    """The subparser of models."""
    p = add_command(sub, "models", cmd_models,
                    help="list the models that can be named instead of a path: the Hugging Face "
                         "hub cache's (HF_HUB_CACHE, HF_HOME, ~/.cache/huggingface/hub) and the "
                         ".gguf files installed packages ship; a hub repo that is not a LLaMA "
                         "checkpoint is listed as not readable, with the reason")
    p.add_argument("--hub-cache", metavar="DIR",
                   help="the hub cache to search (default: HF_HUB_CACHE, else $HF_HOME/hub, else "
                        "~/.cache/huggingface/hub)")
    p.add_argument("--json", action="store_true",
                   help="one JSON list on stdout: name, where, source, format, bytes, parameters, "
                        "tensor_types (with counts), chat_template, unreadable (why, or null)")
