"""Direct preference optimisation (`jax-llama dpo`): the loss, the reference policy, the demo task.

For a pair (prompt x, chosen y_w, rejected y_l), with log pi(y | x) summed over the completion's
tokens and pi_ref the frozen starting model:

    delta = [log pi(y_w|x) - log pi_ref(y_w|x)] - [log pi(y_l|x) - log pi_ref(y_l|x)]
    sigmoid (DPO):  -(1 - e) log s(beta delta) - e log s(-beta delta)   (e: label smoothing, cDPO)
    robust:         [-(1 - e) log s(beta delta) + e log s(-beta delta)] / (1 - 2e)
    hinge (SLiC):   max(0, 1 - beta delta)
    ipo:            (delta_avg - 1 / (2 beta))^2, delta_avg with each log-ratio divided by its
                    completion's length (as TRL computes IPO)

and the metrics under TRL's names: rewards/chosen = beta (log pi(y_w) - log pi_ref(y_w)),
rewards/rejected likewise, rewards/accuracies (chosen reward > rejected reward), rewards/margins,
logps/chosen, logps/rejected. torch_llama.dpo computes the same on the same batch.

The reference: with LoRA, the same weights with the adapters left out (the frozen base; no
second copy); without, a copy of the starting weights, run once per batch without gradients -
or, with precompute_ref, run once over every pair before training, and then dropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bridge.errors import BridgeError
from bridge.preference import Pair, in_order

LOSSES = ("sigmoid", "robust", "hinge", "ipo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class DpoSpec:
    data: str | None = None            # pairs JSONL; None: the demo task (demo_pairs)
    eval_data: str | None = None       # held-out pairs; None: eval_fraction of data
    chat_template: str | None = None   # for conversational pairs; None: the init's own
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    precompute_ref: bool = False       # reference log-probs for every pair before training
    eval_fraction: float = 0.1
    demo_pairs: int = 4000

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise BridgeError(f"unknown loss {self.loss!r} (expected {', '.join(LOSSES)})",
                              field="loss")
        if not (np.isfinite(self.beta) and self.beta > 0):
            raise BridgeError(f"must be positive (got {self.beta})", field="beta")
        if not 0 <= self.label_smoothing < 0.5:
            raise BridgeError(f"must be in [0, 0.5) (got {self.label_smoothing})",
                              field="label_smoothing")
        if self.label_smoothing and self.loss not in ("sigmoid", "robust"):
            raise BridgeError(f"applies to the sigmoid and robust losses, not {self.loss}",
                              field="label_smoothing")
        if not 0 < self.eval_fraction < 1:
            raise BridgeError(f"must be in (0, 1) (got {self.eval_fraction})", field="eval_fraction")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- the loss --------------------------------------------------------------------------------------

def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, n_chosen, n_rejected,
             beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0):
    """(mean loss, metrics) of B pairs from their summed completion log-probs (B,) under the
    policy and the reference, and the completions' lengths (B,), in float32."""
    def f32(x):
        return jnp.asarray(x, jnp.float32)
    policy_chosen, policy_rejected = f32(policy_chosen), f32(policy_rejected)
    chosen_ratio = policy_chosen - f32(ref_chosen)
    rejected_ratio = policy_rejected - f32(ref_rejected)
    delta = chosen_ratio - rejected_ratio
    e = label_smoothing
    if loss == "sigmoid":
        per_pair = -(1 - e) * jax.nn.log_sigmoid(beta * delta) - e * jax.nn.log_sigmoid(-beta * delta)
    elif loss == "robust":
        per_pair = (-(1 - e) * jax.nn.log_sigmoid(beta * delta)
                    + e * jax.nn.log_sigmoid(-beta * delta)) / (1 - 2 * e)
    elif loss == "hinge":
        per_pair = jax.nn.relu(1 - beta * delta)
    elif loss == "ipo":
        average = (chosen_ratio / jnp.maximum(f32(n_chosen), 1.0)
                   - rejected_ratio / jnp.maximum(f32(n_rejected), 1.0))
        per_pair = (average - 1 / (2 * beta)) ** 2
    else:
        raise BridgeError(f"unknown loss {loss!r} (expected {', '.join(LOSSES)})", field="loss")
    chosen_rewards = beta * jax.lax.stop_gradient(chosen_ratio)
    rejected_rewards = beta * jax.lax.stop_gradient(rejected_ratio)
    metrics = {"rewards/chosen": chosen_rewards.mean(),
               "rewards/rejected": rejected_rewards.mean(),
               "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32).mean(),
               "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
               "logps/chosen": jax.lax.stop_gradient(policy_chosen).mean(),
               "logps/rejected": jax.lax.stop_gradient(policy_rejected).mean()}
    return per_pair.mean(), metrics


