"""Sampling with a KV cache: a compiled prefill, then the whole decode loop as one compiled call.

Prompts are left-padded to a length bucket (a power of two), and the cache to another, so prompts
of different lengths reuse one compilation per (batch size, prompt bucket, cache bucket, sampler):
jax.jit's static arguments are the cache. The prefill writes the prompts into a preallocated KV
cache (layers x batch x kv heads x length x head dim, `lax.dynamic_update_slice`) made on the
device; then `lax.while_loop` runs one cached forward per new token until every row has produced
a stop token or the requested number of tokens is reached. Streaming runs the same loop program
one token per call.

Sampling is a few pure functions of (logits, PRNG key) under a bridge.sampling.Sampler:
temperature (0 = greedy), top-k, top-p; the torch twin implements the same rules.

Quantised projections take the activations chosen for generation (bridge.int4.generation_activations:
the environment's, a caller's using_activations, else bfloat16; int8 weights take bfloat16 or
float32 x, projections.int8_input): each program takes the choice as a static argument, so it is
compiled for the one it runs.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from bridge.config import rolling_cache
from bridge.errors import BridgeError
from bridge.inputs import pad_rows, shared_prefix
from bridge.int4 import generation_activations, using_activations
from bridge.sampling import Generation, Sampler, check_generation

from ..model.inputs import bucket, check_inputs
from ..model.llama import KVCache
from .programs import held, program

_MAX_STOP_IDS = 8  # stop ids travel as a fixed-size array so that their number does not recompile


# -- sampling: pure functions ----------------------------------------------------------------------

def top_p_mask(probs_BV, p: float):
    """True for the smallest set of most probable tokens whose total mass reaches p: in
    descending order a token is kept while the mass before it is still below p, so the token
    that crosses p is kept and the most probable one always is. Ties keep vocabulary order."""
    order_BV = jnp.argsort(-probs_BV, axis=-1, stable=True)
    sorted_BV = jnp.take_along_axis(probs_BV, order_BV, axis=-1)
    # The mass before each token by shifting the cumulative sum, not by cumsum - p: that
    # subtraction rounds, and a mass reaching p exactly (0.5 + 0.3 = 0.8) must not flip.
    cumsum_BV = jnp.cumsum(sorted_BV, axis=-1)
    before_BV = jnp.concatenate([jnp.zeros_like(cumsum_BV[:, :1]), cumsum_BV[:, :-1]], axis=-1)
    keep_sorted_BV = before_BV < p
    return jnp.zeros_like(keep_sorted_BV).at[
        jnp.arange(probs_BV.shape[0])[:, None], order_BV].set(keep_sorted_BV)


def filter_logits(logits_BV, sampler: Sampler):
    """Temperature, then top-k (ties at the k-th value kept), then top-p; removed entries -inf."""
    logits_BV = logits_BV.astype(jnp.float32) / sampler.temperature
    if sampler.top_k:
        kth_B1 = jax.lax.top_k(logits_BV, min(sampler.top_k, logits_BV.shape[-1]))[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if sampler.top_p < 1:
        keep_BV = top_p_mask(jax.nn.softmax(logits_BV, axis=-1), sampler.top_p)
        logits_BV = jnp.where(keep_BV, logits_BV, -jnp.inf)
    return logits_BV


def first_max(logits_BV):
    """(B, V) -> (B,) int32: the index of each row's first maximum (of its first NaN, if it has
    one), as jnp.argmax, in passes that XLA:CPU vectorises: the maximum and whether there is a
    NaN, then the least index holding it. jnp.argmax's one pass over (value, index) pairs does not
    vectorise: 330-350 against 180-250 us over SmolLM2's 49,152 logits, about 1% of a decode step.
    (XLA:CPU's vectorised maximum may skip a NaN, hence the NaN pass of its own.)"""
    V = logits_BV.shape[-1]
    nan_BV = jnp.isnan(logits_BV)
    top_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    hit_BV = jnp.where(jnp.any(nan_BV, axis=-1, keepdims=True), nan_BV, logits_BV == top_B1)
    return jnp.min(jnp.where(hit_BV, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def sample(logits_BV, key, sampler: Sampler):
    """(B, V) logits -> (B,) token ids. Greedy takes the first maximum."""
    if sampler.temperature == 0:
        return first_max(logits_BV)
    return jax.random.categorical(key, filter_logits(logits_BV, sampler), axis=-1).astype(jnp.int32)


# -- the compiled loop -----------------------------------------------------------------------------

class Decoding(struct.PyTreeNode):
    """The state of a generation between compiled calls: everything stays on the device."""

    step: jax.Array       # () int32: new tokens produced so far
    cache: KVCache
    token_B: jax.Array    # (B,) int32: the last token of each row (0 once the row is done)
    done_B: jax.Array     # (B,) bool: the row has produced a stop token
    tokens_BN: jax.Array  # (B, N) int32: the new tokens, 0 after a row's stop
    logprobs_BN: jax.Array  # (B, N) float32
    key: jax.Array


def _pick(logits_BV, key, sampler: Sampler, tempered: bool = False):
    """(token (B,), its log-probability (B,)): under the raw model, or, tempered, under
    log_softmax(logits / temperature) over the whole vocabulary (TRL's convention for GRPO:
    top-k and top-p choose the draw, not the probability)."""
    token_B = sample(logits_BV, key, sampler)
    if tempered and sampler.temperature > 0:
        logits_BV = logits_BV.astype(jnp.float32) / sampler.temperature
    logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    return token_B, jnp.take_along_axis(logp_BV, token_B[:, None], axis=-1)[:, 0]


def _emit(d: Decoding, token_B, logprob_B, stop_ids) -> Decoding:
    """Record token_B as new token number d.step of every row not done before it."""
    token_B = jnp.where(d.done_B, 0, token_B)
    return d.replace(step=d.step + 1, token_B=token_B,
                     done_B=d.done_B | jnp.isin(token_B, stop_ids),
                     tokens_BN=d.tokens_BN.at[:, d.step].set(token_B),
                     logprobs_BN=d.logprobs_BN.at[:, d.step].set(
                         jnp.where(d.done_B, 0.0, logprob_B)))


def run_model(model, params, activations: str, tokens, **kwargs):
    """model.run on `tokens` (a LlamaOutput), its 4-bit projections taking `activations`: a
    static argument of the generation program tracing it, so that each choice is compiled apart
    (bridge.int4.generation_activations)."""
    with using_activations(activations):
        return model.apply({"params": params}, tokens, method="run", **kwargs)


# --8<-- [start:decode]
@functools.partial(jax.jit, static_argnames=("model", "sampler", "cache_len", "tempered",
                                             "activations"))
def _prefill(params, tokens_BP, mask_BP, stop_ids, key, *, model, sampler, cache_len,
             tempered=False, activations="float32") -> Decoding:
    """Write the left-padded prompts into a fresh cache and choose each row's first new token.
    The cache is made here, on the device: it never exists on the host. `activations`: how
    4-bit projections take their input (bridge.int4.generation_activations)."""
    B, P = tokens_BP.shape
    n_max = cache_len - P
    cache = KVCache.create(model.config, B, cache_len, model.dtype, rolling=True)
    out = _prefill_in_chunks(model, params, activations, tokens_BP, mask_BP, cache)
    key, sub = jax.random.split(key)
    # left padding: the last column is real
    token_B, logprob_B = _pick(out.logits[:, -1], sub, sampler, tempered)
    start = Decoding(step=jnp.zeros((), jnp.int32), cache=out.cache, token_B=token_B,
                     done_B=jnp.zeros((B,), bool), tokens_BN=jnp.zeros((B, n_max), jnp.int32),
                     logprobs_BN=jnp.zeros((B, n_max), jnp.float32), key=key)
    return _emit(start, token_B, logprob_B, stop_ids)


def _prefill_in_chunks(model, params, activations: str, tokens_BP, mask_BP, cache: KVCache):
    """The left-padded prompts written into `cache` -> the LlamaOutput of their last tokens
    (logits (B, 1, V): the head projects the last column alone, as llama.cpp's prompt does). A
    rolling cache (a sliding window) takes at most `cache.chunk` tokens a call: a longer prompt
    goes in chunks, padded further on the left to a whole number of them, one scanned step each."""
    B, P = tokens_BP.shape
    C = cache.chunk
    last = jnp.full((B, 1), min(P, C or P) - 1)  # the logits of the last column only
    if C is None or P <= C:
        return run_model(model, params, activations, tokens_BP, attention_mask=mask_BP, cache=cache,
                         head_at=last)
    n = -(-P // C)
    pad = ((0, 0), (n * C - P, 0))
    tokens_BnC = jnp.pad(tokens_BP, pad).reshape(B, n, C)
    mask_BnC = jnp.pad(jnp.asarray(mask_BP, bool), pad).reshape(B, n, C)

    def chunk(cache, inputs):
        tokens_BC, mask_BC = inputs
        out = run_model(model, params, activations, tokens_BC, attention_mask=mask_BC,
                        cache=cache, lm_head=False)
        return out.cache, None

    cache, _ = jax.lax.scan(chunk, cache, (tokens_BnC[:, :-1].swapaxes(0, 1),
                                           mask_BnC[:, :-1].swapaxes(0, 1)))
    return run_model(model, params, activations, tokens_BnC[:, -1], attention_mask=mask_BnC[:, -1],
                     cache=cache, head_at=last)


@functools.partial(jax.jit, static_argnames=("model", "sampler", "tempered", "activations"),
                   donate_argnames=("d",))
def _decode(params, d: Decoding, until, stop_ids, *, model, sampler, tempered=False,
            activations="float32"):
    """One cached forward per new token while d.step < until and some row is not done -> (the
    state, its last tokens (B,), its done flags (B,)). The state is donated: XLA updates the
    cache in place. The last tokens and flags come back apart from it, so that a streaming caller
    can read them while the next call, to which the state is donated, already runs."""

    def body(d: Decoding) -> Decoding:
        out = run_model(model, params, activations, d.token_B[:, None], cache=d.cache)
        key, sub = jax.random.split(d.key)
        token_B, logprob_B = _pick(out.logits[:, 0], sub, sampler, tempered)
        return _emit(d.replace(cache=out.cache, key=key), token_B, logprob_B, stop_ids)

    d = jax.lax.while_loop(lambda d: (d.step < until) & ~jnp.all(d.done_B), body, d)
    return d, d.token_B, d.done_B
# --8<-- [end:decode]


def compilations() -> int:
    """How many prefill programs this process holds (one per batch size, prompt bucket, cache
    bucket and sampler): jax.jit's own cache, and those kept on disk (.programs)."""
    return _prefill._cache_size() + held("prefill")


def generate(model, params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampler: Sampler = Sampler(), stop_ids: Sequence[int] = (), seed: int = 0,
             on_token: Callable[[int, int], None] | None = None, key=None,
             tempered_logprobs: bool = False) -> Generation:
    """Continue each prompt (a list of ids) by up to max_new_tokens ids.

    key: the PRNG key of the draws (default jax.random.key(seed)). tempered_logprobs: each
    token's log-probability under log_softmax(logits / temperature), as GRPO's trainer
    recomputes it, rather than the raw model's.

    A batch is left-padded, so each row gives the tokens it would give alone. on_token(row, id)
    is called as each token is produced (streaming): the compiled decode loop then runs one
    token per call and returns to the host between tokens, the same program either way.
    """
    config = model.config
    prompts = [list(map(int, p)) for p in prompts]
    max_new_tokens = check_generation(prompts, max_new_tokens, config)
    if len(stop_ids) > _MAX_STOP_IDS:
        raise BridgeError(f"at most {_MAX_STOP_IDS} (got {len(stop_ids)})", field="stop_ids")
    longest = max(map(len, prompts))

    P = bucket(longest, config.max_seq_len - max_new_tokens)
    cache_len = bucket(P + max_new_tokens, config.max_seq_len)
    if cache_len < P + max_new_tokens:  # the cap bit: fall back to the exact size
        cache_len = P + max_new_tokens
    tokens, mask = pad_rows(prompts, P, side="left")
    check_inputs(tokens, config.vocab_size)  # on the host, once, before the compiled calls
    stops = np.full((_MAX_STOP_IDS,), -1, np.int32)
    stops[:len(stop_ids)] = stop_ids
    static = dict(model=model, sampler=sampler, tempered=tempered_logprobs,
                  activations=generation_activations())
    key = jax.random.key(seed) if key is None else key
    args = (params, tokens, mask, stops, key)
    d = program(_prefill, "prefill", args, dict(cache_len=cache_len, **static))(*args)
    decode = functools.partial(program, _decode, "decode", (params, d, jnp.int32(1), stops), static)
    if on_token is None:
        d = decode()(params, d, jnp.int32(max_new_tokens), stops)[0]
    else:
        d = _stream(params, d, max_new_tokens, stops, decode, on_token, len(prompts))
    out_tokens, out_logprobs = np.asarray(d.tokens_BN), np.asarray(d.logprobs_BN)
    result = Generation([], [])
    for row in range(len(prompts)):
        ids = out_tokens[row, :max_new_tokens].tolist()
        hits = [j for j, t in enumerate(ids) if t in set(stop_ids)]
        n = hits[0] + 1 if hits else len(ids)
        result.tokens.append(ids[:n])
        result.logprobs.append(out_logprobs[row, :n].tolist())
    return result


def _stream(params, d: Decoding, max_new_tokens: int, stops, decode: Callable[[], Callable],
            on_token: Callable[[int, int], None], rows: int) -> Decoding:
    """Decode one token per call of _decode's program (`decode()`, asked for once the first
    token is out), calling on_token(row, id) for each row not done before it. Token k is read on the host while the call for token k + 1 already runs (JAX dispatches
    asynchronously), so the host's per-token work - dispatch, the copy, on_token - overlaps the
    device's. The first token is read before any call: it is reported at once."""
    reported = np.zeros(rows, bool)  # done before the token being reported

    def report(token_B, done_B) -> bool:
        nonlocal reported
        token_B, done_B = np.asarray(token_B), np.asarray(done_B)
        for row in np.flatnonzero(~reported):
            on_token(int(row), int(token_B[row]))
        reported = done_B
        return bool(reported.all())

    if report(d.token_B, d.done_B) or max_new_tokens == 1:
        return d
    decode = decode()
    d, token_B, done_B = decode(params, d, jnp.int32(2), stops)
    for step in range(2, max_new_tokens + 1):
        # the next token's call goes first; where this one ends the generation it is a no-op
        ahead = (decode(params, d, jnp.int32(step + 1), stops)
                 if step < max_new_tokens else None)
        if report(token_B, done_B) or ahead is None:
            return d if ahead is None else ahead[0]
        d, token_B, done_B = ahead
    return d



# -- a cache kept between replies (chat) -----------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("model", "sampler", "n_max", "activations"))
def _extend(params, cache: KVCache, start, tokens_1S, n, stop_ids, key, *, model, sampler,
            n_max: int, activations="float32") -> Decoding:
    """Keep the cache's first `start` slots, write the first n of tokens_1S (right-padded to a
    bucket) after them, and choose the first new token from the logits of token n - 1. The cache
    holds one row whose slots are its tokens in order, so cutting it back is setting its index."""
    T, S = cache.length, tokens_1S.shape[1]
    held_T = jnp.arange(T) if cache.slots is None else cache.slots  # a rolling cache's slots
    cache = cache.replace(index=start, valid=((held_T >= 0) & (held_T < start))[None],
                          positions=jnp.full((1,), start, jnp.int32))
    valid_1S = (jnp.arange(S) < n)[None]
    out = run_model(model, params, activations, tokens_1S, attention_mask=valid_1S, cache=cache,
                    head_at=jnp.full((1, 1), n - 1, jnp.int32))
    key, sub = jax.random.split(key)
    token_B, logprob_B = _pick(out.logits[:, 0], sub, sampler)
    # the padding's slots are free again: the next token is written right after the n
    cache = out.cache.replace(index=start + n)
    begin = Decoding(step=jnp.zeros((), jnp.int32), cache=cache, token_B=token_B,
                     done_B=jnp.zeros((1,), bool), tokens_BN=jnp.zeros((1, n_max), jnp.int32),
                     logprobs_BN=jnp.zeros((1, n_max), jnp.float32), key=key)
    return _emit(begin, token_B, logprob_B, stop_ids)


def _grown(cache: KVCache, length: int) -> KVCache:
    """The cache with `length` slots, its contents kept in the first ones."""
    more = length - cache.length
    slots = ((0, 0),) * 3 + ((0, more), (0, 0))
    return cache.replace(k=jnp.pad(cache.k, slots), v=jnp.pad(cache.v, slots),
                         valid=jnp.pad(cache.valid, ((0, 0), (0, more))))


_MIN_CHUNK, _MIN_SLOTS = 64, 1024


class ChatSession:
    """One conversation's KV cache, kept between replies, so that a reply prefills only the ids
    its prompt does not share with those already in the cache.

    `reply(ids, on_token)` continues `ids` (the whole conversation so far, as
    tasks.conversation.Conversation renders it) up to max_new_tokens ids. The cache holds the ids
    of the last prompt and of its reply but the last token (the decode loop feeds a token only to
    produce the next); a new prompt that starts with all of them prefills only its new ids, one
    that differs earlier (a template that renders earlier turns differently, dropped turns, a
    reply tokenised differently when read back) prefills from the first id that differs.
    `prefilled` and `reused` say how many of the last prompt's ids took each way. The same decode
    loop as generate(); the cache grows by powers of two as the conversation does.
    """

    def __init__(self, model, params, max_new_tokens: int, sampler: Sampler = Sampler(),
                 stop_ids: Sequence[int] = (), seed: int = 0):
        if len(stop_ids) > _MAX_STOP_IDS:
            raise BridgeError(f"at most {_MAX_STOP_IDS} (got {len(stop_ids)})", field="stop_ids")
        self.model, self.params, self.sampler = model, params, sampler
        self.max_new_tokens, self.stop_ids = max_new_tokens, tuple(stop_ids)
        self.stops = np.full((_MAX_STOP_IDS,), -1, np.int32)
        self.stops[:len(stop_ids)] = stop_ids
        self.key = jax.random.key(seed)
        self.cache: KVCache | None = None
        self.cached: list[int] = []  # the ids whose keys and values the cache holds, in order
        self.prefilled = self.reused = 0

    def forget(self) -> None:
        """Drop the cache: the next reply prefills its whole prompt."""
        self.cache, self.cached = None, []

    def reply(self, ids: Sequence[int],
              on_token: Callable[[int, int], None] | None = None) -> list[int]:
        """Continue `ids` -> the new ids (up to and including a stop id). on_token(0, id) hears
        each as it is produced (the decode then returns to the host after every token). A reply
        interrupted (KeyboardInterrupt) leaves no cache behind: its state was handed to the
        compiled loop, and the next reply prefills from the start."""
        config, ids = self.model.config, [int(i) for i in ids]
        limit = check_generation([ids], self.max_new_tokens, config)
        check_inputs(np.asarray([ids], np.int32), config.vocab_size)
        # at least the last id is prefilled: its logits choose the first new token
        start = min(shared_prefix(self.cached, ids), len(ids) - 1)
        static = dict(model=self.model, sampler=self.sampler,
                      activations=generation_activations())
        rolling = rolling_cache(config, config.max_seq_len) is not None
        if rolling:  # a rolling cache, of a fixed size; a long turn goes in in chunks
            start = self._rolling(start)
            chunk = self.cache.chunk
        reused = start
        while rolling and len(ids) - start > chunk:
            d = self._extend(ids, start, chunk, chunk, static)
            self.cache, start = d.cache, start + chunk
        n = len(ids) - start
        # Few shapes, so few programs: each new one costs seconds to compile, and still one or
        # two to load from the persistent compilation cache in a new process. A turn's new ids
        # (the end of the last reply, the user's turn, the assistant's header) mostly fit one
        # chunk of _MIN_CHUNK; the cache starts at _MIN_SLOTS, enough for several turns, and the
        # decode kernels skip its empty slots.
        S = bucket(max(n, _MIN_CHUNK), max(n, config.max_seq_len))
        if rolling:
            S = max(n, min(S, chunk))
        need = max(start + S, len(ids) + self.max_new_tokens)
        if not rolling and (self.cache is None or self.cache.length < need):
            length = max(need, bucket(max(need, _MIN_SLOTS), config.max_seq_len))
            self.cache = (KVCache.create(config, 1, length, self.model.dtype) if self.cache is None
                          else _grown(self.cache, length))
        d = self._extend(ids, start, n, S, static)
        decode = functools.partial(program, _decode, "decode",
                                   (self.params, d, jnp.int32(1), self.stops), static)
        if on_token is None:
            d = decode()(self.params, d, jnp.int32(limit), self.stops)[0]
        else:
            d = _stream(self.params, d, limit, self.stops, decode, on_token, 1)
        steps = int(d.step)
        new = np.asarray(d.tokens_BN)[0, :steps].tolist()
        hits = [j for j, t in enumerate(new) if t in set(self.stop_ids)]
        new = new[:hits[0] + 1] if hits else new
        self.cache, self.cached = d.cache, ids + new[:steps - 1]
        self.prefilled, self.reused = len(ids) - reused, reused
        return new

    def _rolling(self, start: int) -> int:
        """Where the next prompt starts prefilling with a rolling cache (made here when there is
        none): at `start` while the cache still holds the W - 1 slots before it, else at 0 in a
        fresh cache (the conversation was cut back further than its window)."""
        config = self.model.config
        held_from = len(self.cached) - self.cache.length if self.cache is not None else 0
        if max(start - config.sliding_window + 1, 0) < held_from:
            self.forget()
        if self.cache is None:
            self.cache = KVCache.create(config, 1, config.max_seq_len, self.model.dtype,
                                        rolling=True)
            start = 0
        return start

    def _extend(self, ids: list[int], start: int, n: int, S: int, static: dict) -> Decoding:
        """Prefill ids[start:start + n] (right-padded to S) after the cache's first `start` slots
        -> the Decoding that chooses the next token. The cache is handed on (donated)."""
        tokens = np.zeros((1, S), np.int32)
        tokens[0, :n] = ids[start:start + n]
        self.key, key = jax.random.split(self.key)
        cache, self.cache, self.cached = self.cache, None, []  # handed on: donated below
        args = (self.params, cache, jnp.int32(start), tokens, jnp.int32(n), self.stops, key)
        return program(_extend, "extend", args, dict(n_max=self.max_new_tokens, **static))(*args)
