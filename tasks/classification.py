"""What both twins share for sequence classification: the `LABEL ||| TEXT` data files, labels.json,
and the classifier directory.

A classifier directory is a native checkpoint (config.json, model.safetensors, tokenizer files)
plus two files that `llama-bridge` and the LM loaders ignore:
  classifier.safetensors  `classifier.weight` (C, D) and `classifier.bias` (C,), torch layout
  classifier.json         {"labels": [...], "max_len": N, "dropout": p, ...}: how to use the head
So the backbone converts and generates like any checkpoint, and the head travels with it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bridge.config import LlamaConfig
from bridge.errors import BridgeError

HEAD_FILE = "classifier.safetensors"
META_FILE = "classifier.json"
HEAD_TENSORS = ("classifier.weight", "classifier.bias")
_INTEGER = re.compile(r"[+-]?\d+")
# Zero-shot prompting: the text, then the words a label word should continue.
DEFAULT_TEMPLATE = "{text} Overall, it was"
# ... and through a chat template: the user's turn asks, the assistant's turn begins with the
# label word ({labels}: the label words, "a, b or c").
DEFAULT_CHAT_QUESTION = ("{text}\n\nHow is the sentiment of this review: {labels}? Answer with "
                         "one word.")


# What `jax-llama finetune` does by default. From scratch: a small backbone learns the task and
# the language at once, at a high learning rate. From a pretrained backbone (--init): a lower
# rate keeps what it knows, fewer epochs suffice, and only the top blocks train - the lower ones
# hold general features (and their backward pass, most of a step's cost, is skipped). See the
# docs/how-to/classify.md ("Fine-tuning a pretrained model") for the runs behind these values.
# train_layers "half": the top half of the backbone's blocks (15 of SmolLM2's 30); "third": the
# top third (10). Full fine-tuning of SmolLM2 on SST-5 reached 49.1% with 3 epochs at lr 1e-4 on
# the top third, 50.5% with 2 epochs at lr 2e-4 on the top half; LoRA reached 50.05% with its own.
FROM_SCRATCH = {"epochs": 5, "batch_size": 32, "lr": 1e-3, "dropout": 0.3, "train_layers": None}
PRETRAINED = {"epochs": 2, "batch_size": 16, "lr": 2e-4, "dropout": 0.1, "train_layers": "half"}
PRETRAINED_LORA = {"epochs": 3, "batch_size": 16, "lr": 1e-3, "dropout": 0.1,
                   "train_layers": "third"}


def resolve_train_layers(value: int | str | None, n_layers: int) -> int | None:
    """A recipe's train_layers for a backbone of n_layers blocks: None (all) for 'all' or None,
    the top half or third (at least one) for 'half' or 'third', else the count itself."""
    if value in (None, "all"):
        return None
    if value == "half":
        return max(1, n_layers // 2)
    if value == "third":
        return max(1, round(n_layers / 3))
    if value > n_layers:
        raise BridgeError(f"{value} exceeds the backbone's {n_layers} blocks",
                          field="train_layers")
    return value


@dataclass(frozen=True)
class Example:
    text: str
    label: int | None   # None in a file of texts only
    line: int           # 1-based line number in its file


@dataclass
class Dataset:
    path: Path
    examples: list[Example]
    skipped: list[str]  # "LINE: why" for each malformed line skipped

    @property
    def labeled(self) -> bool:
        return all(e.label is not None for e in self.examples)

    @property
    def labels(self) -> np.ndarray:
        return np.array([e.label for e in self.examples], dtype=np.int32)

    @property
    def texts(self) -> list[str]:
        return [e.text for e in self.examples]


def read_labels(path: str | os.PathLike) -> list[str]:
    """labels.json: a JSON list of distinct, non-empty label words (at least two)."""
    path = Path(path)
    try:
        labels = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BridgeError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BridgeError(f"{path}: not a readable JSON file ({e})") from None
    if (not isinstance(labels, list) or len(labels) < 2
            or not all(isinstance(w, str) and w.strip() for w in labels)
            or len(set(labels)) != len(labels)):
        raise BridgeError(f"{path}: expected a JSON list of at least two distinct label words, "
                          f"e.g. [\"bad\", \"good\"]")
    return labels


def read_examples(path: str | os.PathLike, n_labels: int, *, require_labels: bool = True,
                  skip_malformed: bool = False) -> Dataset:
    """Read a `LABEL ||| TEXT` file (LABEL an index into labels.json).

    With require_labels=False a line may also be TEXT alone (a file to predict), but the file
    must be one kind or the other. A malformed line - no separator, a label that is not an
    integer in [0, n_labels), empty text - stops the read with its line number, or with
    skip_malformed is skipped and listed in `skipped`. A file with no examples is refused.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise BridgeError(f"{path}: no such file") from None
    except OSError as e:
        raise BridgeError(f"{path}: cannot read ({e.strerror})") from None
    parsed, skipped = [], []
    for number, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError:
            parsed.append((number, None, "not UTF-8"))
            continue
        if text:
            parsed.append((number, *_parse(text, number, n_labels, require_labels)))
    # A file is labeled when any line is; its lines without a label are then malformed too.
    labeled = any(ex is not None and ex.label is not None for _, ex, _ in parsed)
    examples = []
    for number, example, problem in parsed:
        if example is not None and labeled and example.label is None:
            head, sep, _ = example.text.partition("|||")
            example, problem = None, (f"label {head.strip()!r} is not an integer index into "
                                      f"labels.json" if sep else "expected 'LABEL ||| TEXT'")
        if example is not None:
            examples.append(example)
        elif not skip_malformed:
            raise BridgeError(f"{path}:{number}: {problem}")
        else:
            skipped.append(f"{number}: {problem}")
    if not examples:
        raise BridgeError(f"{path}: no examples" + (
            f" ({len(skipped)} malformed line(s) skipped, the first at line {skipped[0]})"
            if skipped else ""))
    return Dataset(path, examples, skipped)


