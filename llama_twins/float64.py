"""A float64 LLaMA in jax.numpy: the exact answer the parity report measures each twin against.

It shares no model code with either twin. It is written from the canonical (Meta) tensors the way
Meta's release writes the model: RoPE as multiplication by complex numbers on adjacent pairs, with
exact float64 frequencies; GQA by repeating K/V heads; an explicit causal and padding mask. Its
gradients come from jax.grad, its AdamW steps from optax called here (clipping by global norm,
then adamw decaying the 2-D weights, one tensor at a time), not from jax_llama.training.step. Everything runs with 64-bit types
enabled for the duration of the call only (`jax.enable_x64`), so the caller's JAX stays 32-bit.

It runs block by block. One block is one function (`block`), compiled once and applied to each
block's weights in turn, its input the float64 output of the block before; the gradients come
back the same way, each block's vector-Jacobian product taken at its saved input. So compiling
costs one block whatever the depth, and the forward figures (`forward_blocks`) hold one block's
weights in float64 at a time, with the embedding rows of the batch and the head taken in slices
of the vocabulary: a model of any size, block by block. The training figures' AdamW steps need the
whole model: the weights, two moments, the gradients and the first step's gradients in float64,
40 bytes per parameter, and 48 while a perturbed run holds its own 32 beside the plain run's first
gradients and last weights (`TRAINING_BYTES_PER_PARAMETER`).

Beside the plain run, `Perturbation` asks for perturbed ones: the same AdamW steps with each
step's gradients moved by noise of a rounding's size and the weights rounded to the twins' dtype
after each step. How far they end from the plain run (`Truth.spreads`) is how much noise of
that size grows on this model over the steps: what the report judges the training trajectory
against, where the model's own dynamics, not the arithmetic, decide how far rounding carries.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from bridge.config import LlamaConfig
from bridge.dtypes import numpy_dtype
from bridge.rope import rope_inv_freq
from bridge.tensors import layer_shapes


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


@dataclass(frozen=True)
class Perturbation:
    """The perturbed runs beside the plain one: `runs` of them, each step's gradient entries
    moved by noise uniform in +-size x the largest |entry| of their tensor (a rounding of that
    relative size, where the sums behind an entry are of the tensor's scale, not the entry's:
    a cancelling sum carries its terms' rounding), and the weights rounded to `stored` (a numpy
    dtype name: float32, bfloat16) after each step, as the twins keep them. The noise of run r
    comes from numpy's generator seeded by (seed, r, step, tensor)."""

    runs: int
    size: float
    stored: str | None
    seed: int = 0


@dataclass
class Truth:
    """The float64 answers for one batch. hidden: the residual stream after each block (B, S, D);
    sublayers: each block's {attention_norm, attention, ffn_norm, feed_forward} outputs (B, S, D);
    logits (B, S, V); loss, grads {canonical name: array} of one step of next-token cross-entropy
    on the whole batch; trained {canonical name: array}: the weights after the AdamW steps;
    spreads: for each perturbed run, {"max": max |its weights - trained| over the model,
    "tensor": the tensor where it is} after the same steps."""

    hidden: list[np.ndarray]
    sublayers: list[dict[str, np.ndarray]]
    logits: np.ndarray
    loss: float
    grads: dict[str, np.ndarray]
    trained: dict[str, np.ndarray]
    spreads: list[dict] = field(default_factory=list)


TRAINING_BYTES_PER_PARAMETER = 48
# The head's rows (vocabulary entries) taken at a time by the forward figures: 8,192 x dim in
# float64 is 128 MiB at dim 2,048.
HEAD_ROWS = 8192


