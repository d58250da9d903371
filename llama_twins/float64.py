"""A float64 LLaMA in jax.numpy: the exact answer the parity report measures each twin against.

It shares no model code with either twin. It is written from the canonical (Meta) tensors the way
Meta's release writes the model: RoPE as multiplication by complex numbers on adjacent pairs, with
exact float64 frequencies; GQA by repeating K/V heads; an explicit causal and padding mask. Its
gradients come from jax.grad, its AdamW steps from optax called here (clipping by global norm,
then adamw decaying the 2-D weights), not from jax_llama.train. Everything runs with 64-bit types
enabled for the duration of the call only (`jax.enable_x64`), so the caller's JAX stays 32-bit.

Memory: the weights, two AdamW moments and the gradients in float64, 32 bytes per parameter, and
the (B, N, S, S) scores of one block: the report's default 2 x 16 batch is nothing next to that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from bridge.config import LlamaConfig
from bridge.rope import rope_inv_freq


@dataclass(frozen=True)
class AdamW:
    """The optimizer recipe the float64 run follows: warmup from 0 to lr then cosine decay to
    lr * end_lr_ratio over `steps`, clipping by global norm, AdamW with weight decay on the 2-D
    tensors (embeddings and linear weights) and none on the norm gains."""

    steps: int
    lr: float
    warmup_steps: int
    end_lr_ratio: float
    b1: float
    b2: float
    eps: float
    weight_decay: float
    grad_clip: float


@dataclass
class Truth:
    """The float64 answers for one batch. hidden: the residual stream after each block (B, S, D);
    logits (B, S, V); loss, grads {canonical name: array} of one step of next-token cross-entropy
    on the whole batch; trained {canonical name: array}: the weights after the AdamW steps."""

    hidden: list[np.ndarray]
    logits: np.ndarray
    loss: float
    grads: dict[str, np.ndarray]
    trained: dict[str, np.ndarray]


def truth(tensors: dict[str, np.ndarray], config: LlamaConfig, tokens: np.ndarray,
          mask: np.ndarray, adamw: AdamW) -> Truth:
    """The float64 run of `tensors` (canonical names and layout, any float dtype) on `tokens`
    (B, S) with `mask` (B, S; 0 marks left padding) for the forward figures, then one loss and
    gradient on the unmasked batch and `adamw.steps` optimizer steps on it, as the report's
    training figures do."""
    import jax
    import jax.numpy as jnp
    import optax

    with jax.enable_x64(True):
        weights = {name: jnp.asarray(np.asarray(t, np.float64)) for name, t in tensors.items()}
        inv_freq = jnp.asarray(rope_inv_freq(config.head_dim, config.rope_theta,
                                             config.rope_scaling, dtype=np.float64))
        hidden, logits = jax.jit(lambda w, t, m: forward(w, config, inv_freq, t, m))(
            weights, jnp.asarray(tokens), jnp.asarray(mask))

        inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
        grad_fn = jax.jit(jax.value_and_grad(
            lambda w: loss(w, config, inv_freq, inputs, targets)))
        optimizer = _optimizer(adamw)
        update, state, trained = jax.jit(optimizer.update), optimizer.init(weights), weights
        for i in range(adamw.steps):
            value, grads = grad_fn(trained)
            if i == 0:
                first_loss, first_grads = float(value), {k: np.asarray(g) for k, g in grads.items()}
            updates, state = update(grads, state, trained)
            trained = optax.apply_updates(trained, updates)
        return Truth(hidden=[np.asarray(h) for h in hidden], logits=np.asarray(logits),
                     loss=first_loss, grads=first_grads,
                     trained={k: np.asarray(t) for k, t in trained.items()})


def adamw_steps(tensors: dict[str, np.ndarray], grads: Callable[[int], dict[str, np.ndarray]],
                adamw: AdamW) -> dict[str, np.ndarray]:
    """The weights after `adamw.steps` float64 steps of the recipe from `tensors` (canonical
    names), step k taking the gradients grads(k) (canonical names) instead of the model's own:
    the optimizer alone, for the report's figure that feeds both twins the same gradients."""
    import jax
    import jax.numpy as jnp
    import optax

    with jax.enable_x64(True):
        trained = {name: jnp.asarray(np.asarray(t, np.float64)) for name, t in tensors.items()}
        optimizer = _optimizer(adamw)
        update, state = jax.jit(optimizer.update), optimizer.init(trained)
        for k in range(adamw.steps):
            g = {name: jnp.asarray(np.asarray(t, np.float64)) for name, t in grads(k).items()}
            updates, state = update(g, state, trained)
            trained = optax.apply_updates(trained, updates)
        return {name: np.asarray(t) for name, t in trained.items()}


