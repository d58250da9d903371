"""Sequence classification: pooling on the last real token, the two twins' classifiers, the
classifier directory, fine-tuning, zero-shot scoring, the data format, and the CLI commands
(finetune, predict, zero-shot, split, train's label stripping)."""

import functools
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_llama
import torch_llama
from tasks.classification import read_examples, read_labels, strip_labels, truncate_left
from bridge.inputs import pad_rows
from bridge.tokenizer import ByteTokenizer, train_tokenizer
from conftest import SHARED, save_random_checkpoint, small_config
from jax_llama import classify
from jax_llama.training import finetune as finetune_lib
from llama_twins.cli import main as jax_cli
from jax_llama.model.heads import LlamaClassifier
from jax_llama.model.heads import last_real_index as jax_last_real_index
from jax_llama.training import data
from jax_llama.model import Llama
from jax_llama.training.step import (TrainConfig, init_state, jit_train_step, lm_loss, lr_schedule,
                             make_optimizer, make_train_step)
from torch_llama.heads import last_real_index as torch_last_real_index

SHARED_DATA = SHARED / "data"
LABELS = ["negative", "neutral", "positive"]


def pad_batch(rows: list[list[int]], sides: list[str], length: int, seed: int = 0):
    """(tokens (B, length) int32, mask (B, length) bool): each row padded on its side ('left',
    'right' or 'none' when it fills the length) with random ids, so padding content that leaks
    into a result changes it."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (len(rows), length)).astype(np.int32)
    mask = np.zeros((len(rows), length), bool)
    for i, (row, side) in enumerate(zip(rows, sides)):
        assert side != "none" or len(row) == length
        start = length - len(row) if side == "left" else 0
        tokens[i, start:start + len(row)] = row
        mask[i, start:start + len(row)] = True
    return tokens, mask


def decisive_head(params: dict, n_classes: int, seed: int = 0) -> dict:
    """params with the head's N(0, 0.02) init replaced by N(0, 0.5), so that the log-probabilities
    are far from uniform and a wrong hidden state or head cannot pass a comparison by accident."""
    rng = np.random.default_rng(seed)
    dim = params["classifier"]["kernel"].shape[0]
    head = {"kernel": jnp.asarray(rng.normal(0, 0.5, (dim, n_classes)), jnp.float32),
            "bias": jnp.asarray(rng.normal(0, 0.5, n_classes), jnp.float32)}
    return {**params, "classifier": head}


# -- pooling: the last real token, wherever the padding is ------------------------------------------

def test_last_real_index_under_left_right_and_no_padding():
    masks = np.array([[0, 0, 1, 1, 1, 1],   # left-padded
                      [1, 1, 1, 0, 0, 0],   # right-padded
                      [1, 1, 1, 1, 1, 1],   # no padding
                      [0, 1, 1, 1, 0, 0],   # both sides
                      [1, 0, 0, 0, 0, 0]],  # one real token, at the front
                     dtype=bool)
    expected = [5, 2, 5, 3, 0]
    assert np.asarray(jax_last_real_index(masks)).tolist() == expected
    assert torch_last_real_index(torch.from_numpy(masks)).tolist() == expected
    assert torch_last_real_index(torch.from_numpy(masks.astype(np.int64))).tolist() == expected


@pytest.fixture(scope="module")
def pooled_classifier():
    config = small_config(vocab_size=259)
    model = LlamaClassifier(config, len(LABELS))
    params = model.init(jax.random.key(3), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool))
    return config, model, decisive_head(params["params"], len(LABELS), seed=3)


def test_classifier_gives_a_row_the_same_log_probs_alone_and_padded(pooled_classifier):
    _, model, params = pooled_classifier
    short, long = [256, 72, 105, 33, 10], [256, *range(40, 48)]  # 5 and 9 tokens
    apply = jax.jit(lambda t, m: model.apply({"params": params}, t, m))
    alone_short = np.asarray(apply(np.array([short], np.int32), np.ones((1, 5), bool)))[0]
    alone_long = np.asarray(apply(np.array([long], np.int32), np.ones((1, 9), bool)))[0]
    assert alone_short.max() - alone_short.min() > 0.1  # a decisive head, not ~log(1/3) everywhere
    for side in ("left", "right"):
        tokens, mask = pad_batch([short, long], [side, "none"], 9, seed=7)
        got = np.asarray(apply(tokens, mask))
        # The same float32 math on the same real tokens at the same positions; a masked key adds
        # an exact zero. Only summation order differs: ~1e-7 on log-probs of O(1).
        np.testing.assert_allclose(got[0], alone_short, rtol=0, atol=1e-5, err_msg=side)
        np.testing.assert_allclose(got[1], alone_long, rtol=0, atol=1e-5, err_msg=side)


def test_reading_the_final_position_of_a_right_padded_row_is_wrong(pooled_classifier):
    """Without last-real-token pooling a right-padded row would be read at a padding slot."""
    config, model, params = pooled_classifier
    short, long = [256, 72, 105, 33, 10], [256, *range(40, 48)]
    tokens, mask = pad_batch([short, long], ["right", "none"], 9, seed=7)
    hidden = np.asarray(Llama(config).apply({"params": params["llama"]}, tokens,
                                            attention_mask=mask, lm_head=False, method="run").hidden)
    last = int(jax_last_real_index(mask)[0])
    assert last == 4
    assert np.abs(hidden[0, -1] - hidden[0, last]).max() > 0.1  # final-norm outputs are O(1)
    head = params["classifier"]
    at_end = np.asarray(jax.nn.log_softmax(hidden[0, -1] @ head["kernel"] + head["bias"]))
    pooled = np.asarray(model.apply({"params": params}, tokens, mask))[0]
    np.testing.assert_allclose(  # the head on the last real token is what the model returns
        np.asarray(jax.nn.log_softmax(hidden[0, last] @ head["kernel"] + head["bias"])), pooled,
        rtol=0, atol=1e-5)  # float32, the same ops in another order: ~1e-7
    assert np.abs(at_end - pooled).max() > 1e-2


# -- the twins agree; the classifier directory ------------------------------------------------------

@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    """An untrained classifier (ByteTokenizer, max_len 32, dropout 0.1) with a decisive head, saved."""
    config = small_config(vocab_size=259, tie_embeddings=False)
    clf = classify.new_classifier(config, LABELS, ByteTokenizer(), 32, dropout=0.1, seed=0)
    clf.params = decisive_head(clf.params, len(LABELS), seed=1)
    path = tmp_path_factory.mktemp("clf") / "c"
    clf.save(path)
    return path, clf


TEXTS = ["a fine film", "dull", "the plot thin, acting superb"]


def test_jax_and_torch_classifiers_agree_on_mixed_padding(classifier_dir):
    path, clf = classifier_dir
    assert sorted(p.name for p in path.iterdir()) == [
        "classifier.json", "classifier.safetensors", "config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    loaded = classify.load_classifier(path)
    tclf = torch_llama.load_classifier(path, device="cpu")  # the same kind of object
    assert type(tclf).__name__ == type(loaded).__name__ == "Classifier"
    tmodel = tclf.model
    assert loaded.labels == tclf.labels == LABELS and loaded.max_len == tclf.max_len == 32
    assert loaded.model.dropout == tmodel.dropout.p == 0.1
    tok = loaded.tokenizer  # the saved tokenizer.json, read back: the same ids as ByteTokenizer
    rows = [tok.encode(t, bos=True, eos=True) for t in TEXTS]  # as predict() encodes them
    assert rows == [ByteTokenizer().encode(t, bos=True, eos=True) for t in TEXTS]
    tokens, mask = pad_batch(rows, ["left", "right", "none"], len(rows[2]), seed=2)
    original = np.asarray(clf.model.apply({"params": clf.params}, tokens, mask))
    jax_logp = np.asarray(loaded.model.apply({"params": loaded.params}, tokens, mask))
    # The safetensors round trip is exact and the module the same: equal up to recompilation.
    np.testing.assert_allclose(jax_logp, original, rtol=0, atol=1e-6)
    assert (np.ptp(jax_logp, axis=1) > 0.1).all()  # decisive, so agreement means something
    with torch.no_grad():
        torch_logp = tmodel(torch.from_numpy(tokens), torch.from_numpy(mask)).numpy()
    # Two float32 implementations of the same math (XLA vs torch kernels, different summation
    # orders) through 2 layers: differences are rounding, ~1e-6 on log-probs of O(1).
    np.testing.assert_allclose(torch_logp, jax_logp, rtol=0, atol=1e-5)
    # predict() (right padding to a bucket, its own batching) gives the same rows.
    predicted, logp, cut = classify.predict(loaded, TEXTS)
    assert cut == 0 and predicted.tolist() == torch_logp.argmax(-1).tolist()
    np.testing.assert_allclose(logp, torch_logp, rtol=0, atol=1e-5)  # as above
    # and so does the torch twin's predict (its own batching, no buckets)
    t_predicted, t_logp, t_cut = torch_llama.predict(tclf, TEXTS)
    assert t_cut == 0 and t_predicted.tolist() == predicted.tolist()
    np.testing.assert_allclose(t_logp, logp, rtol=0, atol=1e-5)  # as above

    # A head that differs by 1e-3 in one bias is caught by that tolerance.
    with torch.no_grad():
        tmodel.classifier.bias += torch.tensor([1e-3, -1e-3, 0.0])
        perturbed = tmodel(torch.from_numpy(tokens), torch.from_numpy(mask)).numpy()
        tmodel.classifier.bias -= torch.tensor([1e-3, -1e-3, 0.0])
    assert np.abs(perturbed - jax_logp).max() > 5e-4
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(perturbed, jax_logp, rtol=0, atol=1e-5)


def test_torch_classifier_in_eval_mode_ignores_dropout(classifier_dir):
    path, _ = classifier_dir
    tmodel = torch_llama.load_classifier(path, device="cpu").model
    assert not tmodel.training and tmodel.dropout.p == 0.1
    tokens = torch.tensor([ByteTokenizer().encode(TEXTS[2], bos=True)])
    mask = torch.ones_like(tokens, dtype=torch.bool)
    with torch.no_grad():
        first, second = tmodel(tokens, mask), tmodel(tokens, mask)
        torch.testing.assert_close(first, second, rtol=0, atol=0)
        tmodel.train()  # the negative: in training mode the same input gives another answer
        torch.manual_seed(0)
        trained = tmodel(tokens, mask)
        tmodel.eval()
    assert (trained - first).abs().max() > 1e-3


def test_classifier_directory_loads_as_a_plain_language_model(classifier_dir):
    path, clf = classifier_dir
    model, params = jax_llama.load(path)  # the head files are not tensors of the LM
    reference = jax_llama.init(clf.model.config, seed=0)[1]  # new_classifier's backbone + LM head
    assert set(params) == set(reference) and "output" in params
    for got, want in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(reference)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # saved as float32: exact
    tlm = torch_llama.load(path, device="cpu")  # strict load: no unexpected classifier tensors
    np.testing.assert_array_equal(tlm.output.weight.detach().numpy(),
                                  np.asarray(reference["output"]["kernel"]).T)


# -- fine-tuning on a separable task, then predict -------------------------------------------------

FILLER = "the a movie film was plot and actor scene story it with this had".split()
POSITIVE, NEGATIVE = ["great", "superb", "lovely"], ["awful", "boring", "terrible"]


def synthetic_lines(n: int, seed: int) -> str:
    """`LABEL ||| TEXT` lines: 4-7 filler words and one positive (label 1) or negative word."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        label = int(rng.integers(2))
        words = [str(w) for w in rng.choice(FILLER, int(rng.integers(4, 8)))]
        words.insert(int(rng.integers(len(words) + 1)), str(rng.choice(POSITIVE if label else NEGATIVE)))
        out.append(f"{label} ||| {' '.join(words)}")
    return "\n".join(out) + "\n"


