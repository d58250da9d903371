"""Fine-tuning a classifier (`jax-llama finetune`): LlamaClassifier (backbone + head on the last
real token) trained with the same optax AdamW and the same compiled step as pretraining
(jax_llama.training.step: make_optimizer's clipping, warmup + cosine, decay mask and gradient
accumulation; jit_train_step with classifier_loss), on the same loop (loop.run_steps): a recipe
whose batches are epochs of labelled texts and whose evaluation, at each epoch's end, measures
the dev set and keeps the best epoch's classifier. Batches are padded to a power-of-two length and built
from examples of similar length, so there are few compilations and little padding. The
classifier itself, prediction and zero-shot prompting are jax_llama.classify's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from tasks.classification import (FROM_SCRATCH, META_FILE, PRETRAINED, PRETRAINED_LORA, Dataset,
                                   accuracy, encode_texts, write_predictions)
from bridge.errors import BridgeError
from bridge.inputs import length_batches, pad_rows
from bridge.resources import available_memory

from ..classify import Classifier, FrozenFeatures, predict_ids
from ..model.heads import LlamaClassifier
from ..model.inputs import bucket
from ..lora import trainable_for
from .loop import run
from .recipe import RUN_RECORD, Recipe, RunOptions, plot_losses
from .state import keep_metrics_until, say
from .step import Loss, TrainConfig, TrainingDiverged
from .tracking import TrackingSpec


def frozen_features(clf: Classifier, train_rows: list[list[int]], dev_rows: list[list[int]],
                    train_layers: int | None, enabled: bool = True, progress: bool = True
                    ) -> tuple[FrozenFeatures, FrozenFeatures] | None:
    """(train, dev) FrozenFeatures when the blocks below the top `train_layers` are frozen and
    their output for both sets fits in a quarter of the memory available; None otherwise (then
    every step runs the whole backbone). progress: a bar for each set on stderr."""
    n = clf.model.config.n_layers
    if not enabled or train_layers is None or train_layers >= n or clf.model.scan_layers:
        return None
    need = FrozenFeatures.nbytes(clf, train_rows) + FrozenFeatures.nbytes(clf, dev_rows)
    have = available_memory()
    if have is not None and need > have // 4:
        say(f"the frozen blocks' output would take {need / 1e9:.1f} GB of the "
             f"{have / 1e9:.1f} GB available: computed at every step instead")
        return None
    low = n - train_layers
    say(f"the {low} frozen blocks run once for every text ({need / 1e9:.2f} GB kept); each "
         f"step runs the top {train_layers}")
    return (FrozenFeatures.compute(clf, train_rows, low, desc="frozen blocks (train)",
                                   progress=progress),
            FrozenFeatures.compute(clf, dev_rows, low, desc="frozen blocks (dev)",
                                   progress=progress))


# ----------------------------------------------------------------------------- fine-tuning

@dataclass(frozen=True)
class FinetuneConfig:
    epochs: int = 5
    batch_size: int = 32
    lr: float = 1e-3
    warmup: float = 0.1           # fraction of the updates spent warming up
    weight_decay: float = 0.1     # kernels and embeddings, not norms or the head's bias
    grad_clip: float = 1.0
    grad_accum: int = 1
    dropout: float = 0.3          # on the pooled hidden state, before the head
    max_len: int = 512            # tokens per text, BOS included; longer texts lose their start
    seed: int = 0
    # the top blocks that train (with the final norm and the head; LoRA: the adapters in them);
    # None: every block and the embedding table. The blocks below get no gradient, so their
    # backward pass is never computed.
    train_layers: int | None = None
    # with train_layers: the frozen blocks' output computed once for every text (FrozenFeatures),
    # when it fits in memory; False: the whole backbone at every step
    frozen_cache: bool = True

    def __post_init__(self):
        for name in ("epochs", "batch_size", "grad_accum", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise BridgeError(f"must be a positive integer (got {value!r})", field=name)
        if self.train_layers is not None and (not isinstance(self.train_layers, int)
                                              or self.train_layers < 1):
            raise BridgeError(f"must be a positive integer (got {self.train_layers!r})",
                              field="train_layers")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise BridgeError(f"must be positive (got {self.lr})", field="lr")
        if not 0 <= self.warmup < 1:
            raise BridgeError(f"a fraction of the updates in [0, 1) (got {self.warmup})",
                              field="warmup")
        if not 0 <= self.dropout < 1:
            raise BridgeError(f"must be in [0, 1) (got {self.dropout})", field="dropout")

    def train_config(self, micro_steps: int) -> TrainConfig:
        updates = max(micro_steps // self.grad_accum, 1)
        return TrainConfig(steps=max(micro_steps, self.grad_accum), batch_size=self.batch_size,
                           lr=self.lr, warmup_steps=int(self.warmup * updates), b2=0.98,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                           grad_accum=self.grad_accum, seed=self.seed)


def recipe(pretrained: bool, lora: bool, **given) -> dict:
    """The defaults for a run (FROM_SCRATCH, PRETRAINED, PRETRAINED_LORA) with `given` (the
    settings passed, None for those not) over them."""
    base = FROM_SCRATCH if not pretrained else PRETRAINED_LORA if lora else PRETRAINED
    return {**base, **{k: v for k, v in given.items() if v is not None}}


def trainable_layers(model: LlamaClassifier, train_layers: int | None):
    """The `trainable` labelling (params -> True/False tree, see jax_llama.training.step.make_optimizer)
    of a run: LoRA's (jax_llama.lora.trainable_for) when the model has adapters, every leaf
    otherwise; with train_layers, only within the top `train_layers` blocks, the final norm and
    the head. None when everything trains."""
    lora = model.projections.lora
    if train_layers is None:
        return None if lora is None else trainable_for(lora)
    n = model.config.n_layers
    if train_layers > n:
        raise BridgeError(f"{train_layers} exceeds the backbone's {n} blocks", field="train_layers")
    if model.scan_layers:
        raise BridgeError("needs one parameter set per block (not scan_layers)",
                          field="train_layers")
    base = None if lora is None else trainable_for(lora)
    low = n - train_layers

    def top(path) -> bool:
        if path[0] == "classifier":
            return True
        block = next((k for k in path if k.startswith("layers_")), None)
        if block is None:  # the final norm trains, the embedding table not
            return "norm" in path
        return int(block.split("_")[1]) >= low

    def label(params):
        from flax import traverse_util

        inside = traverse_util.path_aware_map(lambda path, _: top(path), params)
        if base is None:
            return inside
        return jax.tree.map(lambda a, b: a and b, inside, base(params))
    return label


def classifier_loss(model: LlamaClassifier) -> Loss:
    """Mean NLL of the labels over the rows with weight 1, dropout drawn from the step's key.
    The model reads batch["tokens"], or batch["hidden"] when it starts at a first_layer."""
    inputs = "hidden" if model.first_layer else "tokens"

    def loss(params, batch, key):
        logp_BC = model.apply({"params": params}, batch[inputs], batch["mask"],
                              deterministic=False, rngs={"dropout": key})
        nll_B = -jnp.take_along_axis(logp_BC, batch["labels"][:, None], axis=1)[:, 0]
        weights = batch["weights"].astype(jnp.float32)
        return jnp.sum(nll_B * weights) / jnp.maximum(weights.sum(), 1.0)
    return loss


def training_batches(rows: list[list[int]], labels: np.ndarray, fc: FinetuneConfig, max_len: int,
                     rng: np.random.Generator, frozen: FrozenFeatures | None = None,
                     skip: int = 0) -> Iterator[dict]:
    """One epoch of padded batches; the last is filled up with weight-0 rows. With `frozen`,
    the rows' hidden states ("hidden") stand for their tokens. skip: leave out the epoch's
    first batches (those a resumed run has trained on); rng moves on as if they were made."""
    lengths = np.array([len(r) for r in rows])
    for idx in length_batches(lengths, fc.batch_size, rng)[skip:]:
        length = bucket(int(lengths[idx].max()), max_len)
        tokens, mask = pad_rows([rows[i] for i in idx], length, batch_size=fc.batch_size)
        y = np.zeros(fc.batch_size, np.int32)
        y[:len(idx)] = labels[idx]
        weights = np.zeros(fc.batch_size, np.float32)
        weights[:len(idx)] = 1
        inputs = ({"tokens": tokens} if frozen is None
                  else {"hidden": frozen.batch(idx, length, fc.batch_size)})
        yield {**inputs, "mask": mask, "labels": y, "weights": weights}


@dataclass(frozen=True)
class RunControl:
    """How a fine-tuning run meets interruptions (jax_llama.training.state, as `train` does): resume
    from out/checkpoints, checkpoint at the end of each epoch (and when stopped by a signal),
    and the policy for a step that is not finite; and whether it shows progress bars on stderr."""

    resume: bool = False
    on_nan: str = "stop"
    max_skipped: int = 10
    keep_checkpoints: int = 2
    progress: bool = True


def _run_record(clf: Classifier, fc: FinetuneConfig, train: Dataset, dev: Dataset) -> dict:
    return {"finetune": asdict(fc), "model": clf.model.config.to_dict(), "labels": clf.labels,
            "max_len": clf.max_len,
            "lora": None if (lora := clf.model.projections.lora) is None else lora.to_dict(),
            "train": str(train.path), "dev": str(dev.path)}


# A run directory from before fine-tuning ran on the one loop: finetune.json for run.json, the
# best classifier in best/ for model/, one metrics.jsonl line an epoch. It still resumes and
# predict still reads it.
OLD_RECORD, OLD_BEST = "finetune.json", "best"


def classifier_dir(run: Path) -> Path:
    """The classifier a finetune run directory holds: model/ (or best/, written before the
    run directories were laid out alike); a classifier directory itself as it is."""
    for name in ("model", OLD_BEST):
        if (run / name / META_FILE).is_file():
            return run / name
    return run


class FinetuneRecipe(Recipe):
    """`jax-llama finetune` as a recipe (jax_llama.training.recipe): its batches are whole epochs
    of length-bucketed rows, its loss the labels' NLL (classifier_loss), its evaluation at each
    epoch's end measures `dev` and keeps the best epoch's classifier at out/model with its dev
    predictions at out/dev_predictions.txt. An epoch's end adds epoch, train_loss, val_loss (the
    dev NLL), dev_accuracy to that step's record in metrics.jsonl."""

    kind, done = "fine-tuning run", "fine-tuned"
    fresh_out = False

    def __init__(self, clf: Classifier, train: Dataset, dev: Dataset, fc: FinetuneConfig,
                 out: Path, on_epoch: Callable[[dict], None] | None = None,
                 keep_checkpoints: int = 2):
        self.clf, self.train, self.dev, self.fc, self.out = clf, train, dev, fc, out
        self.on_epoch, self.keep_checkpoints = on_epoch, keep_checkpoints
        self.old_layout = False

    def check(self, run: RunOptions) -> None:
        self.run = run

    def record_file(self, out: Path, resume: bool) -> str:
        # A run directory from before fine-tuning ran on the one loop: it still resumes.
        self.old_layout = resume and not (out / RUN_RECORD).is_file() \
            and (out / OLD_RECORD).is_file()
        self.checkpoint_meta = self.old_layout
        self.best_dir = out / (OLD_BEST if self.old_layout else "model")
        return OLD_RECORD if self.old_layout else RUN_RECORD

    def read(self) -> None:
        clf, fc = self.clf, self.fc
        self.started = time.time()
        self.train_rows, self.train_cut = encode_texts(clf.tokenizer, self.train.texts,
                                                       clf.max_len)
        self.dev_rows, self.dev_cut = encode_texts(clf.tokenizer, self.dev.texts, clf.max_len)
        for name, cut, n in (("train", self.train_cut, len(self.train_rows)),
                             ("dev", self.dev_cut, len(self.dev_rows))):
            if cut:
                say(f"{name}: {cut} of {n} texts longer than {clf.max_len} tokens were "
                    f"truncated from the left")
        self.per_epoch = per_epoch = math.ceil(len(self.train_rows) / fc.batch_size)
        self.tc = dataclasses.replace(fc.train_config(per_epoch * fc.epochs),
                                      eval_every=per_epoch, checkpoint_every=per_epoch,
                                      keep_checkpoints=self.keep_checkpoints)
        self.desc = f"fine-tuning ({fc.epochs} epochs of {per_epoch} batches)"

    def record(self) -> dict:
        return _run_record(self.clf, self.fc, self.train, self.dev)

    def model(self, run: RunOptions):
        clf, fc = self.clf, self.fc
        frozen = frozen_features(clf, self.train_rows, self.dev_rows, fc.train_layers,
                                 fc.frozen_cache, run.progress)
        self.train_frozen, self.dev_frozen = frozen or (None, None)
        self.network = clf.model if frozen is None else self.train_frozen.model
        # LoRA: the adapters and the head only (and the embedding table, when it trains); with
        # train_layers, of the top blocks only
        return clf.model, clf.params, trainable_layers(clf.model, fc.train_layers), None

    def loss(self, model):
        return classifier_loss(self.network)

    def keep_metrics(self, path: Path, step: int) -> None:
        if self.old_layout:  # its metrics.jsonl has a line an epoch
            keep_metrics_until(path, step // self.per_epoch, key="epoch")
        else:
            keep_metrics_until(path, step)

    def resumed(self, state, meta: dict | None) -> None:
        """The epochs done (from metrics.jsonl), the best so far, this epoch's losses so far and
        the batches from the step the run goes on from."""
        done, per_epoch, out = int(state.step), self.per_epoch, self.out
        if not self.run.resume:
            keep_metrics_until(out / "metrics.jsonl", 0)
        kept = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
            if (out / "metrics.jsonl").is_file() else []
        self.history = [r for r in kept if "dev_accuracy" in r]  # the epochs done
        self.best = max(self.history, key=lambda r: r["dev_accuracy"],
                        default={"dev_accuracy": -1.0, "epoch": 0})
        if self.history and "seconds" in self.history[-1]:  # the time taken when it stopped
            self.started -= self.history[-1]["seconds"]
        # this epoch's losses so far: the steps of it a stopped run trained come from its records
        epoch_start = done - done % per_epoch
        self.losses = [r["loss"] for r in kept if "step" in r and epoch_start < r["step"] <= done]
        if meta:  # an old layout's checkpoint carries them (its metrics.jsonl has epochs only)
            self.losses = list(meta["epoch_losses"])
        self.taken, self.skipped = done, 0  # steps trained; skipped by this process
        self.batches = self.epochs(np.random.default_rng(self.fc.seed), done)

    def epochs(self, rng: np.random.Generator, done: int) -> Iterator[dict]:
        """The batches from step `done` on: the shuffles of the epochs done moved past, then the
        rest of this epoch and the next ones, as an uninterrupted run makes them."""
        fc, per_epoch = self.fc, self.per_epoch
        lengths = np.array([len(r) for r in self.train_rows])
        for _ in range(done // per_epoch):
            length_batches(lengths, fc.batch_size, rng)
        skip = done % per_epoch
        while True:
            yield from training_batches(self.train_rows, self.train.labels, fc,
                                        self.clf.max_len, rng, self.train_frozen, skip=skip)
            skip = 0

    def next_batch(self, step: int, state) -> dict:
        return next(self.batches)

    def step_figures(self, step: int, figures: dict) -> dict:
        """Nothing added; the step's loss kept for its epoch's train_loss, and a step that the
        NaN policy "skip" skips (loss or gradient norm not finite) counted."""
        self.losses.append(figures["loss"])
        self.taken += 1
        self.skipped += not (np.isfinite(figures["loss"]) and np.isfinite(figures["grad_norm"]))
        return {}

    def tokens_in(self, batch: dict) -> int:
        # padding and the weight-0 rows that fill the last batch left out
        return int(np.asarray(batch["mask"])[np.asarray(batch["weights"]) > 0].sum())

    def evaluate(self, params) -> dict:
        """At an epoch's end: the dev set's NLL and accuracy; the best epoch's classifier kept."""
        clf, dev = self.clf, self.dev
        epoch = self.taken // self.per_epoch
        values = np.asarray(self.losses, np.float32)
        values = values[np.isfinite(values)]  # skipped steps left out
        train_loss = float(values.mean()) if values.size else float("nan")
        if not math.isfinite(train_loss):
            raise TrainingDiverged(f"fine-tuning diverged in epoch {epoch} (loss {train_loss})")
        self.losses.clear()
        clf.params = params
        logp = predict_ids(clf, self.dev_rows, progress=self.run.progress, frozen=self.dev_frozen)
        predictions = logp.argmax(-1)
        record = {"val_loss": float(-np.mean(logp[np.arange(len(logp)), dev.labels])),
                  "epoch": epoch, "train_loss": train_loss,
                  "dev_accuracy": accuracy(predictions, dev.labels),
                  "seconds": time.time() - self.started}
        if self.skipped:
            record["skipped_steps"] = self.skipped
        self.history.append(record)
        if record["dev_accuracy"] > self.best["dev_accuracy"]:
            self.best = record
            clf.save(self.best_dir, {"epoch": epoch, "dev_accuracy": record["dev_accuracy"],
                                     "finetune": asdict(self.fc)})
            write_predictions(self.out / "dev_predictions.txt", predictions)
        if self.on_epoch:
            self.on_epoch(record)
        return record

    def save(self, out: Path, model, params):
        self.clf.params = params  # the best epoch's classifier is in out/model already
        return model, params

    def summary(self, out: Path, last: dict) -> dict:
        return {"best": self.best, "history": self.history, "train_truncated": self.train_cut,
                "dev_truncated": self.dev_cut, "seconds": time.time() - self.started,
                "classifier": str(self.best_dir), "plot": None}

    def finish(self, out: Path, model, params, scores: dict, summary: dict, tracker) -> dict:
        summary["plot"] = plot_losses(out, None, "cross-entropy of the labels (nats)")
        return summary


def finetune(clf: Classifier, train: Dataset, dev: Dataset, fc: FinetuneConfig, out: Path,
             on_epoch: Callable[[dict], None] | None = None,
             tracking: TrackingSpec = TrackingSpec(), control: RunControl = RunControl()) -> dict:
    """Fine-tune `clf` in place on `train`: FinetuneRecipe on the training loop (loop.run), the
    run directory laid out as every training command's: run.json, metrics.jsonl (a line a step;
    an epoch's end adds epoch, train_loss, val_loss (the dev NLL), dev_accuracy), checkpoints/
    (one an epoch, and at a stop), model/ (the best epoch's classifier), dev_predictions.txt,
    loss.png; with `tracking`, the same records go to TensorBoard / W&B. A SIGTERM / SIGINT
    stops after the current step with a checkpoint (RunStopped), and `control.resume` goes on
    from the newest checkpoint that restores, ending where an uninterrupted run ends. Returns a
    summary (best, history, classifier, plot, ...)."""
    recipe = FinetuneRecipe(clf, train, dev, fc, out, on_epoch, control.keep_checkpoints)
    return run(recipe, RunOptions(out, control.resume, control.on_nan, control.max_skipped,
                                  tracking, control.progress))
