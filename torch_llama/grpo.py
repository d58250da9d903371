"""GRPO in the torch twin: jax_llama.training.grpo's token log-probs and loss, on the same batch.

    logps, entropy = token_logps(model, batch, temperature)    # batch: a round's rows
    loss, metrics = policy_loss(logps, old, ref, advantages, mask, loss_type="dapo", ...)

The formulas are jax_llama.training.grpo's (see its docstring), in the same order, in float32.
"""

from __future__ import annotations

import torch

from bridge.errors import BridgeError

from .model import Llama

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")


def token_logps(model: Llama, batch: dict, temperature: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, N) log_softmax(logits / temperature) of each completion token, (B, N) entropy):
    batch "inputs" (B, L - 1), "attention" (B, L - 1), "completion" (B, N)."""
    device = next(model.parameters()).device
    inputs, attention, completion = (torch.as_tensor(batch[k], device=device).long()
                                     for k in ("inputs", "attention", "completion"))
    N = completion.shape[1]
    logits = model(inputs, attention_mask=attention)[:, -N:].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, completion[..., None])[..., 0]
    return picked, -(logp.exp() * logp).sum(-1)


def policy_loss(logps, old_logps, ref_logps, advantages, mask, *, loss_type: str,
                epsilon_low: float, epsilon_high: float, beta: float,
                max_completion_length: int, normalizer=None):
    """(loss, metrics): jax_llama.training.grpo.policy_loss in torch."""
    f32 = lambda x: torch.as_tensor(x, dtype=torch.float32, device=logps.device)
    mask = f32(mask)
    old = logps.detach() if old_logps is None else f32(old_logps)
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    A = f32(advantages)[:, None]
    per_token = -torch.minimum(ratio * A, clipped * A)
    metrics = {}
    if beta != 0.0:
        ref = f32(ref_logps)
        kl = (torch.exp(ref - logps) - (ref - logps) - 1) * ratio  # TRL's bias correction
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / f32(normalizer).clamp(min=1.0)
    else:
        raise BridgeError(f"unknown loss type {loss_type!r} (expected {', '.join(LOSS_TYPES)})",
                          field="loss_type")
    low = ((ratio < 1 - epsilon_low) & (A < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (A > 0)).float()
    metrics.update({"clip_ratio/low_mean": _masked_mean(low, mask),
                    "clip_ratio/high_mean": _masked_mean(high, mask),
                    "clip_ratio/region_mean": _masked_mean(torch.maximum(low, high), mask)})
    return loss, metrics


def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1.0)
