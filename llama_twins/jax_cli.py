"""`jax-llama`: the JAX jobs - train, generate, finetune, predict, zero-shot, split - and the
two that also need the torch twin: `generate --compare-torch` and `bench`.

Each subcommand parses its flags, calls into jax_llama (imported when the subcommand runs, so that
`--help` and bad flags answer at once), and prints results to stdout; errors name flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from bridge.classification import (DEFAULT_CHAT_QUESTION, DEFAULT_TEMPLATE, FROM_SCRATCH,
                                   PRETRAINED, PRETRAINED_LORA)
from bridge.config import LlamaConfig, preset
from bridge.data_dirs import check_out_apart
from bridge.dtypes import DTYPE_NAMES
from bridge.errors import BridgeError

from .commands import (EXIT_CHECK_FAILED, EXIT_OK, add_command, add_eval_arguments,
                       add_quantize_arguments,
                       add_generate_arguments, command_main, generation_inputs,
                       report_warnings, requested_quantization, run_eval, run_generation)

# TrainConfig fields settable from the command line: (field, type, TrainConfig's default as the
# help states it, help). The flag itself defaults to None: TrainConfig's default, or on --resume the
# run's saved value. jax_llama.train is not imported for --help (it imports JAX), so the defaults
# are written here; tests/test_cli_help.py checks them against TrainConfig's.
TRAIN_OPTIONS = [
    ("steps", int, 600, "train_step calls (micro-batches when --grad-accum > 1)"),
    ("batch_size", int, 16, "rows per step, all processes together"),
    ("seq_len", int, 128, "tokens per row"),
    ("lr", float, 3e-3, "peak learning rate (linear warmup, then cosine decay to a tenth of it)"),
    ("warmup_steps", int, None, "optimizer updates of linear warmup (default: the first 10%% of "
                                "the updates)"),
    ("weight_decay", float, 0.1, "AdamW's, on the kernels and the embedding table only"),
    ("grad_clip", float, 1.0, "clip the global gradient norm to this"),
    ("grad_accum", int, 1, "micro-batches per optimizer update"),
    ("dtype", str, "float32", "compute dtype; parameters and optimizer state stay float32"),
    ("eval_every", int, 100, "steps between held-out evaluations"),
    ("checkpoint_every", int, 100, "steps between checkpoints"),
    ("keep_checkpoints", int, 3, "the newest checkpoints kept in --out"),
    ("seed", int, 0, "seed of the initial weights and the data order"),
]


def _run_spec(args, data: list[str] | None, pack: bool | None, default_pack: bool, sft=None,
              dpo=None):
    """The RunSpec of `train`, `sft` or `dpo` from their shared flags (a resumed run: its own
    settings unless flags say otherwise, which the resume check then refuses)."""
    from jax_llama.run import RunSpec
    from jax_llama.train import TrainConfig

    out = Path(args.out) if args.out else Path("runs") / time.strftime(
        f"{args.command}-%Y%m%d-%H%M%S")
    given = {name: getattr(args, name) for name, *_ in TRAIN_OPTIONS if getattr(args, name) is not None}
    saved = {}
    if args.resume:
        if not (out / "run.json").is_file():
            raise BridgeError(f"{out} holds no run to resume (no run.json)", field="resume")
        saved = json.loads((out / "run.json").read_text())
        train_config = TrainConfig(**{**saved["train"], **given})
        model = LlamaConfig.from_dict(saved["model"])
    else:
        train_config, model = TrainConfig(**given), preset(args.preset)
        if train_config.seq_len > model.max_seq_len and not args.init:
            # A model trained from scratch has the context it is trained at.
            model = model.replace(max_seq_len=train_config.seq_len)
    if sft is not None and saved.get("sft"):  # flags not given keep the saved run's values
        given_sft = {k: v for k, v in sft.to_dict().items() if v != getattr(type(sft)(), k)}
        sft = dataclasses.replace(type(sft)(**saved["sft"]), **given_sft)
    if dpo is not None and saved.get("dpo"):
        given_dpo = {k: v for k, v in dpo.to_dict().items() if v != getattr(type(dpo)(), k)}
        dpo = dataclasses.replace(type(dpo)(**saved["dpo"]), **given_dpo)
    return RunSpec(out=out, model=model, train=train_config,
                   data=data if data is not None else saved.get("data", []),
                   tokenizer=args.tokenizer or saved.get("tokenizer"),
                   init=args.init or saved.get("init"), vocab_size=args.vocab_size, mesh=args.mesh,
                   scan_layers=args.scan_layers, remat=args.remat, resume=args.resume,
                   sample_tokens=getattr(args, "sample_tokens", 0),
                   strip_labels=getattr(args, "strip_labels", False),
                   pack=pack if pack is not None else saved.get("pack", default_pack),
                   attention=args.attention, lora=_lora_config(args, saved.get("lora")), sft=sft,
                   dpo=dpo, tracking=_tracking(args, saved.get("tracking")),
                   on_nan=args.on_nan, max_skipped=args.max_skipped)


def cmd_train(args) -> int:
    spec = _run_spec(args, args.data, True if args.pack else None, default_pack=False)
    return _run(args, spec)


DEMO_STEPS = 3000


def cmd_sft(args) -> int:
    from jax_llama.run import sft_inputs
    from jax_llama.sft import SftSpec

    if args.data is None and args.steps is None and not args.resume:
        args.steps = DEMO_STEPS  # the demo task's default: 99% exact match in about 5 minutes
    sft = SftSpec(data=args.data, eval_data=args.eval_data, chat_template=args.chat_template,
                  skip_invalid=args.skip_invalid, replay=args.replay,
                  **({} if args.demo_examples is None else {"demo_examples": args.demo_examples}))
    spec = _run_spec(args, [], False if args.no_pack else None, default_pack=True, sft=sft)
    if args.show_mask is not None:
        from bridge.chat import show_mask

        if args.show_mask < 1:
            raise BridgeError(f"must be a positive integer (got {args.show_mask})", field="show_mask")
        chat = sft_inputs(spec)
        print(f"template: {chat.template.name}; trained tokens are shown between « and »")
        for example in chat.examples[:args.show_mask]:
            print(show_mask(example, chat.tokenizer) + "\n")
        return EXIT_OK
    return _run(args, spec)


DPO_DEMO_STEPS = 1500
# DPO's learning rates when none is given: a pretrained model is moved gently (TRL's default for
# full fine-tuning is 1e-6; LoRA's adapters start at zero and take a larger rate); the demo's
# small model, trained from scratch, takes a from-scratch rate.
DPO_LR = {"full": 1e-6, "lora": 5e-5, "scratch": 1e-3}


def cmd_dpo(args) -> int:
    from jax_llama.dpo import DpoSpec

    if not args.resume:
        if args.data is None and args.steps is None:
            args.steps = DPO_DEMO_STEPS
        if args.lr is None:
            args.lr = DPO_LR["scratch" if not args.init else "lora" if args.lora_rank else "full"]
    dpo = DpoSpec(data=args.data, eval_data=args.eval_data, chat_template=args.chat_template,
                  beta=args.beta, loss=args.loss, label_smoothing=args.label_smoothing,
                  precompute_ref=args.precompute_ref,
                  **({} if args.demo_pairs is None else {"demo_pairs": args.demo_pairs}))
    spec = _run_spec(args, [], False, default_pack=False, dpo=dpo)
    return _run(args, spec)


def _join_processes(args) -> None:
    """jax.distributed.initialize: from --coordinator / --num-processes / --process-id, or as the
    cluster says (TPU pods, SLURM) without them. On CPUs, collectives go through gloo."""
    import jax

    given = (args.coordinator, args.num_processes, args.process_id)
    if any(x is not None for x in given) and any(x is None for x in given):
        raise BridgeError("give --coordinator, --num-processes and --process-id together "
                          "(or none, to let JAX find the cluster)", field="coordinator")
    if args.process_id:  # jaxlib aborts the process when it cannot connect: look first
        _wait_for_coordinator(args.coordinator, args.connect_timeout)
    # Set before any backend starts (asking which backend runs would start one); it only
    # concerns the CPU backend's collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   initialization_timeout=args.connect_timeout)
    except Exception as e:  # jaxlib raises its own runtime errors for a coordinator it cannot reach
        where = args.coordinator or "the cluster's coordinator"
        raise BridgeError(f"cannot join {where} within {args.connect_timeout} s "
                          f"({(str(e).strip().splitlines() or [type(e).__name__])[0][:160]})",
                          field="coordinator") from None


def _wait_for_coordinator(address: str, timeout: float) -> None:
    """Return once HOST:PORT accepts a connection; refuse after `timeout` seconds."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise BridgeError(f"expected HOST:PORT (got {address!r})", field="coordinator")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise BridgeError(f"cannot reach {address} within {timeout:g} s ({e})",
                                  field="coordinator") from None
            time.sleep(0.2)


