"""Sliding-window perplexity in the torch twin: tasks.evaluation plans the windows and writes the
report; this module scores a batch of windows with one forward pass under inference_mode.

    report = evaluate(model, documents, seq_len=1024, stride=512, batch_size=8)

The same windows, batches and arithmetic as jax_llama.eval, so the twins report the same numbers.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from tasks.evaluation import DEFAULT_BATCH_SIZE, Document, WindowBatch, run_evaluation

from .model import Llama


def window_nll(model: Llama, tokens_BS, targets_BS, weights_BS) -> torch.Tensor:
    """(B,) float32: the NLL (nats) of each row's weighted targets, from log_softmax of the
    float32 logits. tokens, targets (B, S) integer; weights (B, S) float32, 0 where not scored."""
    logits_BSV = model(tokens_BS).float()
    logp_BSV = torch.log_softmax(logits_BSV, dim=-1)
    nll_BS = -logp_BSV.gather(-1, targets_BS.long()[..., None])[..., 0]
    return (nll_BS * weights_BS).sum(-1)


def evaluate(model: Llama, documents: Sequence[Document], seq_len: int, stride: int,
             batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = False) -> dict:
    """tasks.evaluation.run_evaluation with this model (on its own device): per-file and overall
    nll_per_token, perplexity, tokens, bits_per_byte and seconds (a dict, ready for JSON)."""
    device = next(model.parameters()).device

    def score_batch(batch: WindowBatch) -> np.ndarray:
        tokens_BS, targets_BS, weights_BS = (torch.as_tensor(x, device=device) for x in
                                             (batch.tokens, batch.targets, batch.weights))
        with torch.inference_mode():
            return window_nll(model, tokens_BS.long(), targets_BS, weights_BS).cpu().numpy()
    return run_evaluation(score_batch, documents, seq_len, stride, batch_size, progress)
