"""What every language-model run (train, sft, dpo) settles before it writes anything: the
tokenizer it trains with and the model config that fits it, both read from one opening of the
--init checkpoint (open_init) when there is one."""

from __future__ import annotations

from typing import Callable, Iterable

from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.formats import Checkpoint, open_checkpoint
from bridge.tokenizer import load_tokenizer, train_tokenizer

from .spec import RunSpec
from .state import say


def open_init(spec: RunSpec) -> Checkpoint | None:
    """The --init checkpoint, opened once (None without one): the run reads its tokenizer,
    config, chat template and weights from this opening, the file is not opened again."""
    return open_checkpoint(spec.init) if spec.init else None


def run_tokenizer(spec: RunSpec, init: Checkpoint | None, texts: Callable[[], Iterable[str]],
                  what: str):
    """The run's tokenizer: the one it saved (resume), the one named, the --init checkpoint's
    own (`init`: that checkpoint, opened by open_init), or else a byte-level BPE trained here on
    `texts()` (`what` names them)."""
    if spec.resume:
        return load_tokenizer(spec.out / "tokenizer")
    if spec.tokenizer:
        return load_tokenizer(spec.tokenizer)
    if init is not None:
        own = init.own_tokenizer()  # a GGUF's own vocabulary, from what opening it read
        if own is not None:
            return own
        if init.path.is_dir() and any((init.path / f).is_file()
                                      for f in ("tokenizer.json", "tokenizer.model")):
            return load_tokenizer(init.path)  # the directory's files
    say(f"training a {spec.vocab_size}-token byte-level BPE on {what}")
    return train_tokenizer(texts(), spec.vocab_size, progress=spec.progress)


def run_config(spec: RunSpec, init: Checkpoint | None, tokenizer,
               rows_of_seq_len: bool = True) -> LlamaConfig:
    """The model config: the --init checkpoint's (`init`, opened by open_init; its vocabulary must
    hold the tokenizer's ids), else spec.model sized to the tokenizer; either must fit
    spec.train.seq_len where the rows are that long (rows_of_seq_len; GRPO's are a prompt and a
    completion, checked by GRPO)."""
    if init is not None:
        config = init.config
        if tokenizer.vocab_size > config.vocab_size:
            raise BridgeError(f"{tokenizer.vocab_size} ids do not fit the vocabulary "
                              f"of {spec.init} ({config.vocab_size})", field="tokenizer")
    else:
        config = spec.model.replace(vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id,
                                    eos_ids=() if tokenizer.eos_id is None else (tokenizer.eos_id,))
    if rows_of_seq_len and spec.train.seq_len > config.max_seq_len:
        raise BridgeError(f"{spec.train.seq_len} is above the model's max_seq_len "
                          f"{config.max_seq_len}", field="seq_len")
    return config
