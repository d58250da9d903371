"""A training run from start to finish, the same for every recipe: the run directory, resume,
the model and its optimizer, the loop, checkpoints, the final model and the summary.

`run(recipe, options)` prepares a run and hands the loop (`run_steps`) its step, its batches and
its evaluation; everything that differs between pretraining, SFT, DPO, GRPO and classifier
fine-tuning is the recipe's (jax_llama.training.recipe: its inputs, batches, loss, evaluation,
before/after scores, files and summary). `train(spec)` runs the recipe a RunSpec asks for.

A run directory holds:
  run.json        what was asked for (the recipe's record: model config, TrainConfig, data): a
                  resume must match it
  checkpoints/    orbax checkpoints of the whole TrainState every N steps (the last k kept);
                  orbax writes each into a temporary directory and renames it, so a kill never
                  leaves a half-written one
  metrics.jsonl   one line per step (loss, grad norm, lr, tokens/s) and per evaluation
  tensorboard/, wandb/   the same scalars for TensorBoard / Weights & Biases, when asked for
                  (jax_llama.training.tracking)
  loss.png        the loss curves (GRPO: reward.png, the rewards)
  model/          the final model; for a Llama, a native checkpoint with its tokenizer, ready for
                  the bridge (a LoRA run: the base with the adapter merged in); finetune: the best
                  epoch's classifier, its head in classifier.safetensors / classifier.json
and what the recipe writes besides:
  tokenizer/      the tokenizer the tokens were made with (the Llama recipes)
  adapter/        a LoRA run's adapter, as Hugging Face PEFT writes it (adapter_config.json,
                  adapter_model.safetensors)
  chat_template.jinja   an SFT run's chat template (also in model/, where generate --chat finds it)
  exact_match.json      an SFT run's greedy replies to the held-out chats, before and after
  preference.json       a DPO run's held-out metrics (loss, rewards, pair accuracy) before and
                        after, and greedy replies to a few held-out prompts
  grpo.json             a GRPO run's held-out rewards before and after, with answers
  dev_predictions.txt   a finetune run's best epoch's predictions on the dev set
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax

from bridge.atomic import write_text
from bridge.errors import BridgeError
from bridge.progress import bar as progress_bar

from ..perf import measure_matmul_peak
from .recipe import RUN_RECORD, BatchFailed, Recipe, RunOptions, plot_losses
from .spec import RunSpec
from .state import (Checkpoints, NonFinite, RunStopped, StopSignals, all_processes_reach,
                    check_resumable, say)
from .tracking import Tracker
from .step import (TrainConfig, TrainingDiverged, init_state, jit_train_step, make_optimizer,
                   place_state)

__all__ = ["RunStopped", "TrainingDiverged", "plot_losses", "run", "run_steps", "train"]


def train(spec: RunSpec) -> dict:
    """Run (or resume) the run `spec` asks for: its recipe (RunSpec.recipe) on `run`."""
    return run(spec.recipe(), spec.options())


def run(recipe: Recipe, options: RunOptions) -> dict:
    """Run (or resume) `recipe` into options.out; returns the recipe's summary (the final
    losses and output paths)."""
    out = options.out
    options.tracking.check()
    nonfinite = NonFinite(options.on_nan, options.max_skipped)
    recipe.check(options)
    record_file = recipe.record_file(out, options.resume)
    if options.resume and not (out / record_file).is_file():
        raise BridgeError(f"{out} holds no {recipe.kind} to resume (no {record_file})",
                          field="resume")
    if not options.resume and recipe.fresh_out and out.exists() and any(out.iterdir()):
        raise BridgeError(f"{out} is not empty", field="out",
                          hint=("resume", True, "pass {} to continue that run"))
    recipe.read()  # every input is read and checked before anything is written
    record = recipe.record()
    if options.resume:
        check_resumable(out, {k: v for k, v in record.items() if k != "tracking"}, record_file,
                        recipe.kind, recipe.done, before=recipe.record_before)
    # Several processes share the run directory; process 0 writes it, after every process has
    # checked it and before any reads it back.
    primary = jax.process_index() == 0
    all_processes_reach("checked the run directory")
    if primary:
        out.mkdir(parents=True, exist_ok=True)
        recipe.begin(out)
        if record_file == RUN_RECORD:  # a run directory of an older layout keeps its record
            write_text(out / RUN_RECORD, json.dumps(record, indent=2) + "\n")
    all_processes_reach("wrote the run directory")

    tc = recipe.tc
    model, params, trainable, mesh = recipe.model(options)
    optimizer = make_optimizer(tc, trainable)
    recipe.start(model, params)  # before the state (donated at each step) holds the weights
    state = init_state(params, optimizer)
    if mesh is not None:
        state = place_state(state, mesh)
    checkpoints = Checkpoints(out / "checkpoints", tc.keep_checkpoints)
    meta = None
    if options.resume:  # from the newest checkpoint that restores; none written yet: the start
        restored = checkpoints.restore_newest(state, mesh, with_meta=recipe.checkpoint_meta)
        if restored is not None:
            state, meta, _ = restored
            say(f"resumed {out} at step {int(state.step)}")
        if primary:
            recipe.keep_metrics(out / "metrics.jsonl", int(state.step))
    # Only the primary process logs; a resumed run appends from the step it resumed at.
    tracker = Tracker.open(options.tracking, out, record,
                           int(state.step) if options.resume else None) if primary else Tracker()
    with tracker:
        scores = {}
        if not options.resume and (before := recipe.scores(model, params)) is not None:
            scores["before"] = before
            tracker.log(0, recipe.scalars(before))
        train_step = jit_train_step(recipe.loss(model), optimizer, tc, state, mesh, trainable,
                                    has_aux=recipe.has_aux, skip_nonfinite=nonfinite.skip)
        recipe.resumed(state, meta)
        state, last = run_steps(state, train_step, recipe, tc, desc=recipe.desc,
                                checkpoints=checkpoints, nonfinite=nonfinite, tracker=tracker,
                                metrics=out / "metrics.jsonl" if primary else None,
                                progress=options.progress)
        params = state.params
        model, params = recipe.save(out, model, params)
        summary = recipe.summary(out, last)
        if not primary:
            return summary
        if (after := recipe.scores(model, params)) is not None:
            scores["after"] = after
            tracker.log(tc.steps, recipe.scalars(after))
        return recipe.finish(out, model, params, scores, summary, tracker)


def run_steps(state, train_step, recipe: Recipe, tc: TrainConfig, *, desc: str,
              checkpoints: Checkpoints, nonfinite: NonFinite, tracker: Tracker,
              metrics: Path | None, progress: bool = True):
    """The loop: from the state's step to tc.steps, `train_step(state, recipe.next_batch(step,
    state))`. Each step's record - step, the step's metrics (loss, grad_norm, lr, ...) less those
    recipe.drop(step) names, recipe.step_figures(step, figures), tokens/s (recipe.tokens_in(batch) a
    step) - is appended to `metrics` (None: this process writes nothing) and logged by
    `tracker`; `recipe.evaluate(params)` runs every tc.eval_every steps and at the end, its
    figures (val_loss first) joining that step's record. A checkpoint every tc.checkpoint_every
    steps, at the end and at an early stop. The NaN policy (`nonfinite`) and the stop signals end
    the run with TrainingDiverged / RunStopped, naming the checkpoint to go on from; so does a
    batch the recipe cannot make (BatchFailed), with the last good step's checkpoint. progress:
    the bar on stderr (bridge.progress), its figures recipe.bar's, with the MFU where the recipe
    gives its flops_per_token. Returns (state, last): last holds the final "loss" and "val_loss"
    (NaN where the evaluation has none)."""
    flops_per_token = recipe.flops_per_token
    peak = measure_matmul_peak(tc.dtype) if flops_per_token else None
    last = {"loss": float("nan"), "val_loss": float("nan")}
    evaluated = None  # the newest evaluation's figures: none yet
    start = int(state.step)
    stopped = None
    with open(metrics or os.devnull, "a") as log, \
            progress_bar(total=tc.steps, initial=start, desc=desc, unit="step",
                         enabled=progress) as bar, \
            StopSignals() as signals:
        tick = time.perf_counter()
        for step in range(start, tc.steps):
            try:
                batch = recipe.next_batch(step, state)
            except BatchFailed as e:  # the state is the last good step's: kept
                if step > start:
                    checkpoints.save(step, state)
                raise TrainingDiverged(f"{e}; stopped. " + (
                    f"Its checkpoint: {checkpoints.path(step)}" if step > start else
                    "Last good checkpoint: " + _latest(checkpoints))) from None
            tokens = recipe.tokens_in(batch)
            state, figures = train_step(state, batch)
            figures = {k: float(v) for k, v in jax.device_get(figures).items()}
            dropped = recipe.drop(step)
            figures = {**{k: v for k, v in figures.items() if k not in dropped},
                       **recipe.step_figures(step, figures)}
            why = nonfinite.check(step + 1, figures)
            if why is not None and not nonfinite.skip:  # this state is never saved
                raise nonfinite.diverged(why, checkpoints)
            now = time.perf_counter()
            tokens_per_s = tokens / (now - tick)
            tick = now
            record = {"step": step + 1, **figures, "tokens_per_s": tokens_per_s}
            if nonfinite.skipped and nonfinite.skipped[-1] == step + 1:
                record["skipped"] = True
            if (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps:
                evaluated = recipe.evaluate(state.params)
                record.update(evaluated)
                last["val_loss"] = record.get("val_loss", float("nan"))
                tick = time.perf_counter()  # evaluation time is not training throughput
            if why is not None:  # too many skipped: the state itself is still good
                stopped = (step + 1, why, False)
            elif signals.requested:
                stopped = (step + 1, signals.requested, True)
            if ((step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.steps
                    or stopped is not None):
                checkpoints.save(step + 1, state)
            log.write(json.dumps(record) + "\n")
            log.flush()
            tracker.log(step + 1, record)
            last["loss"] = figures["loss"]
            # refresh=False: the bar is drawn by update(), at its own pace (a log's is coarse)
            bar.set_postfix(recipe.bar(record, tokens_per_s, evaluated,
                                       tokens_per_s * flops_per_token / peak if peak else None),
                            refresh=False)
            bar.update()
            if stopped is not None:
                break
    if stopped is not None:
        step, why, asked = stopped
        if asked:
            raise RunStopped(step, tc.steps, why, checkpoints.path(step))
        raise nonfinite.diverged(why, checkpoints, checkpoints.path(step))
    return state, last


def _latest(checkpoints: Checkpoints) -> str:
    kept = checkpoints.latest_step()
    return "none" if kept is None else str(checkpoints.path(kept))


