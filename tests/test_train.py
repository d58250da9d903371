"""The trainer: loss at init, learning, sharding, kill-and-resume, refusals."""

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jax_llama
from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.tokenizer import ByteTokenizer
from conftest import random_tokens, small_config, with_host_devices
from jax_llama.training import loop as run_lib
from jax_llama.training.loop import TrainingDiverged, train
from jax_llama.training.spec import RunSpec
from jax_llama.sharding import parse_mesh
from jax_llama.training.step import (TrainConfig, init_state, lm_loss, loss_fn, lr_schedule,
                             make_optimizer, make_train_step)

TINY = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=259,
                   max_seq_len=64, rope_theta=10000.0)
WORDS = "the a cat dog sat ran on under mat log red big small quietly".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~40 KB of grammatical nonsense: learnable structure, a few hundred steps' worth."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(4):
        lines = [" ".join(rng.choice(WORDS, size=6)).capitalize() + "." for _ in range(250)]
        (root / f"doc{i}.txt").write_text("\n".join(lines) + "\n")
    tok_dir = root / "tokenizer"
    tok_dir.mkdir()
    ByteTokenizer().save(tok_dir)
    return root


def spec(tmp_path, corpus, **train_kw) -> RunSpec:
    tc = dict(steps=150, batch_size=8, seq_len=32, lr=1e-2, eval_every=50, eval_batches=4,
              checkpoint_every=50)
    tc.update(train_kw)
    return RunSpec(out=tmp_path / "run", model=TINY, train=TrainConfig(**tc),
                   data=[str(corpus / f"doc{i}.txt") for i in range(4)],
                   tokenizer=str(corpus / "tokenizer"), sample_tokens=16)


def test_fresh_model_loss_is_ln_vocab():
    config = small_config()
    model, params = jax_llama.init(config, seed=0)
    tokens = random_tokens(config, batch=4, seq_len=32)
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1), "mask": np.ones((4, 32))}
    # N(0, 0.02) weights give near-uniform logits: cross-entropy ln(97) = 4.575 within 1%.
    assert float(loss_fn(params, model, batch)) == pytest.approx(math.log(97), rel=0.01)


def test_training_drives_the_loss_far_below_the_unigram_baseline(tmp_path, corpus):
    summary = train(spec(tmp_path, corpus))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 151))
    assert records[0]["loss"] == pytest.approx(math.log(259), rel=0.05)
    assert summary["val_loss"] < 0.6 * summary["unigram_loss"]  # measured ~1.1 vs ~2.6
    assert Path(summary["plot"]).is_file() and summary["sample"]
    model, params = jax_llama.load(summary["model"])  # a native checkpoint with its tokenizer
    assert model.config.vocab_size == 259 and (Path(summary["model"]) / "tokenizer.json").is_file()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["100", "150", "50"]


def test_bfloat16_compute_with_scan_and_remat_trains(tmp_path, corpus):
    s = spec(tmp_path, corpus, steps=60, dtype="bfloat16", eval_every=60, checkpoint_every=60)
    s.scan_layers = s.remat = True
    summary = train(s)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    model, params = jax_llama.load(summary["model"])  # parameters stay float32 under bf16 compute
    assert model.dtype == "float32" and "layers_0" in params


def test_gradient_accumulation_matches_the_large_batch(tmp_path):
    config = small_config()
    model, params = jax_llama.init(config, seed=0)
    tokens = random_tokens(config, batch=8, seq_len=12)
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1), "mask": np.ones((8, 12), np.float32)}
    halves = [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}]

    def params_after(tc, batches):
        optimizer = make_optimizer(tc)
        step = jax.jit(make_train_step(lm_loss(model), optimizer, lr_schedule(tc), tc.grad_accum))
        state = init_state(jax.tree_util.tree_map(np.asarray, params), optimizer)
        after = []
        for b in batches:
            state, _ = step(state, b)
            after.append([np.asarray(x) for x in jax.tree_util.tree_leaves(state.params)])
        return after

    # eps = 1 makes AdamW's update ~ lr * g, smooth in the gradient: with the usual 1e-8 the
    # division by sqrt(nu) turns float32 rounding on near-zero coordinates into a fraction of lr.
    kw = dict(lr=1e-1, eps=1.0, warmup_steps=0)
    (big,) = params_after(TrainConfig(steps=10, **kw), [batch])
    first_half, both = params_after(TrainConfig(steps=20, grad_accum=2, **kw), halves)
    initial = [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]
    for a, b in zip(first_half, initial):  # a micro-batch alone does not update
        np.testing.assert_array_equal(a, b)
    moved = max(np.abs(a - b).max() for a, b in zip(big, initial))
    assert moved > 1e-4  # the step did move the weights (~lr * |g|)
    for a, b in zip(both, big):
        # The mean of two half-batch gradients is the full gradient up to float32 rounding:
        # measured 1.9e-9 against updates of ~1e-3; skipping either half would move it by ~moved.
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-8)


