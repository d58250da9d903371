"""Meta's release format (params.json + consolidated.NN.pth): round trips, model-parallel merges
against independently split checkpoints, Meta's ffn formula, and the reader's refusals."""

import json
import pickle
import subprocess
import sys
import zipfile

import ml_dtypes
import numpy as np
import pytest
import torch

import jax_llama
import torch_llama
from bridge.config import PRESETS, RopeScaling
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint, write_checkpoint
from bridge.formats.meta import config_from_params, ffn_params, meta_ffn_dim, params_json
from conftest import SCALING, random_tokens, small_config

# Meta's llama3.1 scaling keeps low_freq_factor 1 and an 8192 original context; params.json
# cannot say anything else, so the round trips use this one.
META_SCALING = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)
# The test's own statement of how Meta's fairscale layers split each weight across ranks, written
# independently of bridge.formats.meta.SPLIT_AXIS (ColumnParallel: axis 0, RowParallel: axis 1).
ROW_PARALLEL = ("attention.wo.weight", "feed_forward.w2.weight")
REPLICATED = ("attention_norm.weight", "ffn_norm.weight", "norm.weight")


def numpy_state(model: torch_llama.Llama) -> dict[str, np.ndarray]:
    return {name: torch_llama.checkpoint.to_numpy(t) for name, t in model.state_dict().items()}


def native(path, config, dtype=torch.float32, seed=0):
    """A native checkpoint of a randomly initialised torch twin (with a tokenizer file)."""
    torch.manual_seed(seed)
    model = torch_llama.Llama(config).to(dtype)
    torch_llama.save(path, model)
    (path / "tokenizer.model").write_bytes(b"not really a tokenizer")
    return path


def to_meta(src, dst, **options):
    ckpt = open_checkpoint(src)
    return write_checkpoint("meta", dst, ckpt.config, ckpt.specs, ckpt.tensor,
                            extra_files=ckpt.extra_files, **options)


