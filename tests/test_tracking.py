"""Experiment tracking (`--log-to tensorboard|wandb` on train, sft and finetune): the scalars the
sinks hold, read back from their own files, are metrics.jsonl's at the same steps; a resumed run
appends; a missing package refuses before anything trains, in one line naming the extra."""

import importlib.util
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from bridge.tokenizer import ByteTokenizer
from conftest import interrupted_at
from llama_twins.cli import main as jax_cli

needs_tensorboardX = pytest.mark.skipif(importlib.util.find_spec("tensorboardX") is None,
                                        reason="tensorboardX is not installed (pip install "
                                               "'jax-llama[tracking]')")

WORDS = "the a cat dog sat ran on under mat log red big".split()
TRAIN = ["--steps", "6", "--batch-size", "2", "--seq-len", "16", "--eval-every", "3",
         "--checkpoint-every", "3", "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    (root / "doc.txt").write_text("\n".join(" ".join(rng.choice(WORDS, size=6)) + "."
                                            for _ in range(200)) + "\n")
    (root / "tokenizer").mkdir()
    ByteTokenizer().save(root / "tokenizer")
    return root


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default under test: offline


def train_argv(corpus: Path, out: Path, *extra) -> list[str]:
    return ["train", "--data", str(corpus / "doc.txt"), "--tokenizer", str(corpus / "tokenizer"),
            *TRAIN, "--out", str(out), *extra]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- readers of the sinks' own files -----------------------------------------------------------------

