"""The LLaMA decoder in PyTorch: the same math and the same tensor names as jax_llama.model.

Axis legend: B batch, S query sequence, T key sequence, D model dim, N query heads, K kv heads,
G = N/K, H head dim, h = H/2 rotated pairs, F ffn dim, V vocab, L layers.

`state_dict()` keys are the canonical names (bridge.tensors). The model runs in the dtype of its
parameters; RMSNorm statistics, RoPE rotation and logits are float32. With a KVCache, a forward
call appends its tokens to the cache and attends over everything cached so far (generation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bridge.config import LlamaConfig, RopeScaling
from bridge.errors import BridgeError
from bridge.inputs import check_inputs as _check_inputs
from bridge.rope import rope_inv_freq


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


# -- rotary position embedding: interleaved pairs (2i, 2i+1), as in Meta's release -----------------

def rope_cos_sin(positions: torch.Tensor, inv_freq_h: torch.Tensor):
    """cos and sin of position * inv_freq, each float32 (B or 1, S, h)."""
    if positions.ndim == 1:
        positions = positions[None, :]
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
    inv_freq = torch.from_numpy(rope_inv_freq(x_BSNH.shape[-1], theta, scaling)).to(x_BSNH.device)
    positions = torch.as_tensor(positions, device=x_BSNH.device)
    return rotate(x_BSNH, *rope_cos_sin(positions, inv_freq))


# -- the key/value cache for generation ----------------------------------------------------------

@dataclass
class KVCache:
    """Keys and values of every layer for T slots, preallocated once per generation.

    Every row writes the same slot at each step (`index`); a row's left padding occupies slots
    marked invalid, so its RoPE positions (`positions`) count real tokens only.
    """
    k: torch.Tensor          # (L, B, K, T, H) in the model's dtype: heads before slots, the
    v: torch.Tensor          # (L, B, K, T, H)   layout SDPA reads without a copy
    valid: torch.Tensor      # (B, T) bool: slots that hold a real (non-padding) token
    index: int               # the next slot to write, shared by all rows
    positions: torch.Tensor  # (B,) int64: the RoPE position of each row's next real token

    @classmethod
    def empty(cls, config: LlamaConfig, batch: int, length: int, dtype: torch.dtype,
              device: torch.device | str) -> "KVCache":
        """A cache of `length` slots, all invalid. Zeros, not torch.empty: unwritten slots are
        masked, but a masked NaN would still poison the weighted sum (0 * NaN = NaN)."""
        shape = (config.n_layers, batch, config.n_kv_heads, length, config.head_dim)
        return cls(k=torch.zeros(shape, dtype=dtype, device=device),
                   v=torch.zeros(shape, dtype=dtype, device=device),
                   valid=torch.zeros(batch, length, dtype=torch.bool, device=device),
                   index=0, positions=torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def length(self) -> int:
        return self.k.shape[3]


# -- the transformer -----------------------------------------------------------------------------

class Attention(nn.Module):
    """Grouped-query attention through F.scaled_dot_product_attention (enable_gqa: K/V not copied
    by us; the fused kernels read each kv head for its G query heads)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = self.config = config
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)

    def forward(self, x_BSD, cos_BSh, sin_BSh, bias_B1ST=None, cache: KVCache | None = None,
                layer: int = 0):
        """bias_B1ST: None for plain causal attention, else an additive float mask (B, 1, S, T).

        With a cache, this step's keys and values go to slots [cache.index, cache.index + S) of
        `layer`, and the queries attend over all T slots of the cache (bias_B1ST then required).
        """
        c = self.config
        B, S, _ = x_BSD.shape
        q_BSNH = rotate(self.wq(x_BSD).view(B, S, c.n_heads, c.head_dim), cos_BSh, sin_BSh)
        k_BTKH = rotate(self.wk(x_BSD).view(B, S, c.n_kv_heads, c.head_dim), cos_BSh, sin_BSh)
        v_BTKH = self.wv(x_BSD).view(B, S, c.n_kv_heads, c.head_dim)
        # SDPA wants heads before sequence: (B, N, S, H) and (B, K, T, H).
        k_BKTH, v_BKTH = k_BTKH.transpose(1, 2), v_BTKH.transpose(1, 2)
        if cache is not None:
            cache.k[layer, :, :, cache.index:cache.index + S] = k_BKTH
            cache.v[layer, :, :, cache.index:cache.index + S] = v_BKTH
            k_BKTH, v_BKTH = cache.k[layer], cache.v[layer]
        out_BNSH = F.scaled_dot_product_attention(
            q_BSNH.transpose(1, 2), k_BKTH, v_BKTH,
            attn_mask=bias_B1ST, is_causal=bias_B1ST is None, enable_gqa=c.n_groups > 1)
        return self.wo(out_BNSH.transpose(1, 2).reshape(B, S, c.n_heads * c.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x_BSD):
        return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then h + ffn(norm(h))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x_BSD, cos_BSh, sin_BSh, bias_B1ST=None, cache=None, layer: int = 0):
        h = x_BSD + self.attention(self.attention_norm(x_BSD), cos_BSh, sin_BSh, bias_B1ST,
                                   cache, layer)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token embedding, n_layers blocks, final RMSNorm, LM head (tied to the embedding or not)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = self.config = config
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = None if c.tie_embeddings else nn.Linear(c.dim, c.vocab_size, bias=False)
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
                return_hidden: bool = False, cache: KVCache | None = None, lm_head: bool = True):
        """tokens (B, S) int -> logits (B, S, V) float32 [, final hidden states (B, S, D)].

        lm_head=False skips the vocabulary projection and returns the final hidden states in place
        of the logits (what a classification head reads).

        positions and attention_mask as in jax_llama.Llama: positions (S,) or (B, S), default
        counting only real tokens when attention_mask (B, S, 1 = real) is given.

        With a cache, the S tokens are appended at slot cache.index, their default positions
        continue from cache.positions, and the cache (updated in place) is returned last:
        (logits, cache) or (logits, hidden, cache).
        """
        c = self.config
        check_inputs(tokens_BS, c.vocab_size, positions, attention_mask)
        B, S = tokens_BS.shape
        device = tokens_BS.device
        dtype = self.tok_embeddings.weight.dtype
        bias_B1ST = None
        if cache is not None:
            bias_B1ST, positions, n_real_B = self._cache_step(cache, B, S, positions,
                                                              attention_mask)
        elif attention_mask is not None:
            valid_BS = torch.as_tensor(attention_mask, device=device).bool()
            causal_ST = torch.ones(S, S, dtype=torch.bool, device=device).tril()
            allowed_B1ST = causal_ST[None, None] & valid_BS[:, None, None, :]
            bias_B1ST = _additive(allowed_B1ST, dtype)
            if positions is None:
                positions = (valid_BS.long().cumsum(-1) - 1).clamp(min=0)
        if positions is None:
            positions = torch.arange(S, device=device)
        positions = torch.as_tensor(positions, device=device)
        cos_BSh, sin_BSh = rope_cos_sin(positions, self._inv_freq_for(device))

        x_BSD = self.tok_embeddings(tokens_BS)
        for i, layer in enumerate(self.layers):
            x_BSD = layer(x_BSD, cos_BSh, sin_BSh, bias_B1ST, cache, i)
        h_BSD = self.norm(x_BSD)
        if not lm_head:
            if cache is None:
                return h_BSD
            cache.positions += n_real_B
            cache.index += S
            return h_BSD, cache
        head = self.tok_embeddings.weight if self.output is None else self.output.weight
        logits_BSV = F.linear(h_BSD, head).float()
        if cache is None:
            return (logits_BSV, h_BSD) if return_hidden else logits_BSV
        cache.positions += n_real_B
        cache.index += S
        return (logits_BSV, h_BSD, cache) if return_hidden else (logits_BSV, cache)

    def _cache_step(self, cache: KVCache, B: int, S: int, positions, attention_mask):
        """Mark S new slots valid where attention_mask says so and build the attention bias over
        the whole cache: slot s sees slots t <= s that hold real tokens. Returns the bias
        (B, 1, S, T), the positions (given, or (B, S) continuing each row's count of real tokens)
        and the number of real tokens per row (B,)."""
        start, T = cache.index, cache.length
        if cache.valid.shape[0] != B:
            raise BridgeError(f"cache: batch {cache.valid.shape[0]} does not match tokens {B}")
        if start + S > T:
            raise BridgeError(f"cache: {S} tokens at slot {start} do not fit the cache length {T}")
        device = cache.valid.device
        if attention_mask is None:
            real_BS = torch.ones(B, S, dtype=torch.bool, device=device)
        else:
            real_BS = torch.as_tensor(attention_mask, device=device).bool()
        cache.valid[:, start:start + S] = real_BS
        slots_S = torch.arange(start, start + S, device=device)
        causal_ST = torch.arange(T, device=device)[None, :] <= slots_S[:, None]
        allowed_B1ST = causal_ST[None, None] & cache.valid[:, None, None, :]
        if positions is None:
            positions = cache.positions[:, None] + (real_BS.long().cumsum(-1) - 1).clamp(min=0)
        return _additive(allowed_B1ST, self.tok_embeddings.weight.dtype), positions, real_BS.sum(-1)

    def _inv_freq_for(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq_on:
            self._inv_freq_on[device] = torch.from_numpy(self._inv_freq).to(device)
        return self._inv_freq_on[device]


def last_real_index(attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last real token, wherever the padding is (left, right or both)."""
    mask_BS = torch.as_tensor(attention_mask_BS).bool()
    return mask_BS.shape[1] - 1 - mask_BS.flip(1).int().argmax(1)


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
        h_BSD = self.llama(tokens_BS, attention_mask=attention_mask, lm_head=False)
        last_B = last_real_index(attention_mask).to(h_BSD.device)
        h_BD = self.dropout(h_BSD[torch.arange(h_BSD.shape[0], device=h_BSD.device), last_B])
        return F.log_softmax(self.classifier(h_BD).float(), dim=-1)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, the dtype's most negative finite value elsewhere: a query with every key
    masked (a padding query) then gets a uniform distribution instead of the NaN of -inf."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)


def check_inputs(tokens: torch.Tensor, vocab_size: int, positions=None, attention_mask=None) -> None:
    """bridge.inputs.check_inputs on torch values (the same rules as jax_llama.check_inputs)."""
    integer = not (tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool)
    _check_inputs(tokens.shape, integer, vocab_size,
                  ids=tokens.detach().cpu().numpy() if integer else None,
                  positions_shape=None if positions is None else np.shape(positions),
                  mask_shape=None if attention_mask is None else np.shape(attention_mask))
