"""What `jax-llama generate` and `torch-llama generate` share: finding the tokenizer, turning
text into prompts (BOS, the LLaMA 3 chat template, truncation), stop ids, and printing text as
tokens arrive. Framework-neutral: the twins bring their own model and generate().
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from .errors import BridgeError
from .tokenizer import Tokenizer, load_tokenizer

# LLaMA 3 instruct: one user turn, then the assistant header the model continues from.
CHAT_TEMPLATE = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT", help="any checkpoint the bridge reads")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the text to continue ('' starts from BOS)")
    source.add_argument("--prompt-file", help="a batch of prompts, one per line")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="tokenizer.model / tokenizer.json (default: the checkpoint's)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the LLaMA 3 instruct template")
    p.add_argument("--truncate", choices=("left",), help="cut over-long prompts from the left "
                                                         "instead of refusing them")
    p.add_argument("--stop", nargs="*", default=[], help="more stop strings (each one token)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="weights and compute (default: as stored)")


def find_tokenizer(checkpoint: str, tokenizer: str | None) -> Tokenizer:
    """--tokenizer, else the tokenizer files in the checkpoint's directory."""
    path = Path(checkpoint)
    if not path.exists():
        raise BridgeError(f"{checkpoint}: no such file or directory")
    if tokenizer:
        return load_tokenizer(tokenizer)
    directory = path if path.is_dir() else path.parent
    for name in ("tokenizer.json", "tokenizer.model"):
        if (directory / name).is_file():
            return load_tokenizer(directory / name)
    raise BridgeError(f"{checkpoint}: no tokenizer.json or tokenizer.model beside the weights; "
                      f"pass --tokenizer PATH")


def read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    try:
        lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BridgeError(f"--prompt-file: {args.prompt_file}: {e}") from None
    if not lines:
        raise BridgeError(f"--prompt-file: {args.prompt_file} holds no prompts")
    return lines


def encode_prompts(tokenizer: Tokenizer, texts: Sequence[str], max_seq_len: int, chat: bool = False,
                   truncate: str | None = None, warn=None) -> list[list[int]]:
    """Token ids per prompt: BOS + text, or the chat template; an empty prompt is just BOS. A
    prompt that leaves no room for one new token is refused, or cut from the left (keeping BOS)
    when truncate == "left"."""
    if chat and "<|start_header_id|>" not in tokenizer.special_tokens:
        raise BridgeError("--chat: the LLaMA 3 instruct template needs a LLaMA 3 tokenizer")
    prompts = []
    for i, text in enumerate(texts):
        if chat:
            ids = tokenizer.encode(CHAT_TEMPLATE.format(prompt=text), allow_special=True)
        else:
            ids = tokenizer.encode(text, bos=tokenizer.bos_id is not None)
        if not ids:
            raise BridgeError(f"prompt {i}: empty, and the tokenizer has no BOS to start from")
        limit = max_seq_len - 1
        if len(ids) > limit:
            if truncate != "left":
                raise BridgeError(f"prompt {i}: {len(ids)} tokens, but the context holds "
                                  f"{max_seq_len} (pass --truncate left to keep the end)")
            keep = ids[:1] if ids[0] == tokenizer.bos_id else []
            ids = keep + ids[len(ids) - (limit - len(keep)):]
            (warn or (lambda m: print(m, file=sys.stderr)))(
                f"warning: prompt {i} cut from the left to {len(ids)} tokens")
        prompts.append(ids)
    return prompts


def stop_ids(tokenizer: Tokenizer, extra: Sequence[str] = ()) -> tuple[int, ...]:
    """The tokenizer's own stops (EOS, <|eot_id|>, <|eom_id|>) and each --stop string's one id."""
    ids = list(tokenizer.stop_ids)
    for text in extra:
        encoded = tokenizer.encode(text, allow_special=True)
        if len(encoded) != 1:
            raise BridgeError(f"--stop: {text!r} is {len(encoded)} tokens; a stop must be one token")
        ids.append(encoded[0])
    return tuple(dict.fromkeys(ids))


class Streamer:
    """Prints row 0's text as its tokens arrive: decodes everything so far and writes what is new,
    so that a character split across tokens appears whole."""

    def __init__(self, tokenizer: Tokenizer, out=None):
        self.tokenizer, self.out, self.ids, self.shown = tokenizer, out or sys.stdout, [], ""

    def __call__(self, row: int, token: int) -> None:
        if row != 0 or token in self.tokenizer.stop_ids:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text


def print_results(tokenizer: Tokenizer, texts: Sequence[str], outputs: list[list[int]],
                  streamed: bool, out=None) -> None:
    """After streaming one prompt: a final newline. For a batch: each continuation in turn."""
    out = out or sys.stdout
    if streamed:
        out.write("\n")
        return
    stops = set(tokenizer.stop_ids)
    for text, ids in zip(texts, outputs):
        out.write(f"--- {text}\n{tokenizer.decode([t for t in ids if t not in stops])}\n")


def report_warnings(caught) -> None:
    """Warnings recorded with warnings.catch_warnings(record=True), one clean line each."""
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
