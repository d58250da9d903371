"""The LLaMA decoder in PyTorch: the same math and the same tensor names as jax_llama.model.

Axis legend: B batch, S query sequence, T key sequence, D model dim, N query heads, K kv heads,
G = N/K, H head dim, h = H/2 rotated pairs, F ffn dim, V vocab, L layers.

`state_dict()` keys are the canonical names (bridge.tensors). The model runs in the dtype of its
parameters; RMSNorm statistics, RoPE rotation and logits are float32. `model(tokens)` gives the
logits; `model.run(...)` gives a LlamaOutput (logits, hidden states, cache) and, with a KVCache,
appends its tokens to the cache and attends over everything cached so far (generation).

Each projection is a Linear, which can carry a LoRA adapter (torch_llama.lora adds them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bridge.config import LlamaConfig, RopeScaling
from bridge.dtypes import dtype_name
from bridge.errors import BridgeError
from bridge.formats.torch_files import to_numpy
from bridge.inputs import check_inputs as _check_inputs
from bridge.lora import LoraConfig
from bridge.quantize import Quantization, quantize_weight
from bridge.rope import rope_inv_freq


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


@dataclass
class AttentionMask:
    """Query s may attend key slot t when t <= q_slots[s] (causal), valid[b, t] (a real token)
    and q_segments[b, s] == k_segments[b, t] (same document); None fields are not restrictions
    (jax_llama.attention.AttentionMask's twin, which builds the dense mask only for the
    implementations that need it; SDPA here always does)."""

    q_slots: torch.Tensor                      # (S,) int64: the key slot each query occupies
    valid: torch.Tensor | None = None          # (B, T) bool
    q_segments: torch.Tensor | None = None     # (B, S)
    k_segments: torch.Tensor | None = None     # (B, T)
    # additive() of this mask by (T, dtype): every layer of a forward pass attends with the same
    # mask, so it is built once (a decode step makes a new mask; it is not kept across steps)
    _biases: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def causal(cls, S: int, valid_BS=None, segments_BS=None, device=None) -> "AttentionMask":
        """S tokens attending to themselves (no cache): query s at slot s."""
        return cls(q_slots=torch.arange(S, device=device), valid=valid_BS,
                   q_segments=segments_BS, k_segments=segments_BS)

    def dense(self, T: int) -> torch.Tensor:
        """The (B or 1, S, T) boolean mask."""
        k_slots = torch.arange(T, device=self.q_slots.device)
        allowed = (k_slots[None, :] <= self.q_slots[:, None])[None]
        if self.valid is not None:
            allowed = allowed & self.valid[:, None, :]
        if self.q_segments is not None:
            allowed = allowed & (self.q_segments[:, :, None] == self.k_segments[:, None, :])
        return allowed

    def additive(self, T: int, dtype: torch.dtype) -> torch.Tensor:
        """dense(T) as SDPA's additive bias (B or 1, 1, S, T) in `dtype` (_additive), built
        once per mask."""
        key = (T, dtype)
        if key not in self._biases:
            self._biases[key] = _additive(self.dense(T)[:, None], dtype)
        return self._biases[key]


# -- the key/value cache for generation ----------------------------------------------------------

@dataclass
# --8<-- [start:kv_cache]
class KVCache:
    """Keys and values of every layer for T slots, preallocated once per generation.

    Every row writes the same slot at each step (`index`); a row's left padding occupies slots
    marked invalid, so its RoPE positions (`positions`) count real tokens only. Heads come before
    slots, the layout SDPA reads without a copy. Updated in place (jax_llama's is functional).
    """
    k: torch.Tensor          # (L, B, K, T, H) in the model's dtype
    v: torch.Tensor          # (L, B, K, T, H)
    valid: torch.Tensor      # (B, T) bool: slots that hold a real (non-padding) token
    index: int               # the next slot to write, shared by all rows
    positions: torch.Tensor  # (B,) int64: the RoPE position of each row's next real token

    @classmethod
    def create(cls, config: LlamaConfig, batch: int, length: int,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "KVCache":
        """A cache of `length` slots, all invalid. Zeros, not torch.empty: unwritten slots are
        masked, but a masked NaN would still poison the weighted sum (0 * NaN = NaN)."""
        shape = (config.n_layers, batch, config.n_kv_heads, length, config.head_dim)
        return cls(k=torch.zeros(shape, dtype=dtype, device=device),
                   v=torch.zeros(shape, dtype=dtype, device=device),
                   valid=torch.zeros(batch, length, dtype=torch.bool, device=device),
                   index=0, positions=torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def length(self) -> int:
        """T, the slots it holds."""
        return self.k.shape[3]

    def reserve(self, valid_BS: torch.Tensor):
        """Make room for S new tokens at slots [index, index + S), valid where valid_BS (B, S) is
        -> (this cache, advanced in place; the AttentionMask of the new queries: each sees the
        valid slots up to its own; positions (B, S) of the new tokens)."""
        (B, S), T, start = valid_BS.shape, self.length, self.index
        if self.valid.shape[0] != B:
            raise BridgeError(f"batch {self.valid.shape[0]} does not match tokens {B}", field="cache")
        if start + S > T:
            raise BridgeError(f"{S} tokens at slot {start} do not fit the cache length {T}",
                              field="cache")
        valid_BS = valid_BS.to(self.valid.device)
        self.valid[:, start:start + S] = valid_BS
        mask = AttentionMask(q_slots=torch.arange(start, start + S, device=self.valid.device),
                             valid=self.valid)
        positions_BS = self.positions[:, None] + default_positions(valid_BS)
        self.positions += valid_BS.sum(-1)
        self.index += S
        return self, mask, positions_BS
# --8<-- [end:kv_cache]


@dataclass
class LlamaOutput:
    """What Llama.run returns, the same in both twins."""

    logits: torch.Tensor | None      # (B, S, V) float32; None with lm_head=False
    hidden: torch.Tensor             # (B, S, D) final hidden states (after the last norm)
    cache: KVCache | None = None     # the cache advanced by these S tokens, when one was given


# -- the transformer -----------------------------------------------------------------------------

class Int8Weight:
    """What a module whose `weight` (out, in) can be int8 shares (Linear, Embedding): Q as a
    frozen int8 `weight` beside float32 scales (out, G), the buffer `weight_scale`."""

    def quantize(self, quantization: Quantization, name: str = "weight") -> None:
        """Replace W by int8 Q (a frozen `weight`) and float32 scales (`weight_scale`, a buffer):
        bridge.quantize.quantize_weight's numbers, the JAX twin's."""
        q_OI, scale_OG = quantize_weight(to_numpy(self.weight.detach()), quantization.group_size,
                                         name)
        self.make_int8(scale_OG.shape[1])
        with torch.no_grad():
            self.weight.copy_(torch.from_numpy(q_OI))
            self.weight_scale.copy_(torch.from_numpy(scale_OG))

    def _scale_in(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The per-channel scales (G = 1) as an (out,) vector in `dtype`, what torch's int8
        kernel multiplies by: converted once, not at every call (a decode step makes one call per
        projection), and again whenever weight_scale changes (a load writes it in place, .to()
        replaces it). None for group-wise scales."""
        scale = self.weight_scale
        if scale.shape[1] != 1:
            return None
        try:
            key = (dtype, scale.data_ptr(), scale._version)
        except RuntimeError:  # an inference tensor keeps no version: convert every call
            return scale[:, 0].to(dtype)
        if getattr(self, "_scale_key", None) != key:
            self._scale_vec, self._scale_key = scale[:, 0].to(dtype), key
        return self._scale_vec

    def make_int8(self, groups: int) -> None:
        """Turn W into an (uninitialised) int8 weight with `groups` scales per row, on W's
        device (meta included): what loading a quantised checkpoint fills."""
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=torch.int8, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(self.weight.shape[0], groups,
                                                         dtype=torch.float32, device=device))


