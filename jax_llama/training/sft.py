"""Supervised fine-tuning on conversations (`jax-llama sft`): chats rendered with the model's own
chat template, the loss on the assistant's tokens only, whole conversations packed into rows.

The rendering and the mask are bridge.chat's (framework-neutral); here the examples become the
batches of jax_llama.training.loop's training loop, and a held-out set is scored by exact match of greedy
replies. With no data, `demo_chats` makes a small instruction task with exact answers, so that
the command shows learning on any machine with nothing downloaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np

from bridge.chat import ChatTemplate, Example, encode_example, read_chats, truncate
from bridge.errors import BridgeError

from . import data as data_lib


@dataclass(frozen=True)
class SftSpec:
    data: str | None = None           # chats JSONL; None: the synthetic demo task (demo_chats)
    eval_data: str | None = None      # held-out chats; None: eval_fraction of data
    chat_template: str | None = None  # llama3 | llama2 | a jinja file; None: the init's own
    skip_invalid: bool = False        # count and skip examples that cannot train, not refuse
    eval_fraction: float = 0.05
    demo_examples: int = 6000         # of the demo task, when there is no data
    replay: int = 0                   # the --init model's own answers to this many general
                                      # prompts, trained on beside the data (replay_chats)
    replay_tokens: int = 128          # at most, per replayed answer

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- the demo task ---------------------------------------------------------------------------------

DEMO_TASKS = ("plus", "minus", "reverse", "sort", "count", "spell", "capitals")
_WORDS = ("apple river stone cloud green music paper light horse table window garden candle "
          "silver winter summer rabbit forest bottle mirror planet orange yellow pencil").split()


def demo_chats(n: int, seed: int) -> list[tuple[str, list[dict]]]:
    """`n` conversations of one question with an exact answer, of seven kinds: add or subtract
    two numbers below 10; reverse, sort or count a list of 2-4 words; spell a word; write it in
    capitals (24 words). A system prompt on some; `where` names the kind (demo:N:KIND); the same
    seed gives the same conversations."""
    rng = np.random.default_rng(seed)

    def words(k):
        return [str(w) for w in rng.choice(_WORDS, size=k, replace=False)]

    def task(kind: str) -> tuple[str, str]:
        a, b = (int(x) for x in rng.integers(0, 10, size=2))
        if kind == "plus":
            return f"What is {a} plus {b}?", str(a + b)
        if kind == "minus":
            a, b = max(a, b), min(a, b)
            return f"What is {a} minus {b}?", str(a - b)
        ws = words(int(rng.integers(2, 5)))
        if kind == "reverse":
            return f"Reverse the list: {' '.join(ws)}", " ".join(reversed(ws))
        if kind == "sort":
            return f"Sort alphabetically: {' '.join(ws)}", " ".join(sorted(ws))
        if kind == "count":
            return f"How many words are in: {' '.join(ws)}", str(len(ws))
        if kind == "spell":
            return f"Spell the word {ws[0]}.", "-".join(ws[0])
        return f"Write {ws[0]} in capitals.", ws[0].upper()

    chats = []
    for i in range(n):
        kind = DEMO_TASKS[int(rng.integers(len(DEMO_TASKS)))]
        question, answer = task(kind)
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": answer}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "Answer with the answer only."})
        chats.append((f"demo:{i + 1}:{kind}", messages))
    return chats


# -- replay: the starting model's own answers ----------------------------------------------------

# General requests, none of them of a demo kind (so the two never compete for one prompt) and
# none of the questions scripts/sft_pretrained.py asks before and after (so those measure what
# the replay generalises to, not what it repeats).
_ASKS = ("Tell me about {}.", "Write two sentences about {}.",
         "Why do people find {} interesting?", "Give me a fun fact about {}.",
         "Explain {} to a child.",
         "What should a beginner know about {}?", "Describe {} in a few words.",
         "What are the good and bad sides of {}?", "Write a short story that involves {}.",
         "How would you describe {} to a friend?")
_TOPICS = ("the moon", "coffee", "volcanoes", "bicycles", "libraries", "honey bees", "thunder",
           "chess", "baking bread", "trains", "mountains", "the piano", "recycling", "deserts",
           "penguins", "the internet", "gardening", "dinosaurs", "football", "photography",
           "clocks", "the human heart", "electricity", "friendship", "maps", "chocolate",
           "glaciers", "robots", "the printing press", "kites")


def general_prompts(n: int, seed: int) -> list[str]:
    """`n` general requests (templates x topics: up to 300 distinct), in a seeded order."""
    asks = [a.format(t) for a in _ASKS for t in _TOPICS]
    if not 0 < n <= len(asks):
        raise BridgeError(f"must be in [1, {len(asks)}] (got {n})", field="replay")
    order = np.random.default_rng([seed, 11]).permutation(len(asks))
    return [asks[i] for i in order[:n]]


def replay_answer(text: str, finished: bool) -> str | None:
    """What of a replayed answer trains: all of it when the model ended it, else up to its last
    sentence end (a cut answer would teach stopping mid-sentence); None when nothing is left."""
    text = text.strip()
    if finished:
        return text or None
    end = max(text.rfind(mark) for mark in (". ", ".\n", "! ", "!\n", "? ", "?\n"))
    if end < 0:
        return text if text.endswith((".", "!", "?")) else None
    return text[:end + 1]


# -- examples and batches --------------------------------------------------------------------------

def encode_all(chats: list[tuple[str, list[dict]]], template: ChatTemplate, tokenizer,
               max_len: int, skip_invalid: bool) -> tuple[list[Example], list[str]]:
    """(examples cut to max_len tokens, the `where` of each skipped one). Refused, naming the
    example, when an assistant turn cannot be found in the rendering or when the cut leaves no
    trained token; with skip_invalid those are counted and skipped instead."""
    examples, skipped = [], []
    for where, messages in chats:
        try:
            example = encode_example(template, tokenizer, messages, where)
            cut = truncate(example, max_len)
            if cut is None:
                raise BridgeError(f"{where}: no assistant token is left within the first "
                                  f"{max_len} tokens ({len(example.ids)} in all; raise --seq-len)")
        except BridgeError:
            if not skip_invalid:
                raise
            skipped.append(where)
            continue
        examples.append(cut)
    return examples, skipped


def example_batches(examples: list[Example], batch_size: int, seq_len: int, seed: int,
                    process_index: int, pad_id: int, pack: bool,
                    process_count: int = 1) -> data_lib.PackedBatches:
    """The examples as rows of seq_len + 1 tokens: packed whole (each its own segment) or one to
    a row; the loss counts an example's trained tokens only."""
    lengths = np.array([len(e.ids) for e in examples], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return data_lib.PackedBatches(
        np.concatenate([e.ids for e in examples]).astype(np.int32), batch_size, seq_len, seed,
        process_index, pad_id=pad_id, docs=np.stack([starts, lengths], axis=1),
        trained=np.concatenate([e.trained for e in examples]), one_per_row=not pack,
        process_count=process_count)


def unpacked_padding(examples: list[Example], seq_len: int) -> float:
    """The fraction of padding one example to a row would leave."""
    return 1.0 - sum(len(e.ids) for e in examples) / (len(examples) * (seq_len + 1))


def load_chats(sft: SftSpec, seed: int) -> tuple[list, list]:
    """(train chats, eval chats): from the files, or the demo task; without eval data, a seeded
    eval_fraction (at least one) of the training chats is held out."""
    chats = read_chats(sft.data) if sft.data else demo_chats(sft.demo_examples, seed)
    if sft.eval_data:
        return chats, read_chats(sft.eval_data)
    return hold_out(chats, sft.eval_fraction, seed,
                    f"{sft.data}: {len(chats)} conversation; at least two are needed to hold one "
                    f"out (or pass --eval-data)")


def hold_out(items: list, fraction: float, seed: int, too_few: str) -> tuple[list, list]:
    """(kept, held out): a seeded `fraction` (at least one) of the items held out; fewer than two
    items are refused with the message `too_few`."""
    if len(items) < 2:
        raise BridgeError(too_few, field="data")
    n_eval = max(1, int(round(len(items) * fraction)))
    order = np.random.default_rng([seed, 7]).permutation(len(items))
    held = set(order[:n_eval].tolist())
    return ([x for i, x in enumerate(items) if i not in held],
            [x for i, x in enumerate(items) if i in held])


def prompt_key(messages: list[dict]) -> str:
    """A conversation but its last reply, as text: what a held-out question is compared by."""
    import json
    return json.dumps(messages[:-1], sort_keys=True)


def chat_texts(chats) -> list[str]:
    """Every message's content: what a BPE trained for the run reads."""
    return [m["content"] for _, messages in chats for m in messages]


# -- exact match -----------------------------------------------------------------------------------

def exact_match(reply: Callable[[list[list[int]]], list[list[int]]], template: ChatTemplate,
                tokenizer, chats, batch_size: int = 64) -> tuple[float, list[dict]]:
    """(fraction of chats whose greedy reply equals the last assistant message, stripped; one
    record per chat). reply(prompts) -> new ids per prompt, stopped at the end of the turn."""
    prompts = [template.encode(messages[:-1], tokenizer, add_generation_prompt=True)
               for _, messages in chats]
    records, stops = [], set(tokenizer.stop_ids)
    for at in range(0, len(prompts), batch_size):
        for (where, messages), ids in zip(chats[at:at + batch_size],
                                          reply(prompts[at:at + batch_size])):
            ids = ids[:next((i for i, t in enumerate(ids) if t in stops), len(ids))]
            got, want = tokenizer.decode(ids).strip(), messages[-1]["content"].strip()
            records.append({"where": where, "expected": want, "reply": got, "match": got == want})
    return sum(r["match"] for r in records) / max(1, len(records)), records
