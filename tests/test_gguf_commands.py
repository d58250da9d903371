"""Every command takes a .gguf path as it takes any checkpoint, with the file's own tokenizer, chat
template, stop tokens and BOS rule: inspect, parity, both generate commands, eval, zero-shot,
finetune / sft / train / dpo --init.

The model is small and random (dim 64, two layers) so that each command costs seconds; its
vocabulary, chat template and GGUF keys are SmolLM2-135M-Instruct's (the `smollm2` fixture: BPE
pre-tokenizer `smollm`, ChatML, `add_bos_token` false), written by our GGUF writer - so the tests
also check that a real vocabulary survives GGUF -> native -> GGUF key for key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import jax_llama
from bridge.chat import TEMPLATE_FILE, find_template
from bridge.convert import convert
from bridge.gguf.container import read_gguf
from tasks.prompts import encode_prompts
from bridge.tokenizer import find_tokenizer, load_tokenizer
from conftest import small_config
from llama_twins.cli import bridge_main as bridge_cli, main as jax_cli, torch_main as torch_cli

VOCAB_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
              "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token",
              "tokenizer.chat_template")


def keys(path: Path) -> dict:
    fields = read_gguf(path).fields  # as gguf's reader reads them: test_gguf.py checks
    return {k: fields[k] for k in VOCAB_KEYS if k in fields}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2) -> Path:
    """tiny.gguf: random weights, SmolLM2's vocabulary and template (F32 tensors)."""
    root = tmp_path_factory.mktemp("gguf-commands")
    config = small_config(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=49152,
                          max_seq_len=256, bos_id=1, eos_ids=(2,))
    jax_llama.save(root / "native", config, jax_llama.init(config, seed=0)[1])
    tokenizer = load_tokenizer(smollm2)
    tokenizer.save(root / "native")
    find_template(smollm2, tokenizer).save(root / "native")
    return convert(root / "native", root / "tiny.gguf", "gguf", progress=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf-commands-data")
    words = ["good", "bad", "fine", "awful", "great", "dull"]
    rng = np.random.default_rng(0)
    lines = [f"{i % 2} ||| {' '.join(rng.choice(words, 5))}" for i in range(24)]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    (root / "dev.txt").write_text("\n".join(lines[:8]) + "\n")
    (root / "labels.json").write_text('["negative", "positive"]')
    (root / "text.txt").write_text("the film was good and the cast was fine\n" * 20)
    chats = [{"messages": [{"role": "user", "content": f"Say {w}."},
                           {"role": "assistant", "content": w}]} for w in words * 4]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    return root


def test_a_real_vocabulary_survives_gguf_native_gguf(tiny, smollm2):
    assert keys(tiny) == keys(smollm2)


def test_inspect_names_the_stored_types_and_the_rebuilt_tokenizer(tiny, capsys, monkeypatch):
    """From one opening of the file: the tokenizer described is the one opening it read (it was
    5: the opening, then looks at the file's magic and the tokenizer's own reading of it)."""
    def run():
        assert bridge_cli.main(["inspect", str(tiny), "--no-scan"]) == 0

    assert opens_of(tiny, monkeypatch, run) == 1
    out = capsys.readouterr().out
    assert "stored      F32 x" in out and "chat template" in out
    assert ("bos <|im_start|> not added, eos <|im_end|> not added: the GGUF file's "
            "tokenizer.ggml.add_bos_token; the GGUF file's tokenizer.ggml.add_eos_token") in out
    assert "not rebuilt" not in out


def test_prompts_follow_the_files_bos_rule(tiny):
    """No BOS where the tokenizer adds none, in each place that encodes text: generate's
    prompts, a finetune classifier's rows, zero-shot's prompts, eval's documents."""
    from tasks.classification import encode_texts
    from tasks.evaluation import Text, tokenize
    from jax_llama.classify import zero_shot_rows

    tokenizer = find_tokenizer(tiny)
    ids = tokenizer.encode("the film")
    assert ids[0] != tokenizer.bos_id
    assert encode_prompts(tokenizer, ["the film"], 256) == [ids]
    assert encode_texts(tokenizer, ["the film"], 64)[0] == [ids + [tokenizer.eos_id]]
    assert zero_shot_rows(tokenizer, ["the film"], ["good"], "{text}", 64)[0] == [ids]
    (doc,) = tokenize([Text("t.txt", "t.txt", "the film")], tokenizer)
    assert doc.ids.tolist() == ids
    tokenizer.add_bos = True  # the same tokenizer told to add one: each place does
    assert encode_prompts(tokenizer, ["the film"], 256) == [[tokenizer.bos_id] + ids]
    assert zero_shot_rows(tokenizer, ["the film"], ["good"], "{text}", 64)[0] == \
        [[tokenizer.bos_id] + ids]
    (chat,) = encode_prompts(tokenizer, ["hi"], 256, chat=find_template(tiny, tokenizer))
    assert tokenizer.decode(chat).startswith("<|im_start|>system\n")


def test_generate_in_both_twins(tiny, capsys):
    argv = ["generate", str(tiny), "--chat", "--prompt", "hi", "--max-new-tokens", "4"]
    assert jax_cli.main(argv) == 0
    jax_text = capsys.readouterr().out
    assert torch_cli.main(argv + ["--device", "cpu"]) == 0
    assert capsys.readouterr().out == jax_text


def opens_of(path: Path, monkeypatch, run) -> int:
    """How many times run() opens `path` - through open() / io.open (which pathlib, numpy's
    memmap and our GGUF reader go through) or os.open."""
    import builtins
    import io
    import os

    opened = []

    def counting(real):
        def open_(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and Path(file) == path:
                opened.append(file)
            return real(file, *args, **kwargs)
        return open_

    for module, name in ((builtins, "open"), (io, "open"), (os, "open")):
        monkeypatch.setattr(module, name, counting(getattr(module, name)))
    run()
    monkeypatch.undo()
    return len(opened)


def test_generate_opens_the_gguf_once(tiny, capsys, monkeypatch):
    """A command reads its checkpoint once and hands on what it read: the weights, config,
    tokenizer and chat template of `generate --chat` come from one opening of the .gguf (it was
    279 - one per tensor, and once each for the tokenizer, the template and --quantize's check)."""
    argv = ["generate", str(tiny), "--chat", "--prompt", "hi", "--max-new-tokens", "2"]
    assert opens_of(tiny, monkeypatch, lambda: load_tokenizer(tiny)) >= 1  # the count sees them
    assert opens_of(tiny, monkeypatch, lambda: jax_cli.main(argv)) <= 2
    assert opens_of(tiny, monkeypatch,
                    lambda: torch_cli.main(argv + ["--device", "cpu", "--quantize", "int8"])) <= 2
    capsys.readouterr()


def test_generate_opens_the_safetensors_once(tiny, capsys, monkeypatch):
    """The same for a native directory: its weights are read from one opening of
    model.safetensors (it was one per tensor), besides the one that reads its header."""
    native = tiny.parent / "native"
    argv = ["generate", str(native), "--chat", "--prompt", "hi", "--max-new-tokens", "2"]
    assert opens_of(native / "model.safetensors", monkeypatch, lambda: jax_cli.main(argv)) <= 2
    capsys.readouterr()


def test_config_json_is_read_once(tiny, tmp_path, capsys, monkeypatch):
    """Format detection hands the config.json it read to the reader: a native directory's is read
    once by generate (it was 2: detection, then the reader), a Hugging Face one's once by
    open_checkpoint (it was 3: detection asked whether it was native, then HF, then the reader)."""
    from bridge.formats import open_checkpoint

    native = tiny.parent / "native"
    argv = ["generate", str(native), "--chat", "--prompt", "hi", "--max-new-tokens", "2"]
    assert opens_of(native / "config.json", monkeypatch, lambda: jax_cli.main(argv)) == 1
    capsys.readouterr()
    hf = convert(native, tmp_path / "hf", "hf", progress=False)
    assert opens_of(hf / "config.json", monkeypatch, lambda: open_checkpoint(hf)) == 1
    assert opens_of(hf / "config.json", monkeypatch, lambda: open_checkpoint(hf, "hf")) == 1


def test_compare_torch_reads_both_twins_from_one_opening(tiny, capsys, monkeypatch):
    """generate --compare-torch compares the JAX twin the command loaded with a torch twin read
    from the checkpoint the command opened. The .gguf is opened once (it was 3: the command's
    opening, then greedy_parity's for each twin, which loaded the JAX twin a second time); a
    native directory's model.safetensors twice, as for plain generate (it was 6)."""
    def argv(path):
        return ["generate", str(path), "--chat", "--prompt", "hi", "--max-new-tokens", "2",
                "--compare-torch"]

    assert opens_of(tiny, monkeypatch, lambda: jax_cli.main(argv(tiny))) == 1
    native = tiny.parent / "native"
    assert opens_of(native / "model.safetensors", monkeypatch,
                    lambda: jax_cli.main(argv(native))) == 2
    assert "JAX and torch agree on all" in capsys.readouterr().out


def test_eval_scores_without_a_bos(tiny, data, capsys):
    assert jax_cli.main(["eval", str(tiny), "--data", str(data / "text.txt"), "--seq-len", "64",
                         "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bos"] is False and report["tokens"] > 0


def test_zero_shot(tiny, data, capsys, monkeypatch):
    """Its tokenizer, chat template and weights from one opening of the .gguf (it was 6)."""
    def run():
        assert jax_cli.main(["zero-shot", str(tiny), "--data", str(data / "dev.txt"), "--labels",
                             str(data / "labels.json"), "--out", str(data / "zs.txt"),
                             "--chat"]) == 0

    assert opens_of(tiny, monkeypatch, run) == 1
    assert "zero-shot accuracy" in capsys.readouterr().out


def test_finetune_from_a_gguf_keeps_its_tokenizer(tiny, data, tmp_path, monkeypatch):
    """The backbone's weights, tokenizer and chat template from one opening of the .gguf (it was
    6: the weights, the tokenizer and the template each opened it, some more than once)."""
    out = tmp_path / "ft"

    def run():
        assert jax_cli.main(["finetune", "--init", str(tiny), "--train", str(data / "train.txt"),
                             "--dev", str(data / "dev.txt"), "--labels", str(data / "labels.json"),
                             "--out", str(out), "--epochs", "1", "--batch-size", "8",
                             "--max-len", "32"]) == 0

    assert opens_of(tiny, monkeypatch, run) == 1
    saved = load_tokenizer(out / "model")
    assert not saved.add_bos and saved.encode("good film") == find_tokenizer(tiny).encode("good film")


def trains_opening_once(tiny, monkeypatch, out, argv):
    """`jax-llama ARGV --out OUT` on the .gguf succeeds, opens it once, and saves its chat
    template beside the trained model."""
    def run():
        assert jax_cli.main([*argv, "--out", str(out)]) == 0

    assert opens_of(tiny, monkeypatch, run) == 1
    assert (out / "model" / TEMPLATE_FILE).read_text() == find_template(tiny, None).source


def test_sft_from_a_gguf_uses_its_chat_template(tiny, data, tmp_path, capsys, monkeypatch):
    """Its tokenizer, config, chat template and weights from one opening of the .gguf (it was
    7; --show-mask's tokenizer, config and template: 6)."""
    def show_mask():
        assert jax_cli.main(["sft", "--init", str(tiny), "--data", str(data / "chats.jsonl"),
                             "--show-mask", "1", "--out", str(tmp_path / "none")]) == 0

    assert opens_of(tiny, monkeypatch, show_mask) == 1
    shown = capsys.readouterr().out
    # ChatML has no generation tags: the reply's span is what its turn adds, newline included
    assert "<|im_start|>assistant\n«good<|im_end|>\n»" in shown
    trains_opening_once(tiny, monkeypatch, tmp_path / "sft",
                        ["sft", "--init", str(tiny), "--data", str(data / "chats.jsonl"),
                         "--steps", "1", "--batch-size", "2", "--seq-len", "64"])


def test_train_from_a_gguf_frames_documents_without_bos(tiny, data, tmp_path, monkeypatch):
    """Its tokenizer, config and weights from one opening of the .gguf (it was 5)."""
    out = tmp_path / "train"

    def run():
        assert jax_cli.main(["train", "--init", str(tiny), "--data", str(data / "text.txt"),
                             "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                             "--sample-tokens", "0", "--out", str(out)]) == 0

    assert opens_of(tiny, monkeypatch, run) == 1
    assert not load_tokenizer(out / "model").add_bos


def test_dpo_from_a_gguf_opens_it_once(tiny, data, tmp_path, monkeypatch):
    """Conversational pairs rendered with the file's chat template: the tokenizer, config,
    template and weights from one opening of the .gguf (it was 7)."""
    pairs = [{"prompt": [{"role": "user", "content": f"Say {w}."}],
              "chosen": [{"role": "assistant", "content": w}],
              "rejected": [{"role": "assistant", "content": "no"}]}
             for w in ("good", "bad", "fine", "awful", "great", "dull")]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    trains_opening_once(tiny, monkeypatch, tmp_path / "dpo",
                        ["dpo", "--init", str(tiny), "--data", str(tmp_path / "pairs.jsonl"),
                         "--steps", "1", "--batch-size", "2", "--seq-len", "48"])


def test_parity(tiny, capsys, monkeypatch):
    """The smallest report: what is GGUF's here is the loading, the rest is test_parity.py's. Both
    twins are read from the report's one opening of the file (it was 3: the report's, then one
    for each twin)."""
    def run():
        assert bridge_cli.main(["parity", str(tiny), "--batch", "1", "--seq-len", "8",
                                "--new-tokens", "0", "--no-reference-f64", "--json"]) == 0

    assert opens_of(tiny, monkeypatch, run) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == str(tiny) and report["passed"]
