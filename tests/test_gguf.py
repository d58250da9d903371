"""GGUF export and import: every written file read back with llama.cpp's own `gguf` reader (every
metadata key, every tensor), round trips, logits of a model loaded from GGUF, the tokenizer keys
of the real LLaMA 3 and LLaMA 2 tokenizers, and the refusals (exit 2, one line, nothing written).
A slow test runs llama.cpp itself (llama-cpp-python) on our file when it is installed."""

import json
import math
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest

import jax_llama
from bridge.config import RopeScaling
from bridge.convert import convert
from bridge.errors import BridgeError
from bridge.formats import detect_format, open_checkpoint
from bridge.gguf import read as gguf_module
from bridge.gguf.conventions import NAMES, OUR_KEY, llama3_rope_freqs
from bridge.gguf.container import read_gguf
from bridge.rope import rope_inv_freq
from bridge.tensors import canonical_shapes
from bridge.tokenizer import ByteTokenizer, _byte_level_chars, load_tokenizer
from conftest import SCALING, SHARED, jax_logits, random_tokens, small_config, smollm2_path
from llama_twins.cli import bridge_main as cli

Q = gguf.GGMLQuantizationType
# Row lengths 64 and 96 are whole Q8_0 blocks of 32; head_dim 16; GQA 4 / 2.
CFG = small_config(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96)


def save(path: Path, config, seed: int = 0) -> Path:
    jax_llama.save(path, config, jax_llama.init(config, seed=seed)[1])
    return path


def run_cli(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def fields(path_or_reader) -> dict:
    reader = path_or_reader
    if not isinstance(reader, gguf.GGUFReader):
        reader = gguf.GGUFReader(path_or_reader)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def expected_metadata(config, file_type: int) -> dict:
    """Every key a file of ours holds without a tokenizer, by llama.cpp's key names."""
    out = {"general.architecture": "llama", "general.file_type": file_type,
           "general.quantization_version": gguf.GGML_QUANT_VERSION,
           "llama.context_length": config.max_seq_len, "llama.embedding_length": config.dim,
           "llama.block_count": config.n_layers, "llama.feed_forward_length": config.ffn_dim,
           "llama.attention.head_count": config.n_heads,
           "llama.attention.head_count_kv": config.n_kv_heads,
           "llama.attention.key_length": config.head_dim,
           "llama.attention.value_length": config.head_dim,
           "llama.rope.dimension_count": config.head_dim,
           "llama.rope.freq_base": float(np.float32(config.rope_theta)),
           "llama.attention.layer_norm_rms_epsilon": float(np.float32(config.norm_eps)),
           "llama.vocab_size": config.vocab_size}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        out.update({OUR_KEY + "type": "llama3", OUR_KEY + "factor": s.factor,
                    OUR_KEY + "low_freq_factor": s.low_freq_factor,
                    OUR_KEY + "high_freq_factor": s.high_freq_factor,
                    OUR_KEY + "original_max_position_embeddings":
                        s.original_max_position_embeddings})
    return out


# -- names and RoPE facts ------------------------------------------------------------------------

def test_names_are_llama_cpps():
    """Each GGUF name is one gguf's own table lists for the llama architecture."""
    known = {gguf.TENSOR_NAMES[t] + ".weight" for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.LLAMA]}
    for canonical, name in NAMES.items():
        assert name.replace("{i}", "{bid}") in known, (canonical, name)
    assert len(set(NAMES.values())) == len(NAMES)


def test_rope_freqs_is_llama_cpps_formula_and_our_scaling():
    """rope_freqs as llama.cpp's converter computes it (transcribed here in torch float32, as it
    runs), and the divisor that turns our unscaled into our scaled frequencies."""
    import torch

    def llama_cpp(dim, base, factor, low, high, old):
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        out = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < old / high:
                out.append(1)
            elif wavelen > old / low:
                out.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append(1 / ((1 - smooth) / factor + smooth))
        return torch.tensor(out, dtype=torch.float32).numpy()

    for head_dim, theta, s in [(8, 100.0, SCALING), (128, 500000.0, None), (64, 500000.0, None)]:
        s = s or RopeScaling(factor=32.0)
        ours = llama3_rope_freqs(head_dim, theta, s)
        ref = llama_cpp(head_dim, theta, s.factor, s.low_freq_factor, s.high_freq_factor,
                        s.original_max_position_embeddings)
        # float32 pow may differ by an ulp between numpy and torch: 2 ulps allowed
        np.testing.assert_allclose(ours, ref, rtol=2.5e-7, atol=0)
        ratio = rope_inv_freq(head_dim, theta) / rope_inv_freq(head_dim, theta, s)
        np.testing.assert_allclose(ours, ratio, rtol=1e-6, atol=0)
    assert set(llama3_rope_freqs(8, 100.0, SCALING)[[0, 2, 3]]) == {1.0, 4.0}


