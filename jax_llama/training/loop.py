"""A training run from start to finish: tokenizer, data, model, mesh, the loop, checkpoints, outputs.

`train` prepares a run (its recipe's inputs: a corpus, or chats (sft.py), or preference pairs
(dpo.py); the model, the optimizer, the state, resumed or new), hands the loop (`run_steps`) its
step, its batches and its evaluation, and saves what the recipe keeps. finetune.py is a recipe on
the same loop: its batches are epochs of labelled texts, its evaluation the dev set's.

A run directory holds:
  run.json        what was asked for (model config, TrainConfig, corpus): a resume must match it
  tokenizer/      the tokenizer the tokens were made with
  checkpoints/    orbax checkpoints of the whole TrainState every N steps (the last k kept);
                  orbax writes each into a temporary directory and renames it, so a kill never
                  leaves a half-written one
  metrics.jsonl   one line per step (loss, grad norm, lr, tokens/s) and per evaluation
  tensorboard/, wandb/   the same scalars for TensorBoard / Weights & Biases, when asked for
                  (jax_llama.training.tracking)
  loss.png        the loss curves against the unigram baseline
  model/          the final model as a native checkpoint with its tokenizer, ready for the bridge
                  (a LoRA run: the base with the adapter merged in; finetune: the best epoch's
                  classifier, its head in classifier.safetensors / classifier.json)
  adapter/        a LoRA run's adapter, as Hugging Face PEFT writes it (adapter_config.json,
                  adapter_model.safetensors)
  chat_template.jinja   an SFT run's chat template (also in model/, where generate --chat finds it)
  exact_match.json      an SFT run's greedy replies to the held-out chats, before and after
  preference.json       a DPO run's held-out metrics (loss, rewards, pair accuracy) before and
                        after, and greedy replies to a few held-out prompts
  dev_predictions.txt   a finetune run's best epoch's predictions on the dev set
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from bridge.atomic import write_text
from bridge.config import LlamaConfig
from bridge.data_dirs import check_out_apart
from bridge.errors import BridgeError
from bridge.merge import merge_lora as merge_checkpoint
from bridge.progress import bar as progress_bar

from . import data as data_lib
from ..model.attention import choose as choose_attention
from ..checkpoint import load as load_checkpoint
from ..checkpoint import save as save_native
from . import dpo as dpo_lib
from . import grpo as grpo_lib
from . import sft as sft_lib
from ..lora import add_lora, count, merge_lora, save_adapter, trainable_for
from ..model.llama import Llama, init
from ..perf import measure_matmul_peak, train_flops_per_token
from .inputs import open_init, run_config, run_tokenizer
from .spec import RunSpec
from .state import (Checkpoints, NonFinite, RunStopped, StopSignals, all_processes_reach,
                    check_resumable, keep_metrics_until, say)
from ..sharding import check_batch, global_batch, make_mesh
from .tracking import Tracker
from .step import (TrainConfig, TrainingDiverged, init_state, jit_eval_step, jit_train_step,
                   lm_loss, make_optimizer, place_state)

__all__ = ["RunStopped", "TrainingDiverged", "run_steps", "train"]


def _run_record(spec: RunSpec, config: LlamaConfig) -> dict:
    return {"model": config.to_dict(), "train": spec.train.to_dict(), "data": spec.data,
            "tokenizer": spec.tokenizer, "init": spec.init, "strip_labels": spec.strip_labels,
            "pack": spec.pack, "lora": None if spec.lora is None else spec.lora.to_dict(),
            "sft": None if spec.sft is None else spec.sft.to_dict(),
            "dpo": None if spec.dpo is None else spec.dpo.to_dict(),
            "grpo": None if spec.grpo is None else spec.grpo.to_dict(),
            "tracking": spec.tracking.to_dict()}


def train(spec: RunSpec) -> dict:
    """Run (or resume) training; returns a summary with the final losses and output paths."""
    tc = spec.train
    choose_attention(spec.attention, 1, 1)  # refused before anything is read or written
    spec.tracking.check()
    nonfinite = NonFinite(spec.on_nan, spec.max_skipped)
    task = spec.sft or spec.dpo or spec.grpo  # their data are files; a run's own output is
    # never its input
    check_out_apart(spec.out, [*spec.data, *((task.data, task.eval_data) if task else ())])
    if jax.process_count() > 1 and (spec.lora or spec.sft or spec.dpo or spec.grpo):
        kind = "LoRA" if spec.lora else "SFT" if spec.sft else "DPO" if spec.dpo else "GRPO"
        raise BridgeError(f"{kind} runs across several processes are "
                          f"not supported yet (one process with many devices is)", field="multi_host")
    if spec.resume and not (spec.out / "run.json").is_file():
        raise BridgeError(f"{spec.out} holds no run to resume (no run.json)", field="resume")
    if not spec.resume and spec.out.exists() and any(spec.out.iterdir()):
        raise BridgeError(f"{spec.out} is not empty", field="out",
                          hint=("resume", True, "pass {} to continue that run"))
    # the --init checkpoint, opened once: its tokenizer, config, template and weights all read here
    init_checkpoint = open_init(spec)
    if spec.sft:  # every conversation is read, rendered and checked before anything is written
        chat = sft_lib.sft_inputs(spec, init_checkpoint)
        tokenizer, config = chat.tokenizer, chat.config
    elif spec.dpo:  # every pair likewise
        prefs = dpo_lib.dpo_inputs(spec, init_checkpoint)
        tokenizer, config = prefs.tokenizer, prefs.config
    elif spec.grpo:  # every prompt and reward function likewise
        rl = grpo_lib.grpo_inputs(spec, init_checkpoint)
        tokenizer, config = rl.tokenizer, rl.config
    else:
        files = data_lib.corpus_files(spec.data, out=spec.out) if spec.data else data_lib.default_corpus()
        tokenizer = run_tokenizer(spec, init_checkpoint,
                                  lambda: data_lib.read_documents(files, labeled=spec.strip_labels),
                                  f"{len(files)} files")
        config = run_config(spec, init_checkpoint, tokenizer)
    mesh = make_mesh(spec.mesh)
    check_batch(tc.batch_size, mesh)
    _check_mesh_splits(config, mesh)
    if spec.resume:
        # run.json files from before strip_labels and pack were recorded ran without them
        now = {k: v for k, v in _run_record(spec, config).items() if k != "tracking"}
        check_resumable(spec.out, now, before={"strip_labels": False, "pack": False})
    # Several processes share the run directory; process 0 writes it, after every process has
    # checked it and before any reads it back.
    primary = jax.process_index() == 0
    all_processes_reach("checked the run directory")
    if primary:
        spec.out.mkdir(parents=True, exist_ok=True)
        if not (spec.out / "tokenizer").is_dir():
            (spec.out / "tokenizer").mkdir()
            tokenizer.save(spec.out / "tokenizer")
        write_text(spec.out / "run.json", json.dumps(_run_record(spec, config), indent=2) + "\n")
    all_processes_reach("wrote the run directory")

    local_batch = tc.batch_size // jax.process_count()
    if spec.sft:
        if primary:
            chat.template.save(spec.out)
        batches, val_batches, unigram = chat.batches(tc, local_batch, spec.pack)
    elif spec.dpo:
        if primary and prefs.template is not None:
            prefs.template.save(spec.out)
        batches, unigram = prefs.batches(tc, local_batch), None
    elif spec.grpo:
        if primary and rl.template is not None:
            rl.template.save(spec.out)
        batches, unigram = None, None
    else:
        batches, val_batches, unigram, val_tokens = _corpus_batches(spec, files, tokenizer, config,
                                                                    local_batch)

    model = Llama(config, dtype=tc.dtype, scan_layers=spec.scan_layers, remat=spec.remat,
                  attention=spec.attention)
    # A frozen base needs no float32 master copy: with LoRA it is held in the compute dtype.
    base_dtype = tc.dtype if spec.lora else "float32"
    if init_checkpoint is not None:
        # straight onto the mesh: each process reads only the parts its devices hold
        params = load_checkpoint(init_checkpoint, dtype=base_dtype, scan_layers=spec.scan_layers,
                                 mesh=mesh)[1]
    else:
        params = init(config, seed=tc.seed, scan_layers=spec.scan_layers,
                      param_dtype=base_dtype)[1]
    labels, desc = None, "training"
    if spec.lora:
        model, params = add_lora(model, params, spec.lora, seed=tc.seed)
        labels = trainable_for(spec.lora)
        n_train, n_all = count(params, labels(params)), count(params)
        say(f"LoRA rank {spec.lora.rank} on {', '.join(spec.lora.targets)}"
             f"{' and the embedding table' if spec.lora.train_embeddings else ''}: training "
             f"{n_train:,} of {n_all:,} parameters")
        desc = f"training LoRA ({n_train / 1e6:.3g}M of {n_all / 1e6:.3g}M params)"
    optimizer = make_optimizer(tc, labels)
    if spec.dpo:  # the starting weights, before the state (donated at each step) holds them
        prefs.start_reference(model, params, tc, local_batch)
    if spec.grpo:  # likewise (its reference, with --beta)
        rl.start(model, params)
    state = place_state(init_state(params, optimizer), mesh)
    checkpoints = Checkpoints(spec.out / "checkpoints", tc.keep_checkpoints)
    if spec.resume:  # from the newest checkpoint that restores; none written yet: from the start
        restored = checkpoints.restore_newest(state, mesh)
        if restored is not None:
            state = restored[0]
            say(f"resumed {spec.out} at step {int(state.step)}")
        if primary:
            keep_metrics_until(spec.out / "metrics.jsonl", int(state.step))
    # Only the primary process logs; a resumed run appends from the step it resumed at.
    tracker = Tracker.open(spec.tracking, spec.out, _run_record(spec, config),
                           int(state.step) if spec.resume else None) if primary else Tracker()
    with tracker:
        scores = {}
        if spec.sft and not spec.resume:
            scores["before"] = chat.exact_match(model, params)
            tracker.log(0, sft_lib.exact_match_scalars(scores["before"]))
        if spec.dpo and not spec.resume:
            scores["before"] = prefs.evaluate(model, params, replies=True)
            tracker.log(0, dpo_lib.eval_scalars(scores["before"]))
        if spec.grpo and not spec.resume:
            scores["before"] = rl.evaluate(model, params, answers=True)
            tracker.log(0, grpo_lib.eval_scalars(scores["before"]))
        if spec.dpo or spec.grpo:
            loss = (dpo_lib.train_loss(model, spec.dpo) if spec.dpo
                    else grpo_lib.train_loss(model, spec.grpo))
            train_step = jit_train_step(loss, optimizer, tc, state, mesh, labels, has_aux=True,
                                        skip_nonfinite=nonfinite.skip)
        else:
            train_step = jit_train_step(lm_loss(model), optimizer, tc, state, mesh, labels,
                                        skip_nonfinite=nonfinite.skip)
            eval_step = jit_eval_step(model, state, mesh)

        def evaluate(params) -> dict:
            if spec.grpo:
                return grpo_lib.eval_scalars(rl.evaluate(model, params))
            if spec.dpo:
                result = prefs.evaluate(model, params)
                return {"val_loss": result["loss"], **dpo_lib.eval_scalars(result)}
            losses = [eval_step(params, global_batch(val_batches.batch(i), mesh))
                      for i in range(tc.eval_batches)]
            return {"val_loss": float(np.mean(jax.device_get(losses)))}

        def next_batch(step: int, state):
            if spec.grpo:
                return global_batch(rl.batch(step, state.params, tc.steps), mesh)
            if spec.dpo:
                return global_batch(prefs.batch(batches, step, state.params), mesh)
            return global_batch(batches.batch(step), mesh)

        state, last = run_steps(state, train_step, next_batch, evaluate, tc, desc=desc,
                                checkpoints=checkpoints, nonfinite=nonfinite, tracker=tracker,
                                metrics=spec.out / "metrics.jsonl" if primary else None,
                                flops_per_token=None if spec.grpo
                                else train_flops_per_token(config, tc.seq_len),
                                tokens_in=(lambda batch: int(batch["inputs"].size))
                                if spec.grpo else None,
                                host=rl if spec.grpo else None, progress=spec.progress)

        params = state.params
        if spec.lora:
            save_adapter(spec.out / "adapter", model, params, base_model=spec.init, overwrite=True)
            model, params = merge_lora(model, params)
        # Merged into the base as stored, not the compute-dtype copy: the merge streams the base
        # from its file again, tensor by tensor, a second reading that is needed by design.
        if spec.lora and spec.init:
            merge_checkpoint(spec.init, spec.out / "adapter", spec.out / "model", force=True,
                             progress=False)
        else:  # every process takes part in gathering the tensors; process 0 writes them
            save_native(spec.out / "model", config, params, overwrite=True)
        if not primary:
            return {"steps": tc.steps, "train_loss": last["loss"], "val_loss": last["val_loss"],
                    "unigram_loss": unigram, "model": str(spec.out / "model"), "plot": None,
                    "sample": ""}
        tokenizer.save(spec.out / "model")
        plot = (grpo_lib.plot_rewards(spec.out, scores.get("before", {}).get("eval/reward"))
                if spec.grpo else
                plot_losses(spec.out, unigram, "DPO loss" if spec.dpo else None))
        summary = {"steps": tc.steps, "train_loss": last["loss"], "val_loss": last["val_loss"],
                   "unigram_loss": unigram, "model": str(spec.out / "model"), "plot": plot}
        if spec.sft:
            chat.template.save(spec.out / "model")
            scores["after"] = chat.exact_match(model, params)
            tracker.log(tc.steps, sft_lib.exact_match_scalars(scores["after"]))
            write_text(spec.out / "exact_match.json", json.dumps(scores, indent=2) + "\n")
            summary["exact_match"] = {k: v["exact_match"] for k, v in scores.items()}
            summary["unseen_exact_match"] = scores["after"]["unseen_exact_match"]
            summary["n_unseen"] = scores["after"]["n_unseen"]
            summary["n_eval"] = scores["after"]["n"]
            summary["sample"] = chat.sample(scores["after"])
        elif spec.dpo:
            if prefs.template is not None:
                prefs.template.save(spec.out / "model")
            scores["after"] = prefs.evaluate(model, params, replies=True)
            tracker.log(tc.steps, dpo_lib.eval_scalars(scores["after"]))
            write_text(spec.out / "preference.json", json.dumps(scores, indent=2) + "\n")
            summary["preference"] = {when: dpo_lib.eval_scalars(v) for when, v in scores.items()}
            summary["n_eval"] = len(prefs.eval_pairs)
            summary["sample"] = prefs.sample(scores)
        elif spec.grpo:
            if rl.template is not None:
                rl.template.save(spec.out / "model")
            scores["after"] = rl.evaluate(model, params, answers=True)
            tracker.log(tc.steps, grpo_lib.eval_scalars(scores["after"]))
            write_text(spec.out / "grpo.json", json.dumps(scores, indent=2) + "\n")
            summary["grpo"] = {when: grpo_lib.eval_scalars(v) for when, v in scores.items()}
            summary["general"] = {when: v["general"] for when, v in scores.items()}
            summary["n_eval"] = len(rl.eval_prompts)
            summary["sample"] = "\n".join(f"{s['prompt']!r} -> {s['completion']!r}"
                                          for s in scores["after"]["samples"])
        else:  # one process decodes: a model sharded over several would need them all
            summary["sample"] = _sample(model, params, tokenizer, val_tokens, tc.seq_len,
                                        spec.sample_tokens if jax.process_count() == 1 else 0,
                                        tc.seed)
        if spec.lora:
            summary["adapter"] = str(spec.out / "adapter")
        return summary


def run_steps(state, train_step, next_batch, evaluate, tc: TrainConfig, *, desc: str,
              checkpoints: Checkpoints, nonfinite: NonFinite, tracker: Tracker,
              metrics: Path | None, flops_per_token: float | None,
              tokens_in: Callable[[dict], int] | None = None, host=None, progress: bool = True):
    """The loop: from the state's step to tc.steps, `train_step(state, next_batch(step, state))`.
    Each step's record - step, the step's metrics (loss, grad_norm, lr, ...), tokens/s - is
    appended to `metrics` (None: this process writes nothing) and logged by `tracker`;
    `evaluate(params)` runs every tc.eval_every steps and at the end, its figures (val_loss first)
    joining that step's record. A checkpoint every tc.checkpoint_every steps, at the end and at
    an early stop. The NaN policy (`nonfinite`) and the stop signals end the run with
    TrainingDiverged / RunStopped, naming the checkpoint to go on from. Tokens a step:
    `tokens_in(batch)`, or tc.batch_size x tc.seq_len; the progress bar shows the MFU where
    `flops_per_token` is given. host (GRPO's inputs): its step_figures(step) join each step's
    record, the device figures its drop(step) names leave it; a batch it cannot make
    (tasks.rewards.RewardFailed) ends the run like a NaN loss, with the last good step's
    checkpoint. progress: the bar on stderr (bridge.progress), its figures step_figures'.
    Returns (state, last): last holds the final "loss" and "val_loss" (NaN where the evaluation
    has none)."""
    from tasks.rewards import RewardFailed

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
                batch = next_batch(step, state)
            except RewardFailed as e:  # the state is the last good step's: kept
                if step > start:
                    checkpoints.save(step, state)
                raise TrainingDiverged(f"{e}; stopped. " + (
                    f"Its checkpoint: {checkpoints.path(step)}" if step > start else
                    "Last good checkpoint: " + _latest(checkpoints))) from None
            tokens = tokens_in(batch) if tokens_in else tc.batch_size * tc.seq_len
            state, figures = train_step(state, batch)
            figures = {k: float(v) for k, v in jax.device_get(figures).items()}
            if host is not None:
                figures = {**{k: v for k, v in figures.items() if k not in host.drop(step)},
                           **host.step_figures(step)}
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
                evaluated = evaluate(state.params)
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
            if "reward" in record:  # GRPO: a round's reward is in the record of its first step
                last["reward"] = record["reward"]
            # refresh=False: the bar is drawn by update(), at its own pace (a log's is coarse)
            bar.set_postfix(step_figures(last, tokens_per_s, evaluated, host is not None,
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


def step_figures(last: dict, tokens_per_s: float, evaluated: dict | None, grpo: bool = False,
                 mfu: float | None = None) -> dict[str, str]:
    """What the progress bar shows after a step: the last "loss" and tokens/s (GRPO: the last
    round's "reward" instead), the held-out figure of the newest evaluation - none before the
    first, rather than a NaN that reads like a diverged run - and the MFU where it is measured.
    evaluated: the newest evaluation's figures, or None."""
    evaluated = evaluated or {}
    if grpo:
        shown = {"loss": f"{last['loss']:.4f}"}
        if "reward" in last:
            shown["reward"] = f"{last['reward']:.3f}"
        if "eval/reward" in evaluated:
            shown["held_out"] = f"{evaluated['eval/reward']:.3f}"
    else:
        shown = {"loss": f"{last['loss']:.3f}"}
        if "val_loss" in evaluated:
            shown["val"] = f"{evaluated['val_loss']:.3f}"
        shown["tok_s"] = f"{tokens_per_s:,.0f}"
    if mfu is not None:
        shown["mfu"] = f"{mfu:.1%}"
    return shown


def _latest(checkpoints: Checkpoints) -> str:
    kept = checkpoints.latest_step()
    return "none" if kept is None else str(checkpoints.path(kept))


def _check_mesh_splits(config: LlamaConfig, mesh) -> None:
    """Refuse an fsdp or tensor axis that divides none of the model's sharded dimensions: the
    rules would leave every parameter whole on every device, which is not what it asks for."""
    from bridge.tensors import canonical_shapes

    from ..checkpoint import _flax_path
    from ..sharding import spec_for

    for axis in ("fsdp", "tensor"):
        if mesh.shape[axis] == 1:
            continue
        split = False
        for name, shape in canonical_shapes(config).items():
            path, _, transposed = _flax_path(name, False)
            keys = [jax.tree_util.DictKey(k) for k in path]
            leaf = tuple(reversed(shape)) if transposed else shape
            split |= axis in tuple(spec_for(keys, leaf, mesh))
        if not split:
            raise BridgeError(f"{axis}={mesh.shape[axis]} divides none of the model's sharded "
                              f"dimensions (dim {config.dim}, ffn_dim {config.ffn_dim}, "
                              f"vocab_size {config.vocab_size}, heads x head_dim); every "
                              f"parameter would stay whole on every device", field="mesh")


def _corpus_batches(spec: RunSpec, files: list[Path], tokenizer, config: LlamaConfig,
                    local_batch: int):
    """(train batches, validation batches, unigram baseline, validation tokens) of a corpus:
    tokenized once into the cache beside the run, 5% held out."""
    tc = spec.train
    tokens = data_lib.tokenize_corpus(files, tokenizer, spec.out.parent / "token-cache",
                                      progress=lambda it: progress_bar(
                                          it, total=len(files), desc="tokenizing", unit="file",
                                          leave=False, enabled=spec.progress),
                                      labeled=spec.strip_labels)
    train_tokens, val_tokens = data_lib.split(tokens, 0.05, tc.seq_len + 1)
    unigram = data_lib.unigram_loss(train_tokens, val_tokens, config.vocab_size)
    kind = data_lib.PackedBatches if spec.pack else data_lib.Batches
    where = dict(process_index=jax.process_index(), process_count=jax.process_count(),
                 bos_id=tokenizer.bos_id if tokenizer.add_bos else None)  # BOS opens documents
    if spec.pack:
        where["eos_id"] = tokenizer.eos_id  # each document ends at EOS when it opens with no BOS
    batches = kind(train_tokens, local_batch, tc.seq_len, tc.seed, **where)
    val_batches = kind(val_tokens, local_batch, tc.seq_len, tc.seed + 1, **where)
    say(f"{len(tokens):,} tokens ({len(train_tokens):,} train, {len(val_tokens):,} validation); "
         f"unigram baseline {unigram:.3f} nats/token")
    if spec.pack:
        say(f"packed {len(batches.rows):,} rows of whole documents, {batches.padding():.1%} "
             f"padding")
    return batches, val_batches, unigram, val_tokens


# -- what the user sees at the end -----------------------------------------------------------------

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


def _sample(model, params, tokenizer, val_tokens, seq_len: int, n_new: int, seed: int) -> str:
    """A short temperature-0.8 continuation of the start of the validation tokens, with the
    KV-cache generator."""
    from bridge.sampling import Sampler

    from ..inference.generate import generate

    if n_new <= 0:
        return ""
    prompt = [int(t) for t in val_tokens[:max(1, min(seq_len // 4, 64))]]
    n_new = min(n_new, model.config.max_seq_len - len(prompt))
    new = generate(model, params, [prompt], n_new, Sampler(temperature=0.8), seed=seed).tokens[0]
    return tokenizer.decode(prompt + new)
