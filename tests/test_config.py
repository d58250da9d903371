import json

import pytest

from bridge.config import PRESETS, LlamaConfig, RopeScaling
from bridge.errors import BridgeError
from bridge.tensors import canonical_shapes, count_params


def test_default_is_llama3_8b():
    c = LlamaConfig()
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size, c.max_seq_len,
            c.rope_theta, c.tie_embeddings, c.head_dim) == (4096, 32, 32, 8, 14336, 128256, 8192,
                                                            500000.0, False, 128)
    # The preset also declares LLaMA 3's bos/eos ids; a bare config declares none.
    assert c == PRESETS["llama3-8b"].replace(bos_id=None, eos_ids=())
    assert PRESETS["llama3-8b"].eos_ids == (128001,) and PRESETS["llama2-7b"].bos_id == 1


@pytest.mark.parametrize("changes, field, rule", [
    (dict(dim=0), "dim", "positive integer"),
    (dict(n_layers=-1), "n_layers", "positive integer"),
    (dict(n_heads=2.5), "n_heads", "positive integer"),
    (dict(vocab_size=True), "vocab_size", "positive integer"),
    (dict(ffn_dim=0), "ffn_dim", "positive integer"),
    (dict(max_seq_len=0), "max_seq_len", "positive integer"),
    (dict(dim=4100), "dim", "divisible by n_heads=32"),
    (dict(n_kv_heads=5), "n_kv_heads", "must divide n_heads=32"),
    (dict(head_dim=127), "head_dim", "even"),
    (dict(norm_eps=0.0), "norm_eps", "positive"),
    (dict(norm_eps=float("nan")), "norm_eps", "positive"),
    (dict(rope_theta=-1.0), "rope_theta", "> 1"),
    (dict(tie_embeddings="yes"), "tie_embeddings", "bool"),
    (dict(bos_id=-1), "bos_id", "non-negative integer"),
    (dict(eos_ids=[2, "3"]), "eos_ids", "non-negative integers"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling.type", "llama3"),
    (dict(rope_scaling={"factor": 0.5}), "rope_scaling.factor", ">= 1"),
    (dict(rope_scaling={"low_freq_factor": 4.0, "high_freq_factor": 1.0}),
     "rope_scaling.high_freq_factor", "greater than low_freq_factor"),
    (dict(rope_scaling={"original_max_position_embeddings": 0}),
     "rope_scaling.original_max_position_embeddings", "positive integer"),
    (dict(rope_scaling={"factor": 8.0, "beta": 1}), "rope_scaling", "unknown field(s) ['beta']"),
])
def test_invalid_fields_are_named(changes, field, rule):
    with pytest.raises(ValueError) as e:  # BridgeError is a ValueError
        LlamaConfig(**changes)
    assert isinstance(e.value, BridgeError)
    assert f"LlamaConfig.{field}:" in str(e.value) and rule in str(e.value)


def test_unknown_field_in_dict_is_refused():
    with pytest.raises(BridgeError, match=r"unknown field\(s\) \['hidden_size'\]"):
        LlamaConfig.from_dict({"dim": 64, "hidden_size": 64})


def test_explicit_head_dim_is_kept():
    c = LlamaConfig(dim=48, n_heads=6, n_kv_heads=2, head_dim=16)
    assert c.head_dim == 16
    assert canonical_shapes(c)["layers.0.attention.wq.weight"] == (96, 48)
    assert PRESETS["llama3.2-1b"].head_dim == 64


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_json(name):
    c = PRESETS[name]
    assert LlamaConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("name, expected", [
    # Published parameter counts of each release.
    ("llama3-8b", 8_030_261_248), ("llama2-7b", 6_738_415_616), ("llama2-13b", 13_015_864_320),
    ("llama3.2-1b", 1_235_814_400), ("llama3.2-3b", 3_212_749_824),
    ("llama3.1-405b", 405_853_388_800), ("llama3-70b", 70_553_706_496),
    ("smollm2-135m", 134_515_008),
    # transformers' num_parameters() of each (tied heads counted once)
    ("mistral-7b-v0.1", 7_241_732_096), ("mistral-7b-v0.3", 7_248_023_552),
    ("qwen2.5-0.5b", 494_032_768), ("qwen3-0.6b", 596_049_920),
])
def test_preset_parameter_counts(name, expected):
    assert count_params(PRESETS[name]) == expected


def test_llama31_presets_scale_rope():
    s = PRESETS["llama3.1-8b"].rope_scaling
    assert s == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
    assert PRESETS["llama3.2-1b"].rope_scaling.factor == 32.0
    assert PRESETS["llama3-8b"].rope_scaling is None


def test_the_smollm2_preset_is_the_real_models_config(smollm2):
    from bridge.formats import open_checkpoint
    assert open_checkpoint(smollm2).config == PRESETS["smollm2-135m"]