class Linear(Int8Weight, nn.Linear):
    """x W^T without bias (W (out, in) keeps nn.Linear's name, `weight`), plus, once add_adapter
    is called, a LoRA update scale * B A dropout(x) with A (rank, in) and B (out, rank) in
    float32 as `lora_A.weight` and `lora_B.weight`: the canonical adapter names."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.lora: LoraConfig | None = None

    def add_adapter(self, lora: LoraConfig) -> None:
        """A as PEFT initialises it (nn.Linear's Kaiming-uniform, U(+-1/sqrt(in))), B zero: the
        output is unchanged until B trains. Drawn on the CPU, so that a seed gives the same A on
        every device, then moved to W's device."""
        a = nn.Linear(self.in_features, lora.rank, bias=False, device="cpu", dtype=torch.float32)
        b = nn.Linear(lora.rank, self.out_features, bias=False, device="cpu", dtype=torch.float32)
        nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
        nn.init.zeros_(b.weight)
        self.lora_A, self.lora_B = a.to(self.weight.device), b.to(self.weight.device)
        self.lora_dropout = nn.Dropout(lora.dropout)  # active in train() only
        self.lora = lora

    def merge_adapter(self) -> None:
        """W + scale * B A, summed in float32 (float64 for float64 W) and rounded once to W's
        dtype (bridge.lora.merge_weight's arithmetic); then a plain projection again."""
        wide = torch.promote_types(self.weight.dtype, torch.float32)
        with torch.no_grad():
            update = self.lora.scale * (self.lora_B.weight.to(wide) @ self.lora_A.weight.to(wide))
            self.weight.copy_(self.weight.to(wide) + update)
        del self.lora_A, self.lora_B, self.lora_dropout
        self.lora = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.int8:
            y = int8_linear(x, self.weight, self.weight_scale, self._scale_in(x.dtype))
        else:
            y = super().forward(x)
        if self.lora is None:
            return y
        # The float32 adapters run in x's dtype, as the projection itself does.
        a, b = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)
        return y + F.linear(F.linear(self.lora_dropout(x), a), b) * self.lora.scale