def _run(args, spec) -> int:
    """Train (`train`, `sft`) and report where everything went."""
    from jax_llama.run import RunStopped, train
    from jax_llama.train import TrainingDiverged

    if args.multi_host:
        _join_processes(args)
    elif args.coordinator or args.num_processes is not None or args.process_id is not None:
        raise BridgeError("needs --multi-host", field="coordinator")
    try:
        summary = train(spec)
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    except RunStopped as e:
        print(f"{e}; resume with: jax-llama {args.command} --out {spec.out} --resume",
              file=sys.stderr)
        return EXIT_OK
    if "exact_match" in summary:
        scores = summary["exact_match"]
        before = f"{scores['before']:.1%} before, " if "before" in scores else ""
        print(f"exact match on {summary['n_eval']} held-out conversations (greedy): {before}"
              f"{scores['after']:.1%} after"
              + (f"; {summary['unseen_exact_match']:.1%} after on the {summary['n_unseen']} "
                 f"whose question is not in the training set" if summary["n_unseen"] else ""))
    if "preference" in summary:
        scores = summary["preference"]
        for name, key in (("the model prefers the chosen completion", "eval/preference/accuracy"),
                          ("rewards/accuracies", "eval/rewards/accuracies")):
            before = f"{scores['before'][key]:.1%} before, " if "before" in scores else ""
            print(f"held-out pairs ({summary['n_eval']}): {name}: {before}"
                  f"{scores['after'][key]:.1%} after")
        print(f"held-out DPO loss {summary['val_loss']:.4f}; train loss "
              f"{summary['train_loss']:.4f} after {summary['steps']} steps")
    else:
        print(f"validation loss {summary['val_loss']:.4f} nats/token (unigram baseline "
              f"{summary['unigram_loss']:.4f}); train loss {summary['train_loss']:.4f} after "
              f"{summary['steps']} steps")
    print(f"model: {summary['model']}  (llama-bridge convert {summary['model']} DST --to hf)")
    if "adapter" in summary:
        print(f"adapter: {summary['adapter']}  (PEFT format; jax-llama generate BASE --adapter "
              f"{summary['adapter']})")
    if summary["plot"]:
        print(f"loss curve: {summary['plot']}")
    if summary["sample"]:
        print(f"sample:\n{summary['sample']}")
    return EXIT_OK


def cmd_generate(args) -> int:
    import warnings

    from jax_llama.checkpoint import load
    from jax_llama.generate import generate

    def load_model():
        model, params = load_quantized(args, lambda: load(
            args.checkpoint, dtype=args.dtype, attention=args.attention, adapter=args.adapter,
            kernels=args.kernels))
        return (model, params), model.config

    if args.compare_torch and args.quantize:
        raise BridgeError("not with --quantize (it compares the float twins)", field="compare_torch")
    (model, params), tokenizer, texts, prompts, sampler, stops = generation_inputs(args, load_model)
    if args.compare_torch:
        from .parity import format_greedy_parity, greedy_parity
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = greedy_parity(args.checkpoint, prompts, args.max_new_tokens, stops, args.dtype,
                                   args.adapter)
        report_warnings(caught)
        print(format_greedy_parity(report, tokenizer.decode))
        return EXIT_OK if report["identical"] else EXIT_CHECK_FAILED
    return run_generation(lambda prompts, stream: generate(
        model, params, prompts, args.max_new_tokens, sampler, stops, args.seed, on_token=stream),
        tokenizer, texts, prompts)


