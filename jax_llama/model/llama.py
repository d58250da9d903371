"""The LLaMA decoder in Flax Linen, top-down in the order of the architecture.

Axis legend (used in einsum strings, shape comments and variable suffixes):
  B batch, S query sequence, T key sequence, D model dim, N query heads, K kv heads,
  G = N/K query heads per kv head, H head dim, h = H/2 rotated pairs, F ffn dim, V vocab, L layers,
  M = B * S tokens (projections run as plain 2-D matmuls, which XLA:CPU does much faster than
  the same contraction over two leading axes).

Parameters live in `param_dtype`, activations in `dtype`; RMSNorm statistics, RoPE rotation,
attention softmax and logits are float32 whatever `dtype` is. Attention itself is one call,
jax_llama.model.attention.attend, whichever implementation runs it (`attention=`).

This file says what the model computes. How a projection x @ W, the embedding and attention
over the KV cache run is the implementation the model is handed, one field, `projections`
(jax_llama.model.projections: the weights' storage, adapters and the CPU decode paths live there).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
from flax import struct
import jax
import jax.numpy as jnp

from bridge.config import LlamaConfig, RopeScaling, rolling_cache
from bridge.dtypes import numpy_dtype
from bridge.errors import BridgeError
from bridge.rope import rope_inv_freq

from .attention import AttentionMask, attend, choose
from .inputs import check_inputs
from .projections import Projections
from .projections import choose as choose_projections

Dtype = Any


# --8<-- [start:rmsnorm]
class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, with the statistics in float32."""

    eps: float = 1e-5
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BSD):
        weight_D = self.param("weight", nn.initializers.ones, (x_BSD.shape[-1],), self.param_dtype)
        x = x_BSD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        return x.astype(self.dtype) * weight_D.astype(self.dtype)
# --8<-- [end:rmsnorm]


# -- rotary position embedding: interleaved pairs (2i, 2i+1), as in Meta's release -----------------

# --8<-- [start:rope]
def rope_cos_sin(positions, inv_freq_h):
    """cos and sin of position * inv_freq, each float32 of shape (B or 1, S, h).

    `positions` (S,) or (B, S) integers; inv_freq_h (h,) from bridge.rope.rope_inv_freq. Only the
    positions given are computed, never a table.
    """
    positions = jnp.asarray(positions)
    if positions.ndim == 1:
        positions = positions[None, :]
    angles_BSh = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_h)
    return jnp.cos(angles_BSh), jnp.sin(angles_BSh)


def rotate(x_BSNH, cos_BSh, sin_BSh):
    """Rotate each pair (x[2i], x[2i+1]) of the last axis by the angle whose cos/sin are given."""
    x = x_BSNH.astype(jnp.float32).reshape(*x_BSNH.shape[:-1], -1, 2)  # (B, S, N, h, 2)
    x_even, x_odd = x[..., 0], x[..., 1]
    cos, sin = cos_BSh[:, :, None, :], sin_BSh[:, :, None, :]          # broadcast over heads
    out = jnp.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], axis=-1)
    return out.reshape(x_BSNH.shape).astype(x_BSNH.dtype)


def apply_rope(x_BSNH, positions, theta: float = 10000.0, scaling: RopeScaling | None = None):
    """RoPE on x (B, S, N, H) at `positions` (S,) or (B, S); returns x's shape and dtype."""
    inv_freq_h = rope_inv_freq(x_BSNH.shape[-1], theta, scaling)
    return rotate(x_BSNH, *rope_cos_sin(positions, inv_freq_h))
# --8<-- [end:rope]


def default_positions(valid_BS, segments_BS=None):
    """(B, S) RoPE positions that count only real tokens (valid_BS True), restarting at 0 where a
    segment begins, so a left-padded row, or a document packed into a row, sees the positions it
    would alone. Segments are contiguous runs of one id."""
    valid_BS = jnp.asarray(valid_BS).astype(jnp.int32)
    seen_BS = jnp.cumsum(valid_BS, axis=-1)                 # real tokens up to and including s
    if segments_BS is None:
        return jnp.maximum(seen_BS - 1, 0)
    S = valid_BS.shape[1]
    starts_BS = jnp.concatenate([jnp.ones_like(segments_BS[:, :1], bool),
                                 segments_BS[:, 1:] != segments_BS[:, :-1]], axis=1)
    start_BS = jax.lax.cummax(jnp.where(starts_BS, jnp.arange(S), 0), axis=1)
    before_BS = jnp.take_along_axis(seen_BS - valid_BS, start_BS, axis=1)  # real tokens before it
    return jnp.maximum(seen_BS - 1 - before_BS, 0)


