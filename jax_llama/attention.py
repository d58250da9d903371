"""Attention implementations behind one function: attend(q, k, v, mask, implementation).

Axis legend as in jax_llama.model; here q is grouped as (B, K, G, S, H) so that each kv head serves
its G query heads without a copy.

  xla      the scores (B, K, G, S, T) materialised whole, softmax, weighted sum: the reference.
  chunked  blockwise attention with an online softmax (flash-style): query blocks of Q positions
           (Q x G rows: a kv head's G query heads together) against key blocks of C; memory
           linear in S, blocks above the causal diagonal skipped, and a backward pass (custom
           VJP) that recomputes each block from the saved log-sum-exp, so it stays linear too.
           Blocks wholly below the diagonal, with no padding or segments, build no mask. Any
           backend.
  cudnn    jax.nn.dot_product_attention(implementation="cudnn"): NVIDIA GPUs, float16 / bfloat16.
  splash   the Pallas TPU splash-attention kernel (jax.experimental.pallas.ops.tpu): TPUs. It runs
           attention of a whole sequence over itself (training, scoring, a prefill without a
           cache); steps over a KV cache, whose causal offset its static mask cannot follow, take
           auto's choice among xla and chunked. Padding and segments become its segment ids.
  auto     xla while the scores are small (under 512 x 512 per head), chunked from there; on a
           TPU, splash from there where its shapes allow (head_dim a multiple of 128, no cache):
           it never fails for lack of a kernel.

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

IMPLEMENTATIONS = ("xla", "chunked", "cudnn", "splash", "auto")
# Masked scores are the most negative float32 rather than -inf, so that a row whose every key is
# masked gets a uniform distribution (xla) instead of NaN.
_MASKED = float(np.finfo(np.float32).min)
QUERY_BLOCK = KEY_BLOCK = 512
# S x T scores per head from which auto chooses chunked: from 512 x 512 a chunked train step is
# already faster on a 2-core CPU (429 against 391 tokens/s, `jax-llama bench --only long`) and
# needs less memory; below it (decoding, short texts) the one fused softmax of xla wins.
AUTO_CHUNKED_FROM = 512 * 512
# Run the splash kernel through Pallas' interpreter, on any backend (slow: for tests on a CPU).
SPLASH_INTERPRET = False
SPLASH_BLOCKS = (512, 256, 128)  # the largest of these that divides the padded length


class AttentionMask(struct.PyTreeNode):
    """Query s may attend key slot t when t <= q_slots[s] (causal), valid[b, t] (a real token)
    and q_segments[b, s] == k_segments[b, t] (same document). None fields are not restrictions."""

    q_slots: jax.Array                  # (S,) int32: the key slot each query occupies
    valid: jax.Array | None = None      # (B, T) bool
    q_segments: jax.Array | None = None  # (B, S) int32
    k_segments: jax.Array | None = None  # (B, T) int32
    # True when the S queries are the T = S keys themselves (q_slots == arange(S), no cache):
    # known when tracing, so kernels with a static causal mask (splash) can be chosen.
    self_attention: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def causal(cls, S: int, valid_BS=None, segments_BS=None) -> "AttentionMask":
        """S tokens attending to themselves (no cache): query s at slot s."""
        return cls(q_slots=jnp.arange(S, dtype=jnp.int32), valid=valid_BS,
                   q_segments=segments_BS, k_segments=segments_BS, self_attention=True)

    def block(self, q_start, Q: int, k_start, C: int):
        """The (B or 1, Q, C) boolean mask of queries [q_start, q_start + Q) and key slots
        [k_start, k_start + C); indices past the ends read as masked keys."""
        q_slots = jax.lax.dynamic_slice_in_dim(self.q_slots, q_start, Q)
        k_slots = k_start + jnp.arange(C)
        allowed = (k_slots[None, :] <= q_slots[:, None])[None]
        if self.valid is not None:
            valid = jax.lax.dynamic_slice_in_dim(self.valid, k_start, C, axis=1)
            allowed = allowed & valid[:, None, :]
        if self.q_segments is not None:
            q_seg = jax.lax.dynamic_slice_in_dim(self.q_segments, q_start, Q, axis=1)
            k_seg = jax.lax.dynamic_slice_in_dim(self.k_segments, k_start, C, axis=1)
            allowed = allowed & (q_seg[:, :, None] == k_seg[:, None, :])
        return allowed

    def dense(self, T: int):
        """The whole (B or 1, S, T) boolean mask."""
        return self.block(0, self.q_slots.shape[0], 0, T)


def choose(implementation: str, S: int, T: int, self_attention: bool = True,
           head_dim: int | None = None) -> str:
    """The implementation `implementation` stands for at S queries and T keys (auto resolved;
    splash over a KV cache, self_attention False, resolved as auto without splash); BridgeError
    naming the field for one that does not exist or the backend does not have."""
    if implementation not in IMPLEMENTATIONS:
        raise BridgeError(f"expected one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}",
                          field="attention")
    backend = jax.default_backend()
    if implementation == "cudnn" and backend != "gpu":
        raise BridgeError(f"cudnn needs an NVIDIA GPU; this JAX runs on {backend} "
                          f"(auto picks what the backend has)", field="attention")
    if implementation == "splash" and backend != "tpu" and not SPLASH_INTERPRET:
        raise BridgeError(f"splash needs a TPU; this JAX runs on {backend} "
                          f"(auto picks what the backend has)", field="attention")
    long = S * T >= AUTO_CHUNKED_FROM
    if implementation == "splash":
        return "splash" if self_attention else ("chunked" if long else "xla")
    if implementation == "auto":
        if (long and backend == "tpu" and self_attention and head_dim is not None
                and head_dim % 128 == 0):
            return "splash"
        return "chunked" if long else "xla"
    return implementation


def attend(q_BKGSH, k_BKTH, v_BKTH, mask: AttentionMask, implementation: str = "xla"):
    """softmax(q k^T / sqrt(H) + mask) v, in q's dtype: (B, K, G, S, H) with keys and values
    (B, K, T, H) -> (B, K, G, S, H). Scores, softmax statistics and accumulation are float32."""
    S, T, H = q_BKGSH.shape[3], k_BKTH.shape[2], q_BKGSH.shape[4]
    implementation = choose(implementation, S, T, mask.self_attention, H)
    if implementation == "chunked":
        return _chunked(q_BKGSH, k_BKTH, v_BKTH, mask)
    if implementation == "cudnn":
        return _cudnn(q_BKGSH, k_BKTH, v_BKTH, mask)
    if implementation == "splash":
        return _splash(q_BKGSH, k_BKTH, v_BKTH, mask)
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


def _splash(q_BKGSH, k_BKTH, v_BKTH, mask: AttentionMask):
    """The splash kernel for self-attention (T = S, query s at slot s): one MQA kernel per kv
    head (its G query heads share it), vmapped over batch and kv heads. The sequence is padded to
    a multiple of 128; padding (padded or invalid tokens) and segments become splash's segment
    ids: each row's invalid tokens get an id no real token of the row has, so no real query sees
    them (they see each other; their outputs are never read)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, K, G, S, H = q_BKGSH.shape
    S_pad = -(-S // 128) * 128
    block = next(b for b in SPLASH_BLOCKS if S_pad % b == 0)
    segments_BS = (jnp.zeros((B, S), jnp.int32) if mask.q_segments is None
                   else jnp.broadcast_to(mask.q_segments, (B, S)).astype(jnp.int32))
    valid_BS = (jnp.ones((B, S), bool) if mask.valid is None
                else jnp.broadcast_to(mask.valid, (B, S)))
    segments_BS, valid_BS = _pad_to(segments_BS, S_pad, 1), _pad_to(valid_BS, S_pad, 1, False)
    info = jnp.iinfo(jnp.int32)
    top = jnp.max(jnp.where(valid_BS, segments_BS, info.min), axis=1, keepdims=True)
    low = jnp.min(jnp.where(valid_BS, segments_BS, info.max), axis=1, keepdims=True)
    unseen = jnp.where(top < info.max, top + 1, low - 1)  # an id no real token of the row has
    segments_BS = jnp.where(valid_BS, segments_BS, unseen)

    kernel = splash.make_splash_mqa_single_device(
        splash.MultiHeadMask([splash.CausalMask((S_pad, S_pad)) for _ in range(G)]),
        block_sizes=splash.BlockSizes(
            block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block),
        interpret=SPLASH_INTERPRET)
    scale = 1.0 / math.sqrt(H)  # splash does not scale the scores itself
    q = _pad_to((q_BKGSH.astype(jnp.float32) * scale).astype(q_BKGSH.dtype), S_pad, 3)
    k, v = _pad_to(k_BKTH, S_pad, 2), _pad_to(v_BKTH, S_pad, 2)

    def one_row(q_KGSH, k_KTH, v_KTH, segments_S):
        ids = splash.SegmentIds(q=segments_S, kv=segments_S)
        return jax.vmap(lambda q_GSH, k_TH, v_TH: kernel(q_GSH, k_TH, v_TH, segment_ids=ids))(
            q_KGSH, k_KTH, v_KTH)
    out_BKGSH = jax.vmap(one_row)(q, k, v, segments_BS)
    return out_BKGSH[:, :, :, :S].astype(q_BKGSH.dtype)


# -- chunked: an online softmax over key blocks, for one query block at a time --------------------

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
    """The mask over padded queries and keys: padded keys are never valid (valid stays None
    when every key is real, which lets the blocks below the diagonal skip the mask)."""
    valid = mask.valid
    if valid is None and T_pad > T:
        valid = jnp.ones((1, T), bool)
    return AttentionMask(
        q_slots=_pad_to(mask.q_slots, S_pad, 0, value=-1),  # a padded query sees nothing
        valid=None if valid is None else _pad_to(valid, T_pad, 1, value=False),
        q_segments=None if mask.q_segments is None else _pad_to(mask.q_segments, S_pad, 1),
        k_segments=None if mask.k_segments is None else _pad_to(mask.k_segments, T_pad, 1))


def _interior(mask: AttentionMask, q_start, Q: int, k_start, C: int):
    """True when every query of the block may see every key of the block: wholly below the
    causal diagonal, with no padding or segments to mask. Such a block needs no mask at all."""
    if mask.valid is not None or mask.q_segments is not None:
        return False
    first_slot = jnp.min(jax.lax.dynamic_slice_in_dim(mask.q_slots, q_start, Q))
    return k_start + C - 1 <= first_slot


def _masked_where(interior, allowed_fn, x, fill):
    """x where the block mask allows, else fill; the mask is not even built for an interior
    block (lax.cond runs one branch)."""
    if interior is False:
        return jnp.where(allowed_fn(), x, fill)
    return jax.lax.cond(interior, lambda: x, lambda: jnp.where(allowed_fn(), x, fill))


def _key_blocks_needed(mask: AttentionMask, q_start, Q: int, C: int, n_k: int):
    """How many key blocks from the first one a query block can see: keys past its last query's
    slot are masked by causality, so those blocks are skipped (half the work of a prefill)."""
    last_slot = jnp.max(jax.lax.dynamic_slice_in_dim(mask.q_slots, q_start, Q))
    return jnp.clip(last_slot // C + 1, 0, n_k)


def _chunked(q_BKGSH, k_BKTH, v_BKTH, mask: AttentionMask):
    S, T = q_BKGSH.shape[3], k_BKTH.shape[2]
    Q, n_q = _blocks(S, QUERY_BLOCK)
    C, n_k = _blocks(T, KEY_BLOCK)
    # Positions before groups: a block of Q queries is then Q * G contiguous rows (M), one plain
    # batched matmul against a key block, which XLA:CPU runs far faster than over (G, Q).
    q = _pad_to(q_BKGSH.transpose(0, 1, 3, 2, 4), Q * n_q, 2)        # (B, K, S, G, H)
    k, v = _pad_to(k_BKTH, C * n_k, 2), _pad_to(v_BKTH, C * n_k, 2)
    out = _flash(q, k, v, _padded_mask(mask, Q * n_q, T, C * n_k), Q, C)
    return out[:, :, :S].transpose(0, 1, 3, 2, 4)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, mask, Q: int, C: int):
    return _flash_forward(q, k, v, mask, Q, C)[0]


def _rows(x, start, Q: int):
    """Queries [start, start + Q) of x (B, K, S, G, ...) as Q * G rows: (B, K, M, ...)."""
    block = jax.lax.dynamic_slice_in_dim(x, start, Q, axis=2)
    return block.reshape(*block.shape[:2], -1, *block.shape[4:])


def _row_mask(mask: AttentionMask, q_start, Q: int, G: int, k_start, C: int):
    """The block mask broadcast over the G query heads of each position: (B or 1, 1, M, C)."""
    allowed = mask.block(q_start, Q, k_start, C)                         # (B, Q, C)
    allowed = jnp.broadcast_to(allowed[:, :, None, :], (allowed.shape[0], Q, G, C))
    return allowed.reshape(allowed.shape[0], 1, Q * G, C)


def _flash_forward(q, k, v, mask: AttentionMask, Q: int, C: int):
    """(out (B, K, S, G, H) in q's dtype, log-sum-exp (B, K, S, G) float32; +inf where a query
    sees no key)."""
    B, K, S, G, H = q.shape
    n_q, n_k, scale, M = S // Q, k.shape[2] // C, 1.0 / math.sqrt(H), Q * G
    k_T = k.transpose(0, 1, 3, 2)                                       # (B, K, H, T)

    def query_block(i):
        q_blk = _rows(q, i * Q, Q)                                      # (B, K, M, H)

        def key_block(j, carry):
            m, l, acc = carry
            kT_blk = jax.lax.dynamic_slice_in_dim(k_T, j * C, C, axis=3)
            v_blk = jax.lax.dynamic_slice_in_dim(v, j * C, C, axis=2)
            allowed = lambda: _row_mask(mask, i * Q, Q, G, j * C, C)  # noqa: E731
            interior = _interior(mask, i * Q, Q, j * C, C)
            s = jnp.einsum("BKMH,BKHC->BKMC", q_blk, kT_blk,
                           preferred_element_type=jnp.float32) * scale
            s = _masked_where(interior, allowed, s, _MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = _masked_where(interior, allowed, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            l = l * correction + p.sum(-1)
            acc = acc * correction[..., None] + jnp.einsum(
                "BKMC,BKCH->BKMH", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, l, acc

        start = (jnp.full((B, K, M), _MASKED, jnp.float32), jnp.zeros((B, K, M), jnp.float32),
                 jnp.zeros((B, K, M, H), jnp.float32))
        needed = _key_blocks_needed(mask, i * Q, Q, C, n_k)
        m, l, acc = jax.lax.fori_loop(0, needed, key_block, start)
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return out.astype(q.dtype).reshape(B, K, Q, G, H), lse.reshape(B, K, Q, G)

    out, lse = jax.lax.map(query_block, jnp.arange(n_q))   # (n_q, B, K, Q, G, ...)
    out = jnp.moveaxis(out, 0, 2).reshape(B, K, S, G, H)
    lse = jnp.moveaxis(lse, 0, 2).reshape(B, K, S, G)
    return out, lse


def _flash_fwd(q, k, v, mask, Q, C):
    out, lse = _flash_forward(q, k, v, mask, Q, C)
    return out, (q, k, v, mask, out, lse)


def _flash_bwd(Q, C, residuals, d_out):
    """The flash backward in two passes that keep only block-sized accumulators: per key block,
    dK and dV over the query blocks that can see it; then per query block, dQ over the key blocks
    it sees. Each (Q, C) block of probabilities is recomputed from the log-sum-exp (twice), so
    nothing of size S x T is kept, and no full-size array is updated inside a loop."""
    q, k, v, mask, out, lse = residuals
    B, K, S, G, H = q.shape
    n_q, n_k, scale = S // Q, k.shape[2] // C, 1.0 / math.sqrt(H)
    k_T, v_T = k.transpose(0, 1, 3, 2), v.transpose(0, 1, 3, 2)          # (B, K, H, T)
    # D = rowsum(dO * O): the softmax's own term in dS = P (dP - D)
    delta = jnp.einsum("BKSGH,BKSGH->BKSG", d_out.astype(jnp.float32), out.astype(jnp.float32))

    def block(i, j):
        """(q rows, dO rows, P, dS) of query block i against key block j, (B, K, M, ...)."""
        q_blk, do_blk = _rows(q, i * Q, Q), _rows(d_out, i * Q, Q)
        lse_blk, delta_blk = _rows(lse, i * Q, Q), _rows(delta, i * Q, Q)
        kT_blk = jax.lax.dynamic_slice_in_dim(k_T, j * C, C, axis=3)
        vT_blk = jax.lax.dynamic_slice_in_dim(v_T, j * C, C, axis=3)
        allowed = lambda: _row_mask(mask, i * Q, Q, G, j * C, C)  # noqa: E731
        s = jnp.einsum("BKMH,BKHC->BKMC", q_blk, kT_blk, preferred_element_type=jnp.float32) * scale
        p = _masked_where(_interior(mask, i * Q, Q, j * C, C), allowed,
                          jnp.exp(s - lse_blk[..., None]), 0.0)
        d_p = jnp.einsum("BKMH,BKHC->BKMC", do_blk, vT_blk, preferred_element_type=jnp.float32)
        return q_blk, do_blk, p, p * (d_p - delta_blk[..., None]) * scale

    def key_block(j):
        def step(i, carry):
            d_k, d_v = carry
            q_blk, do_blk, p, d_s = block(i, j)
            d_v = d_v + jnp.einsum("BKMC,BKMH->BKCH", p.astype(do_blk.dtype), do_blk,
                                   preferred_element_type=jnp.float32)
            d_k = d_k + jnp.einsum("BKMC,BKMH->BKCH", d_s, q_blk.astype(jnp.float32))
            return d_k, d_v
        zeros = jnp.zeros((B, K, C, H), jnp.float32)
        # Causality: query block i sees key block j only if its last slot reaches j * C.
        return jax.lax.fori_loop(_first_query_block(mask, j * C, Q, n_q), n_q, step, (zeros, zeros))

    def query_block(i):
        def step(j, d_q):
            _, _, _, d_s = block(i, j)
            k_blk = jax.lax.dynamic_slice_in_dim(k, j * C, C, axis=2)
            return d_q + jnp.einsum("BKMC,BKCH->BKMH", d_s, k_blk.astype(jnp.float32))
        d_q = jax.lax.fori_loop(0, _key_blocks_needed(mask, i * Q, Q, C, n_k), step,
                                jnp.zeros((B, K, Q * G, H), jnp.float32))
        return d_q.reshape(B, K, Q, G, H)

    d_k, d_v = jax.lax.map(key_block, jnp.arange(n_k))        # (n_k, B, K, C, H) each
    d_q = jax.lax.map(query_block, jnp.arange(n_q))            # (n_q, B, K, Q, G, H)
    d_k = jnp.moveaxis(d_k, 0, 2).reshape(k.shape)
    d_v = jnp.moveaxis(d_v, 0, 2).reshape(v.shape)
    d_q = jnp.moveaxis(d_q, 0, 2).reshape(q.shape)
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
