"""`llama-bridge parity`: a healthy checkpoint passes in float32 (against transformers too) and in
bfloat16; one corrupted tensor in the torch twin fails the report, which names the block; bad
input exits 2 with one line. Three full reports in all (~10 s each on 2 cores): each test asserts
all it can about the one it runs."""

import json
import sys

import numpy as np
import pytest
import torch

import torch_llama
from llama_twins import bridge_cli
from llama_twins import parity
from bridge.formats.hf import config_to_hf
from conftest import save_random_checkpoint, small_config

TORCH_FIGURES = {"hidden after block 0", "hidden after block 1", "logits", "KL, max over positions",
                 "KL, mean over positions", "greedy tokens, first difference", "loss, one step",
                 "gradient norm", "gradients", "parameters after 10 AdamW steps"}
REFERENCE_FIGURES = {"hidden after block 0", "hidden after block 1", "logits",
                     "KL, max over positions", "KL, mean over positions"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """small_config: 2 layers, dim 48, 6 heads / 2 kv heads, vocab 97, max_seq_len 64."""
    return save_random_checkpoint(tmp_path_factory.mktemp("parity") / "ckpt", small_config())


@pytest.fixture(scope="module")
def corrupted(checkpoint):
    """(report, torch model): the torch twin with 0.01 added to one weight of block 1's down
    projection (its entries are ~0.01), the JAX side loaded clean from the checkpoint."""
    tmodel = torch_llama.load(checkpoint, device="cpu")
    with torch.no_grad():
        tmodel.layers[1].feed_forward.w2.weight[3, 5] += 0.01
    return parity.parity_report(checkpoint, torch_model=tmodel), tmodel


def by_figure(report, compared="torch vs JAX") -> dict:
    return {c["figure"]: c for c in report["checks"] if c["compared"] == compared}


def test_float32_passes_against_torch_and_transformers_as_json(checkpoint, capsys):
    pytest.importorskip("transformers")
    argv = ["parity", str(checkpoint), "--reference", "transformers", "--json"]
    assert bridge_cli.main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["passed"] and report["reference"] == {"name": "transformers", "status": "ok",
                                                         "reason": None}
    assert set(by_figure(report)) == TORCH_FIGURES
    assert set(by_figure(report, "transformers vs JAX")) == REFERENCE_FIGURES
    assert report["first_divergence"] == {"torch vs JAX": None, "transformers vs JAX": None}
    for c in report["checks"]:
        assert c["ok"] and (c["value"] is None or 0 <= c["value"] <= c["tolerance"]), c
    greedy = by_figure(report)["greedy tokens, first difference"]
    assert [len(row["jax"]) for row in greedy["rows"]] == [16, 16]
    assert "forward pass in transformers.LlamaForCausalLM" in captured.err  # progress on stderr


def test_bfloat16_passes_and_a_missing_transformers_is_skipped(checkpoint, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    argv = ["parity", str(checkpoint), "--dtype", "bfloat16", "--reference", "transformers"]
    assert bridge_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"parity of {checkpoint}: bfloat16, 2 x 16 random tokens (seed 0)")
    rows = [line.split() for line in out.splitlines()[2:12]]  # the table, under its header
    assert len(rows) == len(TORCH_FIGURES) and all("ok" in row for row in rows)
    assert "reference transformers: skipped (transformers is not importable" in out
    assert out.rstrip().endswith("parity: ok, every figure within tolerance")


def test_a_corrupted_torch_tensor_fails_and_names_its_block(corrupted):
    report, _ = corrupted
    figures = by_figure(report)
    assert not report["passed"] and report["first_divergence"] == {"torch vs JAX": 1}
    assert figures["hidden after block 0"]["ok"]  # block 0 is untouched: still within 1e-5
    for name in ("hidden after block 1", "logits", "KL, max over positions", "gradients"):
        assert not figures[name]["ok"], name
    # caught with room to spare: one weight (of the 3,840 in w2) moves block 1 by ~400x tolerance
    block_1 = figures["hidden after block 1"]
    assert block_1["value"] > 10 * block_1["tolerance"]
    assert "first divergence (torch vs JAX): block 1" in parity.format_parity_report(report)


def test_the_torch_model_given_is_not_trained(corrupted, checkpoint):
    _, tmodel = corrupted
    clean = torch_llama.load(checkpoint, device="cpu").state_dict()
    changed = [name for name, t in tmodel.state_dict().items() if not torch.equal(t, clean[name])]
    assert changed == ["layers.1.feed_forward.w2.weight"]  # only our corruption, no AdamW steps


@pytest.mark.parametrize("as_json", [False, True])
def test_a_failing_report_exits_1(corrupted, checkpoint, monkeypatch, capsys, as_json):
    """The CLI on the corrupted report (parity_report is swapped for one returning it: the CLI
    loads the torch twin from the checkpoint, which a corruption on disk would also feed JAX)."""
    monkeypatch.setattr(parity, "parity_report", lambda *args, **kwargs: corrupted[0])
    assert bridge_cli.main(["parity", str(checkpoint)] + ["--json"] * as_json) == 1
    out = capsys.readouterr().out
    if as_json:
        assert json.loads(out)["first_divergence"] == {"torch vs JAX": 1}
    else:
        assert "first divergence (torch vs JAX): block 1" in out and "parity: FAIL" in out


def test_nan_fails_the_check_it_lands_in():
    assert not parity._check("x", "y", float("nan"), 1.0)["ok"]
    assert parity._difference("x", "y", np.ones(3), np.full(3, np.nan), 1.0)["ok"] is False


@pytest.mark.parametrize("args, message", [
    (["--dtype", "float16"], "error: --dtype: expected one of float32, bfloat16, got 'float16'"),
    (["--batch", "0"], "error: --batch: must be at least 1 (got 0)"),
    (["--seq-len", "65"], "error: --seq-len: 65 exceeds the checkpoint's max_seq_len 64"),
    (["--seq-len", "1"], "error: --seq-len: must be at least 2 (got 1)"),
    (["--new-tokens", "-1"], "error: --new-tokens: must be at least 0 (got -1)"),
    (["--reference", "llama.cpp"],
     "error: --reference: expected one of transformers, got 'llama.cpp'"),
])
def test_bad_arguments_exit_2_with_one_line(checkpoint, args, message, capsys):
    assert bridge_cli.main(["parity", str(checkpoint)] + args) == 2
    assert capsys.readouterr().err == message + "\n"


def test_unsupported_checkpoint_exits_2_naming_the_field(tmp_path, capsys):
    assert bridge_cli.main(["parity", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nothing'}: no such file or directory\n"
    hf_config = dict(config_to_hf(small_config(), "float32"), hidden_act="gelu")
    (tmp_path / "config.json").write_text(json.dumps(hf_config))  # a Hugging Face checkpoint
    assert bridge_cli.main(["parity", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path}/config.json: hidden_act='gelu' is not supported")
    assert err.count("\n") == 1
