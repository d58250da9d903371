"""Runs that survive what real machines do (jax_llama.training.state): a damaged newest checkpoint is set
aside and the run resumes from the one before it; SIGTERM / SIGINT stop after the current step
with a checkpoint; a step whose loss is not finite stops the run or is skipped. Each resumed run
must end bit for bit where an uninterrupted one ends."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge.errors import BridgeError
from jax_llama.training import loop as run_lib
from jax_llama.training.state import ASIDE, MANIFEST, verify
from jax_llama.training.step import TrainConfig, init_state, lm_loss, make_optimizer, make_train_step
from jax_llama.training.step import TrainingDiverged
from test_train import TINY, cli, corpus, spec  # noqa: F401  (corpus: a fixture)

STEPS = dict(steps=20, checkpoint_every=5, eval_every=10, keep_checkpoints=4)


def model_bytes(run: Path) -> bytes:
    return (run / "model" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):  # noqa: F811
    """An uninterrupted run: 20 steps, checkpoints at 5, 10, 15, 20."""
    root = tmp_path_factory.mktemp("straight")
    run_lib.train(spec(root, corpus, **STEPS))
    return root / "run"


# -- 1. the newest checkpoint that restores --------------------------------------------------------

def largest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST),
               key=lambda p: p.stat().st_size)


def truncate(step_dir: Path) -> str:
    path = largest_file(step_dir)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    return "is truncated"


def remove(step_dir: Path) -> str:
    largest_file(step_dir).unlink()
    return "is missing"


def flip(step_dir: Path) -> str:
    path = largest_file(step_dir)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return "is corrupted"


def garble_metadata(step_dir: Path) -> str:
    path = step_dir / "_CHECKPOINT_METADATA"
    path.write_text("{not json".ljust(path.stat().st_size))
    return "_CHECKPOINT_METADATA is corrupted"


def garble_metadata_without_manifest(step_dir: Path) -> str:
    """A checkpoint from before manifests: orbax's own reading is the judge."""
    (step_dir / MANIFEST).unlink()
    (step_dir / "state" / "_METADATA").write_text("{not json")
    return "orbax cannot restore it"


@pytest.mark.parametrize("damage", [truncate, remove, flip, garble_metadata,
                                    garble_metadata_without_manifest])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_resumes(
        corpus, straight, tmp_path, caplog, damage):  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    what = damage(run / "checkpoints" / "20")
    (run / "model").rename(tmp_path / "first-model")
    resumed = spec(tmp_path, corpus, **STEPS)
    resumed.resume = True
    with caplog.at_level(logging.INFO, logger="jax_llama.training"):  # the library's voice
        run_lib.train(resumed)
    err = "\n".join(r.getMessage() for r in caplog.records if r.name == "jax_llama.training")
    lines = [line for line in err.splitlines() if line.startswith("checkpoint of step 20")]
    assert len(lines) == 1 and what in lines[0] and "set aside as" in lines[0], err
    assert "resumed" in err and "at step 15" in err
    aside = [p.name for p in (run / "checkpoints").iterdir() if ASIDE in p.name]
    assert len(aside) == 1 and aside[0].startswith("20" + ASIDE)  # kept, not deleted
    assert model_bytes(run) == model_bytes(straight)  # steps 16-20 again, bit for bit
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 20  # no step logged twice


def test_no_checkpoint_that_restores_is_one_line_and_exit_2(straight_cli, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight_cli, run)
    for step in ("5", "10", "15", "20"):
        flip(run / "checkpoints" / step)
    resumed = cli("--resume", "--out", run)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 2, err
    last = err.strip().splitlines()[-1]
    assert "none of the 4 checkpoints restores" in last and "Traceback" not in err, err


def test_verify_passes_what_was_written(straight):
    for step in ("5", "10", "15", "20"):
        assert (straight / "checkpoints" / step / MANIFEST).is_file()
        assert verify(straight / "checkpoints" / step) is None


# -- 2. SIGTERM / SIGINT ---------------------------------------------------------------------------

def cli_args(corpus):  # noqa: F811
    return ["--data", *[corpus / f"doc{i}.txt" for i in range(4)], "--tokenizer",
            corpus / "tokenizer", "--steps", 20, "--batch-size", 8, "--seq-len", 32,
            "--checkpoint-every", 5, "--eval-every", 10, "--keep-checkpoints", 4,
            "--sample-tokens", 16]


