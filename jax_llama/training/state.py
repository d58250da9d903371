"""What keeps a training run alive through what real machines do to it: checkpoints that are
verified before they are trusted, a stop on SIGTERM / SIGINT that loses no step, and the policy
for a step whose loss or gradients are not finite. Every training loop (jax_llama.training.loop for train,
sft and dpo; jax_llama.training.finetune) uses these, so each behaves the same.

Checkpoints are orbax's (each written into a temporary directory and renamed, so a kill never
leaves half of one). After a save, a manifest - every file's size and SHA-256 - is written into
the step's directory. A resume walks the steps from the newest: a step whose files do not match
its manifest (truncated, missing, corrupted) or that orbax cannot restore (its metadata
unreadable) is renamed aside, `N` -> `N.unreadable-...`, never deleted, and the one before it
is tried. A checkpoint written before manifests existed is trusted as far as orbax can read it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np

from bridge.atomic import check_free_space, describe_bytes, write_text
from bridge.errors import BridgeError

from ..sharding import tree_shardings
from .step import TrainingDiverged

MANIFEST = "jax_llama.manifest.json"
ASIDE = ".unreadable-"


log = logging.getLogger("jax_llama.training")


def say(message: str) -> None:
    """A line for the person running the training, logged at INFO on `jax_llama.training`: the
    one voice of every training run, the loop's and each recipe's. The command line prints
    these lines on stderr (stdout carries results); a program sees them once it configures
    logging (`logging.basicConfig(level=logging.INFO)`)."""
    log.info(message)


class RunStopped(Exception):
    """The run stopped early on request (a signal), with its state saved: not a failure."""

    def __init__(self, step: int, total: int, why: str, checkpoint: Path | None):
        self.step, self.total, self.why, self.checkpoint = step, total, why, checkpoint
        where = f"; its checkpoint: {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped at step {step} of {total} on {why}{where}")


def all_processes_reach(what: str) -> None:
    """A barrier across the processes of a multi-process run (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(what)


def setup_differences(saved: dict, now: dict) -> list[str]:
    """What a resumed run would change of the setup it was started with: "part.field: old ->
    new" inside the parts that are dicts (the model config, the training settings), "part: old
    -> new" for the others."""
    diffs = []
    for part, new in now.items():
        old = saved.get(part)
        if isinstance(new, dict) and isinstance(old, dict):
            diffs += [f"{part}.{k}: {old.get(k)!r} -> {new.get(k)!r}"
                      for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        elif old != new:
            diffs.append(f"{part}: {old!r} -> {new!r}")
    return diffs


# -- checkpoints ------------------------------------------------------------------------------------

def check_resumable(out: Path, now: dict, record: str = "run.json", kind: str = "run",
                    done: str = "trained", before: dict | None = None) -> None:
    """Refuse to resume `out` unless the setup it recorded when it started (out/`record`; keys
    it lacks take their values from `before`, what runs recorded before those keys existed ran
    with) matches `now`, naming each difference: a resumed run must be the run it continues."""
    path = out / record
    if not path.is_file():
        raise BridgeError(f"{out} holds no {kind} to resume (no {record})", field="resume")
    diffs = setup_differences({**(before or {}), **json.loads(path.read_text())}, now)
    if diffs:
        raise BridgeError(f"{out} was {done} with a different setup ({'; '.join(diffs)})",
                          field="resume")


def _file_digests(directory: Path) -> dict[str, dict]:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        files[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size,
                                                         "sha256": digest}
    return files


def verify(directory: Path) -> str | None:
    """What is wrong with the checkpoint at `directory` according to its manifest (None: nothing,
    or no manifest to judge by)."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return None
    try:
        expected = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest {manifest.name} is unreadable ({type(e).__name__})"
    for name, want in expected.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return (f"{name} is {'truncated' if size < want['bytes'] else 'longer than written'}"
                    f" ({size:,} of {want['bytes']:,} bytes)")
        with open(path, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != want["sha256"]:
                return f"{name} is corrupted (its SHA-256 differs from the one written)"
    return None


def state_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
               if hasattr(x, "dtype"))


def _is_disk_full(e: BaseException) -> bool:
    """orbax and tensorstore report a full disk in their own exception types; the OS's words
    survive in the text."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return any(s in text for s in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT),
                                   "RESOURCE_EXHAUSTED", "ENOSPC"))


