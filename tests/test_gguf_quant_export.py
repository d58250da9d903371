"""GGUF export in the small types people run. q4_0 / q4_1 / q5_0 / q5_1 / q8_0 by gguf.quants:
each tensor's type by llama.cpp's rules, every tensor's bits gguf's quantiser's, the logits of the
model read back within its quantisation error, and - where llama-cpp-python is installed - the
very file llama.cpp's own quantiser makes. The K-quants (q4_k_m, q6_k, ...) by llama.cpp's
quantiser (slow): the types it chose, llama.cpp running the file, and the twins reading a
requantised SmolLM2 as transformers does. The refusals: exit 2, one line, nothing written."""

import sys
import types
from pathlib import Path

import gguf
import numpy as np
import pytest

import jax_llama
from bridge.convert import convert
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from bridge.gguf.conventions import FILE_TYPES, NAMES, gguf_name
from conftest import SCALING, TOKENIZER_FILES, jax_logits, random_tokens, small_config
from test_gguf import expected_metadata, fields, refused, run_cli, save

Q = gguf.GGMLQuantizationType
# --dtype -> (the matrices' type, general.file_type: llama.h's enum llama_ftype)
TYPES = {"q4_0": (Q.Q4_0, 2), "q4_1": (Q.Q4_1, 3), "q5_0": (Q.Q5_0, 8), "q5_1": (Q.Q5_1, 9),
         "q8_0": (Q.Q8_0, 7)}
# Rows of 64 and 96: whole blocks of 32 (every type above); head_dim 16; GQA 4 / 2.
CFG = small_config(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96)


def expected_types(config, qtype) -> dict[str, Q]:
    """llama.cpp's rules, written out once more: norms and rope_freqs F32; the output projection
    (output.weight, or the tied token_embd.weight) Q8_0; every other matrix the file's type."""
    out = {"rope_freqs.weight": Q.F32} if config.rope_scaling is not None else {}
    for pattern in NAMES:
        for i in range(config.n_layers) if "{i}" in pattern else [None]:
            name = pattern.format(i=i)
            if name == "output.weight" and config.tie_embeddings:
                continue
            g = gguf_name(name)
            output = g == "output.weight" or (g == "token_embd.weight" and config.tie_embeddings)
            out[g] = Q.F32 if g.endswith("norm.weight") else Q.Q8_0 if output else qtype
    return out


def tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


# -- q4_0 ... q8_0, by gguf.quants ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", TYPES)
@pytest.mark.parametrize("tied", [False, True])
def test_types_keys_and_bits(tmp_path, dtype, tied):
    config = CFG.replace(tie_embeddings=tied, rope_scaling=SCALING)
    qtype, file_type = TYPES[dtype]
    src = open_checkpoint(save(tmp_path / "src", config))
    out = convert(src.path, tmp_path / "m.gguf", "gguf", dtype=dtype, progress=False)
    assert fields(out) == expected_metadata(config, file_type)

    by_name, want = tensors(out), expected_types(config, qtype)
    assert {n: t.tensor_type for n, t in by_name.items()} == want
    back = open_checkpoint(out)  # the bridge's own reader
    for canonical, x in src:
        t = by_name[gguf_name(canonical)]
        if x.ndim == 1:
            np.testing.assert_array_equal(t.data, x)
            continue
        # the file holds gguf's quantisation of the tensor, bit for bit, and reads back as its
        # dequantisation, exactly
        bits = gguf.quants.quantize(x, t.tensor_type)
        np.testing.assert_array_equal(t.data, bits)
        deq = gguf.quants.dequantize(bits, t.tensor_type).reshape(x.shape)
        np.testing.assert_array_equal(gguf.quants.dequantize(t.data, t.tensor_type)
                                      .reshape(x.shape), deq)
        np.testing.assert_array_equal(back.tensor(canonical), deq)
        assert np.abs(deq - x).max() > 0, canonical  # quantised, not copied


