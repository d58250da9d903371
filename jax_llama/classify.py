"""Sequence classification with a LLaMA: fine-tuning end to end, prediction, and zero-shot prompting.

Fine-tuning trains `LlamaClassifier` (backbone + head on the last real token) with the same optax
AdamW and the same compiled step as pretraining (jax_llama.training.step: make_optimizer's clipping,
warmup + cosine, decay mask and gradient accumulation; jit_train_step with classifier_loss). Batches are padded to a power-of-two length and built from examples of
similar length, so there are few compilations and little padding. The backbone comes from any
checkpoint the bridge reads, or is initialised at random with a BPE trained on the training texts.

Zero-shot scores each label word as a continuation of a prompt: the summed log-probability of all
of the word's tokens. Each text is run once, into a KV cache that the later tokens of the longer
label words read (see continuation_logprobs).

The classifier directory (bridge.classification) is a native checkpoint plus the head, so the
torch twin loads it too (torch_llama.load_classifier).
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from bridge.atomic import write_text
from bridge.chat import ChatTemplate, own_template
from bridge.classification import (DEFAULT_TEMPLATE, FROM_SCRATCH, PRETRAINED, PRETRAINED_LORA,
                                   Dataset, accuracy, encode_texts, read_head,
                                   truncate_left, write_head, write_predictions)
from bridge.config import LlamaConfig
from bridge.dtypes import numpy_dtype
from bridge.errors import BridgeError
from bridge.inputs import length_batches, pad_rows
from bridge.lora import LoraConfig
from bridge.resources import available_memory
from bridge.tokenizer import Tokenizer, find_tokenizer

from .attention import choose
from .checkpoint import load as load_checkpoint
from .checkpoint import save as save_native
from .inputs import bucket
from .lora import add_lora, merge_lora, save_adapter, trainable_for
from .heads import Blocks, LlamaClassifier
from .model import KVCache, init
from .training.state import (Checkpoints, NonFinite, RunStopped, StopSignals, check_resumable,
                             keep_metrics_until, say)
from .training.tracking import Tracker, TrackingSpec
from .training.step import Loss, TrainConfig, TrainingDiverged, init_state, jit_train_step, make_optimizer


# ----------------------------------------------------------------------------- the classifier

@dataclass
class Classifier:
    """A LlamaClassifier with its params, its labels, tokenizer and text length, and the LM head
    it does not use (kept to be saved back). torch_llama.Classifier is its twin (no params: a
    torch module holds its own)."""

    model: LlamaClassifier
    params: dict
    labels: list[str]
    tokenizer: Tokenizer
    max_len: int                         # tokens per text, BOS and EOS included
    lm_output: np.ndarray | None = None  # the untied LM head's kernel, carried unchanged
    chat_template: ChatTemplate | None = None  # the backbone's own, carried unchanged

    def save(self, path: str | Path, meta: dict | None = None, overwrite: bool = True) -> Path:
        """The classifier directory: native checkpoint of the backbone + head + tokenizer."""
        import tempfile

        model, params = merge_lora(self.model, self.params)
        lm_params = dict(params["llama"])
        if self.lm_output is not None:
            lm_params["output"] = {"kernel": self.lm_output}
        head = params["classifier"]
        info = {"labels": self.labels, "max_len": self.max_len, "dropout": self.model.dropout,
                **(meta or {})}

        def write_extra(directory: Path) -> None:
            write_head(directory, np.asarray(head["kernel"]).T, np.asarray(head["bias"]), info)
            if self.model.lora is not None:  # the backbone's adapter too, in PEFT's format
                save_adapter(directory / "adapter", self.model, self.params)

        with tempfile.TemporaryDirectory() as tok_dir:
            files = self.tokenizer.save(tok_dir)
            if self.chat_template is not None:  # so that the backbone chats as it did
                files = [*files, self.chat_template.save(tok_dir)]
            save_native(path, model.config, lm_params, overwrite=overwrite, extra_files=files,
                        write_extra=write_extra)
        return Path(path)


def backbone_params(lm_params: dict) -> tuple[dict, np.ndarray | None]:
    """LM params -> (the backbone the classifier uses, the untied LM head's kernel or None)."""
    lm_params = dict(lm_params)
    output = lm_params.pop("output", None)
    return lm_params, None if output is None else np.asarray(output["kernel"])


def new_classifier(config: LlamaConfig, labels: list[str], tokenizer: Tokenizer, max_len: int,
                   dropout: float, seed: int, lm_params: dict | None = None,
                   attention: str = "auto", lora: LoraConfig | None = None) -> Classifier:
    """A classifier with a fresh head on `lm_params` (LM params, e.g. from jax_llama.load), or on
    a randomly initialised backbone when None; with `lora`, fresh adapters on the backbone (which
    fine-tuning then trains with the head, the backbone's weights frozen)."""
    choose(attention, 1, 1)
    model = LlamaClassifier(config, len(labels), dropout, attention=attention)
    tokens, mask = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)
    params = jax.jit(model.init)(jax.random.key(seed), tokens, mask)["params"]
    if lm_params is None:
        lm_params = init(config, seed=seed)[1]
    backbone, output = backbone_params(lm_params)
    params = {"llama": backbone, "classifier": params["classifier"]}
    if lora is not None:
        model, params = add_lora(model, params, lora, seed=seed)
    return Classifier(model, params, labels, tokenizer, max_len, output)


