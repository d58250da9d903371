"""Whole-model behaviour of both twins: an independent reference, causality, GQA/MQA, scan and
remat, padding, full-size shapes without memory, and refused inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_llama
import torch_llama
from bridge.errors import BridgeError
from bridge.rope import rope_inv_freq
from conftest import ATTENTION_KINDS, SCALING, random_tokens, small_config, torch_logits, torch_model
from jax_llama.model.attention import AttentionMask
from jax_llama.checkpoint import params_from_tensors, tensor_specs
from llama_twins import float64  # the independent float64 LLaMA, written from canonical tensors

# Random-init logits are O(0.5); float32 twins vs a float64 reference differ by float32 rounding
# accumulated over 2 layers (~1e-7 relative per op), so 1e-5 absolute is tight yet never flaky.
ATOL = 1e-5


def canonical(params, config) -> dict[str, np.ndarray]:
    specs, fetch = tensor_specs(params, config)
    return {name: fetch(name) for name in specs}


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("scaled", [False, True])
def test_both_twins_match_independent_reference(kind, scaled):
    config = small_config(n_kv_heads=ATTENTION_KINDS[kind],
                          **(dict(rope_scaling=SCALING, rope_theta=100.0) if scaled else {}))
    tokens = random_tokens(config, seq_len=40)  # past original_max_position_embeddings=32
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    model, params = jax_llama.init(config, seed=1)
    expected = float64.logits(canonical(params, config), config, tokens, inv_freq=inv_freq)
    assert 0.1 < np.abs(expected).max() < 10  # the scale ATOL is judged against
    np.testing.assert_allclose(model.apply({"params": params}, tokens), expected, rtol=0, atol=ATOL)

    tmodel = torch_model(config)
    expected = float64.logits(tmodel.state_dict(), config, tokens, inv_freq=inv_freq)
    np.testing.assert_allclose(torch_logits(tmodel, tokens), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_gqa_with_all_kv_heads_is_plain_multi_head_attention(rng, implementation):
    """The grouped (B, S, K, G, H) attention with K = N equals textbook per-head attention."""
    config = small_config(n_kv_heads=6)
    attn = jax_llama.Attention(config, attention=implementation)
    x = rng.standard_normal((2, 5, 48)).astype(np.float32)
    cos = np.ones((1, 5, 4), np.float32)   # identity rotation: isolate the attention itself
    sin = np.zeros((1, 5, 4), np.float32)
    params = attn.init(jax.random.key(0), x, cos, sin)["params"]
    out = np.asarray(attn.apply({"params": params}, x, cos, sin, AttentionMask.causal(5))[0])
    mask = np.tril(np.ones((5, 5), bool))[None]

    w = {k: np.asarray(v["kernel"], np.float64) for k, v in params.items()}
    expected = np.zeros((2, 5, 48))
    for b in range(2):
        heads = []
        for n in range(6):
            cols = slice(8 * n, 8 * n + 8)
            q, k, v = (x[b] @ w[p][:, cols] for p in ("wq", "wk", "wv"))
            s = q @ k.T / np.sqrt(8) + np.where(mask[0], 0, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            heads.append(p / p.sum(-1, keepdims=True) @ v)
        expected[b] = np.concatenate(heads, axis=-1) @ w["wo"]
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("twin", ["jax", "torch"])
def test_causality(twin):
    config = small_config()
    tokens = random_tokens(config, batch=2, seq_len=12)
    changed = tokens.copy()
    t = 7
    changed[:, t] = (changed[:, t] + 1) % config.vocab_size
    if twin == "jax":
        model, params = jax_llama.init(config)
        run = lambda toks: np.asarray(model.apply({"params": params}, toks))  # noqa: E731
    else:
        tmodel = torch_model(config)
        run = lambda toks: torch_logits(tmodel, toks)  # noqa: E731
    before, after = run(tokens), run(changed)
    np.testing.assert_allclose(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    assert np.abs(after[:, t:] - before[:, t:]).max(axis=-1).min() > 1e-4  # every later position moves


def test_scan_and_remat_give_the_same_logits_and_gradients():
    config = small_config(n_layers=3)
    tokens = random_tokens(config)
    model, params = jax_llama.init(config, seed=3)
    tensors = canonical(params, config)

    def loss_and_grad(scan_layers, remat):
        m = jax_llama.Llama(config, scan_layers=scan_layers, remat=remat)
        p = params_from_tensors(tensors.__getitem__, config, scan_layers=scan_layers)
        loss = lambda p: jnp.mean(m.apply({"params": p}, tokens) ** 2)  # noqa: E731
        value, grad = jax.jit(jax.value_and_grad(loss))(p)
        return float(value), canonical(grad, config)

    base_loss, base_grad = loss_and_grad(False, False)
    for scan_layers, remat in [(True, False), (False, True), (True, True)]:
        loss, grad = loss_and_grad(scan_layers, remat)
        assert loss == pytest.approx(base_loss, rel=1e-6)
        for name in base_grad:  # identical math in another order: float32 rounding only
            np.testing.assert_allclose(grad[name], base_grad[name], rtol=1e-4, atol=1e-8,
                                       err_msg=name)


def test_scanned_params_are_stacked_on_a_leading_layer_axis():
    config = small_config(n_layers=3)
    _, params = jax_llama.init(config, scan_layers=True)
    assert params["layers"]["attention"]["wq"]["kernel"].shape == (3, 48, 48)
    assert params["layers"]["attention"]["wk"]["kernel"].shape == (3, 48, 16)


@pytest.mark.parametrize("twin", ["jax", "torch"])
def test_left_padded_rows_equal_the_unpadded_prompt(twin):
    config = small_config()
    tokens = random_tokens(config, batch=2, seq_len=9)
    mask = np.ones_like(tokens)
    mask[0, :4] = 0  # row 0: four pads, then a 5-token prompt
    if twin == "jax":
        model, params = jax_llama.init(config)
        run = lambda t, **kw: np.asarray(model.apply({"params": params}, t, **kw))  # noqa: E731
    else:
        tmodel = torch_model(config)
        run = lambda t, **kw: torch_logits(tmodel, t, **kw)  # noqa: E731
    padded = run(tokens, attention_mask=mask)
    np.testing.assert_allclose(padded[0, 4:], run(tokens[:1, 4:])[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(padded[1], run(tokens[1:])[0], rtol=0, atol=1e-5)
    assert np.isfinite(padded).all()  # pad queries see no real key, yet nothing becomes NaN


def test_run_gives_one_output_type_in_both_twins():
    """model(tokens) is the logits; model.run(...) a LlamaOutput whatever is asked for: logits,
    the final normed hidden states, and the cache only when one is given."""
    config = small_config()
    model, params = jax_llama.init(config)
    tokens = random_tokens(config)
    out = model.apply({"params": params}, tokens, method="run")
    assert isinstance(out, jax_llama.LlamaOutput) and out.cache is None
    assert out.hidden.shape == (3, 11, 48)
    np.testing.assert_allclose(out.logits, out.hidden @ params["output"]["kernel"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(out.logits, model.apply({"params": params}, tokens))
    bare = model.apply({"params": params}, tokens, method="run", lm_head=False)
    assert bare.logits is None
    np.testing.assert_array_equal(bare.hidden, out.hidden)
    tmodel = torch_model(config)
    with torch.inference_mode():
        tout = tmodel.run(torch.as_tensor(tokens))
        assert isinstance(tout, torch_llama.LlamaOutput) and tout.cache is None
        assert tout.hidden.shape == (3, 11, 48) and tout.logits.dtype == torch.float32
        torch.testing.assert_close(tout.logits, tmodel(torch.as_tensor(tokens)), rtol=0, atol=0)
        assert tmodel.run(torch.as_tensor(tokens), lm_head=False).logits is None


def test_token_values_are_read_only_where_they_already_are_on_the_host():
    """A device-resident batch is checked by shape alone: reading its values would copy it off
    the device at every decode step. A tensor on torch's 'meta' device has no values at all, so
    any read would raise; the same ids on the CPU are refused."""
    bad = np.array([[1, 2, 97]])
    torch_llama.check_inputs(torch.as_tensor(bad, device="meta"), 97)  # shape only: no read
    with pytest.raises(BridgeError, match="tokens: id 97 is outside the vocabulary"):
        torch_llama.check_inputs(torch.as_tensor(bad), 97)
    with pytest.raises(BridgeError, match="tokens: expected integer ids"):
        torch_llama.check_inputs(torch.ones((1, 3), device="meta"), 97)
    jax_llama.check_inputs(jax.ShapeDtypeStruct((1, 3), jnp.int32), 97)  # abstract: shape only
    with pytest.raises(BridgeError, match="tokens: id 97 is outside the vocabulary"):
        jax_llama.check_inputs(jnp.asarray(bad), 97)  # a concrete array on the CPU


def test_bfloat16_compute_stays_close_to_float32():
    config = small_config()
    tokens = random_tokens(config)
    model, params = jax_llama.init(config)
    ref = np.asarray(model.apply({"params": params}, tokens))
    bf16 = jax_llama.Llama(config, dtype=jnp.bfloat16)
    out = bf16.apply({"params": params}, tokens)
    assert out.dtype == jnp.float32  # logits are float32 whatever the compute dtype
    # bfloat16 keeps 8 bits of mantissa (~4e-3 relative); logits O(0.5) through 2 layers.
    np.testing.assert_allclose(out, ref, rtol=0, atol=5e-2)


@pytest.mark.parametrize("preset, expected", [("llama3-8b", 8_030_261_248),
                                              ("llama2-7b", 6_738_415_616)])
def test_full_size_shapes_without_memory(preset, expected):
    shapes = jax.eval_shape(lambda: jax_llama.init(jax_llama.PRESETS[preset])[1])
    leaves = jax.tree_util.tree_leaves(shapes)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)  # nothing materialised
    assert sum(int(np.prod(leaf.shape)) for leaf in leaves) == expected


@pytest.mark.parametrize("twin", ["jax", "torch"])
@pytest.mark.parametrize("tokens, kw, message", [
    (np.array([[1, 2, 97]]), {}, r"tokens: id 97 is outside the vocabulary \[0, 97\)"),
    (np.array([[-1, 2, 3]]), {}, r"tokens: id -1 is outside the vocabulary"),
    (np.zeros((0, 4), np.int32), {}, r"tokens: empty batch \(shape \(0, 4\)\)"),
    (np.zeros((2, 0), np.int32), {}, r"tokens: empty batch"),
    (np.array([1, 2, 3]), {}, r"tokens: expected shape \(batch, seq_len\)"),
    (np.array([[1.0, 2.0]]), {}, r"tokens: expected integer ids"),
    (np.array([[1, 2]]), {"attention_mask": np.ones((1, 3))}, r"attention_mask: shape \(1, 3\)"),
    (np.array([[1, 2]]), {"positions": np.arange(3)}, r"positions: shape \(3,\)"),
])
def test_bad_inputs_are_refused(twin, tokens, kw, message):
    config = small_config()
    with pytest.raises(BridgeError, match=message):
        if twin == "jax":
            model, params = jax_llama.init(config)
            model.apply({"params": params}, tokens, **kw)
        else:
            torch_model(config)(torch.as_tensor(tokens), **{k: torch.as_tensor(v) for k, v in kw.items()})


def test_torch_init_is_seeded_and_leaves_the_callers_rng_alone():
    config = small_config()
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = (torch_llama.init(config, seed=s) for s in (7, 7, 8))
    assert torch.equal(torch.rand(3), expected_next)  # the global generator did not move
    assert not a.training and a.tok_embeddings.weight.dtype == torch.float32
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(x, y), name
    assert not torch.equal(a.output.weight, c.output.weight)  # another seed, other weights
    assert torch_llama.init(config, dtype="bfloat16").output.weight.dtype == torch.bfloat16