def test_finetune_learns_a_separable_task_and_predict_agrees(tmp_path, capsys):
    (tmp_path / "train.txt").write_text(synthetic_lines(300, seed=0))
    (tmp_path / "dev.txt").write_text(synthetic_lines(100, seed=1))
    (tmp_path / "labels.json").write_text('["negative", "positive"]')
    out = tmp_path / "run"
    assert jax_cli.main(["finetune", "--train", str(tmp_path / "train.txt"), "--dev",
                         str(tmp_path / "dev.txt"), "--labels", str(tmp_path / "labels.json"),
                         "--out", str(out), "--vocab-size", "300", "--epochs", "3",
                         "--max-len", "64"]) == 0
    stdout = capsys.readouterr().out
    # the run directory is laid out as every training command's (jax_llama.training.loop)
    assert {"run.json", "metrics.jsonl", "checkpoints", "model", "loss.png",
            "dev_predictions.txt"} <= {p.name for p in out.iterdir()}
    assert not (out / "best").exists() and not (out / "finetune.json").exists()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_epoch = 300 // 32 + 1  # the default batch of 32, the last one filled up
    assert [r["step"] for r in records] == list(range(1, 3 * per_epoch + 1))
    assert all({"loss", "lr", "grad_norm", "tokens_per_s"} <= set(r) for r in records)
    history = [r for r in records if "epoch" in r]  # an epoch's end adds the dev figures
    assert [(r["epoch"], r["step"]) for r in history] == [(e, e * per_epoch) for e in (1, 2, 3)]
    best = max(history, key=lambda r: r["dev_accuracy"])
    assert best["dev_accuracy"] >= 0.9, history  # chance is ~0.5
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    epoch_1 = [r["loss"] for r in records[:per_epoch]]  # train_loss: the epoch's mean step loss
    assert history[0]["train_loss"] == pytest.approx(np.mean(epoch_1), rel=1e-6)
    assert f"best dev accuracy {best['dev_accuracy']:.4f} (epoch {best['epoch']} of 3)" in stdout

    assert {"classifier.json", "classifier.safetensors", "model.safetensors", "config.json",
            "tokenizer.json"} <= {p.name for p in (out / "model").iterdir()}
    meta = json.loads((out / "model" / "classifier.json").read_text())
    assert meta["labels"] == ["negative", "positive"] and meta["max_len"] == 64
    assert meta["epoch"] == best["epoch"] and meta["dev_accuracy"] == best["dev_accuracy"]
    dev_predictions = (out / "dev_predictions.txt").read_text()
    assert len(dev_predictions.splitlines()) == 100
    assert set(dev_predictions.split()) <= {"0", "1"}
    dev_labels = [int(line.split(" ||| ")[0])
                  for line in (tmp_path / "dev.txt").read_text().splitlines()]
    assert np.mean(np.array(dev_predictions.split(), int) == dev_labels) == best["dev_accuracy"]

    # predict on the run directory (it finds model/) reproduces best's accuracy and predictions;
    # so it does on a run directory from before the layout, whose classifier is in best/
    n_right = int(round(best["dev_accuracy"] * 100))
    for layout in ("model", "best"):
        if layout == "best":
            (out / "model").rename(out / "best")
        assert jax_cli.main(["predict", str(out), "--data", str(tmp_path / "dev.txt"), "--out",
                             str(tmp_path / "pred.txt")]) == 0
        stdout = capsys.readouterr().out
        assert f"classifier accuracy {best['dev_accuracy']:.4f} ({n_right}/100)" in stdout
        assert (tmp_path / "pred.txt").read_text() == dev_predictions