def load_classifier(path: str | Path, dtype=None, attention: str = "auto",
                    kernels: str = "auto") -> Classifier:
    """A classifier directory written by `finetune` (or Classifier.save); attention and kernels
    as in jax_llama.load."""
    model_lm, lm_params = load_checkpoint(path, dtype=dtype, attention=attention, kernels=kernels)
    meta, weight, bias = read_head(path, model_lm.config)
    dtype = model_lm.dtype
    backbone, output = backbone_params(lm_params)
    head = {"kernel": jnp.asarray(weight.T, dtype), "bias": jnp.asarray(bias, dtype)}
    model = LlamaClassifier(model_lm.config, len(meta["labels"]), float(meta.get("dropout", 0.0)),
                            dtype=dtype, param_dtype=dtype, attention=attention, kernels=kernels)
    return Classifier(model, {"llama": backbone, "classifier": head}, list(meta["labels"]),
                      find_tokenizer(str(path), None), int(meta["max_len"]), output,
                      own_template(path))


def predict_ids(clf: Classifier, rows: list[list[int]], batch_size: int = 64,
                progress: bool = False, frozen: FrozenFeatures | None = None) -> np.ndarray:
    """Log-probabilities (N, C) for token rows (each at most clf.max_len long); with `frozen`
    (the rows' hidden states leaving the frozen blocks), only the blocks above run."""
    lengths = np.array([len(r) for r in rows])
    out = np.zeros((len(rows), len(clf.labels)), np.float32)
    batches = length_batches(lengths, batch_size, None)
    for idx in tqdm(batches, desc="predict", unit="batch", disable=None if progress else True,
                    leave=False):
        length = bucket(int(lengths[idx].max()), clf.max_len)
        tokens, mask = pad_rows([rows[i] for i in idx], length, batch_size=batch_size)
        if frozen is None:
            logp = _log_probs(clf.params, tokens, mask, model=clf.model)
        else:
            logp = _log_probs(clf.params, frozen.batch(idx, length, batch_size), mask,
                              model=frozen.model)
        out[idx] = np.asarray(logp)[:len(idx)]
    return out


def predict(clf: Classifier, texts: list[str], batch_size: int = 64, progress: bool = False):
    """(predicted label indices (N,), log-probabilities (N, C), texts cut to max_len)."""
    rows, cut = encode_texts(clf.tokenizer, texts, clf.max_len)
    logp = predict_ids(clf, rows, batch_size, progress)
    return logp.argmax(-1), logp, cut


