"""torch_llama generation: the KV cache against the plain forward, batching with left padding
against one prompt at a time, the samplers on hand-made distributions, stop tokens, refusals."""

import numpy as np
import pytest
import torch

from bridge.errors import BridgeError
from conftest import ATTENTION_KINDS, small_config, torch_model
from torch_llama.generate import Generation, Sampler, filter_logits, generate, sample, top_p_mask
from torch_llama.model import KVCache

# The cache changes only the order of float32 sums (attention over T slots, masked ones
# contributing exactly 0, instead of S keys): logits O(0.5) agree to ~1e-7, so 1e-5 is tight.
ATOL = 1e-5


def full_logits(model, tokens) -> torch.Tensor:
    """No-cache logits (S, V) of one sequence."""
    with torch.inference_mode():
        return model(torch.as_tensor([tokens]))[0]


def tokens_of(config, n, seed):
    return np.random.default_rng(seed).integers(1, config.vocab_size, n).tolist()


# -- the cache against the plain forward -----------------------------------------------------------

@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_cached_decoding_matches_the_full_forward(kind):
    config = small_config(n_kv_heads=ATTENTION_KINDS[kind])
    model = torch_model(config)
    seq = tokens_of(config, 11, seed=1)
    expected = full_logits(model, seq)
    assert 0.1 < expected.abs().max() < 10  # the scale ATOL is judged against

    with torch.inference_mode():
        cache = KVCache.create(config, 1, 16, torch.float32, "cpu")  # longer than needed: T > S
        out = model.run(torch.as_tensor([seq[:5]]), cache=cache)
        torch.testing.assert_close(out.logits[0], expected[:5], rtol=0, atol=ATOL)
        for i in range(5, 11):
            out = model.run(torch.as_tensor([[seq[i]]]), cache=out.cache)
            torch.testing.assert_close(out.logits[0, 0], expected[i], rtol=0, atol=ATOL)
    cache = out.cache
    assert cache.index == 11 and cache.positions.tolist() == [11]
    assert cache.valid[0].tolist() == [True] * 11 + [False] * 5


def test_cached_decoding_of_a_left_padded_batch_matches_the_unpadded_rows():
    config = small_config()
    model = torch_model(config)
    short, long = tokens_of(config, 4, seed=2), tokens_of(config, 7, seed=3)
    extra = tokens_of(config, 5, seed=4)  # fed to both rows, one token per step
    tokens = torch.as_tensor([[0] * 3 + short, long])
    mask = torch.as_tensor([[0] * 3 + [1] * 4, [1] * 7])

    def decode(attention_mask):
        with torch.inference_mode():
            cache = KVCache.create(config, 2, 12, torch.float32, "cpu")
            out = model.run(tokens, attention_mask=attention_mask, cache=cache)
            steps = [out.logits[:, -1]]
            for t in extra:
                out = model.run(torch.as_tensor([[t], [t]]), cache=cache)
                steps.append(out.logits[:, 0])
        return torch.stack(steps, dim=1), cache  # (B, 6, V)

    got, cache = decode(mask)
    for row, prompt in enumerate([short, long]):
        expected = full_logits(model, prompt + extra)[len(prompt) - 1:]
        torch.testing.assert_close(got[row], expected, rtol=0, atol=ATOL)
    assert cache.positions.tolist() == [4 + 5, 7 + 5]  # padding takes no position

    # A test that can fail: without the mask the short row attends to its padding.
    unmasked, _ = decode(None)
    assert (unmasked[0] - got[0]).abs().max() > 1e-3
    torch.testing.assert_close(unmasked[1], got[1], rtol=0, atol=ATOL)


def test_cache_returns_hidden_and_refuses_to_overflow():
    config = small_config()
    model = torch_model(config)
    with torch.inference_mode():
        cache = KVCache.create(config, 1, 6, torch.float32, "cpu")
        out = model.run(torch.as_tensor([[1, 2, 3, 4]]), cache=cache)
        assert out.logits.shape == (1, 4, 97) and out.hidden.shape == (1, 4, 48)
        assert out.cache is cache and cache.index == 4  # advanced in place
        with pytest.raises(BridgeError, match=r"cache: 3 tokens at slot 4 .* cache length 6"):
            model.run(torch.as_tensor([[5, 6, 7]]), cache=cache)
        with pytest.raises(BridgeError, match=r"cache: batch 1 does not match tokens 2"):
            model.run(torch.as_tensor([[5], [6]]), cache=cache)