def truth(tensors: dict[str, np.ndarray], config: LlamaConfig, tokens: np.ndarray,
          mask: np.ndarray, adamw: AdamW | None, progress: Callable[[str], object] | None = None,
          perturbation: Perturbation | None = None) -> Truth:
    """The float64 run of `tensors` (canonical names and layout, any float dtype) on `tokens`
    (B, S) with `mask` (B, S; 0 marks left padding) for the forward figures, then one loss and
    gradient on the unmasked batch and `adamw.steps` optimizer steps on it, as the report's
    training figures do (adamw None: the forward figures only; loss, grads and trained empty),
    and after them the perturbed runs of `perturbation` (their spreads; none without it).
    The forward holds one block's float64 weights at a time; the optimizer steps one tensor at a
    time (AdamW is elementwise once the gradients are clipped), so that memory holds the
    weights, the gradients and two moments (32 bytes a parameter) and the first gradients (8),
    never a second copy of the model; a perturbed run holds its own 32 beside the plain run's
    first gradients and last weights (16). progress(message) hears each stage."""
    import jax
    import jax.numpy as jnp

    heard = progress or (lambda message: None)
    with jax.enable_x64(True):
        run = _Blocks(config)
        heard(f"float64: the forward pass, {config.n_layers} blocks one at a time")
        hidden, logits, sublayers = forward_blocks(tensors.__getitem__, config, tokens, mask, run)
        if adamw is None:
            return Truth(hidden=hidden, sublayers=sublayers, logits=logits, loss=float("nan"),
                         grads={}, trained={})
        inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
        first = {}
        trained = _trained(run, tensors, inputs, targets, adamw, heard, first=first)
        spreads = []
        for r in range(perturbation.runs if perturbation is not None else 0):
            perturbed = _trained(run, tensors, inputs, targets, adamw, heard,
                                 noise=_Noise(perturbation, r))
            apart = {name: float(np.abs(np.asarray(w) - trained[name]).max())
                     for name, w in perturbed.items()}
            del perturbed
            where = max(apart, key=apart.__getitem__)
            spreads.append({"max": apart[where], "tensor": where})
        return Truth(hidden=hidden, sublayers=sublayers, logits=logits, loss=first["loss"],
                     grads=first["grads"], trained=trained, spreads=spreads)


def _trained(run: "_Blocks", tensors, inputs, targets, adamw: AdamW, heard,
             first: dict | None = None, noise: "_Noise | None" = None) -> dict[str, np.ndarray]:
    """The weights after adamw.steps float64 steps from `tensors` on (inputs, targets), numpy by
    name; first: filled with the first step's "loss" and "grads"; noise: the perturbed run's
    (its gradients moved and its weights rounded at each step)."""
    import jax.numpy as jnp

    weights = {name: jnp.asarray(np.asarray(t, np.float64)) for name, t in tensors.items()}
    optimizer = _tensor_adamw(adamw)
    state = {name: optimizer.init(w) for name, w in weights.items()}
    which = "" if noise is None else f"perturbed run {noise.run + 1}, "
    for i in range(adamw.steps):
        heard(f"float64: {which}training step {i + 1} of {adamw.steps}")
        value, grads = run.value_and_grad(weights, inputs, targets)
        if first is not None and i == 0:
            first.update(loss=float(value), grads={k: np.array(g) for k, g in grads.items()})
        if noise is not None:
            grads = {name: noise.moved(i, k, g) for k, (name, g) in enumerate(grads.items())}
        scale = _clip_scale(_global_norm(grads.values()), adamw.grad_clip)
        for name in list(grads):
            weights[name], state[name] = optimizer.step(weights[name], state[name],
                                                        grads.pop(name), scale)
            if noise is not None:
                weights[name] = noise.stored(weights[name])
    return {name: np.asarray(w) for name, w in weights.items()}


class _Noise:
    """Perturbed run r of a Perturbation (see there)."""

    def __init__(self, perturbation: Perturbation, run: int):
        self.perturbation, self.run = perturbation, run

    def moved(self, step: int, index: int, grad):
        import jax.numpy as jnp

        p = self.perturbation
        g = np.asarray(grad)
        rng = np.random.default_rng((p.seed, self.run, step, index))
        return jnp.asarray(g + rng.uniform(-1.0, 1.0, g.shape) * (p.size * np.abs(g).max()))

    def stored(self, weight):
        import jax.numpy as jnp

        stored = self.perturbation.stored
        return weight if stored is None else weight.astype(numpy_dtype(stored)).astype(jnp.float64)