def tensorboard_events(logdir: Path) -> tuple[dict, dict, list]:
    """(tag -> {step: value}, tag -> text, purge steps) from every event file under logdir,
    oldest file first, with TensorBoard's purge rule: a SessionLog START at step T drops what
    earlier files hold from step T on. The files are TFRecords of tensorboardX's Event protos."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    def records(path: Path) -> list:
        data, pos, events = path.read_bytes(), 0, []
        while pos < len(data):  # u64 length, u32 its crc, the Event, u32 its crc
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            events.append(Event.FromString(data[pos + 12:pos + 12 + n]))
            pos += 12 + n + 4
        return events

    scalars, texts, purges = {}, {}, []
    for events in sorted(map(records, logdir.glob("events.out.tfevents.*")),
                         key=lambda events: events[0].wall_time):
        for event in events:
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                purges.append(event.step)
                for series in scalars.values():
                    for step in [s for s in series if s >= event.step]:
                        del series[step]
            for value in event.summary.value:
                if value.HasField("tensor"):
                    texts[value.tag] = value.tensor.string_val[0].decode()
                else:
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars, texts, purges


def wandb_runs(run: Path) -> list[dict]:
    """Each offline W&B run under RUN/wandb, oldest first: its id, config keys and history rows
    ({step, key: value}). The .wandb file is a LevelDB-style log (a 7-byte header, then 32 KiB
    blocks of chunks: u32 crc, u16 length, u8 type) of wandb's Record protos; wandb ships no
    public reader of it, only the protos."""
    from wandb.proto.wandb_internal_pb2 import Record

    runs = []
    for path in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B", path
        pos, chunk, records = 7, b"", []
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
                pos += left
                continue
            chunk += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last chunk of one
                records.append(Record.FromString(chunk))
                chunk = b""
        info = {"id": None, "config": set(), "history": []}
        for record in records:
            what = record.WhichOneof("record_type")
            if what == "run":
                info["id"] = record.run.run_id
                info["config"] |= {item.key for item in record.run.config.update}
            elif what == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                info["history"].append({**row, "step": record.history.step.num})
        runs.append(info)
    return runs


# -- TensorBoard -------------------------------------------------------------------------------------

@needs_tensorboardX
def test_tensorboard_holds_metrics_jsonl_and_a_resume_appends(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    with interrupted_at(4):  # after the checkpoint at step 3: steps 1-4 logged, 4 done again
        jax_cli.main(train_argv(corpus, out, "--log-to", "tensorboard"))
    assert jax_cli.main(["train", "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    # the resume kept --log-to from run.json: a second event file in the same directory
    files = sorted(p.name for p in (out / "tensorboard").iterdir())
    assert len(files) == 2 and files[1].endswith(".from-step-3"), files

    records = {r["step"]: r for r in metrics(out)}  # the resumed step 4 replaces the first
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    scalars, texts, purges = tensorboard_events(out / "tensorboard")
    assert purges == [4]  # the resumed file hides what the first logged from step 4 on
    assert set(scalars) == {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s",
                            "eval/loss"}
    for tag, key in [("train/loss", "loss"), ("train/grad_norm", "grad_norm"), ("train/lr", "lr"),
                     ("train/tokens_per_s", "tokens_per_s")]:
        assert sorted(scalars[tag]) == [1, 2, 3, 4, 5, 6], tag
        # TensorBoard keeps float32; the loss, grad norm and lr are float32 to begin with
        # (measured: equal), tokens/s a float64 rounded to float32 (2^-24 relative)
        assert [scalars[tag][s] for s in range(1, 7)] == pytest.approx(
            [records[s][key] for s in range(1, 7)], rel=1e-7, abs=0), tag
    assert scalars["eval/loss"] == pytest.approx({3: records[3]["val_loss"],
                                                  6: records[6]["val_loss"]}, rel=1e-7, abs=0)
    config = json.loads(texts["config/text_summary"].strip("`\n"))
    assert config["train"]["steps"] == 6 and config["model"]["dim"] > 0


@needs_tensorboardX
def test_finetune_logs_steps_and_each_epochs_accuracy(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for name, n in (("train", 40), ("dev", 12)):
        labels = rng.integers(2, size=n)
        (tmp_path / f"{name}.txt").write_text("".join(
            f"{y} ||| {' '.join(rng.choice(WORDS, 4))} {'good' if y else 'bad'}\n" for y in labels))
    (tmp_path / "labels.json").write_text('["bad", "good"]')
    out = tmp_path / "clf"
    assert jax_cli.main(["finetune", "--train", str(tmp_path / "train.txt"), "--dev",
                         str(tmp_path / "dev.txt"), "--labels", str(tmp_path / "labels.json"),
                         "--out", str(out), "--vocab-size", "300", "--epochs", "2",
                         "--batch-size", "8", "--max-len", "32", "--log-to", "tensorboard"]) == 0
    records = metrics(out)  # a line a step, as train's; an epoch's last step adds the epoch's
    history = [r for r in records if "epoch" in r]
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["epoch"] for r in history] == [1, 2] and set(history[0]) == {
        "step", "loss", "grad_norm", "lr", "tokens_per_s", "epoch", "train_loss", "val_loss",
        "dev_accuracy", "seconds"}
    scalars, texts, _ = tensorboard_events(out / "tensorboard")
    per_epoch = 5  # 40 examples in batches of 8; the steps are batches trained
    assert sorted(scalars["train/loss"]) == list(range(1, 2 * per_epoch + 1))
    assert scalars["eval/accuracy"] == pytest.approx(
        {per_epoch * r["epoch"]: r["dev_accuracy"] for r in history}, rel=1e-7, abs=0)
    assert scalars["train/epoch_loss"] == pytest.approx(
        {per_epoch * r["epoch"]: r["train_loss"] for r in history}, rel=1e-7, abs=0)
    # the epoch's loss is the mean of its steps' losses
    assert np.mean([scalars["train/loss"][s] for s in range(1, per_epoch + 1)]) == pytest.approx(
        history[0]["train_loss"], rel=1e-6)
    assert scalars["eval/loss"] == pytest.approx(
        {per_epoch * r["epoch"]: r["val_loss"] for r in history}, rel=1e-7, abs=0)
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(scalars)
    assert json.loads(texts["config/text_summary"].strip("`\n"))["labels"] == ["bad", "good"]


CHATS = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                       {"role": "assistant", "content": str(a + b)}]}
         for a in range(5) for b in range(5)]


@needs_tensorboardX
def test_sft_logs_losses_and_exact_match_before_and_after(tmp_path, capsys):
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    out = tmp_path / "sft"
    assert jax_cli.main(["sft", "--data", str(tmp_path / "chats.jsonl"), "--vocab-size", "300",
                         "--steps", "4", "--batch-size", "2", "--seq-len", "64",
                         "--eval-every", "2", "--checkpoint-every", "4", "--out", str(out),
                         "--log-to", "tensorboard"]) == 0, capsys.readouterr().err
    records = {r["step"]: r for r in metrics(out)}
    scalars, _, _ = tensorboard_events(out / "tensorboard")
    assert scalars["train/loss"] == pytest.approx({s: r["loss"] for s, r in records.items()},
                                                  rel=1e-7, abs=0)
    assert sorted(scalars["eval/loss"]) == [2, 4]
    scores = json.loads((out / "exact_match.json").read_text())
    assert scalars["eval/exact_match"] == pytest.approx(
        {0: scores["before"]["exact_match"], 4: scores["after"]["exact_match"]}, rel=1e-7, abs=0)


# -- Weights & Biases, offline --------------------------------------------------------------------

def test_wandb_offline_run_holds_the_config_and_losses_and_resumes(corpus, tmp_path, capsys):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'jax-llama[tracking]')")
    out = tmp_path / "run"
    with interrupted_at(4):
        jax_cli.main(train_argv(corpus, out, "--log-to", "wandb", "--wandb-project", "tests"))
    assert jax_cli.main(["train", "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    assert "wandb: offline run" in capsys.readouterr().err
    run_id = (out / "wandb" / "run-id").read_text().strip()
    first, resumed = wandb_runs(out)  # the resume: a second offline run with the same id
    assert first["id"] == resumed["id"] == run_id
    assert {"model", "train", "data"} <= first["config"]
    records = {r["step"]: r for r in metrics(out)}
    for run, steps in ((first, [1, 2, 3, 4]), (resumed, [4, 5, 6])):
        rows = [r for r in run["history"] if "train/loss" in r]
        assert [r["step"] for r in rows] == steps
        for r in rows:
            # wandb keeps the float64 JSON of the float32 values: equal
            assert r["train/loss"] == records[r["step"]]["loss"]
            assert r["train/lr"] == records[r["step"]]["lr"]
            assert {"train/grad_norm", "train/tokens_per_s"} <= set(r)
    assert [r["step"] for r in resumed["history"] if "eval/loss" in r] == [6]


# -- refusals ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sink, package", [("tensorboard", "tensorboardX"), ("wandb", "wandb")])
@pytest.mark.parametrize("command", ["train", "finetune"])
def test_a_missing_package_refuses_in_one_line_before_training(corpus, tmp_path, capsys,
                                                               monkeypatch, command, sink, package):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError
    out = tmp_path / "run"
    argv = (train_argv(corpus, out) if command == "train" else
            ["finetune", "--train", "missing.txt", "--dev", "missing.txt", "--labels",
             "missing.json", "--out", str(out)])
    assert jax_cli.main([*argv, "--log-to", f"{sink},{'tensorboard' if sink == 'wandb' else 'wandb'}"]
                        ) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --log-to: {sink} needs {package}: pip install 'jax-llama[tracking]'"
    assert not out.exists()


def test_an_unknown_sink_is_refused(corpus, tmp_path, capsys):
    assert jax_cli.main(train_argv(corpus, tmp_path / "run", "--log-to", "tensorboard,mlflow")) == 2
    assert capsys.readouterr().err.strip() == ("error: --log-to: unknown sink 'mlflow'; valid: "
                                               "tensorboard, wandb")
    assert not (tmp_path / "run").exists()
