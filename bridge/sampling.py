"""How a token is chosen from the logits: the one sampling description both twins obey."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

from .config import LlamaConfig
from .errors import BridgeError


@dataclass(frozen=True)
class Sampler:
    """Greedy (temperature 0), or a draw from the softmax of the logits divided by `temperature`,
    restricted to the `top_k` most likely tokens (0 = all; every token tied with the k-th is
    kept) and then to the smallest set whose probability reaches `top_p` (1.0 = all). Frozen and
    hashable: JAX takes it as a static argument."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # `not x >= 0` rather than `x < 0` so that NaN is refused too.
        if not self.temperature >= 0:
            raise BridgeError(f"temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise BridgeError(f"top_k: must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise BridgeError(f"top_p: must be in (0, 1] (1.0 = off), got {self.top_p}")


@dataclass
class Generation:
    """Per prompt: the generated ids only, up to and including the stop token if one was hit,
    and the log-probability of each under the raw model (temperature 1, unfiltered), float32."""
    tokens: list[list[int]]
    logprobs: list[list[float]]


def check_generation(prompts: Sequence[Sequence[int]], max_new_tokens: int, config: LlamaConfig,
                     pad_id: int = 0) -> int:
    """Refuse what cannot run; return max_new_tokens, clipped (with a warning) so that the
    longest prompt plus the new tokens fit max_seq_len (at least one new token always does)."""
    if not prompts:
        raise BridgeError("prompts: no prompt given")
    if max_new_tokens <= 0:
        raise BridgeError(f"max_new_tokens: must be > 0, got {max_new_tokens}")
    if not 0 <= pad_id < config.vocab_size:
        raise BridgeError(f"pad_id: {pad_id} is outside the vocabulary [0, {config.vocab_size})")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise BridgeError(f"prompts[{i}]: empty prompt; start it with the BOS token")
        if len(prompt) >= config.max_seq_len:  # not even one new token would fit
            raise BridgeError(f"prompts[{i}]: {len(prompt)} tokens leave no room in max_seq_len "
                              f"{config.max_seq_len}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > config.max_seq_len:
        clipped = config.max_seq_len - longest
        warnings.warn(f"max_new_tokens {max_new_tokens} clipped to {clipped}: the longest prompt "
                      f"({longest} tokens) plus the new tokens must fit max_seq_len "
                      f"{config.max_seq_len}", stacklevel=3)  # generate's caller
        return clipped
    return max_new_tokens