@pytest.fixture(scope="module")
def straight_cli(corpus, tmp_path_factory):  # noqa: F811
    run = tmp_path_factory.mktemp("straight-cli") / "run"
    done = cli(*cli_args(corpus), "--out", run)
    assert done.wait(timeout=300) == 0, done.stderr.read()[-2000:]
    return run


def test_sigterm_stops_with_a_checkpoint_and_resumes_bitwise(corpus, straight_cli, tmp_path):  # noqa: F811
    common = cli_args(corpus)
    run = tmp_path / "run"
    proc = cli(*common, "--out", run)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "5").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert "on SIGTERM" in last and "--resume" in last, err[-2000:]
    step = int(last.split("stopped at step ")[1].split()[0])
    assert 5 <= step < 20, last  # stopped early, after the step that was running
    assert verify(run / "checkpoints" / str(step)) is None
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == step  # flushed up to the step it stopped at
    assert not (run / "model").exists()
    resumed = cli("--resume", "--out", run)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert model_bytes(run) == model_bytes(straight_cli)


def test_a_second_signal_ends_the_process_at_once(tmp_path):
    """The first SIGINT is taken as a request; the second kills the process as SIGINT would."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        from jax_llama.training.state import StopSignals
        with StopSignals() as s:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            print("requested", s.requested, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            print("still running", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.splitlines() == ["requested SIGINT"], done.stdout + done.stderr
    assert done.returncode == -signal.SIGINT


# -- 3. a full disk while a checkpoint is written -----------------------------------------------

def checkpoint_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())


def state_size(corpus) -> int:  # noqa: F811
    import jax_llama
    from jax_llama.training.state import state_bytes

    tc = spec(Path("unused"), corpus, **STEPS).train
    return state_bytes(init_state(jax_llama.init(TINY, seed=0)[1], make_optimizer(tc)))


def fill(mount: Path, leave: int) -> None:
    """Write a filler file so that `leave` bytes stay free on `mount`."""
    free = shutil.disk_usage(mount).free
    with open(mount / "filler", "wb") as f:
        f.write(b"\0" * max(free - leave, 0))


@pytest.mark.parametrize("when", ["before", "while"])
def test_a_full_disk_refuses_the_checkpoint_and_keeps_the_one_before(
        corpus, straight, small_fs, tmp_path, monkeypatch, when):  # noqa: F811
    """Room for the first checkpoint and not the second: refused up front (the state's bytes
    do not fit) or, with that check out of the way, as orbax writes it."""
    from jax_llama.training import state as run_state

    size, first = state_size(corpus), checkpoint_bytes(straight / "checkpoints" / "5")
    mount = small_fs(size_mb=4)
    if when == "while":
        monkeypatch.setattr(run_state, "check_free_space", lambda *a, **k: None)
    s = spec(mount, corpus, **STEPS)
    s.sample_tokens = 0
    fill(mount, (size if when == "before" else first) + first // 2 + 64 * 1024)
    with pytest.raises(BridgeError) as e:
        run_lib.train(s)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{mount / 'run' / 'checkpoints' / '10'}: cannot write the "
                              f"checkpoint"), message
    assert "No space left on device" in message and "it needs " in message, message
    assert message.endswith("the checkpoint of step 5 is intact"), message
    checkpoints = mount / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["5"]  # nothing of step 10
    assert verify(checkpoints / "5") is None
    assert not (mount / "run" / "model").exists()


# -- 4. non-finite steps ---------------------------------------------------------------------------

def poison(monkeypatch, bad_steps: set[int]):
    """Training batches of `bad_steps` (1-based) get a token id outside the vocabulary: the
    embedding lookup reads NaN, as a corrupted data shard would give."""
    real = run_lib.jit_train_step

    def poisoned(*args, **kwargs):
        step = real(*args, **kwargs)

        def train_step(state, batch):
            if int(state.step) + 1 in bad_steps:
                batch = dict(batch, inputs=batch["inputs"].at[0, 0].set(10 ** 6))
            return step(state, batch)
        return train_step
    monkeypatch.setattr(run_lib, "jit_train_step", poisoned)


def test_skip_drops_the_update_on_the_device():
    config = TINY
    import jax_llama

    model, params = jax_llama.init(config, seed=0)
    tc = TrainConfig(steps=10, batch_size=2, seq_len=8, lr=1e-2)
    optimizer = make_optimizer(tc)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 9)), jnp.int32)
    good = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, 8))}
    bad = dict(good, inputs=good["inputs"].at[0, 0].set(10 ** 6))
    plain = jax.jit(make_train_step(lm_loss(model), optimizer, lambda s: tc.lr))
    skipping = jax.jit(make_train_step(lm_loss(model), optimizer, lambda s: tc.lr,
                                       skip_nonfinite=True))
    state = init_state(params, optimizer)
    # a good step is the same step either way
    a, b = plain(state, good)[0], skipping(state, good)[0]
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), a, b)
    # a bad one: the plain step writes NaN into the params, the skipping one keeps them
    poisoned, metrics = plain(a, bad)
    assert not np.isfinite(float(metrics["loss"]))
    assert not all(np.isfinite(x).all() for x in jax.tree.leaves(poisoned.params))
    kept, metrics = skipping(a, bad)
    assert not np.isfinite(float(metrics["loss"]))
    assert int(kept.step) == int(a.step) + 1
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y),
                 (kept.params, kept.opt_state), (a.params, a.opt_state))


def test_on_nan_skip_counts_and_the_run_goes_on(corpus, tmp_path, monkeypatch):  # noqa: F811
    poison(monkeypatch, {7})
    s = spec(tmp_path, corpus, **STEPS)
    s.on_nan = "skip"
    summary = run_lib.train(s)
    assert np.isfinite(summary["train_loss"])
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped")] == [7]
    assert all(np.isfinite(r["loss"]) for r in records if not r.get("skipped"))


def test_on_nan_skip_stops_after_max_skipped_with_a_checkpoint(corpus, tmp_path, monkeypatch):  # noqa: F811
    poison(monkeypatch, {3, 7, 8})
    s = spec(tmp_path, corpus, **STEPS)
    s.on_nan, s.max_skipped = "skip", 3
    with pytest.raises(TrainingDiverged, match=r"3 updates skipped .*steps 3, 7, 8.*checkpoints/8"):
        run_lib.train(s)
    assert verify(tmp_path / "run" / "checkpoints" / "8") is None  # its state is a good one


def test_on_nan_stop_names_the_step_and_keeps_the_last_good_checkpoint(corpus, tmp_path,
                                                                       monkeypatch):  # noqa: F811
    poison(monkeypatch, {12})
    with pytest.raises(TrainingDiverged, match=r"step 12: loss nan.*Last good checkpoint: .*/10$"):
        run_lib.train(spec(tmp_path, corpus, **STEPS))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["10", "5"]


def test_on_nan_is_checked(corpus, tmp_path):  # noqa: F811
    s = spec(tmp_path, corpus, **STEPS)
    s.on_nan = "ignore"
    with pytest.raises(BridgeError, match="on_nan: must be one of stop, skip"):
        run_lib.train(s)
    assert not (tmp_path / "run").exists()


# -- the same for finetune ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    from test_classify import synthetic_lines

    root = tmp_path_factory.mktemp("task")
    (root / "train.txt").write_text(synthetic_lines(300, seed=0))
    (root / "dev.txt").write_text(synthetic_lines(100, seed=1))
    (root / "labels.json").write_text('["negative", "positive"]')
    return root


def finetune_argv(task: Path, out: Path, *extra) -> list[str]:
    # from scratch: batch 32, so 10 steps an epoch and 30 in all
    return ["finetune", "--train", str(task / "train.txt"), "--dev", str(task / "dev.txt"),
            "--labels", str(task / "labels.json"), "--out", str(out), "--vocab-size", "300",
            "--epochs", "3", "--max-len", "64", *map(str, extra)]


def classifier_bytes(out: Path) -> tuple[bytes, bytes]:
    return tuple((out / "model" / f).read_bytes() for f in ("model.safetensors",
                                                             "classifier.safetensors"))


def history(out: Path) -> list[tuple]:
    """The epochs' records (an epoch's last step's line), as a run with no stop writes them."""
    return [(r["step"], r["epoch"], r["train_loss"], r["val_loss"], r["dev_accuracy"])
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "epoch" in r]


