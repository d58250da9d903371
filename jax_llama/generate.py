"""Sampling with a KV cache: prefill and the whole decode loop in one jitted function.

Prompts are left-padded to a length bucket (a power of two), and the cache to another, so prompts
of different lengths reuse one compilation per (batch size, prompt bucket, cache bucket, sampler).
Inside, a prefill writes the prompts into a preallocated KV cache (layers x batch x length x kv
heads x head dim, `lax.dynamic_update_slice`), then `lax.while_loop` runs one cached forward per
new token until every row has produced a stop token or max_new_tokens is reached.

Sampling is a few pure functions of (logits, PRNG key) under a bridge.sampling.Sampler:
temperature (0 = greedy), top-k, top-p; the torch twin implements the same rules.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax.experimental import io_callback

from bridge.errors import BridgeError
from bridge.sampling import Generation, Sampler, check_generation

from .model import KVCache, check_inputs

_MIN_BUCKET = 16
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


def sample(logits_BV, key, sampler: Sampler):
    """(B, V) logits -> (B,) token ids. Greedy takes the first maximum."""
    if sampler.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits_BV, sampler), axis=-1).astype(jnp.int32)


# -- the compiled loop -----------------------------------------------------------------------------

def bucket(n: int, cap: int) -> int:
    """The power of two >= n (at least 16), but no more than cap."""
    return min(max(_MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()), cap)


TRACES = {"count": 0}  # how many times the loop was traced (= compiled); tests read it
# The streaming callback of the call in progress: the jitted loop calls this module function, so
# a new callback per call does not make a new compilation.
_STREAM: dict[str, Callable | None] = {"on_token": None}


def _on_step(token_B, done_B) -> None:
    on_token = _STREAM["on_token"]
    for row in np.flatnonzero(~np.asarray(done_B)):
        on_token(int(row), int(token_B[row]))


@functools.partial(jax.jit, static_argnames=("model", "sampler", "cache_len", "stream"))
def _generate(params, tokens_BP, mask_BP, max_new, stop_ids, key, *, model, sampler,
              cache_len, stream: bool):
    TRACES["count"] += 1
    B, P = tokens_BP.shape
    n_max = cache_len - P
    # The cache is made here, inside the compiled function: it is never on the host, and as
    # while-loop state XLA updates it in place (what donating a host-made one would buy).
    cache = KVCache.empty(model.config, B, cache_len, model.dtype)

    def emit(step, token_B, logprob_B, done_B, out):
        tokens_BN, logprobs_BN = out
        token_B = jnp.where(done_B, 0, token_B)
        out = (tokens_BN.at[:, step].set(token_B), logprobs_BN.at[:, step].set(jnp.where(done_B, 0.0, logprob_B)))
        if stream:
            io_callback(_on_step, None, token_B, done_B, ordered=True)
        return out, done_B | jnp.isin(token_B, stop_ids)

    def pick(logits_BV, key):
        token_B = sample(logits_BV, key, sampler)
        logprob_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV, axis=-1), token_B[:, None], axis=-1)[:, 0]
        return token_B, logprob_B

    logits_BPV, cache = model.apply({"params": params}, tokens_BP, attention_mask=mask_BP, cache=cache)
    key, sub = jax.random.split(key)
    token_B, logprob_B = pick(logits_BPV[:, -1], sub)  # left padding: the last column is real
    out = (jnp.zeros((B, n_max), jnp.int32), jnp.zeros((B, n_max), jnp.float32))
    out, done_B = emit(0, token_B, logprob_B, jnp.zeros((B,), bool), out)

    def cond(state):
        step, _, _, done_B, _, _ = state
        return (step < max_new) & ~jnp.all(done_B)

    def body(state):
        step, cache, token_B, done_B, out, key = state
        logits_B1V, cache = model.apply({"params": params}, token_B[:, None], cache=cache)
        key, sub = jax.random.split(key)
        token_B, logprob_B = pick(logits_B1V[:, 0], sub)
        out, new_done_B = emit(step, token_B, logprob_B, done_B, out)
        return step + 1, cache, jnp.where(done_B, 0, token_B), new_done_B, out, key

    step, _, _, _, out, _ = jax.lax.while_loop(cond, body, (1, cache, token_B, done_B, out, key))
    return out[0], out[1], step


def generate(model, params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampler: Sampler = Sampler(), stop_ids: Sequence[int] = (), seed: int = 0,
             on_token: Callable[[int, int], None] | None = None) -> Generation:
    """Continue each prompt (a list of ids) by up to max_new_tokens ids.

    A batch is left-padded, so each row gives the tokens it would give alone. on_token(row, id)
    is called as each token is produced (streaming; it costs a host round trip per step).
    """
    config = model.config
    prompts = [list(map(int, p)) for p in prompts]
    max_new_tokens = check_generation(prompts, max_new_tokens, config)
    if len(stop_ids) > _MAX_STOP_IDS:
        raise BridgeError(f"stop_ids: at most {_MAX_STOP_IDS} (got {len(stop_ids)})")
    longest = max(map(len, prompts))

    P = bucket(longest, config.max_seq_len - max_new_tokens)
    cache_len = bucket(P + max_new_tokens, config.max_seq_len)
    if cache_len < P + max_new_tokens:  # the cap bit: fall back to the exact size
        cache_len = P + max_new_tokens
    tokens = np.zeros((len(prompts), P), np.int32)
    mask = np.zeros((len(prompts), P), bool)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):], mask[i, P - len(p):] = p, True
    check_inputs(tokens, config.vocab_size)  # on the host, before the jitted call
    stops = np.full((_MAX_STOP_IDS,), -1, np.int32)
    stops[:len(stop_ids)] = stop_ids
    _STREAM["on_token"] = on_token
    try:
        out_tokens, out_logprobs, _ = _generate(
            params, tokens, mask, jnp.int32(max_new_tokens), jnp.asarray(stops),
            jax.random.key(seed), model=model, sampler=sampler, cache_len=cache_len,
            stream=on_token is not None)
        out_tokens, out_logprobs = np.asarray(out_tokens), np.asarray(out_logprobs)
    finally:
        _STREAM["on_token"] = None
    result = Generation([], [])
    for row in range(len(prompts)):
        ids = out_tokens[row, :max_new_tokens].tolist()
        hits = [j for j, t in enumerate(ids) if t in set(stop_ids)]
        n = hits[0] + 1 if hits else len(ids)
        result.tokens.append(ids[:n])
        result.logprobs.append(out_logprobs[row, :n].tolist())
    return result