@functools.partial(jax.jit, static_argnames="model")
def _log_probs(params, tokens_BS, mask_BS, *, model: LlamaClassifier):
    """(B, C) log-probabilities, without dropout; compiled once per (model, batch shape)."""
    return model.apply({"params": params}, tokens_BS, mask_BS)


@dataclass
class FrozenFeatures:
    """Texts' hidden states leaving the frozen lower blocks of a classifier (each text's length
    x D, in the model's dtype), and the classifier that runs from them: the same params, only
    the blocks above (LlamaClassifier.first_layer). The lower blocks and the embedding get no
    update when only the top blocks train, and the backbone has no dropout, so their output is
    the same in every epoch: computing it once saves their forward pass at every step."""

    model: LlamaClassifier
    rows: list[np.ndarray]

    @classmethod
    def compute(cls, clf: Classifier, rows: list[list[int]], first_layer: int,
                batch_size: int = 64, desc: str = "frozen blocks") -> FrozenFeatures:
        m = clf.model
        lower = Blocks(m.config, 0, first_layer, m.dtype, m.param_dtype, m.attention, m.lora,
                       m.kernels)
        run = jax.jit(lambda params, tokens, mask: lower.apply({"params": params}, tokens, mask))
        lengths = np.array([len(r) for r in rows])
        features: list[np.ndarray | None] = [None] * len(rows)
        for idx in tqdm(length_batches(lengths, batch_size, None), desc=desc, unit="batch",
                        file=sys.stderr, leave=False):
            tokens, mask = pad_rows([rows[i] for i in idx],
                                    bucket(int(lengths[idx].max()), clf.max_len),
                                    batch_size=batch_size)
            x_BSD = np.asarray(run(clf.params["llama"], tokens, mask))
            for j, i in enumerate(idx):
                features[i] = x_BSD[j, :lengths[i]].copy()
        return cls(m.clone(first_layer=first_layer), features)

    @staticmethod
    def nbytes(clf: Classifier, rows: list[list[int]]) -> int:
        """What compute() keeps for these rows."""
        return (sum(map(len, rows)) * clf.model.config.dim
                * np.dtype(numpy_dtype(clf.model.dtype)).itemsize)

    def batch(self, idx: np.ndarray, length: int, batch_size: int) -> np.ndarray:
        """(batch_size, length, D): the rows `idx`, right-padded with zeros (as pad_rows pads
        their tokens; filler rows all zeros)."""
        first = self.rows[int(idx[0])]
        x_BSD = np.zeros((batch_size, length, first.shape[1]), first.dtype)
        for j, i in enumerate(idx):
            x_BSD[j, :len(self.rows[i])] = self.rows[i]
        return x_BSD


