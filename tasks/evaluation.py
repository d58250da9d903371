"""Sliding-window perplexity, framework-neutral: the texts, the window plan, the batches and the
report. The twins (jax_llama.eval, torch_llama.eval) only turn a batch into NLL sums.

The window plan is the one of transformers' guide "Perplexity of fixed-length models": windows of
`seq_len` tokens begin every `stride` tokens; a window scores only the tokens no earlier window
scored (the last `end - previous end` of it), and the tokens before them are context. So every
token is scored once, with up to `seq_len - stride` tokens of context (more for the first
window's), and `stride == seq_len` gives disjoint windows. A token with nothing before it in its
window cannot be predicted and is not scored: the first token of a text always (with a BOS
tokenizer that is the BOS, so every token of the text itself is scored), and with disjoint windows
the first token of each window, as in the guide, where transformers' label shift drops it.

    texts = read_texts(["valid.txt", "more/"])              # bad files refused by name
    documents = tokenize(texts, tokenizer)                  # BOS first when the tokenizer has one
    seq_len, stride = window_settings(config.max_seq_len, seq_len=None, stride=None)
    report = run_evaluation(score, documents, seq_len, stride, batch_size=8)

`score(batch) -> (B,) NLL sums` is the model's part; the report holds nll_per_token, perplexity,
tokens, bits_per_byte and seconds overall and per file.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from bridge.data_dirs import files_under
from bridge.errors import BridgeError

DEFAULT_SEQ_LEN = 1024      # the window when none is given: the checkpoint's context, at most this
DEFAULT_BATCH_SIZE = 8
DATA_SUFFIXES = (".txt", ".jsonl")  # what a data directory is searched for


# -- the texts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Text:
    """One document: a .txt file's whole text, or one record of a .jsonl file."""
    path: str      # the file it came from (the key of the per-file report)
    where: str     # path, or path:line for a .jsonl record (what an error names)
    text: str

    @property
    def n_bytes(self) -> int:
        """The UTF-8 bytes of the text: what bits_per_byte divides by."""
        return len(self.text.encode("utf-8"))


def data_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Files named directly (any name), plus the .txt and .jsonl files under each directory
    (hidden ones, and what runs wrote there - run directories, checkpoints: bridge.data_dirs -
    left out), in order, each once."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = files_under(path, DATA_SUFFIXES)
            if not found:
                raise BridgeError(f"{path}: no {' or '.join(DATA_SUFFIXES)} files in this "
                                  f"directory", field="data")
            files.extend(found)
        else:
            raise BridgeError(f"{path}: no such file or directory", field="data")
    return list(dict.fromkeys(files))


