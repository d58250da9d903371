"""A conversation with a chat model, framework-neutral: its turns, rendered by the model's own
chat template into the ids the next reply continues, trimmed to the context, saved as a line of the
JSONL that `sft` reads. Both twins' chat sessions use it; each brings its own model and cache.

What a twin keeps between turns is the KV cache of the ids it has seen. The next turn's ids are
the whole conversation rendered again, so the cache serves the longest prefix the two share
(bridge.inputs.shared_prefix): with a template that renders earlier turns the same way every
time, that is everything before the new user turn, and only the new tokens are prefilled.
"""

from __future__ import annotations

import json
from pathlib import Path

from bridge.chat import ChatTemplate
from bridge.errors import BridgeError
from bridge.tokenizer import Tokenizer


class Conversation:
    """The turns so far ({"role", "content"} dicts, an optional system turn first) and how they
    become ids: `ask(text)` adds a user turn and returns the ids of the whole conversation up to the
    assistant's reply; `answer(text)` adds the reply. A conversation whose ids, with room for
    `max_new_tokens`, would not fit `max_seq_len` loses its oldest turns (the system turn is kept);
    `dropped` counts the turns lost that way."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer, max_seq_len: int,
                 max_new_tokens: int, system: str | None = None):
        self.template, self.tokenizer, self.system = template, tokenizer, system
        self.max_seq_len, self.max_new_tokens = max_seq_len, max_new_tokens
        self.reset()

    def reset(self) -> None:
        """Forget every turn but the system one."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.dropped = 0

    @property
    def _first_turn(self) -> int:
        return 1 if self.system else 0

    def ask(self, text: str) -> tuple[list[int], int]:
        """Add the user turn `text` -> (the conversation's ids up to the reply, how many of the
        oldest turns were dropped to make room now). A turn that does not fit even alone is
        refused, and the conversation is left as it was."""
        turn = {"role": "user", "content": text}
        alone = self.template.encode(self.messages[:self._first_turn] + [turn], self.tokenizer,
                                     add_generation_prompt=True)
        if len(alone) + self.max_new_tokens > self.max_seq_len:
            raise BridgeError(f"this turn is {len(alone)} tokens; with max_new_tokens "
                              f"{self.max_new_tokens} it does not fit the context of "
                              f"{self.max_seq_len} tokens", field="max_new_tokens")
        self.messages.append(turn)
        dropped = 0
        while True:
            ids = self.template.encode(self.messages, self.tokenizer, add_generation_prompt=True)
            if len(ids) + self.max_new_tokens <= self.max_seq_len:
                break
            # the oldest turn goes, and the reply to it with it: a conversation never starts with
            # an assistant turn
            del self.messages[self._first_turn]
            dropped += 1
            if self.messages[self._first_turn]["role"] == "assistant":
                del self.messages[self._first_turn]
                dropped += 1
        self.dropped += dropped
        return ids, dropped

    def answer(self, text: str) -> None:
        """Add the assistant's reply to the last user turn."""
        if not self.messages or self.messages[-1]["role"] != "user":
            raise BridgeError("an answer must follow a user turn", field="messages")
        self.messages.append({"role": "assistant", "content": text})

    def withdraw(self) -> None:
        """Take back the last user turn (its reply failed)."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()

    def save(self, path: str | Path) -> Path:
        """Append the conversation as one line {"messages": [...]} of a JSONL file, as `sft`
        reads it (tasks.chats.read_chats); it must end with an assistant turn."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise BridgeError(f"{path}: nothing to save yet: the conversation must end with a "
                              f"reply", field="path")
        path = Path(path)
        try:
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"messages": self.messages}, ensure_ascii=False) + "\n")
        except OSError as e:
            raise BridgeError(f"{path}: cannot write ({e.strerror or e})", field="path") from None
        return path
