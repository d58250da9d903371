"""Chats for supervised fine-tuning (SFT): conversations read from JSON lines, rendered by the
model's chat template (bridge.chat) into ids, and the exact per-token loss mask that trains the
assistant's turns only.

    example = encode_example(template, tokenizer, messages, "chats.jsonl:3")
    example.ids, example.trained                             # int32 (T,), bool (T,)
    read_chats("chats.jsonl")                                # [(where "FILE:LINE", messages)]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import groupby, pairwise
from pathlib import Path

import numpy as np

from bridge.chat import ROLES, ChatTemplate
from bridge.errors import BridgeError


# -- examples: ids and the assistant-only mask -----------------------------------------------------

@dataclass
class Example:
    """One tokenized conversation: ids int32 (T,), trained bool (T,) - the loss counts token t
    when trained[t] - and where it came from ("FILE:LINE" or any label)."""

    ids: np.ndarray
    trained: np.ndarray
    where: str


def _turn_spans(template: ChatTemplate, tokenizer, messages: list[dict], text: str, where: str
                ) -> list[tuple[int, int]]:
    """For a template without generation blocks: assistant turn i is the text that
    render(messages[:i+1]) adds to render(messages[:i], add_generation_prompt=True), provided each
    rendering is a prefix of the next and of the whole.

    Some templates render the last assistant turn with more in front than the same turn gets
    once the conversation goes on: Qwen3's puts an empty "<think>" block before a last reply and
    strips the reasoning from earlier ones. There the turn, as the whole conversation renders it,
    is the longest end of its rendering as the last turn that the text continues with, and must
    hold the reply (its text after any "</think>")."""
    spans = []
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    for k, i in enumerate(turns, 1):
        try:
            before, _ = template.render(messages[:i], tokenizer, add_generation_prompt=True)
            after, _ = template.render(messages[:i + 1], tokenizer)
        except BridgeError:
            before = after = None
        lost = BridgeError(f"{where}: assistant turn {k} cannot be found in the rendered "
                           f"template ({template.name})")
        if before is None or not (after.startswith(before) and text.startswith(before)):
            raise lost
        if text.startswith(after):
            spans.append((len(before), len(after)))
            continue
        turn, rest = after[len(before):], text[len(before):]
        shared = next((n for n in range(len(turn), 0, -1) if rest.startswith(turn[-n:])), 0)
        reply = str(messages[i].get("content", "")).rsplit("</think>", 1)[-1].strip()
        if not shared or reply not in rest[:shared]:  # the reply itself, its reasoning aside
            raise lost
        spans.append((len(before), len(before) + shared))
    return spans


def _tokens_before(tokenizer, text: str, ids: list[int], cuts: list[int], where: str,
                   name: str) -> dict[int, int]:
    """{cut: n} such that ids[:n] are exactly the tokens of text[:cut], for sorted character cuts.

    First the pieces between cuts are tokenized on their own: when their ids, concatenated, are
    the whole text's ids, every cut falls between tokens. Otherwise (SentencePiece, say, which
    starts each piece with a space of its own) each prefix text[:cut] is tokenized: its ids must
    begin the whole text's ids, and then those tokens cover text[:cut] exactly. A cut inside a
    token is refused, naming `where`: its token would be half reply, half not."""
    edges = [0, *cuts, len(text)]
    pieces = [tokenizer.encode(text[a:b], allow_special=True) for a, b in pairwise(edges)]
    if [i for piece in pieces for i in piece] == ids:
        return dict(zip(cuts, np.cumsum([len(p) for p in pieces[:-1]]).tolist()))
    found = {}
    for cut in cuts:
        prefix = tokenizer.encode(text[:cut], allow_special=True)
        if ids[:len(prefix)] != prefix:
            raise BridgeError(f"{where}: a token of the rendered template ({name}) straddles "
                              f"character {cut}, an edge of an assistant reply, so the reply's "
                              f"tokens cannot be marked exactly")
        found[cut] = len(prefix)
    return found


def encode_example(template: ChatTemplate, tokenizer, messages: list[dict], where: str) -> Example:
    """A conversation's ids (template.encode's: the whole rendering tokenized at once) and its
    mask: True on the tokens inside an assistant span. The spans are the template's
    {% generation %} blocks, or for a template without them each assistant turn's text found by
    rendering prefixes of the conversation (_turn_spans). Tokens never straddle a span's edge
    (refused otherwise, see _tokens_before), so "starts inside a span" and transformers'
    "overlaps a span" (return_assistant_tokens_mask) mark the same tokens."""
    text, spans = template.render(messages, tokenizer)
    if not template.marks_generation:
        spans = _turn_spans(template, tokenizer, messages, text, where)
    ids = tokenizer.encode(text, allow_special=True)
    cuts = sorted({edge for span in spans for edge in span} - {0, len(text)})
    before = {0: 0, len(text): len(ids), **_tokens_before(tokenizer, text, ids, cuts, where,
                                                           template.name)}
    trained = np.zeros(len(ids), bool)
    for start, end in spans:
        trained[before[start]:before[end]] = True
    return Example(np.asarray(ids, np.int32), trained, where)


def truncate(example: Example, max_len: int) -> Example | None:
    """The example's first max_len tokens; None when none of them is trained."""
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
        raise BridgeError(f"must be a positive integer (got {max_len!r})", field="max_len")
    cut = Example(example.ids[:max_len], example.trained[:max_len], example.where)
    return cut if cut.trained.any() else None