# -- writing: read back with gguf's reader -------------------------------------------------------

@pytest.mark.parametrize("dtype, file_type, qtype", [
    ("f32", 0, Q.F32), ("f16", 1, Q.F16), ("bf16", 32, Q.BF16), ("q8_0", 7, Q.Q8_0)])
@pytest.mark.parametrize("tied", [False, True])
def test_every_key_and_tensor_read_back(tmp_path, dtype, file_type, qtype, tied):
    config = CFG.replace(tie_embeddings=tied, rope_scaling=SCALING)
    src = open_checkpoint(save(tmp_path / "src", config))
    out = convert(src.path, tmp_path / "m.gguf", "gguf", dtype=dtype, progress=False)
    assert fields(out) == expected_metadata(config, file_type)

    reader = gguf.GGUFReader(out)
    by_name = {t.name: t for t in reader.tensors}
    names = {NAMES[p].format(i=i) if "{i}" in p else NAMES[p]: p.format(i=i)
             for p in NAMES for i in range(config.n_layers)}
    expected = {g: c for g, c in names.items() if c in src.specs}
    assert set(by_name) == set(expected) | {"rope_freqs.weight"}
    np.testing.assert_array_equal(by_name["rope_freqs.weight"].data,
                                  llama3_rope_freqs(config.head_dim, config.rope_theta, SCALING))
    for name, canonical in expected.items():
        t, x = by_name[name], src.tensor(canonical)
        assert tuple(reversed(t.shape.tolist())) == x.shape, name
        if x.ndim == 1:  # norms in F32 whatever the file type, as llama.cpp keeps them
            assert t.tensor_type == Q.F32
            np.testing.assert_array_equal(t.data, x)
            continue
        assert t.tensor_type == qtype, name
        if qtype == Q.F32:
            np.testing.assert_array_equal(t.data, x)
        elif qtype == Q.F16:
            np.testing.assert_array_equal(t.data, x.astype(np.float16))
        elif qtype == Q.BF16:
            np.testing.assert_array_equal(t.data.view(ml_dtypes.bfloat16).reshape(x.shape),
                                          x.astype(ml_dtypes.bfloat16))
        else:
            np.testing.assert_array_equal(t.data, gguf.quants.quantize(x, Q.Q8_0))
            back = gguf.quants.dequantize(t.data, Q.Q8_0)
            # Q8_0: per block of 32, step d = absmax / 127 (rounded to float16, up to 2^-11
            # relative); rounding to the nearest step errs by at most d / 2, plus d's own rounding
            # times 127 steps
            blocks = np.abs(x).reshape(-1, 32).max(axis=1, keepdims=True) / 127
            bound = blocks * (0.5 + 127 * 2.0 ** -11)
            assert np.all(np.abs(back - x).reshape(-1, 32) <= bound + 1e-12), name


def test_q8_0_falls_back_to_f16_for_rows_not_whole_blocks(tmp_path):
    """ffn 80: w2's rows of 80 are not Q8_0 blocks of 32, so F16 (llama.cpp's converter's
    fallback), named on the warning; every other matrix Q8_0."""
    config = CFG.replace(ffn_dim=80)
    warnings = []
    from bridge.gguf.write import write_gguf
    src = open_checkpoint(save(tmp_path / "src", config))
    write_gguf(tmp_path / "m.gguf", config, src.specs, src.tensor, dtype="q8_0",
               warn=warnings.append)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.ffn_down.weight"] == Q.F16 and types["blk.1.ffn_gate.weight"] == Q.Q8_0
    assert any("layers.0.feed_forward.w2.weight" in w and "F16" in w for w in warnings)


def test_default_dtype_is_the_sources(tmp_path):
    src = save(tmp_path / "src", CFG)
    convert(src, tmp_path / "bf", "native", dtype="bfloat16", progress=False)
    out = convert(tmp_path / "bf", tmp_path / "m.gguf", "gguf", progress=False)
    assert fields(out)["general.file_type"] == 32
    assert {t.tensor_type for t in gguf.GGUFReader(out).tensors} == {Q.BF16, Q.F32}


