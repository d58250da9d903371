"""Corpus -> token cache -> batches.

Text files (or directories of them) are tokenized once into a flat uint16 / uint32 file next to
the run and memory-mapped; the cache is keyed by the files (path, size, mtime) and the tokenizer,
so an unchanged corpus is never tokenized twice. Each file is one document, framed as
BOS text EOS. Batches are random windows of seq_len + 1 tokens drawn from a generator seeded by
(seed, step, process), so the batch of any step can be recomputed on resume without saving a
data position.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from bridge.atomic import write_text
from tasks.classification import strip_labels
from bridge.data_dirs import check_out_apart, files_under
from bridge.errors import BridgeError

from .state import say

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".tsv", ".html", ".xml",
                 ".c", ".h", ".cc", ".cpp", ".js", ".ts", ".java", ".go", ".rs", ".sh", ".toml",
                 ".yaml", ".yml", ".tex", ""}


def default_corpus() -> list[Path]:
    """The embedded default: the running interpreter's standard library sources (tests and
    site-packages left out, ~12 MB for CPython 3.11), present wherever this project runs."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def corpus_files(paths: Iterable[str | os.PathLike], out: str | os.PathLike | None = None,
                 say=None) -> list[Path]:
    """Files named directly, plus the text files (by suffix) under each directory, sorted.

    A run's own output is never its input: `out` (the run directory) may not be, or hold, one
    of the paths (field "out"); inside a directory, `out` and whatever earlier runs wrote there
    (run directories, checkpoints, token caches: bridge.data_dirs) are left out, in one line
    to stderr (or `say`)."""
    paths = list(paths)
    if out is not None:
        check_out_apart(out, paths)
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(files_under(path, TEXT_SUFFIXES, out, say))
        else:
            raise BridgeError(f"{path}: no such file or directory")
    if not files:
        raise BridgeError(f"no text files found in {', '.join(map(str, paths))}", field="data")
    return files


def read_documents(files: list[Path], warn=None, labeled: bool = False) -> Iterator[str]:
    """The text of each readable UTF-8 file; the others are skipped and counted in one warning.
    labeled: the files are `LABEL ||| TEXT` lines, and only the texts are kept."""
    skipped = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            skipped.append(f"{f} ({type(e).__name__})")
            continue
        if labeled:
            stripped = strip_labels(text)
            if text.strip() and stripped == text:
                (warn or say)(
                    f"warning: {f}: no 'LABEL ||| TEXT' line; its text is used as it is")
            text = stripped
        if text.strip():
            yield text
    if skipped:
        (warn or say)(
            f"warning: skipped {len(skipped)} unreadable or non-UTF-8 file(s), e.g. {skipped[0]}")


def _fingerprint(files: list[Path], tokenizer, labeled: bool = False) -> str:
    h = hashlib.sha256(b"labeled\n" if labeled else b"")
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    with tempfile.TemporaryDirectory() as tmp:  # the tokenizer, by the bytes of its own files
        for path in sorted(tokenizer.save(tmp)):
            h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


def tokenize_corpus(files: list[Path], tokenizer, cache_dir: str | os.PathLike,
                    progress=None, labeled: bool = False) -> np.ndarray:
    """All documents as one flat token array (memory-mapped from the cache).

    Written to a temporary file beside the cache entry and renamed at the end, so a killed run
    never leaves a truncated cache behind. An empty corpus is refused.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    key = _fingerprint(files, tokenizer, labeled)
    path = cache_dir / f"tokens-{key}.{dtype.name}"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=cache_dir)
        n_docs = 0
        try:
            with os.fdopen(fd, "wb") as out:
                for text in (progress or iter)(read_documents(files, labeled=labeled)):
                    ids = tokenizer.encode(text, bos=tokenizer.add_bos,
                                           eos=tokenizer.eos_id is not None)
                    np.asarray(ids, dtype=dtype).tofile(out)
                    n_docs += 1
            if n_docs == 0:
                raise BridgeError(f"the corpus is empty ({len(files)} file(s), no text)", field="data")
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        write_text(cache_dir / f"tokens-{key}.json", json.dumps(
            {"files": len(files), "documents": n_docs, "dtype": dtype.name}) + "\n")
    return np.memmap(path, dtype=dtype, mode="r")


def split(tokens: np.ndarray, val_fraction: float, min_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last val_fraction of the tokens is held out. Each part must hold
    more than `min_tokens` (one window, and a second place to start it: Batches draws a start
    below len - window), else the corpus is too small for the sequence length."""
    n_val = max(int(len(tokens) * val_fraction), min_tokens + 1)
    train, val = tokens[:-n_val], tokens[-n_val:]
    if len(train) <= min_tokens or len(val) <= min_tokens:
        raise BridgeError(f"{len(tokens):,} tokens are too few for windows of {min_tokens} "
                          f"tokens in both the train and validation parts", field="data")
    return train, val


@dataclass(frozen=True)
class Batches:
    """Random windows of seq_len + 1 tokens: inputs, targets (shifted by one) and a loss mask.

    batch(step) is a pure function of (seed, step): the global batch of every process together is
    drawn, and each process of a multi-process run takes its own rows of it, so batches are
    reproducible on resume and the same whatever the number of processes.
    """

    tokens: np.ndarray
    batch_size: int          # rows drawn by this process
    seq_len: int
    seed: int = 0
    process_index: int = 0
    bos_id: int | None = None
    process_count: int = 1

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, step, 0])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1,
                              size=self.batch_size * self.process_count)
        starts = starts[self.process_index * self.batch_size:][:self.batch_size]
        windows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in starts])
        windows = windows.astype(np.int32)
        inputs, targets = windows[:, :-1], windows[:, 1:]
        # Predicting the BOS that opens the next document from the previous one is not learnable.
        mask = np.ones_like(targets, dtype=np.float32) if self.bos_id is None else (
            targets != self.bos_id).astype(np.float32)
        return {"inputs": inputs, "targets": targets, "mask": mask}


