"""Supervised fine-tuning on conversations (`jax-llama sft`): chats rendered with the model's own
chat template, the loss on the assistant's tokens only, whole conversations packed into rows.

The rendering and the mask are bridge.chat's (framework-neutral); here the examples become the
batches of SftRecipe, the recipe the training loop runs, and a held-out set is scored by exact
match of greedy replies. With no data, `demo_chats` makes a small instruction task with exact
answers, so that the command shows learning on any machine with nothing downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import jax
import numpy as np

from bridge.chat import ChatTemplate

from tasks.chats import Example, encode_example, read_chats, truncate
from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.formats import Checkpoint
from bridge.progress import bar as progress_bar

from bridge.atomic import write_text

from ..checkpoint import load as load_checkpoint
from . import data as data_lib
from .lm import NextTokenRecipe
from .recipe import plot_losses
from .inputs import open_init, run_config, run_tokenizer
from .spec import RunSpec, SftSpec
from .state import say

if TYPE_CHECKING:
    from .step import TrainConfig


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
                tokenizer, chats, batch_size: int = 64,
                progress: bool = False) -> tuple[float, list[dict]]:
    """(fraction of chats whose greedy reply equals the last assistant message, stripped; one
    record per chat). reply(prompts) -> new ids per prompt, stopped at the end of the turn.
    progress: a bar over the batches on stderr."""
    prompts = [template.encode(messages[:-1], tokenizer, add_generation_prompt=True)
               for _, messages in chats]
    records, stops = [], set(tokenizer.stop_ids)
    for at in progress_bar(range(0, len(prompts), batch_size), desc="exact match (greedy)",
                           unit="batch", leave=False, enabled=progress):
        for (where, messages), ids in zip(chats[at:at + batch_size],
                                          reply(prompts[at:at + batch_size])):
            ids = ids[:next((i for i, t in enumerate(ids) if t in stops), len(ids))]
            got, want = tokenizer.decode(ids).strip(), messages[-1]["content"].strip()
            records.append({"where": where, "expected": want, "reply": got, "match": got == want})
    return sum(r["match"] for r in records) / max(1, len(records)), records


# -- the recipe's inputs, read and checked before the run writes anything -------------------------

@dataclass
class ChatInputs:
    """An SFT run's inputs, all checked before the run writes anything: the tokenizer, the model
    config, the chat template, and the conversations encoded with their assistant-only masks."""

    spec: RunSpec
    tokenizer: object
    config: LlamaConfig
    template: object                 # bridge.chat.ChatTemplate
    examples: list                   # tasks.chats.Example, cut to seq_len + 1 tokens
    eval_examples: list
    eval_chats: list                 # (where, messages) of the held-out conversations
    skipped: list[str]
    train_prompts: set[str]          # each training conversation but its last reply, as JSON

    def batches(self, tc: TrainConfig, local_batch: int, pack: bool):
        args = (local_batch, tc.seq_len, tc.seed, jax.process_index(), self.tokenizer.pad_id or 0, pack,
                jax.process_count())
        batches = example_batches(self.examples, *args)
        val_batches = example_batches(self.eval_examples, *args[:2], tc.seed + 1, *args[3:])
        trained = int(sum(e.trained.sum() for e in self.examples))
        total = int(sum(len(e.ids) for e in self.examples))
        say(f"{len(self.examples):,} conversations ({len(self.eval_examples):,} held out"
             f"{f', {len(self.skipped):,} skipped' if self.skipped else ''}): {total:,} tokens, "
             f"{trained:,} of them trained (the assistant's)")
        unpacked = unpacked_padding(self.examples, tc.seq_len)
        if pack:
            say(f"packed into {len(batches.rows):,} rows: {batches.padding():.1%} padding "
                 f"(one conversation a row: {unpacked:.1%})")
        else:
            say(f"one conversation a row: {unpacked:.1%} padding (--pack would save most of it)")
        # The baseline: a unigram model of the trained tokens.
        targets = np.concatenate([e.ids[e.trained] for e in self.examples])
        held = np.concatenate([e.ids[e.trained] for e in self.eval_examples])
        return batches, val_batches, data_lib.unigram_loss(targets, held, self.config.vocab_size)

    def exact_match(self, model, params, limit: int = 200) -> dict:
        """Greedy replies to (up to `limit` of) the held-out conversations against their last
        assistant message."""
        from bridge.sampling import Sampler

        from ..inference.generate import generate

        chats = self.eval_chats[:limit]
        longest = max(len(self.tokenizer.encode(m[-1]["content"])) for _, m in chats)

        def reply(prompts):
            room = self.config.max_seq_len - max(map(len, prompts))
            return generate(model, params, prompts, max(1, min(longest + 4, room)), Sampler(),
                            self.tokenizer.stop_ids).tokens
        score, records = exact_match(reply, self.template, self.tokenizer, chats,
                                     progress=self.spec.progress)
        for record, (_, messages) in zip(records, chats):
            record["seen_in_training"] = prompt_key(messages) in self.train_prompts
        unseen = [r["match"] for r in records if not r["seen_in_training"]]
        result = {"exact_match": score, "n": len(chats),
                  "unseen_exact_match": float(np.mean(unseen)) if unseen else None,
                  "n_unseen": len(unseen), "replies": records}
        say(f"exact match on {len(chats)} held-out conversations: {score:.1%}"
             + (f" ({result['unseen_exact_match']:.1%} on the {len(unseen)} whose question is "
                f"not in the training set)" if unseen else ""))
        return result

    def sample(self, scores: dict) -> str:
        return "\n".join(f"{r['where']}: {r['expected']!r} -> {r['reply']!r}"
                         for r in scores["replies"][:5])


def sft_inputs(spec: RunSpec, init: Checkpoint | None = None) -> ChatInputs:
    """Read, render and check an SFT run's conversations (refusing, naming the example, what
    cannot train), with the tokenizer and template they need. `init`: the --init checkpoint
    already opened (inputs.open_init), else opened here; its tokenizer, config, chat template
    and (for replay) weights are read from that one opening."""
    from bridge.chat import find_template

    sft = spec.sft
    chats, eval_chats = load_chats(sft, spec.train.seed)
    if init is None:
        init = open_init(spec)
    tokenizer = run_tokenizer(spec, init, lambda: chat_texts(chats),
                              f"the {len(chats):,} conversations")
    config = run_config(spec, init, tokenizer)
    template_from = spec.out if spec.resume else init
    template = find_template(template_from, tokenizer, None if spec.resume else sft.chat_template)
    max_len = spec.train.seq_len + 1
    if sft.replay:
        chats = chats + replay_chats(spec, tokenizer, template, init)
    examples, skipped = encode_all(chats, template, tokenizer, max_len, sft.skip_invalid)
    eval_examples, eval_skipped = encode_all(eval_chats, template, tokenizer, max_len,
                                                     sft.skip_invalid)
    if not examples or not eval_examples:
        raise BridgeError(f"no {'training' if not examples else 'held-out'} conversation is "
                          f"left to train on", field="data")
    kept = {where for where, _ in eval_chats} - set(eval_skipped)
    return ChatInputs(spec, tokenizer, config, template, examples, eval_examples,
                      [c for c in eval_chats if c[0] in kept], skipped + eval_skipped,
                      {prompt_key(messages) for _, messages in chats})


def replay_chats(spec: RunSpec, tokenizer, template,
                 init: Checkpoint | None = None) -> list[tuple[str, list[dict]]]:
    """The --init model's own greedy answers to spec.sft.replay general prompts, as chats
    (where: replay:N): trained on beside the data, they keep the model answering other requests
    as it did, where a narrow task alone teaches its style to every reply. The same every time
    (greedy), so a resumed run trains on the same chats. `init`: the --init checkpoint already
    opened, its weights read from that opening (else from spec.init)."""
    from tasks.prompts import stop_ids as tokenizer_stops

    from ..inference.generate import generate

    sft = spec.sft
    if not spec.init:
        raise BridgeError("needs --init: the answers replayed are the starting model's own",
                          field="replay")
    prompts = general_prompts(sft.replay, spec.train.seed)
    model, params = load_checkpoint(spec.init if init is None else init, dtype="float32",
                                    attention=spec.attention)
    stops = list(tokenizer_stops(tokenizer))
    ids = [template.encode([{"role": "user", "content": p}], tokenizer, add_generation_prompt=True)
           for p in prompts]
    chats, dropped, batch = [], 0, 32
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    answers: dict[int, str | None] = {}
    for start in progress_bar(range(0, len(order), batch),
                              desc=f"replay: {spec.init}'s own answers", unit="batch",
                              leave=False, enabled=spec.progress):
        rows = order[start:start + batch]
        out = generate(model, params, [ids[i] for i in rows], sft.replay_tokens,
                       stop_ids=stops).tokens
        for i, tokens in zip(rows, out):
            finished = bool(tokens) and tokens[-1] in stops
            answers[i] = replay_answer(
                tokenizer.decode([t for t in tokens if t not in stops]), finished)
    for i, prompt in enumerate(prompts):
        if answers[i] is None:
            dropped += 1
            continue
        chats.append((f"replay:{i + 1}", [{"role": "user", "content": prompt},
                                          {"role": "assistant", "content": answers[i]}]))
    say(f"replay: {len(chats)} of the starting model's own answers join the training chats"
         + (f" ({dropped} left out: cut at {sft.replay_tokens} tokens before any sentence ended)"
            if dropped else ""))
    return chats


def exact_match_scalars(scores: dict) -> dict:
    """exact_match()'s figures, without the replies and counts, for the tracker."""
    return {k: scores[k] for k in ("exact_match", "unseen_exact_match")}


