"""Attention implementations and segment ids: chunked (flash-style) and the splash TPU kernel (run
through Pallas' interpreter on this CPU) against the xla reference, forward and gradients, with
GQA, left padding, segments and the KV cache; memory that stays
linear in S; packed documents that give what each document gives alone, in both twins; refusals.

Blocks are made small (8 queries x 8 keys) in most tests, so that a 37-token sequence crosses
several blocks, partial blocks and the causal diagonal - the cases a block-boundary bug would hit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_llama
import torch_llama
from bridge.errors import BridgeError
from conftest import ATTENTION_KINDS, cached_logits, random_tokens, small_config, torch_logits
from jax_llama.model import attention
from jax_llama.model.attention import AttentionMask, attend
from jax_llama.inference.generate import generate
from jax_llama.model import KVCache, default_positions


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(attention, "QUERY_BLOCK", 8)
    monkeypatch.setattr(attention, "KEY_BLOCK", 8)


@pytest.fixture(params=["one head at a time", "all heads at once"])
def heads(request, monkeypatch):
    """chunked's two layouts: a loop over (sequence, kv head) pairs, as on a CPU, and every head
    in one batched call, as on an accelerator."""
    monkeypatch.setattr(attention, "PER_HEAD_BACKENDS",
                        ("cpu",) if request.param == "one head at a time" else ())
    return request.param


def qkv(B=2, K=2, G=3, S=37, T=None, H=8, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    T = T or S
    return (jnp.asarray(rng.standard_normal((B, K, G, S, H)), dtype),
            jnp.asarray(rng.standard_normal((B, K, T, H)), dtype),
            jnp.asarray(rng.standard_normal((B, K, T, H)), dtype))


def padded_segmented_mask(B=2, S=37):
    """Row 1 left-padded over 5 tokens; row 0 two segments (documents) of 20 and 17 tokens."""
    valid = np.ones((B, S), bool)
    valid[1, :5] = False
    segments = np.zeros((B, S), np.int32)
    segments[0, 20:] = 1
    return AttentionMask.causal(S, jnp.asarray(valid), jnp.asarray(segments)), valid


# -- chunked against the reference ------------------------------------------------------------------

@pytest.mark.parametrize("dtype, tolerance", [
    # float32: the same sums in another order (blocks, online rescaling): ~1e-7 of values O(1).
    (jnp.float32, 1e-5),
    # bfloat16 inputs, float32 statistics: the probabilities are rounded to bfloat16 before the
    # weighted sum in both (8 bits of mantissa, 4e-3 relative), at different moments.
    (jnp.bfloat16, 3e-2),
])
def test_chunked_equals_xla_forward_and_gradients(small_blocks, heads, dtype, tolerance):
    mask, valid = padded_segmented_mask()
    assert_equals_xla("chunked", *qkv(dtype=dtype), mask, valid, tolerance)


def test_chunked_backward_on_blocks_wider_than_the_forwards(small_blocks, heads):
    """48 causal tokens: the forward works on 6 x 6 blocks of 8, the backward on 3 x 3 blocks of
    16 (BACKWARD_WIDEN), with wholly visible key blocks in both. The gradients need no block of
    the forward's, only its log-sum-exp per query; float32 tolerance as above."""
    assert attention._widened(8, 48) == 16 and attention._widened(8, 40) == 8
    q, k, v = qkv(S=48)
    assert_equals_xla("chunked", q, k, v, AttentionMask.causal(48), np.ones((2, 48), bool), 1e-5)


