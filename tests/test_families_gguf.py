"""Qwen2, Qwen3 and Mistral in GGUF, checked against llama.cpp's own converter: a small random
transformers model, converted by convert_hf_to_gguf.py from the llama-cpp-python source
distribution, reads back as the Hugging Face directory's tensors exactly and gives transformers'
logits in both twins; our own export is llama.cpp's file again (its names, keys, pre-tokenizer
and bytes), and reads back the same. Without the per-head RoPE permutation of a qwen file, or
with a bias changed, the logits are wrong; a file that lacks a delta's tensor, or names an
architecture not read, is refused in one line naming it.

The converter wants a real tokenizer (it names the pre-tokenizer by hashing how one text
tokenizes), so the models take Qwen's own vocabulary, rebuilt from llama.cpp's
models/ggml-vocab-qwen2.gguf, and its 151,936 ids."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import jax_llama  # noqa: E402
import torch_llama  # noqa: E402
from bridge.errors import BridgeError  # noqa: E402
from bridge.formats import open_checkpoint  # noqa: E402
from bridge.gguf.container import read_gguf  # noqa: E402
from bridge.gguf.read import GGUFCheckpoint  # noqa: E402
from bridge.gguf.tokenizer import gguf_file_tokenizer  # noqa: E402
from bridge.gguf.write import write_gguf  # noqa: E402
from conftest import SDIST_DIR  # noqa: E402
from test_families import BRIDGE, FAMILIES, SMALL, _error_lines, _hf_model  # noqa: E402
from test_gguf import rewrite  # noqa: E402

F32 = 0  # GGML_TYPE_F32
QWEN_VOCAB = 151936  # Qwen2's ids, as ggml-vocab-qwen2.gguf pads them
TOKENS = np.random.default_rng(1).integers(0, QWEN_VOCAB, (2, 9))
LLAMA_CPP = "vendor/llama.cpp/"
# What the converter needs of the source distribution: itself, its package, and the gguf-py beside
# it (the version it was written against).
_NEEDED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


@pytest.fixture(scope="module")
def llama_cpp(llama_cpp_vocab, tmp_path_factory) -> Path:
    """llama.cpp's converter, taken out of the llama-cpp-python source distribution in
    .cache/sdist (llama_cpp_vocab skips, saying how to fetch it, without one)."""
    out = tmp_path_factory.mktemp("llama.cpp")
    with tarfile.open(sorted(SDIST_DIR.glob("llama_cpp_python-*.tar.gz"))[-1]) as tar:
        for member in tar:
            _, _, inside = member.name.partition(LLAMA_CPP)
            if member.isfile() and inside.startswith(_NEEDED):
                (out / inside).parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src:
                    (out / inside).write_bytes(src.read())
    return out


@pytest.fixture(scope="module")
def qwen_tokenizer(llama_cpp_vocab, tmp_path_factory) -> Path:
    """Qwen2's tokenizer.json, rebuilt from ggml-vocab-qwen2.gguf, saved without the name of the
    GGUF pre-tokenizer it came from (a Hugging Face Qwen directory has none)."""
    out = tmp_path_factory.mktemp("qwen-tokenizer")
    gguf_file_tokenizer(llama_cpp_vocab / "ggml-vocab-qwen2.gguf").save(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("gguf_tokenizer_pre")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _converted(model, root: Path, llama_cpp: Path, tokenizer: Path) -> tuple[Path, np.ndarray]:
    """`model` saved in root/hf with the Qwen tokenizer, and converted to an f32 GGUF by
    llama.cpp's converter -> (the GGUF, transformers' logits of TOKENS)."""
    model.save_pretrained(root / "hf")
    for f in tokenizer.iterdir():
        (root / "hf" / f.name).write_bytes(f.read_bytes())
    out = root / "llama.cpp.gguf"
    result = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"),
                             str(root / "hf"), "--outfile", str(out), "--outtype", "f32"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        return out, model(torch.as_tensor(TOKENS)).logits.float().numpy()


@pytest.fixture(scope="module")
def converted_by_family(llama_cpp, qwen_tokenizer, tmp_path_factory):
    """family -> (its HF directory with the Qwen tokenizer, the f32 GGUF llama.cpp's converter
    makes of it, transformers' logits)."""
    made = {}

    def convert(family):
        if family not in made:
            model = _hf_model(family, vocab_size=QWEN_VOCAB)
            root = tmp_path_factory.mktemp(family)
            made[family] = (root / "hf", *_converted(model, root, llama_cpp, qwen_tokenizer))
        return made[family]
    return convert


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, converted_by_family):
    return (request.param, *converted_by_family(request.param))


