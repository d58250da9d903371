"""The lm-evaluation-harness model `jax-llama` (jax_llama.harness) against lm-eval's own `hf`
model on the converted checkpoint: a local multiple-choice task through lm_eval.simple_evaluate
(same accuracy, same per-example log-likelihoods), generate_until (same greedy text, cut at the
stop string), loglikelihood_rolling against `jax-llama eval`, and an unknown task refused by
`python -m jax_llama.harness` in one line, exit 2. Offline: the task is a YAML over a JSONL file
in tmp_path, and the datasets cache lives there too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jax_llama
from bridge.convert import convert
from bridge.tokenizer import ByteTokenizer
from conftest import small_config

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")
pytest.importorskip("transformers", reason="lm-eval's hf model needs transformers")
from lm_eval.api.instance import Instance  # noqa: E402

from jax_llama.harness import JaxLlamaLM  # noqa: E402  (registers "jax-llama")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = small_config(vocab_size=259, max_seq_len=128)  # the byte tokenizer's 259 ids
# Per-choice log-likelihoods are sums of 5-30 float32 log-softmax values of about -3 to -20:
# XLA and torch reach each through differently ordered float32 matmuls (a few ulps, ~1e-7
# relative, per value through 2 layers); the largest difference seen was 7.6e-6 absolute on
# sums near -45 (a few ulps of the sum). 2e-5 absolute + 1e-6 relative is about three times
# that, and ~1e4 times smaller than the gaps between choices that decide accuracy here (the
# sharpened head keeps the smallest at 0.18).
LOGLIKELIHOOD = dict(rtol=1e-6, atol=2e-5)
WORDS = ("apple river stone cloud candle tiger piano garden silver rocket window meadow "
         "lantern violin harbor pepper marble falcon copper orchard").split()


@pytest.fixture(autouse=True)
def offline_datasets(tmp_path_factory, monkeypatch):
    """datasets and the HF hub read and write only under a temporary directory, and never the
    network."""
    cache = tmp_path_factory.getbasetemp() / "hf-home"
    monkeypatch.setenv("HF_HOME", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def write_choice_task(directory: Path, n_items: int = 20, seed: int = 0,
                      name: str = "jl_choice") -> Path:
    """A multiple-choice task of n_items questions with 4 one-word answers each, as a JSONL file
    and the YAML task over it (lm-eval's `json` dataset builder, a local file); returns the
    directory, for TaskManager(include_path=...)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{name}.jsonl", "w") as f:
        for i in range(n_items):
            choices = [str(w) for w in rng.choice(WORDS, 4, replace=False)]
            f.write(json.dumps({"question": f"Item {i}: which word follows {choices[0][:3]}?",
                                "choices": choices, "label": int(rng.integers(4))}) + "\n")
    (directory / f"{name}.yaml").write_text(f"""\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / f"{name}.jsonl"}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(native, hf): a random model whose output head is scaled by 8, so that its log-likelihoods
    differ between choices by far more than float32 rounding (a random head gives near-uniform
    ones), with the byte tokenizer; and its `llama-bridge convert --to hf` copy."""
    root = tmp_path_factory.mktemp("harness")
    _, params = jax_llama.init(CONFIG, seed=5)
    params = {**params, "output": jax.tree_util.tree_map(lambda w: 8 * w, params["output"])}
    jax_llama.save(root / "native", CONFIG, params)
    ByteTokenizer().save(root / "native")
    convert(root / "native", root / "hf", to="hf", progress=False)
    return root / "native", root / "hf"


@pytest.fixture(scope="module")
def ours(checkpoints):
    return JaxLlamaLM(pretrained=str(checkpoints[0]), batch_size=4)


@pytest.fixture(scope="module")
def theirs(checkpoints):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(checkpoints[1]), dtype="float32", device="cpu", batch_size=4)


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_a_local_choice_task_matches_lm_evals_hf_model(ours, theirs, tmp_path):
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(write_choice_task(tmp_path / "tasks")),
                        include_defaults=False)
    runs = {name: lm_eval.simple_evaluate(model=lm, tasks=["jl_choice"], task_manager=tasks,
                                          log_samples=True, random_seed=0, numpy_random_seed=0,
                                          torch_random_seed=0, fewshot_random_seed=0)
            for name, lm in (("ours", ours), ("hf", theirs))}
    accuracy = {name: run["results"]["jl_choice"]["acc,none"] for name, run in runs.items()}
    assert accuracy["ours"] == accuracy["hf"]
    samples = {name: sorted(run["samples"]["jl_choice"], key=lambda s: s["doc_id"])
               for name, run in runs.items()}
    assert len(samples["ours"]) == len(samples["hf"]) == 20
    for a, b in zip(samples["ours"], samples["hf"]):
        assert a["doc_id"] == b["doc_id"] and a["acc"] == b["acc"]
        ll_a = np.array([float(r[0]) for r in a["filtered_resps"]])
        ll_b = np.array([float(r[0]) for r in b["filtered_resps"]])
        np.testing.assert_allclose(ll_a, ll_b, **LOGLIKELIHOOD)
        assert [bool(r[1]) for r in a["filtered_resps"]] == [bool(r[1]) for r in b["filtered_resps"]]
        assert np.array(a["resps"]).shape == np.array(b["resps"]).shape
        # the choices really are told apart: the gaps dwarf the tolerance
        assert np.min(np.abs(np.diff(np.sort(ll_a)))) > 1000 * LOGLIKELIHOOD["atol"]