def split_label(line: str) -> tuple[int | None, str]:
    """The one reading of a task-file line: `LABEL ||| TEXT` with an integer LABEL gives
    (LABEL, TEXT), surrounding spaces dropped; any other line gives (None, the line as it is)."""
    head, sep, text = line.partition("|||")
    if sep and _INTEGER.fullmatch(head.strip()):
        return int(head), text.strip()
    return None, line


def strip_labels(text: str) -> str:
    """The texts of a `LABEL ||| TEXT` file, one a line (continued pretraining on a task's text);
    lines without a label, and the line endings, stay as they are."""
    lines = text.splitlines(keepends=True)
    bodies = [line.rstrip("\r\n") for line in lines]
    return "".join(split_label(body)[1] + line[len(body):] for body, line in zip(bodies, lines))


def _parse(line: str, number: int, n_labels: int, require_labels: bool):
    label, text = split_label(line)
    if label is None:
        head, sep, _ = line.partition("|||")
        if not require_labels:
            return Example(line, None, number), None  # a text of its own, '|||' and all
        if not sep:
            return None, "expected 'LABEL ||| TEXT'"
        return None, f"label {head.strip()!r} is not an integer index into labels.json"
    if not 0 <= label < n_labels:
        return None, f"label {label} is outside labels.json's {n_labels} labels (0..{n_labels - 1})"
    if not text:
        return None, "empty text"
    return Example(text, label, number), None


def truncate_left(ids: list[int], max_len: int, keep_first: int | None = None) -> tuple[list[int], bool]:
    """The last max_len ids (keeping `keep_first`, e.g. BOS, in front); and whether any were cut."""
    if len(ids) <= max_len:
        return ids, False
    if keep_first is not None and ids and ids[0] == keep_first:
        return [keep_first] + ids[len(ids) - max_len + 1:], True
    return ids[len(ids) - max_len:], True


def encode_texts(tokenizer, texts: list[str], max_len: int) -> tuple[list[list[int]], int]:
    """Each text as BOS + ids + EOS (BOS when the tokenizer adds one), cut from the left to
    max_len (BOS kept); and how many were cut. The head reads the hidden state at EOS: the same token ends every row, so it can learn to
    gather the whole text (GPT's extract token), rather than sit on whatever word ends it."""
    bos, eos = tokenizer.add_bos, tokenizer.eos_id is not None
    encoded, cut = [], 0
    for text in texts:
        ids, was_cut = truncate_left(tokenizer.encode(text, bos=bos, eos=eos), max_len,
                                     tokenizer.bos_id if bos else None)
        encoded.append(ids)
        cut += was_cut
    return encoded, cut


def write_head(directory: Path, weight_CD: np.ndarray, bias_C: np.ndarray, meta: dict) -> None:
    """Write classifier.safetensors and classifier.json into `directory` (a native checkpoint
    being written atomically)."""
    from safetensors.numpy import save_file

    save_file({"classifier.weight": np.ascontiguousarray(weight_CD),
               "classifier.bias": np.ascontiguousarray(bias_C)}, str(directory / HEAD_FILE))
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_head(directory: str | os.PathLike, config: LlamaConfig) -> tuple[dict, np.ndarray, np.ndarray]:
    """(meta, weight (C, D), bias (C,)) of the classifier directory, checked against `config`."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    directory = Path(directory)
    meta_path, head_path = directory / META_FILE, directory / HEAD_FILE
    if not meta_path.is_file() or not head_path.is_file():
        raise BridgeError(f"{directory}: not a classifier (no {META_FILE} and {HEAD_FILE}; "
                          f"`jax-llama finetune` writes them)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BridgeError(f"{meta_path}: not readable JSON ({e})") from None
    labels = meta.get("labels") if isinstance(meta, dict) else None
    if not isinstance(labels, list) or len(labels) < 2:
        raise BridgeError(f"{meta_path}: field 'labels' must list at least two label words")
    if not isinstance(meta.get("max_len"), int) or meta["max_len"] < 1:
        raise BridgeError(f"{meta_path}: field 'max_len' must be a positive integer")
    try:
        tensors = load_file(str(head_path))
    except (SafetensorError, OSError) as e:
        raise BridgeError(f"{head_path}: not a readable safetensors file ({e})") from None
    expected = {"classifier.weight": (len(labels), config.dim), "classifier.bias": (len(labels),)}
    for name, shape in expected.items():
        if name not in tensors:
            raise BridgeError(f"{head_path}: no tensor '{name}'")
        if tensors[name].shape != shape:
            raise BridgeError(f"{head_path}: tensor '{name}' has shape {tensors[name].shape}, "
                              f"expected {shape} ({len(labels)} labels, dim {config.dim})")
    if set(tensors) != set(expected):
        raise BridgeError(f"{head_path}: unexpected tensors {sorted(set(tensors) - set(expected))}")
    return meta, tensors["classifier.weight"], tensors["classifier.bias"]


def accuracy(predictions, labels) -> float:
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    return float((predictions == labels).mean()) if len(labels) else float("nan")


def write_predictions(path: str | os.PathLike, predictions) -> Path:
    """One predicted label index a line (the LABEL field of the data format), written atomically."""
    from bridge.atomic import write_text

    return write_text(path, "".join(f"{int(p)}\n" for p in predictions))