def cmd_serve(args) -> int:
    """Load the model, start the batching engine, serve until interrupted."""
    from bridge.chat import find_template
    from bridge.tokenizer import find_tokenizer
    from jax_llama.checkpoint import load
    from jax_llama.serving import Engine

    from .serve import Server, app

    try:
        import uvicorn
    except ImportError:
        raise BridgeError("needs the [serve] extra: pip install 'jax-llama[serve]'",
                          field="serve") from None
    if not 0 < args.port < 65536:
        raise BridgeError(f"must be in 1..65535 (got {args.port})", field="port")
    tokenizer = find_tokenizer(args.checkpoint, args.tokenizer)
    template = find_template(args.checkpoint, tokenizer, args.chat_template)
    model, params = load_quantized(args, lambda: load(
        args.checkpoint, dtype=args.dtype, attention=args.attention, adapter=args.adapter,
        kernels=args.kernels), say=False)
    engine = Engine(model, params, max_batch=args.max_batch, max_len=args.max_context)
    name = args.model_name or Path(args.checkpoint.rstrip("/")).name
    server = Server(engine, model, params, tokenizer, template, name, args.api_key)
    _say_kernels(args)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (batches of up to "
          f"{args.max_batch}, context {engine.max_len}{', API key required' if args.api_key else ''})",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(app(server), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return EXIT_OK


def load_quantized(args, load: Callable[[], tuple], say: bool = True) -> tuple:
    """load() -> (model, params), quantised to int8 when --quantize asks for it; --kernels said
    as _kernels says it."""
    from jax_llama.quantize import quantize

    quantization = requested_quantization(args)  # refused here, before any weight is read
    model, params = _kernels(args, load, say)
    if quantization is None:
        return model, params
    return model, quantize(params, quantization.group_size, quantization.method)


def _read_task(args, path: str, require_labels: bool = True):
    from bridge.classification import read_examples

    dataset = read_examples(path, len(args.label_words), require_labels=require_labels,
                            skip_malformed=args.skip_malformed)
    if dataset.skipped:
        print(f"warning: {path}: skipped {len(dataset.skipped)} malformed line(s), first at line "
              f"{dataset.skipped[0]}", file=sys.stderr)
    return dataset


def _cut_note(name: str, cut: int, total: int, max_len: int) -> None:
    if cut:
        print(f"{name}: {cut} of {total} texts longer than {max_len} tokens were truncated from the "
              f"left", file=sys.stderr)


def _report_predictions(args, dataset, predictions, what: str) -> float | None:
    """Write predictions to --out (or stdout, one a line) and report accuracy when labeled."""
    from bridge.classification import accuracy, write_predictions

    score = accuracy(predictions, dataset.labels) if dataset.labeled else None
    line = (f"{what} accuracy {score:.4f} ({int(round(score * len(predictions)))}/{len(predictions)}) "
            f"on {dataset.path}" if score is not None else None)
    if args.out:
        write_predictions(args.out, predictions)
        if line:
            print(line)
        print(f"predictions: {args.out}")
    else:
        sys.stdout.write("".join(f"{int(p)}\n" for p in predictions))
        if line:
            print(line, file=sys.stderr)
    return score


def cmd_finetune(args) -> int:
    import jax

    from bridge.classification import read_labels, resolve_train_layers
    from bridge.tokenizer import find_tokenizer, load_tokenizer, train_tokenizer
    from jax_llama.checkpoint import load
    from jax_llama.classify import FinetuneConfig, RunControl, finetune, new_classifier, recipe
    from jax_llama.run_state import RunStopped
    from jax_llama.train import TrainingDiverged

    # the recipe: from scratch, or a pretrained backbone's (jax_llama.classify), flags over it
    chosen = recipe(bool(args.init), args.lora_rank is not None, epochs=args.epochs,
                    batch_size=args.batch_size, lr=args.lr, dropout=args.dropout,
                    train_layers=_train_layers(args.train_layers))
    train_layers = chosen.pop("train_layers")  # resolved once the backbone's depth is known
    fc = FinetuneConfig(**chosen, warmup=args.warmup, weight_decay=args.weight_decay,
                        grad_clip=args.grad_clip, grad_accum=args.grad_accum,
                        max_len=args.max_len, seed=args.seed,
                        frozen_cache=not args.no_frozen_cache)
    tracking = _tracking(args)
    tracking.check()  # before anything is read or trained
    out = Path(args.out)
    check_out_apart(out, [args.train, args.dev, args.labels])
    if out.exists() and any(out.iterdir()) and not args.resume:
        raise BridgeError(f"{out} is not empty", field="out",
                          hint=("resume", True, "pass {} to continue that run"))
    control = RunControl(resume=args.resume, on_nan=args.on_nan, max_skipped=args.max_skipped)
    if args.init and args.preset:
        raise BridgeError("not with --init (the backbone's config comes from the checkpoint)",
                          field="preset")
    args.label_words = labels = read_labels(args.labels)
    train, dev = _read_task(args, args.train), _read_task(args, args.dev)
    if not (train.labeled and dev.labeled):
        raise BridgeError("--train / --dev: need labels on every line")
    lm_params = None
    if args.init:
        model_lm, lm_params = load(args.init, dtype="float32", attention=args.attention)
        config = model_lm.config
        tokenizer = find_tokenizer(args.init, args.tokenizer)
        if tokenizer.vocab_size > config.vocab_size:
            raise BridgeError(f"{tokenizer.vocab_size} ids do not fit the vocabulary "
                              f"of {args.init} ({config.vocab_size})", field="tokenizer")
    else:
        base = preset(args.preset or "tiny")
        if args.tokenizer:
            tokenizer = load_tokenizer(args.tokenizer)
        else:
            print(f"training a {args.vocab_size}-token byte-level BPE on {train.path}", file=sys.stderr)
            tokenizer = train_tokenizer(train.texts, args.vocab_size)
        config = base.replace(
            vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id,
            eos_ids=() if tokenizer.eos_id is None else (tokenizer.eos_id,),
            max_seq_len=max(base.max_seq_len, fc.max_len))
    max_len = min(fc.max_len, config.max_seq_len)
    fc = dataclasses.replace(fc, train_layers=resolve_train_layers(train_layers, config.n_layers))
    lora = _lora_config(args)
    clf = new_classifier(config, labels, tokenizer, max_len, fc.dropout, fc.seed, lm_params,
                         attention=args.attention, lora=lora)
    if args.init:
        from bridge.chat import own_template
        clf.chat_template = own_template(args.init)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(clf.params))
    what = f"{n_params / 1e6:.1f}M parameters"
    if lora is not None:
        from jax_llama.lora import count, trainable_for
        what = (f"LoRA rank {lora.rank} on {', '.join(lora.targets)}"
                f"{', the embedding table' if lora.train_embeddings else ''} and the head: "
                f"{count(clf.params, trainable_for(lora)(clf.params)):,} of {n_params:,} parameters")
    if fc.train_layers is not None:
        what += f", the top {fc.train_layers} of {config.n_layers} blocks training"
    print(f"fine-tuning {what} ({'from ' + args.init if args.init else 'from scratch'}) "
          f"on {len(train.examples)} examples, {len(dev.examples)} dev, {len(labels)} labels; "
          f"{fc.epochs} epochs, batch {fc.batch_size}, lr {fc.lr:g}, dropout {fc.dropout:g}",
          file=sys.stderr)
    started, cpu = time.time(), time.process_time()
    try:
        summary = finetune(clf, train, dev, fc, out, on_epoch=lambda r: print(
            f"epoch {r['epoch']}: train loss {r['train_loss']:.4f}, dev accuracy {r['dev_accuracy']:.4f} "
            f"({r['seconds']:.0f} s)", file=sys.stderr), tracking=tracking, control=control)
    except TrainingDiverged as e:
        print(f"error: {e}; lower --lr", file=sys.stderr)
        return EXIT_CHECK_FAILED
    except RunStopped as e:
        print(f"{e}; resume with the same command and --resume", file=sys.stderr)
        return EXIT_OK
    best = summary["best"]
    print(f"best dev accuracy {best['dev_accuracy']:.4f} (epoch {best['epoch']} of {fc.epochs}); "
          f"{time.time() - started:.0f} s wall, {time.process_time() - cpu:.0f} s CPU")
    print(f"classifier: {summary['classifier']}  (jax-llama predict {out} --data FILE)")
    print(f"dev predictions: {out / 'dev_predictions.txt'}")
    return EXIT_OK


def cmd_predict(args) -> int:
    from jax_llama.classify import load_classifier, predict

    clf = _kernels(args, lambda: load_classifier(
        args.classifier if not (Path(args.classifier) / "best").is_dir()
        else Path(args.classifier) / "best", attention=args.attention, kernels=args.kernels),
        say=False)
    args.label_words = clf.labels
    dataset = _read_task(args, args.data, require_labels=False)
    _say_kernels(args)
    predictions, _, cut = predict(clf, dataset.texts, args.batch_size, progress=True)
    _cut_note(args.data, cut, len(dataset.examples), clf.max_len)
    _report_predictions(args, dataset, predictions, "classifier")
    return EXIT_OK


def cmd_zero_shot(args) -> int:
    import numpy as np

    from bridge.classification import read_labels
    from bridge.tokenizer import find_tokenizer
    from jax_llama.checkpoint import load
    from bridge.chat import find_template
    from jax_llama.classify import fill_template, zero_shot

    if args.template is None:
        args.template = DEFAULT_TEMPLATE if args.chat is None else DEFAULT_CHAT_QUESTION
    fill_template(args.template, "")  # refuse a template without {text} before loading
    tokenizer = find_tokenizer(args.checkpoint, args.tokenizer)
    chat = (None if args.chat is None else
            find_template(args.checkpoint, tokenizer, None if args.chat == "own" else args.chat))
    args.label_words = labels = read_labels(args.labels)
    dataset = _read_task(args, args.data, require_labels=False)
    model, params = _kernels(args, lambda: load(args.checkpoint, dtype="float32",
                                                attention=args.attention, kernels=args.kernels))
    started = time.time()
    predictions, scores, cut = zero_shot(model, params, tokenizer, dataset.texts, labels,
                                         args.template, args.max_len, args.batch_size, progress=True,
                                         calibrate=args.calibrate, chat=chat)
    _cut_note(args.data, cut, len(dataset.examples), args.max_len or model.config.max_seq_len)
    counts = np.bincount(predictions, minlength=len(labels))
    print("predicted: " + ", ".join(f"{w} {c}" for w, c in zip(labels, counts)) +
          f" ({time.time() - started:.0f} s)", file=sys.stderr)
    _report_predictions(args, dataset, predictions, "zero-shot")
    return EXIT_OK


def cmd_split(args) -> int:
    import numpy as np

    from bridge.atomic import write_text

    src = Path(args.file)
    try:
        lines = [l for l in src.read_text(encoding="utf-8").splitlines() if l.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise BridgeError(f"{src}: cannot read ({e})") from None
    if not 0 < args.fraction < 1:
        raise BridgeError(f"must be in (0, 1) (got {args.fraction})", field="fraction")
    n_held = int(round(args.fraction * len(lines)))
    if n_held == 0 or n_held == len(lines):
        raise BridgeError(f"{src}: {len(lines)} lines cannot be split {args.fraction:g} / "
                          f"{1 - args.fraction:g}")
    order = np.random.default_rng(args.seed).permutation(len(lines))
    held, kept = sorted(order[:n_held]), sorted(order[n_held:])
    out = Path(args.out)
    for name, idx in (("train.txt", kept), ("heldout.txt", held)):
        write_text(out / name, "".join(lines[i] + "\n" for i in idx), overwrite=args.force)
    print(f"{out / 'train.txt'}: {len(kept)} lines; {out / 'heldout.txt'}: {len(held)} lines "
          f"(seed {args.seed})")
    return EXIT_OK


def cmd_eval(args) -> int:
    from jax_llama.checkpoint import load
    from jax_llama.eval import evaluate

    def load_model():
        return load_quantized(args, lambda: load(args.checkpoint, dtype=args.dtype,
                                                 attention=args.attention,
                                                 kernels=args.kernels))

    return run_eval(args, load_model, lambda loaded, documents, **kw: evaluate(*loaded, documents,
                                                                               **kw))


def cmd_bench(args) -> int:
    from .bench import suite

    return suite.run_command(args)


def _train_layers(text: str | None) -> int | str | None:
    """--train-layers: a positive count of blocks, or 'all' (None: not given)."""
    if text is None or text == "all":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise BridgeError(f"expected a positive number of blocks or 'all', got {text!r}",
                          field="train_layers")
    return value


def _lora_config(args, saved: dict | None = None):
    """The LoraConfig the --lora-* flags ask for (a resumed run: its own unless flags say
    otherwise, which the resume check then refuses), or None without --lora-rank."""
    from bridge.lora import LoraConfig

    if args.lora_rank is None:
        given = [f"lora_{k}" for k in ("alpha", "dropout", "targets", "train_embeddings")
                 if getattr(args, f"lora_{k}") not in (None, False)]
        if given:
            raise BridgeError("needs --lora-rank", field=given[0])
        return None if not saved else LoraConfig.from_dict(saved)
    return LoraConfig(rank=args.lora_rank,
                      alpha=2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha,
                      dropout=args.lora_dropout or 0.0,
                      targets=args.lora_targets or LoraConfig().targets,
                      train_embeddings=args.lora_train_embeddings)


def _tracking(args, saved: dict | None = None):
    """The TrackingSpec of --log-to / --wandb-project (a resumed run: its own unless --log-to is
    given). W&B logs offline unless WANDB_MODE=online."""
    from jax_llama.tracking import WANDB_MODES, TrackingSpec

    saved = saved or {}
    log_to = ([s.strip() for flag in args.log_to for s in flag.split(",") if s.strip()]
              if args.log_to else saved.get("log_to", []))
    mode = os.environ.get("WANDB_MODE") or "offline"
    mode = {"dryrun": "offline"}.get(mode, mode)  # wandb's old name for offline
    if "wandb" in log_to and mode not in WANDB_MODES:
        raise BridgeError(f"WANDB_MODE={mode!r}: expected one of {', '.join(WANDB_MODES)}")
    return TrackingSpec(log_to=tuple(log_to),
                        project=args.wandb_project or saved.get("project", "jax-llama"),
                        wandb_mode=mode if mode in WANDB_MODES else "offline")


def _add_tracking_arguments(p) -> None:
    # Checked by the library (jax_llama.tracking.TrackingSpec), whose errors name log_to.
    p.add_argument("--log-to", action="append", metavar="tensorboard,wandb",
                   help="also log the run's scalars and config to TensorBoard (RUN/tensorboard/) "
                        "and / or Weights & Biases (RUN/wandb/; offline unless WANDB_MODE=online); "
                        "repeatable or comma-separated; needs pip install 'jax-llama[tracking]'")
    p.add_argument("--wandb-project", help="the W&B project (default jax-llama); the run's name "
                                           "is the run directory's")


def _add_lora_arguments(p) -> None:
    # Checked by the library (bridge.lora.LoraConfig), whose errors name these fields.
    p.add_argument("--lora-rank", type=int,
                   help="train LoRA adapters of this rank only; the base stays frozen (held in "
                        "--dtype). The run writes adapter/ (PEFT format) and the merged model/")
    p.add_argument("--lora-alpha", type=float, help="LoRA scale alpha / rank (default alpha = 2 x rank)")
    p.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input (default 0)")
    p.add_argument("--lora-targets",
                   help="comma-separated projections to adapt (default: wq,wk,wv,wo,w1,w2,w3)")
    p.add_argument("--lora-train-embeddings", action="store_true",
                   help="train the embedding table too, whole, in float32 (PEFT's "
                        "modules_to_save=['embed_tokens']; a tied LM head trains with it)")


def _add_run_arguments(p, corpus: str, defaults: dict[str, str] | None = None) -> None:
    """The options `train`, `sft` and `dpo` share: the model, the run directory, the mesh, LoRA,
    attention and the TrainConfig fields (defaults: field -> where this command's default differs
    from TrainConfig's, as the help says it, with {} for TrainConfig's)."""
    defaults = defaults or {}
    p.add_argument("--preset", default="tiny", help="model config (default tiny)")
    p.add_argument("--tokenizer", help="tokenizer.model / tokenizer.json (default: --init's, or a "
                                       f"byte-level BPE trained on {corpus})")
    p.add_argument("--vocab-size", type=int, default=4096, help="of that BPE (default 4096)")
    p.add_argument("--init", help="start from the weights of any checkpoint the bridge reads")
    p.add_argument("--out", help="run directory (default runs/COMMAND-<time>)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out exactly, with its saved settings (the options "
                        "below keep the run's values; one given that differs is refused)")
    p.add_argument("--mesh", help="device mesh, e.g. data=2,fsdp=4,tensor=1 (default: all on data)")
    p.add_argument("--scan-layers", action="store_true", help="nn.scan over blocks (faster compiles)")
    p.add_argument("--remat", action="store_true", help="recompute activations in the backward pass")
    p.add_argument("--multi-host", action="store_true",
                   help="one of several processes: call jax.distributed.initialize() first")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="with --multi-host: process 0's address (default: found by JAX on TPU "
                        "pods and SLURM)")
    p.add_argument("--num-processes", type=int, help="with --multi-host: how many processes")
    p.add_argument("--process-id", type=int, help="with --multi-host: this process's index")
    p.add_argument("--connect-timeout", type=int, default=300,
                   help="with --multi-host: seconds to wait for the other processes (default 300)")
    _add_lora_arguments(p)
    _add_tracking_arguments(p)
    _add_attention_argument(p)
    _add_nonfinite_arguments(p)
    for name, kind, default, text in TRAIN_OPTIONS:
        shown = f"{default:g}" if kind is float and default is not None else str(default)
        if name in defaults or default is not None:
            text += f" (default {defaults.get(name, '{}').format(shown)})"
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                       choices=DTYPE_NAMES if name == "dtype" else None,
                       help=text)