@pytest.mark.parametrize("dtype", ["q4_0", "q5_1"])
def test_rows_not_whole_blocks_fall_back_to_f16(tmp_path, dtype):
    """ffn 80: w2's rows of 80 are not blocks of 32, so F16 (llama.cpp's fallback for every
    32-block type), named in a warning; the rest keep the rules."""
    from bridge.gguf.write import write_gguf

    config = CFG.replace(ffn_dim=80)
    src = open_checkpoint(save(tmp_path / "src", config))
    warnings = []
    write_gguf(tmp_path / "m.gguf", config, src.specs, src.tensor, dtype=dtype,
               warn=warnings.append)
    want = expected_types(config, TYPES[dtype][0])
    want.update({f"blk.{i}.ffn_down.weight": Q.F16 for i in range(config.n_layers)})
    assert {n: t.tensor_type for n, t in tensors(tmp_path / "m.gguf").items()} == want
    falls = [w for w in warnings if "F16" in w]
    assert len(falls) == 2 and all("feed_forward.w2.weight" in w for w in falls), warnings


def relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum()))


def rms(a: np.ndarray) -> float:
    return float(np.sqrt((a ** 2).mean()))


def test_logits_within_the_quantisation_error(tmp_path):
    """The logits of the model read back from each file, against the original's, as relative
    RMS errors: within twice the weights' own relative RMS quantisation error (the error of all
    matrices together, as the file holds them). A small perturbation of the weights moves the
    logits of this random 2-layer model by 1.25x-1.55x its size (measured, every type, two
    seeds); 2x allowed, and the next-coarser type's logits (a bit fewer: twice the step) fall
    outside the next-finer one's bound, so a file of the wrong type fails."""
    import torch_llama
    from conftest import torch_logits

    config = CFG.replace(rope_scaling=SCALING)
    src = save(tmp_path / "src", config, seed=5)
    original = open_checkpoint(src)
    tokens = random_tokens(config, batch=4, seq_len=16)
    want = jax_logits(*jax_llama.load(src), tokens)
    weights, logits = {}, {}
    for dtype in TYPES:
        gg = convert(src, tmp_path / f"{dtype}.gguf", "gguf", dtype=dtype, progress=False)
        back = open_checkpoint(gg)
        matrices = [(back.tensor(n), x) for n, x in original if x.ndim == 2]
        weights[dtype] = relative_rms(np.concatenate([b.ravel() for b, _ in matrices]),
                                      np.concatenate([x.ravel() for _, x in matrices]))
        got = jax_logits(*jax_llama.load(gg), tokens)
        logits[dtype] = relative_rms(got, want)
        assert 0.5 * weights[dtype] <= logits[dtype] <= 2 * weights[dtype], \
            (dtype, weights[dtype], logits[dtype])
        if dtype == "q4_0":  # the torch twin from the same file: the twins' float32 agreement
            np.testing.assert_allclose(torch_logits(torch_llama.load(gg, device="cpu"), tokens),
                                       got, rtol=1e-5, atol=1e-5)
    # measured: weights 5.3e-3 (q8_0), 3.6e-2 (q5_1), 4.1e-2 (q5_0), 7.4e-2 (q4_1), 8.2e-2 (q4_0)
    assert weights["q8_0"] < weights["q5_1"] < weights["q5_0"] < weights["q4_1"] < weights["q4_0"]
    for coarse, fine in [("q4_0", "q5_0"), ("q4_1", "q5_1"), ("q5_0", "q8_0"), ("q5_1", "q8_0")]:
        assert logits[coarse] > 2 * weights[fine], (coarse, fine, logits, weights)


