"""Mistral's sliding window in the torch twin: the full forward, padding, packed segments, cached
greedy generation (a rolling cache of W + chunk - 1 entries, prefilled in chunks) and a chat kept
across replies, each against transformers' MistralForCausalLM or the model's own full forward."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch_llama  # noqa: E402
from bridge.config import rolling_cache  # noqa: E402
from bridge.errors import BridgeError  # noqa: E402
from bridge.sampling import Sampler  # noqa: E402
from torch_llama.attention import AttentionMask  # noqa: E402
from torch_llama.generate import ChatSession, generate  # noqa: E402
from torch_llama.model import KVCache  # noqa: E402

W = 4  # the window; sequences run 3W and more, so that every query past W loses keys
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-6)
GREEDY = Sampler(temperature=0.0)
TOKENS = np.random.default_rng(1).integers(0, SMALL["vocab_size"], (2, 3 * W))


def _hf_model(window):
    torch.manual_seed(0)
    # eager: transformers' own softmax(QK^T + mask) V, whose window mask is the reference
    config = transformers.MistralConfig(**SMALL, sliding_window=window,
                                        attn_implementation="eager")
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():  # sharp attention (init's std 0.02 gives near-uniform weights), so
        for name, p in model.named_parameters():  # that a wrong or missing key shows
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(transformers' MistralForCausalLM with window W, the torch twin loaded from its save)."""
    hf = _hf_model(W)
    path = tmp_path_factory.mktemp("mistral") / "hf"
    hf.save_pretrained(path)
    model = torch_llama.load(path, device="cpu")
    assert model.config.sliding_window == W
    return hf, model


def _logits(model, tokens, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens), **kwargs).numpy()


def _close(got, want):
    # float32 on both sides and the same operations in the same order up to the summation order
    # inside the matmuls and softmax: agreement to float32 rounding, relative to the logits' size.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_the_mask_is_a_band_of_width_w():
    allowed = AttentionMask.causal(5, window=2).dense(5)[0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0],
                       [0, 0, 0, 1, 1]]
    # a rolling cache's entries hold slots out of order: entry t holds k_slots[t]
    ring = AttentionMask(q_slots=torch.tensor([5, 6]), k_slots=torch.tensor([4, 5, 6, -1]),
                         valid=torch.tensor([[True, True, True, False]]), window=2)
    assert ring.dense(4)[0].int().tolist() == [[1, 1, 0, 0], [0, 1, 1, 0]]


def test_full_forward_equals_transformers(mistral):
    hf, model = mistral
    with torch.no_grad():
        want = hf(torch.as_tensor(TOKENS)).logits.numpy()
    _close(_logits(model, TOKENS), want)
    # Negative case: the same weights without the window agree up to position W - 1 (every key
    # is within the window there) and differ from position W on.
    full = torch_llama.Llama(model.config.replace(sliding_window=None)).eval()
    full.load_state_dict(model.state_dict())
    got = _logits(full, TOKENS)
    _close(got[:, :W], want[:, :W])
    assert (np.abs(got[:, W:] - want[:, W:]).max(axis=-1) > 1e-3 * np.abs(want).max()).all()


def test_left_padded_rows_equal_each_row_alone(mistral):
    _, model = mistral
    short = TOKENS[1, :7]
    pad = TOKENS.shape[1] - len(short)
    batch = np.stack([TOKENS[0], np.concatenate([np.zeros(pad, TOKENS.dtype), short])])
    mask = np.stack([np.ones(TOKENS.shape[1], bool), np.arange(TOKENS.shape[1]) >= pad])
    got = _logits(model, batch, attention_mask=torch.as_tensor(mask))
    _close(got[0], _logits(model, TOKENS[:1])[0])
    _close(got[1, pad:], _logits(model, short[None])[0])


def test_packed_documents_equal_each_document_alone(mistral):
    _, model = mistral
    first, second = TOKENS[0, :9], TOKENS[1, :2 * W + 1]
    row = np.concatenate([first, second])[None]
    segments = np.repeat([[0, 1]], [len(first), len(second)], axis=1)
    got = _logits(model, row, segment_ids=torch.as_tensor(segments))
    _close(got[0, :len(first)], _logits(model, first[None])[0])
    _close(got[0, len(first):], _logits(model, second[None])[0])


@pytest.fixture
def created(monkeypatch):
    """The caches generate and ChatSession create, in order."""
    caches, create = [], KVCache.create.__func__

    def recording(cls, *args, **kwargs):
        caches.append(create(cls, *args, **kwargs))
        return caches[-1]
    monkeypatch.setattr(KVCache, "create", classmethod(recording))
    return caches