def forward_blocks(tensor: Callable[[str], np.ndarray], config: LlamaConfig, tokens: np.ndarray,
                   mask: np.ndarray, run: "_Blocks | None" = None):
    """(hidden after each block, logits, each block's sub-layer outputs), float64 numpy, holding
    one block's weights in float64 at a time: tensor(name) gives a canonical tensor (any float
    dtype) when it is needed. The embedding rows of the batch only; the head in slices of
    HEAD_ROWS vocabulary entries. Call with 64-bit types enabled."""
    import jax.numpy as jnp

    run = run or _Blocks(config)
    c = config
    angles, bias = run.geometry(jnp.asarray(mask))
    embedding = tensor("tok_embeddings.weight")
    x = jnp.asarray(np.asarray(embedding[np.asarray(tokens)], np.float64))
    hidden, sublayers = [], []
    for i in range(c.n_layers):
        x, parts = run.block(_block_weights(tensor, c, i, np.float64), x, angles, bias)
        hidden.append(np.asarray(x))
        sublayers.append({k: np.asarray(v) for k, v in parts.items()})
    h = run.final_norm(jnp.asarray(np.asarray(tensor("norm.weight"), np.float64)), x)
    head = embedding if c.tie_embeddings else tensor("output.weight")
    logits = np.concatenate([np.asarray(h @ jnp.asarray(np.asarray(head[k:k + HEAD_ROWS],
                                                                   np.float64)).T)
                             for k in range(0, head.shape[0], HEAD_ROWS)], axis=-1)
    return hidden, logits, sublayers


def parts_from(tensor: Callable[[str], np.ndarray], config: LlamaConfig, i: int,
               parts: dict, x: np.ndarray | None, tokens: np.ndarray, mask: np.ndarray) -> dict:
    """Each part of block i in float64 on the input another implementation gave that part:
    `parts` is its {attention_norm, attention, ffn_norm, feed_forward, output} of block i (B,
    S, D), `x` its input to the block (None: block 0's, the embedding rows of `tokens`). So each
    part's error against the answer is its own, not what came before it: attention_norm(x),
    attention(its attention_norm), ffn_norm(x + its attention), feed_forward(its ffn_norm), and
    the output as the sum x + its attention + its feed_forward. float64 numpy."""
    import jax
    import jax.numpy as jnp

    with jax.enable_x64(True):
        run = _blocks(config)
        angles, bias = run.geometry(jnp.asarray(mask))
        if x is None:
            x = tensor("tok_embeddings.weight")[np.asarray(tokens)]
        x = np.asarray(x, np.float64)
        given = {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in parts.items()}
        w = _block_weights(tensor, config, i, np.float64)
        out = run.parts(w, jnp.asarray(x), given, angles, bias)
        return {k: np.asarray(v) for k, v in out.items()}


@functools.lru_cache(maxsize=2)
def _blocks(config: LlamaConfig) -> "_Blocks":
    return _Blocks(config)


def _block_weights(tensor: Callable, config: LlamaConfig, i: int, dtype=None) -> dict:
    """Block i's tensors by their short names (bridge.tensors.layer_shapes: a delta's with
    it), as `dtype` (None: as they are)."""
    import jax.numpy as jnp

    def get(name):
        t = tensor(f"layers.{i}.{name}")
        return t if dtype is None else jnp.asarray(np.asarray(t, dtype))
    return {name: get(name) for name in layer_shapes(config)}