def documents(tokens: np.ndarray, bos_id: int | None, eos_id: int | None = None) -> np.ndarray:
    """(N, 2) int64 (start, length) of each document in a flat token array: each begins at a
    BOS (tokenize_corpus frames every file as BOS text EOS); for a tokenizer that adds no BOS
    (bos_id None), each ends at an EOS; with neither, one document."""
    if bos_id is None and eos_id is None:
        return np.array([[0, len(tokens)]], np.int64)
    if bos_id is None:
        starts = np.flatnonzero(np.asarray(tokens)[:-1] == eos_id) + 1
    else:
        starts = np.flatnonzero(np.asarray(tokens) == bos_id)
    if len(starts) == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    return np.stack([starts, np.diff(np.append(starts, len(tokens)))], axis=1).astype(np.int64)


def pack(docs: np.ndarray, row_len: int) -> list[list[tuple[int, int]]]:
    """Rows of at most row_len tokens, each a list of (start, length) pieces of whole documents:
    a document longer than a row is cut into row-sized pieces (the last piece is packed like a
    short document); the rest are placed first-fit, longest first, so little room is left over."""
    rows: list[list[tuple[int, int]]] = []
    short = []
    for start, length in docs.tolist():
        while length > row_len:
            rows.append([(start, row_len)])
            start, length = start + row_len, length - row_len
        if length:
            short.append((start, length))
    short.sort(key=lambda piece: -piece[1])
    room: list[int] = []        # free tokens of each open row, in the order the rows were opened
    open_rows: list[list[tuple[int, int]]] = []
    for piece in short:
        for i, free in enumerate(room):
            if free >= piece[1]:
                open_rows[i].append(piece)
                room[i] -= piece[1]
                break
        else:
            open_rows.append([piece])
            room.append(row_len - piece[1])
    return rows + open_rows


@dataclass(frozen=True)
class PackedBatches:
    """Rows of whole documents (`--pack`): inputs, targets, a loss mask and segment ids.

    Each row holds seq_len + 1 tokens from pack(); its documents are segments (a token attends
    only within its own, positions restart at each), the tail it cannot fill is padding in a
    segment of its own, and no target crosses a document boundary. batch(step) is a pure
    function of (seed, step): rows are dealt out in an order drawn per epoch, each process
    taking its own of the global batch's rows.

    Documents are found at each BOS, or given as `docs` ((N, 2) start, length), e.g. the
    conversations of supervised fine-tuning; `trained` (bool, aligned with `tokens`) then says
    which tokens the loss counts as targets, and `one_per_row` keeps one document to a row
    (padded, no packing).
    """

    tokens: np.ndarray
    batch_size: int          # rows drawn by this process
    seq_len: int
    seed: int = 0
    process_index: int = 0
    bos_id: int | None = None
    pad_id: int = 0
    eos_id: int | None = None  # where documents end when there is no bos_id
    docs: np.ndarray | None = None
    trained: np.ndarray | None = None
    one_per_row: bool = False
    process_count: int = 1

    @functools.cached_property
    def rows(self) -> list[list[tuple[int, int]]]:
        docs = documents(self.tokens, self.bos_id, self.eos_id) if self.docs is None else self.docs
        if self.one_per_row:
            return [[(start, min(length, self.seq_len + 1))] for start, length in docs.tolist()]
        return pack(docs, self.seq_len + 1)

    def padding(self) -> float:
        """The fraction of row tokens that are padding."""
        used = sum(length for row in self.rows for _, length in row)
        return 1.0 - used / (len(self.rows) * (self.seq_len + 1))

    def batch(self, step: int) -> dict[str, np.ndarray]:
        n = len(self.rows)
        picks = []
        first = (step * self.process_count + self.process_index) * self.batch_size
        for i in range(first, first + self.batch_size):
            epoch, at = divmod(i, n)
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(n)
            picks.append(self.rows[order[at]])
        L = self.seq_len + 1
        windows = np.full((len(picks), L), self.pad_id, np.int32)
        segments = np.zeros((len(picks), L), np.int32)
        counted = np.ones((len(picks), L), bool)
        for r, row in enumerate(picks):
            at = 0
            for s, (start, length) in enumerate(row):
                windows[r, at:at + length] = np.asarray(self.tokens[start:start + length])
                segments[r, at:at + length] = s
                if self.trained is not None:
                    counted[r, at:at + length] = self.trained[start:start + length]
                at += length
            segments[r, at:] = len(row)  # the padding: a segment of its own
        real = np.zeros((len(picks), L), bool)
        for r, row in enumerate(picks):
            real[r, :sum(length for _, length in row)] = True
        same = (segments[:, 1:] == segments[:, :-1]) & real[:, 1:] & counted[:, 1:]
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:],
                "mask": same.astype(np.float32), "segment_ids": segments[:, :-1]}


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) on `val` of the unigram model fitted on `train` with add-one
    smoothing: the baseline a language model must beat by far."""
    counts = np.bincount(np.asarray(train), minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[np.asarray(val)].mean())
