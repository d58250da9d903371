"""The flags several `jax-llama` families share, beside what they turn into: the attention
implementation, the decode kernels, LoRA, experiment tracking and the non-finite-step policy."""

from __future__ import annotations

import os
import sys
from typing import Callable

from bridge.errors import BridgeError


def lora_config(args, saved: dict | None = None):
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


def tracking_spec(args, saved: dict | None = None):
    """The TrackingSpec of --log-to / --wandb-project (a resumed run: its own unless --log-to is
    given). W&B logs offline unless WANDB_MODE=online."""
    from jax_llama.training.tracking import WANDB_MODES, TrackingSpec

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


def add_tracking_arguments(p) -> None:
    # Checked by the library (jax_llama.training.tracking.TrackingSpec), whose errors name log_to.
    p.add_argument("--log-to", action="append", metavar="tensorboard,wandb",
                   help="also log the run's scalars and config to TensorBoard (RUN/tensorboard/) "
                        "and / or Weights & Biases (RUN/wandb/; offline unless WANDB_MODE=online); "
                        "repeatable or comma-separated; needs pip install 'jax-llama[tracking]'")
    p.add_argument("--wandb-project", help="the W&B project (default jax-llama); the run's name "
                                           "is the run directory's")


def add_lora_arguments(p) -> None:
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


def add_nonfinite_arguments(p) -> None:
    # Checked by the library (jax_llama.training.state.NonFinite), whose errors name these fields.
    p.add_argument("--on-nan", default="stop",
                   help="a step whose loss or gradients are not finite: stop (the last good "
                        "checkpoint kept) or skip (its update dropped, counted) (default stop)")
    p.add_argument("--max-skipped", type=int, default=10,
                   help="with --on-nan skip: stop once this many updates were skipped "
                        "(default 10)")


def add_attention_argument(p, kernels: bool = True) -> None:
    """--attention, and with `kernels` --kernels: how a model's attention runs, and how its
    projections and attention over the KV cache run when it decodes. The library checks both
    (jax_llama.model.attention.choose, jax_llama.model.projections.implementation), and its
    errors name the flag."""
    p.add_argument("--attention", default="auto",
                   help="attention implementation: xla (scores materialised), chunked (flash-style, "
                        "memory linear in the sequence), cudnn (NVIDIA GPUs), splash (TPUs), auto "
                        "(default: xla for short sequences; for long ones chunked - splash on a "
                        "TPU, cudnn on a GPU in bfloat16 / float16)")
    if kernels:
        p.add_argument("--kernels", default="auto",
                       help="how projections and attention over the KV cache run: kernels (the "
                            "CPU decode kernels, jax_llama/model/kernels/matvec.cc, built ahead by "
                            "`jax-llama kernels build`: up to 8 float32 rows, float32, int8 or "
                            "4-bit weights), xla (XLA's matmuls only), auto (default: kernels "
                            "where they are built and run here, else xla; JAX_LLAMA_KERNELS=0 "
                            "makes it xla)")


def with_kernels(args, load: Callable[[], tuple], say: bool = True):
    """load() (of a model with `kernels=args.kernels`), --kernels checked first - where the
    kernels are compiled, the first time on this machine, the library's log says on stderr
    (common.training_voice) - and once it is loaded, what its decode steps run on said on
    stderr (later, by say_kernels, with say=False: a command that still checks its input
    first)."""
    from jax_llama.model.projections import implementation

    implementation(args.kernels)
    loaded = load()
    if say:
        say_kernels(args)
    return loaded


def kernels_line(args) -> str:
    """What the decode steps' projections and cached attention run on, as --kernels chose, in
    one line (a --kernels that cannot be had is refused here, naming the flag)."""
    from jax_llama.model import kernels
    from jax_llama.model.projections import implementation

    which = implementation(args.kernels)
    why = ("" if which == "kernels" or args.kernels == "xla"
           else f": {kernels.unavailable_reason()}")
    return f"projections and cached attention: {which} (--kernels {args.kernels}{why})"


def say_kernels(args) -> None:
    """kernels_line on stderr."""
    print(kernels_line(args), file=sys.stderr, flush=True)