def test_llama_cpp_quantises_our_f32_file_to_the_same_bits(tmp_path):
    """llama.cpp's own quantiser, run on our f32 file, makes what we write directly: the same
    type and bytes in every tensor (dim 64: output rows are not 256-blocks, so llama.cpp takes
    Q8_0 for the output, as we do; ffn 80: ffn_down in F16 on both sides). With rows of 256 the
    one difference is the output, Q6_K there and Q8_0 here (gguf.quants writes no Q6_K)."""
    pytest.importorskip("llama_cpp")
    from bridge.gguf.quantize import quantize_with_llama_cpp

    for config in (CFG.replace(ffn_dim=80, tie_embeddings=True),
                   CFG.replace(dim=256, ffn_dim=96, rope_scaling=SCALING)):
        tmp = tmp_path / f"d{config.dim}"
        src = save(tmp / "src", config)
        f32 = convert(src, tmp / "f32.gguf", "gguf", dtype="f32", progress=False)
        for dtype in TYPES:
            ours = tensors(convert(src, tmp / f"{dtype}.gguf", "gguf", dtype=dtype,
                                   progress=False))
            quantize_with_llama_cpp(f32, tmp / f"{dtype}-llama.gguf", dtype,
                                    FILE_TYPES[dtype][1], warn=lambda m: None,
                                    stage=lambda m: None)
            theirs = tensors(tmp / f"{dtype}-llama.gguf")
            assert fields(tmp / f"{dtype}-llama.gguf")["general.file_type"] == TYPES[dtype][1]
            assert set(theirs) == set(ours)
            output = "token_embd.weight" if config.tie_embeddings else "output.weight"
            for name, t in ours.items():
                if config.dim == 256 and name == output and dtype != "q8_0":
                    assert (t.tensor_type, theirs[name].tensor_type) == (Q.Q8_0, Q.Q6_K)
                    continue
                assert t.tensor_type == theirs[name].tensor_type, (dtype, name)
                np.testing.assert_array_equal(t.data, theirs[name].data, err_msg=name)


# -- K-quants, by llama.cpp ----------------------------------------------------------------------

# dim 256: rows of 256, whole K-quant blocks; ffn 320: ffn_down's rows are not, so llama.cpp falls
# back (Q4_K -> Q5_0, Q6_K -> Q8_0: tensor_type_fallback); 4 layers, so that q4_k_m's
# use_more_bits (layers i < n/8, i >= 7n/8, (i - n/8) % 3 == 2: here 2 and 3) gives attn_v and
# ffn_down of layers 2 and 3 Q6_K; the real LLaMA 2 vocabulary, so that llama.cpp loads the file.
K_CFG = small_config(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=320, vocab_size=32000)


def k_quant_types(dtype: str) -> dict[str, Q]:
    """The types llama.cpp's quantiser chooses for K_CFG (src/llama-quant.cpp,
    llama_tensor_get_type_impl and tensor_type_fallback, llama-cpp-python 0.3.36)."""
    base, more = {"q4_k_m": (Q.Q4_K, Q.Q6_K), "q6_k": (Q.Q6_K, Q.Q6_K)}[dtype]
    fallback = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}
    out = {"token_embd.weight": base, "output.weight": Q.Q6_K, "output_norm.weight": Q.F32}
    for i in range(K_CFG.n_layers):
        extra = more if i in (2, 3) else base
        out.update({f"blk.{i}.{n}.weight": base for n in ("attn_q", "attn_k", "attn_output",
                                                           "ffn_gate", "ffn_up")})
        out.update({f"blk.{i}.attn_norm.weight": Q.F32, f"blk.{i}.ffn_norm.weight": Q.F32,
                    f"blk.{i}.attn_v.weight": extra,
                    f"blk.{i}.ffn_down.weight": fallback[extra]})
    return out


