"""Group relative policy optimisation (`jax-llama grpo`): reinforcement learning from rewards a
program checks, on the one training loop, as TRL 1.16's GRPOTrainer defines it.

A round: P prompts, G completions each (num_generations), sampled from the current policy by the
KV-cache generator that `generate` uses, all P x G in one batch. Every reward function scores
every completion (tasks.rewards: TRL's calling convention); the weighted sum r_i of a completion
becomes its advantage within its group of G:

    A_i = (r_i - mean(r of its group)) / (std(r of its group) + 1e-4)

(scale_rewards "batch": the std of the whole round; "none": no division; a completion no reward
function scores gets A = 0). The policy is then updated num_iterations times on the round, each
update grad_accum micro-batches of batch_size completions. A token's log-probability is
log_softmax(logits / temperature)[token] over the whole vocabulary (TRL's: top-k / top-p choose
the draw, not the probability), recorded by the sampler as it draws and recomputed by the
trainer; with ratio = exp(logp - logp_old), logp_old the policy that sampled the round,

    per-token loss = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta KL
    KL = (exp(ref - logp) - (ref - logp) - 1) ratio  (ref: the base without LoRA adapters, or
                                                      the starting weights; times the ratio as
                                                      TRL's use_bias_correction_kl, its default)

and the completion tokens' losses (mask: up to and including the stop token) are summed as the
loss type says:

    dapo      sum / (completion tokens of the whole round / grad_accum)    (TRL's default)
    grpo      mean over completions of each one's mean
    bnpo      sum / (completion tokens of the micro-batch)
    dr_grpo   sum / (completions x max_completion_length)

With num_iterations 1 logp_old is logp itself (its gradient stopped): the ratio is 1 and the
loss is the policy gradient. The metrics carry TRL's names (reward, reward_std,
rewards/NAME/mean, frac_reward_zero_std, completions/mean_length, kl, clip_ratio/*, entropy) and
`sampler/logp_diff_max`: the largest difference between the sampler's and the trainer's
log-probability of a sampled token, in the round's first update, when both are the same policy.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.progress import bar as progress_bar
from tasks.rewards import Reward, RewardFailed, load_reward, score

from bridge.atomic import write_text

from ..sharding import global_batch
from .grpo_loss import _nanstd, group_advantages, policy_loss, token_logps, train_loss
from .grpo_prompts import Prompt, demo_prompts, encode_prompts, read_prompts
from .inputs import open_init, run_config, run_tokenizer
from .lm import LanguageModelRecipe
from .recipe import BatchFailed
from .spec import GrpoSpec, RunSpec
from .state import say

DEMO_REWARDS = ("exact_answer",)


# General questions asked before and after, greedy, shown side by side: what RL on one task
# does to the rest of what the model answers.
GENERAL_QUESTIONS = ("What is the capital of France?", "Name three colours of the rainbow.",
                     "Write one sentence about the sea.")


# -- the inputs, read and checked before the run writes anything --------------------------------

@dataclass
class _Round:
    index: int
    rows: dict                     # numpy arrays, R rows each
    metrics: dict
    seconds: dict
    logged: list                   # a few completions as text


@dataclass
class GrpoInputs:
    """A GRPO run's inputs: tokenizer, model config, chat template, the encoded prompts and the
    reward functions, all checked before the run writes anything; then (start) the model and
    the round being trained on."""

    spec: RunSpec
    tokenizer: object
    config: LlamaConfig
    template: object | None
    prompts: list
    eval_prompts: list
    rewards: list                  # tasks.rewards.Reward
    weights: np.ndarray
    prompt_len: int = 0            # the prompts' padded length (the longest)
    model: object = None
    reference: object = None
    _round: _Round | None = None
    _jitted: dict = field(default_factory=dict)
    _handed: float = 0.0

    @property
    def grpo(self) -> GrpoSpec:
        return self.spec.grpo

    @property
    def round_size(self) -> int:   # completions a round: batch_size x grad_accum
        return self.spec.train.batch_size * self.spec.train.grad_accum

    @property
    def steps_per_round(self) -> int:
        return self.spec.train.grad_accum * self.grpo.num_iterations

    @property
    def stop_ids(self) -> tuple:
        return tuple(self.tokenizer.stop_ids)

    def start(self, model, params) -> None:
        """Hold the model; with beta > 0, the reference: the frozen base (LoRA: the same
        weights with the adapters left out) or a copy of the starting weights."""
        self.model = model
        if self.grpo.beta > 0:
            from ..lora import split

            base = model.clone(projections=model.projections.replace(lora=None))
            if model.projections.lora is not None:
                if model.projections.lora.train_embeddings:
                    raise BridgeError("the reference is the frozen base, so the embedding table "
                                      "must stay frozen (drop --lora-train-embeddings)",
                                      field="lora")
                self.reference = (base, None, lambda p: split(p)[0])
            else:
                self.reference = (base, jax.tree.map(lambda x: x.copy(), params), None)
        say(f"{len(self.prompts):,} prompts ({len(self.eval_prompts):,} held out); a round: "
            f"{self.round_size // self.grpo.num_generations} prompts x "
            f"{self.grpo.num_generations} completions of up to "
            f"{self.grpo.max_completion_length} tokens, {self.grpo.num_iterations} update(s) of "
            f"{self.spec.train.grad_accum} micro-batch(es) of {self.spec.train.batch_size}; "
            f"rewards: {', '.join(r.name for r in self.rewards)}")

    # -- a round ------------------------------------------------------------------------------

    def _round_prompts(self, index: int) -> list[Prompt]:
        """The prompts of round `index`: the next P of a seeded order, reshuffled each pass."""
        P, n, seed = self.round_size // self.grpo.num_generations, len(self.prompts), \
            self.spec.train.seed
        chosen = []
        for k in range(index * P, (index + 1) * P):
            order = np.random.default_rng([seed, 31, k // n]).permutation(n)
            chosen.append(self.prompts[order[k % n]])
        return chosen

    def _roll(self, params, index: int, step: int, total: int) -> _Round:
        """Sample round `index` from `params`, score it, and make its rows."""
        from bridge.int4 import activations, using_activations
        from bridge.sampling import Sampler

        from ..inference.generate import generate

        g, N = self.grpo, self.grpo.max_completion_length
        G = g.num_generations
        prompts = [p for p in self._round_prompts(index) for _ in range(G)]
        started = time.perf_counter()
        # the trainer's 4-bit activations (float32 unless the environment says int8), not
        # generation's: the sampler's log-probabilities are then the trainer's numbers
        with using_activations(activations()):
            out = generate(self.model, params, [p.ids for p in prompts], N,
                           Sampler(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p),
                           self.stop_ids, key=jax.random.fold_in(
                               jax.random.key(self.spec.train.seed), index),
                           tempered_logprobs=True)
        generated = time.perf_counter()
        stops = set(self.stop_ids)
        texts = [self.tokenizer.decode([t for t in ids if t not in stops]) for ids in out.tokens]
        truncated = np.array([not (ids and ids[-1] in stops) for ids in out.tokens])
        completions = [t if isinstance(p.prompt, str) else [{"role": "assistant", "content": t}]
                       for p, t in zip(prompts, texts)]
        columns = {k: [p.columns.get(k) for p in prompts]
                   for k in dict.fromkeys(k for p in prompts for k in p.columns)}
        logged_metrics = {}
        rpf = score(self.rewards, [p.prompt for p in prompts], completions,
                    [list(ids) for ids in out.tokens], columns,
                    trainer_state=_TrainerState(step, total),
                    log_metric=lambda name, value: logged_metrics.__setitem__(name, value))
        adv = group_advantages(rpf, self.weights, G, g.scale_rewards)
        scored = time.perf_counter()
        rows = self._rows(prompts, out, truncated, adv["advantages"])
        lengths = np.array([len(ids) for ids in out.tokens], np.float32)
        metrics = {"reward": float(np.nanmean(adv["rewards"])),
                   "reward_std": float(_nanstd(adv["rewards"])),
                   "frac_reward_zero_std": float(adv["zero_std"].mean()),
                   "completions/mean_length": float(lengths.mean()),
                   "completions/min_length": float(lengths.min()),
                   "completions/max_length": float(lengths.max()),
                   "completions/clipped_ratio": float(truncated.mean()),
                   **{f"rewards/{r.name}/mean": float(np.nanmean(rpf[:, j]))
                      if not np.isnan(rpf[:, j]).all() else float("nan")
                      for j, r in enumerate(self.rewards)},
                   **{k: float(v) for k, v in logged_metrics.items()}}
        if g.num_iterations > 1:  # the sampling policy's log-probs, as the trainer computes them
            rows["old_logps"] = self._logps(self.model, params, rows)
        if g.beta > 0:
            model, copy, strip = self.reference
            rows["ref_logps"] = self._logps(model, copy if copy is not None else strip(params),
                                            rows, ref=True)
        logged = [{"step": step + 1, "round": index, "prompt": _as_text(p.prompt),
                   "completion": t, "rewards": {r.name: None if np.isnan(rpf[i, j])
                                                else float(rpf[i, j])
                                                for j, r in enumerate(self.rewards)},
                   "advantage": float(adv["advantages"][i])}
                  for i, (p, t) in enumerate(zip(prompts, texts)) if i < 2]
        seconds = {"generation": generated - started, "scoring": scored - generated}
        return _Round(index, rows, metrics, seconds, logged)

    def _rows(self, prompts, out, truncated, advantages) -> dict:
        """The round's rows: the prompt left-padded to prompt_len, then the completion
        right-padded to max_completion_length; its mask up to and including the stop token (all
        0 for a truncated completion with mask_truncated_completions)."""
        R, P, N = len(prompts), self.prompt_len, self.grpo.max_completion_length
        tokens = np.zeros((R, P + N), np.int32)
        attention = np.zeros((R, P + N), np.int32)
        sampler = np.zeros((R, N), np.float32)
        mask = np.zeros((R, N), np.float32)
        for i, (p, ids, logps) in enumerate(zip(prompts, out.tokens, out.logprobs)):
            tokens[i, P - len(p.ids):P], attention[i, P - len(p.ids):P] = p.ids, 1
            tokens[i, P:P + len(ids)], attention[i, P:P + len(ids)] = ids, 1
            sampler[i, :len(ids)] = logps
            mask[i, :len(ids)] = 0.0 if (truncated[i] and self.grpo.mask_truncated_completions) \
                else 1.0
        A = self.spec.train.grad_accum
        return {"inputs": tokens[:, :-1], "attention": attention[:, :-1],
                "completion": tokens[:, P:], "mask": mask, "sampler_logps": sampler,
                "advantages": advantages.astype(np.float32),
                # per row (a batch is split by rows over the mesh), the same in every row
                "normalizer": np.full((R,), mask.sum() / A, np.float32)}

    def _logps(self, model, params, rows: dict, ref: bool = False) -> np.ndarray:
        """(R, N) token log-probs of the round's rows under `params`, micro-batch by
        micro-batch, without gradients."""
        key = ("ref" if ref else "old")
        if key not in self._jitted:
            self._jitted[key] = jax.jit(
                lambda p, b: token_logps(model, p, b, self.grpo.temperature)[0])
        B = self.spec.train.batch_size
        parts = [np.asarray(self._jitted[key](params, {k: rows[k][i:i + B] for k in (
            "inputs", "attention", "completion")})) for i in range(0, len(rows["mask"]), B)]
        return np.concatenate(parts)

    def batch(self, step: int, params, total: int) -> dict:
        """Micro-batch `step`: a new round (sampled from `params`) at each round's first step,
        then the round's rows in order, num_iterations times over."""
        index = step // self.steps_per_round
        if self._round is None or self._round.index != index:
            self._round = self._roll(params, index, step, total)
        B, A = self.spec.train.batch_size, self.spec.train.grad_accum
        m = step % A
        self._handed = time.perf_counter()
        return {k: v[m * B:(m + 1) * B] for k, v in self._round.rows.items()}

    def step_figures(self, step: int) -> dict:
        """The host's figures of micro-batch `step`, after it ran: the round's rewards and
        lengths and its generation and scoring times on the round's first step; the update's
        time on each; the sampler/trainer difference only where both were the same policy
        (the round's first update)."""
        figures = {"time/update": time.perf_counter() - self._handed}
        first = step % self.steps_per_round == 0
        if first:
            figures.update(self._round.metrics)
            figures.update({f"time/{k}": v for k, v in self._round.seconds.items()})
            self._log_completions()
        return figures

    def drop(self, step: int) -> set:
        """Names of the device figures that do not hold at micro-batch `step`: the sampler's
        difference is only meaningful while the weights are those that sampled."""
        return set() if step % self.steps_per_round < self.spec.train.grad_accum else \
            {"sampler/logp_diff_max"}

    def _log_completions(self) -> None:
        path = self.spec.out / "completions.jsonl"
        if self._round.logged:
            with open(path, "a", encoding="utf-8") as f:
                for record in self._round.logged:
                    f.write(json.dumps(record) + "\n")

    # -- held-out scoring -----------------------------------------------------------------------

    def evaluate(self, model, params, answers: bool = False) -> dict:
        """The held-out prompts, greedy, scored by the same rewards: eval/reward and each
        function's mean (with answers: the general questions' replies too)."""
        from bridge.sampling import Sampler

        from ..inference.generate import generate

        held = self.eval_prompts
        N = self.grpo.max_completion_length
        stops = set(self.stop_ids)
        B = max(1, min(len(held), self.spec.train.batch_size))
        texts, ids_all = [], []
        for i in progress_bar(range(0, len(held), B), desc="held-out prompts (greedy)",
                              unit="batch", leave=False, enabled=self.spec.progress):
            part = held[i:i + B]
            out = generate(model, params, [p.ids for p in part], N, Sampler(), self.stop_ids)
            ids_all += [list(ids) for ids in out.tokens]
            texts += [self.tokenizer.decode([t for t in ids if t not in stops])
                      for ids in out.tokens]
        completions = [t if isinstance(p.prompt, str) else [{"role": "assistant", "content": t}]
                       for p, t in zip(held, texts)]
        columns = {k: [p.columns.get(k) for p in held]
                   for k in dict.fromkeys(k for p in held for k in p.columns)}
        rpf = score(self.rewards, [p.prompt for p in held], completions, ids_all, columns,
                    trainer_state=_TrainerState(0, 0), log_metric=lambda name, value: None)
        rewards = np.nansum(rpf * self.weights[None, :], axis=1)
        result = {"eval/reward": float(np.mean(rewards)),
                  **{f"eval/rewards/{r.name}/mean": float(np.nanmean(rpf[:, j]))
                     if not np.isnan(rpf[:, j]).all() else float("nan")
                     for j, r in enumerate(self.rewards)}}
        say(f"held-out prompts ({len(held)}), greedy: reward {result['eval/reward']:.3f}"
            + "".join(f", {r.name} {result[f'eval/rewards/{r.name}/mean']:.3f}"
                      for r in self.rewards))
        if answers:
            result["samples"] = [{"prompt": _as_text(p.prompt), "completion": t}
                                 for p, t in list(zip(held, texts))[:4]]
            result["general"] = self.general_answers(model, params)
        return result

    def general_answers(self, model, params) -> list[dict]:
        """Greedy replies (48 tokens at most, fewer where the context is shorter) to
        GENERAL_QUESTIONS, in the chat template when there is one."""
        from bridge.sampling import Sampler

        from ..inference.generate import generate

        if self.template is not None:
            ids = [self.template.encode([{"role": "user", "content": q}], self.tokenizer,
                                        add_generation_prompt=True) for q in GENERAL_QUESTIONS]
        else:
            ids = [self.tokenizer.encode(q, bos=self.tokenizer.add_bos)
                   for q in GENERAL_QUESTIONS]
        room = self.config.max_seq_len - max(map(len, ids))
        if room < 1:
            return []
        out = generate(model, params, ids, min(48, room), Sampler(), self.stop_ids)
        stops = set(self.stop_ids)
        return [{"question": q, "answer": self.tokenizer.decode(
            [t for t in toks if t not in stops]).strip()}
            for q, toks in zip(GENERAL_QUESTIONS, out.tokens)]