def frozen_features(clf: Classifier, train_rows: list[list[int]], dev_rows: list[list[int]],
                    train_layers: int | None, enabled: bool = True
                    ) -> tuple[FrozenFeatures, FrozenFeatures] | None:
    """(train, dev) FrozenFeatures when the blocks below the top `train_layers` are frozen and
    their output for both sets fits in a quarter of the memory available; None otherwise (then
    every step runs the whole backbone)."""
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
    return (FrozenFeatures.compute(clf, train_rows, low, desc="frozen blocks (train)"),
            FrozenFeatures.compute(clf, dev_rows, low, desc="frozen blocks (dev)"))


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
    lora = model.lora
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
    and the policy for a step that is not finite."""

    resume: bool = False
    on_nan: str = "stop"
    max_skipped: int = 10
    keep_checkpoints: int = 2


def _run_record(clf: Classifier, fc: FinetuneConfig, train: Dataset, dev: Dataset) -> dict:
    return {"finetune": asdict(fc), "model": clf.model.config.to_dict(), "labels": clf.labels,
            "max_len": clf.max_len,
            "lora": None if clf.model.lora is None else clf.model.lora.to_dict(),
            "train": str(train.path), "dev": str(dev.path)}


def finetune(clf: Classifier, train: Dataset, dev: Dataset, fc: FinetuneConfig, out: Path,
             on_epoch: Callable[[dict], None] | None = None,
             tracking: TrackingSpec = TrackingSpec(), control: RunControl = RunControl()) -> dict:
    """Fine-tune `clf` in place on `train`; after each epoch measure `dev`, and keep the best
    epoch's classifier at out/best with its dev predictions at out/dev_predictions.txt.
    Per-epoch figures go to out/metrics.jsonl; with `tracking`, each step's loss, grad norm and
    learning rate and each epoch's figures and tokens/s (steps: batches trained) go to
    TensorBoard / W&B too. The state is checkpointed at each epoch's end; a SIGTERM / SIGINT
    stops after the current step with a checkpoint (RunStopped), and `control.resume` goes on
    from the newest checkpoint that restores, ending where an uninterrupted run ends. Returns
    a summary."""
    tracking.check()
    nonfinite = NonFinite(control.on_nan, control.max_skipped)
    setup = _run_record(clf, fc, train, dev)
    if control.resume:
        check_resumable(out, setup, "finetune.json", "fine-tuning run", "fine-tuned")
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    train_rows, train_cut = encode_texts(clf.tokenizer, train.texts, clf.max_len)
    dev_rows, dev_cut = encode_texts(clf.tokenizer, dev.texts, clf.max_len)
    for name, cut, n in (("train", train_cut, len(train_rows)), ("dev", dev_cut, len(dev_rows))):
        if cut:
            say(f"{name}: {cut} of {n} texts longer than {clf.max_len} tokens were truncated "
                 f"from the left")
    per_epoch = math.ceil(len(train_rows) / fc.batch_size)
    tc = fc.train_config(per_epoch * fc.epochs)
    # LoRA: the adapters and the head only (and the embedding table, when it trains); with
    # train_layers, of the top blocks only
    labels = trainable_layers(clf.model, fc.train_layers)
    optimizer = make_optimizer(tc, labels)
    state = init_state(clf.params, optimizer)
    checkpoints = Checkpoints(out / "checkpoints", control.keep_checkpoints)
    best = {"dev_accuracy": -1.0, "epoch": 0}
    history, done, carried = [], 0, []  # steps trained; the losses of a part-trained epoch
    if control.resume and (restored := checkpoints.restore_newest(state, None, with_meta=True)):
        state, meta, done = restored
        best, history, carried = meta["best"], meta["history"], meta["epoch_losses"]
        started -= meta["seconds"]
        say(f"resumed {out} at step {done} (epoch {done // per_epoch + 1}, batch "
             f"{done % per_epoch + 1} of {per_epoch})")
    else:
        write_text(out / "finetune.json", json.dumps(setup, indent=2) + "\n")
    keep_metrics_until(out / "metrics.jsonl", len(history), key="epoch")
    frozen = frozen_features(clf, train_rows, dev_rows, fc.train_layers, fc.frozen_cache)
    train_frozen, dev_frozen = frozen or (None, None)
    step = jit_train_step(classifier_loss(clf.model if frozen is None else train_frozen.model),
                          optimizer, tc, state, trainable=labels, skip_nonfinite=nonfinite.skip)
    rng = np.random.default_rng(fc.seed)
    lengths = np.array([len(r) for r in train_rows])
    for _ in range(done // per_epoch):  # the shuffles of the epochs done, to move rng on
        length_batches(lengths, fc.batch_size, rng)
    train_labels = train.labels
    tracker = Tracker.open(tracking, out, setup, done if control.resume else None)
    metrics_file = (out / "metrics.jsonl").open("a")
    n_tokens = sum(map(len, train_rows))  # real tokens an epoch, padding left out

    def checkpoint(epoch_losses=()) -> Path:
        return checkpoints.save(int(state.step), state, {
            "best": best, "history": history, "seconds": time.time() - started,
            "epoch_losses": [float(x) for x in jax.device_get(list(epoch_losses))]})

    def check(at: int, metrics) -> None:
        """The NaN policy on step `at`'s metrics, read back while the next step runs."""
        why = nonfinite.check(at, {k: float(v) for k, v in jax.device_get(metrics).items()})
        if why is not None and not nonfinite.skip:  # this state is never saved
            raise nonfinite.diverged(why, checkpoints)
        if why is not None:  # too many skipped: the state itself is good
            raise nonfinite.diverged(why, checkpoints, checkpoint())

    try:
        with StopSignals() as signals:
            for epoch in range(done // per_epoch + 1, fc.epochs + 1):
                first = (epoch - 1) * per_epoch  # steps before this epoch
                skip = max(done - first, 0)
                losses = carried if skip else []
                step_metrics, tick = [], time.perf_counter()
                bar = tqdm(training_batches(train_rows, train_labels, fc, clf.max_len, rng,
                                            train_frozen, skip=skip),
                           total=per_epoch, initial=skip, desc=f"epoch {epoch}/{fc.epochs}",
                           unit="batch", file=sys.stderr, leave=False)
                pending = None
                for batch in bar:
                    state, metrics = step(state, batch)
                    if pending is not None:
                        check(*pending)
                    pending = (first + len(losses) + 1, metrics)
                    losses.append(metrics["loss"])
                    if tracker.active:  # read back at the epoch's end: no wait here
                        step_metrics.append(metrics)
                    if len(losses) % 20 == 0:
                        bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
                    if signals.requested:
                        break
                if pending is not None:
                    check(*pending)
                for i, metrics in enumerate(jax.device_get(step_metrics)):
                    tracker.log(first + skip + i + 1, metrics)
                if signals.requested:
                    raise RunStopped(int(state.step), per_epoch * fc.epochs, signals.requested,
                                     checkpoint(losses))
                clf.params = state.params
                values = np.asarray(jax.device_get(losses), np.float32)
                values = values[np.isfinite(values)]  # skipped steps left out
                train_loss = float(values.mean()) if values.size else float("nan")
                if not math.isfinite(train_loss):
                    raise TrainingDiverged(f"fine-tuning diverged in epoch {epoch} "
                                           f"(loss {train_loss})")
                seconds = time.perf_counter() - tick
                predictions = predict_ids(clf, dev_rows, frozen=dev_frozen).argmax(-1)
                record = {"epoch": epoch, "train_loss": train_loss,
                          "dev_accuracy": accuracy(predictions, dev.labels),
                          "seconds": time.time() - started,
                          "tokens_per_s": n_tokens * (len(losses) - skip) / per_epoch / seconds}
                if nonfinite.skipped:
                    record["skipped_steps"] = len(nonfinite.skipped)
                history.append(record)
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                tracker.log(epoch * per_epoch, record)
                if record["dev_accuracy"] > best["dev_accuracy"]:
                    best = record
                    clf.save(out / "best", {"epoch": epoch, "dev_accuracy": record["dev_accuracy"],
                                            "finetune": asdict(fc)})
                    write_predictions(out / "dev_predictions.txt", predictions)
                checkpoint()
                if on_epoch:
                    on_epoch(record)
    finally:
        metrics_file.close()
        tracker.close()
    return {"best": best, "history": history, "train_truncated": train_cut,
            "dev_truncated": dev_cut, "seconds": time.time() - started,
            "classifier": str(out / "best")}


# ----------------------------------------------------------------------------- zero-shot

def fill_template(template: str, text: str, labels: list[str] | None = None) -> str:
    """The template with {text} replaced by the text and {labels}, if there, by the label words
    ("a, b or c")."""
    if "{text}" not in template:
        raise BridgeError(f"must contain {{text}} (got {template!r})", field="template")
    if labels is not None and "{labels}" in template:
        words = ", ".join(labels[:-1]) + " or " + labels[-1] if len(labels) > 1 else labels[0]
        template = template.replace("{labels}", words)
    return template.replace("{text}", text)


def zero_shot_rows(tokenizer: Tokenizer, texts: list[str], labels: list[str], template: str,
                   max_len: int, chat: ChatTemplate | None = None
                   ) -> tuple[list[list[int]], list[list[int]], int]:
    """(prompt ids per text, continuation ids per label, prompts cut). A label is continued
    after a space unless the prompt already ends in whitespace. Prompt and label are tokenized
    apart, so a BPE merge across their boundary is never taken: the label's tokens are the same
    after every prompt. With `chat`, the filled template is the user's turn, rendered up to the
    assistant's reply, which the label word begins (no space); a prompt too long loses the start
    of its text. Otherwise a prompt too long is cut from the left (keeping BOS)."""
    space = "" if chat is not None or template.endswith((" ", "\n", "\t")) else " "
    continuations = [tokenizer.encode(space + label) for label in labels]
    if min(map(len, continuations)) == 0:
        raise BridgeError("labels: a label word encodes to no tokens")
    room = max_len - max(map(len, continuations))
    if room < 2:
        raise BridgeError(f"{max_len} tokens leave no room for a prompt before the labels",
                          field="max_len")
    bos = tokenizer.add_bos
    prompts, cut = [], 0
    for text in texts:
        if chat is None:
            ids, was_cut = truncate_left(tokenizer.encode(fill_template(template, text, labels),
                                                          bos=bos), room,
                                         tokenizer.bos_id if bos else None)
        else:
            ids, was_cut = _chat_prompt(chat, tokenizer, template, text, labels, room)
        prompts.append(ids)
        cut += was_cut
    return prompts, continuations, cut


def _chat_prompt(chat: ChatTemplate, tokenizer: Tokenizer, template: str, text: str,
                 labels: list[str], room: int) -> tuple[list[int], bool]:
    """(ids, cut): the user turn fill_template(template, text, labels) rendered up to the
    assistant's reply, the text losing tokens from its start until the prompt fits in `room`."""
    def render(body: str) -> list[int]:
        return chat.encode([{"role": "user", "content": fill_template(template, body, labels)}],
                           tokenizer, add_generation_prompt=True)
    ids = render(text)
    if len(ids) <= room:
        return ids, False
    words = tokenizer.encode(text)
    keep = len(words) - (len(ids) - room)
    while keep > 0:
        ids = render(tokenizer.decode(words[len(words) - keep:]))
        if len(ids) <= room:
            return ids, True
        keep -= max(1, len(ids) - room)
    raise BridgeError(f"{room} tokens leave no room for the chat template's own tokens",
                      field="max_len")


def continuation_logprobs(model, params, prompts: list[list[int]], continuations: list[list[int]],
                          batch_size: int = 64, progress: bool = False) -> np.ndarray:
    """(N, C): log p(continuation c | prompt n), summed over all of c's tokens.

    Each prompt is run once, left-padded in a batch of similar lengths, into a KV cache: every
    continuation's first token is scored at the prompt's last position (the only one that goes
    through the vocabulary projection), and the later tokens of the continuations longer than
    one token run on that cache, one continuation after another, never the prompt again. With
    single-token label words zero-shot costs one forward pass of each text, whatever the labels."""
    lengths = np.array([len(p) for p in prompts])
    cap = max(int(lengths.max()), 16)
    conts = tuple(tuple(int(t) for t in c) for c in continuations)
    scores = np.zeros((len(prompts), len(continuations)), np.float64)
    for idx in tqdm(length_batches(lengths, batch_size, None), desc="zero-shot", unit="batch",
                    disable=None if progress else True, leave=False):
        S = bucket(int(lengths[idx].max()), cap)
        tokens, mask = pad_rows([prompts[i] for i in idx], S, side="left", batch_size=batch_size)
        got = np.asarray(_label_logprobs(params, tokens, mask, model=model, continuations=conts))
        scores[idx] = got[:len(idx)]
    return scores


@functools.partial(jax.jit, static_argnames=("model", "continuations"))
def _label_logprobs(params, tokens_BS, mask_BS, *, model, continuations):
    """(B, C) summed log-probability of each continuation after each left-padded prompt."""
    B, S = tokens_BS.shape
    firsts_C = jnp.asarray([c[0] for c in continuations])
    longer = [c for c in continuations if len(c) > 1]
    L = max((len(c) for c in longer), default=1) - 1  # the later tokens of the longest
    cache = KVCache.create(model.config, B, S + L, model.dtype) if longer else None
    out = model.apply({"params": params}, tokens_BS, attention_mask=mask_BS, cache=cache,
                      head_at=jnp.full((B, 1), S - 1), method="run")
    scores_BC = jax.nn.log_softmax(out.logits[:, 0], axis=-1)[:, firsts_C]
    if not longer:
        return scores_BC
    # each longer continuation: its tokens but the last as inputs on the prompts' cache, scored
    # on its tokens but the first; padded to L (padding comes after, so nothing real sees it)
    inputs_ML = np.zeros((len(longer), L), np.int32)
    targets_ML = np.zeros((len(longer), L), np.int32)
    real_ML = np.zeros((len(longer), L), bool)
    for m, c in enumerate(longer):
        inputs_ML[m, :len(c) - 1], targets_ML[m, :len(c) - 1] = c[:-1], c[1:]
        real_ML[m, :len(c) - 1] = True

    def rest(args):
        inputs_L, targets_L, real_L = args
        logits_BLV = model.apply({"params": params}, jnp.broadcast_to(inputs_L, (B, L)),
                                 cache=out.cache, method="run").logits
        logp_BL = jnp.take_along_axis(jax.nn.log_softmax(logits_BLV, axis=-1),
                                      jnp.broadcast_to(targets_L, (B, L))[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(real_L, logp_BL, 0.0), axis=-1)
    rest_MB = jax.lax.map(rest, (jnp.asarray(inputs_ML), jnp.asarray(targets_ML),
                                 jnp.asarray(real_ML)))
    where = [i for i, c in enumerate(continuations) if len(c) > 1]
    return scores_BC.at[:, jnp.asarray(where)].add(rest_MB.T)


def zero_shot(model, params, tokenizer: Tokenizer, texts: list[str], labels: list[str],
              template: str = DEFAULT_TEMPLATE, max_len: int | None = None,
              batch_size: int = 64, progress: bool = False, calibrate: bool = False,
              chat: ChatTemplate | None = None):
    """(predicted label indices (N,), scores (N, C), prompts truncated).

    chat: ask through this chat template (see zero_shot_rows); the label word begins the reply,
    as given or capitalized (a reply starts a sentence): a label's score is the log of the sum
    of both spellings' probabilities.

    calibrate: subtract each label's score after the template around an empty text, the
    model's prior for the label word in that place (contextual calibration, Zhao et al. 2021);
    without it a small model tends to answer its most frequent label word for every text."""
    max_len = min(max_len or model.config.max_seq_len, model.config.max_seq_len)
    prompts, continuations, cut = zero_shot_rows(tokenizer, texts, labels, template, max_len,
                                                 chat)
    owners = list(range(len(labels)))  # the label each continuation spells
    if chat is not None:
        for i, word in enumerate(labels):
            capital = word[:1].upper() + word[1:]
            if capital != word:
                continuations.append(tokenizer.encode(capital))
                owners.append(i)
        if max(map(len, continuations)) + max(map(len, prompts)) > max_len:
            raise BridgeError(f"{max_len} tokens leave no room for the capitalized label words",
                              field="max_len")

    def label_scores(rows: list[list[int]], show: bool) -> np.ndarray:
        raw = continuation_logprobs(model, params, rows, continuations, batch_size, show)
        out = np.full((len(rows), len(labels)), -np.inf)
        for column, i in enumerate(owners):
            out[:, i] = np.logaddexp(out[:, i], raw[:, column])
        return out
    scores = label_scores(prompts, progress)
    if calibrate:
        empty, _, _ = zero_shot_rows(tokenizer, [""], labels, template, max_len, chat)
        scores = scores - label_scores(empty, False)
    return scores.argmax(-1), scores, cut