# -- zero-shot scoring ------------------------------------------------------------------------------

TEMPLATE = "{text}. the review says:"
ZS_TEXTS = ["a quiet film", "the plot moves", "two actors talk", "rain all day", "an old house",
            "music and dance"]


@pytest.fixture(scope="module")
def trained_lm():
    """A tiny LM trained (60 AdamW steps) on 'TEXT. the review says: excellent' for six texts."""
    tok = ByteTokenizer()
    config = small_config(vocab_size=259, max_seq_len=64)
    model, params = jax_llama.init(config, seed=0)
    rows = [tok.encode(TEMPLATE.format(text=t) + " excellent", bos=True) for t in ZS_TEXTS]
    length = max(map(len, rows))
    tokens = np.full((len(rows), length), tok.pad_id, np.int32)
    mask = np.zeros((len(rows), length - 1), np.float32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
        mask[i, :len(r) - 1] = 1
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}
    tc = TrainConfig(steps=60, batch_size=len(rows), seq_len=length - 1, lr=1e-2, warmup_steps=5)
    optimizer = make_optimizer(tc)
    state = init_state(params, optimizer)
    step = jax.jit(make_train_step(lm_loss(model), optimizer, lr_schedule(tc)))
    for _ in range(tc.steps):
        state, metrics = step(state, batch)
    assert float(metrics["loss"]) < 0.5, "the LM did not learn its sentences"
    return model, state.params, tok


def manual_token_logprobs(model, params, prompt: list[int], continuation: list[int]) -> list[float]:
    """log p(each continuation token | everything before it), read off one unmasked forward pass
    of the row alone. The row is right-padded to 64 so that one compilation serves every row;
    causal attention keeps the trailing padding out of every earlier position."""
    ids = prompt + continuation
    tokens = np.zeros((1, 64), np.int32)
    tokens[0, :len(ids)] = ids
    logits = _logits(params, tokens, model=model)[0]
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1), np.float64)
    return [float(logp[j - 1, ids[j]]) for j in range(len(prompt), len(ids))]


@functools.partial(jax.jit, static_argnames="model")
def _logits(params, tokens, *, model):
    return model.apply({"params": params}, tokens)


def test_zero_shot_ranks_the_trained_label_first(trained_lm):
    model, params, tok = trained_lm
    predictions, scores, cut = classify.zero_shot(model, params, tok, ZS_TEXTS, ["awful", "excellent"],
                                                  template=TEMPLATE)
    assert cut == 0 and scores.shape == (len(ZS_TEXTS), 2)
    assert predictions.tolist() == [1] * len(ZS_TEXTS)
    assert (scores[:, 1] - scores[:, 0] > 5).all()  # by a wide margin, not a near-tie
    # reversing the label order reverses the predicted index: the score goes with the word
    predictions, _, _ = classify.zero_shot(model, params, tok, ZS_TEXTS, ["excellent", "awful"],
                                           template=TEMPLATE)
    assert predictions.tolist() == [0] * len(ZS_TEXTS)