def test_loglikelihood_splits_context_and_continuation_as_hf_does(ours, theirs):
    # trailing spaces move to the continuation; an empty context is the prefix token (BOS)
    args = [("The cat sat ", "on the mat"), ("", "Hello there"), ("x", " y"), ("Q: 2+2=", "4")]
    got = ours.loglikelihood(requests("loglikelihood", args), disable_tqdm=True)
    want = theirs.loglikelihood(requests("loglikelihood", args), disable_tqdm=True)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], **LOGLIKELIHOOD)
    assert [g[1] for g in got] == [w[1] for w in want]
    # negative case: scoring the continuation without its moved space is another number
    moved = ours.loglikelihood(requests("loglikelihood", [("The cat sat", "on the mat")]),
                               disable_tqdm=True)
    assert abs(moved[0][0] - got[0][0]) > 1.0


def test_generate_until_matches_hf_greedy_text_cut_at_the_stop(ours, theirs):
    prompts = ["Once upon a time", "The quick brown fox", "Q: what is 2+2?\nA:"]
    plain = {"until": [], "max_gen_toks": 24, "do_sample": False}
    full = ours.generate_until(requests("generate_until", [(p, plain) for p in prompts]),
                               disable_tqdm=True)
    assert full == theirs.generate_until(requests("generate_until", [(p, plain) for p in prompts]),
                                         disable_tqdm=True)
    # a stop string taken from the middle of each uncut text: the text ends just before it
    for prompt, text in zip(prompts, full):
        assert len(text) > 6, text
        stop = text[4:6]
        kwargs = {"until": [stop, "\u2603never"], "max_gen_toks": 24, "do_sample": False}
        cut = ours.generate_until(requests("generate_until", [(prompt, kwargs)]),
                                  disable_tqdm=True)
        assert cut == [text[:text.find(stop)]]
        assert cut == theirs.generate_until(requests("generate_until", [(prompt, kwargs)]),
                                            disable_tqdm=True)


def test_loglikelihood_rolling_is_jax_llama_eval(ours, checkpoints, tmp_path, capsys):
    from llama_twins.cli import main as jax_cli

    long = " ".join(WORDS * 12)  # 1,200 bytes: ten windows of 128 tokens
    short = "A short text fits in one window."
    (tmp_path / "long.txt").write_text(long)
    got = ours.loglikelihood_rolling(requests("loglikelihood_rolling", [(long,), (short,), ("",)]),
                                     disable_tqdm=True)
    assert jax_cli.main(["eval", str(checkpoints[0]), "--data", str(tmp_path / "long.txt"),
                         "--seq-len", "128", "--stride", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == len(long.encode())  # every byte scored, after the BOS
    # the same windows and the same scorer: equal up to the order of a float64 sum
    np.testing.assert_allclose(got[0], -report["nll"], rtol=1e-12, atol=0)
    # a text within one window is the log-likelihood of it after the prefix token
    once = ours.loglikelihood(requests("loglikelihood", [("", short)]), disable_tqdm=True)
    np.testing.assert_allclose(got[1], once[0][0], **LOGLIKELIHOOD)
    assert got[2] == 0.0


def test_an_unknown_task_is_one_line_and_exit_2(checkpoints, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "jax_llama.harness", "--model_args",
                             f"pretrained={checkpoints[0]}", "--tasks", "no_such_task_xyz"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no_such_task_xyz" in lines[0] and "--tasks" in lines[0], lines


def test_one_token_answers_share_a_row_and_batching_changes_nothing(ours, theirs, checkpoints):
    # "A".."D" after "Answer:" are one byte token each: four requests, one input row
    args = [("Question: pick one\nAnswer:", c) for c in "ABCD"] + [("Other:", "xy"), ("Q", "A")]
    got = ours.loglikelihood(requests("loglikelihood", args), disable_tqdm=True)
    want = theirs.loglikelihood(requests("loglikelihood", args), disable_tqdm=True)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], **LOGLIKELIHOOD)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert sum(g[1] for g in got[:4]) <= 1  # at most one of the four is the argmax
    one = JaxLlamaLM(pretrained=str(checkpoints[0]), batch_size=1)
    # batch 1 vs 4: the same rows through differently shaped float32 programs (XLA may block
    # the matmuls otherwise: a few ulps of the sum), so the tolerance of the twins' comparison
    np.testing.assert_allclose([g[0] for g in one.loglikelihood(
        requests("loglikelihood", args), disable_tqdm=True)], [g[0] for g in got],
        **LOGLIKELIHOOD)
