"""Mistral (its sliding window: tests/test_sliding_window.py), Qwen2 and Qwen3 read from Hugging Face directories: both
twins give transformers' own logits, each delta matters, an export loads in transformers as the
same class, and what the project cannot hold is refused by name, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax_llama  # noqa: E402
import torch_llama  # noqa: E402
from bridge.errors import BridgeError  # noqa: E402
from bridge.formats import open_checkpoint  # noqa: E402
from bridge.sampling import Sampler  # noqa: E402
from bridge.tensors import canonical_shapes  # noqa: E402
from jax_llama.checkpoint import params_from_tensors  # noqa: E402
from torch_llama.generate import generate as torch_generate  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-6)
FAMILIES = {  # name: (config class, model class, settings, its delta)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), "qkv_bias"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32), "qk_norm"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None), None),
}
BRIDGE = str(Path(sys.executable).with_name("llama-bridge"))
WITH_DELTA = [f for f, spec in FAMILIES.items() if spec[3] is not None]
TOKENS = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (2, 9))


def _hf_model(family: str, seed: int = 0, **changes):
    config_class, model_class, extra, _ = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**SMALL, **changes}, **extra)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # random biases and norms, so that a wrong permutation shows
        for name, p in model.named_parameters():
            if name.endswith(("bias", "q_norm.weight", "k_norm.weight")):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(TOKENS)).logits.float().numpy()


@pytest.fixture(scope="module")
def saved_by_family(tmp_path_factory):
    """family -> (family, its small random model saved by transformers, transformers' logits)."""
    made = {}

    def save(family):
        if family not in made:
            model = _hf_model(family)
            path = tmp_path_factory.mktemp(family) / "hf"
            model.save_pretrained(path)
            made[family] = family, path, _hf_logits(model)
        return made[family]
    return save


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, saved_by_family):
    return saved_by_family(request.param)


def test_config_read_as_its_family(saved):
    family, path, _ = saved
    config = open_checkpoint(path).config
    delta = FAMILIES[family][3]
    assert config.family == family
    assert config.deltas == ([] if delta is None else [delta])
    if family == "qwen3":
        assert config.head_dim == 32 != config.dim // config.n_heads
    assert type(config).from_dict(config.to_dict()) == config