# The checks that rewrite a whole file (a 152k vocabulary, seconds each) run on qwen2 by default,
# and on qwen3 as well under -m slow; qwen3's reading and export are checked by default above.
@pytest.fixture(scope="module", params=["qwen2", pytest.param("qwen3", marks=pytest.mark.slow)])
def qwen(request, converted_by_family):
    return (request.param, *converted_by_family(request.param))


def _logits(path) -> tuple[np.ndarray, np.ndarray]:
    """Both twins' logits for TOKENS from the checkpoint at `path`: (jax, torch)."""
    model, params = jax_llama.load(path)
    jax_logits = np.asarray(model.apply({"params": params}, TOKENS))
    torch_logits = torch_llama.load(path, device="cpu")(torch.as_tensor(TOKENS)).detach().numpy()
    return jax_logits, torch_logits


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _assert_far(got: np.ndarray, want: np.ndarray) -> None:
    assert np.abs(got - want).max() > 1e-2 * np.abs(want).max()


def _same_tensors(a, b) -> None:
    assert list(a.specs) == list(b.specs)
    for name in a.specs:
        np.testing.assert_array_equal(a.tensor(name), b.tensor(name), err_msg=name)


# -- llama.cpp's converter's files ----------------------------------------------------------------

def test_llama_cpps_file_reads_as_the_hf_directory(converted):
    family, hf, gg, _ = converted
    fields = read_gguf(gg).fields
    arch = "llama" if family == "mistral" else family
    assert fields["general.architecture"] == arch
    ckpt, source = open_checkpoint(gg), open_checkpoint(hf)
    # Mistral is a llama file: llama.cpp's converter writes no family, so it reads back as LLaMA
    assert ckpt.config.family == ("llama" if family == "mistral" else family)
    assert ckpt.config.deltas == source.config.deltas
    assert ckpt.config.head_dim == source.config.head_dim
    if family == "qwen3":
        assert fields["qwen3.attention.key_length"] == 32 != SMALL["hidden_size"] // 4
    _same_tensors(ckpt, source)  # f32: the permutation undone exactly, every tensor


def test_both_twins_give_transformers_logits_from_llama_cpps_file(converted):
    _, _, gg, want = converted
    for got in _logits(gg):
        _assert_close(got, want)


def test_qwen_pre_tokenizer_and_chat_template(qwen, qwen_tokenizer):
    _, _, gg, _ = qwen
    fields = read_gguf(gg).fields
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    ours = open_checkpoint(gg).own_tokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(qwen_tokenizer)
    for text in ("Hello world, it's 2024!\n\n  indented 12345", "我想在apple工作 ☃ 'RE you"):
        assert ours.encode(text, bos=False, eos=False) == hf.encode(text)
    template = open_checkpoint(gg).own_template()
    assert template is not None and "<|im_start|>" in fields["tokenizer.chat_template"]


def test_reading_without_the_permutation_or_with_a_bias_changed_is_wrong(qwen, tmp_path,
                                                                        monkeypatch):
    family, _, gg, want = qwen
    flipped = rewrite(gg, tmp_path / "flipped.gguf", arch=family, tensors={
        ("blk.0.attn_q.bias" if family == "qwen2" else "blk.0.attn_q_norm.weight"):
            lambda a: -a})
    _assert_far(_logits(flipped)[1], want)
    monkeypatch.setattr(GGUFCheckpoint, "_interleaved", lambda self, name, rows: rows)
    for got in _logits(gg):
        _assert_far(got, want)


# -- our own export -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported_by_family(converted_by_family, tmp_path_factory):
    made = {}

    def export(family):
        if family not in made:
            hf, gg, want = converted_by_family(family)
            out = tmp_path_factory.mktemp(f"{family}-export") / "ours.gguf"
            result = subprocess.run([BRIDGE, "convert", str(hf), str(out), "--to", "gguf",
                                     "--dtype", "f32"], capture_output=True, text=True)
            assert result.returncode == 0, result.stderr
            made[family] = hf, gg, out, want
        return made[family]
    return export


@pytest.fixture(scope="module", params=list(FAMILIES))
def exported(request, exported_by_family):
    return (request.param, *exported_by_family(request.param))


