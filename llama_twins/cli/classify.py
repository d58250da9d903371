"""`jax-llama finetune`, `zero-shot`, `predict` and `split`: a LLaMA as a sequence classifier,
fine-tuned or prompted, over LABEL ||| TEXT task files."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from tasks.classification import (DEFAULT_CHAT_QUESTION, DEFAULT_TEMPLATE, FROM_SCRATCH,
                                   PRETRAINED, PRETRAINED_LORA)
from bridge.config import preset
from bridge.data_dirs import check_out_apart
from bridge.errors import BridgeError

from .common import EXIT_CHECK_FAILED, EXIT_OK, add_command, add_progress_argument
from .options import (add_attention_argument, add_lora_arguments,
                      add_nonfinite_arguments, add_tracking_arguments, lora_config, say_kernels,
                      tracking_spec, with_kernels)


def _read_task(args, path: str, require_labels: bool = True):
    from tasks.classification import read_examples

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
    from tasks.classification import accuracy, write_predictions

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

    from tasks.classification import read_labels, resolve_train_layers
    from bridge.tokenizer import find_tokenizer, load_tokenizer, train_tokenizer
    from jax_llama.checkpoint import load
    from jax_llama.classify import new_classifier
    from jax_llama.training.finetune import FinetuneConfig, RunControl, finetune, recipe
    from jax_llama.training.state import RunStopped
    from jax_llama.training.step import TrainingDiverged

    # the recipe: from scratch, or a pretrained backbone's (jax_llama.training.finetune), flags over it
    chosen = recipe(bool(args.init), args.lora_rank is not None, epochs=args.epochs,
                    batch_size=args.batch_size, lr=args.lr, dropout=args.dropout,
                    train_layers=_train_layers(args.train_layers))
    train_layers = chosen.pop("train_layers")  # resolved once the backbone's depth is known
    fc = FinetuneConfig(**chosen, warmup=args.warmup, weight_decay=args.weight_decay,
                        grad_clip=args.grad_clip, grad_accum=args.grad_accum,
                        max_len=args.max_len, seed=args.seed,
                        frozen_cache=not args.no_frozen_cache)
    tracking = tracking_spec(args)
    tracking.check()  # before anything is read or trained
    out = Path(args.out)
    check_out_apart(out, [args.train, args.dev, args.labels])
    if out.exists() and any(out.iterdir()) and not args.resume:
        raise BridgeError(f"{out} is not empty", field="out",
                          hint=("resume", True, "pass {} to continue that run"))
    control = RunControl(resume=args.resume, on_nan=args.on_nan, max_skipped=args.max_skipped,
                         progress=args.progress)
    if args.init and args.preset:
        raise BridgeError("not with --init (the backbone's config comes from the checkpoint)",
                          field="preset")
    args.label_words = labels = read_labels(args.labels)
    train, dev = _read_task(args, args.train), _read_task(args, args.dev)
    if not (train.labeled and dev.labeled):
        raise BridgeError("--train / --dev: need labels on every line")
    lm_params = None
    if args.init:
        from bridge.formats import open_checkpoint
        checkpoint = open_checkpoint(args.init)  # opened once: weights, tokenizer, chat template
        model_lm, lm_params = load(checkpoint, dtype="float32", attention=args.attention)
        config = model_lm.config
        tokenizer = find_tokenizer(checkpoint, args.tokenizer)
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
    lora = lora_config(args)
    clf = new_classifier(config, labels, tokenizer, max_len, fc.dropout, fc.seed, lm_params,
                         attention=args.attention, lora=lora)
    if args.init:
        from bridge.chat import own_template
        clf.chat_template = own_template(checkpoint)
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
            f"epoch {r['epoch']}: train loss {r['train_loss']:.4f}, dev loss {r['val_loss']:.4f}, "
            f"dev accuracy {r['dev_accuracy']:.4f} "
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
    from jax_llama.training.finetune import classifier_dir

    clf = with_kernels(args, lambda: load_classifier(
        classifier_dir(Path(args.classifier)), attention=args.attention, kernels=args.kernels),
        say=False)
    args.label_words = clf.labels
    dataset = _read_task(args, args.data, require_labels=False)
    say_kernels(args)
    predictions, _, cut = predict(clf, dataset.texts, args.batch_size, progress=args.progress)
    _cut_note(args.data, cut, len(dataset.examples), clf.max_len)
    _report_predictions(args, dataset, predictions, "classifier")
    return EXIT_OK


def cmd_zero_shot(args) -> int:
    import numpy as np

    from bridge.chat import find_template
    from tasks.classification import read_labels
    from bridge.formats import open_checkpoint
    from bridge.tokenizer import find_tokenizer
    from jax_llama.checkpoint import load
    from jax_llama.classify import fill_template, zero_shot

    if args.template is None:
        args.template = DEFAULT_TEMPLATE if args.chat is None else DEFAULT_CHAT_QUESTION
    fill_template(args.template, "")  # refuse a template without {text} before loading
    checkpoint = open_checkpoint(args.checkpoint)  # opened once: tokenizer, template, weights
    tokenizer = find_tokenizer(checkpoint, args.tokenizer)
    chat = (None if args.chat is None else
            find_template(checkpoint, tokenizer, None if args.chat == "own" else args.chat))
    args.label_words = labels = read_labels(args.labels)
    dataset = _read_task(args, args.data, require_labels=False)
    model, params = with_kernels(args, lambda: load(checkpoint, dtype="float32",
                                                    attention=args.attention, kernels=args.kernels))
    started = time.time()
    predictions, scores, cut = zero_shot(model, params, tokenizer, dataset.texts, labels,
                                         args.template, args.max_len, args.batch_size,
                                         progress=args.progress,
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


def _add_task_arguments(p, labels: bool = True) -> None:
    if labels:
        p.add_argument("--labels", required=True, help="labels.json: the label words, in index order")
    p.add_argument("--skip-malformed", action="store_true",
                   help="skip malformed lines (counted) instead of stopping at the first")
    p.add_argument("--batch-size", type=int, default=64, help="rows per batch (default 64)")
    add_progress_argument(p)


def add_commands(sub) -> None:
    """The subparsers of finetune, zero-shot and predict."""
    p = add_command(sub, "finetune", cmd_finetune,
                    help="fine-tune a LLaMA as a sequence classifier, end to end (head on the "
                         "last real token)")
    p.add_argument("--train", required=True, help="LABEL ||| TEXT lines")
    p.add_argument("--dev", required=True, help="LABEL ||| TEXT lines, measured after each epoch")
    p.add_argument("--labels", required=True, help="labels.json: the label words, in index order")
    p.add_argument("--init", help="backbone: any checkpoint the bridge reads, by path or by name "
                                   "(`models` lists them; default: from scratch)")
    p.add_argument("--tokenizer", help="tokenizer file (default: --init's, or a BPE trained on --train)")
    p.add_argument("--preset", help="from scratch: the backbone's config (default tiny)")
    p.add_argument("--vocab-size", type=int, default=8192, help="of the BPE trained from scratch "
                                                                          "(default 8192)")
    p.add_argument("--out", required=True, help="run directory: run.json, metrics.jsonl, checkpoints/, model/ (the best epoch's classifier), dev_predictions.txt, loss.png")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest checkpoint that restores (the "
                        "same command otherwise)")
    add_nonfinite_arguments(p)
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
    add_lora_arguments(p)
    add_tracking_arguments(p)
    p.add_argument("--skip-malformed", action="store_true",
                   help="skip malformed lines (counted) instead of stopping at the first")
    add_attention_argument(p, kernels=False)
    add_progress_argument(p)

    p = add_command(sub, "zero-shot", cmd_zero_shot,
                    help="classify by prompting: the log-likelihood of each label word after a "
                         "template around the text")
    p.add_argument("checkpoint", help="a language model, any format the bridge reads, by path or "
                                       "by name (`models` lists them)")
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
    add_attention_argument(p)

    p = add_command(sub, "predict", cmd_predict,
                    help="a fine-tuned classifier's predictions, and accuracy when the file has "
                         "labels")
    p.add_argument("classifier", help="a finetune --out directory (or its model/; best/ in runs from before)")
    p.add_argument("--data", required=True, help="LABEL ||| TEXT lines (or TEXT lines)")
    p.add_argument("--out", help="write predictions here (default: stdout, accuracy on stderr)")
    _add_task_arguments(p, labels=False)
    add_attention_argument(p)


def add_split_command(sub) -> None:
    """The subparser of split (jax-llama lists it after eval)."""
    p = add_command(sub, "split", cmd_split,
                    help="hold out a random fraction of a data file's lines")
    p.add_argument("file", help="a data file, one example a line")
    p.add_argument("--fraction", type=float, default=0.15, help="held out (default 0.15)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random choice (default 0)")
    p.add_argument("--out", required=True, help="directory for train.txt and heldout.txt")
    p.add_argument("--force", action="store_true", help="replace existing files")