class SftRecipe(NextTokenRecipe):
    """`jax-llama sft` as a recipe (jax_llama.training.recipe): the conversations' tokens with
    the assistant-only mask, next-token cross-entropy on them, the held-out chats' loss at each
    evaluation; exact match of greedy replies before and after (exact_match.json)."""

    title = "SFT"
    scalars = staticmethod(exact_match_scalars)  # the before/after scores' figures

    def inputs(self, init) -> None:
        # every conversation is read, rendered and checked before anything is written
        self.chat = sft_inputs(self.spec, init)
        self.tokenizer, self.config = self.chat.tokenizer, self.chat.config
        self.template = self.chat.template

    def batches(self, local_batch: int) -> None:
        self.train_batches, self.val_batches, self.unigram = self.chat.batches(
            self.tc, local_batch, self.spec.pack)

    def scores(self, model, params) -> dict:
        return self.chat.exact_match(model, params)

    def results(self, out, model, params, scores: dict, summary: dict, tracker) -> dict:
        summary["plot"] = plot_losses(out, self.unigram)
        write_text(out / "exact_match.json", json.dumps(scores, indent=2) + "\n")
        after = scores["after"]
        summary["exact_match"] = {k: v["exact_match"] for k, v in scores.items()}
        summary["unseen_exact_match"] = after["unseen_exact_match"]
        summary["n_unseen"] = after["n_unseen"]
        summary["n_eval"] = after["n"]
        summary["sample"] = self.chat.sample(after)
        return summary