def test_inspect_names_the_family_and_its_delta(saved):
    family, path, _ = saved
    delta = FAMILIES[family][3]
    result = subprocess.run([BRIDGE, "inspect", str(path), "--json", "--no-scan"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["family"] == family
    assert report["deltas"] == ([] if delta is None else [delta])
    text = subprocess.run([BRIDGE, "inspect", str(path), "--no-scan"], capture_output=True,
                          text=True).stdout
    line = next(row for row in text.splitlines() if row.strip().startswith("family"))
    assert family in line and (delta is None or delta in line)


def test_both_twins_equal_transformers(saved):
    family, path, want = saved
    model, params = jax_llama.load(path)
    jax_logits = np.asarray(model.apply({"params": params}, TOKENS))
    torch_logits = torch_llama.load(path, device="cpu")(torch.as_tensor(TOKENS)).detach().numpy()
    np.testing.assert_allclose(jax_logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(torch_logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.fixture(scope="module", params=WITH_DELTA)
def saved_with_delta(request, saved_by_family):
    return saved_by_family(request.param)


def test_cached_greedy_generation_equals_transformers(saved):
    family, path, _ = saved
    prompt = [[5, 17, 33, 2]]
    with torch.no_grad():
        want = _hf_model(family).generate(torch.tensor(prompt), max_new_tokens=8,
                                          do_sample=False)[0, 4:].tolist()
    model, params = jax_llama.load(path)
    assert jax_llama.generate(model, params, prompt, 8, Sampler(temperature=0.0)).tokens == [want]
    got = torch_generate(torch_llama.load(path, device="cpu"), prompt, 8, Sampler(temperature=0.0))
    assert got.tokens == [want]


def test_switching_the_delta_off_changes_the_logits(saved_with_delta):
    family, path, want = saved_with_delta
    delta = FAMILIES[family][3]
    ckpt = open_checkpoint(path)
    config = ckpt.config.replace(**{delta: False})
    tensors = {n: ckpt.tensor(n) for n in ckpt.specs if n in canonical_shapes(config)}
    model = torch_llama.Llama(config)
    model.load_state_dict({n: torch.as_tensor(t) for n, t in tensors.items()})
    got = model.eval()(torch.as_tensor(TOKENS)).detach().numpy()
    assert np.abs(got - want).max() > 1e-2 * np.abs(want).max()
    jax_model, _ = jax_llama.init(config)
    params = params_from_tensors(tensors.__getitem__, config)
    got = np.asarray(jax_model.apply({"params": params}, TOKENS))
    assert np.abs(got - want).max() > 1e-2 * np.abs(want).max()


def test_export_loads_in_transformers_as_the_same_class(saved, tmp_path):
    family, path, want = saved
    out = tmp_path / "out"
    result = subprocess.run([BRIDGE, "convert", str(path), str(out), "--to", "hf"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == family
    assert written["architectures"] == [FAMILIES[family][1]]
    assert open_checkpoint(out).config == open_checkpoint(path).config  # the 4.x schema read
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == FAMILIES[family][1]
    np.testing.assert_allclose(_hf_logits(model), want, rtol=1e-5, atol=1e-6)


def _error_lines(stderr: str) -> list[str]:
    """stderr's lines but a progress bar's (one clear line is what the user reads)."""
    return [line for line in stderr.strip().splitlines() if "%|" not in line]


def _refused(tmp_path, family, change, field):
    model = _hf_model(family)
    src = tmp_path / "src"
    model.save_pretrained(src)
    fields = json.loads((src / "config.json").read_text())
    fields.update(change)
    (src / "config.json").write_text(json.dumps(fields))
    with pytest.raises(BridgeError, match=field):
        open_checkpoint(src)
    return src


def test_qwens_unused_window_size_is_read(tmp_path):
    """Qwen2.5's config.json gives a sliding_window with use_sliding_window false: no window."""
    model = _hf_model("qwen2")
    model.save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    fields.update(sliding_window=32768, use_sliding_window=False, max_window_layers=21)
    fields.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    jax_model, params = jax_llama.load(tmp_path)
    want = _hf_logits(model)
    got = np.asarray(jax_model.apply({"params": params}, TOKENS))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("family, change, field", [
    ("mistral", {"sliding_window": 0}, "sliding_window"),
    ("mistral", {"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]},
     "layer_types"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("qwen2", {"num_experts": 8}, "num_experts"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen2", {"model_type": "qwen2_moe"}, "model_type"),
])
def test_what_cannot_be_held_is_refused_by_name(tmp_path, family, change, field):
    src = _refused(tmp_path, family, change, field)
    out = tmp_path / "out"
    result = subprocess.run([BRIDGE, "convert", str(src), str(out), "--to", "native"],
                            capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    errors = _error_lines(result.stderr)
    assert len(errors) == 1 and field in errors[0]
    assert not out.exists()


@pytest.mark.parametrize("to", ["meta", "llama2c"])  # GGUF holds them: test_families_gguf.py
def test_formats_without_the_deltas_refuse_them(saved_with_delta, tmp_path, to):
    family, path, _ = saved_with_delta
    delta = FAMILIES[family][3]
    out = tmp_path / ("out.gguf" if to == "gguf" else "out")
    result = subprocess.run([BRIDGE, "convert", str(path), str(out), "--to", to],
                            capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    errors = _error_lines(result.stderr)
    assert len(errors) == 1 and delta in errors[0]
    assert not out.exists()


def test_float64_reference_knows_the_deltas(saved):
    import jax

    from llama_twins.float64 import _Blocks, forward_blocks

    family, path, _ = saved
    ckpt = open_checkpoint(path)
    tensors = {n: ckpt.tensor(n) for n in ckpt.specs}
    hf = _hf_model(family).double()
    with torch.no_grad():
        want = hf(torch.as_tensor(TOKENS)).logits.numpy()
    with jax.enable_x64(True):
        _, logits, _ = forward_blocks(tensors.__getitem__, ckpt.config, TOKENS,
                                      np.ones_like(TOKENS))
        _, grads = _Blocks(ckpt.config).value_and_grad(
            {n: jax.numpy.asarray(t, np.float64) for n, t in tensors.items()},
            jax.numpy.asarray(TOKENS[:, :-1]), jax.numpy.asarray(TOKENS[:, 1:]))
    # transformers computes RoPE's angles in float32 even in a float64 model: 1e-7 of the scale
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-6 * np.abs(want).max())
    assert sorted(grads) == sorted(canonical_shapes(ckpt.config))


def test_parity_report_with_transformers_passes(saved_with_delta):
    family, path, _ = saved_with_delta
    result = subprocess.run([BRIDGE, "parity", str(path), "--reference", "transformers",
                             "--seq-len", "8", "--new-tokens", "4", "--no-training",
                             "--no-progress"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "transformers vs JAX" in result.stdout
    assert result.stdout.strip().endswith("parity: ok, every figure within its bound")
