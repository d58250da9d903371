"""The same seed gives the same bits, run to run: training (in separate processes), sampling in
both twins, and classification fine-tuning. A different seed gives a different draw, so the
equalities are not equalities of constants."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jax_llama
import torch_llama
from bridge.sampling import Sampler
from conftest import save_random_checkpoint, small_config
from test_classify import synthetic_lines
from llama_twins.cli import main as jax_cli
from jax_llama.inference.generate import generate as jax_generate
from torch_llama.generate import generate as torch_generate

WORDS = "the a cat dog sat ran on under mat log red big small quietly".split()
# Figures of a step that depend on the clock, not on the seed.
TIMING = ("tokens_per_s", "seconds")


def _records(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in path.read_text().splitlines()]


def test_two_training_runs_with_one_seed_give_identical_bytes(tmp_path):
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS, size=6)) + "." for _ in range(300)))
    # Two processes at once, each with its own token cache: nothing is shared but the inputs.
    # No --tokenizer, so the BPE trained on the corpus must come out the same too.
    runs = [tmp_path / name / "run" for name in ("a", "b")]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "llama_twins.cli.main", "train", "--data", str(corpus), "--vocab-size", "300",
         "--steps", "20", "--batch-size", "4", "--seq-len", "32", "--eval-every", "10",
         "--checkpoint-every", "20", "--sample-tokens", "0", "--seed", "3",
         "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for out in runs]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-2000:]
    a, b = ([_records(run / "metrics.jsonl") for run in runs])
    assert len(a) == 20 and a == b
    assert a[-1]["loss"] < a[0]["loss"]  # it trained, so the weights moved from their init
    for name in ("model/model.safetensors", "model/tokenizer.json", "run.json"):
        assert (runs[0] / name).read_bytes() == (runs[1] / name).read_bytes(), name


# -- sampling ---------------------------------------------------------------------------------------

SAMPLER = Sampler(temperature=0.9, top_k=40, top_p=0.95)
PROMPTS = [[1, 5, 9, 2], [7, 3]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "model", small_config())


def test_jax_sampling_repeats_under_a_seed(checkpoint):
    model, params = jax_llama.load(checkpoint)
    draws = {seed: [jax_generate(model, params, PROMPTS, 24, SAMPLER, seed=seed).tokens
                    for _ in range(2)] for seed in (1, 2)}
    assert draws[1][0] == draws[1][1] and draws[2][0] == draws[2][1]
    # Near-uniform logits over 97 tokens: two seeds agreeing on 48 draws is ~impossible.
    assert draws[1][0] != draws[2][0]
    assert all(len(row) == 24 for row in draws[1][0])


def test_torch_sampling_repeats_under_a_seed(checkpoint):
    model = torch_llama.load(checkpoint, device="cpu")
    draws = {seed: [torch_generate(model, PROMPTS, 24, SAMPLER, seed=seed).tokens
                    for _ in range(2)] for seed in (1, 2)}
    assert draws[1][0] == draws[1][1] and draws[2][0] == draws[2][1]
    assert draws[1][0] != draws[2][0]
    assert all(len(row) == 24 for row in draws[1][0])


# -- classification fine-tuning ----------------------------------------------------------------------

def test_two_finetunes_with_one_seed_give_identical_metrics(tmp_path, capsys):
    (tmp_path / "train.txt").write_text(synthetic_lines(48, seed=0))
    (tmp_path / "dev.txt").write_text(synthetic_lines(16, seed=1))
    (tmp_path / "labels.json").write_text('["negative", "positive"]')

    def finetune(name: str, seed: int) -> list[dict]:
        assert jax_cli.main(["finetune", "--train", str(tmp_path / "train.txt"), "--dev",
                             str(tmp_path / "dev.txt"), "--labels", str(tmp_path / "labels.json"),
                             "--out", str(tmp_path / name), "--vocab-size", "280", "--epochs", "2",
                             "--batch-size", "8", "--max-len", "16", "--seed", str(seed)]) == 0
        return _records(tmp_path / name / "metrics.jsonl")

    first, again, other = finetune("a", 5), finetune("b", 5), finetune("c", 6)
    assert [r["epoch"] for r in first if "epoch" in r] == [1, 2]
    first, again = ([{k: v for k, v in r.items() if k not in ("tokens_per_s", "seconds")}
                     for r in records] for records in (first, again))
    assert first == again  # losses are floats compared exactly
    assert (tmp_path / "a" / "dev_predictions.txt").read_text() == \
        (tmp_path / "b" / "dev_predictions.txt").read_text()
    # dropout, init and batch order follow the seed: another seed gives another loss
    assert [r["loss"] for r in other] != [r["loss"] for r in first]
