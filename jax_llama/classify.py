"""Sequence classification with a LLaMA: the classifier, prediction, and zero-shot prompting.

The classifier is `LlamaClassifier` (backbone + head on the last real token) with its labels and
tokenizer; its backbone comes from any checkpoint the bridge reads, or is initialised at random
with a BPE trained on the training texts. Fine-tuning it is a training recipe
(jax_llama.training.finetune).

Zero-shot scores each label word as a continuation of a prompt: the summed log-probability of all
of the word's tokens. Each text is run once, into a KV cache that the later tokens of the longer
label words read (see continuation_logprobs).

The classifier directory (tasks.classification) is a native checkpoint plus the head, so the
torch twin loads it too (torch_llama.load_classifier).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bridge.chat import ChatTemplate, own_template
from tasks.classification import (DEFAULT_TEMPLATE, encode_texts, read_head,
                                   truncate_left, write_head)
from bridge.config import LlamaConfig
from bridge.dtypes import numpy_dtype
from bridge.errors import BridgeError
from bridge.inputs import length_batches, pad_rows
from bridge.lora import LoraConfig
from bridge.progress import bar as progress_bar
from bridge.tokenizer import Tokenizer, find_tokenizer

from .model.attention import choose
from .checkpoint import load as load_checkpoint
from .checkpoint import save as save_native
from .lora import add_lora, merge_lora, save_adapter
from .model.heads import Blocks, LlamaClassifier
from .model.inputs import bucket
from .model.llama import KVCache, init


# ----------------------------------------------------------------------------- the classifier

@dataclass
class Classifier:
    """A LlamaClassifier with its params, its labels, tokenizer and text length, and the LM head
    it does not use (kept to be saved back). torch_llama.Classifier is its twin (no params: a
    torch module holds its own)."""

    model: LlamaClassifier
    params: dict
    labels: list[str]
    tokenizer: Tokenizer
    max_len: int                         # tokens per text, BOS and EOS included
    lm_output: np.ndarray | None = None  # the untied LM head's kernel, carried unchanged
    chat_template: ChatTemplate | None = None  # the backbone's own, carried unchanged

    def save(self, path: str | Path, meta: dict | None = None, overwrite: bool = True) -> Path:
        """The classifier directory: native checkpoint of the backbone + head + tokenizer."""
        import tempfile

        model, params = merge_lora(self.model, self.params)
        lm_params = dict(params["llama"])
        if self.lm_output is not None:
            lm_params["output"] = {"kernel": self.lm_output}
        head = params["classifier"]
        info = {"labels": self.labels, "max_len": self.max_len, "dropout": self.model.dropout,
                **(meta or {})}

        def write_extra(directory: Path) -> None:
            write_head(directory, np.asarray(head["kernel"]).T, np.asarray(head["bias"]), info)
            if self.model.projections.lora is not None:  # the backbone's adapter too (PEFT)
                save_adapter(directory / "adapter", self.model, self.params)

        with tempfile.TemporaryDirectory() as tok_dir:
            files = self.tokenizer.save(tok_dir)
            if self.chat_template is not None:  # so that the backbone chats as it did
                files = [*files, self.chat_template.save(tok_dir)]
            save_native(path, model.config, lm_params, overwrite=overwrite, extra_files=files,
                        write_extra=write_extra)
        return Path(path)


def backbone_params(lm_params: dict) -> tuple[dict, np.ndarray | None]:
    """LM params -> (the backbone the classifier uses, the untied LM head's kernel or None)."""
    lm_params = dict(lm_params)
    output = lm_params.pop("output", None)
    return lm_params, None if output is None else np.asarray(output["kernel"])


def new_classifier(config: LlamaConfig, labels: list[str], tokenizer: Tokenizer, max_len: int,
                   dropout: float, seed: int, lm_params: dict | None = None,
                   attention: str = "auto", lora: LoraConfig | None = None) -> Classifier:
    """A classifier with a fresh head on `lm_params` (LM params, e.g. from jax_llama.load), or on
    a randomly initialised backbone when None; with `lora`, fresh adapters on the backbone (which
    fine-tuning then trains with the head, the backbone's weights frozen)."""
    choose(attention, 1, 1)
    model = LlamaClassifier(config, len(labels), dropout, attention=attention)
    tokens, mask = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)
    params = jax.jit(model.init)(jax.random.key(seed), tokens, mask)["params"]
    if lm_params is None:
        lm_params = init(config, seed=seed)[1]
    backbone, output = backbone_params(lm_params)
    params = {"llama": backbone, "classifier": params["classifier"]}
    if lora is not None:
        model, params = add_lora(model, params, lora, seed=seed)
    return Classifier(model, params, labels, tokenizer, max_len, output)


