"""`jax-llama sft`: conversations as packed rows whose loss counts the assistant's tokens only,
the same loss packed and unpacked, the run directory (template saved with the model, exact match
before and after, resume), `generate --chat` in both twins with the saved template, the demo
task, and every refusal (one line, exit 2, nothing written)."""

import json

import jax
import numpy as np
import pytest

import jax_llama
from bridge.chat import find_template
from tasks.chats import Example
from bridge.tokenizer import load_tokenizer
from conftest import interrupted_at, small_config
from jax_llama.training.sft import demo_chats, example_batches, exact_match, load_chats
from jax_llama.training.spec import SftSpec
from jax_llama.training.step import lm_loss
from llama_twins.cli import main as jax_cli, torch_main as torch_cli


def random_examples(n=7, vocab=97, seed=0) -> list[Example]:
    """Examples of 5-20 tokens whose trained tokens are a random tail-heavy subset."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(5, 21))
        trained = rng.random(length) < 0.5
        trained[0] = False
        trained[-1] = True
        out.append(Example(rng.integers(3, vocab, length).astype(np.int32), trained, f"ex:{i}"))
    return out


def whole_batch(examples, pack: bool, seq_len=31):
    """One batch holding every row once (batch size = rows: one epoch's permutation)."""
    n_rows = len(example_batches(examples, 1, seq_len, 0, 0, 0, pack).rows)
    return example_batches(examples, n_rows, seq_len, 0, 0, 0, pack).batch(0)


def test_the_mask_counts_exactly_the_trained_tokens_of_each_example():
    examples = random_examples()
    for pack in (True, False):
        batch = whole_batch(examples, pack)
        got = sorted(tuple(batch["targets"][r][batch["mask"][r] > 0]) for r in range(len(batch["mask"])))
        # each row's counted targets, grouped per example: compare as multisets of tokens
        counted = sorted(t for row in got for t in row)
        expected = sorted(int(t) for e in examples for t in e.ids[e.trained])
        assert counted == expected, pack
    packed = whole_batch(examples, True)
    assert len(packed["mask"]) < len(examples)  # several conversations share a row
    assert set(np.unique(packed["segment_ids"])) >= {0, 1}


def test_packed_and_unpacked_give_the_same_loss():
    config = small_config()
    model, params = jax_llama.init(config, seed=0)
    examples = random_examples(vocab=config.vocab_size)
    loss = jax.jit(lambda b: lm_loss(model)(params, b, None))
    packed, unpacked = whole_batch(examples, True), whole_batch(examples, False)
    # The same token losses, averaged over the same trained tokens; float32 sums in another
    # order: ~1e-7 relative. Attention leaking across packed conversations moves it by ~1e-2.
    np.testing.assert_allclose(float(loss(packed)), float(loss(unpacked)), rtol=1e-5, atol=0)
    leaky = {k: v for k, v in packed.items() if k != "segment_ids"}
    assert abs(float(loss(leaky)) - float(loss(unpacked))) > 1e-3


def test_demo_chats_are_seeded_and_exact_match_scores_replies():
    chats = demo_chats(50, seed=3)
    assert chats == demo_chats(50, seed=3) and chats != demo_chats(50, seed=4)
    assert all(m[-1]["role"] == "assistant" for _, m in chats)
    tok = load_tokenizer_for_test()
    template = find_template(None, tok, "llama2")
    answers = {c[0]: tok.encode(c[1][-1]["content"]) + [tok.eos_id] for c in chats[:10]}
    right = exact_match(lambda prompts: [answers[w] for w, _ in chats[:10][:len(prompts)]],
                        template, tok, chats[:10])
    assert right[0] == 1.0
    wrong = exact_match(lambda prompts: [[tok.eos_id] for _ in prompts], template, tok, chats[:10])
    assert wrong[0] == 0.0 and wrong[1][0]["reply"] == ""


def load_tokenizer_for_test():
    from bridge.tokenizer import train_tokenizer
    return train_tokenizer([m["content"] for _, c in demo_chats(200, 0) for m in c], 400)


def test_held_out_split_is_seeded_and_disjoint(tmp_path):
    lines = [json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) for i in range(40)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    train, held = load_chats(SftSpec(data=str(tmp_path / "c.jsonl")), seed=0)
    assert len(held) == 2 and len(train) == 38
    assert not {w for w, _ in train} & {w for w, _ in held}
    assert load_chats(SftSpec(data=str(tmp_path / "c.jsonl")), seed=0) == (train, held)


# -- the command ----------------------------------------------------------------------------------

CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is two plus two?"},
                  {"role": "assistant", "content": "four"},
                  {"role": "user", "content": "And three plus three?"},
                  {"role": "assistant", "content": "six"}]},
    {"prompt": "Say hello.", "completion": "hello"},
    {"messages": [{"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "green"}]},
] * 8


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A short LoRA SFT run from a small base with a BPE tokenizer, on chats in a file."""
    root = tmp_path_factory.mktemp("sft")
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    base = root / "base"
    assert jax_cli.main(["train", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                         "--data", str(root / "chats.jsonl"), "--vocab-size", "300",
                         "--sample-tokens", "0", "--out", str(base)]) == 0
    out = root / "run"
    assert jax_cli.main(["sft", "--data", str(root / "chats.jsonl"), "--init", str(base / "model"),
                         "--steps", "6", "--batch-size", "2", "--seq-len", "64", "--lr", "3e-3",
                         "--checkpoint-every", "3", "--lora-rank", "2", "--out", str(out)]) == 0
    return root, out


def test_the_run_directory_holds_the_template_scores_and_model(sft_run, capsys):
    root, out = sft_run
    for name in ("run.json", "chat_template.jinja", "exact_match.json", "metrics.jsonl",
                 "model/chat_template.jinja", "model/config.json", "adapter/adapter_config.json"):
        assert (out / name).is_file(), name
    assert (out / "chat_template.jinja").read_text() == (out / "model" / "chat_template.jinja").read_text()
    scores = json.loads((out / "exact_match.json").read_text())
    assert set(scores) == {"before", "after"} and scores["after"]["n"] == 1  # 5% of 24, at least 1
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_interrupted_and_resumed_ends_where_a_straight_run_ends(sft_run, tmp_path):
    root, out = sft_run
    again = tmp_path / "again"
    with interrupted_at(4):  # after the checkpoint at step 3
        jax_cli.main(["sft", "--data", str(root / "chats.jsonl"), "--init",
                      str(root / "base" / "model"), "--steps", "6", "--batch-size", "2",
                      "--seq-len", "64", "--lr", "3e-3", "--checkpoint-every", "3",
                      "--lora-rank", "2", "--out", str(again)])
    assert jax_cli.main(["sft", "--out", str(again), "--resume"]) == 0
    for part in ("adapter/adapter_model.safetensors", "model/model.safetensors"):
        assert (out / part).read_bytes() == (again / part).read_bytes(), part
    straight = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(x)["loss"] for x in (again / "metrics.jsonl").read_text().splitlines()]
    assert resumed[-3:] == straight[-3:]


def test_generate_chat_uses_the_saved_template_in_both_twins(sft_run, capsys):
    _, out = sft_run
    argv = ["generate", str(out / "model"), "--chat", "--prompt", "Name a colour.",
            "--max-new-tokens", "8"]
    assert jax_cli.main(argv) == 0
    jax_text = capsys.readouterr().out
    assert torch_cli.main(argv + ["--device", "cpu"]) == 0
    assert capsys.readouterr().out == jax_text
    # the prompt the command builds is the saved template's rendering
    tok = load_tokenizer(out / "model")
    template = find_template(out / "model", tok)
    assert template.source == (out / "chat_template.jinja").read_text()


def test_show_mask_prints_and_writes_nothing(sft_run, tmp_path, capsys):
    root, _ = sft_run
    assert jax_cli.main(["sft", "--data", str(root / "chats.jsonl"), "--init",
                         str(root / "base" / "model"), "--show-mask", "2",
                         "--out", str(tmp_path / "none")]) == 0
    printed = capsys.readouterr().out
    # LLaMA 2's format (the base has no template and a BPE of its own): the reply, the space
    # around it and the EOS closing the turn train; the [INST] turns do not.
    assert "[/INST]« four <|eos|>»" in printed and "[/INST]« six <|eos|>»" in printed
    assert printed.split("\n", 1)[1].count("«") == 3 and "«What" not in printed
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("line, message", [
    ('{"messages": [}', "chats.jsonl:2: "),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "chats.jsonl:2: "),
    ('{"messages": []}', "chats.jsonl:2: "),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "chats.jsonl:2: "),
], ids=["malformed", "unknown-role", "empty", "no-assistant-turn"])
def test_bad_conversations_exit_2_with_one_line_and_nothing_written(tmp_path, capsys, line, message):
    (tmp_path / "chats.jsonl").write_text(json.dumps(CHATS[1]) + "\n" + line + "\n")
    assert jax_cli.main(["sft", "--data", str(tmp_path / "chats.jsonl"), "--steps", "1",
                         "--out", str(tmp_path / "run")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "run").exists()


def test_a_template_that_does_not_render_is_refused(tmp_path, capsys):
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS[:3]))
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}")
    assert jax_cli.main(["sft", "--data", str(tmp_path / "chats.jsonl"), "--chat-template",
                         str(tmp_path / "bad.jinja"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"error: {tmp_path / 'bad.jinja'}" in err
    assert "No filter named 'nosuchfilter'" in err
    assert not (tmp_path / "run").exists()


def test_truncation_that_leaves_nothing_to_train_is_refused_or_skipped(tmp_path, capsys):
    long = {"messages": [{"role": "user", "content": "word " * 300},
                         {"role": "assistant", "content": "ok"}]}
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS[:3] + [long]))
    argv = ["sft", "--data", str(tmp_path / "chats.jsonl"), "--seq-len", "127", "--steps", "1",
            "--eval-data", str(tmp_path / "chats.jsonl"), "--out", str(tmp_path / "run")]
    assert jax_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'chats.jsonl'}:4: no assistant token is left within the first 128 tokens" in err
    assert not (tmp_path / "run").exists()
    assert jax_cli.main(argv + ["--skip-invalid", "--show-mask", "1"]) == 0


# -- replay: the starting model's own answers ----------------------------------------------------

def test_general_prompts_are_seeded_distinct_and_of_no_demo_kind():
    from jax_llama.training.sft import general_prompts

    prompts = general_prompts(300, seed=0)
    assert len(set(prompts)) == 300 and general_prompts(300, seed=0) == prompts
    assert general_prompts(5, seed=1) != general_prompts(5, seed=0)
    demo = {m["content"] for _, chat in demo_chats(2000, seed=0) for m in chat}
    assert not demo & set(prompts)
    # the questions scripts/sft_pretrained.py asks before and after are not replayed
    assert not any(w in p.lower() for p in prompts for w in ("france", "colour", "haiku", "sleep"))
    for bad in (0, 301, -2):
        with pytest.raises(Exception, match=r"replay: must be in \[1, 300\]"):
            general_prompts(bad, seed=0)


@pytest.mark.parametrize("text, finished, kept", [
    (" Paris is the capital. It is big", True, "Paris is the capital. It is big"),
    ("Paris is the capital. It is big", False, "Paris is the capital."),
    ("One! Two? Three", False, "One! Two?"),
    ("A whole sentence.", False, "A whole sentence."),
    ("no end at all", False, None),
    ("   ", True, None),
])
def test_a_replayed_answer_cut_by_the_token_limit_keeps_whole_sentences(text, finished, kept):
    from jax_llama.training.sft import replay_answer

    assert replay_answer(text, finished) == kept


def test_replay_adds_the_starting_model_s_greedy_answers(sft_run, tmp_path, monkeypatch, capsys):
    """--replay N: N general prompts, each with the --init model's greedy answer (what
    jax_llama.generate gives for it alone), join the training chats. The tiny model's answers
    never end a sentence, so replay_answer is made to keep them whole here."""
    from bridge.chat import find_template
    from tasks.prompts import stop_ids
    from jax_llama.training import sft as sft_lib
    from jax_llama.training.sft import general_prompts

    root, _ = sft_run
    init = root / "base" / "model"
    monkeypatch.setattr(sft_lib, "replay_answer", lambda text, finished: text.strip() or None)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS[:2]))
    argv = ["sft", "--data", str(tmp_path / "chats.jsonl"), "--eval-data",
            str(tmp_path / "chats.jsonl"), "--init", str(init), "--seq-len", "255",
            "--out", str(tmp_path / "run")]  # room for a whole answer of 128 tokens
    assert jax_cli.main([*argv, "--replay", "2", "--show-mask", "4"]) == 0
    out, err = capsys.readouterr()
    assert "replay: 2 of the starting model's own answers join the training chats" in err
    tokenizer = load_tokenizer(init)
    template = find_template(init, tokenizer, None)
    model, params = jax_llama.load(init)
    stops = list(stop_ids(tokenizer))
    for prompt in general_prompts(2, seed=0):
        assert prompt in out
        ids = template.encode([{"role": "user", "content": prompt}], tokenizer,
                              add_generation_prompt=True)
        tokens = jax_llama.generate(model, params, [ids], 128, stop_ids=stops).tokens[0]
        answer = tokenizer.decode([t for t in tokens if t not in stops]).strip()
        assert answer and answer in out
    assert not (tmp_path / "run").exists()

    assert jax_cli.main(["sft", "--data", str(tmp_path / "chats.jsonl"), "--replay", "2",
                         "--out", str(tmp_path / "run")]) == 2
    assert "error: --replay: needs --init: the answers replayed are the starting model's own" in \
        capsys.readouterr().err
    assert not (tmp_path / "run").exists()
