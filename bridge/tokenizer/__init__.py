"""One Tokenizer interface over the four kinds this project meets: LLaMA 3 (tiktoken ranks),
LLaMA 2 (SentencePiece), Hugging Face tokenizer.json, and raw UTF-8 bytes.

    tok = load_tokenizer("ckpt/")                # or a file; the kind comes from the contents
    tok = load_tokenizer("model.gguf")            # its vocabulary, tokenizing as llama.cpp does
    ids = tok.encode("Hello world", bos=tok.add_bos)  # [128000, 9906, 1917] with LLaMA 3
    tok.decode(ids)                               # "<|begin_of_text|>Hello world"
    tok.save("other_ckpt/")                       # tokenizer.model or tokenizer.json (+ config)

The tokenizer libraries are imported only when a tokenizer of their kind is built, so that the
rest of `bridge` keeps to numpy.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..errors import BridgeError
from ..locate import resolve_model
from .bos_eos import BosEos, bos_eos_as_transformers, bos_eos_post_processor
from .kinds import (EXPECTED, LLAMA3_PATTERN, LLAMA3_SPECIALS, ByteTokenizer, HFTokenizer,
                    Llama2Tokenizer, Llama3Tokenizer, Tokenizer, _byte_level_chars, _hf_from_file,
                    _split_long_runs, _split_on_specials, read_tokenizer_config)

__all__ = ["LLAMA3_PATTERN", "LLAMA3_SPECIALS", "BosEos", "ByteTokenizer", "HFTokenizer",
           "Llama2Tokenizer", "Llama3Tokenizer", "Tokenizer", "_byte_level_chars", "_split_long_runs",
           "_split_on_specials", "bos_eos_as_transformers", "detect_tokenizer_kind",
           "find_tokenizer", "load_tokenizer", "train_tokenizer"]


# Model files that carry their own vocabulary, as (holds(path), tokenizer(path)). GGUF's enters
# when `bridge` is imported (bridge.gguf): the GGUF wing builds on the kinds here, so this package
# knows it only through this list.
MODEL_FILE_TOKENIZERS: list[tuple[Callable[[Path], bool], Callable[[Path], Tokenizer]]] = []


def _model_file_tokenizer(path: Path) -> Callable[[Path], Tokenizer] | None:
    """The reader of the vocabulary a model file carries (a GGUF file's), or None."""
    return next((read for holds, read in MODEL_FILE_TOKENIZERS if holds(path)), None)


# -- finding, detecting, loading, training -------------------------------------------------------

def _tokenizer_file(path: str | Path) -> Path:
    """A tokenizer file, or the directory's tokenizer.json / tokenizer.model (in that order)."""
    path = Path(path)
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return path / name
        raise BridgeError(f"{path}: no tokenizer.json or tokenizer.model in this directory")
    if not path.is_file():
        raise BridgeError(f"{path}: no such file or directory")
    return path


def _detect(path: Path, data: bytes) -> str:
    if not data.strip():
        raise BridgeError(f"{path}: empty file, not a tokenizer file this project reads "
                          f"({EXPECTED})")
    if data.lstrip()[:1] == b"{":
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise BridgeError(f"{path}: invalid JSON ({e})") from None
        if isinstance(obj, dict) and "model" in obj:
            return "hf"
        raise BridgeError(f"{path}: a JSON file without a 'model' key, not a tokenizer file this "
                          f"project reads ({EXPECTED})")
    if re.fullmatch(rb"[A-Za-z0-9+/]+={0,2}[ \t]+\d+\r?", data.split(b"\n", 1)[0]):
        return "llama3"
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor(model_proto=data)
        return "llama2"
    except RuntimeError:
        raise BridgeError(f"{path}: not a tokenizer file this project reads ({EXPECTED})") from None


def detect_tokenizer_kind(path: str | Path) -> str:
    """"llama3", "llama2" or "hf", from the contents of a file (or of a directory's
    tokenizer.json / tokenizer.model; for a GGUF file, the kind its vocabulary is rebuilt as);
    BridgeError naming the file for anything else."""
    file = _tokenizer_file(path)
    if _model_file_tokenizer(file):
        return load_tokenizer(file).kind
    return _detect(file, file.read_bytes())


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A Tokenizer from a file or a checkpoint directory; the kind is detected from contents.
    A GGUF file (a model, or a vocabulary-only file) gives its tokenizer.ggml.* vocabulary,
    rebuilt to tokenize as llama.cpp does (bridge.gguf.tokenizer)."""
    file = _tokenizer_file(path)
    read = _model_file_tokenizer(file)
    if read:
        return read(file)
    data = file.read_bytes()
    kind = _detect(file, data)
    if kind == "hf":
        return _hf_from_file(file, data)
    tok = Llama3Tokenizer.from_bytes(data, file) if kind == "llama3" else Llama2Tokenizer(data, file)
    config = read_tokenizer_config(file.parent)  # its add_bos_token / add_eos_token, if any
    tok.decide(bos_eos_as_transformers(config, tok.bos_id, tok.eos_id, tokenizer_json=False))
    return tok


def find_tokenizer(checkpoint, tokenizer: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint: the file `tokenizer` when given, else a GGUF file's own
    vocabulary, else the tokenizer.json / tokenizer.model beside the weights (in the checkpoint
    directory, or the file's directory).

    `checkpoint` is a path (or a model's name: bridge.locate.resolve_model), or a checkpoint
    already opened (bridge.formats.open_checkpoint), whose own vocabulary then comes from what
    opening it read: the file is not read again."""
    opened = not isinstance(checkpoint, (str, os.PathLike))
    path = Path(checkpoint.path) if opened else resolve_model(checkpoint)
    if tokenizer:
        return load_tokenizer(tokenizer)
    if opened:
        own = checkpoint.own_tokenizer()
        if own is not None:
            return own
    elif path.is_file() and _model_file_tokenizer(path):
        return load_tokenizer(path)
    directory = path if path.is_dir() else path.parent
    for name in ("tokenizer.json", "tokenizer.model"):
        if (directory / name).is_file():
            return load_tokenizer(directory / name)
    raise BridgeError(f"{path}: no tokenizer.json or tokenizer.model beside the weights",
                      hint=("tokenizer", "PATH", "pass {}"))


def train_tokenizer(texts: Iterable[str], vocab_size: int,
                    special_tokens: Sequence[str] = ("<|bos|>", "<|eos|>", "<|pad|>"),
                    progress: bool = False) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style, so any string round-trips) on `texts`.

    The specials take ids 0, 1, 2, ... and the first three are bos, eos and pad (fewer is fine);
    the 256 byte symbols follow, then merges up to `vocab_size` ids (fewer if the corpus runs out
    of pairs). BOS opens an encoded text (add_bos). The same texts give the same tokenizer.
    progress: the tokenizers library's own bars on stderr (shown on a terminal only)."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers

    special_tokens = list(special_tokens)
    if not all(isinstance(s, str) and s for s in special_tokens) or \
            len(set(special_tokens)) != len(special_tokens):
        raise BridgeError(f"special_tokens: expected distinct non-empty strings "
                          f"(got {special_tokens!r})")
    floor = 256 + len(special_tokens)
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= floor:
        raise BridgeError(f"vocab_size: must be an integer > 256 bytes + {len(special_tokens)} "
                          f"special tokens = {floor} (got {vocab_size!r})")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress)
    tok.train_from_iterator(texts, trainer=trainer)
    # BOS opens every document of a corpus this tokenizer encodes (as the model trained on it
    # sees them); the post-processor is where transformers reads that from.
    if special_tokens:
        tok.post_processor = bos_eos_post_processor(None, (special_tokens[0], 0), None)
    return HFTokenizer(tok, dict(zip(("bos_token", "eos_token", "pad_token"), special_tokens)))