def test_our_export_is_llama_cpps_file(exported):
    """The same architecture, hyperparameter keys, tokenizer keys, and tensors byte for byte as
    llama.cpp's converter writes from the same directory."""
    family, _, theirs, ours, _ = exported
    a, b = read_gguf(ours), read_gguf(theirs)
    arch = b.fields["general.architecture"]
    assert a.fields["general.architecture"] == arch
    for key, value in b.fields.items():
        if key.startswith(f"{arch}.") or key in ("tokenizer.ggml.model", "tokenizer.ggml.pre",
                                                  "tokenizer.chat_template"):
            assert a.fields.get(key) == value, key
    assert a.fields["tokenizer.ggml.tokens"] == b.fields["tokenizer.ggml.tokens"]
    theirs_by_name = {t.name: t for t in b.tensors}
    assert sorted(t.name for t in a.tensors) == sorted(theirs_by_name)
    for t in a.tensors:
        u = theirs_by_name[t.name]
        assert (t.type_id, tuple(t.shape)) == (u.type_id, tuple(u.shape)), t.name
        assert np.array_equal(a.raw(t), b.raw(u)), t.name


def test_our_export_reads_back(exported):
    _, hf, _, ours, want = exported
    _same_tensors(open_checkpoint(ours), open_checkpoint(hf))
    for got in _logits(ours):
        _assert_close(got, want)