# About a minute each: the full step runs by default, the LoRA one with -m slow.
@pytest.mark.parametrize("flags", [[], pytest.param(["--lora"], marks=pytest.mark.slow)],
                         ids=["full", "lora"])
def test_sharded_step_equals_the_single_device_step(flags):
    """With --lora only the adapters train (replicated: the sharding rules leave them whole),
    the frozen weights sharded as ever."""
    result = subprocess.run([sys.executable, str(Path(__file__).parent / "sharded_step.py"), *flags],
                            capture_output=True, text=True, timeout=600, env=with_host_devices(8))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    meshes = [r for r in rows if "mesh" in r]
    assert [r["mesh"] for r in meshes] == ["data=8", "fsdp=8", "data=2,fsdp=2,tensor=2"]
    for r in meshes:
        # Loss, gradients and parameters after 3 steps: the same float32 math with sums in
        # another order (measured: 2e-7 relative, 4e-7 of the gradient scale, 7.5e-9 absolute),
        # while the steps moved the weights by ~1e-2 and a wrong split would be off by as much.
        assert r["loss_rel_diff"] <= 1e-6 and r["grad_rel_diff"] <= 1e-6, r
        assert r["param_diff"] <= 1e-6 and r["param_moved"] > 1e-3, r
    assert [r["params_sharded"] for r in meshes] == [False, True, True]
    assert rows[-1]["refusal"].startswith("batch_size: 6 does not divide over data x fsdp = 8")


def cli(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "llama_twins.cli.main", "train", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_kill_and_resume_gives_the_same_parameters_bitwise(tmp_path, corpus):
    common = ["--data", *[corpus / f"doc{i}.txt" for i in range(4)], "--tokenizer",
              corpus / "tokenizer", "--steps", 60, "--batch-size", 8, "--seq-len", 32,
              "--checkpoint-every", 5, "--eval-every", 30, "--sample-tokens", 0]
    straight = cli(*common, "--out", tmp_path / "straight")
    assert straight.wait(timeout=300) == 0, straight.stderr.read()[-2000:]

    killed = cli(*common, "--out", tmp_path / "killed")
    checkpoints = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 300
    while not (checkpoints / "20").is_dir() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)  # mid-run, possibly mid-checkpoint
    killed.wait()
    assert not (tmp_path / "killed" / "model").exists()
    resumed = cli("--resume", "--out", tmp_path / "killed")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert "resumed" in err
    a = (tmp_path / "straight" / "model" / "model.safetensors").read_bytes()
    b = (tmp_path / "killed" / "model" / "model.safetensors").read_bytes()
    assert a == b


def test_resume_with_a_different_setup_is_refused(tmp_path, corpus):
    train(spec(tmp_path, corpus, steps=10, checkpoint_every=5, eval_every=5))
    other = spec(tmp_path, corpus, steps=10, checkpoint_every=5, eval_every=5, lr=5e-3)
    other.resume = True
    with pytest.raises(BridgeError, match=r"resume: .* different setup \(train.lr: 0.01 -> 0.005\)"):
        train(other)
    fresh = spec(tmp_path, corpus, steps=10)
    with pytest.raises(BridgeError, match="is not empty"):
        train(fresh)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, corpus, monkeypatch):
    real = run_lib.jit_train_step

    def poisoned(*args, **kwargs):
        step = real(*args, **kwargs)

        def train_step(state, batch):
            state, metrics = step(state, batch)
            if int(state.step) == 7:
                metrics = dict(metrics, loss=float("nan"))
            return state, metrics
        return train_step
    monkeypatch.setattr(run_lib, "jit_train_step", poisoned)
    with pytest.raises(TrainingDiverged, match=r"step 7: loss nan.*Last good checkpoint: .*checkpoints/5"):
        train(spec(tmp_path, corpus, steps=20, checkpoint_every=5))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["5"]


