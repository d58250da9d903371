"""RMSNorm and RoPE in both twins against hand-computed values and RoPE's defining properties."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_llama
import torch_llama
from bridge.config import RopeScaling
from bridge.rope import rope_inv_freq

# Single float32 ops on O(1) values: a few ulps (1e-7 each) of rounding, so 1e-6 is tight.
TIGHT = dict(rtol=1e-6, atol=1e-6)


def jax_rms_norm(x, weight, eps):
    return np.asarray(jax_llama.RMSNorm(eps).apply({"params": {"weight": jnp.asarray(weight)}}, x))


def torch_rms_norm(x, weight, eps):
    norm = torch_llama.RMSNorm(len(weight), eps)
    norm.weight.data = torch.tensor(weight)
    return norm(torch.tensor(x)).detach().numpy()


@pytest.mark.parametrize("rms_norm", [jax_rms_norm, torch_rms_norm])
def test_rms_norm_hand_values(rms_norm):
    x = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
    weight = np.array([1.0, 0.5, 2.0, -1.0], dtype=np.float32)
    # mean(x^2) = (1 + 4 + 9 + 16) / 4 = 7.5, so each x is divided by sqrt(7.5 + eps).
    inv = 1 / math.sqrt(7.5 + 1e-5)
    expected = [[1 * inv, 2 * inv * 0.5, 3 * inv * 2.0, -4 * inv]]
    np.testing.assert_allclose(rms_norm(x, weight, 1e-5), expected, **TIGHT)


@pytest.mark.parametrize("rms_norm", [jax_rms_norm, torch_rms_norm])
def test_rms_norm_eps_matters_for_small_inputs(rms_norm):
    x = np.full((1, 4), 1e-3, dtype=np.float32)  # mean(x^2) = 1e-6, comparable to eps
    expected = 1e-3 / math.sqrt(1e-6 + 1e-5)
    np.testing.assert_allclose(rms_norm(x, np.ones(4, np.float32), 1e-5), np.full((1, 4), expected),
                               **TIGHT)


def jax_rope(x, positions, theta=10000.0, scaling=None):
    return np.asarray(jax_llama.apply_rope(jnp.asarray(x), jnp.asarray(positions), theta, scaling))


def torch_rope(x, positions, theta=10000.0, scaling=None):
    return torch_llama.apply_rope(torch.tensor(x), torch.tensor(positions), theta, scaling).numpy()


@pytest.mark.parametrize("rope", [jax_rope, torch_rope])
def test_rope_hand_values(rope):
    # head_dim 4, theta 100: inv_freq = [100^0, 100^-1/2] = [1, 0.1]. Pairs are (x0, x1), (x2, x3).
    x = np.array([1.0, 0.0, 0.0, 1.0], dtype=np.float32).reshape(1, 1, 1, 4)
    out = rope(x, np.array([2]), theta=100.0).ravel()
    # (1, 0) turned by 2 rad; (0, 1) turned by 0.2 rad.
    expected = [math.cos(2), math.sin(2), -math.sin(0.2), math.cos(0.2)]
    np.testing.assert_allclose(out, expected, **TIGHT)


@pytest.mark.parametrize("rope", [jax_rope, torch_rope])
def test_rope_keeps_norms_and_is_identity_at_zero(rope, rng):
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    positions = rng.integers(0, 10_000, (2, 5))
    out = rope(x, positions)
    np.testing.assert_allclose(np.linalg.norm(out.reshape(2, 5, 3, 8, 2), axis=-1),
                               np.linalg.norm(x.reshape(2, 5, 3, 8, 2), axis=-1), rtol=1e-5, atol=0)
    np.testing.assert_array_equal(rope(x, np.zeros((2, 5), np.int64)), x)


@pytest.mark.parametrize("rope", [jax_rope, torch_rope])
@pytest.mark.parametrize("scaling", [None, RopeScaling(factor=8.0, original_max_position_embeddings=64)])
def test_rope_scores_depend_only_on_relative_position(rope, scaling, rng):
    q = rng.standard_normal((1, 1, 1, 32)).astype(np.float32)
    k = rng.standard_normal((1, 1, 1, 32)).astype(np.float32)

    def score(m, n):
        return float(np.sum(rope(q, np.array([m]), scaling=scaling)
                            * rope(k, np.array([n]), scaling=scaling)))

    # float32 angles of up to ~1000 rad carry ~1e-4 rad of rounding; scores are O(5).
    for m, n, shift in [(7, 3, 100), (3, 7, 999), (0, 0, 512)]:
        assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=2e-3)
    assert abs(score(7, 3) - score(7, 4)) > 1e-2  # the check can fail: a different offset differs


def test_rope_twins_agree_with_per_row_positions(rng):
    x = rng.standard_normal((2, 6, 4, 8)).astype(np.float32)
    positions = np.array([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    np.testing.assert_allclose(jax_rope(x, positions), torch_rope(x, positions), rtol=0, atol=1e-6)
    # Row 0 at positions 1..3 equals row-0 data rotated as if alone.
    np.testing.assert_allclose(jax_rope(x[:1, 3:], np.arange(1, 4)), jax_rope(x, positions)[:1, 3:],
                               rtol=0, atol=1e-6)


def published_llama3_scaling(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """The formula as published with LLaMA 3.1 (Meta's apply_scaling), element by element."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new.append(freq)
        elif wavelen > low_freq_wavelen:
            new.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(new)


def test_llama3_rope_scaling_matches_published_formula():
    s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    plain = [500000.0 ** (-i / 128) for i in range(0, 128, 2)]
    expected = published_llama3_scaling(plain, 8.0, 1.0, 4.0, 8192)
    got = rope_inv_freq(128, 500000.0, s)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)  # float32 rounding of float64
    # All three bands are present: kept, divided by 8, and strictly in between.
    ratio = got / np.array(plain)
    assert np.any(np.isclose(ratio, 1.0)) and np.any(np.isclose(ratio, 1 / 8))
    assert np.any((ratio > 1 / 8 + 1e-3) & (ratio < 1 - 1e-3))
    np.testing.assert_allclose(rope_inv_freq(128, 500000.0), plain, rtol=1e-6, atol=0)