def test_without_a_tokenizer_warns_on_stderr(tmp_path, capsys):
    code, _, err = run_cli(["convert", save(tmp_path / "src", CFG), tmp_path / "m.gguf",
                            "--to", "gguf", "--quiet"], capsys)
    assert code == 0 and "llama.cpp will not load it without one" in err
    assert not any(k.startswith("tokenizer.") for k in fields(tmp_path / "m.gguf"))


# -- reading: round trips and logits -------------------------------------------------------------

@pytest.mark.parametrize("changes", [dict(), dict(tie_embeddings=True), dict(n_kv_heads=1),
                                     dict(rope_scaling=SCALING, rope_theta=500000.0),
                                     dict(head_dim=32, norm_eps=1e-6),
                                     dict(bos_id=1, eos_ids=(2, 5))])
def test_native_gguf_native_is_bit_exact(tmp_path, changes):
    config = CFG.replace(**changes)
    src = save(tmp_path / "src", config)
    gg = convert(src, tmp_path / "m.gguf", "gguf", progress=False)
    assert detect_format(gg) == "gguf"
    back = open_checkpoint(convert(gg, tmp_path / "back", "native", progress=False))
    assert back.config == config
    for (name, x), (_, y) in zip(open_checkpoint(src), back):
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def test_jax_and_torch_load_gguf_with_the_same_logits(tmp_path):
    import torch_llama
    from conftest import torch_logits

    config = CFG.replace(rope_scaling=SCALING)
    src = save(tmp_path / "src", config, seed=5)
    tokens = random_tokens(config, batch=2, seq_len=12)
    model, params = jax_llama.load(src)
    want = jax_logits(model, params, tokens)
    assert np.abs(want).max() > 0.5  # logits of this random model: |max| 0.55, std 0.095
    for dtype, atol in [("f32", 0.0), ("q8_0", 1e-2)]:
        gg = convert(src, tmp_path / f"{dtype}.gguf", "gguf", dtype=dtype, progress=False)
        got = jax_logits(*jax_llama.load(gg), tokens)
        # f32: the same tensors, so the same logits, bit for bit. q8_0: weights rounded to 1/254
        # of each block's range; measured 4.8e-3 at most, 1e-2 allowed (~2% of the largest logit)
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)
        if dtype == "q8_0":
            assert np.abs(got - want).max() > 0  # the weights were quantised
        # the torch twin from the same file: the twins' float32 agreement
        np.testing.assert_allclose(torch_logits(torch_llama.load(gg, device="cpu"), tokens),
                                   got, rtol=1e-5, atol=1e-5)


def test_a_llama_cpp_file_without_our_keys(tmp_path):
    """A file llama.cpp made carries rope_freqs.weight only: LLaMA 3.1's parameters are
    recovered when they reproduce it, refused by name when not."""
    config = CFG.replace(rope_scaling=RopeScaling(factor=8.0), rope_theta=500000.0,
                         max_seq_len=256)
    gg = convert(save(tmp_path / "src", config), tmp_path / "m.gguf", "gguf", progress=False)
    stripped = rewrite(gg, tmp_path / "llama_cpp.gguf", drop=OUR_KEY)
    assert open_checkpoint(stripped).config == config
    odd = rewrite(gg, tmp_path / "odd.gguf", drop=OUR_KEY,
                  tensors={"rope_freqs.weight": lambda a: a * np.float32(1.5)})
    with pytest.raises(BridgeError, match="rope_freqs.weight.*cannot be recovered"):
        open_checkpoint(odd)