def assert_equals_xla(implementation, q, k, v, mask, valid, tolerance):
    """attend(implementation) against xla over the real queries (a query that sees no key is
    never read): the output within `tolerance`, the gradients of q, k and v of a random weighting
    of it within `tolerance` x their scale."""
    real = jnp.asarray(valid)[:, None, None, :, None]
    weights = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32) * real

    def loss(implementation):
        return lambda q, k, v: jnp.sum(attend(q, k, v, mask, implementation).astype(jnp.float32)
                                       * weights)
    ref, got = attend(q, k, v, mask, "xla"), attend(q, k, v, mask, implementation)
    assert got.dtype == q.dtype
    np.testing.assert_allclose(np.where(real, got.astype(jnp.float32), 0),
                               np.where(real, ref.astype(jnp.float32), 0), rtol=0, atol=tolerance)
    grads_ref = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    grads = jax.grad(loss(implementation), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", grads, grads_ref):
        scale = float(jnp.abs(b.astype(jnp.float32)).max())
        np.testing.assert_allclose(a.astype(jnp.float32), b.astype(jnp.float32), rtol=0,
                                   atol=tolerance * scale, err_msg=name)
    return ref


def test_a_wrong_block_mask_is_caught(small_blocks, monkeypatch):
    """The comparison above can fail: a chunked path that forgets the segments differs."""
    q, k, v = qkv()
    mask, valid = padded_segmented_mask()
    real = np.asarray(valid)[:, None, None, :, None]
    ref = attend(q, k, v, mask, "xla")
    no_segments = mask.replace(q_segments=None, k_segments=None)
    wrong = attend(q, k, v, no_segments, "chunked")
    assert np.abs(np.where(real, wrong - ref, 0)).max() > 0.1


def assert_models_agree(config, implementation):
    """A model with `implementation` against xla, same weights, 2 x 37 tokens with row 1
    left-padded over 6: logits over the real tokens and every parameter's gradient of the masked
    loss within 1e-5 (of the gradients' scale), float32 sums in another order. Returns (xla
    model, the other, params, tokens)."""
    from jax_llama.training.step import loss_fn
    tokens = random_tokens(config, batch=2, seq_len=37)
    mask = np.ones_like(tokens)
    mask[1, :6] = 0
    model, params = jax_llama.init(config, seed=3, attention="xla")
    other = jax_llama.Llama(config, attention=implementation)
    real = mask.astype(bool)
    np.testing.assert_allclose(
        np.asarray(other.apply({"params": params}, tokens, attention_mask=mask))[real],
        np.asarray(model.apply({"params": params}, tokens, attention_mask=mask))[real],
        rtol=0, atol=1e-5)
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, 1), "mask": mask.astype(np.float32)}
    grad = jax.jit(jax.grad(loss_fn), static_argnums=1)
    g_ref, g = grad(params, model, batch), grad(params, other, batch)
    scale = max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(g_ref))
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale)
    return model, other, params, tokens


# -- splash: the TPU kernel, run here through Pallas' interpreter -----------------------------------

@pytest.fixture
def splash_interpreted(monkeypatch):
    monkeypatch.setattr(attention, "SPLASH_INTERPRET", True)


@pytest.mark.parametrize("dtype, tolerance", [
    # float32: the kernel's own blocks and online softmax, the same sums in another order.
    (jnp.float32, 1e-5),
    # bfloat16: probabilities rounded to 8 bits before the weighted sum, at different moments.
    (jnp.bfloat16, 3e-2),
])
def test_splash_equals_xla_forward_and_gradients(splash_interpreted, dtype, tolerance):
    """150 tokens (padded to 256: two 128 blocks and a partial one), GQA, row 1 left-padded over
    40 tokens, two documents in each row (padding and segments become splash's segment ids)."""
    B, S = 2, 150
    q, k, v = qkv(B=B, K=2, G=2, S=S, H=16, dtype=dtype)
    valid = np.ones((B, S), bool)
    valid[1, :40] = False
    segments = np.zeros((B, S), np.int32)
    segments[0, 70:], segments[1, 100:] = 1, 5
    mask = AttentionMask.causal(S, jnp.asarray(valid), jnp.asarray(segments))
    ref = assert_equals_xla("splash", q, k, v, mask, valid, tolerance)
    # The comparison can fail: the same kernel without the segments differs by far more.
    no_segments = mask.replace(q_segments=None, k_segments=None)
    wrong = attend(q, k, v, no_segments, "splash")
    real = np.asarray(valid)[:, None, None, :, None]
    assert np.abs(np.where(real, wrong.astype(jnp.float32) - ref.astype(jnp.float32), 0)).max() > 0.1


def test_a_splash_model_trains_and_decodes_like_xla(splash_interpreted):
    """A whole GQA model: logits with left padding and every gradient equal xla's (1e-5,
    float32 reordering); cached decoding, which splash's static mask cannot follow, takes auto's
    choice and gives the same greedy tokens."""
    model, splash, params, tokens = assert_models_agree(small_config(), "splash")
    prompts = [tokens[0, :9].tolist(), tokens[1, :4].tolist()]
    assert (generate(splash, params, prompts, 6).tokens
            == generate(model, params, prompts, 6).tokens)