class _Blocks:
    """The model's pieces, each compiled once: one block (forward, and its vector-Jacobian
    product at a saved input), the final norm, the loss of the head. Used with 64-bit types
    enabled."""

    def __init__(self, config: LlamaConfig):
        import jax
        import jax.numpy as jnp

        self.config = c = config
        self.inv_freq = jnp.asarray(rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling,
                                                  dtype=np.float64))
        self.block = jax.jit(lambda w, x, angles, bias: block(w, c, x, angles, bias))

        def parts(w, x, given, angles, bias):
            mid = x + given["attention"]
            return {"attention_norm": _rms_norm(x, w["attention_norm.weight"], c.norm_eps),
                    "attention": attention(w, c, given["attention_norm"], angles, bias),
                    "ffn_norm": _rms_norm(mid, w["ffn_norm.weight"], c.norm_eps),
                    "feed_forward": feed_forward(w, given["ffn_norm"]),
                    "output": mid + given["feed_forward"]}
        self.parts = jax.jit(parts)
        self.final_norm = jax.jit(lambda weight, x: _rms_norm(x, weight, c.norm_eps))

        def block_vjp(w, x, angles, bias, g):
            _, pull = jax.vjp(lambda w, x: block(w, c, x, angles, bias)[0], w, x)
            return pull(g)
        self.block_vjp = jax.jit(block_vjp)

        def head_loss(norm, head, x, targets):
            h = _rms_norm(x, norm, c.norm_eps)
            return _cross_entropy(h @ head.T, targets)
        self.head_value_and_grad = jax.jit(jax.value_and_grad(head_loss, argnums=(0, 1, 2)))

    def geometry(self, mask):
        """(RoPE's angles (B, S, 1, h) as complex numbers, the additive attention bias
        (B, 1, S, T)) for `mask` (B, S): a token at position p (real tokens before it, counted)
        attends to the real tokens at positions <= p of its row (within the window)."""
        return geometry(mask, self.inv_freq, self.config.sliding_window)

    def value_and_grad(self, weights: dict, inputs, targets):
        """(mean next-token cross-entropy, its gradients by canonical name) of `weights` (float64,
        the whole model) on a batch without padding: forward block by block keeping each block's
        input, the head's loss and gradients, then each block's vector-Jacobian product in
        reverse, and the embedding's gradient gathered from the rows the batch used."""
        import jax.numpy as jnp

        c = self.config
        angles, bias = self.geometry(jnp.ones_like(inputs))
        embedding = weights["tok_embeddings.weight"]
        xs = [embedding[inputs]]
        for i in range(c.n_layers):
            w = _block_weights(weights.__getitem__, c, i)
            xs.append(self.block(w, xs[-1], angles, bias)[0])
        head_name = "tok_embeddings.weight" if c.tie_embeddings else "output.weight"
        value, (g_norm, g_head, g) = self.head_value_and_grad(
            weights["norm.weight"], weights[head_name], xs.pop(), targets)
        grads = {"norm.weight": g_norm, head_name: g_head}
        for i in reversed(range(c.n_layers)):
            g_w, g = self.block_vjp(_block_weights(weights.__getitem__, c, i), xs.pop(), angles,
                                    bias, g)
            grads.update({f"layers.{i}.{name}": t for name, t in g_w.items()})
        g_embedding = jnp.zeros_like(embedding).at[inputs].add(g)
        grads["tok_embeddings.weight"] = grads.get("tok_embeddings.weight", 0) + g_embedding
        return value, grads


def adamw_steps(start: np.ndarray, base: np.ndarray, scales: list[np.float32], norms: list[float],
                adamw: AdamW) -> np.ndarray:
    """One tensor after `adamw.steps` float64 steps of the recipe from `start`, step k taking the
    gradient base * scales[k] rounded to float32 (this tensor's part of gradients whose global norm
    is norms[k]) instead of the model's own: the optimizer alone, for the report's figure that
    feeds both twins the same gradients. Clipping by global norm is a scale per step, so the
    tensors run one by one, each in one compiled program (its steps unrolled)."""
    import jax

    with jax.enable_x64(True):
        clips = np.array([_clip_scale(n, adamw.grad_clip) for n in norms], np.float64)
        return np.asarray(_tensor_adamw(adamw).steps(start, np.asarray(base, np.float32),
                                                     np.asarray(scales, np.float32), clips))


