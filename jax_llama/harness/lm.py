"""The lm-evaluation-harness model `jax-llama`: lm-eval's three request kinds answered by this
package's forward pass (loglikelihood), tasks.evaluation's sliding windows (loglikelihood_rolling)
and the KV-cache sampler (generate_until).

    lm_eval.simple_evaluate(model="jax-llama", model_args="pretrained=runs/main/model",
                            tasks=["hellaswag"], batch_size=8)

Importing this module registers the name (lm-eval 0.4 finds models in its registry only; it does
not scan entry points). Tokenization follows lm-eval's `hf` model on the converted checkpoint:
lm_eval's TemplateLM splits a (context, continuation) pair the way HFLM does - trailing spaces of
the context moved to the continuation, the pair encoded jointly and cut at the context's length -
and `tok_encode` adds BOS as a Hugging Face LLaMA tokenizer does by default, so per-example
log-likelihoods agree with `--model hf` to float32 rounding (tests/test_harness.py).
"""

from __future__ import annotations

import logging
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
# The built-in names go into lm-eval's registry before ours: its get_model fills the registry
# with them only while the registry is empty, so registering first would hide `hf` and the rest.
import lm_eval.models  # noqa: F401
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from tqdm import tqdm

from bridge.errors import BridgeError
from tasks.evaluation import Document, window_settings
from bridge.formats import open_checkpoint
from bridge.sampling import Sampler
from bridge.tokenizer import find_tokenizer

from ..checkpoint import load
from ..model.inputs import bucket
from ..eval import evaluate, token_log_probs
from ..inference.generate import _MAX_STOP_IDS, generate

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256  # as lm-eval's hf model


def continuation_scores(model, params, tokens_BS, targets_BS, weights_BS, last_B):
    """From log_softmax of the float32 logits: ((B,) float32 sum of the weighted targets'
    log-probabilities, (B,) bool: every weighted target is the argmax, (B, V) float32 the
    log-probabilities at each row's position last_B). tokens, targets (B, S) int32; weights
    (B, S) float32, 1 on the continuation's positions but its last, else 0; last_B (B,) int32,
    the position that predicts the continuation's last token: the rows that differ only in that
    token share one row (lm-eval's multiple choice with one-token answers: one row per question)."""
    logp_BSV, logp_BS = token_log_probs(model, params, tokens_BS, targets_BS)
    greedy_BS = jnp.argmax(logp_BSV, axis=-1) == targets_BS  # as lm-eval's hf model: of log_softmax
    return (jnp.sum(logp_BS * weights_BS, axis=-1),
            jnp.all(greedy_BS | (weights_BS == 0), axis=-1),
            logp_BSV[jnp.arange(logp_BSV.shape[0]), last_B])


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """text up to the earliest occurrence of any (non-empty) stop string."""
    ends = [text.find(s) for s in stops if s]
    return text[:min([e for e in ends if e >= 0], default=len(text))]