@pytest.fixture(scope="module")
def k_source(tmp_path_factory):
    """A random native model of K_CFG with a sharpened head, and the LLaMA 2 tokenizer file."""
    import torch_llama
    from conftest import real_tokenizer, torch_model

    real_tokenizer("llama2")  # skips, saying where it looked, without the file
    path = tmp_path_factory.mktemp("k") / "src"
    torch_llama.save(path, torch_model(K_CFG, seed=1, head_scale=8.0))
    return path, TOKENIZER_FILES["llama2"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, file_type", [("q4_k_m", 15), ("q6_k", 18)])
def test_k_quants_by_llama_cpp(tmp_path, capsys, monkeypatch, k_source, dtype, file_type):
    """Through the command line: llama.cpp's stage is one line on stderr (its log otherwise
    silent but for its fallback warnings), the keys are ours with llama.cpp's file type, the
    tensor types llama.cpp's, and llama.cpp runs the file: its logits are ours from the same
    file, within the rounding its quantised matrix products add."""
    llama_cpp = pytest.importorskip("llama_cpp")
    src, tok = k_source
    code, out, err = run_cli(["convert", src, tmp_path / "m.gguf", "--to", "gguf", "--dtype",
                              dtype, "--tokenizer", tok], capsys)
    assert code == 0 and out.strip() == str(tmp_path / "m.gguf"), err
    assert err.count(f"llama.cpp: quantising {tmp_path / 'm.gguf'} to {dtype.upper()}") == 1
    falls = [line for line in err.splitlines() if "falling back" in line]
    assert len(falls) == 4 and all("ffn_down" in line for line in falls), err
    assert "llama_model_loader" not in err and "[   1/" not in err  # its INFO log is silenced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no input file left

    f32 = convert(src, tmp_path / "f32.gguf", "gguf", tokenizer=tok, progress=False)
    assert fields(tmp_path / "m.gguf") == {**fields(f32), "general.file_type": file_type}
    got = {n: t.tensor_type for n, t in tensors(tmp_path / "m.gguf").items()}
    assert got == k_quant_types(dtype)

    # Without llama.cpp's extra buffer types (weight repacking): in llama-cpp-python 0.3.36 the
    # AMX repack of quantised weights segfaults on this machine's CPU in its first decode (the
    # real SmolLM2 Q4_1 file too); its plain CPU kernels run them.
    from llama_twins.llama_cpp_reference import plain_cpu_kernels
    with plain_cpu_kernels():
        llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), vocab_only=False, n_ctx=64,
                              logits_all=True, verbose=False, n_threads=2)
    ids = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203]
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)])
    tokens = np.array([ids], np.int32)
    ours = jax_logits(*jax_llama.load(tmp_path / "m.gguf"), tokens)[0]
    original = jax_logits(*jax_llama.load(src), tokens)[0]
    # The same dequantised weights on both sides, but llama.cpp multiplies quantised matrices by
    # activations it rounds to 8 bits a block (Q8_K / Q8_0) and keeps its KV cache in F16: an RMS
    # difference of 0.036 - 0.039 here on logits up to ~12, as much for a q8_0 file (0.025) as
    # for q2_k (0.038): llama.cpp's own rounding, not the weights'; 0.06 allowed. The
    # quantisation itself moves the logits 3.5x (q6_k: 0.137) to 11x (q4_k_m: 0.40) further, so
    # a file read with weights other than llama.cpp's (a wrong type, a wrong layout) fails.
    assert rms(theirs - ours) < 0.06, rms(theirs - ours)
    assert rms(ours - original) > 2 * 0.06, rms(ours - original)


