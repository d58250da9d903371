"""`jax-llama train`, `sft`, `dpo` and `grpo`: the options they share (the model, the run directory, the
mesh, multi-host, the TrainConfig fields), the RunSpec those flags make, and the report of a run."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from bridge.config import LlamaConfig, preset
from bridge.dtypes import DTYPE_NAMES
from bridge.errors import BridgeError

from .common import EXIT_CHECK_FAILED, EXIT_OK, add_command, add_progress_argument
from .options import (add_attention_argument, add_lora_arguments, add_nonfinite_arguments,
                      add_tracking_arguments, lora_config, tracking_spec)

# TrainConfig fields settable from the command line: (field, type, TrainConfig's default as the
# help states it, help). The flag itself defaults to None: TrainConfig's default, or on --resume the
# run's saved value. jax_llama.training.step is not imported for --help (it imports JAX), so the defaults
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
              dpo=None, grpo=None):
    """The RunSpec of `train`, `sft` or `dpo` from their shared flags (a resumed run: its own
    settings unless flags say otherwise, which the resume check then refuses)."""
    from jax_llama.training.spec import RunSpec
    from jax_llama.training.step import TrainConfig

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
    if grpo is not None and saved.get("grpo"):
        given = {k: v for k, v in grpo.to_dict().items() if v != getattr(type(grpo)(), k)}
        grpo = dataclasses.replace(type(grpo)(**saved["grpo"]), **given)
    return RunSpec(out=out, model=model, train=train_config,
                   data=data if data is not None else saved.get("data", []),
                   tokenizer=args.tokenizer or saved.get("tokenizer"),
                   init=args.init or saved.get("init"), vocab_size=args.vocab_size, mesh=args.mesh,
                   scan_layers=args.scan_layers, remat=args.remat, resume=args.resume,
                   sample_tokens=getattr(args, "sample_tokens", 0),
                   strip_labels=getattr(args, "strip_labels", False),
                   pack=pack if pack is not None else saved.get("pack", default_pack),
                   attention=args.attention, lora=lora_config(args, saved.get("lora")), sft=sft,
                   dpo=dpo, grpo=grpo, tracking=tracking_spec(args, saved.get("tracking")),
                   on_nan=args.on_nan, max_skipped=args.max_skipped, progress=args.progress)


def cmd_train(args) -> int:
    spec = _run_spec(args, args.data, True if args.pack else None, default_pack=False)
    return _run(args, spec)


DEMO_STEPS = 3000


def cmd_sft(args) -> int:
    from jax_llama.training.sft import sft_inputs
    from jax_llama.training.spec import SftSpec

    if args.data is None and args.steps is None and not args.resume:
        args.steps = DEMO_STEPS  # the demo task's default: 99% exact match in about 5 minutes
    sft = SftSpec(data=args.data, eval_data=args.eval_data, chat_template=args.chat_template,
                  skip_invalid=args.skip_invalid, replay=args.replay,
                  **({} if args.demo_examples is None else {"demo_examples": args.demo_examples}))
    spec = _run_spec(args, [], False if args.no_pack else None, default_pack=True, sft=sft)
    if args.show_mask is not None:
        from tasks.chats import show_mask

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
    from jax_llama.training.spec import DpoSpec

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


# GRPO's demo (no --data): arithmetic questions, a short completion budget, LoRA by default.
GRPO_DEMO = {"steps": 50, "batch_size": 32, "max_completion_length": 16, "lora_rank": 16,
             "eval_every": 25, "checkpoint_every": 25}
# GRPO's learning rates when none is given: TRL's default for full fine-tuning (1e-6), and a
# larger one for LoRA's adapters, which start at zero.
GRPO_LR = {"full": 1e-6, "lora": 2e-4}


def cmd_grpo(args) -> int:
    from jax_llama.training.spec import GrpoSpec

    demo = args.data is None and not args.resume
    if demo:
        for name in ("steps", "batch_size", "eval_every", "checkpoint_every", "lora_rank"):
            if getattr(args, name) is None:
                setattr(args, name, GRPO_DEMO[name])
        if args.max_completion_length is None:
            args.max_completion_length = GRPO_DEMO["max_completion_length"]
    if not args.resume and args.lr is None:
        args.lr = GRPO_LR["lora" if args.lora_rank else "full"]
    weights = None
    if args.reward_weights:
        try:
            weights = tuple(float(w) for w in args.reward_weights.split(","))
        except ValueError:
            raise BridgeError(f"expected comma-separated numbers (got {args.reward_weights!r})",
                              field="reward_weights") from None
    given = {k: v for k, v in (("max_completion_length", args.max_completion_length),
                               ("epsilon_high", args.epsilon_high)) if v is not None}
    grpo = GrpoSpec(data=args.data, eval_data=args.eval_data, chat_template=args.chat_template,
                    rewards=tuple(args.reward or ()), reward_weights=weights,
                    num_generations=args.num_generations, temperature=args.temperature,
                    top_p=args.top_p, top_k=args.top_k, scale_rewards=args.scale_rewards,
                    loss_type=args.loss_type, epsilon=args.epsilon,
                    num_iterations=args.num_iterations,
                    mask_truncated_completions=args.mask_truncated_completions, beta=args.beta,
                    eval_prompts=args.eval_prompts, **given)
    spec = _run_spec(args, [], False, default_pack=False, grpo=grpo)
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
    from jax_llama.training.loop import RunStopped, train
    from jax_llama.training.step import TrainingDiverged

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
    if "grpo" in summary:
        scores = summary["grpo"]
        for key in [k for k in scores["after"] if k.startswith("eval/")]:
            before = f"{scores['before'][key]:.3f} before, " if "before" in scores else ""
            print(f"held-out prompts ({summary['n_eval']}, greedy): {key[5:]}: {before}"
                  f"{scores['after'][key]:.3f} after")
        for when in ("before", "after"):
            for answer in summary["general"].get(when, []):
                print(f"general question, {when}: {answer['question']!r} -> "
                      f"{answer['answer']!r}")
    elif "preference" in summary:
        scores = summary["preference"]
        for name, key in (("the model prefers the chosen completion", "eval/preference/accuracy"),
                          ("rewards/accuracies", "eval/rewards/accuracies")):
            before = f"{scores['before'][key]:.1%} before, " if "before" in scores else ""
            print(f"held-out pairs ({summary['n_eval']}): {name}: {before}"
                  f"{scores['after'][key]:.1%} after")
        print(f"held-out DPO loss {summary['val_loss']:.4f}; train loss "
              f"{summary['train_loss']:.4f} after {summary['steps']} steps")
    elif "grpo" not in summary:
        print(f"validation loss {summary['val_loss']:.4f} nats/token (unigram baseline "
              f"{summary['unigram_loss']:.4f}); train loss {summary['train_loss']:.4f} after "
              f"{summary['steps']} steps")
    print(f"model: {summary['model']}  (llama-bridge convert {summary['model']} DST --to hf)")
    if "adapter" in summary:
        print(f"adapter: {summary['adapter']}  (PEFT format; jax-llama generate BASE --adapter "
              f"{summary['adapter']})")
    if summary["plot"]:
        print(f"{'reward' if 'grpo' in summary else 'loss'} curve: {summary['plot']}")
    if summary["sample"]:
        print(f"sample:\n{summary['sample']}")
    return EXIT_OK


def _add_run_arguments(p, corpus: str, defaults: dict[str, str] | None = None) -> None:
    """The options `train`, `sft` and `dpo` share: the model, the run directory, the mesh, LoRA,
    attention and the TrainConfig fields (defaults: field -> where this command's default differs
    from TrainConfig's, as the help says it, with {} for TrainConfig's)."""
    defaults = defaults or {}
    p.add_argument("--preset", default="tiny", help="model config (default tiny)")
    p.add_argument("--tokenizer", help="tokenizer.model / tokenizer.json (default: --init's, or a "
                                       f"byte-level BPE trained on {corpus})")
    p.add_argument("--vocab-size", type=int, default=4096, help="of that BPE (default 4096)")
    p.add_argument("--init", help="start from the weights of any checkpoint the bridge reads, "
                                   "by path or by name (`models` lists them)")
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
    add_lora_arguments(p)
    add_tracking_arguments(p)
    add_attention_argument(p, kernels=False)
    add_nonfinite_arguments(p)
    add_progress_argument(p)
    for name, kind, default, text in TRAIN_OPTIONS:
        shown = f"{default:g}" if kind is float and default is not None else str(default)
        if name in defaults or default is not None:
            text += f" (default {defaults.get(name, '{}').format(shown)})"
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                       choices=DTYPE_NAMES if name == "dtype" else None,
                       help=text)


def add_commands(sub) -> None:
    """The subparsers of train, sft and dpo, with the run options they share."""
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

    p = add_command(sub, "grpo", cmd_grpo,
                    help="reinforcement learning from verifiable rewards (GRPO, as TRL 1.16 "
                         "computes it) on prompts; with no --data, an arithmetic demo scored by "
                         "its held-out accuracy before and after")
    p.add_argument("--data", help="JSON lines: {\"prompt\": a string or a message list, and any "
                                  "columns the rewards read} (TRL's format; default: the demo)")
    p.add_argument("--eval-data", help="held-out prompts, same format (default: 10%% of --data)")
    p.add_argument("--chat-template", help="for conversational prompts: llama3, llama2 or a jinja "
                                           "file (default: --init's own chat template)")
    p.add_argument("--reward", action="append", metavar="FILE.py:FUNC",
                   help="a reward function, called as TRL calls it (repeat for several): "
                        "FILE.py:FUNC, regex:PATTERN, or a built-in (exact_answer, number_only) "
                        "(default for the demo: exact_answer)")
    p.add_argument("--reward-weights", metavar="W1,W2,...",
                   help="one weight per --reward (default 1 each)")
    p.add_argument("--num-generations", type=int, default=8,
                   help="completions per prompt, G (default 8)")
    p.add_argument("--max-completion-length", type=int,
                   help=f"new tokens per completion at most (default 256; "
                        f"{GRPO_DEMO['max_completion_length']} for the demo)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sampling; 0 is off (default 0)")
    p.add_argument("--scale-rewards", default="group", choices=("group", "batch", "none"),
                   help="divide the advantages by the std of the group, of the round, or not "
                        "(default group)")
    p.add_argument("--loss-type", default="dapo", choices=("dapo", "grpo", "dr_grpo", "bnpo"),
                   help="how the token losses are averaged, as TRL's (default dapo)")
    p.add_argument("--epsilon", type=float, default=0.2,
                   help="the ratio's clipping below (and above, without --epsilon-high) "
                        "(default 0.2)")
    p.add_argument("--epsilon-high", type=float, help="the ratio's clipping above")
    p.add_argument("--num-iterations", type=int, default=1,
                   help="policy updates per round of completions (default 1)")
    p.add_argument("--mask-truncated-completions", action="store_true",
                   help="no loss on a completion that ran out of tokens before its stop token")
    p.add_argument("--beta", type=float, default=0.0,
                   help="the KL penalty to the reference: the base without the LoRA adapters, "
                        "or the starting weights (default 0, as TRL's)")
    p.add_argument("--eval-prompts", type=int, default=64,
                   help="held-out prompts scored before and after, greedy (default 64)")
    _add_run_arguments(p, "the prompts", {
        "steps": "{}; " f"{GRPO_DEMO['steps']} for the demo",
        "batch_size": "{}; " f"{GRPO_DEMO['batch_size']} for the demo: completions a "
                      "micro-batch, batch size x grad accum a round",
        "lr": f"{GRPO_LR['full']:g}, {GRPO_LR['lora']:g} with --lora-rank"})