def test_zero_shot_scores_sum_over_every_continuation_token(trained_lm):
    model, params, tok = trained_lm
    labels = ["awful", "excellent", "terribly disappointing"]  # 6, 10 and 23 tokens, one batch
    prompts, continuations, cut = classify.zero_shot_rows(tok, ZS_TEXTS[:3], labels, TEMPLATE, 64)
    assert cut == 0
    assert continuations == [tok.encode(" " + w) for w in labels]  # a space after the template
    assert [len(c) for c in continuations] == [6, 10, 23]
    scores = classify.continuation_logprobs(model, params, prompts, continuations)
    for n, prompt in enumerate(prompts):
        assert prompt == tok.encode(TEMPLATE.format(text=ZS_TEXTS[n]), bos=True)
        for c, continuation in enumerate(continuations):
            token_logprobs = manual_token_logprobs(model, params, prompt, continuation)
            assert len(token_logprobs) == len(continuation)
            # Padded batch vs one row: float32 rounding over up to 23 summed terms of up to ~10
            # nats, ~1e-6 each: 1e-4 leaves room without hiding a missing token (>= 1e-2 here).
            np.testing.assert_allclose(scores[n, c], sum(token_logprobs), rtol=0, atol=1e-4,
                                       err_msg=f"{n}, {labels[c]}")
            if c == 2:  # every token counts: the untrained tail of a long label adds a lot
                assert scores[n, c] < token_logprobs[0] - 1.0
                assert scores[n, c] < sum(token_logprobs[:-1]) - 1e-2


def test_zero_shot_cli(trained_lm, tmp_path, capsys):
    model, params, tok = trained_lm
    jax_llama.save(tmp_path / "lm", model.config, params)
    tok.save(tmp_path / "lm")
    (tmp_path / "data.txt").write_text("".join(f"1 ||| {t}\n" for t in ZS_TEXTS))
    (tmp_path / "labels.json").write_text('["awful", "excellent"]')
    assert jax_cli.main(["zero-shot", str(tmp_path / "lm"), "--data", str(tmp_path / "data.txt"),
                         "--labels", str(tmp_path / "labels.json"), "--template", TEMPLATE,
                         "--out", str(tmp_path / "pred.txt")]) == 0
    captured = capsys.readouterr()
    assert "zero-shot accuracy 1.0000 (6/6)" in captured.out
    assert "predicted: awful 0, excellent 6" in captured.err
    assert (tmp_path / "pred.txt").read_text() == "1\n" * 6
    # --chat: the same texts asked through the llama2 template (a short question: this LM's
    # context is 64 bytes); the predictions are the API's on the same rows
    from bridge.chat import find_template
    assert jax_cli.main(["zero-shot", str(tmp_path / "lm"), "--data", str(tmp_path / "data.txt"),
                         "--labels", str(tmp_path / "labels.json"), "--chat", "llama2",
                         "--template", "{text}?", "--out", str(tmp_path / "chat.txt")]) == 0
    want, _, _ = classify.zero_shot(model, params, tok, ZS_TEXTS, ["awful", "excellent"],
                                    "{text}?", chat=find_template(None, tok, "llama2"))
    assert (tmp_path / "chat.txt").read_text() == "".join(f"{p}\n" for p in want)


# -- bad input through the command line -------------------------------------------------------------

def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.fixture
def task(tmp_path):
    """A valid train/dev/labels triple; tests overwrite one file to break it."""
    (tmp_path / "train.txt").write_text("0 ||| bad film\n1 ||| good film\n")
    (tmp_path / "dev.txt").write_text("1 ||| fine film\n")
    (tmp_path / "labels.json").write_text('["bad", "good"]')
    return tmp_path


def finetune_argv(task: Path, *extra: str) -> list[str]:
    return ["finetune", "--train", str(task / "train.txt"), "--dev", str(task / "dev.txt"),
            "--labels", str(task / "labels.json"), "--out", str(task / "out"), *extra]


@pytest.mark.parametrize("train_text, message", [
    ("0 ||| ok\n\nno separator here\n", ":3: expected 'LABEL ||| TEXT'"),  # blank lines count
    ("0 ||| ok\n2 ||| too high\n", ":2: label 2 is outside labels.json's 2 labels (0..1)"),
    ("0 ||| ok\n-1 ||| negative\n", ":2: label -1 is outside labels.json's 2 labels (0..1)"),
    ("pos ||| not an index\n", ":1: label 'pos' is not an integer index into labels.json"),
    ("0 ||| ok\n1 |||   \n", ":2: empty text"),
    ("", ": no examples"),
    ("\n  \n", ": no examples"),
])
def test_finetune_refuses_a_malformed_data_file(task, capsys, train_text, message):
    (task / "train.txt").write_text(train_text)
    assert jax_cli.main(finetune_argv(task)) == 2
    assert one_error_line(capsys) == f"error: {task / 'train.txt'}{message}"
    assert not (task / "out").exists()


def test_skip_malformed_skips_and_counts(task, capsys):
    (task / "train.txt").write_text("0 ||| ok\nbroken\n1 ||| fine\nx ||| bad label\n")
    (task / "dev.txt").write_text("broken too\n")  # all skipped: refused before any training
    assert jax_cli.main(finetune_argv(task, "--skip-malformed")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"warning: {task / 'train.txt'}: skipped 2 malformed line(s), first at line 2: "
        f"expected 'LABEL ||| TEXT'",
        f"error: {task / 'dev.txt'}: no examples (1 malformed line(s) skipped, "
            f"the first at line 1: expected 'LABEL ||| TEXT')"]
    dataset = read_examples(task / "train.txt", 2, skip_malformed=True)
    assert [(e.line, e.label, e.text) for e in dataset.examples] == [(1, 0, "ok"), (3, 1, "fine")]
    assert len(dataset.skipped) == 2 and dataset.skipped[1].startswith("4: label 'x'")


@pytest.mark.parametrize("labels_text, why", [
    ('{"bad": 0, "good": 1}', "not a list"),
    ('["only"]', "one label"),
    ('["bad", "bad"]', "duplicates"),
    ('["bad", ""]', "an empty word"),
])
def test_finetune_refuses_bad_labels_json(task, capsys, labels_text, why):
    (task / "labels.json").write_text(labels_text)
    assert jax_cli.main(finetune_argv(task)) == 2, why
    assert one_error_line(capsys) == (f"error: {task / 'labels.json'}: expected a JSON list of at "
                                      f"least two distinct label words, e.g. [\"bad\", \"good\"]")


