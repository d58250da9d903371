"""The twins and the attention implementations on an NVIDIA GPU: JAX on CUDA against the torch
twin on CUDA (float32 and bfloat16), cuDNN's fused attention against the xla reference (forward,
gradients, padding, segments), KV-cache decoding against the full forward, and greedy generation
equal across the twins and the CPU. Skipped, with the reason, where JAX or torch sees no GPU;
scripts/gpu_check.sh runs them on one (results/gpu/).

Each comparison states its tolerance and runs a planted bug that must break it, so that a pass
means the check could have failed.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_llama
import torch_llama
from conftest import cached_logits, random_tokens, small_config
from jax_llama.model.attention import AttentionMask, attend
from jax_llama.inference.generate import generate
from llama_twins.parity.planted import torch_bug

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" or not torch.cuda.is_available(),
    reason=f"needs an NVIDIA GPU for both twins (JAX runs on {jax.default_backend()}, "
           f"torch.cuda.is_available() is {torch.cuda.is_available()}); scripts/gpu_check.sh runs "
           f"these on one")


def gpu_config(**changes):
    """head_dim 64 (cuDNN's fused kernels need a multiple of 8), GQA 4 / 2, 2 layers."""
    return small_config(**{**dict(dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=512,
                                  max_seq_len=256), **changes})


def twin_logits(path, tokens, dtype: str, bug: str | None = None) -> np.ndarray:
    tmodel = torch_llama.load(path, device="cuda", dtype=dtype)
    with torch_bug(bug, tmodel) if bug else contextlib.nullcontext():
        with torch.inference_mode():
            return tmodel(torch.as_tensor(tokens, device="cuda")).float().cpu().numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A random model saved once; its JAX float32 logits at full float32 precision (XLA on a GPU
    otherwise runs float32 dots in TF32), the reference of every comparison below."""
    path = tmp_path_factory.mktemp("gpu") / "m"
    config = gpu_config()
    model, params = jax_llama.init(config, seed=0)
    jax_llama.save(path, config, params)
    tokens = random_tokens(config, batch=2, seq_len=96)
    with jax.default_matmul_precision("highest"):
        reference = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
    return path, tokens, reference


def test_the_twins_agree_on_the_gpu_in_float32(saved):
    path, tokens, reference = saved
    # float32 on both sides, TF32 off on both (torch's default; JAX's precision "highest"): the
    # same sums in another order, ~1e-6 on logits O(1). 1e-4 leaves room for cuBLAS choosing other
    # kernels; rotating q and k by the wrong RoPE layout moves logits by 7e-2 here.
    got = twin_logits(path, tokens, "float32")
    print(f"float32: torch twin (cuda) vs JAX (cuda) max |diff| {np.abs(got - reference).max():.3g}")
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-4)
    broken = twin_logits(path, tokens, "float32", bug="qk_permuted_twice")
    assert np.abs(broken - reference).max() > 100 * 1e-4


def test_the_twins_agree_on_the_gpu_in_bfloat16(saved):
    path, tokens, reference = saved
    model, params = jax_llama.load(path, dtype="bfloat16")
    jax_bf16 = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
    torch_bf16 = twin_logits(path, tokens, "bfloat16")
    errors = {"JAX": np.abs(jax_bf16 - reference).max(), "torch": np.abs(torch_bf16 - reference).max(),
              "JAX vs torch": np.abs(jax_bf16 - torch_bf16).max()}
    print("bfloat16 max |diff|:", {k: round(float(v), 4) for k, v in errors.items()})
    # bfloat16 keeps 8 bits of mantissa (~4e-3 relative); logits O(1) through 2 layers: 1.0e-2
    # measured on a CPU for each twin against float32 and for the two against each other; 3e-2
    # leaves 3x room, and the wrong RoPE layout (7e-2 in float32) still fails it.
    for name, error in errors.items():
        assert error < 3e-2, name
    broken = twin_logits(path, tokens, "bfloat16", bug="qk_permuted_twice")
    assert np.abs(broken - reference).max() > 3e-2


# -- cuDNN's fused attention against the xla reference --------------------------------------------

def qkv(B=2, K=2, G=3, S=128, H=64, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((B, K, G, S, H)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.bfloat16))


def padded_segmented(B=2, S=128):
    """Row 1 left-padded over 5 tokens; row 0 two documents of 70 and 58 tokens."""
    valid = np.ones((B, S), bool)
    valid[1, :5] = False
    segments = np.zeros((B, S), np.int32)
    segments[0, 70:] = 1
    return valid, segments


def attention_and_grads(implementation: str, segments_seen: bool = True):
    """Outputs at the real queries, and the gradients of a random projection of them."""
    q, k, v = qkv()
    valid, segments = padded_segmented()
    mask = AttentionMask.causal(q.shape[3], jnp.asarray(valid),
                                jnp.asarray(segments) if segments_seen else None)
    weights = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    rows = jnp.asarray(valid)[:, None, None, :, None]  # padded queries attend to nothing: not read

    def loss(q, k, v):
        out = attend(q, k, v, mask, implementation).astype(jnp.float32)
        return jnp.sum(jnp.where(rows, out * weights, 0.0)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return (np.asarray(out)[np.broadcast_to(np.asarray(rows), out.shape)],
            [np.asarray(g.astype(jnp.float32)) for g in grads])


def test_cudnn_attention_equals_xla_forward_and_gradients_with_padding_and_segments():
    out, grads = attention_and_grads("cudnn")
    ref_out, ref_grads = attention_and_grads("xla")
    # Both accumulate in float32 and round once to bfloat16 (2^-8 relative), in other orders:
    # two bfloat16 steps of each value's own scale, i.e. 1e-2 of the largest value.
    scale = np.abs(ref_out).max()
    print(f"cudnn vs xla: output max |diff| {np.abs(out - ref_out).max():.3g} of {scale:.3g}")
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-2 * scale)
    for name, g, ref in zip("qkv", grads, ref_grads):
        print(f"cudnn vs xla: d{name} max |diff| {np.abs(g - ref).max():.3g} of {np.abs(ref).max():.3g}")
        np.testing.assert_allclose(g, ref, rtol=0, atol=1e-2 * np.abs(ref).max(), err_msg=f"d{name}")
    # The negative case: cuDNN not told the segments lets the second document see the first.
    unsegmented, _ = attention_and_grads("cudnn", segments_seen=False)
    assert np.abs(unsegmented - ref_out).max() > 1e-1 * scale


def test_a_cudnn_model_gives_the_xla_model_logits_with_padding(saved):
    path, tokens, _ = saved
    mask = np.ones_like(tokens)
    mask[1, :7] = 0
    logits = {}
    for implementation in ("xla", "cudnn"):
        model, params = jax_llama.load(path, dtype="bfloat16", attention=implementation)
        logits[implementation] = np.asarray(jax.jit(model.apply)({"params": params}, tokens,
                                                                 attention_mask=mask))
    real = mask.astype(bool)
    diff = np.abs(logits["cudnn"][real] - logits["xla"][real]).max()
    print(f"cudnn vs xla model logits (bfloat16): max |diff| {diff:.3g}")
    assert diff < 5e-2  # the bfloat16 bound above: the two attentions round differently


# -- decoding -----------------------------------------------------------------------------------------

def test_cached_decoding_equals_the_full_forward_on_the_gpu(saved):
    path, tokens, _ = saved
    model, params = jax_llama.load(path, attention="xla")
    mask = np.ones_like(tokens)
    mask[1, :3] = 0
    with jax.default_matmul_precision("highest"):
        full = np.asarray(jax.jit(model.apply)({"params": params}, tokens, attention_mask=mask))
        got = cached_logits(model, params, tokens, mask, prefill=40, cache_len=128)
    real = mask.astype(bool)
    # float32, the same sums over a cache instead of the whole sequence: ~1e-6
    np.testing.assert_allclose(got[real], full[real], rtol=0, atol=1e-4)
    assert np.abs(got[real] - np.roll(full, 1, axis=1)[real]).max() > 1e-2  # a one-off shift fails


def test_greedy_generation_is_the_same_on_gpu_and_cpu_in_both_twins(tmp_path):
    config = gpu_config()
    tmodel = torch_llama.init(config, seed=3)
    with torch.no_grad():  # a sharper head: greedy choices decided by margins far above rounding
        tmodel.output.weight.mul_(8.0)
    torch_llama.save(tmp_path / "m", tmodel)
    prompts = [list(range(1, 40)), [5, 6, 7]]
    with jax.default_matmul_precision("highest"):
        model, params = jax_llama.load(tmp_path / "m")
        on_gpu = generate(model, params, prompts, 24).tokens
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        model, params = jax_llama.load(tmp_path / "m")
        on_cpu = generate(model, params, prompts, 24).tokens
    twin = torch_llama.generate(torch_llama.load(tmp_path / "m", device="cuda"), prompts, 24).tokens
    assert on_gpu == on_cpu == twin
