"""Attention implementations behind one function: attend(q, k, v, mask, implementation).

Axis legend as in jax_llama.model.llama; here q is grouped as (B, K, G, S, H) so that each kv head
serves its G query heads without a copy.

  xla      the scores (B, K, G, S, T) materialised whole, softmax, weighted sum: the reference.
  chunked  blockwise attention with an online softmax (flash-style): query blocks of Q positions
           (Q x G rows: a kv head's G query heads together) against key blocks of C; memory
           linear in S, blocks above the causal diagonal skipped, and a backward pass (custom
           VJP) that sweeps the same blocks once, recomputing each one's probabilities from the
           saved log-sum-exp, so it stays linear too. Blocks wholly below the diagonal, with no
           padding or segments, run in a loop of their own that builds no mask. Any backend; on
           a CPU one (sequence, kv head) at a time, so that a block stays in cache.
  cudnn    jax.nn.dot_product_attention(implementation="cudnn"): NVIDIA GPUs, float16 / bfloat16.
  splash   the Pallas TPU splash-attention kernel (jax.experimental.pallas.ops.tpu): TPUs. It runs
           attention of a whole sequence over itself (training, scoring, a prefill without a
           cache); steps over a KV cache, whose causal offset its static mask cannot follow, take
           auto's choice among xla and chunked. Padding and segments become its segment ids.
  auto     xla while the scores are small (under 512 x 512 per head), chunked from there; on a
           TPU, splash from there where its shapes allow (head_dim a multiple of 128, no cache);
           on an NVIDIA GPU, cudnn from there for float16 / bfloat16 self-attention (head_dim a
           multiple of 8, at most 128): the attention of the 50% MFU train step in
           results/gpu/gpu.md. It never fails for lack of a kernel.

The mask is described, not built: AttentionMask says which key slot each query sits at (causal:
a query sees slots up to its own), which slots hold real tokens, each token's segment (a token
sees only its own segment) and, for Mistral's sliding window, how far back a query sees. A
rolling KV cache reuses its entries in turn, so it also says which slot each entry holds. `dense()` builds the (B, S, T) boolean mask for xla and cudnn;
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
# The forward's blocks: queries by keys. Its softmax passes over each block of scores (the row
# maximum, the exponential, the sum) stay in cache at 256 x 256 (512 KB per kv head for G = 2);
# at 512 x 512 the forward took 1.88 against 1.41 s on an AMD EPYC (scripts/profile_attention.py's
# shape, all heads at once). The backward works on blocks BACKWARD_WIDEN times larger where the
# block count allows: its five matmuls per block, not its element-wise passes, are what it spends
# its time on, and they run faster on larger blocks (4.04 against 4.20 s).
QUERY_BLOCK = KEY_BLOCK = 256
BACKWARD_WIDEN = 2
# Backends on which chunked works one (sequence, kv head) pair at a time, in a loop: a block's
# arrays are then one head's (0.5 to 2 MB) and stay in a CPU's cache through their passes, where
# those of all B x K heads at once (8 to 16 MB for B 2, K 4) do not. On an AMD EPYC, one layer's
# forward and backward at S = 8192 took 4.98 against 5.94 s, and at S = 512, B = 32, 0.73 against
# 1.29 s. Accelerators take all the heads at once, which they run in parallel.
PER_HEAD_BACKENDS = ("cpu",)
# S x T scores per head from which auto chooses chunked: from 512 x 512 a chunked train step is
# already faster on a 2-core CPU (429 against 391 tokens/s, `jax-llama bench --only long`) and
# needs less memory; below it (decoding, short texts) the one fused softmax of xla wins.
AUTO_CHUNKED_FROM = 512 * 512
# Run the splash kernel through Pallas' interpreter, on any backend (slow: for tests on a CPU).
SPLASH_INTERPRET = False
SPLASH_BLOCKS = (512, 256, 128)  # the largest of these that divides the padded length


class AttentionMask(struct.PyTreeNode):
    """Query s may attend key entry t, which holds slot k = k_slots[t] (t itself when k_slots is
    None), when k <= q_slots[s] (causal), q_slots[s] - k < window (a sliding window), valid[b, t]
    (a real token) and q_segments[b, s] == k_segments[b, t] (same document). None fields are not
    restrictions."""

    q_slots: jax.Array                  # (S,) int32: the key slot each query occupies
    valid: jax.Array | None = None      # (B, T) bool
    q_segments: jax.Array | None = None  # (B, S) int32
    k_segments: jax.Array | None = None  # (B, T) int32
    k_slots: jax.Array | None = None    # (T,) int32: the slot each entry of a rolling cache holds
    window: int | None = struct.field(pytree_node=False, default=None)  # LlamaConfig.sliding_window
    # True when the S queries are the T = S keys themselves (q_slots == arange(S), no cache):
    # known when tracing, so kernels with a static causal mask (splash) can be chosen.
    self_attention: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def causal(cls, S: int, valid_BS=None, segments_BS=None, window=None) -> "AttentionMask":
        """S tokens attending to themselves (no cache): query s at slot s."""
        return cls(q_slots=jnp.arange(S, dtype=jnp.int32), valid=valid_BS,
                   q_segments=segments_BS, k_segments=segments_BS, window=window,
                   self_attention=True)

    def block(self, q_start, Q: int, k_start, C: int):
        """The (B or 1, Q, C) boolean mask of queries [q_start, q_start + Q) and key slots
        [k_start, k_start + C); indices past the ends read as masked keys."""
        q_slots = jax.lax.dynamic_slice_in_dim(self.q_slots, q_start, Q)
        k_slots = (k_start + jnp.arange(C) if self.k_slots is None
                   else jax.lax.dynamic_slice_in_dim(self.k_slots, k_start, C))
        allowed = (k_slots[None, :] <= q_slots[:, None])[None]
        # --8<-- [start:sliding_window]
        if self.window is not None:  # Mistral: a query sees only the last `window` positions
            allowed = allowed & (q_slots[:, None] - k_slots[None, :] < self.window)[None]
        # --8<-- [end:sliding_window]
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
           head_dim: int | None = None, dtype=None) -> str:
    """The implementation `implementation` stands for at S queries and T keys of `dtype` (auto
    resolved; splash over a KV cache, self_attention False, resolved as auto without splash);
    BridgeError naming the field for one that does not exist or the backend does not have."""
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
        if (long and backend == "gpu" and self_attention and head_dim is not None
                and head_dim % 8 == 0 and head_dim <= 128 and dtype is not None
                and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)):
            return "cudnn"
        return "chunked" if long else "xla"
    return implementation


def attend(q_BKGSH, k_BKTH, v_BKTH, mask: AttentionMask, implementation: str = "xla"):
    """softmax(q k^T / sqrt(H) + mask) v, in q's dtype: (B, K, G, S, H) with keys and values
    (B, K, T, H) -> (B, K, G, S, H). Scores, softmax statistics and accumulation are float32."""
    S, T, H = q_BKGSH.shape[3], k_BKTH.shape[2], q_BKGSH.shape[4]
    implementation = choose(implementation, S, T, mask.self_attention, H, q_BKGSH.dtype)
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
    them (they see each other; their outputs are never read). A sliding window is its LocalMask
    (the last `window` keys up to the query's own)."""
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
        splash.MultiHeadMask([splash.CausalMask((S_pad, S_pad)) if mask.window is None
                              else splash.LocalMask((S_pad, S_pad), (mask.window - 1, 0), 0)
                              for _ in range(G)]),
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
        k_segments=None if mask.k_segments is None else _pad_to(mask.k_segments, T_pad, 1),
        k_slots=None if mask.k_slots is None else _pad_to(mask.k_slots, T_pad, 0,
                                                          value=np.iinfo(np.int32).max),
        window=mask.window)


