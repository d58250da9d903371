"""Text generation for the torch twin: one prefill of the left-padded prompts through a KVCache,
then one decode step per new token. The same semantics as jax_llama.generate, so that greedy
decoding agrees token for token between the twins.

Sampling is a few free functions over logits (B, V); the model knows only how to run a step with
a cache. Axis letters as in torch_llama.model.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from bridge.inputs import check_ids, pad_rows
from bridge.sampling import Generation, Sampler, check_generation

from .model import KVCache, Llama


def top_p_mask(probs: torch.Tensor, p: float) -> torch.Tensor:
    """probs (..., V) -> bool (..., V): the smallest set of most likely tokens whose total mass
    reaches p. In descending order a token is kept iff the mass before it is < p, so the token
    that crosses p is kept and the most likely token always is. Equal probabilities keep their
    vocabulary order (stable sort), so ties at the boundary resolve to the lower id."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    # The exclusive cumsum by shifting, not cumsum - probs: the subtraction rounds, and a mass
    # that reaches p exactly (0.5 + 0.3 = 0.8) must not be kept or dropped by rounding.
    cumsum = sorted_probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumsum[..., :1]), cumsum[..., :-1]], dim=-1)
    keep_sorted = mass_before < p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def filter_logits(logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    """logits (..., V) float32 -> the same divided by the temperature, with tokens outside the
    top-k and then outside the top-p set at -inf. Every token tied with the k-th largest logit
    is kept, so the result does not depend on how ties happen to be ordered."""
    if sampler.temperature > 0:
        logits = logits / sampler.temperature
    if 0 < sampler.top_k < logits.shape[-1]:
        kth_largest = logits.topk(sampler.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampler.top_p < 1.0:
        keep = top_p_mask(logits.softmax(dim=-1), sampler.top_p)
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def sample(logits: torch.Tensor, sampler: Sampler,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) float32 -> token ids (B,) int64: the argmax (first maximum on ties) when
    greedy, else one multinomial draw per row from the filtered distribution."""
    if sampler.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, sampler).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


# --8<-- [start:decode]
def generate(model: Llama, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampler: Sampler = Sampler(), stop_ids: Sequence[int] = (), seed: int = 0,
             on_token: Callable[[int, int], None] | None = None, pad_id: int = 0) -> Generation:
    """Continue each prompt (a list of token ids) by up to max_new_tokens tokens.

    Prompts are left-padded with pad_id to the longest, so that the last column holds every
    row's last real token; one prefill fills the cache, then each step feeds the B sampled
    tokens (B, 1). A row stops after sampling a token in stop_ids; the loop ends when all have.
    on_token(row, token_id) is called as each token is produced. Runs on the model's device,
    under torch.inference_mode (entered inside, so that a clipping warning points at the caller).
    The prompts are checked on the host, once; the decode steps feed the model's own samples.
    """
    c = model.config
    max_new_tokens = check_generation(prompts, max_new_tokens, c, pad_id)
    B = len(prompts)
    tokens, logprobs = [[] for _ in range(B)], [[] for _ in range(B)]
    tokens_BS, mask_BS = pad_rows(prompts, side="left", pad_id=pad_id)
    check_ids(tokens_BS, c.vocab_size)
    weight = model.norm.weight  # the model's dtype (the embedding may be int8)
    device = weight.device
    stop, done = set(stop_ids), [False] * B
    with torch.inference_mode():
        cache = KVCache.create(c, B, tokens_BS.shape[1] + max_new_tokens, weight.dtype, device)
        generator = torch.Generator(device=device).manual_seed(seed)
        out = model.run(torch.from_numpy(tokens_BS).long().to(device),
                        attention_mask=torch.from_numpy(mask_BS).to(device), cache=cache)
        for step in range(max_new_tokens):
            logits_BV = out.logits[:, -1]
            next_B = sample(logits_BV, sampler, generator)
            logprob_B = logits_BV.log_softmax(dim=-1).gather(-1, next_B[:, None])[:, 0]
            for row, (token, logprob) in enumerate(zip(next_B.tolist(), logprob_B.tolist())):
                if done[row]:
                    continue
                tokens[row].append(token)
                logprobs[row].append(logprob)
                if on_token is not None:
                    on_token(row, token)
                done[row] = token in stop
            if all(done) or step == max_new_tokens - 1:
                break
            # Finished rows keep decoding (their outputs are dropped): the batch keeps its shape.
            out = model.run(next_B[:, None], cache=cache)
    return Generation(tokens, logprobs)
# --8<-- [end:decode]
