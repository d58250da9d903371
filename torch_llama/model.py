"""The LLaMA decoder in PyTorch: the same math and the same tensor names as jax_llama.model.

Axis legend: B batch, S query sequence, T key sequence, D model dim, N query heads, K kv heads,
G = N/K, H head dim, h = H/2 rotated pairs, F ffn dim, V vocab, L layers.

`state_dict()` keys are the canonical names (bridge.tensors). The model runs in the dtype of its
parameters; RMSNorm statistics, RoPE rotation and logits are float32. `model(tokens)` gives the
logits; `model.run(...)` gives a LlamaOutput (logits, hidden states, cache) and, with a KVCache,
appends its tokens to the cache and attends over everything cached so far (generation).

Each projection is a Linear and the embedding an Embedding, the implementation the model is
handed (torch_llama.projections: how a weight is stored and what a projection carries besides it
live there); the attention mask and its additive bias are torch_llama.attention's; the
classifier head is in torch_llama.heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bridge.config import LlamaConfig, RopeScaling, rolling_cache
from bridge.dtypes import dtype_name
from bridge.errors import BridgeError
from bridge.rope import rope_inv_freq

from .attention import AttentionMask
from .inputs import check_inputs
from .projections import Embedding, Linear


# --8<-- [start:rmsnorm]
class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, with the statistics in float32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x = x_BSD.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x.to(x_BSD.dtype) * self.weight.to(x_BSD.dtype)
# --8<-- [end:rmsnorm]


# -- rotary position embedding: interleaved pairs (2i, 2i+1), as in Meta's release -----------------

# --8<-- [start:rope]
def rope_cos_sin(positions, inv_freq_h):
    """cos and sin of position * inv_freq, each float32 of shape (B or 1, S, h).

    `positions` (S,) or (B, S) integers; inv_freq_h (h,) from bridge.rope.rope_inv_freq (numpy,
    or a tensor already on the positions' device). Only the positions given are computed.
    """
    positions = torch.as_tensor(positions)
    if positions.ndim == 1:
        positions = positions[None, :]
    inv_freq_h = torch.as_tensor(inv_freq_h, device=positions.device)
    angles_BSh = positions[..., None].float() * inv_freq_h
    return angles_BSh.cos(), angles_BSh.sin()


def rotate(x_BSNH: torch.Tensor, cos_BSh: torch.Tensor, sin_BSh: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of the last axis by the angle whose cos/sin are given."""
    x = x_BSNH.float().reshape(*x_BSNH.shape[:-1], -1, 2)  # (B, S, N, h, 2)
    x_even, x_odd = x[..., 0], x[..., 1]
    cos, sin = cos_BSh[:, :, None, :], sin_BSh[:, :, None, :]
    out = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
    return out.reshape(x_BSNH.shape).to(x_BSNH.dtype)


def apply_rope(x_BSNH: torch.Tensor, positions, theta: float = 10000.0,
               scaling: RopeScaling | None = None) -> torch.Tensor:
    """RoPE on x (B, S, N, H) at `positions` (S,) or (B, S); returns x's shape and dtype."""
    inv_freq_h = rope_inv_freq(x_BSNH.shape[-1], theta, scaling)
    return rotate(x_BSNH, *rope_cos_sin(torch.as_tensor(positions, device=x_BSNH.device), inv_freq_h))
# --8<-- [end:rope]


def default_positions(valid_BS: torch.Tensor, segments_BS: torch.Tensor | None = None) -> torch.Tensor:
    """(B, S) RoPE positions that count only real tokens (valid_BS True), restarting at 0 where a
    segment begins (jax_llama.model.default_positions' twin). Segments are contiguous runs."""
    valid_BS = valid_BS.long()
    seen_BS = valid_BS.cumsum(-1)                              # real tokens up to and including s
    if segments_BS is None:
        return (seen_BS - 1).clamp(min=0)
    S = valid_BS.shape[1]
    starts_BS = torch.ones_like(segments_BS, dtype=torch.bool)
    starts_BS[:, 1:] = segments_BS[:, 1:] != segments_BS[:, :-1]
    index_S = torch.arange(S, device=valid_BS.device)
    start_BS = torch.where(starts_BS, index_S, 0).cummax(dim=1).values
    before_BS = (seen_BS - valid_BS).gather(1, start_BS)     # real tokens before the segment
    return (seen_BS - 1 - before_BS).clamp(min=0)


# -- the key/value cache for generation ----------------------------------------------------------

@dataclass
# --8<-- [start:kv_cache]
class KVCache:
    """Keys and values of every layer for T slots, preallocated once per generation.

    Every row writes the same slot at each step (`index`); a row's left padding occupies slots
    marked invalid, so its RoPE positions (`positions`) count real tokens only. Heads come before
    slots, the layout SDPA reads without a copy. Updated in place (jax_llama's is functional).

    With a sliding window of W a query needs only the W - 1 slots before its own, so a long
    generation can keep a rolling cache (create(rolling=True), sized by
    bridge.config.rolling_cache): T = W + chunk - 1 entries used in turn, slot s in entry s % T,
    `slots` saying which slot each entry holds; `index` still counts every slot written, and one
    call writes at most `chunk` tokens.
    """
    k: torch.Tensor          # (L, B, K, T, H) in the model's dtype
    v: torch.Tensor          # (L, B, K, T, H)
    valid: torch.Tensor      # (B, T) bool: slots that hold a real (non-padding) token
    index: int               # the next slot to write, shared by all rows
    positions: torch.Tensor  # (B,) int64: the RoPE position of each row's next real token
    window: int | None = None          # LlamaConfig.sliding_window
    slots: torch.Tensor | None = None  # (T,) int64, rolling only: each entry's slot (-1: none yet)

    @classmethod
    def create(cls, config: LlamaConfig, batch: int, length: int,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               rolling: bool = False) -> "KVCache":
        """A cache of `length` slots, all invalid; rolling: as few entries as the model's sliding
        window needs (bridge.config.rolling_cache), where it has one and `length` is longer.
        Zeros, not torch.empty: unwritten slots are masked, but a masked NaN would still poison
        the weighted sum (0 * NaN = NaN)."""
        ring = rolling_cache(config, length) if rolling else None
        T = length if ring is None else ring[0]
        shape = (config.n_layers, batch, config.n_kv_heads, T, config.head_dim)
        return cls(k=torch.zeros(shape, dtype=dtype, device=device),
                   v=torch.zeros(shape, dtype=dtype, device=device),
                   valid=torch.zeros(batch, T, dtype=torch.bool, device=device),
                   index=0, positions=torch.zeros(batch, dtype=torch.long, device=device),
                   window=config.sliding_window,
                   slots=None if ring is None else torch.full((T,), -1, device=device))

    @property
    def length(self) -> int:
        """T, the slots (a rolling cache: the entries) it holds."""
        return self.k.shape[3]

    @property
    def chunk(self) -> int | None:
        """The most tokens one call may write: a rolling cache's entries less the W - 1 that its
        first new query reads; None for a plain cache (as many as it has slots)."""
        return None if self.slots is None else self.length - self.window + 1

    def reserve(self, valid_BS: torch.Tensor):
        """Make room for S new tokens at slots [index, index + S), valid where valid_BS (B, S) is
        -> (this cache, advanced in place; the AttentionMask of the new queries: each sees the
        valid slots up to its own, within the window; positions (B, S) of the new tokens)."""
        (B, S), T, start = valid_BS.shape, self.length, self.index
        if self.valid.shape[0] != B:
            raise BridgeError(f"batch {self.valid.shape[0]} does not match tokens {B}", field="cache")
        if self.slots is None and start + S > T:
            raise BridgeError(f"{S} tokens at slot {start} do not fit the cache length {T}",
                              field="cache")
        if self.slots is not None and S > self.chunk:
            raise BridgeError(f"{S} tokens in one call, more than the {self.chunk} a rolling cache "
                              f"of {T} entries takes (window {self.window}): write them in chunks",
                              field="tokens")
        valid_BS = valid_BS.to(self.valid.device)
        q_slots = torch.arange(start, start + S, device=self.valid.device)
        entries = self._entries(start, S)
        self.valid[:, entries] = valid_BS
        if self.slots is not None:
            self.slots[entries] = q_slots
        mask = AttentionMask(q_slots=q_slots, valid=self.valid, k_slots=self.slots,
                             window=self.window)
        positions_BS = self.positions[:, None] + default_positions(valid_BS)
        self.positions += valid_BS.sum(-1)
        self.index += S
        return self, mask, positions_BS

    def write(self, layer: int, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor) -> None:
        """The keys and values of the S tokens reserved last, written into layer `layer` in
        place: slots [index - S, index), or a rolling cache's entries for them."""
        entries = self._entries(self.index - k_BKSH.shape[2], k_BKSH.shape[2])
        self.k[layer][:, :, entries] = k_BKSH
        self.v[layer][:, :, entries] = v_BKSH

    def _entries(self, start: int, S: int):
        """Where slots [start, start + S) live: that slice of a plain cache; entries slot % T of
        a rolling one, an (S,) index."""
        if self.slots is None:
            return slice(start, start + S)
        return torch.arange(start, start + S, device=self.valid.device) % self.length
# --8<-- [end:kv_cache]


@dataclass
class LlamaOutput:
    """What Llama.run returns, the same in both twins."""

    logits: torch.Tensor | None      # (B, S, V) float32; None with lm_head=False
    hidden: torch.Tensor             # (B, S, D) final hidden states (after the last norm)
    cache: KVCache | None = None     # the cache advanced by these S tokens, when one was given


# -- the transformer -----------------------------------------------------------------------------

# --8<-- [start:attention]
class Attention(nn.Module):
    """Grouped-query attention through F.scaled_dot_product_attention (enable_gqa: K/V not copied
    by us; SDPA's fused implementations read each kv head for its G query heads)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = self.config = config
        # --8<-- [start:deltas]
        self.wq = Linear(c.dim, c.n_heads * c.head_dim, bias=c.qkv_bias)  # Qwen2: W x + b
        self.wk = Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.wv = Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.wo = Linear(c.n_heads * c.head_dim, c.dim)
        if c.qk_norm:  # Qwen3: each head's q and k normalised, weights (H,) shared by the heads
            self.q_norm = RMSNorm(c.head_dim, c.norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.norm_eps)
        # --8<-- [end:deltas]

    def forward(self, x_BSD, cos_BSh, sin_BSh, mask: AttentionMask | None = None,
                cache: KVCache | None = None, layer: int = 0):
        """x (B, S, D) -> out (B, S, D).

        mask: which key each query may attend (causal, padding, segments); None is plain causal
        attention over these S tokens (SDPA's is_causal: its flash attention). With a cache
        (already reserved for these tokens), the new keys and values go into the entries of slots
        [index - S, index) of `layer` and the queries read all T entries of that layer.
        """
        c = self.config
        B, S, _ = x_BSD.shape
        q_BSNH = self.wq(x_BSD).view(B, S, c.n_heads, c.head_dim)
        k_BSKH = self.wk(x_BSD).view(B, S, c.n_kv_heads, c.head_dim)
        v_BSKH = self.wv(x_BSD).view(B, S, c.n_kv_heads, c.head_dim)
        # --8<-- [start:qk_norm]
        if c.qk_norm:
            q_BSNH, k_BSKH = self.q_norm(q_BSNH), self.k_norm(k_BSKH)
        # --8<-- [end:qk_norm]
        q_BSNH, k_BSKH = rotate(q_BSNH, cos_BSh, sin_BSh), rotate(k_BSKH, cos_BSh, sin_BSh)
        # SDPA wants heads before sequence: (B, N, S, H) and (B, K, T, H).
        k_BKTH, v_BKTH = k_BSKH.transpose(1, 2), v_BSKH.transpose(1, 2)
        if cache is not None:
            cache.write(layer, k_BKTH, v_BKTH)
            k_BKTH, v_BKTH = cache.k[layer], cache.v[layer]
        bias_B1ST = None if mask is None else mask.additive(k_BKTH.shape[2], q_BSNH.dtype)
        out_BNSH = F.scaled_dot_product_attention(
            q_BSNH.transpose(1, 2), k_BKTH, v_BKTH,
            attn_mask=bias_B1ST, is_causal=mask is None, enable_gqa=c.n_groups > 1)
        return self.wo(out_BNSH.transpose(1, 2).reshape(B, S, c.n_heads * c.head_dim))
# --8<-- [end:attention]


# --8<-- [start:feed_forward]
class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = Linear(config.dim, config.ffn_dim)
        self.w2 = Linear(config.ffn_dim, config.dim)
        self.w3 = Linear(config.dim, config.ffn_dim)

    def forward(self, x_BSD):
        return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))
# --8<-- [end:feed_forward]


# --8<-- [start:block]
class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then h + ffn(norm(h))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x_BSD, cos_BSh, sin_BSh, mask: AttentionMask | None = None,
                cache: KVCache | None = None, layer: int = 0):
        h = x_BSD + self.attention(self.attention_norm(x_BSD), cos_BSh, sin_BSh, mask, cache,
                                   layer)
        return h + self.feed_forward(self.ffn_norm(h))
# --8<-- [end:block]


# --8<-- [start:model]
class Llama(nn.Module):
    """Token embedding, n_layers blocks, final RMSNorm, LM head (tied to the embedding or not)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = self.config = config
        self.tok_embeddings = Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = None if c.tie_embeddings else Linear(c.dim, c.vocab_size)
        # Kept off the module's buffers so that casting the model to bfloat16 cannot round it.
        self._inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02), with the projections into the residual stream (wo, w2) scaled by
        1/sqrt(2L); norms at one, biases at zero. The same distributions as jax_llama.init."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=residual_std)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens_BS: torch.Tensor, positions=None, attention_mask=None,
                segment_ids=None) -> torch.Tensor:
        """tokens (B, S) int -> logits (B, S, V) float32 (see run for the arguments)."""
        return self.run(tokens_BS, positions, attention_mask, segment_ids).logits

    def run(self, tokens_BS: torch.Tensor, positions=None, attention_mask=None, segment_ids=None,
            cache: KVCache | None = None, lm_head: bool = True) -> LlamaOutput:
        """tokens (B, S) int -> LlamaOutput(logits (B, S, V) float32, final hidden states
        (B, S, D), the cache advanced in place when one is given).

        positions, attention_mask, segment_ids, cache and lm_head as in jax_llama.Llama.run:
        positions (S,) or (B, S), by default counting only real tokens when attention_mask
        (B, S, 1 = real) is given and restarting at each segment (segment_ids (B, S), one id per
        document of a packed row: a token attends only within its own); with a cache the S tokens
        go into slots [index, index + S) and attend to every earlier valid slot; with
        config.sliding_window W a query attends only the last W slots, its own included (always a
        mask then: SDPA's is_causal knows no window); lm_head=False skips the vocabulary
        projection (logits None).
        """
        c = self.config
        check_inputs(tokens_BS, c.vocab_size, positions, attention_mask, segment_ids)
        B, S = tokens_BS.shape
        if S > c.max_seq_len:
            raise BridgeError(f"{S} tokens in a row, more than max_seq_len {c.max_seq_len}",
                              field="tokens")
        device = tokens_BS.device
        valid_BS = (torch.ones(B, S, dtype=torch.bool, device=device) if attention_mask is None
                    else torch.as_tensor(attention_mask, device=device).bool())
        mask = None  # plain causal
        if cache is not None:
            if segment_ids is not None:
                raise BridgeError("not with a KV cache (segments are for packed training rows)",
                                  field="segment_ids")
            cache, mask, cached_positions = cache.reserve(valid_BS)
            positions = cached_positions if positions is None else positions
        elif attention_mask is not None or segment_ids is not None or c.sliding_window is not None:
            segments_BS = None if segment_ids is None else torch.as_tensor(segment_ids, device=device)
            mask = AttentionMask.causal(S, None if attention_mask is None else valid_BS,
                                        segments_BS, c.sliding_window, device=device)
            if positions is None:
                positions = default_positions(valid_BS, segments_BS)
        if positions is None:
            positions = torch.arange(S, device=device)
        positions = torch.as_tensor(positions, device=device)
        cos_BSh, sin_BSh = rope_cos_sin(positions, self._inv_freq_for(device))

        # --8<-- [start:embedding]
        # .to: a no-op unless the table is kept in another dtype than the model (float32, to train)
        x_BSD = self.tok_embeddings(tokens_BS).to(self.norm.weight.dtype)
        # --8<-- [end:embedding]
        for i, layer in enumerate(self.layers):
            x_BSD = layer(x_BSD, cos_BSh, sin_BSh, mask, cache, i)
        h_BSD = self.norm(x_BSD)
        if not lm_head:
            return LlamaOutput(logits=None, hidden=h_BSD, cache=cache)
        # --8<-- [start:lm_head]
        if self.output is None:
            logits_BSV = self.tok_embeddings.head(h_BSD)
        else:
            logits_BSV = self.output(h_BSD)
        # --8<-- [end:lm_head]
        return LlamaOutput(logits=logits_BSV.float(), hidden=h_BSD, cache=cache)

    def _inv_freq_for(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq_on:
            self._inv_freq_on[device] = torch.from_numpy(self._inv_freq).to(device)
        return self._inv_freq_on[device]
# --8<-- [end:model]


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' picks CUDA, then MPS, then CPU; anything else is passed to torch.device."""
    if str(device) != "auto":
        try:
            return torch.device(device)
        except RuntimeError as e:
            raise BridgeError(f"device: {e}") from None
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_dtype(dtype) -> torch.dtype:
    """A torch dtype from a dtype or its name ('float32', 'bfloat16', 'float16')."""
    return getattr(torch, dtype_name(dtype))


def init(config: LlamaConfig, seed: int = 0, *, dtype=torch.float32,
         device: torch.device | str = "cpu") -> Llama:
    """A Llama with freshly initialised weights drawn from `seed` (the caller's torch RNG is left
    as it was), in eval mode; jax_llama.init's twin (the same distributions, not the same draws)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Llama(config)
    return model.to(device=resolve_device(device), dtype=resolve_dtype(dtype)).eval()
