"""`llama-bridge convert ... --to hf` carries a tokenizer transformers reads as ours: the files,
BOS, the stop ids, the chat template, greedy generation text in and text out against our own,
and a tokenizer that does not fit the model refused (one line, exit 2, nothing written)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import jax_llama
from bridge.config import LlamaConfig
from bridge.convert import convert
from bridge.formats import write_native
from bridge.sampling import Sampler
from bridge.tensors import canonical_shapes
from bridge.tokenizer import load_tokenizer
from test_convert import run_cli

transformers = pytest.importorskip("transformers")
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "tokenizers"
KINDS = {"llama3": (128256, [128000, 9906, 1917]), "llama2": (32000, [1, 15043, 3186])}


def random_native(path: Path, vocab_size: int, kind: str) -> Path:
    """A small random float32 model of `vocab_size` with the real tokenizer.model beside it."""
    if not (SHARED / kind / "tokenizer.model").is_file():
        pytest.skip(f"the real {kind} tokenizer is not at {SHARED / kind}")
    config = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                         vocab_size=vocab_size, max_seq_len=64, rope_theta=10000.0)
    rng = np.random.default_rng(0)
    tensors = {n: (1.0 if "norm" in n else 0.0) + 0.05 * rng.standard_normal(s, np.float32)
               for n, s in canonical_shapes(config).items()}
    write_native(path, config, {n: (a.shape, a.dtype) for n, a in tensors.items()}, tensors.get)
    shutil.copy(SHARED / kind / "tokenizer.model", path)
    return path


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_export_reads_as_ours_in_transformers(tmp_path, kind):
    vocab, hello = KINDS[kind]
    src = random_native(tmp_path / "native", vocab, kind)
    convert(src, tmp_path / "hf", to="hf", progress=False)
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json", "tokenizer.model"} <= names
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("Hello world")["input_ids"] == hello  # BOS included, as the originals give
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    ours = load_tokenizer(src)
    assert generation["bos_token_id"] == ours.bos_id
    assert set(generation["eos_token_id"]) == set(ours.stop_ids)
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert ("chat_template" in config) == (kind == "llama3")  # LLaMA 3's for its vocabulary

    # Greedy generation, text in and text out: transformers on the export, ours on the source.
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    jmodel, params = jax_llama.load(src)
    for prompt in ["Hello world", "The movie was", "Once upon a time"]:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        theirs = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False,
                                           pad_token_id=ours.eos_id)[0, ids.shape[1]:])
        new = jax_llama.generate(jmodel, params, [ours.encode(prompt, bos=True)], 8,
                                 Sampler(), ()).tokens[0]
        assert theirs == ours.decode(new), prompt


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, capsys):
    src = random_native(tmp_path / "native", 1000, "llama2")
    code, _, err = run_cli(["convert", src, tmp_path / "hf", "--to", "hf"], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "tokenizer.model: the tokenizer's largest id 31999 does not fit " \
                                "the model's vocab_size 1000" in lines[0]
    assert not (tmp_path / "hf").exists()


def test_llama2c_has_no_tokenizer_so_convert_takes_one(tmp_path, capsys):
    src = random_native(tmp_path / "native", 32000, "llama2")
    convert(src, tmp_path / "model.bin", to="llama2c", progress=False)
    code, _, err = run_cli(["convert", tmp_path / "model.bin", tmp_path / "hf", "--to", "hf",
                            "--tokenizer", SHARED / "llama2" / "tokenizer.model", "--quiet"], capsys)
    assert code == 0, err
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("Hello world")["input_ids"] == [1, 15043, 3186]
    code, _, err = run_cli(["convert", tmp_path / "model.bin", tmp_path / "hf2", "--to", "hf",
                            "--tokenizer", tmp_path / "none.model"], capsys)
    assert code == 2 and "--tokenizer: " in err and not (tmp_path / "hf2").exists()


def test_a_run_directory_with_our_bpe_gains_its_bos(tmp_path):
    """A run's model/ holds the tokenizer.json our BPE training writes, which adds no BOS: the
    export rewrites it so that transformers encodes as the model was trained."""
    from bridge.tokenizer import train_tokenizer

    texts = [f"line {i}: the quick brown fox jumps over {i % 7} lazy dogs" for i in range(300)]
    ours = train_tokenizer(texts, 400)
    config = LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64,
                         vocab_size=ours.vocab_size, max_seq_len=64, rope_theta=10000.0)
    rng = np.random.default_rng(0)
    tensors = {n: 0.05 * rng.standard_normal(s, np.float32) for n, s in canonical_shapes(config).items()}
    write_native(tmp_path / "model", config, {n: (a.shape, a.dtype) for n, a in tensors.items()},
                 tensors.get)
    ours.save(tmp_path / "model")
    convert(tmp_path / "model", tmp_path / "hf", to="hf", progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    mismatches = [t for t in texts if tok(t)["input_ids"] != ours.encode(t, bos=True)]
    assert mismatches == [] and tok(texts[0])["input_ids"][0] == ours.bos_id