class _TrainerState:
    """What a reward function sees of the run as TRL's `trainer_state`: the step."""

    def __init__(self, step: int, total: int):
        self.global_step, self.max_steps = step, total


def _as_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(
        f"{m['role']}: {m['content']}" for m in prompt)


def grpo_inputs(spec: RunSpec, init=None) -> GrpoInputs:
    """Read and check a GRPO run's inputs before anything is written: the reward functions (each
    importable and callable), the prompts (FILE:LINE for a malformed line or one too long for
    the context with the completion budget), the batch (a whole number of groups)."""
    from bridge.chat import find_template

    g, tc = spec.grpo, spec.train
    if not spec.init and not spec.resume:
        raise BridgeError("GRPO starts from a trained model: give --init CHECKPOINT",
                          field="init")
    if (tc.batch_size * tc.grad_accum) % g.num_generations:
        raise BridgeError(f"batch_size x grad_accum = {tc.batch_size * tc.grad_accum} completions "
                          f"a round is not a whole number of groups of num_generations "
                          f"{g.num_generations}", field="batch_size")
    specs = g.rewards or (DEMO_REWARDS if g.data is None else ())
    if not specs:
        raise BridgeError("give at least one --reward (FILE.py:FUNC, regex:PATTERN, or a "
                          "built-in: exact_answer, number_only)", field="reward")
    rewards = [load_reward(s) for s in specs]
    weights = np.ones(len(rewards), np.float32) if g.reward_weights is None else \
        np.asarray(g.reward_weights, np.float32)
    if len(weights) != len(rewards):
        raise BridgeError(f"{len(weights)} weights for {len(rewards)} rewards",
                          field="reward_weights")
    seed = tc.seed
    records = read_prompts(g.data) if g.data else demo_prompts(g.demo_prompts, seed)
    if g.eval_data:
        eval_records = read_prompts(g.eval_data)
    else:
        from .sft import hold_out

        records, eval_records = hold_out(records, g.eval_fraction, seed,
                                         f"{len(records)} prompt; at least two are needed to "
                                         f"hold one out (or pass --eval-data)")
    eval_records = eval_records[:g.eval_prompts]
    if init is None:
        init = open_init(spec)
    tokenizer = run_tokenizer(spec, init, lambda: [], "the prompts")
    config = run_config(spec, init, tokenizer, rows_of_seq_len=False)
    template = None
    if any(not isinstance(r["prompt"], str) for _, r in records + eval_records):
        template = find_template(spec.out if spec.resume else init, tokenizer,
                                 None if spec.resume else g.chat_template)
    context = config.max_seq_len
    prompts = encode_prompts(records, tokenizer, template, context, g.max_completion_length)
    eval_prompts = encode_prompts(eval_records, tokenizer, template, context,
                                  g.max_completion_length)
    inputs = GrpoInputs(spec, tokenizer, config, template, prompts, eval_prompts, rewards,
                        weights)
    inputs.prompt_len = max(len(p.ids) for p in prompts)
    if inputs.prompt_len + g.max_completion_length > context:
        raise BridgeError(f"the longest prompt ({inputs.prompt_len} tokens) and "
                          f"max_completion_length {g.max_completion_length} exceed the model's "
                          f"context ({context})", field="max_completion_length")
    return inputs