def test_auto_picks_splash_on_a_tpu_only_where_it_fits(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert attention.choose("auto", 1024, 1024, head_dim=128) == "splash"
    assert attention.choose("auto", 1024, 1024, head_dim=64) == "chunked"  # not a multiple of 128
    assert attention.choose("auto", 1024, 1024, self_attention=False, head_dim=128) == "chunked"
    assert attention.choose("auto", 64, 64, head_dim=128) == "xla"  # small scores
    assert attention.choose("splash", 1, 1024, self_attention=False) == "xla"  # a decode step
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert attention.choose("auto", 1024, 1024, head_dim=128) == "chunked"


def test_auto_picks_cudnn_on_a_gpu_only_for_half_precision_self_attention(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert attention.choose("auto", 2048, 2048, head_dim=64, dtype=jnp.bfloat16) == "cudnn"
    assert attention.choose("auto", 2048, 2048, head_dim=128, dtype="float16") == "cudnn"
    assert attention.choose("auto", 2048, 2048, head_dim=64, dtype=jnp.float32) == "chunked"
    assert attention.choose("auto", 2048, 2048, head_dim=64) == "chunked"  # dtype unknown
    assert attention.choose("auto", 2048, 2048, head_dim=256, dtype=jnp.bfloat16) == "chunked"
    assert attention.choose("auto", 1024, 2048, False, 64, jnp.bfloat16) == "chunked"  # a cache
    assert attention.choose("auto", 64, 64, head_dim=64, dtype=jnp.bfloat16) == "xla"  # small


# GQA by default; MHA and MQA (the same code with G = 1 and G = N) under -m slow
@pytest.mark.parametrize("kind", [pytest.param(k, marks=[] if k == "gqa" else pytest.mark.slow)
                                  for k in ATTENTION_KINDS])
def test_models_agree_across_implementations_with_padding(small_blocks, kind):
    assert_models_agree(small_config(n_kv_heads=ATTENTION_KINDS[kind]), "chunked")


# xla's cache path is also what every generation test runs; chunked's is checked here by default
@pytest.mark.parametrize("implementation", [pytest.param("xla", marks=pytest.mark.slow), "chunked"])
def test_cached_decoding_equals_the_full_forward(small_blocks, implementation):
    config = small_config()
    model, params = jax_llama.init(config, seed=2, attention=implementation)
    tokens = random_tokens(config, batch=2, seq_len=30)
    mask = np.ones_like(tokens)
    mask[1, :3] = 0
    full = np.asarray(model.apply({"params": params}, tokens, attention_mask=mask))
    got = cached_logits(model, params, tokens, mask, prefill=19, cache_len=40)  # 3 blocks, then 1
    np.testing.assert_allclose(got[mask.astype(bool)], full[mask.astype(bool)], rtol=0, atol=1e-5)


def test_generation_is_the_same_with_either_implementation(small_blocks):
    config = small_config(vocab_size=97, max_seq_len=64)
    model, params = jax_llama.init(config, seed=4, attention="xla")
    chunked = jax_llama.Llama(config, attention="chunked")
    prompts = [list(range(1, 30)), [5, 6, 7]]
    assert generate(chunked, params, prompts, 12).tokens == generate(model, params, prompts, 12).tokens


# -- memory -------------------------------------------------------------------------------------

def compiled_temp_bytes(implementation: str, S: int) -> int:
    """Scratch memory XLA plans for the forward and backward of one attention call."""
    q = jax.ShapeDtypeStruct((1, 2, 2, S, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 2, S, 16), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, AttentionMask.causal(S), implementation) ** 2)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_memory_stays_linear_in_the_sequence():
    """From S = 1024 to 8192 (8x): the materialised scores grow 64x; chunked's scratch grows
    less than S does (8.3 to 21 MB, 2.5x, one head at a time): blocks of a fixed size, and
    arrays of S positions (the log-sum-exp, a head's keys' gradients, the results)."""
    xla = [compiled_temp_bytes("xla", S) for S in (1024, 8192)]
    chunked = [compiled_temp_bytes("chunked", S) for S in (1024, 8192)]
    assert xla[1] / xla[0] > 30
    assert chunked[1] / chunked[0] < 4
    assert chunked[1] < xla[1] / 50


# -- segments: packed documents ------------------------------------------------------------------

def packed_row(config, lengths=(5, 9, 3), pad=2, seed=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, config.vocab_size, n).tolist() for n in lengths]
    row = sum(docs, [])
    tokens = np.array([row + [0] * pad], np.int32)
    segments = np.array([sum([[i] * len(d) for i, d in enumerate(docs)], []) + [len(docs)] * pad],
                        np.int32)
    mask = np.array([[1] * len(row) + [0] * pad], np.int32)
    return docs, tokens, segments, mask