# -- the key/value cache for generation ----------------------------------------------------------

# --8<-- [start:kv_cache]
class KVCache(struct.PyTreeNode):
    """Keys and values of every layer for T slots, preallocated once per generation.

    Every row writes the same slot at each step (`index`); a row's left padding occupies slots
    marked invalid, so its RoPE positions (`positions`) count real tokens only. Heads come before
    slots, the layout attention reads: with slots first, XLA:CPU transposes the whole cache of
    every layer at every decode step.

    With a sliding window of W, a query never reads a key W positions back, so a long generation
    can keep a rolling cache (create(rolling=True)): T = W + chunk - 1 entries reused in turn,
    entry t holding slot `slots[t]`, and no call writing more than `chunk` tokens at once.
    """

    k: jax.Array          # (L, B, K, T, H) in the compute dtype
    v: jax.Array          # (L, B, K, T, H)
    valid: jax.Array      # (B, T) bool: slots that hold a real (non-padding) token
    index: jax.Array      # () int32: the next slot to write, shared by all rows
    positions: jax.Array  # (B,) int32: the RoPE position of each row's next real token
    slots: jax.Array | None = None  # (T,) int32: a rolling cache's slot in each entry (-1: none)
    window: int | None = struct.field(pytree_node=False, default=None)  # the config's window

    @classmethod
    def create(cls, config: LlamaConfig, batch: int, length: int, dtype=jnp.float32,
               rolling: bool = False) -> "KVCache":
        """A cache of `length` slots, all invalid (zeros: a masked slot must not hold a NaN);
        rolling: as few entries as the model's sliding window needs (bridge.config.rolling_cache),
        where it has one and `length` is longer."""
        ring = rolling_cache(config, length) if rolling else None
        T = length if ring is None else ring[0]
        shape = (config.n_layers, batch, config.n_kv_heads, T, config.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   valid=jnp.zeros((batch, T), bool), index=jnp.zeros((), jnp.int32),
                   positions=jnp.zeros((batch,), jnp.int32),
                   slots=None if ring is None else jnp.full((T,), -1, jnp.int32),
                   window=config.sliding_window)

    @property
    def length(self) -> int:
        """T, the slots (a rolling cache: the entries) it holds."""
        return self.k.shape[3]

    @property
    def chunk(self) -> int | None:
        """The most tokens one call may write: a rolling cache's entries less the W - 1 that
        its first new query reads; None for a plain cache (as many as it has slots)."""
        return None if self.slots is None else self.length - self.window + 1

    def reserve(self, valid_BS):
        """Make room for S new tokens at slots [index, index + S), valid where valid_BS (B, S) is
        -> (the cache with valid, index and positions advanced; the AttentionMask of the new
        queries: each sees the valid slots up to its own, within the window; positions (B, S) of
        the new tokens)."""
        S = valid_BS.shape[1]
        q_slots = self.index + jnp.arange(S, dtype=jnp.int32)
        if self.slots is None:
            valid_BT, slots = jax.lax.dynamic_update_slice(self.valid, valid_BS, (0, self.index)), None
        else:
            if S > self.chunk:
                raise BridgeError(f"{S} tokens in one call, more than the {self.chunk} a rolling "
                                  f"cache of {self.length} entries takes (window "
                                  f"{self.window}): write them in chunks", field="tokens")
            entries = q_slots % self.length
            valid_BT = self.valid.at[:, entries].set(valid_BS)
            slots = self.slots.at[entries].set(q_slots)
        mask = AttentionMask(q_slots=q_slots, valid=valid_BT, k_slots=slots, window=self.window)
        positions_BS = self.positions[:, None] + default_positions(valid_BS)
        advanced = self.replace(valid=valid_BT, slots=slots, index=self.index + S,
                                positions=self.positions + valid_BS.sum(-1).astype(jnp.int32))
        return advanced, mask, positions_BS

    def write(self, layer, k_BKSH, v_BKSH) -> "KVCache":
        """The keys and values of the S tokens reserved last, written into layer `layer` in place:
        slots [index - S, index), or a rolling cache's entries for them."""
        S = k_BKSH.shape[2]
        if self.slots is None:
            start = (layer, 0, 0, self.index - S, 0)
            return self.replace(
                k=jax.lax.dynamic_update_slice(self.k, k_BKSH[None].astype(self.k.dtype), start),
                v=jax.lax.dynamic_update_slice(self.v, v_BKSH[None].astype(self.v.dtype), start))
        entries = (self.index - S + jnp.arange(S)) % self.length
        # indexed by (layer, :, :, entries): the indexed axes come first, (S, B, K, H)
        return self.replace(
            k=self.k.at[layer, :, :, entries].set(k_BKSH.transpose(2, 0, 1, 3).astype(self.k.dtype)),
            v=self.v.at[layer, :, :, entries].set(v_BKSH.transpose(2, 0, 1, 3).astype(self.v.dtype)))
