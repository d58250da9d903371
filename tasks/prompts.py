"""Text in and out of generation, framework-neutral: prompts as token ids (BOS, a chat template,
truncation), the ids that stop a row, and what a generation shows while it runs (its text as
the tokens arrive, or a bar over a batch's steps). Both twins' generate commands use these;
each twin brings its own model and generate()."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bridge.chat import ChatTemplate
from bridge.errors import BridgeError
from bridge.tokenizer import Tokenizer


def encode_prompts(tokenizer: Tokenizer, texts: Sequence[str], max_seq_len: int,
                   chat: ChatTemplate | None = None, truncate: str | None = None, warn=None,
                   system: str | None = None) -> list[list[int]]:
    """Token ids per prompt: BOS + text (no BOS for a tokenizer that adds none, such as
    SmolLM2's), or with `chat` one user turn (after a `system` one when given) rendered by the
    template up to the assistant's reply; an empty prompt is just BOS. A
    prompt that leaves no room for one new token is refused, or cut from the left (keeping BOS)
    when truncate == "left"; warn(message) hears each cut (default: stderr)."""
    prompts = []
    for i, text in enumerate(texts):
        if chat is not None:
            messages = [{"role": "system", "content": system}] if system else []
            ids = chat.encode(messages + [{"role": "user", "content": text}], tokenizer,
                              add_generation_prompt=True)
        else:
            ids = tokenizer.encode(text, bos=tokenizer.add_bos)
        if not ids:
            raise BridgeError(f"prompt {i}: empty, and the tokenizer adds no BOS to start from")
        limit = max_seq_len - 1
        if len(ids) > limit:
            if truncate != "left":
                raise BridgeError(f"prompt {i}: {len(ids)} tokens, but the context holds "
                                  f"{max_seq_len}", hint=("truncate", "left", "pass {} to keep the end"))
            keep = ids[:1] if ids[0] == tokenizer.bos_id else []
            ids = keep + ids[len(ids) - (limit - len(keep)):]
            (warn or (lambda m: print(m, file=sys.stderr)))(
                f"warning: prompt {i} cut from the left to {len(ids)} tokens")
        prompts.append(ids)
    return prompts


def stop_ids(tokenizer: Tokenizer, stop: Sequence[str] = ()) -> tuple[int, ...]:
    """The tokenizer's own stops (EOS, <|eot_id|>, <|eom_id|>) and each `stop` string's one id."""
    ids = list(tokenizer.stop_ids)
    for text in stop:
        encoded = tokenizer.encode(text, allow_special=True)
        if len(encoded) != 1:
            raise BridgeError(f"{text!r} is {len(encoded)} tokens; a stop must be one token",
                              field="stop")
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


class Display:
    """What a generation shows while it runs, as a context around it: one prompt's text printed
    as its tokens arrive (Streamer), or for a batch a bar on stderr over its decode steps
    (max_new_tokens at most; it ends early when every row has stopped). `note`: a line said on
    stderr as the generation starts (what its decode steps run on, say).

        with Display(tokenizer, len(prompts), max_new_tokens) as shown:
            result = generate(..., on_token=shown.on_token)

    on_token(row, id) is what generate() calls: None for a batch without a bar, which then
    decodes in one call rather than a step per call."""

    def __init__(self, tokenizer: Tokenizer, rows: int, max_new_tokens: int,
                 progress: bool = True, note: str | None = None, out=None):
        from bridge.progress import bar

        self.stream = Streamer(tokenizer, out) if rows == 1 else None
        counting = progress and self.stream is None
        self.bar = bar(total=max_new_tokens, desc=f"decoding {rows} prompts", unit="step",
                       enabled=counting)
        self.note, self.made = note, [0] * rows
        self.on_token = self.stream if self.stream is not None else (
            self._count if counting else None)

    def __enter__(self) -> "Display":
        if self.note:
            print(self.note, file=sys.stderr, flush=True)
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def _count(self, row: int, token: int) -> None:
        self.made[row] += 1
        if self.made[row] > self.bar.n:  # the first row to reach a step
            self.bar.update(self.made[row] - self.bar.n)


class TextStream:
    """A generation's text as its tokens arrive, cut at the first stop string: push(id) returns
    the text that is now safe to show. Text that could still become a stop string (a suffix that
    is the start of one) is held back until a later token settles it, so a stop string never
    appears, not even in part; an incomplete multi-byte character waits for its rest. `stopped`
    turns True once a stop string has appeared (the text ends before it); finish() returns what
    was held back when the generation ended without one."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        if any(not isinstance(s, str) or not s for s in stops):
            raise BridgeError("stop: each stop must be a non-empty string", field="stop")
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.ids: list[int] = []
        self.text = ""       # all decoded so far (up to a stop string, once one appeared)
        self.shown = 0       # characters of text returned so far
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        cut = min((i for i in (text.find(s, max(0, self.shown - len(s) + 1)) for s in self.stops)
                   if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._show(cut)
        self.text = text
        held = max((k for s in self.stops for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
        # a trailing U+FFFD may be a multi-byte character whose rest is still to come
        safe = min(len(text) - held, len(text.rstrip("\ufffd")))
        return self._show(max(safe, self.shown))

    def finish(self) -> str:
        """The rest of the text (the end of a generation that met no stop string)."""
        return "" if self.stopped else self._show(len(self.text))

    def _show(self, upto: int) -> str:
        new, self.shown = self.text[self.shown:upto], max(upto, self.shown)
        return new
