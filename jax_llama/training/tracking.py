"""Experiment tracking: a run's scalars, at its step numbers, sent to TensorBoard and / or Weights &
Biases as well as to metrics.jsonl (which the loops keep writing themselves, unchanged).

    spec = TrackingSpec(log_to=("tensorboard", "wandb"))
    spec.check()                                      # before training: a missing package refuses
    with Tracker.open(spec, run_dir, config) as tracker:
        tracker.log(step, {"loss": 2.3, "lr": 1e-3, "val_loss": 2.5})   # metrics.jsonl's names

TensorBoard: event files in RUN/tensorboard/ (tensorboardX, which needs only numpy and protobuf),
the config once as text. W&B: a run in RUN/wandb/ named after the run directory, the config as
its config; offline unless asked otherwise, so nothing leaves the machine and no login is asked
for (`wandb sync RUN/wandb/offline-run-*` uploads it later). A resumed run appends: TensorBoard
writes a new event file into the same directory, purging the steps the resume repeats, and W&B
resumes the run whose id RUN/wandb/run-id keeps.

Neither package is needed to train: both are imported only when asked for.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from pathlib import Path

from bridge.atomic import write_text
from bridge.errors import BridgeError

from .state import say

__all__ = ["SINKS", "TAGS", "Tracker", "TrackingSpec"]

SINKS = {"tensorboard": "tensorboardX", "wandb": "wandb"}   # sink -> the package it needs
EXTRA = "pip install 'jax-llama[tracking]'"
WANDB_MODES = ("offline", "online")

# metrics.jsonl's names -> the tags both sinks show (one table: TensorBoard groups by the prefix,
# W&B makes a panel section of it). Names not here pass through as they are.
TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
        "tokens_per_s": "train/tokens_per_s", "val_loss": "eval/loss",
        "train_loss": "train/epoch_loss", "epoch": "train/epoch",
        "dev_accuracy": "eval/accuracy", "exact_match": "eval/exact_match",
        "unseen_exact_match": "eval/unseen_exact_match"}


@dataclass(frozen=True)
class TrackingSpec:
    log_to: tuple[str, ...] = ()       # any of SINKS
    project: str = "jax-llama"         # the W&B project
    wandb_mode: str = "offline"        # online streams to W&B's server and needs an API key

    def __post_init__(self):
        unknown = [s for s in self.log_to if s not in SINKS]
        if unknown:
            raise BridgeError(f"unknown sink {unknown[0]!r}; valid: {', '.join(SINKS)}",
                              field="log_to")
        object.__setattr__(self, "log_to", tuple(dict.fromkeys(self.log_to)))
        if self.wandb_mode not in WANDB_MODES:
            raise BridgeError(f"must be one of {', '.join(WANDB_MODES)} (got {self.wandb_mode!r})",
                              field="wandb_mode")

    def check(self) -> None:
        """Refuse, before anything trains, a sink whose package is missing (or, online, W&B
        without credentials: wandb would otherwise ask for them at a prompt)."""
        for sink in self.log_to:
            try:
                __import__(SINKS[sink])
            except ImportError:
                raise BridgeError(f"{sink} needs {SINKS[sink]}: {EXTRA}", field="log_to") from None
        if "wandb" in self.log_to and self.wandb_mode == "online" and not _wandb_credentials():
            raise BridgeError("wandb online needs an API key (wandb login, or WANDB_API_KEY); "
                              "unset WANDB_MODE to log offline", field="log_to")

    def to_dict(self) -> dict:
        return {"log_to": list(self.log_to), "project": self.project}


class Tracker:
    """Sends scalars to its sinks; with none (nothing asked for, or a process other than the
    primary one) it does nothing."""

    def __init__(self, sinks: list | None = None):
        self._sinks = list(sinks or ())

    @classmethod
    def open(cls, spec: TrackingSpec, run_dir: Path, config: dict,
             resume_step: int | None = None) -> "Tracker":
        """The sinks `spec` asks for, writing under `run_dir`; `config` (JSON-able) is recorded
        once. resume_step: the step a resumed run continues from (None for a new run)."""
        sinks = []
        try:
            for sink in spec.log_to:
                if sink == "tensorboard":
                    sinks.append(_TensorBoard(run_dir / "tensorboard", config, resume_step))
                else:
                    sinks.append(_Wandb(run_dir, spec, config, resume_step))
        except BaseException:
            cls(sinks).close()
            raise
        return cls(sinks)

    @property
    def active(self) -> bool:
        return bool(self._sinks)

    def log(self, step: int, metrics: dict) -> None:
        """metrics: names (metrics.jsonl's, mapped through TAGS) -> numbers; 'step', and values
        that are not finite numbers, are left out."""
        scalars = {TAGS.get(k, k): x for k, x in ((k, _number(v)) for k, v in metrics.items())
                   if k != "step" and x is not None}
        if scalars:
            for sink in self._sinks:
                sink.log(step, scalars)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _TensorBoard:
    def __init__(self, logdir: Path, config: dict, resume_step: int | None):
        from tensorboardX import SummaryWriter

        # purge_step: TensorBoard drops what earlier event files hold from this step on, the
        # steps after the last checkpoint that the resumed run does again
        # (the suffix keeps a resume's file apart from one opened in the same second)
        self.writer = SummaryWriter(str(logdir), purge_step=None if resume_step is None
                                    else resume_step + 1,
                                    filename_suffix=f".from-step-{resume_step or 0}")
        if resume_step is None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, spec: TrackingSpec, config: dict, resume_step: int | None):
        import wandb

        directory = run_dir / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        id_file = directory / "run-id"
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(4)
            write_text(id_file, run_id + "\n")
        # console off: our progress bar and results stay ours; silent: the one line below says
        # where the run went
        self.run = wandb.init(project=spec.project, name=run_dir.name, dir=str(run_dir),
                              id=run_id, resume="allow", mode=spec.wandb_mode, config=config,
                              settings=wandb.Settings(console="off", silent=True))
        where = Path(self.run.dir).parent
        say(f"wandb: {spec.wandb_mode} run {run_id} in {where}"
            + (f" (upload later: wandb sync {where})" if spec.wandb_mode == "offline" else ""))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def _number(value) -> float | None:
    """A finite float of a Python or numpy number (0-d arrays too); None for anything else."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _wandb_credentials() -> bool:
    """Whether wandb finds an API key (environment, settings, .netrc) without asking for one."""
    import inspect

    import wandb

    if "prompt" not in inspect.signature(wandb.login).parameters:
        return True  # an older wandb: it decides for itself
    return bool(wandb.login(prompt=False, verify=False))
