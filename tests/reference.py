"""An independent float64 numpy LLaMA forward, written the way Meta's release writes it: RoPE as
multiplication by complex numbers on adjacent pairs, GQA by repeating K/V heads, an explicit
-inf causal mask. It reads canonical tensors, so it checks both twins and the name table."""

from __future__ import annotations

import numpy as np

from bridge.config import LlamaConfig


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_complex(x, positions, inv_freq):
    """x (B, S, N, H) real -> rotated, treating (x[2i], x[2i+1]) as the complex x[2i] + i x[2i+1]."""
    z = x[..., 0::2] + 1j * x[..., 1::2]
    z = z * np.exp(1j * positions[:, :, None, None] * inv_freq)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def forward(tensors: dict[str, np.ndarray], config: LlamaConfig, tokens, inv_freq) -> np.ndarray:
    """tokens (B, S) -> logits (B, S, V) in float64; inv_freq (H/2,) from the config."""
    c = config
    t = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
    B, S = tokens.shape
    positions = np.broadcast_to(np.arange(S), (B, S)).astype(np.float64)
    x = t["tok_embeddings.weight"][tokens]
    causal = np.where(np.tril(np.ones((S, S), dtype=bool)), 0.0, -np.inf)
    for i in range(c.n_layers):
        p = f"layers.{i}."
        h = rms_norm(x, t[p + "attention_norm.weight"], c.norm_eps)
        q = (h @ t[p + "attention.wq.weight"].T).reshape(B, S, c.n_heads, c.head_dim)
        k = (h @ t[p + "attention.wk.weight"].T).reshape(B, S, c.n_kv_heads, c.head_dim)
        v = (h @ t[p + "attention.wv.weight"].T).reshape(B, S, c.n_kv_heads, c.head_dim)
        q, k = rope_complex(q, positions, inv_freq), rope_complex(k, positions, inv_freq)
        k = np.repeat(k, c.n_heads // c.n_kv_heads, axis=2)   # head n reads kv head n // G
        v = np.repeat(v, c.n_heads // c.n_kv_heads, axis=2)
        scores = np.einsum("bsnh,btnh->bnst", q, k) / np.sqrt(c.head_dim) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("bnst,btnh->bsnh", probs, v).reshape(B, S, -1)
        x = x + attn @ t[p + "attention.wo.weight"].T
        h = rms_norm(x, t[p + "ffn_norm.weight"], c.norm_eps)
        gate = h @ t[p + "feed_forward.w1.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ t[p + "feed_forward.w3.weight"].T)) @ t[
            p + "feed_forward.w2.weight"].T
    h = rms_norm(x, t["norm.weight"], c.norm_eps)
    head = t["tok_embeddings.weight"] if c.tie_embeddings else t["output.weight"]
    return h @ head.T
