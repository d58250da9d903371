"""A run's own output is never its input (issue 37, part 5): a data directory's files leave out
the run's own --out and whatever earlier runs wrote there; an --out that is, or holds, an input
is refused by name (exit 2) before anything is written."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from bridge.data_dirs import check_out_apart, files_under, output_kind
from bridge.errors import BridgeError
from tasks.evaluation import data_files
from bridge.tokenizer import ByteTokenizer
from jax_llama.training import data
from llama_twins.cli import main as cli

WORDS = "the a cat dog sat ran on under mat log red big small quietly".split()


def write_corpus(root: Path, n_files: int = 3) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n_files):
        lines = [" ".join(rng.choice(WORDS, size=6)) + "." for _ in range(60)]
        (root / f"doc{i}.txt").write_text("\n".join(lines) + "\n")
    return root


def naive_files(root: Path) -> list[Path]:
    """What corpus_files read before the fix: every text file under root but hidden ones."""
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and p.suffix.lower() in data.TEXT_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


# What each of the project's writers leaves in a directory (names as they write them).
OUTPUTS = {
    "runs/old": {"run.json": "{}", "metrics.jsonl": '{"step": 1}', "loss.png": "",
                 "tokenizer/tokenizer.json": "{}", "model/config.json": "{}",
                 "model/model.safetensors": "", "checkpoints/2/_CHECKPOINT_METADATA": "{}",
                 "checkpoints/2/commit_success.txt": "ok"},
    "stopped": {"run.json": "{}", "tokenizer/tokenizer.json": "{}"},
    "clf": {"metrics.jsonl": '{"epoch": 1}', "dev_predictions.txt": "0\n1\n",
            "best/config.json": "{}", "best/model.safetensors": "", "best/head.json": "{}"},
    "hf": {"config.json": "{}", "model.safetensors.index.json": "{}", "tokenizer.json": "{}"},
    "adapter": {"adapter_config.json": "{}", "adapter_model.safetensors": "",
                "README.md": "adapter"},
    "ckpts": {"7/_CHECKPOINT_METADATA": "{}", "7/state/manifest.ocdbt": "",
              "7/state/_METADATA": "{}"},
    "token-cache": {"tokens-0123456789abcdef.uint16": "", "tokens-0123456789abcdef.json": "{}"},
}


def make_outputs(root: Path) -> None:
    for directory, files in OUTPUTS.items():
        for name, text in files.items():
            (root / directory / name).parent.mkdir(parents=True, exist_ok=True)
            (root / directory / name).write_text(text)


def test_a_data_directory_leaves_out_what_runs_wrote_there(tmp_path):
    root = write_corpus(tmp_path / "data")
    (root / "notes").mkdir()
    (root / "notes" / "config.json").write_text('{"a": 1}')  # a config.json alone is data
    (root / "notes" / "log.jsonl").write_text('{"text": "kept"}\n')
    before = data.corpus_files([root])
    make_outputs(root)
    # Each output holds files the plain walk would read: the exclusion is what keeps them out.
    for directory in OUTPUTS:
        assert any(p.is_relative_to(root / directory) for p in naive_files(root)), directory
    lines = []
    assert data.corpus_files([root], say=lines.append) == before
    assert {p.relative_to(root).as_posix() for p in before} == {
        "doc0.txt", "doc1.txt", "doc2.txt", "notes/config.json", "notes/log.jsonl"}
    assert lines == ["excluding adapter (a LoRA adapter), ckpts (orbax checkpoints), clf (a "
                     "fine-tuning run directory), hf (a checkpoint) and 3 more from the data in "
                     f"{root}"]
    # eval's walk (.txt, .jsonl) leaves out the same: a run's metrics.jsonl is not a text record
    assert data_files([root]) == [root / "doc0.txt", root / "doc1.txt", root / "doc2.txt",
                                  root / "notes" / "log.jsonl"]


def test_output_kinds_and_a_root_that_is_an_output(tmp_path):
    make_outputs(tmp_path)
    kinds = {d: output_kind(tmp_path / d) for d in OUTPUTS}
    assert kinds == {"runs/old": "a run directory", "stopped": "a run directory",
                     "clf": "a fine-tuning run directory", "hf": "a checkpoint",
                     "adapter": "a LoRA adapter", "ckpts": "orbax checkpoints",
                     "token-cache": "a token cache"}
    assert output_kind(tmp_path / "runs") is None and output_kind(tmp_path / "missing") is None
    with pytest.raises(BridgeError, match=r"data: .*old is a run directory written by this "
                                          r"project, not data"):
        data.corpus_files([tmp_path / "runs" / "old"])
    # Named directly, a run's file is read like any other file.
    assert data.corpus_files([tmp_path / "runs" / "old" / "metrics.jsonl"])


def test_nothing_left_but_run_outputs_is_refused_naming_the_directory(tmp_path):
    root = tmp_path / "data"
    make_outputs(root)
    with pytest.raises(BridgeError) as e:
        data.corpus_files([root], say=lambda line: None)
    assert e.value.field == "data" and str(e.value).startswith(
        f"data: {root}: no data files are left once the run outputs in it are excluded (")
    (root / "empty").mkdir()  # no files at all: the plain message
    with pytest.raises(BridgeError, match="no text files found"):
        data.corpus_files([root / "empty"])


def test_an_output_that_is_or_holds_an_input_is_refused(tmp_path):
    root = write_corpus(tmp_path / "data")
    for out, data_path, word in [(root, root, "is"), (tmp_path, root, "holds"),
                                 (tmp_path, root / "doc0.txt", "holds")]:
        with pytest.raises(BridgeError) as e:
            data.corpus_files([data_path], out=out)
        assert e.value.field == "out"
        assert str(e.value) == (f"out: {out} {word} {data_path}, an input of the run; write the "
                                f"output to a directory of its own")
    check_out_apart(root / "run", [root, None])  # inside the data: allowed (and left out)
    lines = []
    assert files_under(root, {".txt"}, out=root / "run",
                       say=lines.append) == sorted(root.glob("*.txt"))
    assert lines == [f"excluding run (this run's output) from the data in {root}"]


TRAIN_FLAGS = ["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--warmup-steps", "0",
               "--eval-every", "1", "--checkpoint-every", "1",
               "--sample-tokens", "0"]


@pytest.fixture
def byte_tokenizer(tmp_path) -> Path:
    ByteTokenizer().save(tmp_path / "tokenizer")
    return tmp_path / "tokenizer"


def test_a_second_run_trains_on_the_same_files_as_the_first(tmp_path, byte_tokenizer, capsys):
    """Two runs whose --out lies inside the --data directory: the second sees the first's run
    directory and the token cache both wrote there, and trains on exactly the first's files
    (the token cache's key is the files' paths, sizes and times: one entry for both runs)."""
    root = write_corpus(tmp_path / "data")
    files = data.corpus_files([root])

    def train(name: str) -> tuple[str, str]:
        assert cli.main(["train", "--data", str(root), "--out", str(root / name), "--tokenizer",
                         str(byte_tokenizer), *TRAIN_FLAGS]) == 0
        err = capsys.readouterr().err
        excluding = [line for line in err.splitlines() if line.startswith("excluding")]
        tokens = re.search(r"(?<![\d,])[\d,]+ tokens \([\d,]+ train, [\d,]+ validation\)", err)
        assert len(excluding) == 1 and tokens, err
        return excluding[0], tokens.group(0)

    excluding, tokens = train("run")
    assert excluding == f"excluding run (this run's output) from the data in {root}"
    # Without the exclusion the second run would read the first's files.
    leaked = {p.relative_to(root).as_posix() for p in naive_files(root)} - {
        p.relative_to(root).as_posix() for p in files}
    assert {"run/run.json", "run/metrics.jsonl", "run/tokenizer/tokenizer.json",
            "run/model/config.json"} <= leaked and any(p.startswith("token-cache/") for p in leaked)

    excluding, tokens_again = train("run2")
    assert excluding == (f"excluding run (a run directory), run2 (this run's output), token-cache "
                         f"(a token cache) from the data in {root}")
    assert tokens_again == tokens
    assert len(list((root / "token-cache").glob("tokens-*.json"))) == 1
    assert data.corpus_files([root], out=root / "run2", say=lambda line: None) == files
    # eval walks the same directory: the runs' metrics.jsonl files are not read as text records
    assert cli.main(["eval", str(root / "run" / "model"), "--data", str(root), "--json",
                     "--seq-len", "16", "--batch-size", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(report["files"]) == sorted(str(f) for f in files)


@pytest.mark.parametrize("layout", ["out is data", "data inside out"])
def test_train_refuses_an_out_over_its_data_before_writing(tmp_path, byte_tokenizer, capsys,
                                                           layout):
    root = write_corpus(tmp_path / "data")
    out, data_arg = (root, root) if layout == "out is data" else (tmp_path, root)
    listing = sorted(tmp_path.rglob("*"))
    assert cli.main(["train", "--data", str(data_arg), "--out", str(out), "--tokenizer",
                     str(byte_tokenizer), *TRAIN_FLAGS]) == 2
    err = capsys.readouterr().err.strip()
    word = "is" if layout == "out is data" else "holds"
    assert err == (f"error: --out: {out} {word} {data_arg}, an input of the run; write the output "
                   f"to a directory of its own")
    assert sorted(tmp_path.rglob("*")) == listing  # nothing written: no run, no token cache


def test_sft_and_finetune_refuse_an_out_holding_their_files(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "chats.jsonl").write_text(json.dumps({"prompt": "hi", "completion": "yo"}) + "\n")
    assert cli.main(["sft", "--data", str(out / "chats.jsonl"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --out: {out} holds {out / 'chats.jsonl'}, an input of the run; write the output "
        f"to a directory of its own")
    (out / "train.txt").write_text("0 ||| a\n")
    (tmp_path / "dev.txt").write_text("0 ||| b\n")
    (tmp_path / "labels.json").write_text('["x", "y"]')
    assert cli.main(["finetune", "--train", str(out / "train.txt"),
                     "--dev", str(tmp_path / "dev.txt"), "--labels", str(tmp_path / "labels.json"),
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out: {out} holds {out / 'train.txt'}, an input"), err
    assert sorted(p.name for p in out.iterdir()) == ["chats.jsonl", "train.txt"]