def test_finetune_refuses_a_non_empty_out_and_init_with_preset(task, capsys):
    (task / "out").mkdir()
    (task / "out" / "keep.txt").write_text("mine")
    assert jax_cli.main(finetune_argv(task)) == 2
    assert one_error_line(capsys) == (f"error: --out: {task / 'out'} is not empty (pass --resume "
                                      f"to continue that run)")
    assert (task / "out" / "keep.txt").read_text() == "mine"
    (task / "out" / "keep.txt").unlink()
    assert jax_cli.main(finetune_argv(task, "--init", str(task / "ckpt"), "--preset", "tiny")) == 2
    assert one_error_line(capsys).startswith("error: --preset: not with --init")


def test_zero_shot_refuses_a_template_without_text(task, capsys):
    assert jax_cli.main(["zero-shot", str(task), "--data", str(task / "dev.txt"), "--labels",
                         str(task / "labels.json"), "--template", "Overall, it was"]) == 2
    assert one_error_line(capsys) == "error: --template: must contain {text} (got 'Overall, it was')"


def test_predict_truncates_long_texts_from_the_left_and_says_how_many(classifier_dir, tmp_path, capsys):
    path, _ = classifier_dir  # max_len 32 with a byte tokenizer: BOS + the last 30 bytes + EOS
    long = "this opening is cut away entirely, while this ending stays"
    (tmp_path / "data.txt").write_text(f"short one\n{long}\nanother short text\n")
    assert jax_cli.main(["predict", str(path), "--data", str(tmp_path / "data.txt")]) == 0
    captured = capsys.readouterr()
    note = f"{tmp_path / 'data.txt'}: 1 of 3 texts longer than 32 tokens were truncated from the left"
    assert note in captured.err.splitlines()  # (the other stderr output is a progress bar)
    assert captured.err.count("truncated") == 1
    assert len(captured.out.split()) == 3  # unlabeled: predictions only, no accuracy
    clf = classify.load_classifier(path)
    _, logp_long, cut = classify.predict(clf, [long])
    _, logp_tail, _ = classify.predict(clf, [long[-30:]])
    assert cut == 1
    np.testing.assert_allclose(logp_long, logp_tail, rtol=0, atol=1e-6)  # the same tokens exactly
    _, logp_head, _ = classify.predict(clf, [long[:30]])
    assert np.abs(logp_long - logp_head).max() > 1e-3  # it is the start that was dropped
    assert truncate_left([256, 1, 2, 3, 4], 3, 256) == ([256, 3, 4], True)
    assert truncate_left([1, 2, 3], 3, 256) == ([1, 2, 3], False)


def test_predict_with_skip_malformed_and_on_a_plain_lm(classifier_dir, tmp_path, capsys):
    path, _ = classifier_dir
    (tmp_path / "data.txt").write_text("0 ||| fine\nx ||| bad label\n2 ||| also fine\n")
    assert jax_cli.main(["predict", str(path), "--data", str(tmp_path / "data.txt")]) == 2
    assert one_error_line(capsys) == (f"error: {tmp_path / 'data.txt'}:2: label 'x' is not an "
                                      f"integer index into labels.json")
    assert jax_cli.main(["predict", str(path), "--data", str(tmp_path / "data.txt"),
                         "--skip-malformed"]) == 0
    captured = capsys.readouterr()
    warning = f"warning: {tmp_path / 'data.txt'}: skipped 1 malformed line(s), first at line 2"
    assert warning in captured.err
    expected, _, _ = classify.predict(classify.load_classifier(path), ["fine", "also fine"])
    assert captured.out.split() == [str(p) for p in expected]  # the two good lines, in order
    right = int((expected == [0, 2]).sum())
    assert f"classifier accuracy {right / 2:.4f} ({right}/2)" in captured.err
    model, params = jax_llama.load(path)
    jax_llama.save(tmp_path / "lm", model.config, params)
    assert jax_cli.main(["predict", str(tmp_path / "lm"), "--data", str(tmp_path / "data.txt")]) == 2
    assert "not a classifier (no classifier.json" in one_error_line(capsys)


# -- split ------------------------------------------------------------------------------------------

def test_split_partitions_the_lines_reproducibly(tmp_path, capsys):
    lines = [f"{i % 2} ||| text number {i}" for i in range(50)]
    (tmp_path / "all.txt").write_text("\n".join(lines[:25]) + "\n\n" + "\n".join(lines[25:]) + "\n")

    def split(out: str, seed: int = 0) -> tuple[list[str], list[str]]:
        assert jax_cli.main(["split", str(tmp_path / "all.txt"), "--fraction", "0.2", "--out",
                             str(tmp_path / out), "--seed", str(seed)]) == 0
        return ((tmp_path / out / "train.txt").read_text().splitlines(),
                (tmp_path / out / "heldout.txt").read_text().splitlines())

    train, held = split("a")
    assert len(held) == 10 and len(train) == 40
    assert not set(train) & set(held) and sorted(train + held) == sorted(lines)  # blank line dropped
    assert train == [line for line in lines if line in set(train)]  # file order kept
    assert split("b") == (train, held)  # same seed, same split
    assert split("c", seed=1)[1] != held
    capsys.readouterr()
    assert jax_cli.main(["split", str(tmp_path / "all.txt"), "--fraction", "0.2", "--out",
                         str(tmp_path / "a")]) == 2  # no silent overwrite
    assert "already exists" in one_error_line(capsys)
    assert jax_cli.main(["split", str(tmp_path / "all.txt"), "--fraction", "1.0", "--out",
                         str(tmp_path / "d")]) == 2
    assert one_error_line(capsys) == "error: --fraction: must be in (0, 1) (got 1.0)"


# -- the label prefix stripped for language-model training ------------------------------------------

LABELED = ("0 ||| a film\n"
           "1 ||| another ||| with bars inside\n"
           "  3|||tight, with 2 ||| in it\n"
           "a line without a label\n"
           "\n"
           "12 ||| 7 ||| text that starts with a number\n"
           "4 ||| last line without newline")
STRIPPED = ("a film\n"
            "another ||| with bars inside\n"
            "tight, with 2 ||| in it\n"
            "a line without a label\n"
            "\n"
            "7 ||| text that starts with a number\n"
            "last line without newline")


