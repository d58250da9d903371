"""llama2.c checkpoints: .bin exports (v0 / v1) against an independent encoder written here from
the published layout, end-to-end logits through both twins, .pt training checkpoints, and the
refusals (truncated, absurd, malicious or unrunnable input)."""

import pickle
import struct
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import torch

import jax_llama
import torch_llama
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint, write_checkpoint
from bridge.formats.llama2c import Llama2cCheckpoint, write_llama2c
from bridge.tensors import canonical_shapes
from conftest import SCALING, random_tokens, small_config

# -- an independent encoder, straight from llama2.c's export.py layout --------------------------

AK42 = 0x616B3432
# File order; "*x" is x for every layer, stacked.
V0_ORDER = ["tok_embeddings", "*attention_norm", "*attention.wq", "*attention.wk", "*attention.wv",
            "*attention.wo", "*ffn_norm", "*feed_forward.w1", "*feed_forward.w2",
            "*feed_forward.w3", "norm", "freq_cis_real", "freq_cis_imag", "output"]
V1_ORDER = ["*attention_norm", "*ffn_norm", "norm", "tok_embeddings", "*attention.wq",
            "*attention.wk", "*attention.wv", "*attention.wo", "*feed_forward.w1",
            "*feed_forward.w2", "*feed_forward.w3", "output"]


def header_fields(config, vocab_size):
    return (config.dim, config.ffn_dim, config.n_layers, config.n_heads, config.n_kv_heads,
            vocab_size, config.max_seq_len)


def v0_header(config):
    vocab = config.vocab_size if config.tie_embeddings else -config.vocab_size
    return struct.pack("<7i", *header_fields(config, vocab))


def v1_header(config, version=1):
    head = struct.pack("<Ii7iB", AK42, version, *header_fields(config, config.vocab_size),
                       int(config.tie_embeddings))
    return head + bytes(256 - len(head))


def freq_cis(config):
    """run.c's legacy RoPE tables: cos / sin of t * 10000^(-2i/H), float32 (S, H/2) each."""
    h = config.dim // config.n_heads
    freqs = (1.0 / 10000.0 ** (np.arange(0, h, 2, dtype=np.float64) / h)).astype(np.float32)
    angles = np.outer(np.arange(config.max_seq_len, dtype=np.float32), freqs)
    return {"freq_cis_real": np.cos(angles), "freq_cis_imag": np.sin(angles)}


def body(config, tensors, order):
    arrays = []
    for key in order:
        if key.startswith("*"):
            arrays += [tensors[f"layers.{i}.{key[1:]}.weight"] for i in range(config.n_layers)]
        elif key.startswith("freq_cis"):
            arrays.append(freq_cis(config)[key])
        elif key + ".weight" in tensors:  # output only when unshared
            arrays.append(tensors[key + ".weight"])
    return b"".join(np.asarray(a, dtype="<f4").tobytes() for a in arrays)


def encode(config, tensors, version):
    if version == 0:
        return v0_header(config) + body(config, tensors, V0_ORDER)
    return v1_header(config) + body(config, tensors, V1_ORDER)


def random_tensors(config, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in canonical_shapes(config).items()}


def specs_of(tensors):
    return {n: (t.shape, t.dtype) for n, t in tensors.items()}


VERSIONS_AND_TYING = [(0, False), (0, True), (1, False), (1, True)]


def assert_reads_back(path, config, tensors):
    ckpt = Llama2cCheckpoint(path)
    assert ckpt.format == "llama2c" and ckpt.files == [path] and ckpt.extra_files == []
    assert ckpt.config == config
    assert list(ckpt.specs) == list(canonical_shapes(config))
    for name, expected in tensors.items():
        got = ckpt.tensor(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.asarray(expected, dtype=np.float32))
    return ckpt


# -- .bin: reading and writing -------------------------------------------------------------------

@pytest.mark.parametrize("version, tied", VERSIONS_AND_TYING)
def test_reads_independently_encoded_files(tmp_path, version, tied):
    config = small_config(tie_embeddings=tied)
    tensors = random_tensors(config)
    (tmp_path / "model.bin").write_bytes(encode(config, tensors, version))
    ckpt = assert_reads_back(tmp_path / "model.bin", config, tensors)
    assert any("hard-codes" in note for note in ckpt.notes)
    assert open_checkpoint(tmp_path / "model.bin").format == "llama2c"