# --8<-- [end:kv_cache]


class LlamaOutput(struct.PyTreeNode):
    """What Llama.run returns, the same in both twins."""

    logits: jax.Array | None       # (B, S, V) float32; None with lm_head=False
    hidden: jax.Array              # (B, S, D) final hidden states (after the last norm), in dtype
    cache: KVCache | None = None   # the cache advanced by these S tokens, when one was given


# -- the transformer -----------------------------------------------------------------------------

def _init(config: LlamaConfig, residual: bool = False):
    """N(0, 0.02); projections that write into the residual stream are scaled by 1/sqrt(2L) so the
    stream's variance does not grow with depth (GPT-2, llama2.c)."""
    std = 0.02 / math.sqrt(2 * config.n_layers) if residual else 0.02
    return nn.initializers.normal(stddev=std)


# --8<-- [start:attention]
class Attention(nn.Module):
    """Grouped-query attention: N query heads share K kv heads in groups of G, without copying K/V.
    `attention` names the implementation (jax_llama.model.attention: xla, chunked, cudnn, splash,
    auto)."""

    config: LlamaConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "auto"
    projections: Projections = Projections()  # how x @ W runs (jax_llama.model.projections)

    @nn.compact
    def __call__(self, x_BSD, cos_BSh, sin_BSh, mask: AttentionMask | None = None,
                 cache: KVCache | None = None, layer=0):
        """x (B, S, D) -> (out (B, S, D), cache).

        mask: which key each query may attend (causal, padding, segments, the sliding window);
        None is causal attention over these S tokens (within the config's window, if any). With a cache (already reserved for these tokens), the new
        keys and values go into slots [index - S, index) of `layer` and the queries read all T
        slots of that layer (attend_cache): each step writes in place and reads once, with no
        copy."""
        c = self.config
        N, K, G, H = c.n_heads, c.n_kv_heads, c.n_groups, c.head_dim
        B, S, D = x_BSD.shape
        x_MD = x_BSD.reshape(B * S, D)  # projections as plain 2-D matmuls (faster on XLA:CPU)
        q_MF, k_MF, v_MF = self.projections.project(self, x_MD, _init(c),
                                                    wq=N * H, wk=K * H, wv=K * H)
        # --8<-- [start:qkv_bias]
        if c.qkv_bias:  # Qwen2: W x + b
            q_MF, k_MF, v_MF = (y + self.param(f"w{n}_bias", nn.initializers.zeros,
                                               (y.shape[-1],), self.param_dtype).astype(y.dtype)
                                for n, y in zip("qkv", (q_MF, k_MF, v_MF)))
        # --8<-- [end:qkv_bias]
        q_BSNH = q_MF.reshape(B, S, N, H)
        k_BSKH, v_BSKH = k_MF.reshape(B, S, K, H), v_MF.reshape(B, S, K, H)
        # --8<-- [start:qk_norm]
        if c.qk_norm:  # Qwen3: each head's q and k normalised, weights (H,) shared by the heads
            kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
            q_BSNH = RMSNorm(c.norm_eps, **kw, name="q_norm")(q_BSNH)
            k_BSKH = RMSNorm(c.norm_eps, **kw, name="k_norm")(k_BSKH)
        # --8<-- [end:qk_norm]
        q_BSNH = rotate(q_BSNH, cos_BSh, sin_BSh)
        k_BSKH = rotate(k_BSKH, cos_BSh, sin_BSh)

        # Heads go before positions so that each (kv head, group) is one batched matmul.
        k_BKTH, v_BKTH = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)
        if mask is None:
            mask = AttentionMask.causal(S, window=c.sliding_window)
        # Query head n = k * G + g reads kv head k (the order Meta's repeat_kv implies).
        q_BKGSH = q_BSNH.reshape(B, S, K, G, H).transpose(0, 2, 3, 1, 4)
        if cache is not None:
            cache = cache.write(layer, k_BKTH, v_BKTH)
            out_BKGSH = self.projections.attend_cache(self, q_BKGSH, cache.k, cache.v, layer, mask)
        else:
            out_BKGSH = attend(q_BKGSH, k_BKTH, v_BKTH, mask, self.attention)
        out_MNH = out_BKGSH.transpose(0, 3, 1, 2, 4).reshape(B * S, N * H)
        # W_o [head_1; ...; head_N]
        (out_MD,) = self.projections.project(self, out_MNH, _init(c, residual=True), wo=D)
        return out_MD.reshape(B, S, D), cache