@pytest.fixture(scope="module")
def straight_finetune(task_files, tmp_path_factory):
    from llama_twins.cli import main as jax_cli

    out = tmp_path_factory.mktemp("finetune") / "run"
    assert jax_cli.main(finetune_argv(task_files, out)) == 0
    return out


def finetune_steps(monkeypatch, at: dict):
    """classify's train step, with `at[step]` (1-based) run before that step: a signal sent, a
    batch poisoned (returned)."""
    from jax_llama.training import loop as loop_lib  # finetune runs on the one loop

    real = loop_lib.jit_train_step

    def wrapped(*args, **kwargs):
        step = real(*args, **kwargs)

        def train_step(state, batch):
            action = at.get(int(state.step) + 1)
            return step(state, action(batch) if action else batch)
        return train_step
    monkeypatch.setattr(loop_lib, "jit_train_step", wrapped)


def needs_main_thread():
    import threading
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")


def sigterm(batch):
    os.kill(os.getpid(), signal.SIGTERM)
    return batch


def test_finetune_stopped_by_sigterm_resumes_bitwise(task_files, straight_finetune, tmp_path,
                                                     monkeypatch, capsys):
    from llama_twins.cli import main as jax_cli

    needs_main_thread()
    out = tmp_path / "run"
    finetune_steps(monkeypatch, {15: sigterm})
    assert jax_cli.main(finetune_argv(task_files, out)) == 0
    err = capsys.readouterr().err
    assert "stopped at step 15 of 30 on SIGTERM" in err and "--resume" in err, err[-2000:]
    assert verify(out / "checkpoints" / "15") is None
    assert [e for _, e, *_ in history(out)] == [1]  # epoch 1's record, flushed
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 16))  # every step's line up to the stop
    monkeypatch.undo()
    assert jax_cli.main(finetune_argv(task_files, out, "--resume")) == 0
    assert "resumed" in capsys.readouterr().err
    assert classifier_bytes(out) == classifier_bytes(straight_finetune)
    assert history(out) == history(straight_finetune)