def rewrite(src: Path, dst: Path, drop: str = "\0", tensors=None, arch=None, add=None) -> Path:
    """A copy of a GGUF file through gguf's reader and writer, without the keys starting with
    `drop`, with some tensors changed (name -> function of the array, giving an array, or an
    array of blocks and its GGML type), `add(writer)` adding more keys or tensors, under
    architecture `arch`."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch or "llama")
    for key, f in reader.fields.items():
        if key.startswith(("GGUF.", drop)) or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    if add is not None:
        add(writer)
    for t in reader.tensors:
        changed = (tensors or {}).get(t.name, lambda a: a)(np.array(t.data))
        data, qtype = changed if isinstance(changed, tuple) else (changed, t.tensor_type)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# -- tokenizers ----------------------------------------------------------------------------------

def test_our_container_reader_reads_what_gguf_reads(tmp_path, llama2):
    """bridge.gguf.container against gguf.GGUFReader: every key's value, every tensor's name,
    type, shape and bytes - on a file of ours with the real LLaMA 2 vocabulary and on SmolLM2
    (llama.cpp's converter wrote it; where it is installed)."""
    ours = tokenizer_model(tmp_path, SHARED / "tokenizers/llama2/tokenizer.model", 32000)
    for path in [ours] + [p for p in [smollm2_path()] if p is not None]:
        theirs, mine = gguf.GGUFReader(path), read_gguf(path)
        assert mine.version == theirs.fields["GGUF.version"].contents()
        assert mine.fields == fields(theirs)
        assert [(t.name, t.type_id, t.shape, t.n_bytes) for t in mine.tensors] == \
            [(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist())),
              int(t.n_bytes)) for t in theirs.tensors]
        for t, u in zip(mine.tensors, theirs.tensors):
            assert t.start == u.data_offset
        t = mine.tensors[len(mine.tensors) // 2]
        np.testing.assert_array_equal(mine.raw(t), np.asarray(theirs.tensors[
            len(mine.tensors) // 2].data).view(np.uint8).reshape(-1))


def tokenizer_model(tmp_path, tokenizer_file, vocab_size):
    config = CFG.replace(vocab_size=vocab_size, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=32,
                         n_layers=1, tie_embeddings=True)
    src = save(tmp_path / "src", config)
    return convert(src, tmp_path / "m.gguf", "gguf", tokenizer=tokenizer_file, dtype="f16",
                   progress=False)


def test_llama3_tokenizer_keys_and_round_trip(tmp_path, llama3):
    gg = tokenizer_model(tmp_path, SHARED / "tokenizers/llama3/tokenizer.model", 128256)
    ckpt = open_checkpoint(gg)  # its tokenizer files live as long as it does
    # our container reader (gguf's, the independent one, takes ~10 s on 128k tokens and 280k
    # merges; test_our_container_reader_reads_what_gguf_reads holds the two equal)
    f = read_gguf(gg).fields
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "llama-bpe"
    tokens = f["tokenizer.ggml.tokens"]
    to_byte = {c: b for b, c in enumerate(_byte_level_chars())}
    by_rank = sorted(llama3._ranks.items(), key=lambda kv: kv[1])
    assert [bytes(to_byte[c] for c in t) for t in tokens[:128000]] == [t for t, _ in by_rank]
    assert tokens[128000:] == list(llama3.special_tokens)
    assert f["tokenizer.ggml.token_type"] == [1] * 128000 + [3] * 256
    merges = set(f["tokenizer.ggml.merges"])
    assert "Ġ t" in merges and "Ġt he" in merges  # " t" and " the" are ranks of their own
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"],
            f["tokenizer.ggml.eot_token_id"], f["tokenizer.ggml.eom_token_id"]) == \
        (128000, 128001, 128009, 128008)
    assert f["tokenizer.ggml.add_bos_token"] is True and f["tokenizer.ggml.add_eos_token"] is False
    # import rebuilds the very file, with llama.cpp's BOS decision beside it
    rebuilt, config = ckpt.extra_files
    assert rebuilt.read_bytes() == (SHARED / "tokenizers/llama3/tokenizer.model").read_bytes()
    assert json.loads(config.read_text())["add_bos_token"] is True


def test_llama2_tokenizer_keys_and_round_trip(tmp_path, llama2):
    gg = tokenizer_model(tmp_path, SHARED / "tokenizers/llama2/tokenizer.model", 32000 + 7)
    f = fields(gg)
    sp = llama2._sp
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.pre"] == "default"
    assert f["tokenizer.ggml.tokens"][:32000] == [sp.id_to_piece(i) for i in range(32000)]
    assert f["tokenizer.ggml.tokens"][32000:] == [f"[PAD{i}]" for i in range(32000, 32007)]
    np.testing.assert_array_equal(np.float32(f["tokenizer.ggml.scores"][:32000]),
                                  np.float32([sp.get_score(i) for i in range(32000)]))
    types = f["tokenizer.ggml.token_type"]
    assert types[:3] == [2, 3, 3] and types[3:259] == [6] * 256 and set(types[259:32000]) == {1}
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"],
            f["tokenizer.ggml.unknown_token_id"]) == (1, 2, 0)
    ckpt = open_checkpoint(gg)
    rebuilt, config = ckpt.extra_files
    again = load_tokenizer(rebuilt)
    assert again.kind == "llama2" and again.vocab_size == 32000
    assert config.name == "tokenizer_config.json" and (again.add_bos, again.add_eos) == (True, False)
    lines = (SHARED / "data/sst/train.txt").read_text().splitlines()[:300]
    texts = [line.split(" ||| ", 1)[1] for line in lines]
    texts += ["  two  spaces", "ünïcödé 🦙\n\tx"]
    assert [again.encode(t) for t in texts] == [llama2.encode(t) for t in texts]


def test_our_bpe_tokenizer_round_trips_through_tokenizer_json(tmp_path):
    from bridge.tokenizer import train_tokenizer

    tok = train_tokenizer(["hello world, hello GGUF " * 20, "the quick brown fox"], vocab_size=300)
    tok.save(tmp_path / "tok")
    gg = tokenizer_model(tmp_path, tmp_path / "tok" / "tokenizer.json", 301)
    f = fields(gg)
    assert (f["tokenizer.ggml.model"], f["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert f["tokenizer.ggml.tokens"][:3] == ["<|bos|>", "<|eos|>", "<|pad|>"]
    ckpt = open_checkpoint(gg)
    again = load_tokenizer(ckpt.extra_files[0])
    for text in ["hello world", "the quick brown GGUF fox!", "  spaces\n"]:
        assert again.encode(text) == tok.encode(text)
    assert (again.bos_id, again.eos_id, again.pad_id) == (0, 1, 2)


# -- refusals ------------------------------------------------------------------------------------

def refused(capsys, tmp_path, argv, *words):
    dst = Path(argv[2])
    code, out, err = run_cli(argv + ["--quiet"], capsys)
    assert code == 2 and out == "", err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}.partial-*"))
    return err


def test_refusals(tmp_path, capsys):
    src = save(tmp_path / "src", CFG)
    gg = convert(src, tmp_path / "m.gguf", "gguf", progress=False)
    capsys.readouterr()  # the no-tokenizer warning
    out = tmp_path / "out"
    refused(capsys, tmp_path, ["convert", src, out, "--dtype", "q8_0"], "--dtype", "q8_0", "gguf")
    refused(capsys, tmp_path, ["convert", src, tmp_path / "x.bin", "--to", "llama2c",
                               "--dtype", "q8_0"], "q8_0")

    gemma = rewrite(gg, tmp_path / "gemma.gguf", arch="gemma")
    refused(capsys, tmp_path, ["convert", gemma, out], "gemma.gguf", "general.architecture",
            "'gemma'")

    # a Q8_K tensor (256-element blocks of 292 bytes: llama.cpp's intermediate type for K-quant
    # matmuls, which gguf does not dequantise)
    q8k = gguf.GGUFWriter(tmp_path / "q8k.gguf", "llama")
    q8k.add_tensor("blk.0.attn_q.weight", np.zeros((64, 292), np.uint8), raw_dtype=Q.Q8_K)
    q8k.write_header_to_file()
    q8k.write_kv_data_to_file()
    q8k.write_tensors_to_file()
    q8k.close()
    refused(capsys, tmp_path, ["convert", tmp_path / "q8k.gguf", out], "q8k.gguf",
            "'blk.0.attn_q.weight'", "Q8_K", "cannot dequantise")

    data = gg.read_bytes()
    for cut in (len(data) - 100, 20, len(data) // 3):
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        refused(capsys, tmp_path, ["convert", short, out], short.name, "truncated")



# Every type gguf 0.19 dequantises: the float types, the legacy and K-quants, IQ, TQ, MXFP4.
QUANTISED = [t for t in Q if t.name not in ("F32", "F16", "BF16", "F64")
             and gguf_module._readable(t)]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random scale bits overflow float32
def test_every_type_gguf_dequantises_is_read_as_gguf_reads_it(tmp_path, monkeypatch):
    """Each quantised type, on random block bytes (dim 256: whole blocks of 256 for the
    K-quants), read through a few rows at a time equals gguf.quants.dequantize of the whole
    tensor - bit for bit, NaN where random scale bits make one."""
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "IQ2_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "IQ1_M", "TQ1_0", "TQ2_0"} <= \
        {t.name for t in QUANTISED}
    monkeypatch.setattr(gguf_module, "_DEQUANT_CHUNK", 1000)  # several chunks per tensor
    config = CFG.replace(dim=256, ffn_dim=256, n_layers=1)
    gg = convert(save(tmp_path / "src", config), tmp_path / "f32.gguf", "gguf", progress=False)
    rng = np.random.default_rng(0)
    for qtype in QUANTISED:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        path = tmp_path / f"{qtype.name}.gguf"

        def blocks(a, qtype=qtype, block=block, size=size):  # in place of the float32 rows
            return rng.integers(0, 256, (a.shape[0], a.shape[1] // block * size), np.uint8), qtype

        rewrite(gg, path, tensors={t.name: blocks for t in gguf.GGUFReader(gg).tensors
                                   if len(t.shape) == 2})
        ckpt = open_checkpoint(path)
        assert qtype.name in ckpt.tensor_types, qtype.name
        for t in gguf.GGUFReader(path).tensors:
            if t.tensor_type != qtype:
                continue
            name = gguf_module.canonical_name(t.name)
            assert ckpt.specs[name][1] == np.float32
            want = gguf.quants.dequantize(np.array(t.data), qtype)
            np.testing.assert_array_equal(ckpt.tensor(name), want, err_msg=f"{qtype.name} {name}")


def test_a_vocabulary_larger_than_the_embedding_is_refused(tmp_path, capsys):
    """CFG's embedding has 97 rows; a tokenizer of 98 tokens has an id no row stands for."""
    gg = convert(save(tmp_path / "src", CFG), tmp_path / "m.gguf", "gguf", progress=False)
    capsys.readouterr()
    tokens = [bytes([b]).decode("latin-1") for b in range(98)]

    def vocab(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))

    big = rewrite(gg, tmp_path / "big.gguf", add=vocab)
    err = refused(capsys, tmp_path, ["convert", big, tmp_path / "out"], "big.gguf",
                  "tokenizer.ggml.tokens holds 98 tokens", "97 rows")
    assert "Traceback" not in err


def test_a_vocabulary_we_cannot_rebuild_converts_the_weights_and_says_so(tmp_path, capsys):
    gg = convert(save(tmp_path / "src", CFG), tmp_path / "m.gguf", "gguf", progress=False)

    def vocab(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("kimi-k2")  # llama.cpp splits it in code, no table row holds it
        w.add_token_list([bytes([b]).decode("latin-1") for b in range(97)])

    odd = rewrite(gg, tmp_path / "odd.gguf", add=vocab)
    capsys.readouterr()
    code, out, err = run_cli(["convert", odd, tmp_path / "out", "--quiet"], capsys)
    assert code == 0, err
    (line,) = err.strip().splitlines()
    assert line.startswith("warning: ") and "odd.gguf: tokenizer not rebuilt" in line
    assert "'kimi-k2'" in line and "--tokenizer FILE" in line
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json",
                                                                    "model.safetensors"]
    # with --tokenizer it travels, and nothing is said
    tok = save(tmp_path / "bytes", CFG)
    ByteTokenizer().save(tok)
    code, out, err = run_cli(["convert", odd, tmp_path / "out2", "--quiet", "--tokenizer",
                              tok / "tokenizer.json"], capsys)
    assert code == 0 and err == "", err
    assert (tmp_path / "out2" / "tokenizer.json").is_file()


def test_unknown_tensor_and_scaling_type_are_refused(tmp_path):
    gg = convert(save(tmp_path / "src", CFG), tmp_path / "m.gguf", "gguf", progress=False)
    yarn = rewrite(gg, tmp_path / "yarn.gguf",
                   add=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN))
    with pytest.raises(BridgeError, match="yarn.gguf: llama.rope.scaling.type 'yarn'"):
        open_checkpoint(yarn)
    moe = rewrite(gg, tmp_path / "moe.gguf", add=lambda w: w.add_tensor(
        "blk.0.ffn_gate_exps.weight", np.zeros((2, 3), np.float32)))
    with pytest.raises(BridgeError, match="unexpected tensor 'blk.0.ffn_gate_exps.weight'"):
        open_checkpoint(moe)


def test_canonical_shapes_cover_every_name():
    assert {n.replace("0", "{i}", 1) if n.startswith("layers.0.") else n
            for n in canonical_shapes(CFG.replace(n_layers=1))} == set(NAMES)


# -- llama.cpp itself ----------------------------------------------------------------------------

@pytest.mark.slow
def test_llama_cpp_runs_our_gguf(tmp_path):
    """llama.cpp (llama-cpp-python) on our f32 GGUF: its logits equal ours within float32
    summation-order noise, and its greedy tokens are ours. The real LLaMA 2 vocabulary, so that
    llama.cpp accepts the file; weights random with a sharpened head (no near-ties)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    tok_file = SHARED / "tokenizers/llama2/tokenizer.model"
    if not tok_file.is_file():
        pytest.skip(f"the real llama2 tokenizer is not at {tok_file}")
    import torch_llama
    from conftest import torch_model

    for scaling in (None, SCALING):
        tmp = tmp_path / ("scaled" if scaling else "plain")
        config = CFG.replace(vocab_size=32000, max_seq_len=64, rope_scaling=scaling,
                             rope_theta=100.0 if scaling else 10000.0)
        torch_llama.save(tmp / "src", torch_model(config, seed=1, head_scale=8.0))
        gg = convert(tmp / "src", tmp / "m.gguf", "gguf", tokenizer=tok_file,
                     progress=False, force=True)
        llm = llama_cpp.Llama(str(gg), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
        tokens = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203]
        llm.eval(tokens)
        theirs = np.array(llm.scores[:len(tokens)])
        ours = jax_logits(*jax_llama.load(tmp / "src"), np.array([tokens], np.int32))[0]
        # float32 weights on both sides, but llama.cpp keeps its KV cache in float16 by default:
        # measured 1.03e-3 at most on logits of up to ~5; 5e-3 allowed. A wrong q/k row order
        # or RoPE would be off by O(1)
        np.testing.assert_allclose(theirs, ours, rtol=0, atol=5e-3)
        assert np.array_equal(theirs.argmax(-1), ours.argmax(-1))
        # and generation: llama.cpp's greedy continuation is ours
        llm.reset()
        theirs_gen = [t for _, t in zip(range(8), llm.generate(tokens, temp=0.0))]
        seq = list(tokens)
        model, params = jax_llama.load(tmp / "src")
        for _ in range(8):
            seq.append(int(jax_logits(model, params, np.array([seq], np.int32))[0, -1].argmax()))
        assert theirs_gen == seq[len(tokens):]


def _q4_k_blocks(rng, rows: int, cols: int, d: float = 0.0004, dmin: float = 0.0002):
    """Random Q4_K super-blocks (rows, cols / 256 x 144) with float16 d and dmin as given."""
    raw = rng.integers(0, 256, (rows, cols // 256, 144), np.uint8)
    raw[..., :4] = np.array([d, dmin], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_q4_k_keeps_its_4_bit_values_and_rounds_only_its_scales():
    """A Q4_K tensor in the 4-bit layout: with float32 scales, gguf's own dequantisation bit for
    bit (so the nibbles and the unpacked 6-bit scales are read right); with the layout's float16
    ones, each weight within the rounding of its scale and minimum (q |d sc| 2^-11 + |dmin m|
    2^-11, and float32's rounding of the two sums), the sums it returns those of the change.
    Negative cases: a super-block's halves read in the wrong order, and the refusals."""
    from bridge.gguf.int4 import from_q4_k_blocks
    from bridge.int4 import dequantize_int4, pack, unpack

    rng = np.random.default_rng(3)
    raw = _q4_k_blocks(rng, 37, 512)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    packed, d, m, change, norm = from_q4_k_blocks(raw, (37, 512), scale_dtype=np.float32,
                                                  chunk_bytes=1000)
    np.testing.assert_array_equal(dequantize_int4(packed, d, m), theirs)
    assert change == 0.0
    p16, d16, m16, change, norm = from_q4_k_blocks(raw, (37, 512), chunk_bytes=1000)
    np.testing.assert_array_equal(p16, packed)  # the same 4-bit values
    assert d16.dtype == m16.dtype == np.float16
    ours = dequantize_int4(p16, d16, m16)
    q = unpack(packed).reshape(37, 16, 32).astype(np.float64)
    bound = (q * np.abs(d.astype(np.float64))[..., None] + np.abs(m.astype(np.float64))[..., None]
             ) * 2.0 ** -11 + 2 * np.spacing(np.abs(theirs)).reshape(37, 16, 32)
    diff = np.abs(ours.astype(np.float64) - theirs).reshape(37, 16, 32)
    assert np.all(diff <= bound) and diff.max() > 0
    want = ((ours.astype(np.float64) - theirs) ** 2).sum() / (theirs.astype(np.float64) ** 2).sum()
    assert change / norm == pytest.approx(want, rel=1e-3)
    assert norm == pytest.approx((theirs.astype(np.float64) ** 2).sum(), rel=1e-9)
    swapped = unpack(packed).reshape(37, 2, 4, 2, 32)[:, :, :, ::-1].reshape(37, 512)
    assert np.abs(dequantize_int4(pack(swapped), d, m) - theirs).max() > 100 * bound.max()
    with pytest.raises(BridgeError, match="'w1': 100 bytes of Q4_K blocks"):
        from_q4_k_blocks(np.zeros(100, np.uint8), (1, 256), "w1")
    with pytest.raises(BridgeError, match="'w1': 288 input columns are not whole Q4_K"):
        from_q4_k_blocks(np.zeros(144, np.uint8), (1, 288), "w1")
    with pytest.raises(BridgeError, match="'w2': a Q4_K scale or minimum beyond float16"):
        from_q4_k_blocks(_q4_k_blocks(rng, 2, 256, d=60000.0), (2, 256), "w2")


def test_a_q4_k_file_loads_as_4_bit_values_as_stored(tmp_path, capsys):
    """A GGUF whose matrices are Q4_K loads by default (nearest) as 4-bit weights with the file's
    own 4-bit values, in both twins; the load's summary says so with the error of the rounded
    scales, far below what quantising the weights again gave; inspect says which."""
    import torch_llama
    from bridge.int4 import nearest_reader, quantize_int4

    config = CFG.replace(dim=256, ffn_dim=512, n_layers=1, n_heads=2, n_kv_heads=1)
    gg = convert(save(tmp_path / "src", config), tmp_path / "f32.gguf", "gguf", progress=False)
    rng = np.random.default_rng(0)
    path = rewrite(gg, tmp_path / "q4_k.gguf", tensors={
        t.name: lambda a: (_q4_k_blocks(rng, *a.shape), gguf.GGMLQuantizationType.Q4_K)
        for t in gguf.GGUFReader(gg).tensors
        if len(t.shape) == 2 and t.name != "token_embd.weight"})
    ckpt = open_checkpoint(path)
    near = nearest_reader(ckpt, ckpt.tensor, ckpt.config)
    name = "layers.0.feed_forward.w1.weight"
    packed, d, m = near(name)
    stored = ckpt.tensor(name)  # gguf's dequantisation of the file
    assert packed.shape == (512, 128) and d.shape == m.shape == (512, 8)
    assert np.abs(dequantize_layout(packed, d, m) - stored).max() <= 2.0 ** -10 * np.abs(
        stored).max()
    for other in ("layers.0.attention.wq.weight", "output.weight"):
        near(other)
    summary = near.summary()
    assert "3 Q4_K -> int4 with their 4-bit values as stored" in summary, summary
    # negative: quantising the weights again (what the load did before) changes them far more
    requantised = quantize_int4(stored)
    err = np.sqrt(((dequantize_layout(*requantised) - stored) ** 2).sum() / (stored ** 2).sum())
    assert max(near.rounded["Q4_K -> int4"]) < err / 20
    model, params = jax_llama.load(path, quantize="stored")
    np.testing.assert_array_equal(np.asarray(params["layers_0"]["feed_forward"]["w1"]["kernel"]),
                                  packed)
    tmodel = torch_llama.load(path, device="cpu", quantize="stored")
    np.testing.assert_array_equal(tmodel.state_dict()[name].numpy(), packed)
    tokens = random_tokens(config, 2, 8)
    np.testing.assert_allclose(jax_logits(model, params, tokens),
                               tmodel(__import__("torch").from_numpy(tokens)).detach().numpy(),
                               rtol=0, atol=1e-4)
    code, out, _ = run_cli(["inspect", path], capsys)
    assert code == 0 and "8 Q4_K -> int4 (4-bit values as stored)" in out, out


def dequantize_layout(packed, d, m):
    from bridge.int4 import dequantize_int4
    return dequantize_int4(packed, d, m)
