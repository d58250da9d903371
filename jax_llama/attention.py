"""Attention implementations behind one function: attend(q, k, v, mask, implementation).

Axis legend as in jax_llama.model; here q is grouped as (B, K, G, S, H) so that each kv head serves
its G query heads without a copy.

  xla      the scores (B, K, G, S, T) materialised whole, softmax, weighted sum: the reference.
  chunked  blockwise attention with an online softmax (flash-style): query blocks of Q and key
           blocks of C; memory linear in S, blocks above the causal diagonal skipped, and a backward
           pass (custom VJP) that recomputes each block from the saved log-sum-exp, so it stays
           linear too. Any backend.
  cudnn    jax.nn.dot_product_attention(implementation="cudnn"): NVIDIA GPUs, float16 / bfloat16.
  auto     xla while the scores are small (a few million per head), chunked beyond: it never fails
           for lack of a kernel.

The mask is described, not built: AttentionMask says which key slot each query sits at (causal:
a query sees slots up to its own), which slots hold real tokens, and each token's segment (a
token sees only its own segment). `dense()` builds the (B, S, T) boolean mask for xla and cudnn;
chunked builds one (Q, C) block at a time. A query that may see no key (left padding) gets the
uniform average of every key in xla and zeros in chunked: its output is never read.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from bridge.errors import BridgeError

IMPLEMENTATIONS = ("xla", "chunked", "cudnn", "auto")
# Masked scores are the most negative float32 rather than -inf, so that a row whose every key is
# masked gets a uniform distribution (xla) instead of NaN.
_MASKED = float(np.finfo(np.float32).min)
QUERY_BLOCK = KEY_BLOCK = 512
AUTO_CHUNKED_FROM = 1 << 22  # S x T scores per head from which auto chooses chunked (2048 x 2048)


class AttentionMask(struct.PyTreeNode):
    """Query s may attend key slot t when t <= q_slots[s] (causal), valid[b, t] (a real token)
    and q_segments[b, s] == k_segments[b, t] (same document). None fields are not restrictions."""

    q_slots: jax.Array                  # (S,) int32: the key slot each query occupies
    valid: jax.Array | None = None      # (B, T) bool
    q_segments: jax.Array | None = None  # (B, S) int32
    k_segments: jax.Array | None = None  # (B, T) int32

    @classmethod
    def causal(cls, S: int, valid_BS=None, segments_BS=None) -> "AttentionMask":
        """S tokens attending to themselves (no cache): query s at slot s."""
        return cls(q_slots=jnp.arange(S, dtype=jnp.int32), valid=valid_BS,
                   q_segments=segments_BS, k_segments=segments_BS)

    def block(self, q_start, Q: int, k_start, C: int):
        """The (B or 1, Q, C) boolean mask of queries [q_start, q_start + Q) and key slots
        [k_start, k_start + C); indices past the ends read as masked keys."""
        q_slots = jax.lax.dynamic_slice_in_dim(self.q_slots, q_start, Q)
        k_slots = k_start + jnp.arange(C)
        allowed = (k_slots[None, :] <= q_slots[:, None])[None]
        if self.valid is not None:
            allowed = allowed & jax.lax.dynamic_slice_in_dim(self.valid, k_start, C, axis=1)[:, None, :]
        if self.q_segments is not None:
            q_seg = jax.lax.dynamic_slice_in_dim(self.q_segments, q_start, Q, axis=1)
            k_seg = jax.lax.dynamic_slice_in_dim(self.k_segments, k_start, C, axis=1)
            allowed = allowed & (q_seg[:, :, None] == k_seg[:, None, :])
        return allowed

    def dense(self, T: int):
        """The whole (B or 1, S, T) boolean mask."""
        return self.block(0, self.q_slots.shape[0], 0, T)


def choose(implementation: str, S: int, T: int) -> str:
    """The implementation `implementation` stands for at S queries and T keys (auto resolved);
    BridgeError naming the field for one that does not exist or the backend does not have."""
    if implementation not in IMPLEMENTATIONS:
        raise BridgeError(f"expected one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}",
                          field="attention")
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        raise BridgeError(f"cudnn needs an NVIDIA GPU; this JAX runs on {jax.default_backend()} "
                          f"(auto picks what the backend has)", field="attention")
    if implementation == "auto":
        return "chunked" if S * T >= AUTO_CHUNKED_FROM else "xla"
    return implementation


def attend(q_BKGSH, k_BKTH, v_BKTH, mask: AttentionMask, implementation: str = "xla"):
    """softmax(q k^T / sqrt(H) + mask) v, in q's dtype: (B, K, G, S, H) with keys and values
    (B, K, T, H) -> (B, K, G, S, H). Scores, softmax statistics and accumulation are float32."""
    S, T = q_BKGSH.shape[3], k_BKTH.shape[2]
    implementation = choose(implementation, S, T)
    if implementation == "chunked":
        return _chunked(q_BKGSH, k_BKTH, v_BKTH, mask)
    if implementation == "cudnn":
        return _cudnn(q_BKGSH, k_BKTH, v_BKTH, mask)
    return _xla(q_BKGSH, k_BKTH, v_BKTH, mask)


def _xla(q_BKGSH, k_BKTH, v_BKTH, mask: AttentionMask):
    H, T = q_BKGSH.shape[-1], k_BKTH.shape[2]
    scores_BKGST = jnp.einsum("BKGSH,BKTH->BKGST", q_BKGSH, k_BKTH,
                              preferred_element_type=jnp.float32) / math.sqrt(H)
    scores_BKGST = jnp.where(mask.dense(T)[:, None, None], scores_BKGST, _MASKED)
    probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1).astype(q_BKGSH.dtype)
    return jnp.einsum("BKGST,BKTH->BKGSH", probs_BKGST, v_BKTH)


def _cudnn(q_BKGSH, k_BKTH, v_BKTH, mask: AttentionMask):
    """cuDNN's fused attention, the mask passed whole (B, 1, S, T); GQA by its own grouping."""
    B, K, G, S, H = q_BKGSH.shape
    T = k_BKTH.shape[2]
    q_BSNH = q_BKGSH.reshape(B, K * G, S, H).transpose(0, 2, 1, 3)
    out_BSNH = jax.nn.dot_product_attention(
        q_BSNH, k_BKTH.transpose(0, 2, 1, 3), v_BKTH.transpose(0, 2, 1, 3),
        mask=mask.dense(T)[:, None], implementation="cudnn")
    return out_BSNH.transpose(0, 2, 1, 3).reshape(B, K, G, S, H)