# -- conversations from JSON lines -----------------------------------------------------------------

def _messages(obj, where: str) -> list[dict]:
    """One JSON line's conversation as [{"role", "content"}, ...] (other keys dropped)."""
    if not isinstance(obj, dict):
        raise BridgeError(f"{where}: expected a JSON object (got {type(obj).__name__})")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list):
            raise BridgeError(f"{where}: messages: expected a list (got {type(messages).__name__})")
    elif "prompt" in obj and "completion" in obj:
        messages = [{"role": "user", "content": obj["prompt"]},
                    {"role": "assistant", "content": obj["completion"]}]
    else:
        raise BridgeError(f"{where}: expected \"messages\", or \"prompt\" and \"completion\" "
                          f"(got keys {', '.join(map(repr, obj)) or 'none'})")
    if not messages:
        raise BridgeError(f"{where}: messages: empty list")
    for j, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BridgeError(f"{where}: message {j}: expected an object with \"role\" and "
                              f"\"content\"")
        if m["role"] not in ROLES:
            raise BridgeError(f"{where}: message {j}: unknown role {m['role']!r} (expected "
                              f"{', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise BridgeError(f"{where}: message {j}: content must be a string (got "
                              f"{type(m['content']).__name__})")
    if messages[-1]["role"] != "assistant":
        raise BridgeError(f"{where}: the conversation ends with a {messages[-1]['role']} turn; "
                          f"it must end with an assistant turn to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_json_lines(path: str | Path, what: str) -> list[tuple[str, object]]:
    """[(where "FILE:LINE", the line's JSON value)] of a JSON-lines file of `what` (named in the
    error when it cannot be read); blank lines skipped, malformed JSON refused naming FILE:LINE."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise BridgeError(f"{path}: cannot read the {what} "
                          f"({getattr(e, 'strerror', None) or e})") from None
    values = []
    # split("\n"), not splitlines(): U+2028 and friends may stand unescaped inside JSON strings
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            values.append((where, json.loads(line)))
        except ValueError as e:
            raise BridgeError(f"{where}: malformed JSON ({getattr(e, 'msg', e)} at column "
                              f"{getattr(e, 'colno', '?')})") from None
    return values


def read_chats(path: str | Path) -> list[tuple[str, list[dict]]]:
    """[(where "FILE:LINE", messages)] from a JSON-lines file, one conversation a line: either
    {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]} ending with an
    assistant turn, or {"prompt": str, "completion": str} (a user turn and an assistant turn).
    Blank lines are skipped; anything else is refused in one line naming FILE:LINE."""
    return [(where, _messages(obj, where))
            for where, obj in read_json_lines(path, "conversations")]


# -- showing a mask --------------------------------------------------------------------------------

def show_mask(example: Example, tokenizer) -> str:
    """The example for a reader: a first line "WHERE: N of T tokens trained", then its text with
    each run of trained tokens between « and ». Special tokens show as their names; other tokens
    are decoded together with the tokens before them, so a space or a character that spans
    tokens comes out as in the rendered text."""
    names = {i: name for name, i in tokenizer.special_tokens.items()}
    ids = [int(i) for i in example.ids]
    parts: list[tuple[bool, str]] = []
    start, done = 0, ""  # the current stretch of ordinary tokens, and its text so far
    for (trained, special), run in groupby(range(len(ids)), lambda t: (bool(example.trained[t]),
                                                                       ids[t] in names)):
        run = list(run)
        if special:
            text, start, done = "".join(names[ids[t]] for t in run), run[-1] + 1, ""
        else:
            whole = tokenizer.decode(ids[start:run[-1] + 1])
            text, done = whole[len(done):], whole
        parts.append((trained, text))
    body = "".join(("«" + "".join(t for _, t in group) + "»") if trained
                   else "".join(t for _, t in group)
                   for trained, group in groupby(parts, lambda p: p[0]))
    return f"{example.where}: {int(example.trained.sum())} of {len(ids)} tokens trained\n{body}"
