"""Text generation for the torch twin: one prefill of the left-padded prompts through a KVCache,
then one decode step per new token. The same semantics as jax_llama.generate, so that greedy
decoding agrees token for token between the twins.

Sampling is a few free functions over logits (B, V); the model knows only how to run a step with
a cache. Axis letters as in torch_llama.model. Quantised projections take the activations chosen
for generation (bridge.int4.generation_activations), as in jax_llama.generate.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from bridge.config import rolling_cache
from bridge.inputs import check_ids, pad_rows, shared_prefix
from bridge.int4 import generation_activations, using_activations
from bridge.sampling import Generation, Sampler, check_generation

from .model import KVCache, Llama


def top_p_mask(probs: torch.Tensor, p: float) -> torch.Tensor:
    """probs (..., V) -> bool (..., V): the smallest set of most likely tokens whose total mass
    reaches p. In descending order a token is kept iff the mass before it is < p, so the token
    that crosses p is kept and the most likely token always is. Equal probabilities keep their
    vocabulary order (stable sort), so ties at the boundary resolve to the lower id."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    # The exclusive cumsum by shifting, not cumsum - probs: the subtraction rounds, and a mass
    # that reaches p exactly (0.5 + 0.3 = 0.8) must not be kept or dropped by rounding.
    cumsum = sorted_probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumsum[..., :1]), cumsum[..., :-1]], dim=-1)
    keep_sorted = mass_before < p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def filter_logits(logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    """logits (..., V) float32 -> the same divided by the temperature, with tokens outside the
    top-k and then outside the top-p set at -inf. Every token tied with the k-th largest logit
    is kept, so the result does not depend on how ties happen to be ordered."""
    if sampler.temperature > 0:
        logits = logits / sampler.temperature
    if 0 < sampler.top_k < logits.shape[-1]:
        kth_largest = logits.topk(sampler.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampler.top_p < 1.0:
        keep = top_p_mask(logits.softmax(dim=-1), sampler.top_p)
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def sample(logits: torch.Tensor, sampler: Sampler,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) float32 -> token ids (B,) int64: the argmax (first maximum on ties) when
    greedy, else one multinomial draw per row from the filtered distribution."""
    if sampler.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, sampler).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


# --8<-- [start:decode]
def generate(model: Llama, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampler: Sampler = Sampler(), stop_ids: Sequence[int] = (), seed: int = 0,
             on_token: Callable[[int, int], None] | None = None, pad_id: int = 0) -> Generation:
    """Continue each prompt (a list of token ids) by up to max_new_tokens tokens.

    Prompts are left-padded with pad_id to the longest, so that the last column holds every
    row's last real token; a prefill fills the cache (in pieces when it is a rolling one: a model
    with a sliding window keeps at most W + chunk - 1 slots however long it generates), then each
    step feeds the B sampled tokens (B, 1). A row stops after sampling a token in stop_ids; the
    loop ends when all have.
    on_token(row, token_id) is called as each token is produced. Runs on the model's device,
    under torch.inference_mode (entered inside, so that a clipping warning points at the caller).
    The prompts are checked on the host, once; the decode steps feed the model's own samples.
    """
    c = model.config
    max_new_tokens = check_generation(prompts, max_new_tokens, c, pad_id)
    B = len(prompts)
    tokens, logprobs = [[] for _ in range(B)], [[] for _ in range(B)]
    tokens_BS, mask_BS = pad_rows(prompts, side="left", pad_id=pad_id)
    check_ids(tokens_BS, c.vocab_size)
    weight = model.norm.weight  # the model's dtype (the embedding may be int8)
    device = weight.device
    stop, done = set(stop_ids), [False] * B
    with torch.inference_mode(), using_activations(generation_activations()):
        cache = KVCache.create(c, B, tokens_BS.shape[1] + max_new_tokens, weight.dtype, device,
                               rolling=True)
        generator = torch.Generator(device=device).manual_seed(seed)
        out = _prefill(model, torch.from_numpy(tokens_BS).long().to(device), cache,
                      torch.from_numpy(mask_BS).to(device))
        for step in range(max_new_tokens):
            logits_BV = out.logits[:, -1]
            next_B = sample(logits_BV, sampler, generator)
            logprob_B = logits_BV.log_softmax(dim=-1).gather(-1, next_B[:, None])[:, 0]
            for row, (token, logprob) in enumerate(zip(next_B.tolist(), logprob_B.tolist())):
                if done[row]:
                    continue
                tokens[row].append(token)
                logprobs[row].append(logprob)
                if on_token is not None:
                    on_token(row, token)
                done[row] = token in stop
            if all(done) or step == max_new_tokens - 1:
                break
            # Finished rows keep decoding (their outputs are dropped): the batch keeps its shape.
            out = model.run(next_B[:, None], cache=cache)
    return Generation(tokens, logprobs)
# --8<-- [end:decode]


def _prefill(model: Llama, tokens_BS: torch.Tensor, cache: KVCache, attention_mask=None):
    """Run tokens (B, S) into `cache` (attention_mask (B, S), 1 = real, as in Llama.run) -> the
    LlamaOutput of the last call: one call, or pieces of cache.chunk tokens for a rolling cache,
    which takes no more at once."""
    S = tokens_BS.shape[1]
    piece = cache.chunk or S
    for i in range(0, S, piece):
        out = model.run(tokens_BS[:, i:i + piece], cache=cache, attention_mask=(
            None if attention_mask is None else attention_mask[:, i:i + piece]))
    return out


# -- a cache kept between replies (chat) -----------------------------------------------------------

class ChatSession:
    """One conversation's KV cache, kept between replies, so that a reply prefills only the ids
    its prompt does not share with those already in the cache: jax_llama's ChatSession, with the
    same attributes (`cached`, `prefilled`, `reused`) and the same rules. The cache holds the ids
    of the last prompt and of its reply but the last token; cutting it back to the ids a new
    prompt shares with them is moving its index (one row, no padding: slot i holds id i). A
    rolling cache (sliding window W) is cut back only while it still holds the W - 1 slots before
    the cut, which the new tokens attend; otherwise the prompt is prefilled from scratch."""

    def __init__(self, model: Llama, max_new_tokens: int, sampler: Sampler = Sampler(),
                 stop_ids: Sequence[int] = (), seed: int = 0):
        self.model, self.max_new_tokens, self.sampler = model, max_new_tokens, sampler
        self.stop_ids = tuple(stop_ids)
        device = model.norm.weight.device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.cache: KVCache | None = None
        self.cached: list[int] = []
        self.prefilled = self.reused = 0

    def forget(self) -> None:
        """Drop the cache: the next reply prefills its whole prompt."""
        self.cache, self.cached = None, []

    def reply(self, ids: Sequence[int],
              on_token: Callable[[int, int], None] | None = None) -> list[int]:
        """Continue `ids` -> the new ids (up to and including a stop id); on_token(0, id) hears
        each as it is produced. An interrupted reply (KeyboardInterrupt) leaves no cache behind."""
        c, ids = self.model.config, [int(i) for i in ids]
        limit = check_generation([ids], self.max_new_tokens, c)
        check_ids(np.asarray([ids]), c.vocab_size)
        start = min(shared_prefix(self.cached, ids), len(ids) - 1)
        weight = self.model.norm.weight  # the model's dtype (the embedding may be int8)
        need = len(ids) + limit
        cache, self.cache, self.cached = self.cache, None, []  # rebuilt below once the reply ends
        with torch.inference_mode(), using_activations(generation_activations()):
            cache, start = _resume(cache, start, need, c, weight)
            out = _prefill(self.model, torch.tensor([ids[start:]], device=weight.device), cache)
            new = []
            for step in range(limit):
                token = int(sample(out.logits[:, -1], self.sampler, self.generator)[0])
                new.append(token)
                if on_token is not None:
                    on_token(0, token)
                if token in self.stop_ids or step == limit - 1:
                    break
                out = self.model.run(torch.tensor([[token]], device=weight.device), cache=cache)
        self.cache, self.cached = cache, ids + new[:-1]
        self.prefilled, self.reused = len(ids) - start, start
        return new


def _resume(cache: KVCache | None, start: int, need: int, config, weight):
    """A one-row cache cut back to its first `start` slots, with room for `need` -> (the cache,
    the slots it kept). A model with a sliding window keeps one rolling cache of a fixed size,
    started afresh (start 0) when it no longer holds the W - 1 slots before `start`; a plain cache
    too short for `need` is copied into a longer one (at least twice as long)."""
    if rolling_cache(config, config.max_seq_len) is not None:
        first_needed = max(start - config.sliding_window + 1, 0)
        if cache is not None and first_needed < cache.index - cache.length:
            cache = None  # the ring has overwritten slots the new tokens would attend
        if cache is None:
            cache, start = KVCache.create(config, 1, config.max_seq_len, weight.dtype,
                                          weight.device, rolling=True), 0
    elif cache is None or cache.length < need:
        grown = KVCache.create(config, 1, max(need, 2 * (cache.length if cache else 0)),
                               weight.dtype, weight.device)
        if cache is not None:
            grown.k[:, :, :, :start], grown.v[:, :, :, :start] = (
                cache.k[:, :, :, :start], cache.v[:, :, :, :start])
        else:
            start = 0
        cache = grown
    held_T = cache.slots  # the slot in each entry
    if held_T is None:
        held_T = torch.arange(cache.length, device=weight.device)
    cache.valid[:] = ((held_T >= 0) & (held_T < start))[None]  # slots past `start`: invalid
    cache.index = start
    cache.positions.fill_(start)
    return cache, start
