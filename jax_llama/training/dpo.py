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

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.progress import bar as progress_bar
from bridge.formats import Checkpoint
from tasks.preference import Pair, in_order

from bridge.atomic import write_text

from ..sharding import global_batch
from .inputs import open_init, run_config, run_tokenizer
from .lm import LanguageModelRecipe
from .recipe import plot_losses
from .spec import LOSSES, DpoSpec, RunSpec
from .state import say

if TYPE_CHECKING:
    from .step import TrainConfig

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


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

        self.lora = model.projections.lora is not None
        if self.lora and model.projections.lora.train_embeddings:
            raise BridgeError("the reference is the frozen base, so the embedding table must "
                              "stay frozen (drop --lora-train-embeddings)", field="lora")
        self.model = model.clone(projections=model.projections.replace(lora=None))
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


# -- the recipe's inputs, read and checked before the run writes anything -------------------------

@dataclass
class PreferenceInputs:
    """A DPO run's inputs, all checked before the run writes anything: the tokenizer, the model
    config, the chat template (for conversational pairs) and the encoded pairs; then its
    reference (start_reference) and the reference log-probs of the held-out pairs."""

    spec: RunSpec
    tokenizer: object
    config: LlamaConfig
    template: object | None          # bridge.chat.ChatTemplate, or None for plain-text pairs
    pairs: list                      # tasks.preference.Pair
    eval_pairs: list
    counts: dict                     # skipped (identical) and cut pairs
    reference: object = None         # Reference, once started
    eval_ref: np.ndarray | None = None
    train_ref: np.ndarray | None = None   # with precompute_ref
    batch_size: int = 0              # pairs a batch, and the rows' length: set with the reference
    seq_len: int = 0
    _logps: dict = field(default_factory=dict)

    def batches(self, tc: TrainConfig, local_batch: int):
        from tasks.preference import PairBatches

        tokens = sum(len(p.chosen) + len(p.rejected) for p in self.pairs)
        say(f"{len(self.pairs):,} preference pairs ({len(self.eval_pairs):,} held out"
             + "".join(f", {n:,} {what}" for what, n in (
                 ("skipped: chosen = rejected", self.counts["identical"]),
                 (f"cut to {tc.seq_len + 1} tokens", self.counts["cut"])) if n)
             + f"): {tokens:,} completion tokens")
        return PairBatches(self.pairs, local_batch, tc.seq_len, tc.seed, self.pad_id)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id or 0

    def start_reference(self, model, params, tc: TrainConfig, local_batch: int) -> None:
        """The reference policy of the starting weights (see jax_llama.training.dpo.Reference) and the
        held-out pairs' reference log-probs; with precompute_ref, every training pair's too,
        and the reference's copy of the weights is then dropped."""
        dpo = self.spec.dpo
        adapted = model.projections.lora is not None
        copy = None if adapted else jax.tree.map(lambda x: x.copy(), params)
        self.reference = Reference(model, copy)
        self.batch_size, self.seq_len = local_batch, tc.seq_len

        def progress(desc):
            return lambda it, total: progress_bar(it, total=total, desc=desc, unit="batch",
                                                  leave=False, enabled=self.spec.progress)
        self.eval_ref = self.reference.all_logps(params, self.eval_pairs, local_batch, tc.seq_len,
                                                 self.pad_id, progress("reference (held out)"))
        if dpo.precompute_ref:
            self.train_ref = self.reference.all_logps(params, self.pairs, local_batch, tc.seq_len,
                                                      self.pad_id, progress("reference (train)"))
            self.reference.params = None

    def batch(self, batches, step: int, params) -> dict:
        """Training batch `step` with its reference log-probs (2B,): looked up when precomputed,
        else computed now from the frozen reference."""
        rows = batches.batch(step)
        index = rows.pop("index")
        if self.train_ref is not None:
            ref = np.concatenate([self.train_ref[index, 0], self.train_ref[index, 1]])
        else:
            ref = np.asarray(self.reference.logps(params, rows))
        return {**rows, "ref_logps": ref.astype(np.float32)}

    def evaluate(self, model, params, replies: bool = False) -> dict:
        """Held-out loss, rewards and pair accuracy (jax_llama.training.dpo.evaluate); with replies, the
        model's greedy answers to the first four held-out prompts as well."""
        fn = self._logps.get(id(model))
        if fn is None:
            fn = self._logps[id(model)] = jax.jit(
                lambda p, rows: sequence_logps(model, p, rows))
        result = evaluate(model, params, self.eval_pairs, self.eval_ref, self.spec.dpo,
                                  self.batch_size, self.seq_len, self.pad_id, fn)
        say(f"held-out pairs: loss {result['loss']:.4f}, rewards/accuracies "
             f"{result['rewards/accuracies']:.1%}, the model prefers the chosen completion in "
             f"{result['preference/accuracy']:.1%}")
        if replies:
            from bridge.sampling import Sampler

            from ..inference.generate import generate

            shown = self.eval_pairs[:4]
            new = max(len(p.chosen) for p in shown) + 4
            room = self.config.max_seq_len - max(len(p.prompt) for p in shown)
            out = generate(model, params, [p.prompt.tolist() for p in shown],
                           max(1, min(new, room)), Sampler(), self.tokenizer.stop_ids).tokens
            stops = set(self.tokenizer.stop_ids)
            result["replies"] = []
            for pair, ids in zip(shown, out):
                ids = ids[:next((i for i, t in enumerate(ids) if t in stops), len(ids))]
                result["replies"].append({
                    "where": pair.where, "prompt": self.tokenizer.decode(pair.prompt),
                    "chosen": self.tokenizer.decode(pair.chosen),
                    "rejected": self.tokenizer.decode(pair.rejected),
                    "reply": self.tokenizer.decode(ids).strip()})
        return result

    def sample(self, scores: dict) -> str:
        before = {r["where"]: r["reply"] for r in scores.get("before", {}).get("replies", [])}
        return "\n".join(f"{r['where']}: chosen {r['chosen'].strip()!r}, rejected "
                         f"{r['rejected'].strip()!r}: {before.get(r['where'], '?')!r} -> "
                         f"{r['reply']!r}" for r in scores["after"]["replies"])