# -- chunked: an online softmax over key blocks, for one query block at a time ----------------------

def _blocks(n: int, size: int) -> tuple[int, int]:
    """(block size, number of blocks) covering n."""
    size = min(size, n)
    return size, -(-n // size)


def _pad_to(x, n: int, axis: int, value=0):
    pad = n - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _padded_mask(mask: AttentionMask, S_pad: int, T: int, T_pad: int) -> AttentionMask:
    """The mask over padded queries and keys: padded keys are never valid."""
    valid = mask.valid if mask.valid is not None else jnp.ones((1, T), bool)
    return AttentionMask(
        q_slots=_pad_to(mask.q_slots, S_pad, 0, value=-1),  # a padded query sees nothing
        valid=_pad_to(valid, T_pad, 1, value=False),
        q_segments=None if mask.q_segments is None else _pad_to(mask.q_segments, S_pad, 1),
        k_segments=None if mask.k_segments is None else _pad_to(mask.k_segments, T_pad, 1))


def _key_blocks_needed(mask: AttentionMask, q_start, Q: int, C: int, n_k: int):
    """How many key blocks from the first one a query block can see: keys past its last query's
    slot are masked by causality, so those blocks are skipped (half the work of a prefill)."""
    last_slot = jnp.max(jax.lax.dynamic_slice_in_dim(mask.q_slots, q_start, Q))
    return jnp.clip(last_slot // C + 1, 0, n_k)


def _chunked(q_BKGSH, k_BKTH, v_BKTH, mask: AttentionMask):
    S, T = q_BKGSH.shape[3], k_BKTH.shape[2]
    Q, n_q = _blocks(S, QUERY_BLOCK)
    C, n_k = _blocks(T, KEY_BLOCK)
    q = _pad_to(q_BKGSH, Q * n_q, 3)
    k, v = _pad_to(k_BKTH, C * n_k, 2), _pad_to(v_BKTH, C * n_k, 2)
    out = _flash(q, k, v, _padded_mask(mask, Q * n_q, T, C * n_k), Q, C)
    return out[:, :, :, :S]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, mask, Q: int, C: int):
    return _flash_forward(q, k, v, mask, Q, C)[0]


def _flash_forward(q, k, v, mask: AttentionMask, Q: int, C: int):
    """(out (B, K, G, S, H) in q's dtype, log-sum-exp (B, K, G, S) float32; +inf where a query
    sees no key)."""
    B, K, G, S, H = q.shape
    n_q, n_k, scale = S // Q, k.shape[2] // C, 1.0 / math.sqrt(H)

    def query_block(i):
        q_blk = jax.lax.dynamic_slice_in_dim(q, i * Q, Q, axis=3)

        def key_block(j, carry):
            m, l, acc = carry
            k_blk = jax.lax.dynamic_slice_in_dim(k, j * C, C, axis=2)
            v_blk = jax.lax.dynamic_slice_in_dim(v, j * C, C, axis=2)
            allowed = mask.block(i * Q, Q, j * C, C)[:, None, None]          # (B, 1, 1, Q, C)
            s = jnp.einsum("BKGQH,BKCH->BKGQC", q_blk, k_blk,
                           preferred_element_type=jnp.float32) * scale
            m_new = jnp.maximum(m, jnp.max(jnp.where(allowed, s, _MASKED), axis=-1))
            p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            l = l * correction + p.sum(-1)
            acc = acc * correction[..., None] + jnp.einsum(
                "BKGQC,BKCH->BKGQH", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, l, acc

        start = (jnp.full((B, K, G, Q), _MASKED, jnp.float32), jnp.zeros((B, K, G, Q), jnp.float32),
                 jnp.zeros((B, K, G, Q, H), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, _key_blocks_needed(mask, i * Q, Q, C, n_k), key_block, start)
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return out.astype(q.dtype), lse

    out, lse = jax.lax.map(query_block, jnp.arange(n_q))   # (n_q, B, K, G, Q, ...)
    out = jnp.moveaxis(out, 0, 3).reshape(B, K, G, S, H)
    lse = jnp.moveaxis(lse, 0, 3).reshape(B, K, G, S)
    return out, lse


def _flash_fwd(q, k, v, mask, Q, C):
    out, lse = _flash_forward(q, k, v, mask, Q, C)
    return out, (q, k, v, mask, out, lse)


def _flash_bwd(Q, C, residuals, d_out):
    """The flash backward: per key block, the query blocks that can see it; each (Q, C) block of
    probabilities is recomputed from the log-sum-exp, so nothing of size S x T is kept."""
    q, k, v, mask, out, lse = residuals
    B, K, G, S, H = q.shape
    n_q, n_k, scale = S // Q, k.shape[2] // C, 1.0 / math.sqrt(H)
    # D = rowsum(dO * O): the softmax's own term in dS = P (dP - D)
    delta = jnp.einsum("BKGSH,BKGSH->BKGS", d_out.astype(jnp.float32), out.astype(jnp.float32))

    def key_block(d_q, j):
        k_blk = jax.lax.dynamic_slice_in_dim(k, j * C, C, axis=2)
        v_blk = jax.lax.dynamic_slice_in_dim(v, j * C, C, axis=2)

        def query_block(i, carry):
            d_q, d_k, d_v = carry
            q_blk = jax.lax.dynamic_slice_in_dim(q, i * Q, Q, axis=3)
            do_blk = jax.lax.dynamic_slice_in_dim(d_out, i * Q, Q, axis=3)
            lse_blk = jax.lax.dynamic_slice_in_dim(lse, i * Q, Q, axis=3)
            delta_blk = jax.lax.dynamic_slice_in_dim(delta, i * Q, Q, axis=3)
            allowed = mask.block(i * Q, Q, j * C, C)[:, None, None]
            s = jnp.einsum("BKGQH,BKCH->BKGQC", q_blk, k_blk,
                           preferred_element_type=jnp.float32) * scale
            p = jnp.where(allowed, jnp.exp(s - lse_blk[..., None]), 0.0)
            d_v = d_v + jnp.einsum("BKGQC,BKGQH->BKCH", p.astype(do_blk.dtype), do_blk,
                                   preferred_element_type=jnp.float32)
            d_p = jnp.einsum("BKGQH,BKCH->BKGQC", do_blk, v_blk, preferred_element_type=jnp.float32)
            d_s = p * (d_p - delta_blk[..., None]) * scale
            d_q_blk = jnp.einsum("BKGQC,BKCH->BKGQH", d_s, k_blk.astype(jnp.float32))
            d_q = jax.lax.dynamic_update_slice_in_dim(
                d_q, jax.lax.dynamic_slice_in_dim(d_q, i * Q, Q, axis=3) + d_q_blk, i * Q, axis=3)
            d_k = d_k + jnp.einsum("BKGQC,BKGQH->BKCH", d_s, q_blk.astype(jnp.float32))
            return d_q, d_k, d_v

        # Causality: query block i sees key block j only if its last slot reaches j * C.
        first = _first_query_block(mask, j * C, Q, n_q)
        zeros = jnp.zeros((B, K, C, H), jnp.float32)
        d_q, d_k, d_v = jax.lax.fori_loop(first, n_q, query_block, (d_q, zeros, zeros))
        return d_q, (d_k, d_v)

    d_q, (d_k, d_v) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(n_k))
    d_k = jnp.moveaxis(d_k, 0, 2).reshape(k.shape)
    d_v = jnp.moveaxis(d_v, 0, 2).reshape(v.shape)
    d_mask = jax.tree_util.tree_map(_zero_cotangent, mask)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_mask


def _first_query_block(mask: AttentionMask, k_start, Q: int, n_q: int):
    """The first query block that can see key slot k_start: slots rise with the query index
    (padded queries, at the end, have slot -1), so it is the first block whose largest slot
    reaches k_start; n_q when none does."""
    reaches = mask.q_slots.reshape(n_q, Q).max(axis=1) >= k_start
    return jnp.where(reaches.any(), jnp.argmax(reaches), n_q)


def _zero_cotangent(x):
    """Integer and boolean inputs take a float0 cotangent."""
    return np.zeros(x.shape, jax.dtypes.float0)


_flash.defvjp(_flash_fwd, _flash_bwd)