@pytest.mark.parametrize("prompt_length", [3, 10])  # shorter than W; longer than the chunk W
def test_greedy_generation_past_the_window_equals_transformers(mistral, created, prompt_length):
    hf, model = mistral
    prompt = TOKENS[0, :prompt_length].tolist()
    new = 3 * W
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                           min_new_tokens=new)[0, prompt_length:].tolist()
    got = generate(model, [prompt], new, GREEDY).tokens[0]
    assert got == want
    # the full forward over the whole sequence predicts each generated token
    full = _logits(model, [prompt + got])[0]
    assert full[prompt_length - 1:-1].argmax(-1).tolist() == got
    # a rolling cache of W + chunk - 1 entries, whatever the number of new tokens
    slots, chunk = rolling_cache(model.config, prompt_length + new)
    assert (slots, chunk) == (2 * W - 1, W)
    assert created[0].chunk == chunk and created[0].k.shape[3] == slots
    generate(model, [prompt], 4 * new, GREEDY)
    assert created[1].k.shape[3] == slots


def test_left_padded_generation_equals_each_prompt_alone(mistral):
    _, model = mistral
    prompts = [TOKENS[0, :10].tolist(), TOKENS[1, :3].tolist()]
    together = generate(model, prompts, 3 * W, GREEDY).tokens
    assert together == [generate(model, [p], 3 * W, GREEDY).tokens[0] for p in prompts]


def _check_cache(chat, model):
    """Every key the chat's cache holds equals that of one plain-cache prefill of the ids it
    holds: each entry holds the slot it says, and the ring the last T slots, none lost."""
    cache = chat.cache
    fresh = KVCache.create(model.config, 1, len(chat.cached), rolling=False)
    with torch.no_grad():
        model.run(torch.tensor([chat.cached]), cache=fresh)
    assert cache.index == len(chat.cached)
    held = range(cache.length) if cache.slots is None else cache.slots.tolist()
    entries = [e for e, slot in enumerate(held) if cache.valid[0, e] and slot >= 0]
    slots = [held[e] for e in entries]
    assert slots and set(slots) == set(range(max(0, cache.index - cache.length), cache.index))
    want = fresh.k[:, 0, :, slots].numpy()
    _close(cache.k[:, 0, :, entries].numpy(), want)


def test_chat_turns_equal_generating_from_the_whole_conversation(mistral):
    _, model = mistral
    chat = ChatSession(model, max_new_tokens=3, sampler=GREEDY)
    ids = TOKENS[0, :3].tolist()
    reply = chat.reply(ids)
    assert reply == generate(model, [ids], 3, GREEDY).tokens[0]
    assert chat.cache.length == 2 * W - 1  # one rolling cache of a fixed size, from the start
    _check_cache(chat, model)
    # a longer conversation: the same cache, past its length
    ids = ids + reply + TOKENS[1, :4].tolist()
    cache = chat.cache
    reply = chat.reply(ids)
    assert reply == generate(model, [ids], 3, GREEDY).tokens[0]
    assert chat.cache is cache and chat.reused == 5 and chat.cache.index > chat.cache.length
    _check_cache(chat, model)
    # the ring still holds the W - 1 slots before the cut: cut back, only the new ids prefilled
    ids = ids + reply + TOKENS[1, 4:6].tolist()
    reply = chat.reply(ids)
    assert reply == generate(model, [ids], 3, GREEDY).tokens[0]
    assert chat.reused == len(ids) - 3 and chat.prefilled == 3
    _check_cache(chat, model)
    # an edit near the start: the ring has overwritten those slots, so it prefills from scratch
    ids = ids[:2] + [(ids[2] + 1) % SMALL["vocab_size"]] + ids[3:]
    reply = chat.reply(ids)
    assert reply == generate(model, [ids], 3, GREEDY).tokens[0]
    assert chat.reused == 0 and chat.prefilled == len(ids)
    _check_cache(chat, model)


def test_a_rolling_cache_refuses_more_than_a_chunk_at_once(mistral):
    _, model = mistral
    cache = KVCache.create(model.config, 1, 64, rolling=True)
    assert (cache.length, cache.chunk) == (2 * W - 1, W)
    with pytest.raises(BridgeError, match="tokens") as refused:
        cache.reserve(torch.ones(1, W + 1, dtype=torch.bool))
    assert refused.value.field == "tokens" and cache.index == 0
    cache.reserve(torch.ones(1, W, dtype=torch.bool))  # a chunk fits
    assert cache.index == W and cache.slots.tolist() == [0, 1, 2, 3, -1, -1, -1]
    plain = KVCache.create(model.config, 1, 64)  # rolling is asked for, not the default
    assert (plain.length, plain.chunk) == (64, None)
