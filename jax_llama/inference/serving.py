"""Continuous batching for a server: requests join and leave one KV cache of `max_batch` rows.

A request is prefilled alone, exactly as `generate` prefills a prompt alone (the same program, the
same cache length), and its prompt's keys and values are then copied into a free row of the shared
cache, in the slots that end where the other rows are writing. Every step then decodes one token
for every active row at once; a row that stops (a stop id, its max_tokens, a cancel) is free for the
next waiting request at the next step. Each row keeps its own RoPE positions and valid slots (the
cache's per-row masks), so a row sees only its own tokens, as it would alone: a greedy answer is
the same token for token as `generate` gives for that prompt by itself.

Sampling takes each row's own temperature, top-k and top-p as values, not as compiled constants,
so requests with different settings share one program; a sampled row draws from a key made from
its own seed and its step, so that a seed gives the same answer whatever else is in the batch.

The slots of the shared cache are used in order; when the last is reached, each row's valid slots
are moved to the front (`_compact`), the order of its tokens kept.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from bridge.errors import BridgeError
from bridge.inputs import pad_rows
from bridge.int4 import generation_activations

from ..model.inputs import bucket
from ..model.llama import KVCache
from .generate import first_max, run_model, top_p_mask

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class Token:
    """One new token of a request: its id, its log-probability under the raw model, and the
    `top_logprobs` most likely ids with theirs (empty when none were asked for)."""
    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Request:
    """What a row decodes. on_token(Token) hears each new token, then on_finish(reason) once:
    "stop" (a stop id was produced; it is the last token heard), "length" (max_tokens reached),
    "cancelled" or "error: ..."; both are called on the engine's thread."""
    prompt: list[int]
    max_tokens: int
    on_token: Callable[[Token], None]
    on_finish: Callable[[str], None]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    top_logprobs: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    produced: int = 0


# -- compiled pieces -------------------------------------------------------------------------------

def _row_keys(seeds_B, steps_B):
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), t))(
        seeds_B, steps_B)


@functools.partial(jax.jit, static_argnames=("n_top",))
def _pick_rows(logits_BV, seeds_B, steps_B, temperature_B, top_k_B, top_p_B, *, n_top: int):
    """Each row's token (greedy where its temperature is 0, else temperature, top-k with ties at
    the k-th kept, top-p, as bridge.sampling.Sampler describes), its log-probability under the
    raw model, and the n_top most likely (ids, log-probabilities)."""
    logits_BV = logits_BV.astype(jnp.float32)
    logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    greedy_B = first_max(logits_BV)

    def sampled(_):
        scaled_BV = logits_BV / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
        V = scaled_BV.shape[-1]
        ordered_BV = -jnp.sort(-scaled_BV, axis=-1)
        kth_B = jnp.take_along_axis(ordered_BV, jnp.clip(top_k_B - 1, 0, V - 1)[:, None], axis=-1)
        kth_B = jnp.where(top_k_B[:, None] > 0, kth_B, -jnp.inf)
        scaled_BV = jnp.where(scaled_BV < kth_B, -jnp.inf, scaled_BV)
        keep_BV = top_p_mask(jax.nn.softmax(scaled_BV, axis=-1), top_p_B[:, None])
        scaled_BV = jnp.where(keep_BV | (top_p_B[:, None] >= 1), scaled_BV, -jnp.inf)
        keys = _row_keys(seeds_B, steps_B)
        draw_B = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, scaled_BV)
        return jnp.where(temperature_B > 0, draw_B.astype(jnp.int32), greedy_B)

    token_B = jax.lax.cond(jnp.any(temperature_B > 0), sampled, lambda _: greedy_B, None)
    logprob_B = jnp.take_along_axis(logp_BV, token_B[:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.top_k(logp_BV, max(n_top, 1))
    return token_B, logprob_B, top_ids, top_vals


@functools.partial(jax.jit, static_argnames=("model", "cache_len", "activations"))
def _prefill_alone(params, tokens_1P, mask_1P, *, model, cache_len: int, activations: str):
    """A left-padded prompt into a fresh one-row cache of cache_len slots, as generate's prefill
    does it -> (the cache, the last position's logits (1, V)). activations: as generate's."""
    cache = KVCache.create(model.config, 1, cache_len, model.dtype)
    out = run_model(model, params, activations, tokens_1P, attention_mask=mask_1P, cache=cache,
                    head_at=jnp.full((1, 1), tokens_1P.shape[1] - 1))
    return out.cache, out.logits[:, -1]


@functools.partial(jax.jit, static_argnames=("P",), donate_argnames=("cache",))
def _splice(cache: KVCache, row_cache: KVCache, row, start, *, P: int) -> KVCache:
    """Row `row` of `cache` becomes row_cache's first P slots, at slots [start, start + P)."""
    k = jax.lax.dynamic_update_slice(cache.k, row_cache.k[:, :, :, :P], (0, row, 0, start, 0))
    v = jax.lax.dynamic_update_slice(cache.v, row_cache.v[:, :, :, :P], (0, row, 0, start, 0))
    valid = cache.valid.at[row].set(False)
    valid = jax.lax.dynamic_update_slice(valid, row_cache.valid[:, :P], (row, start))
    return cache.replace(k=k, v=v, valid=valid,
                         positions=cache.positions.at[row].set(row_cache.positions[0]),
                         index=jnp.maximum(cache.index, start + P))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _compact(cache: KVCache) -> KVCache:
    """Each row's valid slots moved to the front, in their order; index after the longest."""
    order_BT = jnp.argsort(~cache.valid, axis=1, stable=True)
    take = lambda x: jnp.take_along_axis(x, order_BT[None, :, None, :, None], axis=3)
    valid = jnp.take_along_axis(cache.valid, order_BT, axis=1)
    return cache.replace(k=take(cache.k), v=take(cache.v), valid=valid,
                         index=jnp.max(valid.sum(axis=1)).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("length",))
def _grow(cache: KVCache, *, length: int) -> KVCache:
    """The cache with invalid (zero) slots added at the end, up to `length`."""
    more = length - cache.length
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, more), (0, 0)])
    return cache.replace(k=pad(cache.k), v=pad(cache.v),
                         valid=jnp.pad(cache.valid, [(0, 0), (0, more)]))


