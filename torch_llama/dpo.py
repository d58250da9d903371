"""DPO in the torch twin: jax_llama.training.dpo's loss, rewards and log-probs, on the same batch.

    logps = sequence_logps(model, rows)        # rows: tasks.preference.pair_rows (2B rows)
    loss, metrics = dpo_loss(logps[:B], logps[B:], ref[:B], ref[B:], n[:B], n[B:], beta=0.1)

The formulas are jax_llama.training.dpo's (see its docstring): the twins compute each in the same order,
in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bridge.errors import BridgeError

from .model import Llama

LOSSES = ("sigmoid", "robust", "hinge", "ipo")


def sequence_logps(model: Llama, rows: dict) -> torch.Tensor:
    """(2B,) float32: each row's summed log-probability of its completion tokens (mask 1)."""
    device = next(model.parameters()).device
    inputs, targets, mask = (torch.as_tensor(rows[k], device=device)
                             for k in ("inputs", "targets", "mask"))
    logp = torch.log_softmax(model(inputs.long()).float(), dim=-1)
    picked = logp.gather(-1, targets.long()[..., None])[..., 0]
    return (picked * mask.float()).sum(-1)


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, n_chosen, n_rejected,
             beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0):
    """(mean loss, metrics) of B pairs: jax_llama.training.dpo.dpo_loss in torch."""
    f32 = lambda x: torch.as_tensor(x, dtype=torch.float32, device=policy_chosen.device)
    policy_chosen, policy_rejected = policy_chosen.float(), policy_rejected.float()
    chosen_ratio = policy_chosen - f32(ref_chosen)
    rejected_ratio = policy_rejected - f32(ref_rejected)
    delta = chosen_ratio - rejected_ratio
    e = label_smoothing
    if loss == "sigmoid":
        per_pair = -(1 - e) * F.logsigmoid(beta * delta) - e * F.logsigmoid(-beta * delta)
    elif loss == "robust":
        per_pair = (-(1 - e) * F.logsigmoid(beta * delta)
                    + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)
    elif loss == "hinge":
        per_pair = torch.relu(1 - beta * delta)
    elif loss == "ipo":
        average = (chosen_ratio / f32(n_chosen).clamp(min=1.0)
                   - rejected_ratio / f32(n_rejected).clamp(min=1.0))
        per_pair = (average - 1 / (2 * beta)) ** 2
    else:
        raise BridgeError(f"unknown loss {loss!r} (expected {', '.join(LOSSES)})", field="loss")
    chosen_rewards = beta * chosen_ratio.detach()
    rejected_rewards = beta * rejected_ratio.detach()
    metrics = {"rewards/chosen": chosen_rewards.mean(),
               "rewards/rejected": rejected_rewards.mean(),
               "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
               "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
               "logps/chosen": policy_chosen.detach().mean(),
               "logps/rejected": policy_rejected.detach().mean()}
    return per_pair.mean(), metrics
