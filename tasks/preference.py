"""Preference pairs for DPO: TRL's formats read and checked, tokenized, and laid out as rows.

A JSON line is {"prompt", "chosen", "rejected"}, each either a string (standard format) or a
list of messages (conversational: the prompt's turns, and the chosen / rejected assistant
turn(s), rendered with the model's chat template). As TRL tokenizes them:

- standard: the prompt's ids (with BOS where the tokenizer adds one), then the completion's ids
  with EOS appended;
- conversational: the prompt rendered with the generation prompt, then what the whole
  conversation's rendering adds to it (the reply and its end-of-turn);
- in both, the completion starts where the prompt's ids and the whole sequence's ids part
  (TRL's common prefix: the end of the prompt, unless tokens merge across it).

Only the completion's tokens count in the log-probabilities. A batch of B pairs is 2B rows,
the B chosen rows first and the B rejected rows after them (TRL's order), each padded on the
right to seq_len + 1 tokens: a padded row needs no attention mask under causal attention.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bridge.chat import ROLES, ChatTemplate

from .chats import read_json_lines
from bridge.errors import BridgeError
from bridge.inputs import shared_prefix

FIELDS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """One preference pair as token ids: the prompt's, and each completion's."""

    prompt: np.ndarray    # int32
    chosen: np.ndarray    # int32, the completion only
    rejected: np.ndarray  # int32
    where: str


def _check_messages(value, where: str, name: str) -> list[dict]:
    if not value:
        raise BridgeError(f"{where}: {name}: empty list")
    for j, m in enumerate(value, 1):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise BridgeError(f"{where}: {name}: message {j}: expected an object with \"role\" "
                              f"and a string \"content\"")
        if m["role"] not in ROLES:
            raise BridgeError(f"{where}: {name}: message {j}: unknown role {m['role']!r} "
                              f"(expected {', '.join(ROLES)})")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def check_record(obj, where: str) -> dict:
    """One JSON line's pair, checked: the three fields present, all strings or all message
    lists (the completions ending with an assistant turn)."""
    if not isinstance(obj, dict):
        raise BridgeError(f"{where}: expected a JSON object (got {type(obj).__name__})")
    missing = [f for f in FIELDS if f not in obj]
    if missing:
        raise BridgeError(f"{where}: missing {', '.join(map(repr, missing))} (a pair needs "
                          f"\"prompt\", \"chosen\" and \"rejected\"; got keys "
                          f"{', '.join(map(repr, obj)) or 'none'})")
    kinds = {f: "text" if isinstance(obj[f], str) else "messages" if isinstance(obj[f], list)
             else type(obj[f]).__name__ for f in FIELDS}
    if set(kinds.values()) == {"text"}:
        return {f: obj[f] for f in FIELDS}
    if set(kinds.values()) != {"messages"}:
        raise BridgeError(f"{where}: prompt, chosen and rejected must all be strings or all "
                          f"message lists (got {', '.join(f'{f}: {k}' for f, k in kinds.items())})")
    record = {f: _check_messages(obj[f], where, f) for f in FIELDS}
    for f in ("chosen", "rejected"):
        if record[f][-1]["role"] != "assistant":
            raise BridgeError(f"{where}: {f}: ends with a {record[f][-1]['role']} turn; a "
                              f"completion ends with an assistant turn")
    return record


def read_pairs(path: str | Path) -> list[tuple[str, dict]]:
    """[(where "FILE:LINE", record)] from a JSON-lines file; blank lines skipped, anything
    malformed refused in one line naming FILE:LINE."""
    pairs = [(where, check_record(obj, where))
             for where, obj in read_json_lines(path, "preference pairs")]
    if not pairs:
        raise BridgeError(f"{path}: no preference pairs (the file is empty)")
    return pairs


def encode_pair(record: dict, where: str, tokenizer, template: ChatTemplate | None) -> Pair:
    """A checked record as ids, as TRL tokenizes it: the prompt alone, and the prompt with each
    completion (standard: the text with EOS appended; conversational: the rendered
    conversation); the completion starts where both diverge from the prompt's ids (after the
    prompt, unless tokens merge across its end). Conversational pairs need a template."""
    if isinstance(record["prompt"], str):
        bos, eos = tokenizer.add_bos, [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        prompt = tokenizer.encode(record["prompt"], bos=bos)
        whole = [tokenizer.encode(record["prompt"] + record[f], bos=bos) + eos
                 for f in ("chosen", "rejected")]
    else:
        if template is None:
            raise BridgeError(f"{where}: a conversational pair needs a chat template "
                              f"(--chat-template)")
        prompt = template.encode(record["prompt"], tokenizer, add_generation_prompt=True)
        whole = [template.encode(record["prompt"] + record[f], tokenizer)
                 for f in ("chosen", "rejected")]
    n = min(shared_prefix(prompt, ids) for ids in whole)
    chosen, rejected = (ids[n:] for ids in whole)
    for name, ids in (("chosen", chosen), ("rejected", rejected)):
        if not ids:
            raise BridgeError(f"{where}: {name}: the completion has no tokens")
    return Pair(np.asarray(prompt[:n], np.int32), np.asarray(chosen, np.int32),
                np.asarray(rejected, np.int32), where)


def encode_pairs(records: list[tuple[str, dict]], tokenizer, template: ChatTemplate | None,
                 seq_len: int) -> tuple[list[Pair], dict]:
    """(pairs, counts): each record encoded; a pair whose chosen and rejected are the same
    tokens is skipped (it carries no preference) and counted, with a warning; one whose prompt
    leaves no completion token within seq_len + 1 is refused; longer completions are cut to
    fit (keep the start, as TRL) and counted."""
    pairs, identical, cut = [], [], 0
    for where, record in records:
        pair = encode_pair(record, where, tokenizer, template)
        if np.array_equal(pair.chosen, pair.rejected):
            identical.append(where)
            continue
        room = seq_len + 1 - len(pair.prompt)
        if room < 1:
            raise BridgeError(f"{where}: the prompt's {len(pair.prompt)} tokens leave no room for "
                              f"the completion within {seq_len + 1} (raise --seq-len)",
                              field="seq_len")
        cut += max(len(pair.chosen), len(pair.rejected)) > room
        pairs.append(Pair(pair.prompt, pair.chosen[:room], pair.rejected[:room], where))
    if identical:
        print(f"warning: skipped {len(identical)} pair(s) whose chosen and rejected are the same "
              f"tokens (first: {identical[0]})", file=sys.stderr)
    return pairs, {"identical": len(identical), "cut": int(cut)}


def pair_rows(pairs: list[Pair], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """The pairs as a batch of 2B rows (chosen first): inputs and targets int32 (2B, seq_len),
    mask float32 (2B, seq_len) - 1 where the target is a completion token - and n_tokens
    (2B,), the completion lengths."""
    rows = np.full((2 * len(pairs), seq_len + 1), pad_id, np.int32)
    mask = np.zeros((2 * len(pairs), seq_len + 1), np.float32)
    for i, pair in enumerate(pairs):
        for r, completion in ((i, pair.chosen), (len(pairs) + i, pair.rejected)):
            ids = np.concatenate([pair.prompt, completion])
            rows[r, :len(ids)] = ids
            mask[r, len(pair.prompt):len(ids)] = 1.0
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:], "mask": mask[:, 1:],
            "n_tokens": mask.sum(axis=1)}


class PairBatches:
    """Batches of `batch_size` pairs in a seeded order, a new permutation each epoch; batch(step)
    depends on the step only (a resumed run sees the same batches). Each carries `index`, the
    pairs' positions, for precomputed reference log-probs."""

    def __init__(self, pairs: list[Pair], batch_size: int, seq_len: int, seed: int, pad_id: int):
        if len(pairs) < batch_size:
            raise BridgeError(f"{len(pairs)} pairs are fewer than one batch of {batch_size}",
                              field="batch_size")
        self.pairs, self.batch_size, self.seq_len = pairs, batch_size, seq_len
        self.seed, self.pad_id = seed, pad_id
        self.per_epoch = len(pairs) // batch_size

    def indices(self, step: int) -> np.ndarray:
        epoch, at = divmod(step, self.per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.pairs))
        return order[at * self.batch_size:(at + 1) * self.batch_size]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        index = self.indices(step)
        rows = pair_rows([self.pairs[i] for i in index], self.seq_len, self.pad_id)
        return {**rows, "index": index.astype(np.int32)}


def in_order(pairs: list[Pair], batch_size: int, seq_len: int, pad_id: int):
    """Every pair once, in order, in batches of at most batch_size: (index, rows)."""
    for at in range(0, len(pairs), batch_size):
        index = np.arange(at, min(at + batch_size, len(pairs)))
        yield index, pair_rows([pairs[i] for i in index], seq_len, pad_id)
