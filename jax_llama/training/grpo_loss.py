"""GRPO's arithmetic (jax_llama.training.grpo has the whole algorithm): the group-relative
advantages, computed on the host in float32 in TRL's order of operations, the trainer's token
log-probabilities, and the clipped policy loss with its KL term, as a Loss for the train step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bridge.errors import BridgeError

from .spec import LOSS_TYPES, GrpoSpec


# -- the advantages: host side, float32, TRL's order of operations -------------------------------

def _nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """TRL's nanstd: the Bessel-corrected std of the non-NaN values (NaN for fewer than two)."""
    mean = np.nanmean(x, axis=axis, keepdims=True)
    variance = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    count = np.sum(~np.isnan(x), axis=axis, keepdims=True).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        variance = variance * np.where(count > 1, count / (count - 1), np.nan)
    std = np.sqrt(variance).astype(np.float32)
    return std.reshape(()) if axis is None else np.squeeze(std, axis=axis)


def group_advantages(rewards_per_func: np.ndarray, weights: np.ndarray, num_generations: int,
                     scale_rewards: str = "group") -> dict[str, np.ndarray]:
    """{"advantages", "rewards", "std", "zero_std"} of a round: rewards_per_func (N, F) with NaN
    where a function returned None, completions grouped by G consecutive rows."""
    import warnings

    rpf = np.asarray(rewards_per_func, np.float32)
    unscorable = np.isnan(rpf).all(axis=1)
    with warnings.catch_warnings():  # all-NaN groups: NaN means, as torch.nanmean gives
        warnings.simplefilter("ignore", RuntimeWarning)
        rewards = np.nansum(rpf * np.asarray(weights, np.float32)[None, :], axis=1)
        rewards = np.where(unscorable, np.nan, rewards).astype(np.float32)
        grouped = rewards.reshape(-1, num_generations)
        mean = np.repeat(np.nanmean(grouped, axis=1), num_generations).astype(np.float32)
        if scale_rewards == "batch":
            std = np.broadcast_to(_nanstd(rewards), rewards.shape).astype(np.float32)
        else:  # "group", and "none", which computes it for frac_reward_zero_std only
            std = np.repeat(_nanstd(grouped, axis=1), num_generations).astype(np.float32)
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + np.float32(1e-4))
    zero_std = np.abs(std) <= 1e-8  # torch.isclose(std, 0): NaN is not close
    return {"advantages": np.nan_to_num(advantages, nan=0.0).astype(np.float32),
            "rewards": rewards, "std": std, "zero_std": zero_std}


# -- the loss: pure functions of log-probs ------------------------------------------------------

def token_logps(model, params, batch: dict, temperature: float, key=None):
    """((B, N) log_softmax(logits / temperature) of each completion token, (B, N) the entropy of
    that distribution), float32. batch: "inputs" (B, L - 1) the prompt, left-padded, then the
    completion; "attention" (B, L - 1); "completion" (B, N) the completion's ids: the last N
    positions' targets."""
    (B, N), S = batch["completion"].shape, batch["inputs"].shape[1]
    # the vocabulary projection of the last N positions only: those that predict the completion
    head_at = jnp.broadcast_to(jnp.arange(S - N, S), (B, N))
    logits = model.apply({"params": params}, batch["inputs"], attention_mask=batch["attention"],
                         head_at=head_at, method="run",
                         rngs={} if key is None else {"dropout": key}).logits
    logits = logits.astype(jnp.float32) / temperature
    logp_BNV = jax.nn.log_softmax(logits, axis=-1)
    logps = jnp.take_along_axis(logp_BNV, batch["completion"][..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_BNV) * logp_BNV, axis=-1)
    return logps, entropy


def policy_loss(logps, old_logps, ref_logps, advantages, mask, *, loss_type: str,
                epsilon_low: float, epsilon_high: float, beta: float,
                max_completion_length: int, normalizer=None):
    """(loss, metrics) of B completions: logps, old_logps (None: logps with its gradient stopped),
    ref_logps (used where beta > 0), mask (B, N); advantages (B,). normalizer: dapo's, the
    completion tokens of the whole round / grad_accum."""
    mask = mask.astype(jnp.float32)
    old = jax.lax.stop_gradient(logps) if old_logps is None else old_logps
    ratio = jnp.exp(logps - old)
    clipped = jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
    A = advantages[:, None]
    per_token = -jnp.minimum(ratio * A, clipped * A)
    metrics = {}
    if beta != 0.0:
        # TRL 1.16's default (use_bias_correction_kl): times the ratio, so that its gradient is
        # the reverse KL's, unbiased (the ratio's value is 1 on the sampling policy, its
        # gradient is not 0)
        kl = (jnp.exp(ref_logps - logps) - (ref_logps - logps) - 1) * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl, mask)
    if loss_type == "grpo":
        loss = jnp.mean(jnp.sum(per_token * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0))
    elif loss_type == "bnpo":
        loss = jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    elif loss_type == "dr_grpo":
        loss = jnp.sum(per_token * mask) / (per_token.shape[0] * max_completion_length)
    elif loss_type == "dapo":
        loss = jnp.sum(per_token * mask) / jnp.maximum(normalizer, 1.0)
    else:
        raise BridgeError(f"unknown loss type {loss_type!r} (expected {', '.join(LOSS_TYPES)})",
                          field="loss_type")
    low = ((ratio < 1 - epsilon_low) & (A < 0)).astype(jnp.float32)
    high = ((ratio > 1 + epsilon_high) & (A > 0)).astype(jnp.float32)
    metrics.update({"clip_ratio/low_mean": _masked_mean(low, mask),
                    "clip_ratio/high_mean": _masked_mean(high, mask),
                    "clip_ratio/region_mean": _masked_mean(jnp.maximum(low, high), mask)})
    return loss, metrics


def _masked_mean(x, mask):
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def train_loss(model, spec: GrpoSpec):
    """The micro-batch loss as a jax_llama.training.step Loss with aux metrics: policy_loss on
    token_logps, plus the entropy and the sampler/trainer difference."""
    def loss(params, batch, key):
        logps, entropy = token_logps(model, params, batch, spec.temperature, key)
        value, metrics = policy_loss(
            logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"],
            batch["mask"], loss_type=spec.loss_type, epsilon_low=spec.epsilon,
            epsilon_high=spec.epsilon_high or spec.epsilon, beta=spec.beta,
            max_completion_length=spec.max_completion_length, normalizer=batch["normalizer"][0])
        mask = batch["mask"].astype(jnp.float32)
        metrics["entropy"] = _masked_mean(jax.lax.stop_gradient(entropy), mask)
        metrics["sampler/logp_diff_max"] = jnp.max(
            jnp.abs(jax.lax.stop_gradient(logps) - batch["sampler_logps"]) * mask)
        return value, metrics
    return loss