def _int_arg(value, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise BridgeError(f"expected an integer (got {value!r})", field=name) from None
    if number < 1:
        raise BridgeError(f"must be a positive integer (got {value!r})", field=name)
    return number


@register_model("jax-llama")
class JaxLlamaLM(TemplateLM):
    """lm-eval's LM over a jax_llama checkpoint. Arguments (lm-eval's `--model_args`):
    pretrained: any checkpoint jax_llama.load reads; dtype: params and compute dtype (as stored
    when absent; log-probabilities are float32 whatever it is); batch_size: rows per forward
    pass ("auto" = 8); max_length: the context in tokens (the checkpoint's max_seq_len when
    absent); tokenizer: a tokenizer file (else the checkpoint's own); add_bos_token: BOS before
    each encoded text (absent: where the tokenizer adds one, as transformers decides it from the
    same files: bridge.tokenizer.bos_eos);
    stride: loglikelihood_rolling's window stride (absent: max_length // 2, as `jax-llama eval`);
    seed: the sampling seed of generate_until. `device` and `max_batch_size`, which lm-eval
    passes to every model, are ignored: JAX places arrays on its default backend."""

    def __init__(self, pretrained: str, dtype: str | None = None,
                 batch_size: int | str = DEFAULT_BATCH_SIZE, max_length: int | None = None,
                 tokenizer: str | None = None, add_bos_token: bool | None = None,
                 stride: int | None = None, seed: int = 0, device: str | None = None,
                 max_batch_size: int | None = None):
        super().__init__()
        if str(batch_size).startswith("auto"):
            log.warning("batch_size %s: jax-llama has no automatic batch size; using %d",
                        batch_size, DEFAULT_BATCH_SIZE)
            batch_size = DEFAULT_BATCH_SIZE
        self.batch_size = _int_arg(batch_size, "batch_size")
        checkpoint = open_checkpoint(pretrained)  # once: its tokenizer and weights from it
        self.tokenizer_ = find_tokenizer(checkpoint, tokenizer)
        self.model, self.params = load(checkpoint, dtype=dtype)
        config = self.model.config
        self.max_length = (config.max_seq_len if max_length is None
                           else _int_arg(max_length, "max_length"))
        if self.max_length > config.max_seq_len:
            raise BridgeError(f"{self.max_length} is more than the checkpoint's max_seq_len "
                              f"{config.max_seq_len}", field="max_length")
        if self.tokenizer_.vocab_size > config.vocab_size:
            raise BridgeError(f"the tokenizer's {self.tokenizer_.vocab_size} ids do not fit the "
                              f"model's vocab_size {config.vocab_size}", field="tokenizer")
        if add_bos_token is not None and not isinstance(add_bos_token, bool):
            raise BridgeError(f"expected True or False (got {add_bos_token!r})",
                              field="add_bos_token")
        if add_bos_token and self.tokenizer_.bos_id is None:
            raise BridgeError(f"this {self.tokenizer_.kind} tokenizer has no BOS token",
                              field="add_bos_token")
        self.add_bos_token = add_bos_token
        self.seq_len, self.stride = window_settings(
            self.max_length, self.max_length, None if stride is None else _int_arg(stride, "stride"))
        self.seed = int(seed)
        self.pretrained = str(pretrained)
        self._score = jax.jit(lambda p, t, y, w, last: continuation_scores(self.model, p, t, y, w,
                                                                           last))

    # -- tokens ---------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context, and the first window of a rolling text, is conditioned on: BOS,
        or EOS for a tokenizer without one (as lm-eval's hf model)."""
        bos = self.tokenizer_.bos_id
        return self.eot_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        """string -> ids. add_special_tokens None: BOS first per add_bos_token (absent: when the
        tokenizer adds one), unless the string already begins with the BOS text."""
        tok = self.tokenizer_
        if add_special_tokens is None:
            if tok.bos_id is not None and string.startswith(tok.decode([tok.bos_id])):
                return tok.encode(string, allow_special=True)
            add_special_tokens = (tok.add_bos if self.add_bos_token is None
                                  else self.add_bos_token)
        return tok.encode(string, bos=bool(add_special_tokens) and tok.bos_id is not None)

    def tok_decode(self, ids: Sequence[int]) -> str:
        """ids -> text without the special tokens (as lm-eval's hf model decodes generations)."""
        specials = set(self.tokenizer_.special_tokens.values())
        return self.tokenizer_.decode([i for i in ids if i not in specials])

    # -- loglikelihood --------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context ids, continuation ids) -> per request
        (sum of the continuation's log-probabilities, whether greedy decoding gives it), in
        request order. Longest first, batch_size rows per forward pass, each row a context +
        continuation less its last token (left-truncated to max_length), shared by the requests
        that differ only in that last token, padded on the right to a power-of-two length:
        padding comes after every scored position, so under the causal mask it changes nothing."""
        rows = []
        for i, (_, context, continuation) in enumerate(requests):
            if not continuation:
                raise BridgeError(f"request {i}: an empty continuation has nothing to score")
            if len(continuation) > self.max_length:
                raise BridgeError(f"request {i}: its continuation of {len(continuation)} tokens "
                                  f"is longer than max_length {self.max_length}")
            ids = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((ids, len(continuation)))
        shared: dict[tuple, list[int]] = {}  # (input ids, continuation length) -> requests
        for i, (ids, n_cont) in enumerate(rows):
            shared.setdefault((tuple(ids[:-1]), n_cont), []).append(i)
        keys = sorted(shared, key=lambda k: (-len(k[0]), k[0]))
        results: list[tuple[float, bool]] = [None] * len(rows)  # type: ignore[list-item]
        with tqdm(total=len(rows), disable=disable_tqdm, desc="loglikelihood") as bar:
            for start in range(0, len(keys), self.batch_size):
                chunk = keys[start:start + self.batch_size]
                S = bucket(max(len(inputs) for inputs, _ in chunk), self.max_length)
                tokens_BS = np.zeros((self.batch_size, S), np.int32)  # all rows: one B, one program
                targets_BS = np.zeros((self.batch_size, S), np.int32)
                weights_BS = np.zeros((self.batch_size, S), np.float32)
                last_B = np.zeros((self.batch_size,), np.int32)
                for row, (inputs, n_cont) in enumerate(chunk):
                    n = len(inputs)
                    ids = rows[shared[inputs, n_cont][0]][0]
                    tokens_BS[row, :n] = inputs
                    targets_BS[row, :n] = ids[1:]
                    weights_BS[row, n - n_cont:n - 1] = 1.0  # position s predicts ids[s + 1]
                    last_B[row] = n - 1
                logp_B, greedy_B, last_BV = map(np.asarray, self._score(
                    self.params, tokens_BS, targets_BS, weights_BS, last_B))
                for row, key in enumerate(chunk):
                    best = int(np.argmax(last_BV[row]))  # the first maximum, as torch and jnp
                    for i in shared[key]:
                        token = rows[i][0][-1]
                        results[i] = (float(logp_B[row]) + float(last_BV[row, token]),
                                      bool(greedy_B[row]) and best == token)
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
                    bar.update(len(shared[key]))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Per request (text,): the log-likelihood of all of the text's tokens, conditioned on
        prefix_token_id, in `jax-llama eval`'s sliding windows (tasks.evaluation: windows of
        max_length tokens every `stride` tokens, each token scored once). A text that fits one
        window gets exactly lm-eval's hf number; a longer one keeps more context per token than
        hf's disjoint windows, as `jax-llama eval --seq-len max_length --stride stride` does."""
        texts = [req.args[0] for req in requests]
        documents = {i: Document(str(i), np.asarray(
            [self.prefix_token_id] + self.tok_encode(t, add_special_tokens=False), np.int32), 0)
            for i, t in enumerate(texts)}
        documents = {i: d for i, d in documents.items() if len(d.ids) > 1}  # "" scores 0.0
        files = {}
        if documents:
            files = evaluate(self.model, self.params, list(documents.values()), self.seq_len,
                             self.stride, self.batch_size, progress=not disable_tqdm)["files"]
        results = [-files[str(i)]["nll"] if i in documents else 0.0 for i in range(len(texts))]
        for text, result in zip(texts, results):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), result)
        return results

    # -- generation -----------------------------------------------------------------------------

    def _stop_ids(self, stops: Sequence[str]) -> list[int]:
        """The tokenizer's stop ids, then the id of each stop string that is one token, up to
        generate's limit: the compiled loop ends a row on these; the text is cut at the stop
        strings afterwards either way (a stop string spread over tokens only costs steps)."""
        ids = list(self.tokenizer_.stop_ids)
        for s in stops:
            one = self.tokenizer_.encode(s) if s else []
            if len(one) == 1 and one[0] not in ids and len(ids) < _MAX_STOP_IDS:
                ids.append(one[0])
        return ids[:_MAX_STOP_IDS]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Per request (context, gen_kwargs): the continuation, cut at the first `until` string
        (EOS's text always among them). gen_kwargs as lm-eval normalises them: max_gen_toks
        (aliases max_new_tokens, ...), do_sample / temperature (0 = greedy), top_k, top_p.
        Requests with the same gen_kwargs run batch_size at a time, longest context first, the
        context left-truncated so that max_gen_toks new tokens fit max_length."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        results: list[str] = [None] * len(requests)  # type: ignore[list-item]
        eos = self.tokenizer_.decode([self.eot_token_id]) if self.eot_token_id is not None else None
        with tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until") as bar:
            for indices in groups.values():
                kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], DEFAULT_MAX_GEN_TOKS)
                stops = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_gen_toks = int(kwargs.pop("max_gen_toks"))
                if not 0 < max_gen_toks < self.max_length:
                    raise BridgeError(f"max_gen_toks {max_gen_toks} must be from 1 to less than "
                                      f"max_length {self.max_length}")
                sampler = Sampler(temperature=float(kwargs.get("temperature") or 0.0)
                                  if kwargs.get("do_sample") else 0.0,
                                  top_k=int(kwargs.get("top_k") or 0),
                                  top_p=float(kwargs.get("top_p") or 1.0))
                stop_ids = self._stop_ids(stops)
                prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length
                                                                      - max_gen_toks):]
                           for i in indices}
                order = sorted(indices, key=lambda i: (-len(prompts[i]), requests[i].args[0]))
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start:start + self.batch_size]
                    # Full batches only (repeats of the first row), so one program serves all.
                    batch = [prompts[i] for i in chunk]
                    batch += [batch[0]] * (self.batch_size - len(batch))
                    out = generate(self.model, self.params, batch, max_gen_toks, sampler,
                                   stop_ids, seed=self.seed + start)
                    for row, i in enumerate(chunk):
                        results[i] = cut_at_stops(self.tok_decode(out.tokens[row]), stops)
                        self.cache_hook.add_partial("generate_until", requests[i].args,
                                                    results[i])
                    bar.update(len(chunk))
        return results