# --8<-- [end:attention]


# --8<-- [start:feed_forward]
class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up and w2 the down projection."""

    config: LlamaConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    projections: Projections = Projections()  # how x @ W runs (jax_llama.model.projections)

    @nn.compact
    def __call__(self, x_BSD):
        c = self.config
        x_MD = x_BSD.reshape(-1, x_BSD.shape[-1])  # M = B * S tokens: plain 2-D matmuls
        gate_MF, up_MF = self.projections.project(self, x_MD, _init(c),
                                                  w1=c.ffn_dim, w3=c.ffn_dim)
        hidden_MF = nn.silu(gate_MF) * up_MF                      # silu(W1 x) * W3 x
        (out_MD,) = self.projections.project(self, hidden_MF, _init(c, residual=True), w2=c.dim)
        return out_MD.reshape(x_BSD.shape)
# --8<-- [end:feed_forward]


# --8<-- [start:block]
class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then h + ffn(norm(h))."""

    config: LlamaConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "auto"
    projections: Projections = Projections()  # how x @ W runs (jax_llama.model.projections)

    @nn.compact
    def __call__(self, carry, layer, cos_BSh, sin_BSh, mask: AttentionMask | None):
        """carry = (x (B, S, D), the KVCache or None) -> (carry, None): the signature nn.scan
        expects (layer, this block's index, is scanned over; the rest is broadcast)."""
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x_BSD, cache = carry
        attended, cache = Attention(c, **kw, attention=self.attention,
                                    projections=self.projections, name="attention")(
            RMSNorm(c.norm_eps, **kw, name="attention_norm")(x_BSD), cos_BSh, sin_BSh, mask,
            cache, layer)
        h = x_BSD + attended
        out = h + FeedForward(c, **kw, projections=self.projections, name="feed_forward")(
            RMSNorm(c.norm_eps, **kw, name="ffn_norm")(h))
        return (out, cache), None
# --8<-- [end:block]