@functools.lru_cache(maxsize=2)
def _tensor_adamw(adamw: AdamW) -> "_TensorAdamW":
    return _TensorAdamW(adamw)


class _TensorAdamW:
    """The recipe as optax for one tensor at a time: the warmup-cosine schedule and optax.adamw,
    decaying the 2-D tensors (the embedding and the linear weights) and not the norm gains;
    step(weight, state, grad, scale) applies one step to grad * scale (the global clipping)."""

    def __init__(self, adamw: AdamW):
        import jax
        import jax.numpy as jnp
        import optax

        schedule = optax.warmup_cosine_decay_schedule(
            0.0, adamw.lr, adamw.warmup_steps, adamw.steps,
            end_value=adamw.lr * adamw.end_lr_ratio)
        self._optimizers = {decay: optax.adamw(schedule, b1=adamw.b1, b2=adamw.b2, eps=adamw.eps,
                                               weight_decay=adamw.weight_decay if decay else 0.0)
                            for decay in (False, True)}

        def step(decay, weight, state, grad, scale):
            updates, state = self._optimizers[decay].update(grad * scale, state, weight)
            return optax.apply_updates(weight, updates), state
        # the weight and its moments are consumed: their buffers hold the new ones
        self._step = jax.jit(step, static_argnums=0, donate_argnums=(1, 2))

        def steps(decay, start, base, scales, clips):  # step k's gradient: f32(base * scales[k])
            weight = start.astype(jnp.float64)
            state = self._optimizers[decay].init(weight)
            for k in range(adamw.steps):
                grad = (base * scales[k]).astype(jnp.float64)
                weight, state = step(decay, weight, state, grad, clips[k])
            return weight
        self._steps = jax.jit(steps, static_argnums=0)

    def init(self, weight):
        return self._optimizers[weight.ndim == 2].init(weight)

    def step(self, weight, state, grad, scale: float):
        return self._step(weight.ndim == 2, weight, state, grad, scale)

    def steps(self, start, base, scales, clips):
        """The weight after len(scales) steps from start (any float dtype), step k's gradient
        base (float32) * scales[k] rounded to float32, clipped by clips[k]."""
        return self._steps(start.ndim == 2, start, base, scales, clips)


def _global_norm(tensors) -> float:
    """sqrt of the sum of squares of every entry, float64 (optax.global_norm)."""
    return math.sqrt(sum(_squares(np.asarray(t, np.float64)) for t in tensors))


def _squares(x: np.ndarray) -> float:
    """The sum of x's squares, float64 (a dot product: one pass, no temporary)."""
    x = np.ascontiguousarray(x).reshape(-1)
    return float(np.dot(x, x))


def _clip_scale(norm: float, threshold: float) -> float:
    """The factor optax.clip_by_global_norm multiplies every gradient by."""
    return 1.0 if norm < threshold else threshold / norm


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


def forward(w: dict, config: LlamaConfig, inv_freq, tokens, mask, sublayers: bool = False):
    """(hidden state after each block, logits), float64, the whole model in one trace (`logits`;
    the report runs it block by block). A token at position p (real tokens before it, counted)
    attends to the real tokens at positions <= p of its row. sublayers: also each block's
    {attention_norm, attention, ffn_norm, feed_forward} outputs, a third item."""

    c = config
    angles, bias = geometry(mask, inv_freq, c.sliding_window)
    x = w["tok_embeddings.weight"][tokens]
    hidden, parts = [], []
    for i in range(c.n_layers):
        x, part = block(_block_weights(w.__getitem__, c, i), c, x, angles, bias)
        hidden.append(x)
        parts.append(part)
    head = w["tok_embeddings.weight"] if c.tie_embeddings else w["output.weight"]
    logits = _rms_norm(x, w["norm.weight"], c.norm_eps) @ head.T
    return (hidden, logits, parts) if sublayers else (hidden, logits)


