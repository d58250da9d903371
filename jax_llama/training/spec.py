"""What a training run is asked to do, as data: the run (RunSpec) and the recipes' own settings
(SftSpec, DpoSpec, GrpoSpec). Checked where they are made, so a bad value is refused, naming its field,
before anything is read or written; recorded in run.json, which a resume must match."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.lora import LoraConfig

from .step import TrainConfig
from .tracking import TrackingSpec

LOSSES = ("sigmoid", "robust", "hinge", "ipo")   # DPO's losses (jax_llama.training.dpo)


@dataclass(frozen=True)
class SftSpec:
    RECIPE = "sft:SftRecipe"  # the recipe these settings are for (module:class here)

    data: str | None = None           # chats JSONL; None: the synthetic demo task (demo_chats)
    eval_data: str | None = None      # held-out chats; None: eval_fraction of data
    chat_template: str | None = None  # llama3 | llama2 | a jinja file; None: the init's own
    skip_invalid: bool = False        # count and skip examples that cannot train, not refuse
    eval_fraction: float = 0.05
    demo_examples: int = 6000         # of the demo task, when there is no data
    replay: int = 0                   # the --init model's own answers to this many general
                                      # prompts, trained on beside the data (replay_chats)
    replay_tokens: int = 128          # at most, per replayed answer

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DpoSpec:
    RECIPE = "dpo:DpoRecipe"  # the recipe these settings are for (module:class here)

    data: str | None = None            # pairs JSONL; None: the demo task (demo_pairs)
    eval_data: str | None = None       # held-out pairs; None: eval_fraction of data
    chat_template: str | None = None   # for conversational pairs; None: the init's own
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    precompute_ref: bool = False       # reference log-probs for every pair before training
    eval_fraction: float = 0.1
    demo_pairs: int = 4000

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise BridgeError(f"unknown loss {self.loss!r} (expected {', '.join(LOSSES)})",
                              field="loss")
        if not (np.isfinite(self.beta) and self.beta > 0):
            raise BridgeError(f"must be positive (got {self.beta})", field="beta")
        if not 0 <= self.label_smoothing < 0.5:
            raise BridgeError(f"must be in [0, 0.5) (got {self.label_smoothing})",
                              field="label_smoothing")
        if self.label_smoothing and self.loss not in ("sigmoid", "robust"):
            raise BridgeError(f"applies to the sigmoid and robust losses, not {self.loss}",
                              field="label_smoothing")
        if not 0 < self.eval_fraction < 1:
            raise BridgeError(f"must be in (0, 1) (got {self.eval_fraction})", field="eval_fraction")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")   # GRPO's losses (jax_llama.training.grpo)
SCALE_REWARDS = ("group", "batch", "none")


@dataclass(frozen=True)
class GrpoSpec:
    RECIPE = "grpo:GrpoRecipe"  # the recipe these settings are for (module:class here)

    data: str | None = None            # prompts JSONL; None: the demo task (demo_prompts)
    eval_data: str | None = None       # held-out prompts; None: eval_fraction of data
    chat_template: str | None = None   # for conversational prompts; None: the init's own
    rewards: tuple = ()                # FILE.py:FUNC, built-in names, regex:PATTERN; () with no
                                       # data: the demo's (exact_answer)
    reward_weights: tuple | None = None
    num_generations: int = 8           # G completions per prompt
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    scale_rewards: str = "group"
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    num_iterations: int = 1            # policy updates per generation round
    mask_truncated_completions: bool = False
    beta: float = 0.0                  # KL to the reference (the base without LoRA adapters)
    eval_fraction: float = 0.1
    eval_prompts: int = 64             # at most, scored before and after (greedy)
    demo_prompts: int = 4000

    def __post_init__(self):
        object.__setattr__(self, "rewards", tuple(self.rewards))
        if self.reward_weights is not None:
            object.__setattr__(self, "reward_weights", tuple(map(float, self.reward_weights)))
        if self.num_generations < 2:
            raise BridgeError(f"must be at least 2 (got {self.num_generations}): the advantages "
                              f"compare the completions of one prompt with each other",
                              field="num_generations")
        if self.loss_type not in LOSS_TYPES:
            raise BridgeError(f"unknown loss type {self.loss_type!r} (expected "
                              f"{', '.join(LOSS_TYPES)})", field="loss_type")
        if self.scale_rewards not in SCALE_REWARDS:
            raise BridgeError(f"expected {', '.join(SCALE_REWARDS)} (got {self.scale_rewards!r})",
                              field="scale_rewards")
        for name in ("max_completion_length", "num_iterations", "eval_prompts", "demo_prompts"):
            if getattr(self, name) < 1:
                raise BridgeError(f"must be a positive integer (got {getattr(self, name)})",
                                  field=name)
        for name, value in (("temperature", self.temperature), ("epsilon", self.epsilon),
                            ("epsilon_high", self.epsilon_high)):
            if value is not None and not (np.isfinite(value) and value > 0):
                raise BridgeError(f"must be positive (got {value})", field=name)
        if not 0 < self.top_p <= 1:
            raise BridgeError(f"must be in (0, 1] (got {self.top_p})", field="top_p")
        if self.top_k < 0:
            raise BridgeError(f"must be >= 0 (got {self.top_k})", field="top_k")
        if not (np.isfinite(self.beta) and self.beta >= 0):
            raise BridgeError(f"must be >= 0 (got {self.beta})", field="beta")
        if not 0 < self.eval_fraction < 1:
            raise BridgeError(f"must be in (0, 1) (got {self.eval_fraction})",
                              field="eval_fraction")
        if self.reward_weights is not None and self.rewards and \
                len(self.reward_weights) != len(self.rewards):
            raise BridgeError(f"{len(self.reward_weights)} weights for {len(self.rewards)} "
                              f"rewards", field="reward_weights")

    def to_dict(self) -> dict:  # lists, as run.json reads them back
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}


# The RunSpec fields that hold a recipe's settings, as run.json records them.
RECIPE_SETTINGS = ("sft", "dpo", "grpo")


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
    attention: str = "auto"            # the attention implementation (jax_llama.model.attention)
    lora: LoraConfig | None = None     # train LoRA adapters only; the base stays frozen, held in
                                       # the compute dtype (train.dtype)
    sft: SftSpec | None = None  # supervised fine-tuning on chats instead of a corpus
    dpo: DpoSpec | None = None  # preference tuning on pairs instead of a corpus
    grpo: GrpoSpec | None = None  # reinforcement learning from rewards on prompts
    tracking: TrackingSpec = field(default_factory=TrackingSpec)  # TensorBoard / W&B as well;
                                       # not part of the setup a resume must match
    on_nan: str = "stop"               # a step whose loss or gradients are not finite: stop
                                       # the run, or skip its update (jax_llama.training.state)
    max_skipped: int = 10              # with on_nan="skip": stop once this many were skipped
    progress: bool = True              # progress bars on stderr (bridge.progress); not part of
                                       # the setup either

    @property
    def settings(self):
        """The recipe's own settings (SftSpec, DpoSpec, GrpoSpec), or None: pretraining."""
        return next((getattr(self, k) for k in RECIPE_SETTINGS if getattr(self, k) is not None),
                    None)

    def settings_record(self) -> dict:
        """Each recipe's settings as run.json records them (None for those not asked for)."""
        return {k: None if getattr(self, k) is None else getattr(self, k).to_dict()
                for k in RECIPE_SETTINGS}

    def recipe(self):
        """The recipe this run asks for (jax_llama.training.recipe): the one its settings name
        (RECIPE, module:class in this package), or pretraining on the corpus without any."""
        import importlib

        where = self.settings.RECIPE if self.settings is not None else "lm:CorpusRecipe"
        module, name = where.split(":")
        return getattr(importlib.import_module(f".{module}", __package__), name)(self)

    def options(self):
        """The run's RunOptions: its directory, resume, NaN policy, trackers and progress."""
        from .recipe import RunOptions

        return RunOptions(self.out, self.resume, self.on_nan, self.max_skipped, self.tracking,
                          self.progress)
