"""Mistral's sliding window in the JAX twin, against transformers' MistralForCausalLM: the full
forward in each attention implementation, padded and packed rows, generation past the window
with a rolling cache of a fixed size (prefilled in chunks), the decode kernels, a chat that keeps
its cache and the server. Tolerances: float32 throughout, the same operations in another order
(1e-5 of the largest logit); every comparison has a case without the window that fails it."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax_llama  # noqa: E402
from bridge.config import rolling_cache  # noqa: E402
from bridge.errors import BridgeError  # noqa: E402
from jax_llama.inference.generate import ChatSession  # noqa: E402
from jax_llama.inference.serving import Engine, Request  # noqa: E402
from jax_llama.model import attention  # noqa: E402
from jax_llama.model.attention import AttentionMask, attend  # noqa: E402
from jax_llama.model.llama import KVCache  # noqa: E402

W = 4  # the window: rolling_cache gives 7 entries, 4 tokens a call
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-6)
TOKENS = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (2, 14))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(transformers' windowed model, the JAX model and params read from its save_pretrained)."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(**SMALL, sliding_window=W)
    hf = transformers.MistralForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("mistral")
    hf.save_pretrained(path)
    model, params = jax_llama.load(path)
    return hf, model, params


def hf_logits(hf, tokens, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.as_tensor(tokens), **kwargs).logits.float().numpy()


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def far(got, want):
    assert np.abs(np.asarray(got) - want).max() > 1e-3


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_the_full_forward_is_transformers(mistral, implementation):
    hf, model, params = mistral
    assert model.config.sliding_window == W and model.config.deltas == ["sliding_window"]
    want = hf_logits(hf, TOKENS)
    close(model.clone(attention=implementation).apply({"params": params}, TOKENS), want)
    # without the window the same weights part from it at position W
    unwindowed = model.clone(config=model.config.replace(sliding_window=None))
    got = np.asarray(unwindowed.apply({"params": params}, TOKENS))
    close(got[:, :W], want[:, :W])
    far(got[:, W:], want[:, W:])


def test_padded_and_packed_rows_see_what_they_would_alone(mistral):
    hf, model, params = mistral
    apply = lambda tokens, **kw: np.asarray(model.apply({"params": params}, tokens, **kw))
    alone = apply(TOKENS[:1, :11])
    padded = np.concatenate([np.zeros((1, 3), np.int64), TOKENS[:1, :11]], axis=1)
    mask = np.concatenate([np.zeros((1, 3)), np.ones((1, 11))], axis=1).astype(np.int32)
    close(apply(padded, attention_mask=mask)[:, 3:], alone)
    segments = np.array([[0] * 6 + [1] * 8])
    packed = apply(TOKENS[:1], segment_ids=segments)
    close(packed[:, :6], apply(TOKENS[:1, :6]))
    close(packed[:, 6:], apply(TOKENS[:1, 6:]))
    close(packed[:, 6:], hf_logits(hf, TOKENS[:1, 6:]))


def qkv(B=2, K=2, G=2, S=700, H=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (B, K, G, S, H)), jax.random.normal(keys[1], (B, K, S, H)),
            jax.random.normal(keys[2], (B, K, S, H)))


@pytest.mark.parametrize("window", [1, 100, 300])
def test_chunked_skips_blocks_outside_the_window_and_equals_xla(window):
    """700 queries in blocks of 256: the blocks wholly before a query block's window are
    skipped; forward and gradients equal xla's (1e-5, float32 sums in another order), with
    left padding and segments."""
    q, k, v = qkv()
    valid = np.ones((2, 700), bool)
    valid[1, :50] = False
    segments = np.zeros((2, 700), np.int32)
    segments[0, 400:] = 1
    mask = AttentionMask.causal(700, jnp.asarray(valid), jnp.asarray(segments), window)
    loss = lambda impl: lambda q, k, v: jnp.sum(jnp.where(
        jnp.asarray(valid)[:, None, None, :, None], attend(q, k, v, mask, impl), 0) ** 2)
    want, want_grads = jax.value_and_grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.value_and_grad(loss("chunked"), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        # (window 1: a query sees itself alone, and q's gradient is 0 up to rounding)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1.0, float(jnp.abs(b).max())))
    unwindowed = attend(q, k, v, mask.replace(window=None), "chunked")
    far(jnp.where(jnp.asarray(valid)[:, None, None, :, None], unwindowed, 0),
        np.asarray(jnp.where(jnp.asarray(valid)[:, None, None, :, None],
                             attend(q, k, v, mask, "xla"), 0)))


def test_splash_takes_the_window_as_its_local_mask(monkeypatch):
    monkeypatch.setattr(attention, "SPLASH_INTERPRET", True)
    q, k, v = qkv(B=1, S=150)
    mask = AttentionMask.causal(150, window=40)
    close(np.asarray(attend(q, k, v, mask, "splash")), np.asarray(attend(q, k, v, mask, "xla")))


def test_a_rolling_cache_holds_the_window_whatever_the_length(mistral):
    hf, model, params = mistral
    assert rolling_cache(model.config, 64) == (7, 4)
    cache = KVCache.create(model.config, 2, 64, rolling=True)
    assert cache.k.shape[3] == 7 and cache.chunk == 4
    assert KVCache.create(model.config, 2, 64).k.shape[3] == 64  # a plain cache, on request
    pieces = []
    for i in range(0, 14, 3):  # 3 tokens a call: the entries wrap around within a call
        out = model.apply({"params": params}, TOKENS[:, i:i + 3], cache=cache, method="run")
        cache = out.cache
        pieces.append(np.asarray(out.logits))
    close(np.concatenate(pieces, axis=1), hf_logits(hf, TOKENS))
    with pytest.raises(BridgeError, match="tokens"):
        model.apply({"params": params}, TOKENS[:, :5], cache=KVCache.create(
            model.config, 2, 64, rolling=True), method="run")


def hf_greedy(hf, prompt, n):
    """transformers' greedy continuation by its full forward, token by token (no cache). Its
    generate() is compared as well where it agrees with that: transformers 5.x's cached
    generate gives other tokens for a prompt exactly W long (its own forward disagrees)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(hf, np.array([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def hf_generate(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.as_tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("prompt_len", [3, 11])  # within a chunk; prefilled in 3 chunks
@pytest.mark.parametrize("kernels", ["auto", "xla"])
def test_generation_past_the_window_is_transformers(mistral, tmp_path, prompt_len, kernels):
    hf, model, params = mistral
    model = model.clone(projections=model.projections.replace(kernels=kernels))
    prompt = TOKENS[0, :prompt_len].tolist()
    got = jax_llama.generate(model, params, [prompt, TOKENS[1, :5].tolist()], 3 * W).tokens
    assert got[0] == hf_greedy(hf, prompt, 3 * W) == hf_generate(hf, prompt, 3 * W)
    assert got[1] == hf_greedy(hf, TOKENS[1, :5].tolist(), 3 * W)
    # and each token is the argmax of the full forward over everything before it
    whole = np.array([prompt + got[0]])
    argmax = np.asarray(model.apply({"params": params}, whole)).argmax(-1)[0]
    assert argmax[prompt_len - 1:-1].tolist() == got[0]
    unwindowed = model.clone(config=model.config.replace(sliding_window=None))
    assert jax_llama.generate(unwindowed, params, [prompt, TOKENS[1, :5].tolist()],
                              3 * W).tokens != got


def test_a_chat_keeps_its_rolling_cache_and_restarts_past_the_window(mistral):
    hf, model, params = mistral
    chat = ChatSession(model, params, 6)
    first = TOKENS[0, :9].tolist()
    reply = chat.reply(first)
    assert reply == hf_greedy(hf, first, 6)
    second = first + reply + TOKENS[1, :5].tolist()
    assert chat.reply(second) == hf_greedy(hf, second, 6)
    assert chat.reused == len(first) + len(reply) - 1  # all it held
    # a prompt that parts from the conversation 10 ids back: the cache no longer holds the
    # window before that point, so the reply prefills from the start
    third = second[:len(second) - 10] + TOKENS[1, 5:9].tolist()
    assert chat.reply(third) == hf_greedy(hf, third, 6)
    assert chat.reused == 0 and chat.prefilled == len(third)


def test_the_server_decodes_with_the_window(mistral):
    hf, model, params = mistral
    engine = Engine(model, params, max_batch=2)
    heard, done = {0: [], 1: []}, [threading.Event(), threading.Event()]
    prompts = [TOKENS[0, :9].tolist(), TOKENS[1, :4].tolist()]
    try:
        for row, prompt in enumerate(prompts):
            engine.submit(Request(prompt, 3 * W, on_token=lambda t, r=row: heard[r].append(t.id),
                                  on_finish=lambda reason, r=row: done[r].set()))
        assert all(event.wait(120) for event in done)
    finally:
        engine.close()
    for row, prompt in enumerate(prompts):
        assert heard[row] == hf_greedy(hf, prompt, 3 * W)


def test_the_float64_reference_knows_the_window(mistral, tmp_path):
    from bridge.formats import open_checkpoint
    from llama_twins import float64

    hf, model, params = mistral
    hf.save_pretrained(tmp_path)
    checkpoint = open_checkpoint(tmp_path)
    tensors = dict(checkpoint)
    mask = np.ones_like(TOKENS)
    mask[1, :3] = 0  # left padding: its columns are no positions
    got = float64.logits(tensors, checkpoint.config, TOKENS, mask)
    close(got[0], hf_logits(hf, TOKENS[:1])[0])  # transformers in float32
    close(got[1, 3:], hf_logits(hf, TOKENS[1:, 3:])[0])
    unwindowed = float64.logits(tensors, checkpoint.config.replace(sliding_window=None), TOKENS)
    far(unwindowed[:, W:], got[:, W:])


def test_the_window_travels_through_an_hf_export_and_parity(mistral, tmp_path):
    """`convert --to hf` writes sliding_window back (transformers reads the same class with the
    same window and logits); `parity` passes on the windowed checkpoint with transformers as
    its reference; `inspect` names the delta."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bridge = str(Path(sys.executable).with_name("llama-bridge"))
    hf, model, params = mistral
    hf.save_pretrained(tmp_path / "src")
    run = lambda *args: subprocess.run([bridge, *map(str, args)], capture_output=True, text=True)
    result = run("convert", tmp_path / "src", tmp_path / "out", "--to", "hf")
    assert result.returncode == 0, result.stderr
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "MistralForCausalLM" and back.config.sliding_window == W
    close(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
    inspected = json.loads(run("inspect", tmp_path / "out", "--json").stdout)
    assert inspected["family"] == "mistral" and inspected["deltas"] == ["sliding_window"]
    report = run("parity", tmp_path / "src", "--seq-len", 12, "--new-tokens", 3 * W,
                 "--reference", "transformers", "--no-training", "--json")
    assert report.returncode == 0, report.stdout[-2000:] + report.stderr[-2000:]
