"""A training run from start to finish: tokenizer, data, model, mesh, the loop, checkpoints, outputs.

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
                  (a LoRA run: the base with the adapter merged in)
  adapter/        a LoRA run's adapter, as Hugging Face PEFT writes it (adapter_config.json,
                  adapter_model.safetensors)
  chat_template.jinja   an SFT run's chat template (also in model/, where generate --chat finds it)
  exact_match.json      an SFT run's greedy replies to the held-out chats, before and after
  preference.json       a DPO run's held-out metrics (loss, rewards, pair accuracy) before and
                        after, and greedy replies to a few held-out prompts
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import jax
import numpy as np
from tqdm import tqdm

from bridge.atomic import write_text
from bridge.config import LlamaConfig
from bridge.data_dirs import check_out_apart
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from bridge.gguf.container import is_gguf
from bridge.lora import LoraConfig
from bridge.merge import merge_lora as merge_checkpoint
from bridge.tokenizer import load_tokenizer, train_tokenizer

from . import data as data_lib
from ..attention import choose as choose_attention
from ..checkpoint import load as load_checkpoint
from ..checkpoint import save as save_native
from . import dpo as dpo_lib
from . import sft as sft_lib
from ..lora import add_lora, count, merge_lora, save_adapter, trainable_for
from ..model import Llama, init
from ..perf import measure_matmul_peak, train_flops_per_token
from .state import (Checkpoints, NonFinite, RunStopped, StopSignals, all_processes_reach,
                        keep_metrics_until, setup_differences)
from .sharding import check_batch, global_batch, make_mesh
from .tracking import Tracker, TrackingSpec
from .step import (TrainConfig, TrainingDiverged, init_state, jit_eval_step, jit_train_step,
                    lm_loss, make_optimizer, place_state)

__all__ = ["RunSpec", "RunStopped", "TrainingDiverged", "train"]


@dataclass
class RunSpec:
    out: Path
    model: LlamaConfig | None          # None with `init`: the checkpoint's own config
    train: TrainConfig
    data: list[str] = field(default_factory=list)   # empty: the embedded default corpus
    tokenizer: str | None = None       # None: the init checkpoint's, else a BPE trained here
    init: str | None = None
    vocab_size: int = 4096             # of the BPE trained when no tokenizer is given
    mesh: str | None = None
    scan_layers: bool = False
    remat: bool = False
    resume: bool = False
    sample_tokens: int = 64
    strip_labels: bool = False         # data files are `LABEL ||| TEXT` lines: train on the texts
    pack: bool = False                 # rows of whole documents with segment ids, not windows
    attention: str = "auto"            # the attention implementation (jax_llama.attention)
    lora: LoraConfig | None = None     # train LoRA adapters only; the base stays frozen, held in
                                       # the compute dtype (train.dtype)
    sft: sft_lib.SftSpec | None = None  # supervised fine-tuning on chats instead of a corpus
    dpo: dpo_lib.DpoSpec | None = None  # preference tuning on pairs instead of a corpus
    tracking: TrackingSpec = field(default_factory=TrackingSpec)  # TensorBoard / W&B as well;
                                       # not part of the setup a resume must match
    on_nan: str = "stop"               # a step whose loss or gradients are not finite: stop
                                       # the run, or skip its update (jax_llama.training.state)
    max_skipped: int = 10              # with on_nan="skip": stop once this many were skipped


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def _run_record(spec: RunSpec, config: LlamaConfig) -> dict:
    return {"model": config.to_dict(), "train": spec.train.to_dict(), "data": spec.data,
            "tokenizer": spec.tokenizer, "init": spec.init, "strip_labels": spec.strip_labels,
            "pack": spec.pack, "lora": None if spec.lora is None else spec.lora.to_dict(),
            "sft": None if spec.sft is None else spec.sft.to_dict(),
            "dpo": None if spec.dpo is None else spec.dpo.to_dict(),
            "tracking": spec.tracking.to_dict()}


def _check_resumable(spec: RunSpec, config: LlamaConfig) -> None:
    # run.json files from before strip_labels and pack were recorded ran without them
    saved = {"strip_labels": False, "pack": False,
             **json.loads((spec.out / "run.json").read_text())}
    now = {k: v for k, v in _run_record(spec, config).items() if k != "tracking"}
    diffs = setup_differences(saved, now)
    if diffs:
        raise BridgeError(f"{spec.out} was trained with a different setup ({'; '.join(diffs)})",
                          field="resume")


def _tokenizer(spec: RunSpec, texts: Callable[[], Iterable[str]], what: str):
    if spec.resume:
        return load_tokenizer(spec.out / "tokenizer")
    if spec.tokenizer:
        return load_tokenizer(spec.tokenizer)
    if spec.init and (is_gguf(spec.init) or Path(spec.init).is_dir() and any(
            (Path(spec.init) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))):
        return load_tokenizer(spec.init)  # a GGUF's own vocabulary, or the directory's files
    _say(f"training a {spec.vocab_size}-token byte-level BPE on {what}")
    return train_tokenizer(texts(), spec.vocab_size)


def _model_config(spec: RunSpec, tokenizer) -> LlamaConfig:
    if spec.init:
        config = open_checkpoint(spec.init).config
        if tokenizer.vocab_size > config.vocab_size:
            raise BridgeError(f"{tokenizer.vocab_size} ids do not fit the vocabulary "
                              f"of {spec.init} ({config.vocab_size})", field="tokenizer")
    else:
        config = spec.model.replace(vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id,
                                    eos_ids=() if tokenizer.eos_id is None else (tokenizer.eos_id,))
    if spec.train.seq_len > config.max_seq_len:
        raise BridgeError(f"{spec.train.seq_len} is above the model's max_seq_len "
                          f"{config.max_seq_len}", field="seq_len")
    return config


def train(spec: RunSpec) -> dict:
    """Run (or resume) training; returns a summary with the final losses and output paths."""
    tc = spec.train
    choose_attention(spec.attention, 1, 1)  # refused before anything is read or written
    spec.tracking.check()
    nonfinite = NonFinite(spec.on_nan, spec.max_skipped)
    task = spec.sft or spec.dpo  # their data are files; a run's own output is never its input
    check_out_apart(spec.out, [*spec.data, *((task.data, task.eval_data) if task else ())])
    if jax.process_count() > 1 and (spec.lora or spec.sft or spec.dpo):
        kind = "LoRA" if spec.lora else "SFT" if spec.sft else "DPO"
        raise BridgeError(f"{kind} runs across several processes are "
                          f"not supported yet (one process with many devices is)", field="multi_host")
    if spec.resume and not (spec.out / "run.json").is_file():
        raise BridgeError(f"{spec.out} holds no run to resume (no run.json)", field="resume")
    if not spec.resume and spec.out.exists() and any(spec.out.iterdir()):
        raise BridgeError(f"{spec.out} is not empty", field="out",
                          hint=("resume", True, "pass {} to continue that run"))
    if spec.sft:  # every conversation is read, rendered and checked before anything is written
        chat = sft_inputs(spec)
        tokenizer, config = chat.tokenizer, chat.config
    elif spec.dpo:  # every pair likewise
        prefs = dpo_inputs(spec)
        tokenizer, config = prefs.tokenizer, prefs.config
    else:
        files = data_lib.corpus_files(spec.data, out=spec.out) if spec.data else data_lib.default_corpus()
        tokenizer = _tokenizer(spec, lambda: data_lib.read_documents(files, labeled=spec.strip_labels),
                               f"{len(files)} files")
        config = _model_config(spec, tokenizer)
    mesh = make_mesh(spec.mesh)
    check_batch(tc.batch_size, mesh)
    _check_mesh_splits(config, mesh)
    if spec.resume:
        _check_resumable(spec, config)
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
    else:
        batches, val_batches, unigram, val_tokens = _corpus_batches(spec, files, tokenizer, config,
                                                                    local_batch)

    model = Llama(config, dtype=tc.dtype, scan_layers=spec.scan_layers, remat=spec.remat,
                  attention=spec.attention)
    # A frozen base needs no float32 master copy: with LoRA it is held in the compute dtype.
    base_dtype = tc.dtype if spec.lora else "float32"
    if spec.init:
        # straight onto the mesh: each process reads only the parts its devices hold
        params = load_checkpoint(spec.init, dtype=base_dtype, scan_layers=spec.scan_layers,
                                 mesh=mesh)[1]
    else:
        params = init(config, seed=tc.seed, scan_layers=spec.scan_layers,
                      param_dtype=base_dtype)[1]
    labels, desc = None, "training"
    if spec.lora:
        model, params = add_lora(model, params, spec.lora, seed=tc.seed)
        labels = trainable_for(spec.lora)
        n_train, n_all = count(params, labels(params)), count(params)
        _say(f"LoRA rank {spec.lora.rank} on {', '.join(spec.lora.targets)}"
             f"{' and the embedding table' if spec.lora.train_embeddings else ''}: training "
             f"{n_train:,} of {n_all:,} parameters")
        desc = f"training LoRA ({n_train / 1e6:.3g}M of {n_all / 1e6:.3g}M params)"
    optimizer = make_optimizer(tc, labels)
    if spec.dpo:  # the starting weights, before the state (donated at each step) holds them
        prefs.start_reference(model, params, tc, local_batch)
    state = place_state(init_state(params, optimizer), mesh)
    checkpoints = Checkpoints(spec.out / "checkpoints", tc.keep_checkpoints)
    if spec.resume:  # from the newest checkpoint that restores; none written yet: from the start
        restored = checkpoints.restore_newest(state, mesh)
        if restored is not None:
            state = restored[0]
            _say(f"resumed {spec.out} at step {int(state.step)}")
        if primary:
            keep_metrics_until(spec.out / "metrics.jsonl", int(state.step))
    # Only the primary process logs; a resumed run appends from the step it resumed at.
    tracker = Tracker.open(spec.tracking, spec.out, _run_record(spec, config),
                           int(state.step) if spec.resume else None) if primary else Tracker()
    with tracker:
        scores = {}
        if spec.sft and not spec.resume:
            scores["before"] = chat.exact_match(model, params)
            tracker.log(0, _exact_match_scalars(scores["before"]))
        if spec.dpo and not spec.resume:
            scores["before"] = prefs.evaluate(model, params, replies=True)
            tracker.log(0, _eval_scalars(scores["before"]))
        if spec.dpo:
            train_step = jit_train_step(dpo_lib.train_loss(model, spec.dpo), optimizer, tc, state,
                                        mesh, labels, has_aux=True, skip_nonfinite=nonfinite.skip)
        else:
            train_step = jit_train_step(lm_loss(model), optimizer, tc, state, mesh, labels,
                                        skip_nonfinite=nonfinite.skip)
            eval_step = jit_eval_step(model, state, mesh)

        def evaluate(params) -> float:
            if spec.dpo:
                result = prefs.evaluate(model, params)
                last["eval"] = _eval_scalars(result)
                return result["loss"]
            losses = [eval_step(params, global_batch(val_batches.batch(i), mesh))
                      for i in range(tc.eval_batches)]
            return float(np.mean(jax.device_get(losses)))

        def next_batch(step: int, state):
            if spec.dpo:
                return global_batch(prefs.batch(batches, step, state.params), mesh)
            return global_batch(batches.batch(step), mesh)

        peak = measure_matmul_peak(tc.dtype)
        flops_per_token = train_flops_per_token(config, tc.seq_len)
        tokens_per_step = tc.batch_size * tc.seq_len
        last = {"loss": float("nan"), "val_loss": float("nan")}
        start = int(state.step)
        stopped = None
        with open(spec.out / "metrics.jsonl" if primary else os.devnull, "a") as log, \
                tqdm(total=tc.steps, initial=start, desc=desc, unit="step", file=sys.stderr) as bar, \
                StopSignals() as signals:
            tick = time.perf_counter()
            for step in range(start, tc.steps):
                state, metrics = train_step(state, next_batch(step, state))
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                why = nonfinite.check(step + 1, metrics)
                if why is not None and not nonfinite.skip:  # this state is never saved
                    kept = checkpoints.latest_step()
                    raise TrainingDiverged(
                        f"{why}; stopped. Last good checkpoint: "
                        f"{'none' if kept is None else checkpoints.path(kept)}")
                now = time.perf_counter()
                tokens_per_s = tokens_per_step / (now - tick)
                tick = now
                record = {"step": step + 1, **metrics, "tokens_per_s": tokens_per_s}
                if nonfinite.skipped and nonfinite.skipped[-1] == step + 1:
                    record["skipped"] = True
                if (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps:
                    record["val_loss"] = last["val_loss"] = evaluate(state.params)
                    record.update(last.pop("eval", {}))
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
                last["loss"] = metrics["loss"]
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", val=f"{last['val_loss']:.3f}",
                                tok_s=f"{tokens_per_s:,.0f}",
                                mfu=f"{tokens_per_s * flops_per_token / peak:.1%}")
                bar.update()
                if stopped is not None:
                    break
        if stopped is not None:
            step, why, asked = stopped
            if asked:
                raise RunStopped(step, tc.steps, why, checkpoints.path(step))
            raise TrainingDiverged(f"{why}; stopped. Its checkpoint: {checkpoints.path(step)}")

        params = state.params
        if spec.lora:
            save_adapter(spec.out / "adapter", model, params, base_model=spec.init, overwrite=True)
            model, params = merge_lora(model, params)
        if spec.lora and spec.init:  # merged into the base as stored, not the compute-dtype copy
            merge_checkpoint(spec.init, spec.out / "adapter", spec.out / "model", force=True,
                             progress=False)
        else:  # every process takes part in gathering the tensors; process 0 writes them
            save_native(spec.out / "model", config, params, overwrite=True)
        if not primary:
            return {"steps": tc.steps, "train_loss": last["loss"], "val_loss": last["val_loss"],
                    "unigram_loss": unigram, "model": str(spec.out / "model"), "plot": None,
                    "sample": ""}
        tokenizer.save(spec.out / "model")
        plot = _plot(spec.out, unigram, "DPO loss" if spec.dpo else None)
        summary = {"steps": tc.steps, "train_loss": last["loss"], "val_loss": last["val_loss"],
                   "unigram_loss": unigram, "model": str(spec.out / "model"), "plot": plot}
        if spec.sft:
            chat.template.save(spec.out / "model")
            scores["after"] = chat.exact_match(model, params)
            tracker.log(tc.steps, _exact_match_scalars(scores["after"]))
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
            tracker.log(tc.steps, _eval_scalars(scores["after"]))
            write_text(spec.out / "preference.json", json.dumps(scores, indent=2) + "\n")
            summary["preference"] = {when: _eval_scalars(v) for when, v in scores.items()}
            summary["n_eval"] = len(prefs.eval_pairs)
            summary["sample"] = prefs.sample(scores)
        else:  # one process decodes: a model sharded over several would need them all
            summary["sample"] = _sample(model, params, tokenizer, val_tokens, tc.seq_len,
                                        spec.sample_tokens if jax.process_count() == 1 else 0,
                                        tc.seed)
        if spec.lora:
            summary["adapter"] = str(spec.out / "adapter")
        return summary


def _check_mesh_splits(config: LlamaConfig, mesh) -> None:
    """Refuse an fsdp or tensor axis that divides none of the model's sharded dimensions: the
    rules would leave every parameter whole on every device, which is not what it asks for."""
    from bridge.tensors import canonical_shapes

    from ..checkpoint import _flax_path
    from .sharding import spec_for

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
                                      progress=lambda it: tqdm(it, total=len(files), desc="tokenizing",
                                                               unit="file", file=sys.stderr, leave=False),
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
    _say(f"{len(tokens):,} tokens ({len(train_tokens):,} train, {len(val_tokens):,} validation); "
         f"unigram baseline {unigram:.3f} nats/token")
    if spec.pack:
        _say(f"packed {len(batches.rows):,} rows of whole documents, {batches.padding():.1%} "
             f"padding")
    return batches, val_batches, unigram, val_tokens


# -- supervised fine-tuning on chats -----------------------------------------------------------------

@dataclass
class ChatInputs:
    """An SFT run's inputs, all checked before the run writes anything: the tokenizer, the model
    config, the chat template, and the conversations encoded with their assistant-only masks."""

    spec: RunSpec
    tokenizer: object
    config: LlamaConfig
    template: object                 # bridge.chat.ChatTemplate
    examples: list                   # bridge.chat.Example, cut to seq_len + 1 tokens
    eval_examples: list
    eval_chats: list                 # (where, messages) of the held-out conversations
    skipped: list[str]
    train_prompts: set[str]          # each training conversation but its last reply, as JSON

    def batches(self, tc: TrainConfig, local_batch: int, pack: bool):
        args = (local_batch, tc.seq_len, tc.seed, jax.process_index(), self.tokenizer.pad_id or 0, pack,
                jax.process_count())
        batches = sft_lib.example_batches(self.examples, *args)
        val_batches = sft_lib.example_batches(self.eval_examples, *args[:2], tc.seed + 1, *args[3:])
        trained = int(sum(e.trained.sum() for e in self.examples))
        total = int(sum(len(e.ids) for e in self.examples))
        _say(f"{len(self.examples):,} conversations ({len(self.eval_examples):,} held out"
             f"{f', {len(self.skipped):,} skipped' if self.skipped else ''}): {total:,} tokens, "
             f"{trained:,} of them trained (the assistant's)")
        unpacked = sft_lib.unpacked_padding(self.examples, tc.seq_len)
        if pack:
            _say(f"packed into {len(batches.rows):,} rows: {batches.padding():.1%} padding "
                 f"(one conversation a row: {unpacked:.1%})")
        else:
            _say(f"one conversation a row: {unpacked:.1%} padding (--pack would save most of it)")
        # The baseline: a unigram model of the trained tokens.
        targets = np.concatenate([e.ids[e.trained] for e in self.examples])
        held = np.concatenate([e.ids[e.trained] for e in self.eval_examples])
        return batches, val_batches, data_lib.unigram_loss(targets, held, self.config.vocab_size)

    def exact_match(self, model, params, limit: int = 200) -> dict:
        """Greedy replies to (up to `limit` of) the held-out conversations against their last
        assistant message."""
        from bridge.sampling import Sampler

        from ..generate import generate

        chats = self.eval_chats[:limit]
        longest = max(len(self.tokenizer.encode(m[-1]["content"])) for _, m in chats)

        def reply(prompts):
            room = self.config.max_seq_len - max(map(len, prompts))
            return generate(model, params, prompts, max(1, min(longest + 4, room)), Sampler(),
                            self.tokenizer.stop_ids).tokens
        score, records = sft_lib.exact_match(reply, self.template, self.tokenizer, chats)
        for record, (_, messages) in zip(records, chats):
            record["seen_in_training"] = sft_lib.prompt_key(messages) in self.train_prompts
        unseen = [r["match"] for r in records if not r["seen_in_training"]]
        result = {"exact_match": score, "n": len(chats),
                  "unseen_exact_match": float(np.mean(unseen)) if unseen else None,
                  "n_unseen": len(unseen), "replies": records}
        _say(f"exact match on {len(chats)} held-out conversations: {score:.1%}"
             + (f" ({result['unseen_exact_match']:.1%} on the {len(unseen)} whose question is "
                f"not in the training set)" if unseen else ""))
        return result

    def sample(self, scores: dict) -> str:
        return "\n".join(f"{r['where']}: {r['expected']!r} -> {r['reply']!r}"
                         for r in scores["replies"][:5])


def sft_inputs(spec: RunSpec) -> ChatInputs:
    """Read, render and check an SFT run's conversations (refusing, naming the example, what
    cannot train), with the tokenizer and template they need."""
    from bridge.chat import find_template

    sft = spec.sft
    chats, eval_chats = sft_lib.load_chats(sft, spec.train.seed)
    tokenizer = _tokenizer(spec, lambda: sft_lib.chat_texts(chats),
                           f"the {len(chats):,} conversations")
    config = _model_config(spec, tokenizer)
    template_from = spec.out if spec.resume else spec.init
    template = find_template(template_from, tokenizer, None if spec.resume else sft.chat_template)
    max_len = spec.train.seq_len + 1
    if sft.replay:
        chats = chats + replay_chats(spec, tokenizer, template)
    examples, skipped = sft_lib.encode_all(chats, template, tokenizer, max_len, sft.skip_invalid)
    eval_examples, eval_skipped = sft_lib.encode_all(eval_chats, template, tokenizer, max_len,
                                                     sft.skip_invalid)
    if not examples or not eval_examples:
        raise BridgeError(f"no {'training' if not examples else 'held-out'} conversation is "
                          f"left to train on", field="data")
    kept = {where for where, _ in eval_chats} - set(eval_skipped)
    return ChatInputs(spec, tokenizer, config, template, examples, eval_examples,
                      [c for c in eval_chats if c[0] in kept], skipped + eval_skipped,
                      {sft_lib.prompt_key(messages) for _, messages in chats})


# -- preference tuning on pairs -----------------------------------------------------------------

@dataclass
class PreferenceInputs:
    """A DPO run's inputs, all checked before the run writes anything: the tokenizer, the model
    config, the chat template (for conversational pairs) and the encoded pairs; then its
    reference (start_reference) and the reference log-probs of the held-out pairs."""

    spec: RunSpec
    tokenizer: object
    config: LlamaConfig
    template: object | None          # bridge.chat.ChatTemplate, or None for plain-text pairs
    pairs: list                      # bridge.preference.Pair
    eval_pairs: list
    counts: dict                     # skipped (identical) and cut pairs
    reference: object = None         # dpo_lib.Reference, once started
    eval_ref: np.ndarray | None = None
    train_ref: np.ndarray | None = None   # with precompute_ref
    batch_size: int = 0              # pairs a batch, and the rows' length: set with the reference
    seq_len: int = 0
    _logps: dict = field(default_factory=dict)

    def batches(self, tc: TrainConfig, local_batch: int):
        from bridge.preference import PairBatches

        tokens = sum(len(p.chosen) + len(p.rejected) for p in self.pairs)
        _say(f"{len(self.pairs):,} preference pairs ({len(self.eval_pairs):,} held out"
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
        copy = None if model.lora is not None else jax.tree.map(lambda x: x.copy(), params)
        self.reference = dpo_lib.Reference(model, copy)
        self.batch_size, self.seq_len = local_batch, tc.seq_len

        def progress(desc):
            return lambda it, total: tqdm(it, total=total, desc=desc, unit="batch",
                                          file=sys.stderr, leave=False)
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
                lambda p, rows: dpo_lib.sequence_logps(model, p, rows))
        result = dpo_lib.evaluate(model, params, self.eval_pairs, self.eval_ref, self.spec.dpo,
                                  self.batch_size, self.seq_len, self.pad_id, fn)
        _say(f"held-out pairs: loss {result['loss']:.4f}, rewards/accuracies "
             f"{result['rewards/accuracies']:.1%}, the model prefers the chosen completion in "
             f"{result['preference/accuracy']:.1%}")
        if replies:
            from bridge.sampling import Sampler

            from ..generate import generate

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


def dpo_inputs(spec: RunSpec) -> PreferenceInputs:
    """Read, check and encode a DPO run's pairs (refusing, naming FILE:LINE, what cannot train),
    with the tokenizer and, for conversational pairs, the chat template."""
    from bridge.chat import find_template
    from bridge.preference import encode_pairs, read_pairs

    dpo = spec.dpo
    seed = spec.train.seed
    records = read_pairs(dpo.data) if dpo.data else dpo_lib.demo_pairs(dpo.demo_pairs, seed)
    if dpo.eval_data:
        eval_records = read_pairs(dpo.eval_data)
    else:
        records, eval_records = dpo_lib.split_pairs(records, dpo.eval_fraction, seed)
    tokenizer = _tokenizer(spec, lambda: _pair_texts(records), f"the {len(records):,} pairs")
    config = _model_config(spec, tokenizer)
    template = None
    if any(not isinstance(r["prompt"], str) for _, r in records + eval_records):
        template = find_template(spec.out if spec.resume else spec.init, tokenizer,
                                 None if spec.resume else dpo.chat_template)
    pairs, counts = encode_pairs(records, tokenizer, template, spec.train.seq_len)
    eval_pairs, eval_counts = encode_pairs(eval_records, tokenizer, template, spec.train.seq_len)
    if not pairs or not eval_pairs:
        raise BridgeError(f"no {'training' if not pairs else 'held-out'} pair is left to train on",
                          field="data")
    counts = {k: counts[k] + eval_counts[k] for k in counts}
    return PreferenceInputs(spec, tokenizer, config, template, pairs, eval_pairs, counts)


def replay_chats(spec: RunSpec, tokenizer, template) -> list[tuple[str, list[dict]]]:
    """The --init model's own greedy answers to spec.sft.replay general prompts, as chats
    (where: replay:N): trained on beside the data, they keep the model answering other requests
    as it did, where a narrow task alone teaches its style to every reply. The same every time
    (greedy), so a resumed run trains on the same chats."""
    from bridge.prompts import stop_ids as tokenizer_stops

    from ..generate import generate

    sft = spec.sft
    if not spec.init:
        raise BridgeError("needs --init: the answers replayed are the starting model's own",
                          field="replay")
    prompts = sft_lib.general_prompts(sft.replay, spec.train.seed)
    model, params = load_checkpoint(spec.init, dtype="float32", attention=spec.attention)
    stops = list(tokenizer_stops(tokenizer))
    ids = [template.encode([{"role": "user", "content": p}], tokenizer, add_generation_prompt=True)
           for p in prompts]
    chats, dropped, batch = [], 0, 32
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    answers: dict[int, str | None] = {}
    for start in tqdm(range(0, len(order), batch), desc=f"replay: {spec.init}'s own answers",
                      unit="batch", file=sys.stderr, leave=False):
        rows = order[start:start + batch]
        out = generate(model, params, [ids[i] for i in rows], sft.replay_tokens,
                       stop_ids=stops).tokens
        for i, tokens in zip(rows, out):
            finished = bool(tokens) and tokens[-1] in stops
            answers[i] = sft_lib.replay_answer(
                tokenizer.decode([t for t in tokens if t not in stops]), finished)
    for i, prompt in enumerate(prompts):
        if answers[i] is None:
            dropped += 1
            continue
        chats.append((f"replay:{i + 1}", [{"role": "user", "content": prompt},
                                          {"role": "assistant", "content": answers[i]}]))
    _say(f"replay: {len(chats)} of the starting model's own answers join the training chats"
         + (f" ({dropped} left out: cut at {sft.replay_tokens} tokens before any sentence ended)"
            if dropped else ""))
    return chats


def _eval_scalars(result: dict) -> dict:
    """A DPO evaluation's figures, without the replies, for the tracker and the metrics."""
    return {f"eval/{k}": v for k, v in result.items() if k != "replies"}


def _exact_match_scalars(scores: dict) -> dict:
    """exact_match()'s figures, without the replies and counts, for the tracker."""
    return {k: scores[k] for k in ("exact_match", "unseen_exact_match")}


# -- what the user sees at the end -----------------------------------------------------------------

def _plot(out: Path, unigram: float | None, ylabel: str | None = None) -> str | None:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
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

    from ..generate import generate

    if n_new <= 0:
        return ""
    prompt = [int(t) for t in val_tokens[:max(1, min(seq_len // 4, 64))]]
    n_new = min(n_new, model.config.max_seq_len - len(prompt))
    new = generate(model, params, [prompt], n_new, Sampler(temperature=0.8), seed=seed).tokens[0]
    return tokenizer.decode(prompt + new)
