"""The attention mask of the torch twin: which key slot each query may attend (causal, padding,
packed segments, Mistral's sliding window), and SDPA's additive bias built from it once per
forward pass (jax_llama.model.attention.AttentionMask's twin). A rolling KV cache reuses its
entries in turn, so the mask also says which slot each key entry holds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMask:
    """Query s may attend key entry t, which holds slot k = k_slots[t] (t itself when k_slots is
    None), when k <= q_slots[s] (causal), q_slots[s] - k < window (a sliding window), valid[b, t]
    (a real token) and q_segments[b, s] == k_segments[b, t] (same document); None fields are not
    restrictions (jax_llama.model.attention.AttentionMask's twin, which builds the dense mask only
    for the implementations that need it; SDPA here always does)."""

    q_slots: torch.Tensor                      # (S,) int64: the key slot each query occupies
    valid: torch.Tensor | None = None          # (B, T) bool
    q_segments: torch.Tensor | None = None     # (B, S)
    k_segments: torch.Tensor | None = None     # (B, T)
    k_slots: torch.Tensor | None = None        # (T,) int64: the slot each rolling cache entry holds
    window: int | None = None                  # LlamaConfig.sliding_window
    # additive() of this mask by (T, dtype): every layer of a forward pass attends with the same
    # mask, so it is built once (a decode step makes a new mask; it is not kept across steps)
    _biases: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def causal(cls, S: int, valid_BS=None, segments_BS=None, window=None,
               device=None) -> "AttentionMask":
        """S tokens attending to themselves (no cache): query s at slot s."""
        return cls(q_slots=torch.arange(S, device=device), valid=valid_BS,
                   q_segments=segments_BS, k_segments=segments_BS, window=window)

    def dense(self, T: int) -> torch.Tensor:
        """The (B or 1, S, T) boolean mask."""
        k_slots = self.k_slots
        if k_slots is None:
            k_slots = torch.arange(T, device=self.q_slots.device)
        allowed = (k_slots[None, :] <= self.q_slots[:, None])[None]
        # --8<-- [start:sliding_window]
        if self.window is not None:  # Mistral: a query sees only the last `window` positions
            allowed = allowed & (self.q_slots[:, None] - k_slots[None, :] < self.window)[None]
        # --8<-- [end:sliding_window]
        if self.valid is not None:
            allowed = allowed & self.valid[:, None, :]
        if self.q_segments is not None:
            allowed = allowed & (self.q_segments[:, :, None] == self.k_segments[:, None, :])
        return allowed

    def additive(self, T: int, dtype: torch.dtype) -> torch.Tensor:
        """dense(T) as SDPA's additive bias (B or 1, 1, S, T) in `dtype` (_additive), built
        once per mask."""
        key = (T, dtype)
        if key not in self._biases:
            self._biases[key] = _additive(self.dense(T)[:, None], dtype)
        return self._biases[key]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, the dtype's most negative finite value elsewhere: a query with every key
    masked (a padding query) then gets a uniform distribution instead of the NaN of -inf."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)