def test_strip_labels_removes_only_the_label_prefixes(tmp_path):
    assert strip_labels(LABELED) == STRIPPED
    assert strip_labels(LABELED.replace("\n", "\r\n")) == STRIPPED.replace("\n", "\r\n")
    # the same reading of a line as read_examples: its texts are what the LM is trained on
    dataset = read_examples(_write(tmp_path / "labeled.txt", LABELED), 13, skip_malformed=True)
    assert [e.text for e in dataset.examples] == [line for line in STRIPPED.splitlines()
                                                  if line and line != "a line without a label"]
    (tmp_path / "task.txt").write_text(LABELED)
    files = data.corpus_files([tmp_path / "task.txt"])
    assert list(data.read_documents(files, labeled=True)) == [STRIPPED]
    assert list(data.read_documents(files)) == [LABELED]
    tok = ByteTokenizer()  # what `train --strip-labels` tokenizes, cached apart from the raw file
    stripped = data.tokenize_corpus(files, tok, tmp_path / "cache", labeled=True)
    raw = data.tokenize_corpus(files, tok, tmp_path / "cache")
    assert tok.decode(stripped) == f"<|bos|>{STRIPPED}<|eos|>"
    assert tok.decode(raw) == f"<|bos|>{LABELED}<|eos|>"


# -- the real task files ---------------------------------------------------------------------------

@pytest.mark.skipif(not ((SHARED_DATA / "sst").is_dir() and (SHARED_DATA / "cfimdb").is_dir()),
                    reason=f"the SST / CFIMDB task files are not at {SHARED_DATA}")
def test_read_the_shared_task_files():
    for task, split_name, count in [("sst", "train", 8544), ("sst", "dev", 1101),
                                    ("cfimdb", "train", 1707)]:
        labels = read_labels(SHARED_DATA / task / "labels.json")
        dataset = read_examples(SHARED_DATA / task / f"{split_name}.txt", len(labels))
        assert len(dataset.examples) == count and not dataset.skipped, (task, split_name)
        assert dataset.labeled and all(t.strip() for t in dataset.texts)
        assert set(dataset.labels.tolist()) == set(range(len(labels))), (task, split_name)
    assert read_labels(SHARED_DATA / "sst" / "labels.json") == ["awful", "bad", "average", "good",
                                                                "excellent"]


def test_gradient_accumulation_equals_the_full_batch():
    """Two micro-batches of 4 with grad_accum=2 make the same update as one batch of 8: MultiSteps
    averages the micro-batch gradients, each a mean over 4 rows."""

    config = small_config(vocab_size=259)
    clf = classify.new_classifier(config, LABELS, ByteTokenizer(), 32, dropout=0.0, seed=0)
    rows = [ByteTokenizer().encode(t, bos=True, eos=True) for t in
            ["a fine film", "dull", "the plot thin", "acting superb", "meh", "great fun",
             "too long by half", "worth it"]]
    tokens, mask = pad_rows(rows, 32)
    batch = {"tokens": tokens, "mask": mask, "labels": np.array([0, 1, 2, 0, 1, 2, 0, 1], np.int32),
             "weights": np.ones(8, np.float32)}
    halves = [{k: v[i:i + 4] for k, v in batch.items()} for i in (0, 4)]
    # eps = 1: with eps ~ 0 Adam's first step is lr * sign(g), and float32 rounding of a
    # near-zero gradient entry (summed in another order) could flip a sign.
    results = []
    for accum, batches in ((1, [batch]), (2, halves)):
        optimizer = make_optimizer(TrainConfig(steps=2 * accum, batch_size=8, lr=1e-2,
                                               warmup_steps=0, eps=1.0, grad_accum=accum))
        tc = TrainConfig(steps=2 * accum, batch_size=8, grad_accum=accum)
        state = init_state(jax.tree_util.tree_map(jnp.array, clf.params), optimizer)
        step = jit_train_step(finetune_lib.classifier_loss(clf.model), optimizer, tc, state)
        for b in batches:
            state, _ = step(state, b)
        results.append(state.params)
    start = jax.tree_util.tree_leaves(clf.params)
    for full, accumulated, before in zip(*map(jax.tree_util.tree_leaves, results), start):
        assert np.abs(np.asarray(full) - np.asarray(before)).max() > 0  # an update happened
        # float32 sums in another order: ~1e-7 relative on gradients, times lr / eps = 1e-2.
        np.testing.assert_allclose(accumulated, full, rtol=0, atol=1e-7)


def test_diverging_finetune_names_the_epoch_and_exits_1(task, tmp_path, capsys):
    # A backbone with a NaN weight gives a NaN loss: a failed run (exit 1, as `jax-llama train`
    # does), not bad input, and no classifier is kept.
    config = small_config(vocab_size=259)
    _, params = jax_llama.init(config, seed=0)
    params["norm"]["weight"] = params["norm"]["weight"].at[0].set(jnp.nan)
    tokenizer_files = ByteTokenizer().save(tmp_path / "tok")
    jax_llama.save(tmp_path / "nan-lm", config, params)
    for f in tokenizer_files:
        (tmp_path / "nan-lm" / Path(f).name).write_bytes(Path(f).read_bytes())
    assert jax_cli.main(finetune_argv(task, "--init", str(tmp_path / "nan-lm"), "--epochs", "2")) == 1
    err = capsys.readouterr().err
    assert "error: step 1: loss nan" in err and "lower --lr" in err
    assert not (task / "out" / "model").exists()


def _write(path, text: str):
    path.write_text(text)
    return path


def test_single_token_labels_are_scored_from_one_row_per_text(trained_lm):
    """Labels of one token each: every text is one row, and each label's score is its token's
    log-probability after the prompt, as one unpadded forward pass gives it."""
    model, params, tok = trained_lm
    labels = ["x", "e", "q"]  # a template ending in a space: one byte token each
    prompts, continuations, _ = classify.zero_shot_rows(tok, ZS_TEXTS, labels, TEMPLATE + " ", 64)
    assert [len(c) for c in continuations] == [1, 1, 1]
    scores = classify.continuation_logprobs(model, params, prompts, continuations, batch_size=4)
    for n, prompt in enumerate(prompts):
        for c, continuation in enumerate(continuations):
            # float32 rounding of one log-probability in a padded batch: 1e-5 of ~10 nats
            np.testing.assert_allclose(scores[n, c],
                                       manual_token_logprobs(model, params, prompt,
                                                             continuation)[0], rtol=0, atol=1e-4)
    assert (scores[:, 1] > scores[:, 0] + 1).all()  # 'e' (of "excellent") is the trained one