def load_classifier(path: str | Path, dtype=None, attention: str = "auto",
                    kernels: str = "auto") -> Classifier:
    """A classifier directory written by `finetune` (or Classifier.save); attention and kernels
    as in jax_llama.load."""
    model_lm, lm_params = load_checkpoint(path, dtype=dtype, attention=attention, kernels=kernels)
    meta, weight, bias = read_head(path, model_lm.config)
    dtype = model_lm.dtype
    backbone, output = backbone_params(lm_params)
    head = {"kernel": jnp.asarray(weight.T, dtype), "bias": jnp.asarray(bias, dtype)}
    model = LlamaClassifier(model_lm.config, len(meta["labels"]), float(meta.get("dropout", 0.0)),
                            dtype=dtype, param_dtype=dtype, attention=attention,
                            projections=model_lm.projections)
    return Classifier(model, {"llama": backbone, "classifier": head}, list(meta["labels"]),
                      find_tokenizer(str(path), None), int(meta["max_len"]), output,
                      own_template(path))


def predict_ids(clf: Classifier, rows: list[list[int]], batch_size: int = 64,
                progress: bool = False, frozen: FrozenFeatures | None = None) -> np.ndarray:
    """Log-probabilities (N, C) for token rows (each at most clf.max_len long); with `frozen`
    (the rows' hidden states leaving the frozen blocks), only the blocks above run."""
    lengths = np.array([len(r) for r in rows])
    out = np.zeros((len(rows), len(clf.labels)), np.float32)
    batches = length_batches(lengths, batch_size, None)
    for idx in progress_bar(batches, desc="predict", unit="batch", leave=False, enabled=progress):
        length = bucket(int(lengths[idx].max()), clf.max_len)
        tokens, mask = pad_rows([rows[i] for i in idx], length, batch_size=batch_size)
        if frozen is None:
            logp = _log_probs(clf.params, tokens, mask, model=clf.model)
        else:
            logp = _log_probs(clf.params, frozen.batch(idx, length, batch_size), mask,
                              model=frozen.model)
        out[idx] = np.asarray(logp)[:len(idx)]
    return out


def predict(clf: Classifier, texts: list[str], batch_size: int = 64, progress: bool = False):
    """(predicted label indices (N,), log-probabilities (N, C), texts cut to max_len)."""
    rows, cut = encode_texts(clf.tokenizer, texts, clf.max_len)
    logp = predict_ids(clf, rows, batch_size, progress)
    return logp.argmax(-1), logp, cut


@functools.partial(jax.jit, static_argnames="model")
def _log_probs(params, tokens_BS, mask_BS, *, model: LlamaClassifier):
    """(B, C) log-probabilities, without dropout; compiled once per (model, batch shape)."""
    return model.apply({"params": params}, tokens_BS, mask_BS)


@dataclass
class FrozenFeatures:
    """Texts' hidden states leaving the frozen lower blocks of a classifier (each text's length
    x D, in the model's dtype), and the classifier that runs from them: the same params, only
    the blocks above (LlamaClassifier.first_layer). The lower blocks and the embedding get no
    update when only the top blocks train, and the backbone has no dropout, so their output is
    the same in every epoch: computing it once saves their forward pass at every step."""

    model: LlamaClassifier
    rows: list[np.ndarray]

    @classmethod
    def compute(cls, clf: Classifier, rows: list[list[int]], first_layer: int,
                batch_size: int = 64, desc: str = "frozen blocks",
                progress: bool = True) -> FrozenFeatures:
        m = clf.model
        lower = Blocks(m.config, 0, first_layer, m.dtype, m.param_dtype, m.attention,
                       m.projections)
        run = jax.jit(lambda params, tokens, mask: lower.apply({"params": params}, tokens, mask))
        lengths = np.array([len(r) for r in rows])
        features: list[np.ndarray | None] = [None] * len(rows)
        for idx in progress_bar(length_batches(lengths, batch_size, None), desc=desc,
                                unit="batch", leave=False, enabled=progress):
            tokens, mask = pad_rows([rows[i] for i in idx],
                                    bucket(int(lengths[idx].max()), clf.max_len),
                                    batch_size=batch_size)
            x_BSD = np.asarray(run(clf.params["llama"], tokens, mask))
            for j, i in enumerate(idx):
                features[i] = x_BSD[j, :lengths[i]].copy()
        return cls(m.clone(first_layer=first_layer), features)

    @staticmethod
    def nbytes(clf: Classifier, rows: list[list[int]]) -> int:
        """What compute() keeps for these rows."""
        return (sum(map(len, rows)) * clf.model.config.dim
                * np.dtype(numpy_dtype(clf.model.dtype)).itemsize)

    def batch(self, idx: np.ndarray, length: int, batch_size: int) -> np.ndarray:
        """(batch_size, length, D): the rows `idx`, right-padded with zeros (as pad_rows pads
        their tokens; filler rows all zeros)."""
        first = self.rows[int(idx[0])]
        x_BSD = np.zeros((batch_size, length, first.shape[1]), first.dtype)
        for j, i in enumerate(idx):
            x_BSD[j, :len(self.rows[i])] = self.rows[i]
        return x_BSD