def _add_nonfinite_arguments(p) -> None:
    # Checked by the library (jax_llama.run_state.NonFinite), whose errors name these fields.
    p.add_argument("--on-nan", default="stop",
                   help="a step whose loss or gradients are not finite: stop (the last good "
                        "checkpoint kept) or skip (its update dropped, counted) (default stop)")
    p.add_argument("--max-skipped", type=int, default=10,
                   help="with --on-nan skip: stop once this many updates were skipped "
                        "(default 10)")


def _add_attention_argument(p) -> None:
    # Checked by the library (jax_llama.attention.choose), which also knows what the backend has.
    p.add_argument("--attention", default="auto",
                   help="attention implementation: xla (scores materialised), chunked (flash-style, "
                        "memory linear in the sequence), cudnn (NVIDIA GPUs), splash (TPUs), auto "
                        "(default: xla for short sequences, chunked - or splash on a TPU - for "
                        "long ones)")


def _add_kernels_argument(p) -> None:
    # Checked by the library (jax_llama.projections.implementation), whose errors name kernels.
    p.add_argument("--kernels", default="auto",
                   help="how projections and attention over the KV cache run: kernels (the CPU "
                        "decode kernels, jax_llama/kernels/matvec.cc, built on first use: up to 8 "
                        "float32 rows, float32 or int8 weights), xla (XLA's matmuls only), auto "
                        "(default: kernels where they can run, else xla; JAX_LLAMA_KERNELS=0 "
                        "makes it xla)")