def int8_linear(x: torch.Tensor, q_OI: torch.Tensor, scale_OG: torch.Tensor,
                scale_O: torch.Tensor | None = None) -> torch.Tensor:
    """x Q^T scaled, for int8 Q (out, in) and float32 scales (out, G) (bridge.quantize), in x's
    dtype: jax_llama.projections.int8_matmul's twin. Per channel (G = 1), (x Q^T) * s - through
    torch's int8 weight kernel when x is bfloat16 on a CPU or CUDA device, which reads the int8
    weight as it multiplies; group-wise, each group dequantised in float32, rounded once.
    scale_O: the per-channel scales already in x's dtype (Linear keeps them), else converted."""
    O, I = q_OI.shape
    G = scale_OG.shape[1]
    if G == 1:
        scale_O = scale_OG[:, 0].to(x.dtype) if scale_O is None else scale_O
        if x.dtype == torch.bfloat16 and x.device.type in ("cpu", "cuda"):
            y = torch._weight_int8pack_mm(x.reshape(-1, I), q_OI, scale_O)
            return y.reshape(*x.shape[:-1], O)
        return F.linear(x, q_OI.to(x.dtype)) * scale_O
    w_OGi = q_OI.view(O, G, I // G).to(torch.float32) * scale_OG[..., None]
    return F.linear(x, w_OGi.view(O, I).to(x.dtype))


class Embedding(Int8Weight, nn.Embedding):
    """The token embedding (vocab, dim) as `weight`: a lookup, and the LM head of a tied model
    (`head`, x W^T). Int8 once quantised (torch_llama.quantize of a tied model): a token's row is
    Q[t] * s[t] in float32 (bridge.quantize.dequantize_weight's numbers), and the head multiplies
    by Q as an int8 Linear does; jax_llama.projections.Embed is the twin."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != torch.int8:
            return super().forward(tokens)
        q_D, s_G = self.weight[tokens], self.weight_scale[tokens]
        rows = q_D.view(*q_D.shape[:-1], s_G.shape[-1], -1).to(torch.float32) * s_G[..., None]
        return rows.view(q_D.shape)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != torch.int8:
            return F.linear(h, self.weight.to(h.dtype))
        return int8_linear(h, self.weight, self.weight_scale, self._scale_in(h.dtype))


# --8<-- [start:attention]
class Attention(nn.Module):
    """Grouped-query attention through F.scaled_dot_product_attention (enable_gqa: K/V not copied
    by us; the fused kernels read each kv head for its G query heads)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = self.config = config
        self.wq = Linear(c.dim, c.n_heads * c.head_dim)
        self.wk = Linear(c.dim, c.n_kv_heads * c.head_dim)
        self.wv = Linear(c.dim, c.n_kv_heads * c.head_dim)
        self.wo = Linear(c.n_heads * c.head_dim, c.dim)

    def forward(self, x_BSD, cos_BSh, sin_BSh, mask: AttentionMask | None = None,
                cache: KVCache | None = None, layer: int = 0):
        """x (B, S, D) -> out (B, S, D).

        mask: which key each query may attend (causal, padding, segments); None is plain causal
        attention over these S tokens (SDPA's is_causal: its flash kernels). With a cache (already reserved for these tokens), the new
        keys and values go into slots [index - S, index) of `layer` and the queries read all T
        slots of that layer.
        """
        c = self.config
        B, S, _ = x_BSD.shape
        q_BSNH = rotate(self.wq(x_BSD).view(B, S, c.n_heads, c.head_dim), cos_BSh, sin_BSh)
        k_BSKH = rotate(self.wk(x_BSD).view(B, S, c.n_kv_heads, c.head_dim), cos_BSh, sin_BSh)
        v_BSKH = self.wv(x_BSD).view(B, S, c.n_kv_heads, c.head_dim)
        # SDPA wants heads before sequence: (B, N, S, H) and (B, K, T, H).
        k_BKTH, v_BKTH = k_BSKH.transpose(1, 2), v_BSKH.transpose(1, 2)
        if cache is not None:
            cache.k[layer, :, :, cache.index - S:cache.index] = k_BKTH
            cache.v[layer, :, :, cache.index - S:cache.index] = v_BKTH
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
        self.lora: LoraConfig | None = None  # the adapters' settings, between add_lora and merge_lora
        # Kept off the module's buffers so that casting the model to bfloat16 cannot round it.
        self._inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02), with the projections into the residual stream (wo, w2) scaled by
        1/sqrt(2L); norms at one. The same distributions as jax_llama.init."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
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
        document of a packed row: a token attends only within its own); with a cache the S tokens go into slots [index, index + S) and attend to every
        earlier valid slot; lm_head=False skips the vocabulary projection (logits None).
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
        elif attention_mask is not None or segment_ids is not None:
            segments_BS = None if segment_ids is None else torch.as_tensor(segment_ids, device=device)
            mask = AttentionMask.causal(S, None if attention_mask is None else valid_BS,
                                        segments_BS, device=device)
            if positions is None:
                positions = default_positions(valid_BS, segments_BS)
        if positions is None:
            positions = torch.arange(S, device=device)
        positions = torch.as_tensor(positions, device=device)
        cos_BSh, sin_BSh = rope_cos_sin(positions, self._inv_freq_for(device))

        # --8<-- [start:embedding]
        # .to: a no-op unless LoRA trains the embedding table in float32 under a lower-precision model
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


