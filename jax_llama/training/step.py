"""The pure pieces of training: hyperparameters, losses, optimizer, and `train_step(state, batch)`.

One step factory serves every training mode: `make_train_step(loss, ...)` for any
loss(params, batch, key) -> scalar, and `jit_train_step` compiles it once, the state donated (and,
on a mesh, sharded by role). Pretraining (jax_llama/training/loop.py) uses it with `lm_loss`, classification
fine-tuning (jax_llama/classify.py) with its own loss. The loops that drive them (data,
checkpoints, progress) live in those modules.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh

from bridge.dtypes import dtype_name
from bridge.errors import BridgeError

from ..sharding import batch_sharding, tree_shardings

Loss = Callable[[Any, dict, jax.Array], jax.Array]  # (params, batch, PRNG key) -> scalar


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite."""


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of a run. Defaults train the `tiny` preset on the embedded corpus in a
    few minutes on two CPU cores."""

    steps: int = 600                 # train_step calls (micro-batches when grad_accum > 1)
    batch_size: int = 16             # global, all hosts together
    seq_len: int = 128
    lr: float = 3e-3                 # peak; small models tolerate (and want) a high rate
    warmup_steps: int | None = None  # None: the first 10% of the updates
    end_lr_ratio: float = 0.1        # cosine decay to lr * end_lr_ratio
    b1: float = 0.9
    b2: float = 0.95                 # LLaMA's setting: faster second-moment tracking than 0.999
    eps: float = 1e-8
    weight_decay: float = 0.1        # on kernels and embeddings only, never on norm weights
    grad_clip: float = 1.0
    grad_accum: int = 1
    dtype: str = "float32"           # compute dtype; parameters and optimizer state stay float32
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_batches",
                     "checkpoint_every", "keep_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise BridgeError(f"must be a positive integer (got {value!r})", field=name)
        for name in ("lr", "eps", "grad_clip"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                raise BridgeError(f"must be positive (got {getattr(self, name)})", field=name)
        if self.warmup_steps is None:
            object.__setattr__(self, "warmup_steps", self.steps // self.grad_accum // 10)
        if not 0 <= self.warmup_steps <= self.steps // self.grad_accum:
            raise BridgeError(f"must be within [0, steps / grad_accum] (got {self.warmup_steps})",
                              field="warmup_steps")
        dtype_name(self.dtype)  # float32, bfloat16 or float16

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to lr, then cosine decay to lr * end_lr_ratio, over optimizer updates."""
    return optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.steps // tc.grad_accum,
                                              end_value=tc.lr * tc.end_lr_ratio)