# -- generate --------------------------------------------------------------------------------------

def greedy_without_cache(model, prompt, n):
    """The textbook loop: rerun the whole sequence each step, take the argmax."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(full_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


def test_greedy_generation_of_a_padded_batch_equals_each_prompt_alone():
    config = small_config()
    model = torch_model(config, head_scale=20.0)
    prompts = [tokens_of(config, n, seed=n) for n in (3, 7, 5)]
    batch = generate(model, prompts, max_new_tokens=8)
    for row, prompt in enumerate(prompts):
        alone = generate(model, [prompt], max_new_tokens=8)
        assert batch.tokens[row] == alone.tokens[0] == greedy_without_cache(model, prompt, 8)
        np.testing.assert_allclose(batch.logprobs[row], alone.logprobs[0], rtol=0, atol=ATOL)
    assert all(len(t) == 8 for t in batch.tokens)


def test_stop_token_ends_one_row_while_the_others_continue():
    config = small_config()
    model = torch_model(config, head_scale=20.0)
    prompts = [tokens_of(config, 4, seed=10), tokens_of(config, 6, seed=11)]
    free = generate(model, prompts, max_new_tokens=8).tokens
    # Row 0's third token, chosen so that it ends row 0 there and never appears in row 1.
    stop_at = next(i for i in range(2, 8) if free[0][i] not in free[0][:i] + free[1])
    stop_id = free[0][stop_at]

    streamed = []
    out = generate(model, prompts, max_new_tokens=8, stop_ids=[stop_id],
                   on_token=lambda row, tok: streamed.append((row, tok)))
    assert out.tokens[0] == free[0][:stop_at + 1] and out.tokens[0][-1] == stop_id
    assert out.tokens[1] == free[1]
    for row in (0, 1):
        assert [t for r, t in streamed if r == row] == out.tokens[row]
        # Logprobs are of the raw distribution: log_softmax of the no-cache logits.
        prompt, new = prompts[row], out.tokens[row]
        logp = full_logits(model, prompt + new).log_softmax(-1)[len(prompt) - 1:-1]
        expected = logp.gather(-1, torch.as_tensor(new)[:, None])[:, 0]
        np.testing.assert_allclose(out.logprobs[row], expected.numpy(), rtol=0, atol=ATOL)

    calls = []
    model.norm.register_forward_hook(lambda *_: calls.append(1))  # once per forward pass
    both = generate(model, prompts, max_new_tokens=8, stop_ids=[stop_id, free[1][0]])
    assert both.tokens[1] == free[1][:1]
    # Every row done: the loop stops; one prefill plus a decode per further token of the longest.
    assert len(calls) == max(len(t) for t in both.tokens) < 8


def test_top_k_one_is_greedy_and_seeds_are_reproducible():
    config = small_config()
    model = torch_model(config)  # random init: near-uniform logits, so samples vary with the seed
    prompts = [tokens_of(config, 5, seed=20), tokens_of(config, 3, seed=21)]
    greedy = generate(model, prompts, max_new_tokens=10)
    assert generate(model, prompts, 10, Sampler(temperature=1.0, top_k=1), seed=3) == greedy

    hot = Sampler(temperature=1.0)
    first = generate(model, prompts, 10, hot, seed=5)
    assert isinstance(first, Generation) and generate(model, prompts, 10, hot, seed=5) == first
    assert generate(model, prompts, 10, hot, seed=6).tokens != first.tokens
    assert first.tokens != greedy.tokens


# -- samplers on hand-made distributions -----------------------------------------------------------

@pytest.mark.parametrize("p, kept", [(0.8, {0.5, 0.3}), (0.81, {0.5, 0.3, 0.15}),
                                     (1.0, {0.5, 0.3, 0.15, 0.05}), (0.4, {0.5})])
def test_top_p_keeps_the_smallest_set_reaching_p(p, kept):
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # shuffled, so the sort must be undone
    mask = top_p_mask(probs, p)
    assert {round(x, 2) for x in probs[mask].tolist()} == kept
    assert top_p_mask(probs[None].expand(3, 4), p).tolist() == [mask.tolist()] * 3  # batched


def test_filter_logits_temperature_top_k_ties_and_top_p():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])
    inf = float("-inf")
    torch.testing.assert_close(filter_logits(logits, Sampler(temperature=2.0)), logits / 2,
                               rtol=0, atol=0)
    # Every token tied with the k-th largest logit is kept: top_k=1 keeps both 3.0s.
    assert filter_logits(logits, Sampler(temperature=1.0, top_k=1)).tolist() == \
        [[inf, 3.0, 3.0, inf, inf]]
    assert filter_logits(logits, Sampler(temperature=1.0, top_k=3)).tolist() == \
        [[inf, 3.0, 3.0, 2.0, inf]]
    assert filter_logits(logits, Sampler(temperature=1.0, top_k=99)).tolist() == logits.tolist()
    # top_p after top_k: (3, 3, 2) have probabilities (0.42, 0.42, 0.16), so p=0.4 keeps the
    # first 3.0 alone (ties resolve to the lower id), p=0.5 both and p=0.9 all three.
    for p, kept in [(0.4, [[inf, 3.0, inf, inf, inf]]), (0.5, [[inf, 3.0, 3.0, inf, inf]]),
                    (0.9, [[inf, 3.0, 3.0, 2.0, inf]])]:
        assert filter_logits(logits, Sampler(1.0, top_k=3, top_p=p)).tolist() == kept
    assert sample(logits, Sampler()).tolist() == [1]  # greedy: the first maximum
    draws = {sample(logits, Sampler(1.0, top_k=3), torch.Generator().manual_seed(s)).item()
             for s in range(40)}
    assert draws == {1, 2, 3}  # never a filtered token, every kept one eventually


# -- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [({"temperature": -1.0}, "temperature"),
                                       ({"temperature": float("nan")}, "temperature"),
                                       ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                       ({"top_k": -1}, "top_k")])
def test_bad_sampler_fields_are_refused(kw, field):
    with pytest.raises(BridgeError, match=rf"^{field}: must be"):
        Sampler(**kw)


def test_bad_prompts_are_refused_and_long_requests_clipped():
    config = small_config(max_seq_len=16)
    model = torch_model(config)
    with pytest.raises(BridgeError, match=r"prompts\[1\]: empty prompt; start it with the BOS"):
        generate(model, [[1, 2], []], 4)
    with pytest.raises(BridgeError, match=r"prompts\[0\]: 16 tokens leave no room in max_seq_len"):
        generate(model, [[1] * 16], 4)
    with pytest.raises(BridgeError, match=r"max_new_tokens: must be > 0, got 0"):
        generate(model, [[1, 2]], 0)
    with pytest.raises(BridgeError, match=r"pad_id: 97 is outside the vocabulary"):
        generate(model, [[1, 2]], 4, pad_id=97)
    with pytest.warns(UserWarning, match=r"max_new_tokens 20 clipped to 6: .*max_seq_len 16"):
        out = generate(model, [[1, 2], [3] * 10], 20)
    assert [len(t) for t in out.tokens] == [6, 6]
    with pytest.warns(UserWarning, match=r"clipped to 1"):
        assert [len(t) for t in generate(model, [[1] * 15], 3).tokens] == [1]


def test_bfloat16_generation_of_a_padded_batch_stays_finite():
    """Padding queries see no real key; in bfloat16 the finfo.min bias must still give a uniform
    row rather than NaN, or the NaN would reach every later token through the cache."""
    config = small_config()
    model = torch_model(config, head_scale=20.0).to(torch.bfloat16)
    out = generate(model, [[1, 2], [3, 4, 5, 6, 7, 8]], 6)
    assert [len(t) for t in out.tokens] == [6, 6]
    assert np.isfinite(out.logprobs).all()