def test_finetune_resumes_past_a_damaged_checkpoint(task_files, straight_finetune, tmp_path,
                                                    capsys):
    from llama_twins.cli import main as jax_cli

    out = tmp_path / "run"
    assert jax_cli.main(finetune_argv(task_files, out)) == 0
    flip(out / "checkpoints" / "30")
    assert jax_cli.main(finetune_argv(task_files, out, "--resume")) == 0
    err = capsys.readouterr().err
    assert "checkpoint of step 30:" in err and "is corrupted" in err and "at step 20" in err
    assert classifier_bytes(out) == classifier_bytes(straight_finetune)
    assert history(out) == history(straight_finetune)


def test_finetune_resume_with_another_setup_is_refused(task_files, straight_finetune, tmp_path,
                                                       capsys):
    from llama_twins.cli import main as jax_cli

    out = tmp_path / "run"
    shutil.copytree(straight_finetune, out)
    assert jax_cli.main(finetune_argv(task_files, out, "--resume", "--lr", "0.01")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --resume: ") and "different setup (finetune.lr: 0.001 -> 0.01)" in last


def poisoned(batch):
    return dict(batch, tokens=np.full_like(batch["tokens"], 10 ** 6))


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_finetune_non_finite_step(task_files, tmp_path, monkeypatch, capsys, policy):
    from llama_twins.cli import main as jax_cli

    out = tmp_path / "run"
    finetune_steps(monkeypatch, {5: poisoned, 12: poisoned})
    code = jax_cli.main(finetune_argv(task_files, out, "--on-nan", policy, "--max-skipped", 3))
    err = capsys.readouterr().err
    if policy == "stop":
        assert code == 1 and "error: step 5: loss nan" in err and "Last good checkpoint: none" in err
        assert not (out / "model").exists()
    else:
        assert code == 0, err[-2000:]
        assert "step 5: loss nan" in err and "update skipped (1 of at most 3)" in err
        assert [r.get("skipped_steps") for r in map(json.loads, (out / "metrics.jsonl")
                                                     .read_text().splitlines())
                if "epoch" in r] == [1, 2, 2]
