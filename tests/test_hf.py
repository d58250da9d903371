"""Hugging Face checkpoints against an independent implementation: transformers itself."""

import json

import numpy as np
import pytest
import torch

import jax_llama
import torch_llama
from bridge.config import PRESETS
from bridge.convert import convert
from bridge.errors import BridgeError
from bridge.formats import hf as hf_format
from bridge.formats import open_checkpoint
from conftest import jax_logits, random_tokens, small_config, torch_logits

transformers = pytest.importorskip("transformers")

# Random-init logits are O(1) (asserted). transformers and our twins do the same float32 math in
# a different order (half-split vs interleaved RoPE on permuted rows, fused vs explicit attention):
# differences are float32 rounding, ~3e-7 measured; 1e-5 leaves room yet catches any real error.
ATOL = 1e-5
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = {
    "mha": dict(num_key_value_heads=6),
    "gqa": dict(num_key_value_heads=2),
    "mqa": dict(num_key_value_heads=1),
    "tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "llama3-rope": dict(num_key_value_heads=2, rope_scaling=LLAMA3_SCALING, rope_theta=100.0),
    "bf16": dict(num_key_value_heads=2, dtype="bfloat16"),
    "sharded": dict(num_key_value_heads=2, shard="20KB"),
}


def hf_model(num_key_value_heads, dtype="float32", seed=0, **kw):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=num_key_value_heads,
                                      vocab_size=97, max_position_embeddings=64, **kw)
    model = transformers.LlamaForCausalLM(config).eval()
    for p in model.parameters():  # not model.to(dtype): that would also round RoPE's inv_freq buffer
        p.data = p.data.to(getattr(torch, dtype))
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model.float()(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def loaded_logits(path, tokens, **kw) -> tuple[np.ndarray, np.ndarray]:
    """(JAX logits, torch logits) of the checkpoint at `path`, each twin loading it itself."""
    return (jax_logits(*jax_llama.load(path, **kw), tokens),
            torch_logits(torch_llama.load(path, device="cpu", **kw), tokens))


@pytest.mark.parametrize("case", CASES)
def test_twins_match_transformers(tmp_path, case):
    kw = dict(CASES[case])
    shard = kw.pop("shard", None)
    model = hf_model(**kw)
    model.save_pretrained(tmp_path / "hf", **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    convert(tmp_path / "hf", tmp_path / "native", progress=False)
    tokens = random_tokens(small_config(), seq_len=40)  # past original_max_position_embeddings
    expected = hf_logits(model, tokens)
    assert 0.1 < np.abs(expected).max() < 10

    for path in (tmp_path / "native", tmp_path / "hf"):  # converted, and read in place
        for logits in loaded_logits(path, tokens, dtype="float32"):
            np.testing.assert_allclose(logits, expected, rtol=0, atol=ATOL)
    if case == "bf16":
        assert open_checkpoint(tmp_path / "native").stored_dtype() == "bfloat16"


def test_skipping_the_qk_permutation_is_caught(tmp_path, monkeypatch):
    model = hf_model(num_key_value_heads=2)
    model.save_pretrained(tmp_path / "hf")
    tokens = random_tokens(small_config(), seq_len=20)
    monkeypatch.setattr(hf_format, "from_half_split", lambda w, n_heads: w)
    diff = np.abs(loaded_logits(tmp_path / "hf", tokens)[1] - hf_logits(model, tokens)).max()
    assert diff > 100 * ATOL


def test_our_export_loads_in_transformers(tmp_path):
    config = small_config(rope_scaling=dict(factor=4.0, original_max_position_embeddings=32),
                          rope_theta=100.0, bos_id=1, eos_ids=(2, 3))
    tokens = random_tokens(config, seq_len=40)
    model, params = jax_llama.init(config, seed=5)
    jax_llama.save(tmp_path / "native", config, params)
    (tmp_path / "native" / "tokenizer.json").write_text("{}")  # tokenizer files travel along
    convert(tmp_path / "native", tmp_path / "hf", to="hf", progress=False)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()

    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.eos_token_id == [2, 3] and loaded.config.num_key_value_heads == 2
    np.testing.assert_allclose(hf_logits(loaded, tokens),
                               np.asarray(model.apply({"params": params}, tokens)), rtol=0, atol=ATOL)


def test_hf_native_hf_is_bitwise_and_transformers_sees_the_same_model(tmp_path):
    model = hf_model(num_key_value_heads=2, tie_word_embeddings=True, dtype="bfloat16")
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "native", progress=False)
    convert(tmp_path / "native", tmp_path / "hf2", to="hf", progress=False)
    from safetensors.numpy import load_file
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name].view(np.uint16), b[name].view(np.uint16), err_msg=name)
    tokens = random_tokens(small_config())
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf2")
    np.testing.assert_array_equal(hf_logits(again, tokens), hf_logits(model, tokens))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_hf_native_is_bitwise(tmp_path, dtype):
    config = small_config(n_kv_heads=1, bos_id=1, eos_ids=(2,))
    _, params = jax_llama.init(config, param_dtype=dtype)
    jax_llama.save(tmp_path / "a", config, params)
    convert(tmp_path / "a", tmp_path / "hf", to="hf", progress=False)
    convert(tmp_path / "hf", tmp_path / "b", progress=False)
    a, b = open_checkpoint(tmp_path / "a"), open_checkpoint(tmp_path / "b")
    assert b.config == a.config  # every field survives, bos/eos ids included
    for (name, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.dtype.name == dtype
        np.testing.assert_array_equal(x, y, err_msg=name)


def test_permutation_round_trip_and_what_it_moves():
    w = np.arange(2 * 8 * 3).reshape(16, 3)  # 2 heads of head_dim 8, 3 input columns
    half = hf_format.to_half_split(w, n_heads=2)
    np.testing.assert_array_equal(hf_format.from_half_split(half, n_heads=2), w)
    # In head 0, interleaved rows (0, 1), (2, 3), ... become rows 0..3 (first halves), 4..7.
    np.testing.assert_array_equal(half[:8, 0], w[[0, 2, 4, 6, 1, 3, 5, 7], 0])
    assert not np.array_equal(hf_format.to_half_split(w, n_heads=1), half)  # heads matter


PUBLISHED_LLAMA31_8B = {  # config.json of meta-llama/Llama-3.1-8B as transformers 4.43 wrote it
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def test_config_as_transformers_4_and_5_write_it():
    config, notes = hf_format.config_from_hf(PUBLISHED_LLAMA31_8B, "config.json")
    assert config == PRESETS["llama3.1-8b"] and notes == []
    v5 = {k: v for k, v in PUBLISHED_LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta",
                                                                       "torch_dtype")}
    v5.update(dtype="bfloat16", rope_parameters=dict(PUBLISHED_LLAMA31_8B["rope_scaling"],
                                                     rope_theta=500000.0))
    assert hf_format.config_from_hf(v5, "config.json")[0] == PRESETS["llama3.1-8b"]
    written = hf_format.config_to_hf(PRESETS["llama3.1-8b"], "bfloat16")
    assert {k: written[k] for k in PUBLISHED_LLAMA31_8B if k != "transformers_version"} == {
        k: v for k, v in PUBLISHED_LLAMA31_8B.items() if k != "transformers_version"}


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"model_type": "mixtral"}, "model_type 'mixtral' is not supported"),
    ({"model_type": []}, r"model_type \[\] is not supported"),  # found by test_fuzz
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear' is not supported"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config is not supported"),
    ({"num_key_value_heads": 5}, r"LlamaConfig.n_kv_heads: must divide n_heads=32"),
    ({"hidden_size": None}, r"LlamaConfig.dim: must be a positive integer"),
])
def test_unsupported_config_is_refused_by_name(change, message):
    with pytest.raises(BridgeError, match=message):
        hf_format.config_from_hf(dict(PUBLISHED_LLAMA31_8B, **change), "config.json")


def test_unexpected_tensor_and_untied_head_are_refused(tmp_path):
    model = hf_model(num_key_value_heads=2, attention_bias=False)
    model.save_pretrained(tmp_path / "hf")
    from safetensors.numpy import load_file, save_file
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    save_file(dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(48, np.float32)}),
              tmp_path / "hf" / "model.safetensors")
    with pytest.raises(BridgeError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        open_checkpoint(tmp_path / "hf")

    tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"] + 1  # head stored, differs
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))
    with pytest.raises(BridgeError, match="tie_word_embeddings is true but lm_head.weight differs"):
        open_checkpoint(tmp_path / "hf")