def test_positions_restart_at_each_segment_and_skip_padding():
    valid = np.array([[0, 1, 1, 1, 1, 1, 1, 0]], bool)
    segments = np.array([[0, 0, 0, 1, 1, 2, 2, 2]])
    expected = [[0, 0, 1, 0, 1, 0, 1, 1]]
    assert np.asarray(default_positions(valid, segments)).tolist() == expected
    assert torch_llama.model.default_positions(torch.as_tensor(valid),
                                               torch.as_tensor(segments)).tolist() == expected


# chunked by default (the implementation long packed rows use); xla, the reference, under -m slow
@pytest.mark.parametrize("implementation", [pytest.param("xla", marks=pytest.mark.slow), "chunked"])
def test_packed_documents_give_what_each_gives_alone_in_both_twins(small_blocks, implementation,
                                                                  tmp_path):
    """Per-document logits, losses and gradients of a packed row equal those of each document run
    alone (float32: the same sums in another order, ~1e-7)."""
    config = small_config()
    model, params = jax_llama.init(config, seed=5, attention=implementation)
    docs, tokens, segments, mask = packed_row(config)
    packed = np.asarray(model.apply({"params": params}, tokens, attention_mask=mask,
                                    segment_ids=segments))
    jax_llama.save(tmp_path / "m", config, params)
    tmodel = torch_llama.load(tmp_path / "m", device="cpu")
    torch_packed = torch_logits(tmodel, tokens, attention_mask=mask, segment_ids=segments)
    start = 0
    for doc in docs:
        alone = np.asarray(model.apply({"params": params}, np.array([doc], np.int32)))[0]
        np.testing.assert_allclose(packed[0, start:start + len(doc)], alone, rtol=0, atol=1e-5)
        np.testing.assert_allclose(torch_packed[0, start:start + len(doc)], alone, rtol=0, atol=1e-5)
        start += len(doc)
    # Without segment ids the second document attends to the first: the check can fail.
    plain = np.asarray(model.apply({"params": params}, tokens, attention_mask=mask))
    assert np.abs(plain[0, 5:14] - packed[0, 5:14]).max() > 1e-2

    # Gradients: the packed row's loss (no target across a boundary) is the sum of the
    # documents' own losses, so its gradient is the sum of theirs.
    from jax_llama.training.step import loss_fn

    def doc_batch(ids):
        ids = np.array([ids], np.int32)
        return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": np.ones((1, ids.shape[1] - 1))}
    boundary = np.diff(segments[0]) == 0                     # target in the same document
    packed_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                    "mask": (boundary & mask[0, 1:].astype(bool))[None].astype(np.float32),
                    "segment_ids": segments[:, :-1], "attention_mask": mask[:, :-1]}
    n_targets = [len(d) - 1 for d in docs]

    def packed_loss(p):
        logits = model.apply({"params": p}, packed_batch["inputs"],
                             attention_mask=packed_batch["attention_mask"],
                             segment_ids=packed_batch["segment_ids"])
        logp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(logp, packed_batch["targets"][..., None], -1)[..., 0]
        return jnp.sum(nll * packed_batch["mask"])
    expected = jax.jit(jax.grad(lambda p: sum(loss_fn(p, model, doc_batch(d)) * n
                                              for d, n in zip(docs, n_targets))))(params)
    got = jax.jit(jax.grad(packed_loss))(params)
    scale = max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(expected))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale)


# -- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("twin", ["jax", "torch"])
@pytest.mark.parametrize("segments, message", [
    (np.zeros((1, 3), np.int32), r"segment_ids: shape \(1, 3\) does not match tokens \(1, 4\)"),
    (np.zeros((1, 4), np.float32), "segment_ids: expected integer segment ids"),
])
def test_bad_segment_ids_are_refused(twin, segments, message):
    config = small_config()
    tokens = np.array([[1, 2, 3, 4]])
    with pytest.raises(BridgeError, match=message):
        if twin == "jax":
            model, params = jax_llama.init(config)
            model.apply({"params": params}, tokens, segment_ids=segments)
        else:
            torch_llama.init(config)(torch.as_tensor(tokens), segment_ids=torch.as_tensor(segments))