def assert_same_tensors(a, b):
    assert list(a.specs) == list(b.specs)
    for name in a.specs:
        x, y = a.tensor(name), b.tensor(name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_native_meta_native_round_trip_is_bitwise(tmp_path, dtype, tied):
    config = small_config(tie_embeddings=tied, rope_scaling=META_SCALING, bos_id=1, eos_ids=(2,))
    src = native(tmp_path / "src", config, dtype)
    to_meta(src, tmp_path / "meta")
    meta = open_checkpoint(tmp_path / "meta")
    assert meta.format == "meta" and [f.name for f in meta.files] == ["consolidated.00.pth"]
    assert meta.config == config.replace(bos_id=None, eos_ids=())  # params.json holds no token ids
    assert any("tied" in note for note in meta.notes) is tied
    assert [f.name for f in meta.extra_files] == ["tokenizer.model"]
    write_checkpoint("native", tmp_path / "back", meta.config, meta.specs, meta.tensor,
                     extra_files=meta.extra_files)
    assert_same_tensors(open_checkpoint(src), open_checkpoint(tmp_path / "back"))


def test_both_twins_load_meta_with_native_logits(tmp_path):
    config = small_config()
    tokens = random_tokens(config)
    model, params = jax_llama.init(config, seed=3)
    jax_llama.save(tmp_path / "native", config, params)
    to_meta(tmp_path / "native", tmp_path / "meta")
    expected = np.asarray(model.apply({"params": params}, tokens))
    assert 0.1 < np.abs(expected).max() < 10
    # Same weights bit for bit; fp32 logits of O(0.5) then differ only by summation order between
    # the twins (~1e-7 relative per op), so 1e-5 is loose for that yet tight for any wrong weight.
    jmodel, jparams = jax_llama.load(tmp_path / "meta")
    np.testing.assert_allclose(np.asarray(jmodel.apply({"params": jparams}, tokens)), expected,
                               rtol=0, atol=1e-5)
    with torch.inference_mode():
        got = torch_llama.load(tmp_path / "meta", device="cpu")(torch.as_tensor(tokens)).numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


# -- model-parallel checkpoints split independently of the reader ---------------------------------

def split_axis(name, embedding_axis):
    suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if suffix in REPLICATED:
        return None
    if name == "tok_embeddings.weight":
        return embedding_axis
    return 1 if suffix in ROW_PARALLEL else 0


def write_split(directory, state, params, embedding_axis, ranks=2, extra=None):
    """Meta-style ranks of `state` (name -> torch tensor) by torch.chunk, plus params.json."""
    directory.mkdir()
    (directory / "params.json").write_text(json.dumps(params))
    for r in range(ranks):
        shard = {}
        for name, t in state.items():
            axis = split_axis(name, embedding_axis)
            shard[name] = t.clone() if axis is None else torch.chunk(t, ranks, dim=axis)[r].clone()
        shard.update(extra or {})
        torch.save(shard, directory / f"consolidated.{r:02d}.pth")
    return directory


# LLaMA 3 style: vocab-split embeddings, GQA, explicit vocab; LLaMA 2 style: dim-split embeddings,
# MHA with n_kv_heads absent, vocab_size -1 and a rope.freqs buffer.
LLAMA3_STYLE = (small_config(vocab_size=98, rope_theta=500000.0, max_seq_len=8192),
                dict(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=98, multiple_of=16,
                     ffn_dim_multiplier=0.625, norm_eps=1e-5, rope_theta=500000.0), 0)
LLAMA2_STYLE = (small_config(n_kv_heads=6, ffn_dim=128, vocab_size=98, max_seq_len=4096),
                dict(dim=48, n_layers=2, n_heads=6, vocab_size=-1, multiple_of=32, norm_eps=1e-5,
                     max_seq_len=4096), 1)


@pytest.fixture(params=[LLAMA3_STYLE, LLAMA2_STYLE], ids=["llama3-vocab-split", "llama2-dim-split"])
def split(request, tmp_path):
    """(config, unsplit numpy tensors, 2-rank Meta directory, its params.json)."""
    config, params, embedding_axis = request.param
    torch.manual_seed(0)
    model = torch_llama.Llama(config)
    extra = {"rope.freqs": torch.rand(4)} if embedding_axis == 1 else None
    path = write_split(tmp_path / "meta", model.state_dict(), params, embedding_axis, extra=extra)
    return config, numpy_state(model), path, params


def test_two_rank_checkpoint_merges_to_the_unsplit_model(split):
    config, expected, path, params = split
    ckpt = open_checkpoint(path)
    assert len(ckpt.files) == 2 and ckpt.config == config
    assert list(ckpt.specs) == list(expected)
    for name, array in ckpt:
        np.testing.assert_array_equal(array, expected[name], err_msg=name)
    if params["vocab_size"] == -1:  # the LLaMA 2 style case
        assert any("rope.freqs" in n for n in ckpt.notes)
        assert any("vocab_size -1" in n for n in ckpt.notes)


def test_negative_case_wrong_rank_order_or_axis_is_caught(split, tmp_path):
    """The bitwise comparison can fail: ranks read in the wrong order, or the right pieces joined
    along the wrong axis, give the same shapes and values in different places."""
    _, expected, path, _ = split
    for f in ("00", "01"):
        (path / f"consolidated.{f}.pth").rename(tmp_path / f"{f}.pth")
    (tmp_path / "00.pth").rename(path / "consolidated.01.pth")
    (tmp_path / "01.pth").rename(path / "consolidated.00.pth")
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(open_checkpoint(path).tensor("layers.0.attention.wq.weight"),
                                      expected["layers.0.attention.wq.weight"])
    w2 = expected["layers.1.feed_forward.w2.weight"]  # (D, F), split along F
    wrong = np.concatenate(np.split(w2, 2, axis=1), axis=0).reshape(w2.shape)
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(wrong, w2)


@pytest.mark.parametrize("tied", [False, True])
def test_write_two_shards_reads_back_bitwise(tmp_path, tied):
    config = small_config(vocab_size=98, tie_embeddings=tied)
    src = native(tmp_path / "src", config, torch.bfloat16)
    fetched = []
    to_meta(src, tmp_path / "meta", shards=2, progress=fetched.append)
    assert sum(fetched) == open_checkpoint(src).nbytes
    files = sorted(p.name for p in (tmp_path / "meta").glob("*.pth"))
    assert files == ["consolidated.00.pth", "consolidated.01.pth"]
    rank1 = torch.load(tmp_path / "meta" / files[1], weights_only=True)
    assert rank1["tok_embeddings.weight"].shape == (49, 48)  # vocab-split, as LLaMA 3
    assert rank1["layers.0.attention.wo.weight"].shape == (48, 24)
    assert rank1["norm.weight"].shape == (48,) and "output.weight" in rank1
    assert_same_tensors(open_checkpoint(src), open_checkpoint(tmp_path / "meta"))


# -- params.json: Meta's ffn formula and what it can express ------------------------------------

@pytest.mark.parametrize("dim, multiple_of, multiplier, ffn_dim", [
    (4096, 256, None, 11008),     # llama2-7b
    (4096, 1024, 1.3, 14336),     # llama3-8b
    (8192, 4096, 1.3, 28672),     # llama3-70b
    (16384, 4096, 1.2, 53248),    # llama3.1-405b
    (2048, 256, 1.5, 8192),       # llama3.2-1b
])
def test_meta_ffn_formula_gives_the_published_sizes(dim, multiple_of, multiplier, ffn_dim):
    assert meta_ffn_dim(dim, multiple_of, multiplier) == ffn_dim
    assert meta_ffn_dim(dim, *ffn_params(dim, ffn_dim)) == ffn_dim  # maybe another published pair


@pytest.mark.parametrize("ffn_dim", [80, 96, 128, 200, 1, 1000])
def test_chosen_ffn_params_reproduce_any_ffn_dim(ffn_dim):
    assert meta_ffn_dim(48, *ffn_params(48, ffn_dim)) == ffn_dim


@pytest.mark.parametrize("name", sorted(n for n, c in PRESETS.items() if not c.deltas))
def test_every_preset_survives_params_json(name):
    """Every preset of LLaMA's decoder (params.json names no family: Mistral v0.3 reads back as
    the LLaMA it is; the presets with deltas are refused by the Meta writer, test_families)."""
    preset = PRESETS[name]
    params = json.loads(json.dumps(params_json(preset)))
    config = config_from_params(params, "params.json", {}, [])
    assert config == preset.replace(bos_id=None, eos_ids=(), tie_embeddings=False, family="llama")


def test_configs_params_json_cannot_express_are_refused(tmp_path):
    src = native(tmp_path / "src", small_config(n_heads=4, n_kv_heads=2, head_dim=8))
    with pytest.raises(BridgeError, match=r"^head_dim: params\.json cannot express head_dim=8"):
        to_meta(src, tmp_path / "a")
    src = native(tmp_path / "src2", small_config(rope_scaling=SCALING))
    with pytest.raises(BridgeError, match=r"rope_scaling\.original_max_position_embeddings: params"
                                          r"\.json cannot express 32"):
        to_meta(src, tmp_path / "b")
    with pytest.raises(BridgeError, match=r"tensor 'tok_embeddings\.weight': size 97 along axis 0 "
                                          r"does not split into 2 equal shards"):
        to_meta(native(tmp_path / "src3", small_config()), tmp_path / "c", shards=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "src2", "src3"]


# -- refusals -------------------------------------------------------------------------------------

@pytest.fixture
def meta(tmp_path):
    to_meta(native(tmp_path / "src", small_config(vocab_size=98)), tmp_path / "meta", shards=2)
    return tmp_path / "meta"


def refused(path, message):
    with pytest.raises(BridgeError, match=message) as info:
        open_checkpoint(path)
    assert "\n" not in str(info.value)


def edit_params(path, **changes):
    params = json.loads((path / "params.json").read_text())
    (path / "params.json").write_text(json.dumps(dict(params, **changes)))


def edit_shard(path, rank, edit):
    file = path / f"consolidated.{rank:02d}.pth"
    state = torch.load(file, weights_only=True)
    edit(state)
    torch.save(state, file)


class CreatesAFile:
    """Unpickling this would call open(target, 'w'): what a malicious .pth could do."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return open, (str(self.target), "w")


def pickle_dump(obj, file):
    with open(file, "wb") as f:
        pickle.dump(obj, f)


@pytest.mark.parametrize("save, message", [
    (torch.save, r"not a plain tensor checkpoint \(Unsupported global: GLOBAL io\.open"),
    # a bare (legacy) pickle is refused before anything unpickles it
    (pickle_dump, r"not a plain tensor checkpoint \(not a torch.save zip archive\)"),
], ids=["torch-zip", "bare-pickle"])
def test_a_pickle_that_runs_code_is_refused_without_running(meta, tmp_path, save, message):
    target = tmp_path / "pwned"
    save({"tok_embeddings.weight": CreatesAFile(target)}, meta / "consolidated.01.pth")
    refused(meta, r"consolidated\.01\.pth: " + message)
    assert not target.exists()


def test_garbage_and_non_tensor_shards(meta):
    (meta / "consolidated.01.pth").write_bytes(b"\x00garbage" * 100)
    refused(meta, r"consolidated\.01\.pth: not a plain tensor checkpoint \(not a torch.save zip")
    torch.save([torch.zeros(2)], meta / "consolidated.01.pth")
    refused(meta, r"consolidated\.01\.pth: expected a dict of tensors, got list")
    torch.save({"norm.weight": 3}, meta / "consolidated.01.pth")
    refused(meta, r"consolidated\.01\.pth: entry 'norm\.weight' is not a tensor \(int\)")
    with zipfile.ZipFile(meta / "consolidated.01.pth", "w") as z:
        z.writestr("notes.txt", "a zip, but not one torch.save wrote")
    refused(meta, r"consolidated\.01\.pth: not a plain tensor checkpoint \(file in archive is not "
                  r"in a subdirectory: notes\.txt\)$")
    (meta / "consolidated.01.pth").write_bytes((meta / "consolidated.00.pth").read_bytes()[:5000])
    refused(meta, r"consolidated\.01\.pth: not a plain tensor checkpoint")


def test_missing_shard(meta):
    (meta / "consolidated.01.pth").rename(meta / "consolidated.02.pth")
    refused(meta, r"consolidated\.01\.pth: missing")


def test_shards_with_different_tensors(meta):
    edit_shard(meta, 1, lambda s: s.pop("layers.1.attention.wv.weight"))
    refused(meta, r"consolidated\.01\.pth: tensor 'layers\.1\.attention\.wv\.weight' is absent, "
                  r"but torch\.float32\(8, 48\) in consolidated\.00\.pth")
    edit_shard(meta, 1, lambda s: s.update({"layers.1.attention.wv.weight": torch.zeros(8, 48),
                                            "layers.2.attention.wv.weight": torch.zeros(8, 48)}))
    refused(meta, r"consolidated\.01\.pth: tensor 'layers\.2\.attention\.wv\.weight' is "
                  r"torch\.float32\(8, 48\), but absent in consolidated\.00\.pth")
    edit_shard(meta, 1, lambda s: s.pop("layers.2.attention.wv.weight"))
    edit_shard(meta, 1, lambda s: s.update({"layers.1.attention.wv.weight": torch.zeros(8, 47)}))
    refused(meta, r"consolidated\.01\.pth: tensor 'layers\.1\.attention\.wv\.weight' is "
                  r"torch\.float32\(8, 47\), but torch\.float32\(8, 48\) in consolidated\.00\.pth")


def test_replicated_norm_that_differs_between_ranks(meta):
    edit_shard(meta, 1, lambda s: s["layers.0.ffn_norm.weight"].__setitem__(5, 2.0))
    refused(meta, r"consolidated\.01\.pth: replicated tensor 'layers\.0\.ffn_norm\.weight' differs")


@pytest.mark.parametrize("key", ["moe_args", "vision_chunk_size", "quantization_args"])
def test_unknown_params_key(meta, key):
    edit_params(meta, **{key: {}})
    refused(meta, rf"params\.json: unsupported key '{key}'$")


def test_params_json_that_contradicts_the_tensors(meta):
    written = json.loads((meta / "params.json").read_text())
    assert (written["multiple_of"], written["ffn_dim_multiplier"]) == (80, 80 / 128)
    edit_params(meta, multiple_of=32, ffn_dim_multiplier=None)
    refused(meta, r"params\.json: multiple_of=32 and ffn_dim_multiplier=None give ffn dim 128, but "
                  r"'layers\.0\.feed_forward\.w1\.weight' has 80")
    edit_params(meta, multiple_of=80, ffn_dim_multiplier=80 / 128, n_kv_heads=4)
    refused(meta, r"params\.json: LlamaConfig\.n_kv_heads: must divide n_heads=6")
    edit_params(meta, n_kv_heads=2, n_layers=3)
    refused(meta, r"meta: tensor 'layers\.2\.attention_norm\.weight' is missing")
    edit_params(meta, n_layers=2, max_batch_size=4)
    assert any("max_batch_size" in n for n in open_checkpoint(meta).notes)


def test_wrongly_shaped_tensor(meta):
    for rank in (0, 1):
        edit_shard(meta, rank, lambda s: s.update({"layers.1.attention.wk.weight":
                                                   torch.zeros(8, 40)}))
    refused(meta, r"tensor 'layers\.1\.attention\.wk\.weight' has shape \(16, 40\), but "
                  r"params\.json implies \(16, 48\)")


def test_output_one_bit_away_from_the_embedding_is_untied(tmp_path):
    config = small_config(tie_embeddings=True)
    to_meta(native(tmp_path / "src", config), tmp_path / "meta")
    assert open_checkpoint(tmp_path / "meta").config.tie_embeddings

    def flip_last_bit(s):
        s["output.weight"].view(torch.int32)[-1, -1] ^= 1
    edit_shard(tmp_path / "meta", 0, flip_last_bit)
    ckpt = open_checkpoint(tmp_path / "meta")
    assert not ckpt.config.tie_embeddings and "output.weight" in ckpt.specs


def test_writer_refuses_bad_tensors_and_leaves_nothing(tmp_path):
    config = small_config(tie_embeddings=True)
    src = open_checkpoint(native(tmp_path / "src", config))
    specs = dict(src.specs, **{"output.weight": src.specs["tok_embeddings.weight"]})
    with pytest.raises(BridgeError, match=r"unexpected tensor 'output\.weight'"):
        write_checkpoint("meta", tmp_path / "a", config, specs, src.tensor)

    def bad_fetch(name):
        array = src.tensor(name)
        return array[:, :-1] if name == "layers.1.feed_forward.w2.weight" else array
    with pytest.raises(BridgeError, match=r"tensor 'layers\.1\.feed_forward\.w2\.weight': got "
                                          r"float32\(48, 79\), expected float32\(48, 80\)"):
        write_checkpoint("meta", tmp_path / "b", config, src.specs, bad_fetch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_existing_destination_is_kept_unless_overwrite(meta, tmp_path):
    before = (meta / "consolidated.00.pth").read_bytes()
    with pytest.raises(BridgeError, match="already exists"):
        to_meta(tmp_path / "src", meta)
    assert (meta / "consolidated.00.pth").read_bytes() == before
    to_meta(tmp_path / "src", meta, overwrite=True)
    assert sorted(p.name for p in meta.iterdir()) == ["consolidated.00.pth", "params.json",
                                                      "tokenizer.model"]


def test_bfloat16_tensors_come_back_as_ml_dtypes_bfloat16(tmp_path):
    to_meta(native(tmp_path / "src", small_config(), torch.bfloat16), tmp_path / "meta")
    ckpt = open_checkpoint(tmp_path / "meta")
    assert ckpt.stored_dtype() == "bfloat16"
    assert ckpt.tensor("norm.weight").dtype == ml_dtypes.bfloat16


def test_bridge_meta_imports_without_torch():
    code = "import sys, bridge.formats.meta; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