def last_real_index(attention_mask_BS) -> torch.Tensor:
    """(B,) index of each row's last real token, wherever the padding is (left, right or both)."""
    mask_BS = torch.as_tensor(attention_mask_BS).bool()
    return mask_BS.shape[1] - 1 - mask_BS.flip(1).int().argmax(1)


# --8<-- [start:classifier]
class LlamaClassifier(nn.Module):
    """A Llama backbone and a classification head: the final hidden state of each row's last real
    token, dropout, a linear layer to n_classes, log-softmax (jax_llama.LlamaClassifier's twin).

    The head's tensors are `classifier.weight` (C, D) and `classifier.bias` (C,); the backbone is
    `llama`, whose state_dict keys are the canonical names.
    """

    def __init__(self, config: LlamaConfig, n_classes: int, dropout: float = 0.0):
        super().__init__()
        self.config, self.n_classes = config, n_classes
        self.llama = Llama(config)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.dim, n_classes)
        nn.init.normal_(self.classifier.weight, std=0.02)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, tokens_BS: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """tokens (B, S) int, attention_mask (B, S) with at least one real token per row ->
        log-probabilities (B, C) float32."""
        h_BSD = self.llama.run(tokens_BS, attention_mask=attention_mask, lm_head=False).hidden
        last_B = last_real_index(attention_mask).to(h_BSD.device)
        h_BD = self.dropout(h_BSD[torch.arange(h_BSD.shape[0], device=h_BSD.device), last_B])
        return F.log_softmax(self.classifier(h_BD).float(), dim=-1)
# --8<-- [end:classifier]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, the dtype's most negative finite value elsewhere: a query with every key
    masked (a padding query) then gets a uniform distribution instead of the NaN of -inf."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)


def check_inputs(tokens: torch.Tensor, vocab_size: int, positions=None, attention_mask=None,
                 segment_ids=None) -> None:
    """bridge.inputs.check_inputs on torch values (the same rules as jax_llama.check_inputs):
    shapes always, token values only where they are on the host already (a CPU tensor) - never
    a copy off an accelerator, which would stall every decode step."""
    integer = _is_integer(tokens)
    _check_inputs(tokens.shape, integer, vocab_size,
                  ids=tokens.detach().numpy() if integer and tokens.device.type == "cpu" else None,
                  positions_shape=None if positions is None else np.shape(positions),
                  mask_shape=None if attention_mask is None else np.shape(attention_mask),
                  segments_shape=None if segment_ids is None else np.shape(segment_ids),
                  segments_integer=segment_ids is None or _is_integer(torch.as_tensor(segment_ids)))


def _is_integer(x: torch.Tensor) -> bool:
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


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