@pytest.mark.parametrize("version, tied", VERSIONS_AND_TYING)
def test_writer_is_byte_identical_to_the_independent_encoder(tmp_path, version, tied):
    config = small_config(tie_embeddings=tied)
    tensors = random_tensors(config)
    seen = []
    write_llama2c(tmp_path / "model.bin", config, specs_of(tensors), tensors.__getitem__,
                  version=version, progress=seen.append)
    assert (tmp_path / "model.bin").read_bytes() == encode(config, tensors, version)
    assert sum(seen) == sum(t.nbytes for t in tensors.values()) and len(seen) == len(tensors)
    assert_reads_back(tmp_path / "model.bin", config, tensors)
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]  # no temporaries left


def test_bfloat16_tensors_are_written_as_exact_float32(tmp_path):
    config = small_config(tie_embeddings=True)
    tensors = random_tensors(config, dtype=ml_dtypes.bfloat16)
    write_llama2c(tmp_path / "model.bin", config, specs_of(tensors), tensors.__getitem__)
    assert (tmp_path / "model.bin").read_bytes() == encode(config, tensors, 1)
    assert_reads_back(tmp_path / "model.bin", config, tensors)


def test_negative_case_the_wrong_order_gives_other_tensors(tmp_path):
    """A body laid out in v1 order under a v0 header (same size, so it is accepted) decodes to
    different tensors: the order comparison above can fail."""
    config = small_config(tie_embeddings=True)
    tensors = random_tensors(config)
    v1_first = [k for k in V1_ORDER if k != "output"] + ["freq_cis_real", "freq_cis_imag"]
    (tmp_path / "model.bin").write_bytes(v0_header(config) + body(config, tensors, v1_first))
    ckpt = Llama2cCheckpoint(tmp_path / "model.bin")
    differ = [n for n in tensors if not np.array_equal(ckpt.tensor(n), tensors[n])]
    assert "tok_embeddings.weight" in differ and "layers.0.attention.wq.weight" in differ


# -- end to end: native -> llama2.c -> both twins -------------------------------------------------

# Random-init logits are O(0.5). The .bin holds the same float32 bits, so JAX reproduces its own
# logits exactly; torch differs from JAX only in summation order (~1e-7 relative per op), and
# 1e-5 is the project's twin-parity bound.
ATOL = 1e-5


@pytest.mark.parametrize("version, tied", [(1, False), (0, True)])
def test_native_to_llama2c_gives_the_same_logits(tmp_path, version, tied):
    config = small_config(tie_embeddings=tied)
    tokens = random_tokens(config, seq_len=20)
    model, params = jax_llama.init(config, seed=3)
    jax_llama.save(tmp_path / "native", config, params)
    ckpt = open_checkpoint(tmp_path / "native")
    write_checkpoint("llama2c", tmp_path / "model.bin", ckpt.config, ckpt.specs, ckpt.tensor,
                     version=version)
    expected = np.asarray(model.apply({"params": params}, tokens))
    assert 0.1 < np.abs(expected).max() < 10

    jmodel, jparams = jax_llama.load(tmp_path / "model.bin")
    np.testing.assert_allclose(np.asarray(jmodel.apply({"params": jparams}, tokens)), expected,
                               rtol=0, atol=ATOL)
    tmodel = torch_llama.load(tmp_path / "model.bin", device="cpu")
    assert ("output.weight" in tmodel.state_dict()) is not tied
    with torch.inference_mode():
        got = tmodel(torch.as_tensor(tokens)).numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


# -- .pt training checkpoints ----------------------------------------------------------------------

# train.py saves exactly these keys: no hidden_dim (derived: 4*48 -> 128 -> multiple of 32 = 128)
# and no norm_eps.
MODEL_ARGS = dict(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=97, multiple_of=32,
                  max_seq_len=64, dropout=0.0)
PT_CONFIG = small_config(ffn_dim=128, tie_embeddings=True)


