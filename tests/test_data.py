"""Corpus reading, the token cache, batches, and the unigram baseline."""

import math

import numpy as np
import pytest

from bridge.errors import BridgeError
from bridge.tokenizer import ByteTokenizer
from jax_llama.training import data


def test_default_corpus_is_the_standard_library():
    files = data.default_corpus()
    names = {f.name for f in files}
    assert {"os.py", "json", "argparse.py"} & names and len(files) > 300
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)


def test_corpus_files_skips_hidden_and_binary_suffixes(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("beta")
    (tmp_path / "img.png").write_bytes(b"\x89PNG")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "c.txt").write_text("hidden")
    assert [f.name for f in data.corpus_files([tmp_path])] == ["a.txt", "b.md"]
    with pytest.raises(BridgeError, match="no such file or directory"):
        data.corpus_files([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(BridgeError, match="no text files found"):
        data.corpus_files([tmp_path / "empty"])


def test_unreadable_files_are_skipped_and_counted(tmp_path):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "bad1.txt").write_bytes(b"\xff\xfe\xfa not utf-8")
    (tmp_path / "bad2.txt").write_bytes(b"\xc3\x28")
    warnings = []
    texts = list(data.read_documents(data.corpus_files([tmp_path]), warn=warnings.append))
    assert texts == ["fine"]
    assert len(warnings) == 1 and "skipped 2 unreadable or non-UTF-8 file(s)" in warnings[0]


def test_token_cache_frames_documents_and_is_reused(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("hi")
    (tmp_path / "b.txt").write_text("yo!")
    files = data.corpus_files([tmp_path])
    tok = ByteTokenizer()
    tokens = data.tokenize_corpus(files, tok, tmp_path / "cache")
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == [256, *b"hi", 257, 256, *b"yo!", 257]  # BOS text EOS per file

    def fail(*a, **k):
        raise AssertionError("tokenized again")
    monkeypatch.setattr(tok, "encode", fail)
    assert data.tokenize_corpus(files, tok, tmp_path / "cache").tolist() == tokens.tolist()
    (tmp_path / "b.txt").write_text("changed")  # a changed corpus is tokenized again
    with pytest.raises(AssertionError, match="tokenized again"):
        data.tokenize_corpus(files, tok, tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temp


def test_empty_corpus_is_refused(tmp_path):
    (tmp_path / "blank.txt").write_text("   \n")
    with pytest.raises(BridgeError, match="the corpus is empty"):
        data.tokenize_corpus(data.corpus_files([tmp_path]), ByteTokenizer(), tmp_path / "cache")


def test_batches_are_reproducible_shifted_windows():
    tokens = np.arange(1000, dtype=np.uint16) % 250
    tokens[::50] = 256  # BOS every 50 tokens
    b = data.Batches(tokens, batch_size=4, seq_len=16, seed=3, bos_id=256)
    first, again, other = b.batch(7), b.batch(7), b.batch(8)
    for k in first:
        np.testing.assert_array_equal(first[k], again[k])
    assert not np.array_equal(first["inputs"], other["inputs"])
    np.testing.assert_array_equal(first["inputs"][:, 1:], first["targets"][:, :-1])
    np.testing.assert_array_equal(first["mask"], (first["targets"] != 256).astype(np.float32))
    # Two processes take their own rows of the global batch: together, one process's 8 rows.
    hosts = [data.Batches(tokens, 4, 16, seed=3, process_index=i, bos_id=256, process_count=2)
             for i in range(2)]
    whole = data.Batches(tokens, 8, 16, seed=3, bos_id=256).batch(7)
    for k in whole:
        np.testing.assert_array_equal(np.concatenate([h.batch(7)[k] for h in hosts]), whole[k])
    assert not np.array_equal(hosts[0].batch(7)["inputs"], hosts[1].batch(7)["inputs"])


def test_split_and_too_small_corpus():
    train, val = data.split(np.arange(1000), 0.1, min_tokens=33)
    assert len(val) == 100 and len(train) == 900 and train[-1] + 1 == val[0]
    with pytest.raises(BridgeError, match="too few for windows of 600 tokens"):
        data.split(np.arange(1000), 0.1, min_tokens=600)
    # a part of exactly one window has one place for it, which Batches cannot draw from
    train, val = data.split(np.arange(100), 0.05, min_tokens=33)
    assert len(val) == 34
    data.Batches(val, batch_size=2, seq_len=32).batch(0)
    with pytest.raises(BridgeError, match="too few"):
        data.split(np.arange(67), 0.05, min_tokens=33)


def test_unigram_loss_by_hand():
    # Train counts [2, 1, 0] + 1 smoothing -> p = [3/6, 2/6, 1/6]; val tokens 0 and 2.
    loss = data.unigram_loss(np.array([0, 0, 1]), np.array([0, 2]), vocab_size=3)
    assert loss == pytest.approx(-(math.log(3 / 6) + math.log(1 / 6)) / 2, rel=1e-12)


# -- packing: rows of whole documents ----------------------------------------------------------

def corpus_of(lengths, bos=0, seed=0):
    """A flat token stream of documents of the given lengths, each starting with BOS."""
    rng = np.random.default_rng(seed)
    return np.concatenate([np.concatenate([[bos], rng.integers(1, 50, n - 1)]) for n in lengths]
                          ).astype(np.uint16)


def test_documents_are_found_at_each_bos():
    tokens = corpus_of([3, 5, 1, 4])
    assert data.documents(tokens, 0).tolist() == [[0, 3], [3, 5], [8, 1], [9, 4]]
    assert data.documents(tokens, None).tolist() == [[0, 13]]


def test_pack_keeps_documents_whole_unless_longer_than_a_row():
    lengths = [10, 3, 25, 7, 16, 1, 9]
    docs = data.documents(corpus_of(lengths), 0)
    rows = data.pack(docs, 16)
    pieces = sorted(piece for row in rows for piece in row)
    assert all(sum(n for _, n in row) <= 16 for row in rows)
    # every token exactly once: the pieces tile the stream
    assert pieces[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
    assert pieces[-1][0] + pieces[-1][1] == sum(lengths)
    # only the 25-token document is cut (into 16 + 9); the rest stay whole
    starts = {start for start, _ in pieces}
    doc_starts = set(docs[:, 0].tolist())
    assert starts - doc_starts == {13 + 16}
    assert len(rows) == 5  # 71 tokens in rows of 16: first-fit leaves one row's worth of room


def test_packed_batches_mask_every_target_across_a_boundary():
    tokens = corpus_of([6, 4, 9, 3, 2, 7], seed=1)  # BOS is 0, and so is the padding
    packed = data.PackedBatches(tokens, batch_size=3, seq_len=8, seed=0, bos_id=0)
    b = packed.batch(0)
    assert b["inputs"].shape == b["mask"].shape == b["segment_ids"].shape == (3, 8)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    order = np.random.default_rng([0, 0, 0]).permutation(len(packed.rows))
    for r in range(3):
        row = packed.rows[order[r]]
        # Only the targets inside a document count: n - 1 of each n-token piece.
        assert b["mask"][r].sum() == sum(n - 1 for _, n in row)
        assert not b["mask"][r][b["targets"][r] == 0].any()   # no BOS, no padding learned
        same = b["segment_ids"][r][1:] == b["segment_ids"][r][:-1]
        assert not (b["mask"][r][:-1].astype(bool) & ~same).any()  # never across a boundary
    assert packed.batch(0)["inputs"].tolist() == b["inputs"].tolist()  # a pure function of step
    assert packed.batch(1)["inputs"].tolist() != b["inputs"].tolist()
    assert 0 <= packed.padding() < 0.5