def test_quantised_export_keeps_biases_and_norms_f32(qwen, tmp_path):
    family, hf, theirs, _ = qwen
    out = tmp_path / "q8.gguf"
    result = subprocess.run([BRIDGE, "convert", str(hf), str(out), "--to", "gguf",
                             "--dtype", "q8_0"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    types = {t.name: gguf.GGMLQuantizationType(t.type_id).name for t in read_gguf(out).tensors}
    delta = [n for n in types if n.endswith((".bias", "_norm.weight"))]
    assert delta and all(types[n] == "F32" for n in delta)
    assert types["blk.0.attn_q.weight"] == "Q8_0"
    # the q8_0 blocks are gguf's quantisation of llama.cpp's own (half-split) rows
    f32 = {t.name: t for t in read_gguf(theirs).tensors}
    mine = next(t for t in read_gguf(out).tensors if t.name == "blk.1.attn_k.weight")
    rows = read_gguf(theirs).raw(f32[mine.name]).view(np.float32).reshape(mine.shape)
    quantised = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(read_gguf(out).raw(mine).reshape(quantised.shape), quantised)


def test_q4_blocks_come_in_the_interleaved_order(qwen, tmp_path):
    """A Q4_0 qwen file's q and k blocks, handed to int4 loading as they are held, come per head
    in the order tensor() gives: the same numbers dequantised."""
    from bridge.int4 import dequantize_int4

    _, hf, _, _ = qwen
    out = tmp_path / "q4.gguf"
    result = subprocess.run([BRIDGE, "convert", str(hf), str(out), "--to", "gguf",
                             "--dtype", "q4_0"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    ckpt = open_checkpoint(out)
    for name in ("layers.0.attention.wq.weight", "layers.1.attention.wk.weight"):
        held = dequantize_int4(*ckpt.int4_tensor(name))
        np.testing.assert_array_equal(np.asarray(held, np.float32), ckpt.tensor(name))
        assert np.abs(ckpt.tensor(name) - open_checkpoint(hf).tensor(name)).max() < 0.1


# -- refusals -------------------------------------------------------------------------------------

def _refused(args: list, *words: str) -> None:
    result = subprocess.run([BRIDGE, *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    errors = _error_lines(result.stderr)
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in errors[0], (word, errors[0])


@pytest.mark.slow  # a whole 152k-vocabulary file rewritten (10 s)
def test_a_missing_delta_tensor_is_named(qwen, tmp_path):
    family, _, gg, _ = qwen
    name = "blk.1.attn_k.bias" if family == "qwen2" else "blk.1.attn_k_norm.weight"
    src = gguf.GGUFReader(gg)  # the file again, every key and every tensor but `name`
    dst = gguf.GGUFWriter(tmp_path / "missing.gguf", family)
    for key, f in src.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            dst.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in src.tensors:
        if t.name != name:
            dst.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    dst.write_header_to_file()
    dst.write_kv_data_to_file()
    dst.write_tensors_to_file()
    dst.close()
    _refused(["convert", tmp_path / "missing.gguf", tmp_path / "out"], "missing.gguf", name)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a whole 152k-vocabulary file rewritten (10 s); tests/test_gguf.py refuses
# an unread architecture on a small file by default
def test_an_architecture_not_read_is_named(qwen, tmp_path):
    _, _, gg, _ = qwen
    gemma = rewrite(gg, tmp_path / "gemma.gguf", arch="gemma")
    _refused(["convert", gemma, tmp_path / "out"], "gemma.gguf", "general.architecture",
             "'gemma'")


def test_what_gguf_cannot_hold_is_refused_by_name(converted_by_family, tmp_path):
    hf, _, _ = converted_by_family("qwen2")
    ckpt = open_checkpoint(hf)
    for changes, word in [(dict(family="mistral", qkv_bias=False, sliding_window=8),
                           "sliding_window"),
                          (dict(sliding_window=8), "sliding_window"),
                          (dict(qk_norm=True), "qk_norm"),
                          (dict(qkv_bias=False), "qkv_bias")]:
        config = ckpt.config.replace(**changes)
        with pytest.raises(BridgeError, match=word):
            write_gguf(tmp_path / "x.gguf", config, {}, ckpt.tensor)
        assert not (tmp_path / "x.gguf").exists()


# -- llama.cpp itself (slow: needs `pip install llama-cpp-python`) ---------------------------------

def _llama_cpp_logits(path: Path) -> np.ndarray:
    """llama.cpp's float32 logits (B, S, V) of TOKENS, each row evaluated alone from position 0,
    its KV cache in float32 (its default, float16, rounds keys and values by 2.7e-4 here)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from llama_twins.llama_cpp_reference import plain_cpu_kernels

    with plain_cpu_kernels():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=16, n_batch=16, logits_all=True,
                              verbose=False, n_threads=2, type_k=F32, type_v=F32)
    try:
        rows = []
        for row in TOKENS.tolist():
            llm.reset()
            llm.eval(row)
            rows.append(np.array(llm.scores[:len(row)], np.float32))
        return np.stack(rows)
    finally:
        llm.close()


@pytest.mark.slow
def test_llama_cpp_runs_our_export_and_its_own_file_as_transformers(exported):
    """llama.cpp on its converter's file and on ours gives transformers' logits. Tolerance 1e-4
    of the largest logit: ggml's float32 matmuls and its own RoPE and softmax, summed in other
    orders (the twins' 1e-5 is the same sums in one order nearer transformers'). With a
    delta's tensor changed (a bias or head norm negated), llama.cpp's logits part: the check can
    fail."""
    family, _, theirs, ours, want = exported
    for path in (theirs, ours):
        got = _llama_cpp_logits(path)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    delta = {"qwen2": "blk.0.attn_k.bias", "qwen3": "blk.0.attn_k_norm.weight"}.get(family)
    if delta is not None:  # the delta's tensor changed in llama.cpp's file: llama.cpp parts
        wrong = rewrite(theirs, theirs.with_name("changed.gguf"), arch=family,
                        tensors={delta: lambda a: -a})
        assert np.abs(_llama_cpp_logits(wrong) - want).max() > 100 * 1e-4 * np.abs(want).max()


@pytest.mark.slow
def test_llama_cpp_agrees_inside_the_window_it_does_not_have(llama_cpp, qwen_tokenizer, tmp_path):
    """Mistral v0.1's window: llama.cpp's converter writes the file as plain LLaMA and llama.cpp
    attends over every position, so it equals transformers' windowed model inside the first W
    positions and parts from it after; the twins read the HF directory with its window and equal
    transformers everywhere. Our GGUF export refuses the window by name."""
    W = 4
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        **{**SMALL, "vocab_size": QWEN_VOCAB}, sliding_window=W)).eval()
    out, want = _converted(model, tmp_path, llama_cpp, qwen_tokenizer)
    got = _llama_cpp_logits(out)
    tolerance = 1e-4 * np.abs(want).max()
    np.testing.assert_allclose(got[:, :W], want[:, :W], rtol=0, atol=tolerance)
    assert np.abs(got[:, W:] - want[:, W:]).max() > 100 * tolerance
    for twin in _logits(tmp_path / "hf"):
        _assert_close(twin, want)
    _refused(["convert", tmp_path / "hf", tmp_path / "ours.gguf", "--to", "gguf"],
             "sliding_window")