def test_head_at_projects_only_the_positions_asked(trained_lm):
    """Llama.run(head_at=...) gives the logits of those positions of each row, the same as the
    full projection's."""
    model, params, tok = trained_lm
    tokens = np.array([tok.encode(TEMPLATE.format(text=t), bos=True)[:12] for t in ZS_TEXTS[:2]],
                      np.int32)
    full = np.asarray(model.apply({"params": params}, tokens))
    where = np.array([[0, 5, 11], [3, 3, 7]], np.int32)
    some = np.asarray(model.apply({"params": params}, tokens, head_at=where, method="run").logits)
    assert some.shape == (2, 3, full.shape[-1])
    np.testing.assert_allclose(some, np.take_along_axis(full, where[..., None], axis=1),
                               rtol=0, atol=1e-5)  # the same float32 math, another batch shape


def test_zero_shot_through_a_chat_template(trained_lm):
    """--chat: the filled question ({labels} as 'a, b or c') is the user's turn rendered up to
    the reply, the label words follow without a space; a text too long loses its start."""
    from bridge.chat import find_template

    _, _, tok = trained_lm
    chat = find_template(None, tok, "llama2")
    question = "{text}\nIs it {labels}?"
    prompts, continuations, cut = classify.zero_shot_rows(tok, ZS_TEXTS[:2], ["bad", "ok", "good"],
                                                          question, 200, chat)
    assert cut == 0 and continuations == [tok.encode(w) for w in ("bad", "ok", "good")]
    filled = f"{ZS_TEXTS[0]}\nIs it bad, ok or good?"
    assert prompts[0] == chat.encode([{"role": "user", "content": filled}], tok,
                                     add_generation_prompt=True)
    long_text = "word " * 100
    prompts, _, cut = classify.zero_shot_rows(tok, [long_text], ["bad", "good"], question, 120,
                                              chat)
    assert cut == 1 and len(prompts[0]) <= 120 - 4
    assert tok.decode(prompts[0]).rstrip().endswith("Is it bad or good? [/INST]")


def test_a_pretrained_backbone_gets_its_own_recipe_and_trains_its_top_blocks(task, capsys):
    """finetune --init: the PRETRAINED recipe (lr, epochs, batch, dropout; the top half of the
    blocks, 1 of 3), flags over it; the blocks below and the embedding table come out unchanged, the top
    block, the final norm and the head do not. From scratch keeps FROM_SCRATCH."""
    from tasks.classification import (FROM_SCRATCH, PRETRAINED, PRETRAINED_LORA,
                                       resolve_train_layers)
    from jax_llama.training.finetune import recipe

    (task / "train.txt").write_text(synthetic_lines(40, seed=0))
    config = small_config(n_layers=3, vocab_size=300)
    save_random_checkpoint(task / "lm", config)
    tok = train_tokenizer(read_examples(task / "train.txt", 2).texts, 300)
    tok.save(task / "lm")
    (task / "lm" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}"
                                                     "{% endfor %}")
    assert jax_cli.main(finetune_argv(task, "--init", str(task / "lm"), "--epochs", "1",
                                      "--max-len", "32")) == 0
    err = capsys.readouterr().err
    assert (f"the top 1 of 3 blocks training (from {task / 'lm'}) on 40 examples, 1 dev, 2 labels; "
            f"1 epochs, batch {PRETRAINED['batch_size']}, lr {PRETRAINED['lr']:g}, dropout "
            f"{PRETRAINED['dropout']:g}") in err
    before = jax_llama.load(task / "lm")[1]
    after = jax_llama.load(task / "out" / "model")[1]
    for block in ("layers_0", "layers_1"):
        for got, want in zip(jax.tree.leaves(after[block]), jax.tree.leaves(before[block])):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(after["tok_embeddings"]["embedding"]),
                                  np.asarray(before["tok_embeddings"]["embedding"]))
    top = lambda p: (p["layers_2"]["feed_forward"]["w2"]["kernel"], p["norm"]["weight"])  # noqa: E731
    for got, want in zip(top(after), top(before)):
        assert not np.array_equal(np.asarray(got), np.asarray(want))
    # the backbone's own chat template (here one beside the LM) goes with the classifier
    assert (task / "out" / "model" / "chat_template.jinja").read_text() == \
        (task / "lm" / "chat_template.jinja").read_text()
    assert recipe(False, False) == FROM_SCRATCH
    assert recipe(True, False, lr=3e-5)["lr"] == 3e-5
    assert recipe(True, True) == PRETRAINED_LORA  # LoRA keeps its own (the top third, lr 1e-3)
    # SmolLM2's 30 blocks: full fine-tuning trains 15, LoRA 10; never none
    assert [resolve_train_layers(v, n) for v, n in [("half", 30), ("third", 30), ("half", 1),
                                                    ("third", 1), ("all", 30)]] == \
        [15, 10, 1, 1, None]


@pytest.mark.parametrize("value, message", [
    ("0", "error: --train-layers: expected a positive number of blocks or 'all', got '0'"),
    ("some", "error: --train-layers: expected a positive number of blocks or 'all', got 'some'"),
])
def test_finetune_refuses_a_bad_train_layers(task, capsys, value, message):
    assert jax_cli.main(finetune_argv(task, "--train-layers", value)) == 2
    assert one_error_line(capsys) == message


def test_train_layers_beyond_the_backbone_is_refused(task, capsys):
    save_random_checkpoint(task / "lm", small_config(vocab_size=300))
    tok = train_tokenizer(read_examples(task / "train.txt", 2).texts, 300)
    tok.save(task / "lm")
    assert jax_cli.main(finetune_argv(task, "--init", str(task / "lm"), "--train-layers", "5")) == 2
    assert one_error_line(capsys) == "error: --train-layers: 5 exceeds the backbone's 2 blocks"


def test_a_chat_reply_may_begin_with_the_word_capitalized(trained_lm):
    """Through a chat template a label's score is log(p(word) + p(Word)) after the prompt: both
    spellings, as continuation_logprobs scores each."""
    from bridge.chat import find_template

    model, params, tok = trained_lm
    chat = find_template(None, tok, "llama2")
    labels = ["awful", "excellent"]
    _, scores, _ = classify.zero_shot(model, params, tok, ZS_TEXTS[:2], labels, "{text}?",
                                      chat=chat)
    prompts, _, _ = classify.zero_shot_rows(tok, ZS_TEXTS[:2], labels, "{text}?", 64, chat)
    spellings = [tok.encode(w) for w in ("awful", "excellent", "Awful", "Excellent")]
    raw = classify.continuation_logprobs(model, params, prompts, spellings)
    np.testing.assert_allclose(scores, np.logaddexp(raw[:, :2], raw[:, 2:]), rtol=0, atol=1e-6)
    assert (np.abs(raw[:, 2:] - raw[:, :2]) > 1e-3).all()  # the capitals do count