def _pair_texts(records) -> list[str]:
    """Every prompt and completion's text: what a BPE trained for the run reads."""
    texts = []
    for _, record in records:
        for value in record.values():
            texts += [value] if isinstance(value, str) else [m["content"] for m in value]
    return texts


def dpo_inputs(spec: RunSpec, init: Checkpoint | None = None) -> PreferenceInputs:
    """Read, check and encode a DPO run's pairs (refusing, naming FILE:LINE, what cannot train),
    with the tokenizer and, for conversational pairs, the chat template. `init`: the --init
    checkpoint already opened (inputs.open_init), else opened here; its tokenizer, config and
    chat template are read from that one opening."""
    from bridge.chat import find_template
    from tasks.preference import encode_pairs, read_pairs

    dpo = spec.dpo
    seed = spec.train.seed
    records = read_pairs(dpo.data) if dpo.data else demo_pairs(dpo.demo_pairs, seed)
    if dpo.eval_data:
        eval_records = read_pairs(dpo.eval_data)
    else:
        records, eval_records = split_pairs(records, dpo.eval_fraction, seed)
    if init is None:
        init = open_init(spec)
    tokenizer = run_tokenizer(spec, init, lambda: _pair_texts(records),
                              f"the {len(records):,} pairs")
    config = run_config(spec, init, tokenizer)
    template = None
    if any(not isinstance(r["prompt"], str) for _, r in records + eval_records):
        template = find_template(spec.out if spec.resume else init, tokenizer,
                                 None if spec.resume else dpo.chat_template)
    pairs, counts = encode_pairs(records, tokenizer, template, spec.train.seq_len)
    eval_pairs, eval_counts = encode_pairs(eval_records, tokenizer, template, spec.train.seq_len)
    if not pairs or not eval_pairs:
        raise BridgeError(f"no {'training' if not pairs else 'held-out'} pair is left to train on",
                          field="data")
    counts = {k: counts[k] + eval_counts[k] for k in counts}
    return PreferenceInputs(spec, tokenizer, config, template, pairs, eval_pairs, counts)


def eval_scalars(result: dict) -> dict:
    """A DPO evaluation's figures, without the replies, for the tracker and the metrics."""
    return {f"eval/{k}": v for k, v in result.items() if k != "replies"}


class DpoRecipe(LanguageModelRecipe):
    """`jax-llama dpo` as a recipe (jax_llama.training.recipe): batches of pairs with their
    reference log-probs, the DPO loss (train_loss), the held-out pairs' loss, rewards and
    accuracy at each evaluation and before and after (preference.json)."""

    title = "DPO"
    scalars = staticmethod(eval_scalars)  # the before/after scores' figures
    has_aux = True

    def inputs(self, init) -> None:
        # every pair is read, encoded and checked before anything is written
        self.prefs = dpo_inputs(self.spec, init)
        self.tokenizer, self.config = self.prefs.tokenizer, self.prefs.config
        self.template = self.prefs.template

    def batches(self, local_batch: int) -> None:
        self.pair_batches = self.prefs.batches(self.tc, local_batch)

    def start(self, model, params) -> None:
        self.prefs.start_reference(model, params, self.tc, self.local_batch)

    def scores(self, model, params) -> dict:
        return self.prefs.evaluate(model, params, replies=True)

    def loss(self, model):
        return train_loss(model, self.spec.dpo)

    def next_batch(self, step: int, state) -> dict:
        return global_batch(self.prefs.batch(self.pair_batches, step, state.params), self.mesh)

    def evaluate(self, params) -> dict:
        result = self.prefs.evaluate(self.network, params)
        return {"val_loss": result["loss"], **eval_scalars(result)}

    def results(self, out, model, params, scores: dict, summary: dict, tracker) -> dict:
        summary["plot"] = plot_losses(out, None, "DPO loss")
        write_text(out / "preference.json", json.dumps(scores, indent=2) + "\n")
        summary["preference"] = {when: eval_scalars(v) for when, v in scores.items()}
        summary["n_eval"] = len(self.prefs.eval_pairs)
        summary["sample"] = self.prefs.sample(scores)
        return summary