def decay_mask(params):
    """True for the 2-D weights (Dense kernels, the embedding; stacked per layer under scan), False
    for RMSNorm weights: decaying a norm's gain toward 0 only fights the normalisation."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) in ("kernel", "embedding"), params)


# --8<-- [start:optimizer]
def make_optimizer(tc: TrainConfig, trainable: Callable | None = None
                   ) -> optax.GradientTransformation:
    """Clip, AdamW with decay_mask, accumulation over grad_accum micro-batches. trainable:
    params -> a True/False tree (LoRA: jax_llama.lora.trainable); the False leaves are frozen by
    optax.multi_transform: zero updates, no optimizer state, no accumulator."""
    optimizer = optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.adamw(lr_schedule(tc), b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay,
                    mask=decay_mask))
    if tc.grad_accum > 1:  # average grad_accum micro-batch gradients per update
        optimizer = optax.MultiSteps(optimizer, every_k_schedule=tc.grad_accum)
    if trainable is not None:
        optimizer = optax.multi_transform(
            {"train": optimizer, "frozen": optax.set_to_zero()},
            lambda params: jax.tree.map(lambda t: "train" if t else "frozen", trainable(params)))
    return optimizer
# --8<-- [end:optimizer]


class TrainState(struct.PyTreeNode):
    step: jax.Array        # train_step calls so far
    params: Any
    opt_state: Any


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


# --8<-- [start:train_step]
def loss_fn(params, model, batch, key=None) -> jax.Array:
    """Mean next-token cross-entropy over the tokens whose mask is 1, in float32. A packed batch
    carries segment_ids (each document attends only within itself). key: the dropout rng of a
    training step (LoRA dropout); None evaluates."""
    logits = model.apply({"params": params}, batch["inputs"], segment_ids=batch.get("segment_ids"),
                         rngs={} if key is None else {"dropout": key})
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def lm_loss(model) -> Loss:
    """loss_fn of `model` as a Loss (the key drives dropout: LoRA's, when it has any)."""
    return lambda params, batch, key: loss_fn(params, model, batch, key)


def make_train_step(loss: Loss, optimizer: optax.GradientTransformation, schedule: Callable,
                    grad_accum: int = 1, seed: int = 0, trainable: Callable | None = None,
                    has_aux: bool = False, skip_nonfinite: bool = False):
    """The pure step: (state, batch) -> (new state, metrics {loss, grad_norm, lr}). loss gets a
    PRNG key that depends on (seed, step) only, so a resumed run draws the same dropout.
    trainable (as in make_optimizer): grad_norm counts those leaves only; the frozen leaves'
    gradients are then used nowhere, and XLA does not compute them. has_aux: loss returns
    (value, {name: scalar}), and those scalars join the metrics (DPO's rewards).
    skip_nonfinite: a step whose loss or gradient norm is not finite keeps the params and the
    optimizer state it was given (only the step count moves on), decided on the device."""
    base_key = jax.random.key(seed)

    def train_step(state: TrainState, batch) -> tuple[TrainState, dict]:
        key = jax.random.fold_in(base_key, state.step)
        value, grads = jax.value_and_grad(loss, has_aux=has_aux)(state.params, batch, key)
        value, aux = value if has_aux else (value, {})
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if trainable is not None:
            grads = [g for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(trainable(grads))) if t]
        metrics = {"loss": value, "grad_norm": optax.tree.norm(grads),
                   "lr": schedule(state.step // grad_accum), **aux}
        if skip_nonfinite:
            finite = jnp.isfinite(value) & jnp.isfinite(metrics["grad_norm"])
            params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                             (params, opt_state), (state.params, state.opt_state))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics
    return train_step
# --8<-- [end:train_step]


def jit_train_step(loss: Loss, optimizer: optax.GradientTransformation, tc: TrainConfig,
                   state: TrainState, mesh: Mesh | None = None, trainable: Callable | None = None,
                   has_aux: bool = False, skip_nonfinite: bool = False):
    """make_train_step for tc's schedule, accumulation and seed, jitted once with the state
    donated; on a mesh, the state sharded by role and the batch split over data x fsdp."""
    step = make_train_step(loss, optimizer, lr_schedule(tc), tc.grad_accum, tc.seed, trainable,
                           has_aux, skip_nonfinite)
    options = compiler_options(state.params)
    if mesh is None:
        return jax.jit(step, donate_argnums=0, compiler_options=options)
    state_sharding = tree_shardings(state, mesh)
    return jax.jit(step, in_shardings=(state_sharding, batch_sharding(mesh)),
                   out_shardings=(state_sharding, None), donate_argnums=0,
                   compiler_options=options)


def compiler_options(params) -> dict | None:
    """XLA options for a step over `params`. XLA:CPU computes bfloat16 / float16 dots in float32,
    and its while-loop invariant code motion then hoists the conversion of each stacked
    (scan_layers) weight out of the layer loop: a float32 copy of every layer, held through the
    step (3.9 GB for llama3.2-1b held in bfloat16, as a LoRA run holds its base). Without that
    pass the conversion stays in the loop, one layer at a time. Other backends, and float32
    params, compile as XLA chooses."""
    narrow = any(jnp.dtype(x.dtype).itemsize < 4 for x in jax.tree.leaves(params)
                 if jnp.issubdtype(x.dtype, jnp.floating))
    if jax.default_backend() == "cpu" and narrow:
        return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
    return None


def jit_eval_step(model, state: TrainState, mesh: Mesh):
    """loss_fn on the mesh: params sharded as in the state, batches split over data x fsdp."""
    return jax.jit(lambda params, batch: loss_fn(params, model, batch),
                   in_shardings=(tree_shardings(state, mesh).params, batch_sharding(mesh)))


def place_state(state: TrainState, mesh: Mesh) -> TrainState:
    """Move (and split) a state onto the mesh according to the sharding rules."""
    return jax.device_put(state, tree_shardings(state, mesh))