# -- the frozen blocks' output, computed once --------------------------------------------------------

def _byte_rows(texts):
    return [ByteTokenizer().encode(t, bos=True, eos=True) for t in texts]


FROZEN_TEXTS = ["a fine film", "dull", "the plot is thin but the acting is superb", "meh",
                "great fun for all", "too long by half", "worth it", "x"]


def test_frozen_features_give_the_whole_model_s_log_probs():
    """The top blocks run on FrozenFeatures (the lower blocks' output, computed once and padded
    again per batch) give the whole model's log-probs; in float32 the two differ only in how
    XLA fuses the computation around the split (atol 1e-5 on log-probs of order 1). Features
    of the wrong depth (one block fewer than the top model expects) are far off: the check can
    fail."""
    config = small_config(n_layers=3, vocab_size=259)
    clf = classify.new_classifier(config, LABELS, ByteTokenizer(), 64, dropout=0.1, seed=0)
    clf.params = decisive_head(clf.params, len(LABELS))
    rows = _byte_rows(FROZEN_TEXTS)
    whole = classify.predict_ids(clf, rows, batch_size=4)
    for first in (1, 2):
        frozen = classify.FrozenFeatures.compute(clf, rows, first)
        assert frozen.model.first_layer == first
        assert [f.shape for f in frozen.rows] == [(len(r), config.dim) for r in rows]
        got = classify.predict_ids(clf, rows, batch_size=4, frozen=frozen)
        np.testing.assert_allclose(got, whole, rtol=0, atol=1e-5)
    wrong = classify.FrozenFeatures(frozen.model,
                                    classify.FrozenFeatures.compute(clf, rows, 1).rows)
    assert np.abs(classify.predict_ids(clf, rows, batch_size=4, frozen=wrong) - whole).max() > 1e-2


def _frozen_run(tmp_path, frozen_cache: bool, lora=None):
    train = read_examples_from(tmp_path / "train.txt", synthetic_lines(48, seed=0))
    dev = read_examples_from(tmp_path / "dev.txt", synthetic_lines(16, seed=1))
    config = small_config(n_layers=3, vocab_size=259)
    clf = classify.new_classifier(config, ["negative", "positive"], ByteTokenizer(), 32,
                                  dropout=0.1, seed=0, lora=lora)
    fc = finetune_lib.FinetuneConfig(epochs=2, batch_size=8, lr=3e-3, train_layers=1,
                                 frozen_cache=frozen_cache, max_len=32)
    summary = finetune_lib.finetune(clf, train, dev, fc, tmp_path / f"run-{frozen_cache}")
    return clf, summary


def read_examples_from(path, text):
    path.write_text(text)
    return read_examples(path, 2)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_finetune_with_the_frozen_cache_trains_as_without(tmp_path, caplog, lora):
    """With train_layers the frozen blocks run once (FrozenFeatures) instead of at every step:
    the same batches, the same updates. Two epochs of a 3-block model, full and LoRA: training
    losses equal within rtol 1e-4 and the trained params within atol 1e-5 (float32 rounding of
    the differently fused forward, carried through 12 AdamW updates), dev predictions equal, and
    the frozen blocks bit-for-bit untouched in both."""
    from bridge.lora import LoraConfig

    config = LoraConfig(rank=4, alpha=8) if lora else None
    with caplog.at_level(logging.INFO, logger="jax_llama.training"):  # the library's voice
        cached, with_cache = _frozen_run(tmp_path, True, config)
    assert "the 2 frozen blocks run once for every text" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jax_llama.training"):
        plain, without = _frozen_run(tmp_path, False, config)
    assert "frozen blocks run once" not in caplog.text
    np.testing.assert_allclose([h["train_loss"] for h in with_cache["history"]],
                               [h["train_loss"] for h in without["history"]], rtol=1e-4)
    assert [h["dev_accuracy"] for h in with_cache["history"]] == \
        [h["dev_accuracy"] for h in without["history"]]
    moved = 0.0
    start = classify.new_classifier(small_config(n_layers=3, vocab_size=259),
                                    ["negative", "positive"], ByteTokenizer(), 32, dropout=0.1,
                                    seed=0, lora=config).params
    for path_a, a in jax.tree_util.tree_leaves_with_path(cached.params):
        b = _at(plain.params, path_a)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
        s = np.asarray(_at(start, path_a))
        if any(getattr(k, "key", None) in ("layers_0", "layers_1", "tok_embeddings")
               for k in path_a):
            np.testing.assert_array_equal(np.asarray(a), s)
        else:
            moved = max(moved, float(np.abs(np.asarray(a) - s).max()))
    assert moved > 1e-3  # the top block and the head did train


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_the_frozen_cache_steps_aside_when_memory_is_short(monkeypatch, caplog):
    clf = classify.new_classifier(small_config(n_layers=3, vocab_size=259), LABELS,
                                  ByteTokenizer(), 64, dropout=0.0, seed=0)
    rows = _byte_rows(FROZEN_TEXTS)
    need = 2 * classify.FrozenFeatures.nbytes(clf, rows)
    assert need == 2 * sum(map(len, rows)) * 48 * 4
    monkeypatch.setattr(finetune_lib, "available_memory", lambda: 4 * need - 4)
    with caplog.at_level(logging.INFO, logger="jax_llama.training"):
        assert finetune_lib.frozen_features(clf, rows, rows, 1) is None
    assert "computed at every step instead" in caplog.text
    monkeypatch.setattr(finetune_lib, "available_memory", lambda: 4 * need)
    train, dev = finetune_lib.frozen_features(clf, rows, rows, 1)
    assert train.model.first_layer == dev.model.first_layer == 2
    assert finetune_lib.frozen_features(clf, rows, rows, 3) is None     # nothing frozen
    assert finetune_lib.frozen_features(clf, rows, rows, None) is None  # everything trains
    assert finetune_lib.frozen_features(clf, rows, rows, 1, enabled=False) is None