class Checkpoints:
    """The orbax checkpoints of a run's TrainState in `directory` (the newest `keep` kept),
    each with a manifest; `meta` (JSON) travels with the state where a loop needs more than
    the state to resume (finetune: its epoch, best score and history)."""

    def __init__(self, directory: Path, keep: int):
        import orbax.checkpoint as ocp

        self.directory = directory.resolve()
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state, meta: dict | None = None) -> Path:
        """Write step `step`; a disk too full for it is one BridgeError naming the path and the
        bytes it needs, with the earlier checkpoints intact and nothing of this one left."""
        import orbax.checkpoint as ocp

        needed = state_bytes(state)
        previous = self.latest_step()
        intact = (f"; the checkpoint of step {previous} is intact" if previous is not None
                  else "; there is no earlier checkpoint")
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            check_free_space(self.path(step), needed, f"the checkpoint of step {step}")
        except BridgeError as e:
            raise BridgeError(f"{e.message}{intact}") from None
        args = {"state": ocp.args.StandardSave(state)}
        if meta is not None:
            args["meta"] = ocp.args.JsonSave(meta)
        try:
            self.manager.save(step, args=ocp.args.Composite(**args))
            self.manager.wait_until_finished()
            if jax.process_index() == 0:  # the files of every process are written by now
                files = _file_digests(self.path(step))
                write_text(self.path(step) / MANIFEST, json.dumps({"step": step, "files": files}))
        except Exception as e:
            if not _is_disk_full(e) and not isinstance(e, BridgeError):
                raise
            self._remove_partial(step)
            free = shutil.disk_usage(self.directory).free
            raise BridgeError(
                f"{self.path(step)}: cannot write the checkpoint ({os.strerror(errno.ENOSPC)}): "
                f"it needs {describe_bytes(needed)}, {describe_bytes(free)} were free{intact}"
            ) from None
        return self.path(step)

    def _remove_partial(self, step: int) -> None:
        """What a failed save left: orbax's temporary directory, or the step without its
        manifest. Orbax's writer threads may still be failing into that directory when its
        error reaches us, so the removal waits for them and is repeated until nothing is left."""
        try:
            self.manager.wait_until_finished()
        except Exception:  # noqa: BLE001 - the same failure, reported again by the threads
            pass
        deadline = time.monotonic() + 10.0
        for thread in threading.enumerate():  # orbax's own threads, not its idle pool workers
            if (thread is not threading.current_thread()
                    and type(thread).__module__.startswith("orbax")):
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

        def partial() -> list[Path]:
            return [path for path in self.directory.iterdir()
                    if path.name == str(step) or (path.name.startswith(f"{step}.")
                                                  and "tmp" in path.name)]

        quiet_since = None  # gone, and staying gone for a moment: no thread writes there now
        while time.monotonic() < deadline:
            if left := partial():
                quiet_since = None
                for path in left:
                    shutil.rmtree(path, ignore_errors=True)
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > 0.5:
                break
            time.sleep(0.05)
        self.manager.reload()

    def restore_newest(self, state, mesh, with_meta: bool = False):
        """The newest checkpoint that verifies and restores, as (state, meta, step), laid out
        as `state` is on `mesh` (None: on the devices `state` is on); None when there is none
        at all. Those that fail are reported in a line each and set aside; when every one
        fails, a BridgeError."""
        import orbax.checkpoint as ocp

        shardings = (tree_shardings(state, mesh) if mesh is not None
                     else jax.tree.map(lambda x: x.sharding, state))
        abstract = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
        steps = sorted(self.manager.all_steps(), reverse=True)
        for step in steps:
            problem = verify(self.path(step))
            if problem is None:
                args = {"state": ocp.args.StandardRestore(abstract)}
                if with_meta:
                    args["meta"] = ocp.args.JsonRestore()
                try:
                    restored = self.manager.restore(step, args=ocp.args.Composite(**args))
                    return restored["state"], restored.get("meta") if with_meta else None, step
                except Exception as e:  # orbax's and tensorstore's own error types
                    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                    problem = f"orbax cannot restore it ({type(e).__name__}: {reason})"
            aside = self.path(step).with_name(f"{step}{ASIDE}{time.strftime('%Y%m%d-%H%M%S')}")
            all_processes_reach(f"judged the checkpoint of step {step}")
            if jax.process_index() == 0:  # every process judged it alike: one moves it
                os.rename(self.path(step), aside)
                say(f"checkpoint of step {step}: {problem}; set aside as {aside}")
            all_processes_reach(f"set aside the checkpoint of step {step}")
            self.manager.reload()
        if steps:
            raise BridgeError(f"{self.directory}: none of the {len(steps)} checkpoints restores "
                              f"(each set aside, see above)", field="resume")
        return None