def plot_rewards(out: Path, before: float | None = None) -> str | None:
    """out/reward.png: each round's mean reward and each held-out evaluation's over steps, from
    `before` (the held-out reward at step 0) on (None where matplotlib is not installed)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [r for r in records if "reward" in r]
    held = [r for r in records if "eval/reward" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["reward"] for r in train], lw=0.8, alpha=0.7,
            label="sampled completions (mean reward of the round)")
    start = [] if before is None else [(0, before)]
    points = start + [(r.get("step", 0), r["eval/reward"]) for r in held]
    ax.plot([s for s, _ in points], [v for _, v in points], "o-", label="held-out prompts, greedy")
    ax.set(xlabel="step", ylabel="reward", title=out.name)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=120)
    plt.close(fig)
    return str(out / "reward.png")


def eval_scalars(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("samples", "general")}


class GrpoRecipe(LanguageModelRecipe):
    """`jax-llama grpo` as a recipe (jax_llama.training.recipe): each round sampled and scored on
    the host (GrpoInputs.batch), the clipped policy loss (train_loss), the held-out prompts'
    rewards at each evaluation and before and after (grpo.json); its progress bar and its plot
    show rewards."""

    title = "GRPO"
    scalars = staticmethod(eval_scalars)  # the before/after scores' figures
    has_aux = True
    reward: float | None = None  # the last round's mean reward, for the bar

    def inputs(self, init) -> None:
        # every prompt and reward function is read and checked before anything is written
        self.rl = grpo_inputs(self.spec, init)
        self.tokenizer, self.config = self.rl.tokenizer, self.rl.config
        self.template = self.rl.template

    def read(self) -> None:
        super().read()
        self.flops_per_token = None  # a step's work is mostly sampling: no MFU

    def batches(self, local_batch: int) -> None:
        pass  # sampled round by round

    def start(self, model, params) -> None:
        self.rl.start(model, params)

    def scores(self, model, params) -> dict:
        return self.rl.evaluate(model, params, answers=True)

    def loss(self, model):
        return train_loss(model, self.spec.grpo)

    def next_batch(self, step: int, state) -> dict:
        try:
            rows = self.rl.batch(step, state.params, self.tc.steps)
        except RewardFailed as e:
            raise BatchFailed(str(e)) from None
        return global_batch(rows, self.mesh)

    def tokens_in(self, batch: dict) -> int:
        return int(batch["inputs"].size)

    def step_figures(self, step: int, figures: dict) -> dict:
        return self.rl.step_figures(step)

    def drop(self, step: int) -> set:
        return self.rl.drop(step)

    def evaluate(self, params) -> dict:
        return eval_scalars(self.rl.evaluate(self.network, params))

    def bar(self, record: dict, tokens_per_s: float, evaluated: dict | None,
            mfu: float | None = None) -> dict[str, str]:
        """The last loss, the last round's mean reward (in the record of its first step) and
        the newest held-out reward, once scored."""
        if "reward" in record:
            self.reward = record["reward"]
        evaluated = evaluated or {}
        shown = {"loss": f"{record['loss']:.4f}"}
        if self.reward is not None:
            shown["reward"] = f"{self.reward:.3f}"
        if "eval/reward" in evaluated:
            shown["held_out"] = f"{evaluated['eval/reward']:.3f}"
        if mfu is not None:
            shown["mfu"] = f"{mfu:.1%}"
        return shown

    def results(self, out, model, params, scores: dict, summary: dict, tracker) -> dict:
        summary["plot"] = plot_rewards(out, scores.get("before", {}).get("eval/reward"))
        write_text(out / "grpo.json", json.dumps(scores, indent=2) + "\n")
        summary["grpo"] = {when: eval_scalars(v) for when, v in scores.items()}
        summary["general"] = {when: v["general"] for when, v in scores.items()}
        summary["n_eval"] = len(self.rl.eval_prompts)
        summary["sample"] = "\n".join(f"{s['prompt']!r} -> {s['completion']!r}"
                                      for s in scores["after"]["samples"])
        return summary


__all__ = ["GrpoInputs", "GrpoRecipe", "Reward", "RewardFailed", "group_advantages", "policy_loss",
           "token_logps", "train_loss", "grpo_inputs", "demo_prompts"]