@pytest.mark.slow
def test_smollm2_requantised_by_llama_cpp_reads_as_transformers_does(tmp_path, smollm2):
    """llama.cpp's quantiser on the real SmolLM2 (Q4_1 / Q8_0 in, requantised) to Q4_K_M and
    Q6_K; dim 576 is not 256-blocks, so most matrices fall back (Q5_0 / Q8_0) and only ffn_down
    (rows of 1536) holds K-quants. Both twins read each file with transformers' logits."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch_llama
    from conftest import torch_logits

    tokens = np.random.default_rng(0).integers(0, 49152, (2, 12), dtype=np.int32)
    for ftype, number, k_types in [("Q4_K_M", 15, {"Q4_K", "Q6_K"}), ("Q6_K", 18, {"Q6_K"})]:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.allow_requantize = True
        path = tmp_path / f"smollm2-{ftype}.gguf"
        assert llama_cpp.llama_model_quantize(bytes(smollm2), bytes(path),
                                              ctypes.byref(params)) == 0
        kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
        assert fields(path)["general.file_type"] == number and k_types <= kinds, kinds
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
        with torch.inference_mode():
            want = hf(torch.as_tensor(tokens).long()).logits.float().numpy()
        del hf
        # both dequantise the same bits with gguf's own dequantiser: float32 summation order only,
        # through 30 layers; measured 1.2e-4 (JAX) and 9e-5 (torch) at most on logits up to ~35,
        # 1e-3 allowed, as tests/test_smollm2.py allows for the Q4_1 file itself
        for name, got in (("jax", jax_logits(*jax_llama.load(path), tokens)),
                          ("torch", torch_logits(torch_llama.load(path, device="cpu"), tokens))):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-3, err_msg=f"{ftype} {name}")


# -- refusals ------------------------------------------------------------------------------------

def test_k_quants_without_llama_cpp_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    src = save(tmp_path / "src", CFG)
    err = refused(capsys, tmp_path, ["convert", src, tmp_path / "m.gguf", "--to", "gguf",
                                     "--dtype", "q4_k_m"],
                  "--dtype", "q4_k_m", "llama.cpp's quantiser", "pip install llama-cpp-python")
    assert err.startswith("error: --dtype: q4_k_m needs")
    with pytest.raises(BridgeError, match="dtype: q6_k needs llama.cpp's quantiser"):
        convert(src, tmp_path / "m.gguf", "gguf", dtype="q6_k", progress=False)


def test_quantised_dtypes_for_other_formats_are_refused(tmp_path, capsys):
    src = save(tmp_path / "src", CFG)
    for dtype in ("q4_0", "q5_1", "q4_k_m"):
        refused(capsys, tmp_path, ["convert", src, tmp_path / "out", "--to", "native",
                                   "--dtype", dtype], "--dtype", dtype, "only the gguf format")
    with pytest.raises(SystemExit) as e:  # not a value --dtype takes at all: argparse's exit 2
        run_cli(["convert", src, tmp_path / "out", "--dtype", "q7_0"], capsys)
    assert e.value.code == 2 and "invalid choice: 'q7_0'" in capsys.readouterr().err


def test_k_quants_without_a_tokenizer_are_refused(tmp_path, capsys, monkeypatch):
    """llama.cpp loads no model without a vocabulary, so a K-quant file needs one (an f32 ... q5_1
    file is written with a warning). Refused before llama.cpp is called: a stand-in module."""
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    src = save(tmp_path / "src", CFG)
    refused(capsys, tmp_path, ["convert", src, tmp_path / "m.gguf", "--to", "gguf",
                               "--dtype", "q4_k_m"], "m.gguf", "q4_k_m", "tokenizer",
            "--tokenizer FILE")


def test_a_failing_llama_cpp_leaves_nothing(tmp_path, capsys, monkeypatch):
    """llama.cpp's quantiser failing (here made to, after writing half a file; and for real, on
    a truncated input): exit 2 with its reason, nothing at DST, neither temporary left."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from bridge.gguf.quantize import quantize_with_llama_cpp

    tok = TOKENIZER_FILES["llama2"]
    if not tok.is_file():
        pytest.skip(f"the real llama2 tokenizer is not at {tok}")
    src = save(tmp_path / "src", CFG.replace(vocab_size=32000, tie_embeddings=True))
    gg = convert(src, tmp_path / "f32.gguf", "gguf", progress=False)
    short = tmp_path / "short.gguf"
    short.write_bytes(gg.read_bytes()[:5000])
    with pytest.raises(BridgeError, match=r"x\.gguf: llama.cpp could not quantise it to Q4_K_M "
                                          r"\(.+\)"):
        quantize_with_llama_cpp(short, tmp_path / "x.gguf", "q4_k_m", "MOSTLY_Q4_K_M",
                                stage=lambda m: None)

    def half_then_fail(inp, out, params):
        assert Path(inp.decode()).name.endswith(".input")  # our lossless file, beside DST's
        Path(out.decode()).write_bytes(b"GGUF half")
        return 1
    monkeypatch.setattr(llama_cpp, "llama_model_quantize", half_then_fail)
    capsys.readouterr()  # the f32 file's no-tokenizer warning
    refused(capsys, tmp_path, ["convert", src, tmp_path / "m.gguf", "--to", "gguf", "--dtype",
                               "q4_k_m", "--tokenizer", tok], "m.gguf",
            "llama.cpp could not quantise it to Q4_K_M (status 1)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f32.gguf", "short.gguf", "src"]


def test_a_killed_writers_input_is_cleaned_up(tmp_path):
    """A kill during llama.cpp's stage leaves `.DST.partial-X` and its `.DST.partial-X.input`,
    unlocked: the next write to DST removes both (bridge.atomic's stale-temporary clean-up)."""
    src = save(tmp_path / "src", CFG)
    left = [tmp_path / ".m.gguf.partial-dead", tmp_path / ".m.gguf.partial-dead.input"]
    for path in left:
        path.write_bytes(b"GGUF")
    convert(src, tmp_path / "m.gguf", "gguf", dtype="q4_0", progress=False)
    assert not any(p.exists() for p in left)
