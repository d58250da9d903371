"""What every language-model run (train, sft, dpo) settles before it writes anything: the
tokenizer it trains with and the model config that fits it."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from bridge.gguf.container import is_gguf
from bridge.tokenizer import load_tokenizer, train_tokenizer

from .spec import RunSpec
from .state import say


def run_tokenizer(spec: RunSpec, texts: Callable[[], Iterable[str]], what: str):
    """The run's tokenizer: the one it saved (resume), the one named, the --init checkpoint's
    own, or else a byte-level BPE trained here on `texts()` (`what` names them)."""
    if spec.resume:
        return load_tokenizer(spec.out / "tokenizer")
    if spec.tokenizer:
        return load_tokenizer(spec.tokenizer)
    if spec.init and (is_gguf(spec.init) or Path(spec.init).is_dir() and any(
            (Path(spec.init) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))):
        return load_tokenizer(spec.init)  # a GGUF's own vocabulary, or the directory's files
    say(f"training a {spec.vocab_size}-token byte-level BPE on {what}")
    return train_tokenizer(texts(), spec.vocab_size)


def run_config(spec: RunSpec, tokenizer) -> LlamaConfig:
    """The model config: the --init checkpoint's (its vocabulary must hold the tokenizer's ids),
    else spec.model sized to the tokenizer; either must fit spec.train.seq_len."""
    if spec.init:
        config = open_checkpoint(spec.init).config
        if tokenizer.vocab_size > config.vocab_size:
            raise BridgeError(f"{tokenizer.vocab_size} ids do not fit the vocabulary "
                              f"of {spec.init} ({config.vocab_size})", field="tokenizer")
    else:
        config = spec.model.replace(vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id,
                                    eos_ids=() if tokenizer.eos_id is None else (tokenizer.eos_id,))
    if spec.train.seq_len > config.max_seq_len:
        raise BridgeError(f"{spec.train.seq_len} is above the model's max_seq_len "
                          f"{config.max_seq_len}", field="seq_len")
    return config