def sequence_logps(model, params, rows: dict, key=None) -> jax.Array:
    """(2B,) float32: each row's log-probability of its completion tokens (mask 1), summed."""
    logits = model.apply({"params": params}, rows["inputs"],
                         rngs={} if key is None else {"dropout": key})
    logp = -optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                            rows["targets"])
    return jnp.sum(logp * rows["mask"].astype(jnp.float32), axis=-1)


def batch_loss(model, params, batch: dict, spec: DpoSpec, key=None):
    """dpo_loss of a batch of 2B rows (chosen first) whose reference log-probs are in
    batch["ref_logps"] (2B,)."""
    logps = sequence_logps(model, params, batch, key)
    ref, n = batch["ref_logps"], batch["n_tokens"]
    B = logps.shape[0] // 2
    return dpo_loss(logps[:B], logps[B:], ref[:B], ref[B:], n[:B], n[B:], spec.beta, spec.loss,
                    spec.label_smoothing)


def train_loss(model, spec: DpoSpec):
    """batch_loss as a jax_llama.training.step Loss with aux metrics (make_train_step(has_aux=True))."""
    return lambda params, batch, key: batch_loss(model, params, batch, spec, key)


# -- the reference ---------------------------------------------------------------------------------

class Reference:
    """The frozen starting policy. `logps(policy_params, rows)`: its (2B,) completion
    log-probs. With LoRA it reads the policy's own frozen weights, adapters left out; else it
    holds `params`, a copy of the starting weights (None once dropped)."""

    def __init__(self, model, params=None):
        from ..lora import split

        self.lora = model.lora is not None
        if self.lora and model.lora.train_embeddings:
            raise BridgeError("the reference is the frozen base, so the embedding table must "
                              "stay frozen (drop --lora-train-embeddings)", field="lora")
        self.model = model.clone(lora=None)
        self.params = None if self.lora else params
        strip = (lambda p: split(p)[0]) if self.lora else (lambda p: p)
        self._logps = jax.jit(lambda p, rows: sequence_logps(self.model, strip(p), rows))

    def logps(self, policy_params, rows: dict) -> jax.Array:
        if not self.lora and self.params is None:
            raise BridgeError("the reference weights were dropped after precomputing",
                              field="precompute_ref")
        return self._logps(policy_params if self.lora else self.params,
                           {k: rows[k] for k in ("inputs", "targets", "mask")})

    def all_logps(self, policy_params, pairs: list[Pair], batch_size: int, seq_len: int,
                  pad_id: int, progress=None) -> np.ndarray:
        """(N, 2): chosen and rejected reference log-probs of every pair, in order."""
        return pair_logps(self.logps, policy_params, pairs, batch_size, seq_len, pad_id,
                          progress)[0]