def training_checkpoint(tensors, model_args=MODEL_ARGS, tie=True, extra_state=()):
    state = {f"_orig_mod.{n}": torch.from_numpy(t.view(np.int16)).view(torch.bfloat16)
             if t.dtype == ml_dtypes.bfloat16 else torch.from_numpy(t) for n, t in tensors.items()}
    if tie:  # llama2.c shares one Parameter between the two
        state["_orig_mod.output.weight"] = state["_orig_mod.tok_embeddings.weight"]
    state.update({f"_orig_mod.{k}": torch.zeros(3) for k in extra_state})
    some = state["_orig_mod.norm.weight"]
    return {"model": state, "model_args": model_args, "iter_num": 2000, "best_val_loss": 1.25,
            "optimizer": {"state": {0: {"exp_avg": torch.zeros_like(some), "step": 3}},
                          "param_groups": [{"lr": 5e-4, "params": [0]}]},
            "config": {"batch_size": 8, "dataset": "tinystories"}}


def test_training_checkpoint_loads_tied_with_its_tensors(tmp_path):
    tensors = random_tensors(PT_CONFIG)
    torch.save(training_checkpoint(tensors, extra_state=("freqs_cos", "freqs_sin")),
               tmp_path / "ckpt.pt")
    ckpt = open_checkpoint(tmp_path / "ckpt.pt")
    assert isinstance(ckpt, Llama2cCheckpoint) and ckpt.config == PT_CONFIG
    assert "output.weight" not in ckpt.specs
    for name, expected in tensors.items():
        np.testing.assert_array_equal(ckpt.tensor(name), expected)
    notes = " | ".join(ckpt.notes)
    assert "optimizer" in notes and "iter_num" in notes and "freqs_cos" in notes


def test_training_checkpoint_with_its_own_classifier_and_hidden_dim(tmp_path):
    config = small_config(n_kv_heads=6, tie_embeddings=False)
    tensors = random_tensors(config)
    args = dict(MODEL_ARGS, n_kv_heads=None, hidden_dim=80, norm_eps=1e-5)
    torch.save(training_checkpoint(tensors, model_args=args, tie=False), tmp_path / "ckpt.pth")
    ckpt = Llama2cCheckpoint(tmp_path / "ckpt.pth")
    assert ckpt.config == config
    np.testing.assert_array_equal(ckpt.tensor("output.weight"), tensors["output.weight"])


def test_bfloat16_training_checkpoint_stays_bfloat16(tmp_path):
    tensors = random_tensors(PT_CONFIG, dtype=ml_dtypes.bfloat16)
    torch.save(training_checkpoint(tensors), tmp_path / "ckpt.pt")
    ckpt = Llama2cCheckpoint(tmp_path / "ckpt.pt")
    assert ckpt.stored_dtype() == "bfloat16" and "output.weight" not in ckpt.specs
    got = ckpt.tensor("layers.1.attention.wk.weight")
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.int16),
                                  tensors["layers.1.attention.wk.weight"].view(np.int16))


# -- refusals --------------------------------------------------------------------------------------

@pytest.fixture
def good_bin(tmp_path):
    config = small_config()
    path = tmp_path / "model.bin"
    path.write_bytes(encode(config, random_tensors(config), 1))
    return path