def test_segments_with_a_cache_and_unknown_implementations_are_refused():
    config = small_config()
    model, params = jax_llama.init(config)
    too_long = np.ones((1, config.max_seq_len + 1), np.int32)
    with pytest.raises(BridgeError, match="tokens: 65 tokens in a row, more than max_seq_len 64"):
        model.apply({"params": params}, too_long)
    with pytest.raises(BridgeError, match="tokens: 65 tokens in a row, more than max_seq_len 64"):
        torch_llama.init(config)(torch.as_tensor(too_long))
    with pytest.raises(BridgeError, match="segment_ids: not with a KV cache"):
        model.apply({"params": params}, np.array([[1, 2]]), segment_ids=np.array([[0, 0]]),
                    cache=KVCache.create(config, 1, 8), method="run")
    with pytest.raises(BridgeError,
                       match="attention: expected one of xla, chunked, cudnn, splash, auto"):
        jax_llama.init(config, attention="flash")
    if jax.default_backend() != "gpu":
        with pytest.raises(BridgeError, match="attention: cudnn needs an NVIDIA GPU"):
            jax_llama.init(config, attention="cudnn")
    if jax.default_backend() != "tpu":
        with pytest.raises(BridgeError, match="attention: splash needs a TPU; this JAX runs on"):
            jax_llama.init(config, attention="splash")


def test_a_prompt_of_thousands_of_tokens_generates_the_same_in_both_twins(tmp_path):
    """A 2,500-token prompt: JAX's auto picks chunked for the prefill (2,560 x 2,576 scores per
    head), torch runs SDPA over the cache; greedy tokens agree."""
    config = jax_llama.PRESETS["tiny"].replace(max_seq_len=4096)
    model, params = jax_llama.init(config, seed=0)
    assert attention.choose("auto", 2560, 2576) == "chunked"
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, 2500).tolist()
    jax_llama.save(tmp_path / "m", config, params)
    tmodel = torch_llama.load(tmp_path / "m", device="cpu")
    expected = torch_llama.generate(tmodel, [prompt], 8).tokens
    assert generate(model, params, [prompt], 8).tokens == expected


def test_long_bench_skips_what_would_not_fit_and_tabulates(tmp_path, monkeypatch):
    """The long-context section without running it: points whose materialised scores exceed the
    budget are skipped with the reason, the rest become rows, and the plot is written."""
    from llama_twins.bench import long
    from llama_twins.bench.common import CONFIG, Spec

    spec = Spec(config=CONFIG.replace(max_seq_len=16384), batch=1, seq_len=16384)
    assert long.scores_bytes(spec, "jax-llama chunked") == 0
    assert long.scores_bytes(spec, "transformers eager") == 2 * 4 * 8 * 1 * 8 * 16384 ** 2  # 128 GiB
    calls = []

    def fake_spawn(job, spec, extra=()):
        calls.append((extra[1], spec.seq_len))
        return {"runs_s": [1.0, 2.0, 3.0], "peak_rss_bytes": 2**30 * spec.seq_len / 512}
    monkeypatch.setattr(long, "spawn", fake_spawn)
    monkeypatch.setattr(long, "budget_bytes", lambda: 2 * 4 * 8 * 8 * 1024 ** 2)  # fits up to S 1024
    result = long.run(seq_lens=(512, 2048), tokens=2048)
    assert ("jax-llama xla", 2048) not in calls and ("jax-llama chunked", 2048) in calls
    assert result["rows"]["jax-llama xla"]["2048"]["skipped"].startswith("its scores need")
    sdpa = result["rows"]["transformers sdpa"]["512"]
    assert sdpa["tokens_per_s"] == 2048 / 2.0 and sdpa["vs_sdpa"] == 1.0
    table = "\n".join(long.markdown(result))
    assert "| jax-llama xla | 1,024 tok/s (1.00x sdpa), 1.0 GiB | not run: its scores need" in table
    assert long.plot(result, tmp_path / "long.png") and (tmp_path / "long.png").stat().st_size > 0


def test_packed_gradients_equal_the_documents_alone_in_the_torch_twin():
    """The torch side of the packing check: the packed row's summed loss has the gradient of the
    documents' own summed losses (float32, ~1e-7 of the scale)."""
    config = small_config()
    docs, tokens, segments, mask = packed_row(config, seed=3)
    model = torch_llama.init(config, seed=1).train()
    t = torch.as_tensor(tokens, dtype=torch.long)
    logits = model(t[:, :-1], attention_mask=torch.as_tensor(mask[:, :-1]),
                   segment_ids=torch.as_tensor(segments[:, :-1]))
    same = torch.as_tensor((np.diff(segments[0]) == 0) & mask[0, 1:].astype(bool))
    nll = torch.nn.functional.cross_entropy(logits[0], t[0, 1:], reduction="none")
    (nll * same).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for doc in docs:
        d = torch.as_tensor([doc])
        torch.nn.functional.cross_entropy(model(d[:, :-1])[0], d[0, 1:], reduction="sum").backward()
    scale = max(float(p.grad.abs().max()) for p in model.parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=0, atol=1e-5 * scale, msg=name)