@pytest.mark.parametrize("poison, step", [("init", 1), ("lr", 2)])
def test_diverging_run_names_the_step_and_the_cli_exits_1(tmp_path, corpus, capsys, poison, step):
    """A NaN weight in the --init checkpoint makes the very first loss NaN; lr 1e30 makes the
    first update blow the weights up, so the second loss is not finite."""
    from llama_twins.cli import main as cli
    extra = ["--lr", "1e30"]
    if poison == "init":
        _, params = jax_llama.init(TINY, seed=0)
        params = jax.tree_util.tree_map(np.array, params)
        params["norm"]["weight"][0] = np.nan
        jax_llama.save(tmp_path / "poisoned", TINY, params)
        extra = ["--init", str(tmp_path / "poisoned")]
    assert cli.main(["train", "--data", *[str(corpus / f"doc{i}.txt") for i in range(4)],
                     "--tokenizer", str(corpus / "tokenizer"), "--steps", "5", "--batch-size", "4",
                     "--seq-len", "16", "--warmup-steps", "0", "--sample-tokens", "0",
                     "--out", str(tmp_path / "run"), *extra]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: step {step}: loss ") and "Last good checkpoint: none" in err, err
    assert not (tmp_path / "run" / "model").exists()


@pytest.mark.parametrize("kw, message", [
    (dict(seq_len=128), "seq_len: 128 is above the model's max_seq_len 64"),
])
def test_bad_run_settings(tmp_path, corpus, kw, message):
    with pytest.raises(BridgeError, match=message):
        train(spec(tmp_path, corpus, **kw))


def test_empty_corpus(tmp_path, corpus):
    (tmp_path / "blank.txt").write_text("\n\n")
    s = spec(tmp_path, corpus)
    s.data = [str(tmp_path / "blank.txt")]
    with pytest.raises(BridgeError, match="the corpus is empty"):
        train(s)


@pytest.mark.parametrize("mesh, message", [
    ("data=2,fsdp=2", "uses 4 devices, but 1 are available"),
    ("pipeline=1", "unknown axis 'pipeline'"),
    ("data=0", "data must be a positive integer"),
])
def test_mesh_specs(mesh, message):
    with pytest.raises(BridgeError, match=message):
        parse_mesh(mesh, 1)
    assert parse_mesh(None, 8) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert parse_mesh("fsdp=4,data=2", 8) == {"data": 2, "fsdp": 4, "tensor": 1}


def test_cli_unknown_preset_lists_valid_ones(capsys):
    from llama_twins.cli import main as cli
    assert cli.main(["train", "--preset", "llama5"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'llama5'; valid: llama2-7b" in err and "tiny" in err


@pytest.mark.parametrize("implementation, message", [
    ("flash", "expected one of xla, chunked, cudnn, splash, auto, got 'flash'"),
    pytest.param("splash", "splash needs a TPU; this JAX runs on cpu",
                 marks=pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU check")),
])
def test_cli_attention_the_backend_lacks_is_one_line_and_exit_2(implementation, message, tmp_path,
                                                                capsys):
    from llama_twins.cli import main as cli
    out = tmp_path / "run"
    assert cli.main(["train", "--preset", "tiny", "--steps", "1", "--attention", implementation,
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "attention" in err and message in err, err
    assert not out.exists()  # refused before anything is written


def test_packed_long_context_run_from_the_command_line(tmp_path, corpus, capsys):
    """--pack with chunked attention at 1,024 tokens a row (several of its blocks): a tiny model
    trained from scratch gets the context it is trained at (the preset's max_seq_len is 256),
    packed rows keep each document to itself, and a resume must keep --pack."""
    from llama_twins.cli import main as cli
    argv = ["train", "--preset", "tiny", "--data", *[str(corpus / f"doc{i}.txt") for i in range(4)],
            "--tokenizer", str(corpus / "tokenizer"), "--seq-len", "1024", "--batch-size", "2",
            "--steps", "2", "--eval-every", "2", "--checkpoint-every", "2",
            "--sample-tokens", "4", "--pack", "--attention", "chunked", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "packed" in err and "padding" in err
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["pack"] is True and record["model"]["max_seq_len"] == 1024
    losses = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(r["loss"]) for r in losses)
    assert np.isfinite(losses[-1]["val_loss"])


def test_the_bar_in_a_log_shows_no_held_out_loss_before_the_first_evaluation(
        tmp_path, corpus, capsys, monkeypatch):
    """stderr not a terminal (captured), a line at every step: the held-out loss joins the bar
    at the first evaluation, never as a NaN before it."""
    import re

    from bridge import progress

    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    train(spec(tmp_path, corpus, steps=4, eval_every=2, checkpoint_every=4))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("training")]
    at = {int(re.search(r"\| (\d)/4 \[", line).group(1)): line for line in lines}
    assert sorted(at) == [0, 1, 2, 3, 4], lines
    assert "loss=" in at[1] and "val=" not in at[1] and "nan" not in at[1], at[1]
    assert all(re.search(r"val=\d+\.\d{3}", at[step]) for step in (2, 3, 4)), lines