@functools.partial(jax.jit, static_argnames=("model", "activations"),
                   donate_argnames=("cache",))
def _step(params, cache: KVCache, token_B, active_B, *, model, activations: str):
    """One token for every row: active rows write it into the cache and advance; the others
    write an invalid slot -> (the cache, the logits (B, V))."""
    out = run_model(model, params, activations, token_B[:, None],
                    attention_mask=active_B[:, None], cache=cache)
    return out.cache, out.logits[:, 0]


# -- the engine ------------------------------------------------------------------------------------

class Engine:
    """Decodes the requests submitted to it on a thread of its own, up to max_batch at once over a
    cache of max_len slots a row (a prompt and its new tokens must fit: check() says)."""

    def __init__(self, model, params, max_batch: int = 8, max_len: int | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise BridgeError(f"must be a positive integer (got {max_batch!r})", field="max_batch")
        self.model, self.params, self.max_batch = model, params, max_batch
        # chosen here, in the caller's context: the engine's thread starts without it
        self.activations = generation_activations()
        self.max_len = min(max_len or model.config.max_seq_len, model.config.max_seq_len)
        self._waiting: queue.Queue[Request] = queue.Queue()
        self._rows: list[Request | None] = [None] * max_batch
        self._cache: KVCache | None = None
        self._token_B = np.zeros(max_batch, np.int32)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0             # decode steps run (each for every active row)
        self.batch_sizes: list[int] = []  # active rows at each step

    # -- the caller's side

    def check(self, prompt_len: int, max_tokens: int) -> int:
        """max_tokens clipped so that the prompt and its new tokens fit a row; refused when the
        prompt leaves no room for one."""
        if prompt_len < 1:
            raise BridgeError("the prompt is empty", field="prompt")
        room = self.max_len - prompt_len
        if room < 1:
            raise BridgeError(f"{prompt_len} prompt tokens leave no room for a new one in the "
                              f"context of {self.max_len}", field="prompt")
        return min(max_tokens, room)

    def submit(self, request: Request) -> None:
        request.max_tokens = self.check(len(request.prompt), request.max_tokens)
        if request.top_logprobs > MAX_TOP_LOGPROBS:
            raise BridgeError(f"at most {MAX_TOP_LOGPROBS}", field="top_logprobs")
        self._start()
        self._waiting.put(request)
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def active(self) -> int:
        return sum(r is not None for r in self._rows)

    # -- the engine's thread

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jax-llama-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit()
                if self.active:
                    self._decode_step()
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
            except Exception as e:  # noqa: BLE001 - every request hears it; the engine goes on
                message = f"error: {type(e).__name__}: {e}"
                for i, r in enumerate(self._rows):
                    if r is not None:
                        self._finish(i, message)
                self._cache = None

    def _admit(self) -> None:
        while None in self._rows:
            try:
                request = self._waiting.get_nowait()
            except queue.Empty:
                return
            if request.cancelled.is_set():
                request.on_finish("cancelled")
                continue
            row = self._rows.index(None)
            try:
                self._prefill(row, request)
            except Exception as e:  # noqa: BLE001
                self._rows[row] = None
                request.on_finish(f"error: {type(e).__name__}: {e}")

    def _prefill(self, row: int, request: Request) -> None:
        config = self.model.config
        P = bucket(len(request.prompt), config.max_seq_len - request.max_tokens)
        cache_len = bucket(P + request.max_tokens, config.max_seq_len)
        cache_len = max(cache_len, P + request.max_tokens)
        tokens, mask = pad_rows([request.prompt], P, side="left")
        row_cache, logits = _prefill_alone(self.params, tokens, mask, model=self.model,
                                           cache_len=cache_len, activations=self.activations)
        index = self._room(P, 1)
        start = max(index - P, 0)
        self._cache = _splice(self._cache, row_cache, jnp.int32(row), jnp.int32(start), P=P)
        self._rows[row] = request
        self._emit_picked(logits, [row])

    def _emit_picked(self, logits_BV, rows: list[int | None]) -> None:
        """Pick each row's token from logits_BV (row j of it is the cache's row rows[j]; None:
        an idle row, whose token is not read) and hand it to its request."""
        reqs = [_IDLE if i is None else self._rows[i] for i in rows]
        n_top = MAX_TOP_LOGPROBS if any(r.top_logprobs for r in reqs) else 0
        token, logprob, top_ids, top_vals = map(np.asarray, _pick_rows(
            logits_BV, np.array([r.seed for r in reqs], np.uint32),
            np.array([r.produced for r in reqs], np.int32),
            np.array([r.temperature for r in reqs], np.float32),
            np.array([r.top_k for r in reqs], np.int32),
            np.array([r.top_p for r in reqs], np.float32), n_top=n_top))
        for j, (i, r) in enumerate(zip(rows, reqs)):
            if i is None:
                continue
            t = int(token[j])
            r.produced += 1
            self._token_B[i] = t
            r.on_token(Token(t, float(logprob[j]), tuple(
                (int(a), float(b)) for a, b in zip(top_ids[j, :r.top_logprobs],
                                                   top_vals[j, :r.top_logprobs]))))
            if t in r.stop_ids:
                self._finish(i, "stop")
            elif r.produced >= r.max_tokens:
                self._finish(i, "length")
            elif r.cancelled.is_set():
                self._finish(i, "cancelled")

    def _room(self, P: int, steps: int) -> int:
        """Make the shared cache hold `steps` more slots after max(index, P): start one (at
        least 256 slots) or, once full, move each row's tokens to the front and, if that is not
        enough, grow it to the next power of two (up to max_len); returns the index. The cache
        is as long as the rows need, so a step reads no more empty slots than it must."""
        if self._cache is None:
            length = min(bucket(max(P + steps, 256), self.max_len), self.max_len)
            self._cache = KVCache.create(self.model.config, self.max_batch, length,
                                         self.model.dtype)
        need = lambda: max(int(self._cache.index), P) + steps
        if need() > self._cache.length:
            self._cache = _compact(self._cache)
        if need() > self._cache.length:
            length = min(bucket(need(), self.max_len), self.max_len)
            if need() > length:
                raise BridgeError(f"the rows need {need()} slots, more than the context of "
                                  f"{self.max_len}")
            self._cache = _grow(self._cache, length=length)
        return int(self._cache.index)

    def _decode_step(self) -> None:
        self._room(0, 1)
        active = np.array([r is not None for r in self._rows])
        self._cache, logits_BV = _step(self.params, self._cache, jnp.asarray(self._token_B),
                                       jnp.asarray(active), model=self.model,
                                       activations=self.activations)
        self.steps += 1
        self.batch_sizes.append(int(active.sum()))
        self._emit_picked(logits_BV, [i if active[i] else None for i in range(self.max_batch)])

    def _finish(self, row: int, reason: str) -> None:
        request, self._rows[row] = self._rows[row], None
        self._token_B[row] = 0
        if not self.active and self._waiting.empty():
            self._cache = None  # the next request starts a short cache again
        request.on_finish(reason)


_IDLE = Request(prompt=[0], max_tokens=1, on_token=lambda t: None, on_finish=lambda r: None)


@functools.partial(jax.jit, static_argnames=("model", "n_top"))
def _prompt_logprobs(params, tokens_1S, mask_1S, *, model, n_top: int):
    logits = model.apply({"params": params}, tokens_1S, attention_mask=mask_1S)
    logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens_1S[0, 1:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.top_k(logp, n_top)
    return chosen, top_ids, top_vals


def prompt_logprobs(model, params, ids: list[int], n_top: int = 1
                    ) -> list[Token | None]:
    """Each prompt token's log-probability given the ones before it, with the n_top most likely
    there (what `echo` with `logprobs` reports, and lm-eval's loglikelihood reads); None for the
    first token, which has no context."""
    if not 1 <= n_top <= MAX_TOP_LOGPROBS:
        raise BridgeError(f"must be in [1, {MAX_TOP_LOGPROBS}] (got {n_top})", field="logprobs")
    S = bucket(len(ids), model.config.max_seq_len)
    tokens, mask = pad_rows([ids], S)
    chosen, top_ids, top_vals = map(np.asarray, _prompt_logprobs(
        params, tokens, mask, model=model, n_top=MAX_TOP_LOGPROBS))
    return [None] + [Token(int(ids[i + 1]), float(chosen[i]), tuple(
        (int(a), float(b)) for a, b in zip(top_ids[i, :n_top], top_vals[i, :n_top])))
        for i in range(len(ids) - 1)]