def read_text_file(path: Path) -> str:
    """The file's text, strictly UTF-8 and byte for byte (no newline translation); a file with a
    NUL byte (binary) or that is not UTF-8 is refused, naming it."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BridgeError(f"{path}: cannot read ({e.strerror or e})", field="data") from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise BridgeError(f"{path}: not a text file (a NUL byte at offset {nul})", field="data")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BridgeError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                          f"{e.start})", field="data") from None


def read_texts(paths: Iterable[str | os.PathLike]) -> list[Text]:
    """The documents of the data files: a .jsonl file holds one per line (a JSON object with a
    string "text"; blank lines skipped), any other file is one document."""
    texts = []
    for path in data_files(paths):
        text = read_text_file(path)
        if path.suffix.lower() != ".jsonl":
            texts.append(Text(str(path), str(path), text))
            continue
        n_before = len(texts)
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BridgeError(f"{where}: not JSON ({e.msg})", field="data") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise BridgeError(f"{where}: expected an object with a string field \"text\"",
                                  field="data")
            texts.append(Text(str(path), where, record["text"]))
        if len(texts) == n_before:
            raise BridgeError(f"{path}: no records", field="data")
    return texts


# -- tokens and windows ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Document:
    path: str
    ids: np.ndarray  # (n,) int32: BOS (where the tokenizer adds one), then the text's tokens
    n_bytes: int


def tokenize(texts: Sequence[Text], tokenizer) -> list[Document]:
    """Each text on its own with `tokenizer`, BOS first when the tokenizer adds one (as Hugging
    Face tokenizers do; SmolLM2's adds none), no EOS. A text of fewer than 2 tokens has nothing to score: refused."""
    documents = []
    for t in texts:
        ids = np.asarray(tokenizer.encode(t.text, bos=tokenizer.add_bos), np.int32)
        if len(ids) < 2:
            raise BridgeError(f"{t.where}: {len(ids)} token(s); at least 2 are needed (the first "
                              f"is never scored)", field="data")
        documents.append(Document(t.path, ids, t.n_bytes))
    return documents


def window_settings(max_seq_len: int, seq_len: int | None = None,
                    stride: int | None = None) -> tuple[int, int]:
    """(seq_len, stride), checked: seq_len defaults to the model's context, at most
    DEFAULT_SEQ_LEN, and must lie in [2, max_seq_len]; stride defaults to seq_len // 2 and must
    lie in [1, seq_len]."""
    if seq_len is None:
        seq_len = min(max_seq_len, DEFAULT_SEQ_LEN)
    if seq_len < 2:
        raise BridgeError(f"must be at least 2 (got {seq_len})", field="seq_len")
    if seq_len > max_seq_len:
        raise BridgeError(f"{seq_len} is more than the checkpoint's max_seq_len {max_seq_len}",
                          field="seq_len")
    if stride is None:
        stride = max(1, seq_len // 2)
    if not 1 <= stride <= seq_len:
        raise BridgeError(f"must be from 1 to the window length, {seq_len} (got {stride})",
                          field="stride")
    return seq_len, stride


class Window(NamedTuple):
    begin: int     # the window is ids[begin:end]
    end: int
    n_scored: int  # its last n_scored tokens are scored; the ones before are context


def plan_windows(n_tokens: int, seq_len: int, stride: int) -> list[Window]:
    """The windows of a sequence of n_tokens, in order (transformers' guide): one begins every
    `stride` tokens, `seq_len` long (the last may be shorter), until one reaches the end. A
    window scores the tokens after the previous window's end, less any first token of the window
    (it has nothing to be predicted from); a window that would score nothing is left out."""
    windows, previous_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + seq_len, n_tokens)
        n_scored = min(end - previous_end, end - begin - 1)
        if n_scored > 0:
            windows.append(Window(begin, end, n_scored))
        previous_end = end
        if end == n_tokens:
            break
    return windows


@dataclass(frozen=True)
class WindowBatch:
    """Windows of one document as rows, padded on the right (padding is never scored; under the
    causal mask no real token attends to it, so it changes nothing)."""
    tokens: np.ndarray    # (B, S) int32 inputs: each window's tokens, then 0s
    targets: np.ndarray   # (B, S) int32: the token after each position (0 where none)
    weights: np.ndarray   # (B, S) float32: 1 where that target is scored, else 0
    windows: int          # real rows; the rest (B - windows) are all padding


def _padded(n: int, cap: int, least: int) -> int:
    """The power of two >= n (at least `least`), but no more than cap: padded sizes come in few
    shapes, so a jitted scorer compiles few times."""
    return min(max(least, 1 << (max(n, 1) - 1).bit_length()), cap)


def window_batches(ids: np.ndarray, windows: Sequence[Window], seq_len: int,
                   batch_size: int) -> Iterator[WindowBatch]:
    """`windows` of `ids` in order, batch_size at a time: full windows make (batch_size, seq_len)
    batches; a shorter last batch or window is padded to powers of two (rows, length)."""
    for start in range(0, len(windows), batch_size):
        chunk = windows[start:start + batch_size]
        B = _padded(len(chunk), batch_size, 1)
        S = _padded(max(w.end - w.begin for w in chunk), seq_len, 16)
        tokens_BS = np.zeros((B, S), np.int32)
        targets_BS = np.zeros((B, S), np.int32)
        weights_BS = np.zeros((B, S), np.float32)
        for row, w in enumerate(chunk):
            n = w.end - w.begin
            tokens_BS[row, :n] = ids[w.begin:w.end]
            targets_BS[row, :n - 1] = ids[w.begin + 1:w.end]
            # the scored tokens are the window's last n_scored; position s predicts token s + 1
            weights_BS[row, n - 1 - w.n_scored:n - 1] = 1.0
        yield WindowBatch(tokens_BS, targets_BS, weights_BS, len(chunk))


# -- running and reporting ------------------------------------------------------------------------

Scorer = Callable[[WindowBatch], np.ndarray]  # batch -> (B,) sum of weighted NLL per row, nats


def run_evaluation(score: Scorer, documents: Sequence[Document], seq_len: int, stride: int,
                   batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = False) -> dict:
    """Score every document's windows with `score` (one document at a time, so that each file's
    seconds are its own) and return the report (see `report`). progress: a tqdm bar over
    windows on stderr."""
    from bridge.progress import bar as progress_bar

    if batch_size < 1:
        raise BridgeError(f"must be a positive integer (got {batch_size})", field="batch_size")
    plans = [plan_windows(len(d.ids), seq_len, stride) for d in documents]
    nll, seconds = np.zeros(len(documents)), np.zeros(len(documents))
    with progress_bar(total=sum(map(len, plans)), unit="window", desc="scoring", leave=False,
                      enabled=progress) as bar:
        for i, (document, windows) in enumerate(zip(documents, plans)):
            started = time.perf_counter()
            for batch in window_batches(document.ids, windows, seq_len, batch_size):
                # float64 sums on the host: a long text's total keeps its last digits
                nll[i] += float(np.sum(np.asarray(score(batch), np.float64)[:batch.windows]))
                bar.update(batch.windows)
            seconds[i] = time.perf_counter() - started
    tokens = [sum(w.n_scored for w in windows) for windows in plans]
    return {"seq_len": seq_len, "stride": stride, "batch_size": batch_size,
            **report(documents, nll, tokens, seconds)}


def _figures(nll: float, tokens: int, n_bytes: int, seconds: float) -> dict:
    per_token = nll / tokens
    return {"nll_per_token": per_token,
            "perplexity": math.exp(per_token) if per_token < 700 else math.inf,
            "tokens": int(tokens),
            "bits_per_byte": nll / math.log(2) / n_bytes if n_bytes else math.nan,
            "bytes": int(n_bytes), "nll": nll, "seconds": seconds}


def report(documents: Sequence[Document], nll: Sequence[float], tokens: Sequence[int],
           seconds: Sequence[float]) -> dict:
    """Overall and per-file figures from each document's total NLL (nats), scored tokens and
    seconds: nll_per_token (total NLL / scored tokens), perplexity (its exp), tokens, bits_per_byte
    (total NLL / ln 2 / the UTF-8 bytes of the texts), bytes, nll, seconds; per file under
    `files` (path -> the same keys), token-weighted, not a mean of files."""
    files: dict[str, list] = {}
    for d, n, t, s in zip(documents, nll, tokens, seconds):
        acc = files.setdefault(d.path, [0.0, 0, 0, 0.0])
        acc[0] += float(n)
        acc[1] += int(t)
        acc[2] += d.n_bytes
        acc[3] += float(s)
    total = [sum(acc[k] for acc in files.values()) for k in range(4)]
    return {**_figures(*total), "documents": len(documents),
            "files": {path: _figures(*acc) for path, acc in files.items()}}


def format_report(report: dict) -> str:
    """The report as a table: one row per file, then the total."""
    rows = [(path, f) for path, f in report["files"].items()]
    if len(rows) > 1 or not rows:
        rows.append((f"all ({len(report['files'])} files)", report))
    width = max(12, *(len(name) for name, _ in rows))
    lines = [f"window {report['seq_len']} tokens, stride {report['stride']} (each token scored "
             f"once, with up to {report['seq_len'] - report['stride']} tokens of context)",
             f"{'file':<{width}} {'tokens':>10} {'nll/token':>10} {'perplexity':>11} "
             f"{'bits/byte':>10} {'seconds':>8}"]
    for name, f in rows:
        lines.append(f"{name:<{width}} {f['tokens']:>10,} {f['nll_per_token']:>10.4f} "
                     f"{f['perplexity']:>11.3f} {f['bits_per_byte']:>10.4f} {f['seconds']:>8.2f}")
    return "\n".join(lines)