def keep_metrics_until(path: Path, step: int, key: str = "step") -> None:
    """A resumed run's metrics.jsonl without the lines of the steps (`key`: or epochs) after
    the one it resumed at, written by the run that stopped before its next checkpoint: those
    are run again."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if json.loads(line).get(key, 0) <= step]
    if len(kept) < len(lines):
        write_text(path, "".join(line + "\n" for line in kept))


# -- stopping on a signal ---------------------------------------------------------------------------

class StopSignals:
    """While active (a context manager): the first SIGTERM or SIGINT asks the loop to stop once
    its current step is done (`requested` names the signal); a second one ends the process at
    once, as the signal would have. Outside the main thread nothing is installed, nor in a run
    of several processes: a signal reaches each at its own step, and one process saving while
    the others train on would hang them all (there, a signal ends the process as before)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}
        self.enabled = (threading.current_thread() is threading.main_thread()
                        and jax.process_count() == 1)

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:  # the second: at once
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = signal.Signals(signum).name
        say(f"\n{self.requested}: stopping after this step and saving a checkpoint "
             f"(send it again to stop at once)")

    def __enter__(self) -> "StopSignals":
        if self.enabled:
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


# -- non-finite steps -------------------------------------------------------------------------------

ON_NAN = ("stop", "skip")


class NonFinite:
    """`--on-nan`: stop at the first step whose loss or gradient norm is not finite (the state
    after it is never saved), or skip such steps (the step drops its update on the device: see
    jax_llama.training.step.make_train_step) and stop once `max_skipped` of them have been skipped."""

    def __init__(self, policy: str = "stop", max_skipped: int = 10):
        if policy not in ON_NAN:
            raise BridgeError(f"must be one of {', '.join(ON_NAN)} (got {policy!r})",
                              field="on_nan")
        if not isinstance(max_skipped, int) or max_skipped < 1:
            raise BridgeError(f"must be a positive integer (got {max_skipped!r})",
                              field="max_skipped")
        self.policy, self.max_skipped, self.skipped = policy, max_skipped, []

    @property
    def skip(self) -> bool:
        return self.policy == "skip"

    def check(self, step: int, metrics: dict) -> str | None:
        """After step `step` (1-based) with its metrics read back: None to go on; else why the
        run must stop. A skipped step is counted."""
        if np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"]):
            return None
        what = f"step {step}: loss {metrics['loss']}, grad norm {metrics['grad_norm']}"
        if not self.skip:
            return what
        self.skipped.append(step)
        say(f"{what}: update skipped ({len(self.skipped)} of at most {self.max_skipped})")
        if len(self.skipped) >= self.max_skipped:
            return (f"{len(self.skipped)} updates skipped for a loss or gradient that was not "
                    f"finite (steps {', '.join(map(str, self.skipped[-5:]))}; max_skipped "
                    f"{self.max_skipped})")
        return None

    def diverged(self, why: str, checkpoints: Checkpoints, saved: Path | None = None):
        """The TrainingDiverged that ends a run for `why` (what check returned): naming the last
        good checkpoint (policy stop: the state after the step is never saved), or `saved`, the
        one just written (policy skip, too many skipped: the state itself is good)."""
        if saved is not None:
            return TrainingDiverged(f"{why}; stopped. Its checkpoint: {saved}")
        kept = checkpoints.latest_step()
        return TrainingDiverged(f"{why}; stopped. Last good checkpoint: "
                                f"{'none' if kept is None else checkpoints.path(kept)}")