def _kernels(args, load: Callable[[], tuple], say: bool = True):
    """load() (of a model with `kernels=args.kernels`), --kernels checked first - where the
    kernels are compiled, the first time on this machine, which the library's log says on
    stderr - and once it is loaded, what its decode steps run on said on stderr (later, by
    _say_kernels, with say=False: a command that still checks its input first)."""
    import logging

    from jax_llama import kernels
    from jax_llama.projections import implementation

    log = logging.getLogger("jax_llama.kernels")
    handler, level = logging.StreamHandler(sys.stderr), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        which = implementation(args.kernels)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    loaded = load()
    why = ("" if which == "kernels" or args.kernels == "xla"
           else f": {kernels.unavailable_reason()}")
    args.kernels_note = f"projections and cached attention: {which} (--kernels {args.kernels}{why})"
    if say:
        _say_kernels(args)
    return loaded


def _say_kernels(args) -> None:
    print(args.kernels_note, file=sys.stderr, flush=True)


def _add_task_arguments(p, labels: bool = True) -> None:
    if labels:
        p.add_argument("--labels", required=True, help="labels.json: the label words, in index order")
    p.add_argument("--skip-malformed", action="store_true",
                   help="skip malformed lines (counted) instead of stopping at the first")
    p.add_argument("--batch-size", type=int, default=64, help="rows per batch (default 64)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jax-llama", description="LLaMA in JAX: train, generate, "
                                     "fine-tune, benchmark.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = add_command(sub, "train", cmd_train,
                    help="train (or fine-tune from --init) a LLaMA with optax AdamW; with no "
                         "--data, on the Python standard library's sources")
    p.add_argument("--data", nargs="+", help="text files or directories (default: the embedded corpus)")
    _add_run_arguments(p, "the corpus")
    p.add_argument("--sample-tokens", type=int, default=64,
                   help="length of the sample printed at the end (default 64)")
    p.add_argument("--strip-labels", action="store_true",
                   help="the data files are LABEL ||| TEXT lines (the classification format): "
                        "train on the texts only, e.g. continued pretraining on a task's text")
    p.add_argument("--pack", action="store_true",
                   help="rows of whole documents (split only when longer than a row), each its "
                        "own segment: no attention and no loss across documents")

    p = add_command(sub, "sft", cmd_sft,
                    help="supervised fine-tuning on conversations: the chat template, loss on the "
                         "assistant's tokens only, packed rows; with no --data, a synthetic "
                         "instruction task scored by exact match before and after")
    p.add_argument("--data", help="JSON lines: {\"messages\": [{\"role\", \"content\"}, ...]} or "
                                  "{\"prompt\", \"completion\"} (default: the demo task)")
    p.add_argument("--eval-data", help="held-out conversations, same format (default: 5%% of --data)")
    p.add_argument("--chat-template", help="llama3, llama2 or a jinja file (default: --init's own "
                                           "chat template, else the one its tokenizer implies)")
    p.add_argument("--no-pack", action="store_true",
                   help="one conversation a row, padded (default: packed, each its own segment)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="count and skip conversations that cannot train (no assistant span found, "
                        "or none left after truncation) instead of refusing them")
    p.add_argument("--show-mask", type=int, metavar="N",
                   help="print the first N rendered conversations with the trained tokens marked, "
                        "and exit")
    p.add_argument("--demo-examples", type=int, help="conversations of the demo task (default 6000)")
    p.add_argument("--replay", type=int, default=0, metavar="N",
                   help="with --init: train beside the data on the starting model's own greedy "
                        "answers to N general requests (at most 300), so that it keeps answering "
                        "other requests as it did (default 0: none)")
    _add_run_arguments(p, "the conversations",
                       {"steps": "{}; " f"{DEMO_STEPS} for the demo task, without --data"})

    p = add_command(sub, "dpo", cmd_dpo,
                    help="preference tuning (DPO, IPO, hinge) on {prompt, chosen, rejected} pairs "
                         "against the frozen starting model; with no --data, a demo task scored "
                         "by held-out pair accuracy before and after")
    p.add_argument("--data", help="JSON lines: {\"prompt\", \"chosen\", \"rejected\"}, as "
                                  "strings or as message lists (TRL's formats; default: the demo)")
    p.add_argument("--eval-data", help="held-out pairs, same format (default: 10%% of --data)")
    p.add_argument("--chat-template", help="for conversational pairs: llama3, llama2 or a jinja "
                                           "file (default: --init's own chat template)")
    p.add_argument("--beta", type=float, default=0.1,
                   help="how far the policy may move from the reference (default 0.1)")
    p.add_argument("--loss", default="sigmoid", choices=("sigmoid", "robust", "hinge", "ipo"),
                   help="sigmoid (DPO), robust, hinge (SLiC) or ipo, as TRL computes them "
                        "(default sigmoid)")
    p.add_argument("--label-smoothing", type=float, default=0.0,
                   help="with sigmoid or robust: the assumed fraction of flipped labels "
                        "(default 0)")
    p.add_argument("--precompute-ref", action="store_true",
                   help="without LoRA: compute the reference log-probs of every pair before "
                        "training and free the reference's copy of the weights (default: per "
                        "batch)")
    p.add_argument("--demo-pairs", type=int, help="pairs of the demo task (default 4000)")
    _add_run_arguments(p, "the pairs", {
        "steps": "{}; " f"{DPO_DEMO_STEPS} for the demo task, without --data",
        "lr": f"{DPO_LR['scratch']:g} from scratch, {DPO_LR['full']:g} from --init, "
              f"{DPO_LR['lora']:g} with --lora-rank"})

    p = add_command(sub, "generate", cmd_generate,
                    help="continue prompts with a KV cache (greedy, temperature, top-k, top-p); "
                         "text streams as it is produced")
    add_generate_arguments(p)
    _add_attention_argument(p)
    _add_kernels_argument(p)
    p.add_argument("--compare-torch", action="store_true",
                   help="decode greedily with both twins and report where they first differ")
    p = add_command(sub, "serve", cmd_serve,
                    help="an OpenAI-compatible HTTP server (/v1/chat/completions, "
                         "/v1/completions, /v1/models, /health); requests arriving together "
                         "are decoded together")
    p.add_argument("checkpoint", metavar="CKPT", help="any checkpoint the bridge reads")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to bind (default 127.0.0.1: this machine only; anything "
                        "else exposes the model to the network)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--max-batch", type=int, default=8,
                   help="rows decoded together (default 8); more requests wait for a free row")
    p.add_argument("--max-context", type=int,
                   help="tokens a request may hold, prompt and reply (default: the model's "
                        "max_seq_len)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint")
    p.add_argument("--model-name", help="the name clients ask for (default: the checkpoint's "
                                        "file or directory name)")
    p.add_argument("--tokenizer", help="tokenizer file (default: the checkpoint's)")
    p.add_argument("--chat-template", help="llama3, llama2 or a jinja file (default: the "
                                           "checkpoint's own)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="weights and compute (default: as stored)")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter (PEFT format) merged into "
                                                    "the weights as they load")
    add_quantize_arguments(p)
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning",
                                                               "info", "debug"),
                   help="uvicorn's (default warning)")
    _add_attention_argument(p)
    _add_kernels_argument(p)

    p = add_command(sub, "finetune", cmd_finetune,
                    help="fine-tune a LLaMA as a sequence classifier, end to end (head on the "
                         "last real token)")
    p.add_argument("--train", required=True, help="LABEL ||| TEXT lines")
    p.add_argument("--dev", required=True, help="LABEL ||| TEXT lines, measured after each epoch")
    p.add_argument("--labels", required=True, help="labels.json: the label words, in index order")
    p.add_argument("--init", help="backbone: any checkpoint the bridge reads (default: from scratch)")
    p.add_argument("--tokenizer", help="tokenizer file (default: --init's, or a BPE trained on --train)")
    p.add_argument("--preset", help="from scratch: the backbone's config (default tiny)")
    p.add_argument("--vocab-size", type=int, default=8192, help="of the BPE trained from scratch "
                                                                          "(default 8192)")
    p.add_argument("--out", required=True, help="run directory: best/, metrics.jsonl, dev_predictions.txt")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest checkpoint that restores (the "
                        "same command otherwise)")
    _add_nonfinite_arguments(p)
    p.add_argument("--epochs", type=int,
                   help=f"default {FROM_SCRATCH['epochs']}, from --init {PRETRAINED['epochs']} "
                        f"({PRETRAINED_LORA['epochs']} with LoRA)")
    p.add_argument("--lr", type=float,
                   help=f"peak learning rate (default {FROM_SCRATCH['lr']:g}; from --init "
                        f"{PRETRAINED['lr']:g}, with LoRA {PRETRAINED_LORA['lr']:g})")
    p.add_argument("--batch-size", type=int,
                   help=f"default {FROM_SCRATCH['batch_size']}, from --init "
                        f"{PRETRAINED['batch_size']}")
    p.add_argument("--train-layers", metavar="N|all",
                   help="train the top N blocks (with the final norm and the head; the rest, "
                        "and the embedding table, stay frozen) or all (default all; from --init "
                        "the top half, with LoRA the top third)")
    p.add_argument("--no-frozen-cache", action="store_true",
                   help="with --train-layers: run the frozen blocks at every step (by default "
                        "their output is computed once for every text, when it fits in a "
                        "quarter of the memory available)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per update (default 1)")
    p.add_argument("--warmup", type=float, default=0.1,
                   help="fraction of updates warming up (default 0.1)")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW's weight decay (default 0.1)")
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the global gradient norm to this (default 1.0)")
    p.add_argument("--dropout", type=float,
                   help=f"before the head (default {FROM_SCRATCH['dropout']}, from --init "
                        f"{PRETRAINED['dropout']})")
    p.add_argument("--max-len", type=int, default=512, help="tokens per text; longer texts lose "
                                                            "their beginning (default 512)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the head's initial weights, the data order and dropout "
                        "(default 0)")
    _add_lora_arguments(p)
    _add_tracking_arguments(p)
    p.add_argument("--skip-malformed", action="store_true",
                   help="skip malformed lines (counted) instead of stopping at the first")
    _add_attention_argument(p)

    p = add_command(sub, "zero-shot", cmd_zero_shot,
                    help="classify by prompting: the log-likelihood of each label word after a "
                         "template around the text")
    p.add_argument("checkpoint", help="a language model, any format the bridge reads")
    p.add_argument("--data", required=True, help="LABEL ||| TEXT lines (or TEXT lines)")
    p.add_argument("--template",
                   help=f"prompt around the text, with {{text}} and optionally {{labels}} (the "
                        f"label words, 'a, b or c'); default {DEFAULT_TEMPLATE!r}, with --chat "
                        f"{DEFAULT_CHAT_QUESTION!r}")
    p.add_argument("--chat", nargs="?", const="own", metavar="TEMPLATE",
                   help="ask through a chat template: the filled template is the user's turn and "
                        "the label word begins the reply; the checkpoint's own template, or "
                        "llama3 / llama2 / a jinja file")
    p.add_argument("--tokenizer", help="tokenizer file (default: the checkpoint's)")
    p.add_argument("--max-len", type=int, help="tokens per row; prompts lose their beginning")
    p.add_argument("--calibrate", action="store_true",
                   help="subtract each label's score after the template around an empty text "
                        "(the model's prior for the word there)")
    p.add_argument("--out", help="write predictions here (default: stdout, accuracy on stderr)")
    _add_task_arguments(p)
    _add_attention_argument(p)
    _add_kernels_argument(p)

    p = add_command(sub, "predict", cmd_predict,
                    help="a fine-tuned classifier's predictions, and accuracy when the file has "
                         "labels")
    p.add_argument("classifier", help="a finetune --out directory (or its best/)")
    p.add_argument("--data", required=True, help="LABEL ||| TEXT lines (or TEXT lines)")
    p.add_argument("--out", help="write predictions here (default: stdout, accuracy on stderr)")
    _add_task_arguments(p, labels=False)
    _add_attention_argument(p)
    _add_kernels_argument(p)

    p = add_command(sub, "eval", cmd_eval,
                    help="sliding-window perplexity, NLL per token and bits per byte of text "
                         "files, per file and overall")
    add_eval_arguments(p)
    _add_attention_argument(p)
    _add_kernels_argument(p)

    p = add_command(sub, "split", cmd_split,
                    help="hold out a random fraction of a data file's lines")
    p.add_argument("file", help="a data file, one example a line")
    p.add_argument("--fraction", type=float, default=0.15, help="held out (default 0.15)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random choice (default 0)")
    p.add_argument("--out", required=True, help="directory for train.txt and heldout.txt")
    p.add_argument("--force", action="store_true", help="replace existing files")

    p = add_command(sub, "bench", cmd_bench,
                    help="benchmarks side by side with transformers on the same config: forward, "
                         "train step, decode, conversion, compile time",
                    description="Measure this machine's matmul peak and read bandwidth, then "
                    "forward (prefill) and train-step tokens/s with MFU, decode tokens/s at batch "
                    "1 and 8, conversion throughput and peak RSS against cp -r, and compile time "
                    "against depth, for jax-llama, the torch twin and transformers on the same "
                    "config, each in its own worker process. The table goes to stdout and to "
                    "OUT/bench.md (OUT: the current directory unless --out), every figure to "
                    "OUT/bench.json, progress to stderr.")
    p.add_argument("--preset", help="model config (default: dim 512, 8 layers, 56M parameters; "
                                    "with --quick, tiny)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="params and compute of forward and decode; train computes in it with "
                        "float32 params (default float32)")
    p.add_argument("--only", help="comma-separated subset of forward,train,decode,convert,compile "
                                  "(default: all of those), long, lora (a LoRA train step of "
                                  "llama3.2-1b: peak RSS against full fine-tuning; minutes)")
    p.add_argument("--repeats", type=int, help="timed runs per worker process and round "
                                               "(default 3; --quick 2)")
    p.add_argument("--rounds", type=int, help="rounds of one worker process per implementation, "
                                              "in alternating order (default 2; --quick 1)")
    p.add_argument("--batch", type=int, help="rows of a forward pass and a train step (default 8; "
                                             "--quick 2)")
    p.add_argument("--seq-len", type=int, help="tokens per row (default 256; --quick 32)")
    p.add_argument("--convert-preset", help="model of the conversion benchmark (default "
                                            "llama3.2-1b; with --quick, the --preset)")
    p.add_argument("--out", default=".",
                   help="directory for bench.md and bench.json (default: the current directory)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, short runs, smaller depths: a smoke run in well under a minute")
    return parser


_main = command_main(build_parser)
# Commands that measure compilation themselves (their workers are fresh processes anyway).
_UNCACHED = ("bench",)


def main(argv: list[str] | None = None) -> int:
    """`jax-llama`: every command but bench with JAX's persistent compilation cache on
    (jax_llama.perf.use_compile_cache: JAX_LLAMA_COMPILE_CACHE=off turns it off)."""
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] not in _UNCACHED and not words[0].startswith("-"):
        from jax_llama.perf import use_compile_cache
        use_compile_cache()
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