def pair_logps(logps_fn, params, pairs: list[Pair], batch_size: int, seq_len: int, pad_id: int,
               progress=None) -> tuple[np.ndarray, np.ndarray]:
    """(log-probs, completion lengths), each (N, 2) - chosen, rejected - of every pair in order:
    logps_fn(params, rows) run over batches of batch_size pairs (the last one padded)."""
    logps = np.zeros((len(pairs), 2), np.float32)
    n = np.zeros((len(pairs), 2), np.float32)
    batches = in_order(pairs, batch_size, seq_len, pad_id)
    if progress is not None:
        batches = progress(batches, -(-len(pairs) // batch_size))
    for index, rows in batches:
        values = np.asarray(logps_fn(params, _padded(
            {k: rows[k] for k in ("inputs", "targets", "mask")}, batch_size)))
        k = len(index)
        logps[index, 0], logps[index, 1] = values[:k], values[batch_size:batch_size + k]
        n[index, 0], n[index, 1] = rows["n_tokens"][:k], rows["n_tokens"][k:]
    return logps, n


def _padded(rows: dict, batch_size: int) -> dict:
    """A last, short batch of rows padded to batch_size pairs (fixed shapes: one compile);
    the padding rows come after each half's real rows."""
    B = rows["inputs"].shape[0] // 2
    if B == batch_size:
        return rows
    out = {}
    for k, v in rows.items():
        pad = np.zeros((batch_size - B, *v.shape[1:]), v.dtype)
        out[k] = np.concatenate([v[:B], pad, v[B:], pad])
    return out


def evaluate(model, params, pairs: list[Pair], ref: np.ndarray, spec: DpoSpec, batch_size: int,
             seq_len: int, pad_id: int, logps_fn=None) -> dict:
    """The loss and metrics over every pair (ref: their (N, 2) reference log-probs), and
    `preference/accuracy`: the fraction where the model itself finds the chosen completion more
    likely than the rejected one (about a coin flip for a task it has not learnt)."""
    logps_fn = logps_fn or jax.jit(lambda p, rows: sequence_logps(model, p, rows))
    policy, n = pair_logps(logps_fn, params, pairs, batch_size, seq_len, pad_id)
    loss, metrics = dpo_loss(policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], n[:, 0], n[:, 1],
                             spec.beta, spec.loss, spec.label_smoothing)
    result = {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}}
    result["preference/accuracy"] = float(np.mean(policy[:, 0] > policy[:, 1]))
    return result


# -- the demo task ---------------------------------------------------------------------------------

# The demo's kinds: those whose right answer a model can tell from a wrong one by the words'
# order or form. (The arithmetic kinds are left out: learning to add from preferences alone takes
# a model trained from scratch far longer than the demo's minutes; they stay at a coin flip.)
DEMO_KINDS = ("reverse", "sort", "spell", "capitals")


def _wrong(kind: str, answer: str) -> str:
    """A wrong answer of the same form as `answer` to a demo question of this kind."""
    if kind in ("reverse", "sort"):  # the order asked for, backwards (2-4 distinct words)
        return " ".join(reversed(answer.split()))
    if kind == "spell":  # the word spelled backwards
        return "-".join(reversed(answer.split("-")))
    if kind == "capitals":  # only the first letter
        return answer.capitalize()
    raise BridgeError(f"no wrong answer for the demo kind {kind!r}", field="kind")


def demo_pairs(n: int, seed: int) -> list[tuple[str, dict]]:
    """`n` conversational pairs over the SFT demo's word questions (jax_llama.training.sft.demo_chats,
    DEMO_KINDS): the right answer chosen, a wrong one of the same form rejected (the list in the
    other order, the word spelled backwards, only its first letter in capitals). A model that
    has not learnt the tasks finds either about as likely; one that has prefers the right one."""
    from .sft import demo_chats

    pairs = []
    for where, messages in demo_chats(3 * n, seed):
        kind, answer = where.rsplit(":", 1)[1], messages[-1]["content"]
        if kind not in DEMO_KINDS or _wrong(kind, answer) == answer:  # a palindrome's spelling
            continue
        pairs.append((where, {"prompt": messages[:-1],
                              "chosen": [{"role": "assistant", "content": answer}],
                              "rejected": [{"role": "assistant", "content": _wrong(kind, answer)}]}))
        if len(pairs) == n:
            break
    return pairs


def split_pairs(records: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): jax_llama.training.sft.hold_out's seeded split of the pairs."""
    from .sft import hold_out

    return hold_out(records, eval_fraction, seed, f"{len(records)} pair; at least two are needed "
                    f"to hold one out (or pass --eval-data)")
