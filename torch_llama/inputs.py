"""Host-side checks of a torch model's inputs: bridge.inputs.check_inputs on torch values."""

from __future__ import annotations

import numpy as np
import torch

from bridge.inputs import check_inputs as _check_inputs


def check_inputs(tokens: torch.Tensor, vocab_size: int, positions=None, attention_mask=None,
                 segment_ids=None) -> None:
    """bridge.inputs.check_inputs on torch values (the same rules as jax_llama.check_inputs):
    shapes always, token values only where they are on the host already (a CPU tensor) - never
    a copy off an accelerator, which would stall every decode step."""
    integer = _is_integer(tokens)
    _check_inputs(tokens.shape, integer, vocab_size,
                  ids=tokens.detach().numpy() if integer and tokens.device.type == "cpu" else None,
                  positions_shape=None if positions is None else np.shape(positions),
                  mask_shape=None if attention_mask is None else np.shape(attention_mask),
                  segments_shape=None if segment_ids is None else np.shape(segment_ids),
                  segments_integer=segment_ids is None or _is_integer(torch.as_tensor(segment_ids)))


def _is_integer(x: torch.Tensor) -> bool:
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