# --8<-- [start:model]
class Llama(nn.Module):
    """Token embedding, n_layers blocks, final RMSNorm, LM head (tied to the embedding or not).

    scan_layers: run the blocks with nn.scan (parameters stacked on a leading L axis), so compile
    time does not grow with depth. remat: recompute each block's activations in the backward pass.
    attention: xla, chunked, cudnn, splash or auto (jax_llama.model.attention). projections: how
    each x @ W, the embedding and the attention over the cache run, and what the projections
    carry besides W (jax_llama.model.projections.choose makes one).
    """

    config: LlamaConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    scan_layers: bool = False
    remat: bool = False
    attention: str = "auto"
    projections: Projections = Projections()  # how x @ W runs (jax_llama.model.projections)

    def __call__(self, tokens_BS, positions=None, attention_mask=None, segment_ids=None):
        """tokens (B, S) int -> logits (B, S, V) float32 (see run for the arguments)."""
        return self.run(tokens_BS, positions, attention_mask, segment_ids).logits

    @nn.compact
    def run(self, tokens_BS, positions=None, attention_mask=None, segment_ids=None,
            cache: KVCache | None = None, lm_head: bool = True, head_at=None) -> LlamaOutput:
        """tokens (B, S) int -> LlamaOutput(logits (B, S, V) float32, final hidden states
        (B, S, D), the advanced cache when one is given).

        positions: (S,) or (B, S); default 0..S-1, or, when attention_mask is given, each row
        counting only its real tokens, so a left-padded row sees the positions it would alone.
        attention_mask: (B, S), 1 for real tokens and 0 for padding; combined with the causal mask.
        segment_ids: (B, S) ints, one per document of a packed row (contiguous runs): a token
        attends only to earlier tokens of its own segment, and positions restart at each one.
        cache: a KVCache; the S tokens then go into its slots [index, index + S), take the
        positions that follow each row's previous tokens, and attend to every earlier valid slot.
        lm_head=False skips the vocabulary projection (logits None): what a classification head
        reads is the hidden states. head_at (B, P) int: project only these positions of each row,
        logits (B, P, V) (what scoring a few tokens of long rows needs).
        """
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        check_inputs(tokens_BS, c.vocab_size, positions, attention_mask, segment_ids)
        B, S = tokens_BS.shape
        if S > c.max_seq_len:
            raise BridgeError(f"{S} tokens in a row, more than max_seq_len {c.max_seq_len}",
                              field="tokens")
        T = S if cache is None else cache.length
        choose(self.attention, S, T)  # an implementation the backend lacks: refused here
        valid_BS = (jnp.ones((B, S), bool) if attention_mask is None
                    else jnp.asarray(attention_mask).astype(bool))
        mask = None  # plain causal
        if cache is not None:
            if segment_ids is not None:
                raise BridgeError("not with a KV cache (segments are for packed training rows)",
                                  field="segment_ids")
            cache, mask, cached_positions = cache.reserve(valid_BS)
            positions = cached_positions if positions is None else positions
        elif attention_mask is not None or segment_ids is not None:
            segments_BS = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
            mask = AttentionMask.causal(S, None if attention_mask is None else valid_BS, segments_BS,
                                        c.sliding_window)
            if positions is None:
                positions = default_positions(valid_BS, segments_BS)
        if positions is None:
            positions = jnp.arange(S)
        cos_BSh, sin_BSh = rope_cos_sin(positions, rope_inv_freq(c.head_dim, c.rope_theta,
                                                                 c.rope_scaling))

        # --8<-- [start:embedding]
        embed = self.projections.embedding(c.vocab_size, c.dim, **kw, embedding_init=_init(c),
                                           name="tok_embeddings")
        carry = (embed(tokens_BS), cache)
        # --8<-- [end:embedding]
        block = nn.remat(Block, prevent_cse=not self.scan_layers) if self.remat else Block
        kw_blocks = dict(kw, attention=self.attention, projections=self.projections)
        if self.scan_layers:
            stack = nn.scan(block, variable_axes={"params": 0},
                            split_rngs={"params": True, "dropout": True},
                            in_axes=(0,) + (nn.broadcast,) * 3, length=c.n_layers)
            carry, _ = stack(c, **kw_blocks, name="layers")(carry, jnp.arange(c.n_layers), cos_BSh,
                                                             sin_BSh, mask)
        else:
            for i in range(c.n_layers):
                carry, _ = block(c, **kw_blocks, name=f"layers_{i}")(carry, i, cos_BSh, sin_BSh,
                                                                     mask)
        x_BSD, cache = carry
        h_BSD = RMSNorm(c.norm_eps, **kw, name="norm")(x_BSD)
        if not lm_head:
            return LlamaOutput(logits=None, hidden=h_BSD, cache=cache)

        h_BPD = h_BSD if head_at is None else jnp.take_along_axis(
            h_BSD, jnp.asarray(head_at)[..., None], axis=1)
        P = h_BPD.shape[1]
        h_MD = h_BPD.reshape(B * P, c.dim)
        # --8<-- [start:lm_head]
        if c.tie_embeddings:
            logits_MV = embed.attend(h_MD)
        else:
            (logits_MV,) = self.projections.project(self, h_MD, _init(c), output=c.vocab_size)
        # --8<-- [end:lm_head]
        logits_BSV = logits_MV.reshape(B, P, c.vocab_size).astype(jnp.float32)
        return LlamaOutput(logits=logits_BSV, hidden=h_BSD, cache=cache)
# --8<-- [end:model]


def resolve_dtype(dtype) -> jnp.dtype:
    """A jnp dtype from a dtype or its name ('float32', 'bfloat16', 'float16')."""
    return jnp.dtype(numpy_dtype(dtype))


def init(config: LlamaConfig, seed: int = 0, *, dtype=jnp.float32, param_dtype=jnp.float32,
         scan_layers: bool = False, remat: bool = False, attention: str = "auto", **projections):
    """A Llama module and freshly initialised params. `projections`: the keyword arguments of
    jax_llama.model.projections.choose (how its projections run and what they carry; their
    fresh params are initialised too).

    Traceable: `jax.eval_shape(lambda: init(cfg)[1])` gives the shapes without allocating.
    """
    choose(attention, 1, 1)  # a bad name, or one the backend lacks, is refused before anything
    model = Llama(config, dtype=resolve_dtype(dtype), param_dtype=resolve_dtype(param_dtype),
                  scan_layers=scan_layers, remat=remat, attention=attention,
                  projections=choose_projections(**projections))
    tokens = jnp.zeros((1, 1), dtype=jnp.int32)
    params = jax.jit(model.init)(jax.random.key(seed), tokens)["params"]
    return model, params
