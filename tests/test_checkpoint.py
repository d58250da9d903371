"""JAX <-> torch through the native checkpoint, both directions, and the checkpoint's refusals."""

import json

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
from safetensors import safe_open

import jax_llama
import torch_llama
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint, write_native
from conftest import ATTENTION_KINDS, SCALING, jax_logits, random_tokens, small_config, torch_logits
from jax_llama.checkpoint import tensor_specs

# Random-init logits here are O(0.5) (asserted below). Both twins compute in float32 from the same
# weights and differ only in summation order, ~1e-7 relative per op; 1e-5 is the bound.
ATOL = 1e-5

# MHA / GQA / MQA x tied / untied, with rope scaling and scan_layers alternating so that every
# value of every option is covered by at least two cases.
CASES = [
    ("mha", False, False, False), ("mha", True, True, True),
    ("gqa", False, True, False), ("gqa", True, False, True),
    ("mqa", False, False, True), ("mqa", True, True, False),
]


def case_config(kind, tied, scaled):
    extra = dict(rope_scaling=SCALING, rope_theta=100.0) if scaled else {}
    return small_config(n_kv_heads=ATTENTION_KINDS[kind], tie_embeddings=tied, **extra)


@pytest.mark.parametrize("kind, tied, scaled, scan", CASES)
def test_jax_to_torch(tmp_path, kind, tied, scaled, scan):
    config = case_config(kind, tied, scaled)
    tokens = random_tokens(config, seq_len=40)
    model, params = jax_llama.init(config, seed=7, scan_layers=scan)
    jax_llama.save(tmp_path / "ckpt", config, params)
    tmodel = torch_llama.load(tmp_path / "ckpt", device="cpu")
    assert ("output.weight" in tmodel.state_dict()) is not tied

    expected = jax_logits(model, params, tokens)
    assert 0.1 < np.abs(expected).max() < 10
    np.testing.assert_allclose(torch_logits(tmodel, tokens), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("kind, tied, scaled, scan", CASES)
def test_torch_to_jax(tmp_path, kind, tied, scaled, scan):
    config = case_config(kind, tied, scaled)
    tokens = random_tokens(config, seq_len=40)
    torch.manual_seed(7)
    tmodel = torch_llama.Llama(config).eval()
    torch_llama.save(tmp_path / "ckpt", tmodel)
    model, params = jax_llama.load(tmp_path / "ckpt", scan_layers=scan)
    assert ("layers" in params) is scan

    expected = torch_logits(tmodel, tokens)
    assert 0.1 < np.abs(expected).max() < 10
    np.testing.assert_allclose(jax_logits(model, params, tokens), expected, rtol=0, atol=ATOL)


def test_round_trip_is_bit_exact_and_order_independent(tmp_path):
    config = small_config()
    _, params = jax_llama.init(config, scan_layers=True)
    jax_llama.save(tmp_path / "a", config, params)
    torch_llama.save(tmp_path / "b", torch_llama.load(tmp_path / "a", device="cpu"))
    _, back = jax_llama.load(tmp_path / "b")          # unscanned this time
    jax_llama.save(tmp_path / "c", config, back)
    a, c = open_checkpoint(tmp_path / "a"), open_checkpoint(tmp_path / "c")
    for (name, x), (name2, y) in zip(a, c):
        assert name == name2
        np.testing.assert_array_equal(x, y)


def write_modified(src, dst, edit):
    """Copy a single-file native checkpoint, letting edit(tensors) change the tensor dict."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = safetensors.numpy.load_file(src / "model.safetensors")
    edit(tensors)
    safetensors.numpy.save_file(tensors, dst / "model.safetensors")


def test_negative_case_one_perturbed_weight_breaks_parity(tmp_path):
    """The comparison can fail: 0.01 added to one weight of the last block is caught."""
    config = small_config()
    tokens = random_tokens(config)
    model, params = jax_llama.init(config)
    jax_llama.save(tmp_path / "good", config, params)

    def perturb(t):
        t["layers.1.feed_forward.w2.weight"][3, 5] += 0.01
    write_modified(tmp_path / "good", tmp_path / "bad", perturb)
    diff = np.abs(torch_logits(torch_llama.load(tmp_path / "bad", device="cpu"), tokens)
                  - jax_logits(model, params, tokens)).max()
    assert diff > 10 * ATOL


def test_negative_case_half_split_rope_layout_is_caught(tmp_path):
    """wq/wk stored in Hugging Face's half-split layout (the most common conversion bug) give
    clearly different logits, so the interleaved convention is really being tested."""
    config = small_config()
    tokens = random_tokens(config, seq_len=20)
    model, params = jax_llama.init(config)
    jax_llama.save(tmp_path / "good", config, params)

    def to_half_split(t):
        for i in range(config.n_layers):
            for w, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads)):
                name = f"layers.{i}.attention.{w}.weight"
                x = t[name].reshape(heads, config.head_dim // 2, 2, config.dim)
                t[name] = np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(-1, config.dim))
    write_modified(tmp_path / "good", tmp_path / "bad", to_half_split)
    diff = np.abs(torch_logits(torch_llama.load(tmp_path / "bad", device="cpu"), tokens)
                  - jax_logits(model, params, tokens)).max()
    assert diff > 100 * ATOL


def test_sharded_checkpoint(tmp_path):
    config = small_config()
    tokens = random_tokens(config)
    model, params = jax_llama.init(config)
    jax_llama.save(tmp_path / "ckpt", config, params, max_shard_size=20_000)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(
        t.nbytes for _, t in open_checkpoint(tmp_path / "ckpt"))
    for f in files:  # every shard is a valid safetensors file within the limit (or one big tensor)
        with safe_open(tmp_path / "ckpt" / f, framework="numpy") as st:
            sizes = [st.get_tensor(k).nbytes for k in st.keys()]
            assert sum(sizes) <= 20_000 or len(sizes) == 1
    np.testing.assert_allclose(torch_logits(torch_llama.load(tmp_path / "ckpt", device="cpu"), tokens),
                               jax_logits(model, params, tokens), rtol=0, atol=ATOL)


def test_bfloat16_is_stored_and_loaded_without_a_float32_detour(tmp_path):
    config = small_config()
    _, params = jax_llama.init(config, param_dtype="bfloat16")
    jax_llama.save(tmp_path / "ckpt", config, params)
    with safe_open(tmp_path / "ckpt" / "model.safetensors", framework="numpy") as st:
        stored = st.get_tensor("layers.0.attention.wq.weight")
    assert stored.dtype == ml_dtypes.bfloat16
    tmodel = torch_llama.load(tmp_path / "ckpt", device="cpu")
    weight = tmodel.state_dict()["layers.0.attention.wq.weight"]
    assert weight.dtype == torch.bfloat16
    np.testing.assert_array_equal(weight.view(torch.int16).numpy(), stored.view(np.int16))
    model, loaded = jax_llama.load(tmp_path / "ckpt")
    assert model.dtype == "bfloat16" and loaded["norm"]["weight"].dtype == "bfloat16"
    _, as_f32 = jax_llama.load(tmp_path / "ckpt", dtype="float32")
    assert as_f32["norm"]["weight"].dtype == "float32"


# -- refusals ------------------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    config = small_config()
    _, params = jax_llama.init(config)
    jax_llama.save(tmp_path / "good", config, params)
    return tmp_path / "good"


def both_loaders_refuse(path, message):
    for load in (lambda p: jax_llama.load(p), lambda p: torch_llama.load(p, device="cpu")):
        with pytest.raises(BridgeError, match=message):
            load(path)


def test_missing_tensor(saved, tmp_path):
    write_modified(saved, tmp_path / "bad", lambda t: t.pop("layers.1.attention.wv.weight"))
    both_loaders_refuse(tmp_path / "bad", r"tensor 'layers\.1\.attention\.wv\.weight' is missing")


def test_extra_tensor(saved, tmp_path):
    write_modified(saved, tmp_path / "bad",
                   lambda t: t.update({"layers.2.ffn_norm.weight": np.ones(48, np.float32)}))
    both_loaders_refuse(tmp_path / "bad", r"unexpected tensor 'layers\.2\.ffn_norm\.weight'")


def test_wrongly_shaped_tensor(saved, tmp_path):
    write_modified(saved, tmp_path / "bad", lambda t: t.update(
        {"layers.0.attention.wk.weight": np.zeros((48, 48), np.float32)}))
    both_loaders_refuse(tmp_path / "bad", r"tensor 'layers\.0\.attention\.wk\.weight' has shape "
                                          r"\(48, 48\), but config.json implies \(16, 48\)")


def test_integer_tensor(saved, tmp_path):
    write_modified(saved, tmp_path / "bad", lambda t: t.update({"norm.weight": np.ones(48, np.int32)}))
    both_loaders_refuse(tmp_path / "bad", r"tensor 'norm\.weight' has dtype int32")


def test_config_json_that_does_not_match_the_tensors(saved):
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps(dict(config, ffn_dim=96)))
    both_loaders_refuse(saved, r"tensor 'layers\.0\.feed_forward\.w1\.weight' has shape \(80, 48\), "
                               r"but config.json implies \(96, 48\)")


def test_invalid_config_json(saved):
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps(dict(config, n_kv_heads=4)))
    both_loaders_refuse(saved, r"config\.json: LlamaConfig\.n_kv_heads: must divide n_heads=6")
    (saved / "config.json").write_text("{not json")
    both_loaders_refuse(saved, r"config\.json: not valid JSON")


def test_unrecognised_path(tmp_path):
    both_loaders_refuse(tmp_path / "nowhere", "no such file or directory")
    both_loaders_refuse(tmp_path, "not a recognised checkpoint")


def test_index_pointing_outside_the_directory(saved, tmp_path):
    names = [name for name, _ in open_checkpoint(saved)]
    (saved / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    index = {"weight_map": {n: "../elsewhere.safetensors" for n in names}}
    (saved / "model.safetensors.index.json").write_text(json.dumps(index))
    both_loaders_refuse(saved, r"points outside the directory \('\.\./elsewhere\.safetensors'\)")


def test_existing_destination_is_kept_unless_overwrite(saved):
    config = small_config()
    before = (saved / "model.safetensors").read_bytes()
    _, params = jax_llama.init(config, seed=99)
    with pytest.raises(BridgeError, match="already exists"):
        jax_llama.save(saved, config, params)
    assert (saved / "model.safetensors").read_bytes() == before
    jax_llama.save(saved, config, params, overwrite=True)
    assert (saved / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in saved.parent.iterdir()) == ["good"]  # no temporaries left


def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    config = small_config()
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    _, params = jax_llama.init(config)
    with pytest.raises(BridgeError, match="not a checkpoint directory"):
        jax_llama.save(tmp_path / "precious", config, params, overwrite=True)
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_failed_write_leaves_nothing(tmp_path):
    config = small_config()
    _, params = jax_llama.init(config)
    params["layers_1"]["feed_forward"]["w2"]["kernel"] = np.zeros((80, 47), np.float32)
    with pytest.raises(BridgeError, match=r"tensor 'layers\.1\.feed_forward\.w2\.weight'"):
        jax_llama.save(tmp_path / "out", config, params)
    assert list(tmp_path.iterdir()) == []


def test_params_that_do_not_match_the_config_are_refused(tmp_path):
    config = small_config()
    _, params = jax_llama.init(config)
    with pytest.raises(BridgeError, match=r"no entry layers_2/attention_norm/weight"):
        jax_llama.save(tmp_path / "out", config.replace(n_layers=3), params)
    params["classifier"] = {"kernel": np.zeros((48, 5), np.float32)}
    with pytest.raises(BridgeError, match="extra entries would be lost"):
        jax_llama.save(tmp_path / "out", config, params)
    assert list(tmp_path.iterdir()) == []


def test_write_interrupted_midway_leaves_nothing(tmp_path):
    """A failure after some tensors (and shards) are on disk removes them all."""
    config = small_config()
    _, params = jax_llama.init(config)
    specs, fetch = tensor_specs(params, config)
    written = []

    def failing_fetch(name):
        if len(written) == 10:
            raise OSError("disk full")
        written.append(name)
        return fetch(name)
    with pytest.raises(OSError, match="disk full"):
        write_native(tmp_path / "out", config, specs, failing_fetch, max_shard_size=10_000)
    assert len(written) == 10 and list(tmp_path.iterdir()) == []