def geometry(mask, inv_freq, window: int | None = None):
    """(RoPE's angles (B, S, 1, h) as complex numbers, the additive attention bias (B, 1, S, T))
    for `mask` (B, S): a token at position p (real tokens before it, counted) attends to the
    real tokens at positions <= p of its row, and with a sliding window only to those after
    p - window."""
    import jax.numpy as jnp

    S = mask.shape[1]
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.float64)
    allowed = jnp.tril(jnp.ones((S, S), bool))[None] & (mask[:, None, :] > 0)
    if window is not None:  # left padding is contiguous: columns apart are positions apart
        allowed = allowed & ~jnp.tril(jnp.ones((S, S), bool), -window)[None]
    # A finite fill: a padding query sees no key, and its row (never compared) stays finite.
    bias = jnp.where(allowed, 0.0, -1e30)[:, None]
    return jnp.exp(1j * positions[:, :, None, None] * inv_freq), bias


def block(w: dict, config: LlamaConfig, x, angles, bias):
    """One block on x (B, S, D): (its output, {attention_norm, attention, ffn_norm,
    feed_forward: each part's output}). w: the block's tensors by short name (_block_weights);
    angles, bias: see _Blocks.geometry."""
    part = {"attention_norm": _rms_norm(x, w["attention_norm.weight"], config.norm_eps)}
    part["attention"] = attention(w, config, part["attention_norm"], angles, bias)
    x = x + part["attention"]
    part["ffn_norm"] = _rms_norm(x, w["ffn_norm.weight"], config.norm_eps)
    part["feed_forward"] = feed_forward(w, part["ffn_norm"])
    return x + part["feed_forward"], part


def attention(w: dict, config: LlamaConfig, h, angles, bias):
    """Grouped-query attention of the normed h (B, S, D), with its output projection."""
    import jax.numpy as jnp

    c = config
    B, S, _ = h.shape
    q, k, v = (h @ w[f"attention.{n}.weight"].T for n in ("wq", "wk", "wv"))
    if c.qkv_bias:  # Qwen2
        q, k, v = q + w["attention.wq.bias"], k + w["attention.wk.bias"], v + w["attention.wv.bias"]
    q = q.reshape(B, S, c.n_heads, c.head_dim)
    k, v = k.reshape(B, S, c.n_kv_heads, c.head_dim), v.reshape(B, S, c.n_kv_heads, c.head_dim)
    if c.qk_norm:  # Qwen3: each head's q and k, before RoPE
        q = _rms_norm(q, w["attention.q_norm.weight"], c.norm_eps)
        k = _rms_norm(k, w["attention.k_norm.weight"], c.norm_eps)
    q, k = _rotate(q, angles), _rotate(k, angles)
    k = jnp.repeat(k, c.n_heads // c.n_kv_heads, axis=2)  # query head n reads kv head n // G
    v = jnp.repeat(v, c.n_heads // c.n_kv_heads, axis=2)
    scores = jnp.einsum("bsnh,btnh->bnst", q, k) / np.sqrt(c.head_dim) + bias
    probs = jnp.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    out = jnp.einsum("bnst,btnh->bsnh", probs, v).reshape(B, S, -1)
    return out @ w["attention.wo.weight"].T


def feed_forward(w: dict, h):
    """SwiGLU of the normed h: w2(silu(w1 h) * w3 h)."""
    import jax.numpy as jnp

    gate = h @ w["feed_forward.w1.weight"].T
    up = h @ w["feed_forward.w3.weight"].T
    return (gate / (1 + jnp.exp(-gate)) * up) @ w["feed_forward.w2.weight"].T


def loss(w: dict, config: LlamaConfig, inv_freq, inputs, targets):
    """Mean next-token cross-entropy over every position (the batch has no padding)."""
    import jax.numpy as jnp

    _, logits = forward(w, config, inv_freq, inputs, jnp.ones_like(inputs))
    return _cross_entropy(logits, targets)


def _cross_entropy(logits, targets):
    import jax.numpy as jnp

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
