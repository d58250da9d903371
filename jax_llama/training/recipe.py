"""A recipe: what one kind of training run does, as one object the training loop calls.

The run set-up and the loop (jax_llama.training.loop.run) are the same for every recipe: the run
directory (run.json, metrics.jsonl, checkpoints/, the loss plot), resume, the stop signals, the
NaN policy, the trackers, the optimizer and its state. What differs is the recipe's, and it is
all here, in the order the loop calls it:

  check(run)             refuse what cannot run before anything is read (an output directory
                         that holds an input, several processes where the recipe runs on one)
  read()                 read and check every input - tokenizer, model config, data, template -
                         before anything is written; refuse, naming the field, what cannot train
  record()               the setup run.json records (a resume must match it; "tracking" is left
                         out of that comparison); record_file(out, resume): its file name
  begin(out)             what the recipe saves into the run directory at the start (process 0)
  model(run)             (model, params, trainable, mesh): the network it trains, its weights
                         (LoRA adapters added), the trainable labelling for the optimizer (None:
                         all) and the device mesh (None: the default devices)
  start(model, params)   anything set up from the starting weights before the state, donated at
                         each step, holds them: DPO's and GRPO's reference
  resumed(state, meta)   the state the run goes on from (its step: 0 for a new run) and its
                         checkpoint's meta (checkpoint_meta), before the first batch
  scores(model, params)  the before/after scores (None: none), and scalars(scores) their figures
  loss(model)            the loss a train step minimises (jax_llama.training.step.Loss); has_aux:
                         whether it returns (loss, metrics)
  next_batch(step, state)   the batch of `step`, on the devices it runs on (a mesh: global_batch)
  evaluate(params)       the held-out figures, every tc.eval_every steps and at the end
  step_figures(step, figures), drop(step)   figures the host adds to a step's record (given
                         the device's), device figures it leaves out (GRPO's round figures)
  tokens_in(batch)       the tokens a step trains on
  bar(record, tokens_per_s, evaluated, mfu)   what the progress bar shows
  save(out, model, params)   the final model (LoRA: the adapter, then the merge), on every
                         process; returns the (model, params) the after-scores and finish see;
                         summary(out, last): the summary every process returns
  finish(out, model, params, scores, summary, tracker)   the files it writes at the end
                         (exact_match.json, preference.json, grpo.json, ...), the plot, and its
                         part of the summary

`Recipe` below holds the defaults every method falls back on; jax_llama.training.lm's
LanguageModelRecipe adds those of the recipes that train a Llama on tokens (lm, sft, dpo, grpo),
and jax_llama.training.finetune's FinetuneRecipe those of a classifier. A new recipe is one new
module with one subclass, plus its command-line entry that builds it and calls loop.run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .step import TrainConfig
from .tracking import TrackingSpec

RUN_RECORD = "run.json"


class BatchFailed(Exception):
    """A batch the recipe cannot make (GRPO: a reward function that failed): the run stops as
    at a NaN loss, keeping the last good step's checkpoint."""


@dataclass(frozen=True)
class RunOptions:
    """How a run meets its directory and interruptions, the same for every recipe: out, resume
    from out/checkpoints, the NaN policy (jax_llama.training.state.NonFinite), the trackers, and
    whether progress bars show on stderr."""

    out: Path
    resume: bool = False
    on_nan: str = "stop"
    max_skipped: int = 10
    tracking: TrackingSpec = TrackingSpec()
    progress: bool = True


class Recipe:
    """The defaults of a recipe (see the module's docstring); a subclass sets `tc` (its
    TrainConfig) in check() at the latest and overrides what it does differently."""

    kind: str = "run"                 # "holds no {kind} to resume"
    done: str = "trained"             # "was {done} with a different setup"
    fresh_out: bool = True            # a new run refuses a non-empty directory
    desc: str = "training"            # the progress bar's label
    has_aux: bool = False
    flops_per_token: float | None = None   # the bar shows the MFU where it is given
    record_before: dict | None = None      # what run.json files from before a key existed ran with
    tc: TrainConfig

    def check(self, run: RunOptions) -> None:
        pass

    def read(self) -> None:
        raise NotImplementedError

    def record(self) -> dict:
        raise NotImplementedError

    def record_file(self, out: Path, resume: bool) -> str:
        return RUN_RECORD

    def begin(self, out: Path) -> None:
        pass

    def model(self, run: RunOptions):
        raise NotImplementedError

    def start(self, model, params) -> None:
        pass

    def resumed(self, state, meta: dict | None) -> None:
        pass

    checkpoint_meta: bool = False     # restore the checkpoints' meta as well (resumed's meta)

    def keep_metrics(self, path: Path, step: int) -> None:
        """metrics.jsonl without the lines after `step`, which a resumed run writes again."""
        from .state import keep_metrics_until

        keep_metrics_until(path, step)

    def scores(self, model, params) -> dict | None:
        return None

    def scalars(self, scores: dict) -> dict:
        return {}

    def loss(self, model):
        raise NotImplementedError

    def next_batch(self, step: int, state) -> dict:
        raise NotImplementedError

    def evaluate(self, params) -> dict:
        return {}

    def tokens_in(self, batch: dict) -> int:
        """The tokens a step trains on: batch_size x seq_len unless the recipe counts them."""
        return self.tc.batch_size * self.tc.seq_len

    def step_figures(self, step: int, figures: dict) -> dict:
        return {}

    def drop(self, step: int) -> set:
        return set()

    def bar(self, record: dict, tokens_per_s: float, evaluated: dict | None,
            mfu: float | None = None) -> dict[str, str]:
        """What the progress bar shows after a step (`record`: its record): its "loss" and
        tokens/s, the held-out loss of the newest evaluation (`evaluated`: its figures, or None)
        - none before the first, rather than a NaN that reads like a diverged run - and the MFU
        where it is measured."""
        evaluated = evaluated or {}
        shown = {"loss": f"{record['loss']:.3f}"}
        if "val_loss" in evaluated:
            shown["val"] = f"{evaluated['val_loss']:.3f}"
        shown["tok_s"] = f"{tokens_per_s:,.0f}"
        if mfu is not None:
            shown["mfu"] = f"{mfu:.1%}"
        return shown

    def save(self, out: Path, model, params):
        return model, params

    def summary(self, out: Path, last: dict) -> dict:
        return {"steps": self.tc.steps, "train_loss": last["loss"], "val_loss": last["val_loss"]}

    def finish(self, out: Path, model, params, scores: dict, summary: dict, tracker) -> dict:
        summary["plot"] = plot_losses(out, summary.get("unigram_loss"))
        return summary


def plot_losses(out: Path, unigram: float | None, ylabel: str | None = None) -> str | None:
    """out/loss.png from out/metrics.jsonl: each step's loss and each evaluation's val_loss
    (None where matplotlib is not installed)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step" in r]  # a finetune run's from before: epochs only
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is a convenience; metrics.jsonl has the numbers
        return None
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in records], lw=0.8, alpha=0.6, label="train")
    evals = [r for r in records if "val_loss" in r]
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation")
    if unigram is not None:
        ax.axhline(unigram, ls="--", color="gray", label=f"unigram baseline ({unigram:.2f})")
    ax.set(xlabel="step", ylabel=ylabel or "cross-entropy (nats/token)", title=out.name)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    return str(out / "loss.png")
