"""Sliding-window perplexity: the window plan (tasks.evaluation), the two twins against
transformers' guide and against a direct computation, batching, the report and the eval commands'
bad input."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_llama
import torch_llama
from bridge.convert import convert
from tasks.evaluation import Text, Window, plan_windows, read_texts, tokenize, window_settings
from bridge.tokenizer import ByteTokenizer
from conftest import real_tokenizer, save_random_checkpoint, small_config
from jax_llama.eval import evaluate as jax_evaluate
from llama_twins.cli import main as jax_cli, torch_main as torch_cli
from torch_llama.eval import evaluate as torch_evaluate

ROOT = Path(__file__).resolve().parents[1]
CONFIG = small_config(vocab_size=259, max_seq_len=64)  # the byte tokenizer's 259 ids
# 157 bytes in 146 characters (multi-byte é, ï, ü, —, 東京): 158 byte-tokenizer tokens.
TEXT = ("Perplexity of fixed-length models: a window of tokens slides along the text — café, "
        "naïve, über, 東京 — and each token is scored once, with context.")
# Per-token means of ~5.6 nats over ~157 tokens from float32 logits: the twins and transformers
# sum the same products in other orders, a few ulps (1.2e-7 relative) per value through 2 layers,
# and the three means came out within 9e-8 of each other. 1e-6 relative is ten times that, and
# still a hundredth of what 4 fewer tokens of context change here (the negative case below).
FLOAT32 = dict(rtol=1e-6, atol=0)


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documents(*texts: str):
    return tokenize([Text(f"doc{i}.txt", f"doc{i}.txt", t) for i, t in enumerate(texts)],
                    ByteTokenizer())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("eval") / "ckpt", CONFIG, seed=3,
                                  tokenizer=True)


@pytest.fixture(scope="module")
def twins(ckpt):
    return jax_llama.load(ckpt), torch_llama.load(ckpt, device="cpu")


# -- the window plan -------------------------------------------------------------------------------

def test_window_plan_by_hand():
    # seq_len 4, stride 2: 2 tokens of context after the first window; the last reaches the end
    assert plan_windows(10, 4, 2) == [Window(0, 4, 3), Window(2, 6, 2), Window(4, 8, 2),
                                      Window(6, 10, 2)]
    # stride 3 on 11 tokens: a final window of 2 tokens that scores its last one
    assert plan_windows(11, 4, 3) == [Window(0, 4, 3), Window(3, 7, 3), Window(6, 10, 3),
                                      Window(9, 11, 1)]
    # stride = seq_len: disjoint windows; each window's first token has nothing before it, and
    # a last window of one token would score nothing, so it is left out
    assert plan_windows(9, 4, 4) == [Window(0, 4, 3), Window(4, 8, 3)]
    assert plan_windows(3, 8, 4) == [Window(0, 3, 2)]  # shorter than a window: one window


@settings(max_examples=300, deadline=None, database=None)
@given(st.integers(2, 400), st.integers(2, 64), st.data())
def test_window_plan_scores_each_token_once(n_tokens, seq_len, data):
    stride = data.draw(st.integers(1, seq_len), label="stride")
    windows = plan_windows(n_tokens, seq_len, stride)
    times = np.zeros(n_tokens, int)
    for i, (begin, end, n_scored) in enumerate(windows):
        assert begin % stride == 0 and 0 < end - begin <= seq_len and 0 < n_scored < end - begin
        times[end - n_scored:end] += 1
        if i > 0:  # context: what the previous windows already scored, up to seq_len - stride
            assert end - n_scored - begin <= max(seq_len - stride, 1)
    # the windows reach the end (but for a last one-token window, which would score nothing)
    assert windows[-1].end == n_tokens or (stride == seq_len and windows[-1].end == n_tokens - 1)
    assert times[0] == 0  # the first token is never scored: nothing comes before it
    if stride < seq_len:
        assert (times[1:] == 1).all()
    else:  # disjoint windows: all but each window's first token
        np.testing.assert_array_equal(times, (np.arange(n_tokens) % seq_len != 0).astype(int))


def test_window_settings_defaults():
    assert window_settings(64) == (64, 32)
    assert window_settings(131072) == (1024, 512)   # at most 1024 by default
    assert window_settings(64, 16, 16) == (16, 16)


# -- the twins against transformers and against a direct computation ------------------------------

@pytest.fixture(scope="module")
def hf_dir(ckpt, tmp_path_factory) -> Path:
    return convert(ckpt, tmp_path_factory.mktemp("eval-hf") / "hf", to="hf", progress=False)


@pytest.mark.parametrize("seq_len, stride", [(32, 12), (24, 24), (64, 20)])
def test_jax_torch_and_transformers_agree(twins, hf_dir, seq_len, stride):
    import transformers

    (model, params), tmodel = twins
    docs = documents(TEXT)
    ours = [jax_evaluate(model, params, docs, seq_len, stride, batch_size=4),
            torch_evaluate(tmodel, docs, seq_len, stride, batch_size=4)]
    # transformers' side: its own tokenizer from the HF export gives the very same ids
    hf_ids = transformers.AutoTokenizer.from_pretrained(hf_dir)(TEXT, return_tensors="pt").input_ids
    np.testing.assert_array_equal(hf_ids[0].numpy(), docs[0].ids)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    nll, n_tokens = load_script("eval_transformers").guide_nll(hf_model, hf_ids, seq_len, stride)
    n = len(docs[0].ids)  # BOS and the 157 bytes
    # every token but the first; with disjoint windows, every token but each window's first
    expected_tokens = n - 1 if stride < seq_len else n - len(range(0, n, seq_len))
    assert n_tokens == expected_tokens
    for report in ours:
        assert report["tokens"] == n_tokens
        np.testing.assert_allclose(report["nll_per_token"], nll / n_tokens, **FLOAT32)
        np.testing.assert_allclose(report["perplexity"], math.exp(nll / n_tokens), **FLOAT32)
    # The comparison can fail: 4 fewer tokens of context move the figure far beyond the tolerance.
    if stride == 12:
        other = jax_evaluate(model, params, docs, seq_len, stride + 4, batch_size=4)
        assert abs(other["nll_per_token"] / ours[0]["nll_per_token"] - 1) > 100 * FLOAT32["rtol"]


def test_a_window_longer_than_the_text_is_one_full_forward_pass(twins):
    (model, params), tmodel = twins
    docs = documents(TEXT[:40])  # 41 tokens with BOS, less than seq_len 64
    ids = docs[0].ids
    logits = np.asarray(model.apply({"params": params}, ids[None]), np.float64)[0]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    direct = -logp[np.arange(len(ids) - 1), ids[1:]].sum()
    for report in (jax_evaluate(model, params, docs, 64, 32), torch_evaluate(tmodel, docs, 64, 32)):
        assert report["tokens"] == len(ids) - 1
        # one float32 forward pass, its log-softmax in float32 here and float64 above
        np.testing.assert_allclose(report["nll"], direct, rtol=2e-6, atol=0)


def test_uniform_model_has_perplexity_of_the_vocabulary(twins):
    """All-zero weights give equal logits: every token costs ln V nats, whatever the windows."""
    (model, params), _ = twins
    zeros = jax.tree_util.tree_map(np.zeros_like, params)
    docs = documents(TEXT, TEXT[:30])
    report = jax_evaluate(model, zeros, docs, 16, 5, batch_size=3)
    assert report["tokens"] == len(TEXT.encode()) + 30
    np.testing.assert_allclose(report["nll_per_token"], math.log(259), rtol=1e-6, atol=0)
    np.testing.assert_allclose(report["perplexity"], 259, rtol=1e-5, atol=0)
    n_bytes = len(TEXT.encode()) + 30
    np.testing.assert_allclose(report["bits_per_byte"],
                               report["tokens"] * math.log2(259) / n_bytes, rtol=1e-6, atol=0)


@pytest.mark.parametrize("twin", ["jax", "torch"])
def test_batch_size_does_not_change_the_numbers(twins, twin):
    (model, params), tmodel = twins
    # 158 and 61 tokens at seq_len 16, stride 6: full windows, short last windows, padded rows
    docs = documents(TEXT, TEXT[:60])
    run = ((lambda b: jax_evaluate(model, params, docs, 16, 6, batch_size=b)) if twin == "jax"
           else (lambda b: torch_evaluate(tmodel, docs, 16, 6, batch_size=b)))
    one, four, three = run(1), run(4), run(3)
    for other in (four, three):
        assert other["tokens"] == one["tokens"]
        # the same float32 products, batched in other shapes (matmul blocking may differ)
        np.testing.assert_allclose(other["nll"], one["nll"], rtol=1e-6, atol=0)
        for path in one["files"]:
            np.testing.assert_allclose(other["files"][path]["nll"], one["files"][path]["nll"],
                                       rtol=1e-6, atol=0)


# -- the commands ----------------------------------------------------------------------------------

KEYS = {"nll_per_token", "perplexity", "tokens", "bits_per_byte", "seconds"}


def test_json_contract_and_table(ckpt, tmp_path, capsys):
    (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "b.jsonl").write_text(
        json.dumps({"text": TEXT[:50]}) + "\n\n" + json.dumps({"text": TEXT[50:]}) + "\n")
    (tmp_path / "dir" / "skipped.bin").write_bytes(b"\0\1")  # not .txt / .jsonl: not looked at
    argv = ["eval", str(ckpt), "--data", str(tmp_path / "a.txt"), str(tmp_path / "dir"),
            "--seq-len", "32", "--stride", "16", "--json"]
    reports = []
    for main in (jax_cli.main, torch_cli.main):
        assert main(argv) == 0
        captured = capsys.readouterr()
        reports.append(json.loads(captured.out))  # one JSON object, nothing else on stdout
        assert "window" in captured.err  # the progress bar
    for report in reports:
        assert KEYS <= set(report) and report["seq_len"] == 32 and report["stride"] == 16
        files = report["files"]
        assert list(files) == [str(tmp_path / "a.txt"), str(tmp_path / "dir" / "b.jsonl")]
        assert all(KEYS <= set(f) for f in files.values())
        assert report["tokens"] == sum(f["tokens"] for f in files.values())
        # each jsonl record is its own document: its first token (BOS) unscored, its text scored
        assert files[str(tmp_path / "dir" / "b.jsonl")]["tokens"] == len(TEXT[:50].encode()) + len(
            TEXT[50:].encode())
        np.testing.assert_allclose(report["perplexity"], math.exp(report["nll_per_token"]),
                                   rtol=1e-12, atol=0)
    np.testing.assert_allclose(reports[0]["nll"], reports[1]["nll"], **FLOAT32)  # the twins agree
    assert jax_cli.main(argv[:-1]) == 0
    table = capsys.readouterr().out
    assert "perplexity" in table and "a.txt" in table and "all (2 files)" in table


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "binary.txt").write_bytes(b"PK\x03\x04\x00\x00")
    (d / "empty.txt").write_text("")
    (d / "no_text.jsonl").write_text('{"content": "x"}\n')
    (d / "empty_dir").mkdir()
    (d / "ok.txt").write_text(TEXT)
    return d


BAD_INPUT = [  # the arguments after CKPT, and the line (in {d}: the directory of bad files)
    ("--data {d}/latin1.txt", "--data: {d}/latin1.txt: not UTF-8 text (byte 0xe9 at offset 3)"),
    ("--data {d}/binary.txt", "--data: {d}/binary.txt: not a text file (a NUL byte at offset 4)"),
    ("--data {d}/empty_dir", "--data: {d}/empty_dir: no .txt or .jsonl files in this directory"),
    ("--data {d}/missing.txt", "--data: {d}/missing.txt: no such file or directory"),
    ("--data {d}/empty.txt", "--data: {d}/empty.txt: 1 token(s); at least 2 are needed"),
    ("--data {d}/no_text.jsonl",
     '--data: {d}/no_text.jsonl:1: expected an object with a string field "text"'),
    ("--data {d}/ok.txt --seq-len 16 --stride 17",
     "--stride: must be from 1 to the window length, 16 (got 17)"),
    ("--data {d}/ok.txt --stride 0", "--stride: must be from 1 to the window length, 64 (got 0)"),
    ("--data {d}/ok.txt --seq-len 65", "--seq-len: 65 is more than the checkpoint's max_seq_len 64"),
    ("--data {d}/ok.txt --batch-size 0", "--batch-size: must be a positive integer (got 0)"),
]


@pytest.mark.parametrize("main", [jax_cli.main, torch_cli.main], ids=["jax", "torch"])
@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_is_one_line_naming_it_and_exit_2(ckpt, bad_files, main, args, message, capsys):
    assert main(["eval", str(ckpt), *args.format(d=bad_files).split()]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: " + message.format(d=bad_files)), err


# -- a real tokenizer: bits per byte counts UTF-8 bytes --------------------------------------------

def test_bits_per_byte_counts_utf8_bytes_with_a_real_tokenizer(tmp_path, capsys):
    tokenizer = real_tokenizer("llama2")
    config = small_config(vocab_size=tokenizer.vocab_size, max_seq_len=64)
    ckpt = save_random_checkpoint(tmp_path / "ckpt", config, seed=1)
    tokenizer.save(ckpt)
    text = "Ünïcödé text — 東京, Zürich, naïve café. " * 3
    assert len(text.encode("utf-8")) > len(text) + 30
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    assert jax_cli.main(["eval", str(ckpt), "--data", str(tmp_path / "t.txt"), "--seq-len", "32",
                         "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ids = tokenizer.encode(text, bos=True)
    assert ids[0] == tokenizer.bos_id and report["tokens"] == len(ids) - 1  # BOS first, unscored
    assert report["bytes"] == len(text.encode("utf-8"))
    np.testing.assert_allclose(report["bits_per_byte"],
                               report["nll"] / math.log(2) / len(text.encode("utf-8")),
                               rtol=1e-12, atol=0)


def test_read_texts_keeps_the_bytes_of_the_file(tmp_path):
    (tmp_path / "crlf.txt").write_bytes("a\r\nb é\r\n".encode())
    [text] = read_texts([tmp_path / "crlf.txt"])
    assert text.text == "a\r\nb é\r\n" and text.n_bytes == 9