def _free_key_blocks(mask: AttentionMask, q_start, Q: int, C: int, needed):
    """How many key blocks from the first one every query of the block may see whole: wholly
    below the causal diagonal, with no padding, segments or window to mask. They need no mask."""
    if (mask.valid is not None or mask.q_segments is not None or mask.window is not None
            or mask.k_slots is not None):
        return 0
    first_slot = jnp.min(jax.lax.dynamic_slice_in_dim(mask.q_slots, q_start, Q))
    return jnp.clip((first_slot + 1) // C, 0, needed)


def _key_blocks_needed(mask: AttentionMask, q_start, Q: int, C: int, n_k: int):
    """How many key blocks from the first one a query block can see: keys past its last query's
    slot are masked by causality, so those blocks are skipped (half the work of a prefill). A
    rolling cache's entries are in no order: it needs them all."""
    if mask.k_slots is not None:
        return n_k
    last_slot = jnp.max(jax.lax.dynamic_slice_in_dim(mask.q_slots, q_start, Q))
    return jnp.clip(last_slot // C + 1, 0, n_k)


def _sweep(mask: AttentionMask, i, Q: int, C: int, n_k: int, step, carry):
    """carry = step(j, carry, masked) over the key blocks query block i sees: first those it sees
    whole (masked False: no mask built), then the rest (the diagonal, padding, segments)."""
    needed = _key_blocks_needed(mask, i * Q, Q, C, n_k)
    free = _free_key_blocks(mask, i * Q, Q, C, needed)
    carry = jax.lax.fori_loop(0, free, lambda j, c: step(j, c, False), carry)
    return jax.lax.fori_loop(jnp.maximum(free, _first_key_block(mask, i * Q, Q, C, needed)),
                             needed, lambda j, c: step(j, c, True), carry)


def _first_key_block(mask: AttentionMask, q_start, Q: int, C: int, needed):
    """The first key block a query block can see: with a sliding window, the blocks wholly
    before its first query's window are skipped (work linear in the window, not the length)."""
    if mask.window is None or mask.k_slots is not None:
        return 0
    q_slots = jax.lax.dynamic_slice_in_dim(mask.q_slots, q_start, Q)
    first_slot = jnp.min(jnp.where(q_slots >= 0, q_slots, jnp.iinfo(jnp.int32).max))
    return jnp.clip((first_slot - mask.window + 1) // C, 0, needed)


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


def _flash_forward(q, k, v, mask: AttentionMask, Q: int, C: int):
    return _per_head(lambda arrays, one: _forward_blocks(*arrays, one, Q, C), (q, k, v), mask)


def _flash_fwd(q, k, v, mask, Q, C):
    out, lse = _flash_forward(q, k, v, mask, Q, C)
    return out, (q, k, v, mask, out, lse)


def _flash_bwd(Q, C, residuals, d_out):
    q, k, v, mask, out, lse = residuals
    d_q, d_k, d_v = _per_head(lambda arrays, one: _backward_blocks(*arrays, one, Q, C),
                              (q, k, v, out, lse, d_out), mask)
    return d_q, d_k, d_v, jax.tree_util.tree_map(_zero_cotangent, mask)


def _per_head(blocks, arrays, mask: AttentionMask):
    """blocks(arrays, mask) with arrays and results (B, K, ...): on the backends of
    PER_HEAD_BACKENDS, in a loop over the B x K (sequence, kv head) pairs, each a call on
    (1, 1, ...) arrays; elsewhere one call on them all. The mask's per-sequence fields follow
    their sequence."""
    B, K = arrays[0].shape[:2]
    if jax.default_backend() not in PER_HEAD_BACKENDS or B * K == 1:
        return blocks(arrays, mask)
    per_sequence = {name: jnp.repeat(x, K, axis=0)[:, None]
                    for name in ("valid", "q_segments", "k_segments")
                    if (x := getattr(mask, name)) is not None and x.shape[0] > 1}

    def one_pair(xs):
        arrays, fields = xs
        return blocks(arrays, mask.replace(**fields))
    pairs = tuple(x.reshape(B * K, 1, 1, *x.shape[2:]) for x in arrays)
    results = jax.lax.map(one_pair, (pairs, per_sequence))
    return jax.tree_util.tree_map(lambda x: x.reshape(B, K, *x.shape[3:]), results)


def _rows(x, start, Q: int):
    """Queries [start, start + Q) of x (B, K, S, G, ...) as Q * G rows: (B, K, M, ...)."""
    block = jax.lax.dynamic_slice_in_dim(x, start, Q, axis=2)
    return block.reshape(*block.shape[:2], -1, *block.shape[4:])


def _row_mask(mask: AttentionMask, q_start, Q: int, G: int, k_start, C: int):
    """The block mask broadcast over the G query heads of each position: (B or 1, 1, M, C)."""
    allowed = mask.block(q_start, Q, k_start, C)                         # (B, Q, C)
    allowed = jnp.broadcast_to(allowed[:, :, None, :], (allowed.shape[0], Q, G, C))
    return allowed.reshape(allowed.shape[0], 1, Q * G, C)


def _forward_blocks(q, k, v, mask: AttentionMask, Q: int, C: int):
    """(out (B, K, S, G, H) in q's dtype, log-sum-exp (B, K, S, G) float32; +inf where a query
    sees no key)."""
    B, K, S, G, H = q.shape
    n_q, n_k, scale, M = S // Q, k.shape[2] // C, 1.0 / math.sqrt(H), Q * G
    k_T = k.transpose(0, 1, 3, 2)                                       # (B, K, H, T)

    def query_block(i):
        q_blk = _rows(q, i * Q, Q)                                      # (B, K, M, H)

        def key_block(j, carry, masked: bool):
            m, l, acc = carry
            kT_blk = jax.lax.dynamic_slice_in_dim(k_T, j * C, C, axis=3)
            v_blk = jax.lax.dynamic_slice_in_dim(v, j * C, C, axis=2)
            # The 1/sqrt(H) is applied in the exponential's pass (and to the row maximum, which it
            # commutes with), not in a pass of its own over the block.
            s = jnp.einsum("BKMH,BKHC->BKMC", q_blk, kT_blk, preferred_element_type=jnp.float32)
            if masked:
                allowed = _row_mask(mask, i * Q, Q, G, j * C, C)
                s = jnp.where(allowed, s, _MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1) * scale)
            p = jnp.exp(s * scale - m_new[..., None])
            if masked:
                p = jnp.where(allowed, p, 0.0)
            correction = jnp.exp(m - m_new)
            l = l * correction + p.sum(-1)
            acc = acc * correction[..., None] + jnp.einsum(
                "BKMC,BKCH->BKMH", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, l, acc

        start = (jnp.full((B, K, M), _MASKED, jnp.float32), jnp.zeros((B, K, M), jnp.float32),
                 jnp.zeros((B, K, M, H), jnp.float32))
        m, l, acc = _sweep(mask, i, Q, C, n_k, key_block, start)
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return out.astype(q.dtype).reshape(B, K, Q, G, H), lse.reshape(B, K, Q, G)

    out, lse = jax.lax.map(query_block, jnp.arange(n_q))   # (n_q, B, K, Q, G, ...)
    out = jnp.moveaxis(out, 0, 2).reshape(B, K, S, G, H)
    lse = jnp.moveaxis(lse, 0, 2).reshape(B, K, S, G)
    return out, lse


def _backward_blocks(q, k, v, out, lse, d_out, mask: AttentionMask, Q: int, C: int):
    """The flash backward in one sweep, the forward's: per query block, over the key blocks it
    sees, each block of probabilities recomputed from the log-sum-exp once; dQ of the query
    block is carried, dK and dV (float32, the keys' size) are added to block by block. No array
    of size S x T is kept.

    The block is worked on transposed, keys by query rows (C, M): then none of its five matmuls
    contracts over the leading axis of a left operand (the rows of an (M, C) block, for dK and
    dV), which XLA:CPU runs at half the speed of the other layouts."""
    B, K, S, G, H = q.shape
    Q, C = _widened(Q, S), _widened(C, k.shape[2])
    n_q, n_k, scale = S // Q, k.shape[2] // C, 1.0 / math.sqrt(H)
    k_T = k.transpose(0, 1, 3, 2)                                       # (B, K, H, T)
    # D = rowsum(dO * O): the softmax's own term in dS = P (dP - D)
    delta = jnp.einsum("BKSGH,BKSGH->BKSG", d_out.astype(jnp.float32), out.astype(jnp.float32))

    def query_block(d_kv, i):
        q_blk, do_blk = _rows(q, i * Q, Q), _rows(d_out, i * Q, Q)       # (B, K, M, H)
        lse_blk, delta_blk = _rows(lse, i * Q, Q)[:, :, None], _rows(delta, i * Q, Q)[:, :, None]

        def key_block(j, carry, masked: bool):
            d_qT, d_k, d_v = carry
            k_blk = jax.lax.dynamic_slice_in_dim(k, j * C, C, axis=2)     # (B, K, C, H)
            v_blk = jax.lax.dynamic_slice_in_dim(v, j * C, C, axis=2)
            kT_blk = jax.lax.dynamic_slice_in_dim(k_T, j * C, C, axis=3)  # (B, K, H, C)
            s = jnp.einsum("BKCH,BKMH->BKCM", k_blk, q_blk,
                           preferred_element_type=jnp.float32) * scale
            p = jnp.exp(s - lse_blk)
            if masked:
                p = jnp.where(_row_mask(mask, i * Q, Q, G, j * C, C).swapaxes(2, 3), p, 0.0)
            d_p = jnp.einsum("BKCH,BKMH->BKCM", v_blk, do_blk, preferred_element_type=jnp.float32)
            d_s = p * (d_p - delta_blk) * scale
            d_qT = d_qT + jnp.einsum("BKHC,BKCM->BKHM", kT_blk.astype(jnp.float32), d_s)
            d_v = _add_block(d_v, j * C, C, jnp.einsum(
                "BKCM,BKMH->BKCH", p.astype(do_blk.dtype), do_blk, preferred_element_type=jnp.float32))
            d_k = _add_block(d_k, j * C, C, jnp.einsum(
                "BKCM,BKMH->BKCH", d_s, q_blk.astype(jnp.float32)))
            return d_qT, d_k, d_v

        d_qT = jnp.zeros((B, K, H, Q * G), jnp.float32)
        d_qT, d_k, d_v = _sweep(mask, i, Q, C, n_k, key_block, (d_qT, *d_kv))
        return (d_k, d_v), d_qT.swapaxes(2, 3).reshape(B, K, Q, G, H)

    zeros = jnp.zeros(k.shape, jnp.float32)
    (d_k, d_v), d_q = jax.lax.scan(query_block, (zeros, zeros), jnp.arange(n_q))
    d_q = jnp.moveaxis(d_q, 0, 2).reshape(q.shape)                       # (n_q, B, K, Q, G, H)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype)


def _widened(block: int, n: int) -> int:
    """The backward's block: BACKWARD_WIDEN forward blocks where they tile n, else the forward's."""
    wide = block * BACKWARD_WIDEN
    return wide if n % wide == 0 else block


def _add_block(x, start, C: int, block):
    """x with block added to its positions [start, start + C) along axis 2 (in place in a loop)."""
    return jax.lax.dynamic_update_slice_in_dim(
        x, jax.lax.dynamic_slice_in_dim(x, start, C, axis=2) + block, start, axis=2)


def _zero_cotangent(x):
    """Integer and boolean inputs take a float0 cotangent."""
    return np.zeros(x.shape, jax.dtypes.float0)


_flash.defvjp(_flash_fwd, _flash_bwd)