# ----------------------------------------------------------------------------- zero-shot

def fill_template(template: str, text: str, labels: list[str] | None = None) -> str:
    """The template with {text} replaced by the text and {labels}, if there, by the label words
    ("a, b or c")."""
    if "{text}" not in template:
        raise BridgeError(f"must contain {{text}} (got {template!r})", field="template")
    if labels is not None and "{labels}" in template:
        words = ", ".join(labels[:-1]) + " or " + labels[-1] if len(labels) > 1 else labels[0]
        template = template.replace("{labels}", words)
    return template.replace("{text}", text)


def zero_shot_rows(tokenizer: Tokenizer, texts: list[str], labels: list[str], template: str,
                   max_len: int, chat: ChatTemplate | None = None
                   ) -> tuple[list[list[int]], list[list[int]], int]:
    """(prompt ids per text, continuation ids per label, prompts cut). A label is continued
    after a space unless the prompt already ends in whitespace. Prompt and label are tokenized
    apart, so a BPE merge across their boundary is never taken: the label's tokens are the same
    after every prompt. With `chat`, the filled template is the user's turn, rendered up to the
    assistant's reply, which the label word begins (no space); a prompt too long loses the start
    of its text. Otherwise a prompt too long is cut from the left (keeping BOS)."""
    space = "" if chat is not None or template.endswith((" ", "\n", "\t")) else " "
    continuations = [tokenizer.encode(space + label) for label in labels]
    if min(map(len, continuations)) == 0:
        raise BridgeError("labels: a label word encodes to no tokens")
    room = max_len - max(map(len, continuations))
    if room < 2:
        raise BridgeError(f"{max_len} tokens leave no room for a prompt before the labels",
                          field="max_len")
    bos = tokenizer.add_bos
    prompts, cut = [], 0
    for text in texts:
        if chat is None:
            ids, was_cut = truncate_left(tokenizer.encode(fill_template(template, text, labels),
                                                          bos=bos), room,
                                         tokenizer.bos_id if bos else None)
        else:
            ids, was_cut = _chat_prompt(chat, tokenizer, template, text, labels, room)
        prompts.append(ids)
        cut += was_cut
    return prompts, continuations, cut


def _chat_prompt(chat: ChatTemplate, tokenizer: Tokenizer, template: str, text: str,
                 labels: list[str], room: int) -> tuple[list[int], bool]:
    """(ids, cut): the user turn fill_template(template, text, labels) rendered up to the
    assistant's reply, the text losing tokens from its start until the prompt fits in `room`."""
    def render(body: str) -> list[int]:
        return chat.encode([{"role": "user", "content": fill_template(template, body, labels)}],
                           tokenizer, add_generation_prompt=True)
    ids = render(text)
    if len(ids) <= room:
        return ids, False
    words = tokenizer.encode(text)
    keep = len(words) - (len(ids) - room)
    while keep > 0:
        ids = render(tokenizer.decode(words[len(words) - keep:]))
        if len(ids) <= room:
            return ids, True
        keep -= max(1, len(ids) - room)
    raise BridgeError(f"{room} tokens leave no room for the chat template's own tokens",
                      field="max_len")


def continuation_logprobs(model, params, prompts: list[list[int]], continuations: list[list[int]],
                          batch_size: int = 64, progress: bool = False) -> np.ndarray:
    """(N, C): log p(continuation c | prompt n), summed over all of c's tokens.

    Each prompt is run once, left-padded in a batch of similar lengths, into a KV cache: every
    continuation's first token is scored at the prompt's last position (the only one that goes
    through the vocabulary projection), and the later tokens of the continuations longer than
    one token run on that cache, one continuation after another, never the prompt again. With
    single-token label words zero-shot costs one forward pass of each text, whatever the labels."""
    lengths = np.array([len(p) for p in prompts])
    cap = max(int(lengths.max()), 16)
    conts = tuple(tuple(int(t) for t in c) for c in continuations)
    scores = np.zeros((len(prompts), len(continuations)), np.float64)
    for idx in progress_bar(length_batches(lengths, batch_size, None), desc="zero-shot",
                            unit="batch", leave=False, enabled=progress):
        S = bucket(int(lengths[idx].max()), cap)
        tokens, mask = pad_rows([prompts[i] for i in idx], S, side="left", batch_size=batch_size)
        got = np.asarray(_label_logprobs(params, tokens, mask, model=model, continuations=conts))
        scores[idx] = got[:len(idx)]
    return scores