def _optimizer(adamw: AdamW):
    """The recipe as optax: warmup-cosine schedule, clipping by global norm, AdamW decaying the
    2-D tensors (canonical names, so the embedding and the linear weights)."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, adamw.lr, adamw.warmup_steps, adamw.steps, end_value=adamw.lr * adamw.end_lr_ratio)
    return optax.chain(
        optax.clip_by_global_norm(adamw.grad_clip),
        optax.adamw(schedule, b1=adamw.b1, b2=adamw.b2, eps=adamw.eps,
                    weight_decay=adamw.weight_decay,
                    mask=lambda w: {name: t.ndim == 2 for name, t in w.items()}))


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float64 (gain 1)."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def logits(tensors: dict[str, np.ndarray], config: LlamaConfig, tokens: np.ndarray,
           mask: np.ndarray | None = None, inv_freq: np.ndarray | None = None) -> np.ndarray:
    """The float64 logits (B, S, V) of `tensors` (canonical names and layout) on `tokens`; mask
    as in `truth` (default: no padding); inv_freq (H/2,) default: the exact frequencies."""
    import jax
    import jax.numpy as jnp

    if inv_freq is None:
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling,
                                 dtype=np.float64)
    with jax.enable_x64(True):
        weights = {name: jnp.asarray(np.asarray(t, np.float64)) for name, t in tensors.items()}
        tokens = jnp.asarray(tokens)
        mask = jnp.ones_like(tokens) if mask is None else jnp.asarray(mask)
        return np.asarray(forward(weights, config, jnp.asarray(inv_freq, jnp.float64), tokens,
                                  mask)[1])


def rotation(x: np.ndarray, config: LlamaConfig, positions: np.ndarray) -> np.ndarray:
    """RoPE of x (1, P, 1, H) at `positions` (P,), float64: each pair as a complex number times
    exp(i p f) with the exact frequencies of `config` (its theta and scaling)."""
    import jax
    import jax.numpy as jnp

    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling,
                             dtype=np.float64)
    with jax.enable_x64(True):
        angles = jnp.exp(1j * jnp.asarray(positions, jnp.float64)[None, :, None, None]
                         * jnp.asarray(inv_freq))
        return np.asarray(_rotate(jnp.asarray(x, jnp.float64), angles))


def forward(w: dict, config: LlamaConfig, inv_freq, tokens, mask):
    """(hidden state after each block, logits), float64. A token at position p (real tokens
    before it, counted) attends to the real tokens at positions <= p of its row."""
    import jax.numpy as jnp

    c = config
    B, S = tokens.shape
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.float64)  # (B, S)
    allowed = jnp.tril(jnp.ones((S, S), bool))[None] & (mask[:, None, :] > 0)     # (B, S, T)
    # A finite fill: a padding query sees no key, and its row (never compared) stays finite.
    bias = jnp.where(allowed, 0.0, -1e30)[:, None]                                 # (B, 1, S, T)
    angles = jnp.exp(1j * positions[:, :, None, None] * inv_freq)                  # (B, S, 1, h)
    x = w["tok_embeddings.weight"][tokens]
    hidden = []
    for i in range(c.n_layers):
        p = f"layers.{i}."
        h = _rms_norm(x, w[p + "attention_norm.weight"], c.norm_eps)
        q = (h @ w[p + "attention.wq.weight"].T).reshape(B, S, c.n_heads, c.head_dim)
        k = (h @ w[p + "attention.wk.weight"].T).reshape(B, S, c.n_kv_heads, c.head_dim)
        v = (h @ w[p + "attention.wv.weight"].T).reshape(B, S, c.n_kv_heads, c.head_dim)
        q, k = _rotate(q, angles), _rotate(k, angles)
        k = jnp.repeat(k, c.n_heads // c.n_kv_heads, axis=2)  # query head n reads kv head n // G
        v = jnp.repeat(v, c.n_heads // c.n_kv_heads, axis=2)
        scores = jnp.einsum("bsnh,btnh->bnst", q, k) / np.sqrt(c.head_dim) + bias
        probs = jnp.exp(scores - scores.max(-1, keepdims=True))
        probs = probs / probs.sum(-1, keepdims=True)
        attention = jnp.einsum("bnst,btnh->bsnh", probs, v).reshape(B, S, -1)
        x = x + attention @ w[p + "attention.wo.weight"].T
        h = _rms_norm(x, w[p + "ffn_norm.weight"], c.norm_eps)
        gate = h @ w[p + "feed_forward.w1.weight"].T
        up = h @ w[p + "feed_forward.w3.weight"].T
        x = x + (gate / (1 + jnp.exp(-gate)) * up) @ w[p + "feed_forward.w2.weight"].T
        hidden.append(x)
    head = w["tok_embeddings.weight"] if c.tie_embeddings else w["output.weight"]
    return hidden, _rms_norm(x, w["norm.weight"], c.norm_eps) @ head.T


def loss(w: dict, config: LlamaConfig, inv_freq, inputs, targets):
    """Mean next-token cross-entropy over every position (the batch has no padding)."""
    import jax.numpy as jnp

    _, logits = forward(w, config, inv_freq, inputs, jnp.ones_like(inputs))
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - jnp.log(jnp.exp(shifted).sum(-1, keepdims=True))
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1).mean()


def _rms_norm(x, weight, eps):
    import jax.numpy as jnp

    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rotate(x, angles):
    """x (B, S, N, H) real: each pair (x[2i], x[2i+1]) as the complex x[2i] + i x[2i+1], times
    angles (B, S, 1, H/2)."""
    import jax.numpy as jnp

    z = (x[..., 0::2] + 1j * x[..., 1::2]) * angles
    return jnp.stack([z.real, z.imag], axis=-1).reshape(x.shape)