def refuses(path, message):
    with pytest.raises(BridgeError, match=message) as info:
        Llama2cCheckpoint(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_truncated_and_trailing_bytes(good_bin):
    data = good_bin.read_bytes()
    good_bin.write_bytes(data[:-4])
    refuses(good_bin, rf"truncated \(expected {len(data)} bytes, found {len(data) - 4}\)")
    good_bin.write_bytes(data + bytes(8))
    refuses(good_bin, rf"has 8 trailing bytes after the {len(data)}")
    good_bin.write_bytes(data[:100])
    refuses(good_bin, r"truncated \(expected a 256-byte v1 header, found 100 bytes\)")


def test_quantized_version_is_refused(good_bin):
    data = good_bin.read_bytes()
    good_bin.write_bytes(data[:4] + struct.pack("<i", 2) + data[8:])
    refuses(good_bin, r"llama2\.c export version 2 is not supported")


def test_absurd_headers(tmp_path):
    config = small_config(tie_embeddings=True)
    data = encode(config, random_tensors(config), 0)
    path = tmp_path / "model.bin"
    for field, value, message in [("dim", -48, r"header field dim must be positive \(got -48\)"),
                                  ("n_heads", 7, r"header field n_heads=7 does not divide dim=48"),
                                  ("n_kv_heads", 4, r"n_kv_heads=4 does not divide n_heads=6")]:
        fields = list(struct.unpack_from("<7i", data))
        fields[["dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads"].index(field)] = value
        path.write_bytes(struct.pack("<7i", *fields) + data[28:])
        refuses(path, message)


def test_huge_n_layers_is_refused_without_allocating(tmp_path):
    config = small_config(tie_embeddings=True)
    data = encode(config, random_tensors(config), 0)
    (tmp_path / "model.bin").write_bytes(struct.pack("<3i", 48, 80, 10**9) + data[12:])
    tracemalloc.start()
    try:
        refuses(tmp_path / "model.bin", r"truncated \(expected \d+ bytes, .* n_layers=1000000000")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000  # the layout of 10^9 layers would be gigabytes


class Evil:
    """Unpickling this opens (creates) `target`: arbitrary code execution in miniature."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return open, (str(self.target), "w")


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_malicious_pickle_is_never_run(tmp_path, how):
    target = tmp_path / "pwned"
    blob = {"model": Evil(target), "model_args": MODEL_ARGS}
    if how == "torch.save":
        torch.save(blob, tmp_path / "ckpt.pt")
    else:
        (tmp_path / "ckpt.pt").write_bytes(pickle.dumps(blob))
        pickle.loads((tmp_path / "ckpt.pt").read_bytes())  # control: running it does create it
        assert target.exists()
        target.unlink()
    refuses(tmp_path / "ckpt.pt", r"not a plain tensor checkpoint \(")
    assert not target.exists()


def test_training_checkpoint_refusals(tmp_path):
    tensors = random_tensors(PT_CONFIG)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": training_checkpoint(tensors)["model"]}, path)
    refuses(path, r"no 'model_args' dict")
    torch.save(training_checkpoint(tensors, model_args=dict(MODEL_ARGS, rope_theta=5e5)), path)
    refuses(path, r"model_args: unknown key\(s\) \['rope_theta'\]")
    torch.save(training_checkpoint(tensors, model_args=dict(MODEL_ARGS, multiple_of=256)), path)
    refuses(path, r"tensor 'layers\.0\.feed_forward\.w1\.weight' has shape \(128, 48\), but "
                  r"model_args implies \(256, 48\)")


def specs_for(config):
    return {n: (s, np.dtype(np.float32)) for n, s in canonical_shapes(config).items()}


def never(name):
    raise AssertionError("fetched a tensor of a config that should have been refused")


@pytest.mark.parametrize("changes, message", [
    (dict(rope_scaling=SCALING), r"LlamaConfig\.rope_scaling must be None"),
    (dict(rope_theta=500000.0), r"LlamaConfig\.rope_theta must be 10000 \(run\.c hard-codes it\), "
                                r"got 500000\.0"),
    (dict(head_dim=12), r"LlamaConfig\.head_dim must be dim / n_heads = 8 "),
    (dict(norm_eps=1e-6), r"LlamaConfig\.norm_eps must be 1e-05"),
])
def test_writer_refuses_what_run_c_cannot_run(tmp_path, changes, message):
    config = small_config(**changes)
    with pytest.raises(BridgeError, match=message):
        write_llama2c(tmp_path / "model.bin", config, specs_for(config), never)
    assert list(tmp_path.iterdir()) == []


def test_writer_keeps_an_existing_file_unless_overwrite(good_bin):
    config = small_config()
    tensors = random_tensors(config, seed=1)
    before = good_bin.read_bytes()
    with pytest.raises(BridgeError, match="already exists"):
        write_llama2c(good_bin, config, specs_of(tensors), tensors.__getitem__)
    assert good_bin.read_bytes() == before
    write_llama2c(good_bin, config, specs_of(tensors), tensors.__getitem__, overwrite=True)
    assert good_bin.read_bytes() == encode(config, tensors, 1)
    assert [p.name for p in good_bin.parent.iterdir()] == ["model.bin"]


def test_failing_fetch_midway_leaves_nothing(tmp_path):
    config = small_config()
    tensors = random_tensors(config)
    fetched = []

    def failing_fetch(name):
        if len(fetched) == 5:
            raise OSError("disk full")
        fetched.append(name)
        return tensors[name]
    with pytest.raises(OSError, match="disk full"):
        write_llama2c(tmp_path / "model.bin", config, specs_of(tensors), failing_fetch)
    assert len(fetched) == 5 and list(tmp_path.iterdir()) == []
    with pytest.raises(BridgeError, match=r"version: llama2c writes versions \[0, 1\], got 2"):
        write_llama2c(tmp_path / "model.bin", config, specs_of(tensors), never, version=2)
    assert list(tmp_path.iterdir()) == []