@functools.partial(jax.jit, static_argnames=("model", "continuations"))
def _label_logprobs(params, tokens_BS, mask_BS, *, model, continuations):
    """(B, C) summed log-probability of each continuation after each left-padded prompt."""
    B, S = tokens_BS.shape
    firsts_C = jnp.asarray([c[0] for c in continuations])
    longer = [c for c in continuations if len(c) > 1]
    L = max((len(c) for c in longer), default=1) - 1  # the later tokens of the longest
    cache = KVCache.create(model.config, B, S + L, model.dtype) if longer else None
    out = model.apply({"params": params}, tokens_BS, attention_mask=mask_BS, cache=cache,
                      head_at=jnp.full((B, 1), S - 1), method="run")
    scores_BC = jax.nn.log_softmax(out.logits[:, 0], axis=-1)[:, firsts_C]
    if not longer:
        return scores_BC
    # each longer continuation: its tokens but the last as inputs on the prompts' cache, scored
    # on its tokens but the first; padded to L (padding comes after, so nothing real sees it)
    inputs_ML = np.zeros((len(longer), L), np.int32)
    targets_ML = np.zeros((len(longer), L), np.int32)
    real_ML = np.zeros((len(longer), L), bool)
    for m, c in enumerate(longer):
        inputs_ML[m, :len(c) - 1], targets_ML[m, :len(c) - 1] = c[:-1], c[1:]
        real_ML[m, :len(c) - 1] = True

    def rest(args):
        inputs_L, targets_L, real_L = args
        logits_BLV = model.apply({"params": params}, jnp.broadcast_to(inputs_L, (B, L)),
                                 cache=out.cache, method="run").logits
        logp_BL = jnp.take_along_axis(jax.nn.log_softmax(logits_BLV, axis=-1),
                                      jnp.broadcast_to(targets_L, (B, L))[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(real_L, logp_BL, 0.0), axis=-1)
    rest_MB = jax.lax.map(rest, (jnp.asarray(inputs_ML), jnp.asarray(targets_ML),
                                 jnp.asarray(real_ML)))
    where = [i for i, c in enumerate(continuations) if len(c) > 1]
    return scores_BC.at[:, jnp.asarray(where)].add(rest_MB.T)


def zero_shot(model, params, tokenizer: Tokenizer, texts: list[str], labels: list[str],
              template: str = DEFAULT_TEMPLATE, max_len: int | None = None,
              batch_size: int = 64, progress: bool = False, calibrate: bool = False,
              chat: ChatTemplate | None = None):
    """(predicted label indices (N,), scores (N, C), prompts truncated).

    chat: ask through this chat template (see zero_shot_rows); the label word begins the reply,
    as given or capitalized (a reply starts a sentence): a label's score is the log of the sum
    of both spellings' probabilities.

    calibrate: subtract each label's score after the template around an empty text, the
    model's prior for the label word in that place (contextual calibration, Zhao et al. 2021);
    without it a small model tends to answer its most frequent label word for every text."""
    max_len = min(max_len or model.config.max_seq_len, model.config.max_seq_len)
    prompts, continuations, cut = zero_shot_rows(tokenizer, texts, labels, template, max_len,
                                                 chat)
    owners = list(range(len(labels)))  # the label each continuation spells
    if chat is not None:
        for i, word in enumerate(labels):
            capital = word[:1].upper() + word[1:]
            if capital != word:
                continuations.append(tokenizer.encode(capital))
                owners.append(i)
        if max(map(len, continuations)) + max(map(len, prompts)) > max_len:
            raise BridgeError(f"{max_len} tokens leave no room for the capitalized label words",
                              field="max_len")

    def label_scores(rows: list[list[int]], show: bool) -> np.ndarray:
        raw = continuation_logprobs(model, params, rows, continuations, batch_size, show)
        out = np.full((len(rows), len(labels)), -np.inf)
        for column, i in enumerate(owners):
            out[:, i] = np.logaddexp(out[:, i], raw[:, column])
        return out
    scores = label_scores(prompts, progress)
    if calibrate:
        empty, _, _ = zero_shot_rows(tokenizer, [""], labels, template, max_len, chat)
        scores = scores - label_scores(empty, False)
    return scores.argmax(-1), scores, cut
