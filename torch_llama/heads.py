"""What reads a torch Llama's hidden states besides its LM head: the classifier
(jax_llama.model.heads' twin)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bridge.config import LlamaConfig

from .model import Llama


def last_real_index(attention_mask_BS) -> torch.Tensor:
    """(B,) index of each row's last real token, wherever the padding is (left, right or both)."""
    mask_BS = torch.as_tensor(attention_mask_BS).bool()
    return mask_BS.shape[1] - 1 - mask_BS.flip(1).int().argmax(1)


# --8<-- [start:classifier]
class LlamaClassifier(nn.Module):
    """A Llama backbone and a classification head: the final hidden state of each row's last real
    token, dropout, a linear layer to n_classes, log-softmax (jax_llama.LlamaClassifier's twin).

    The head's tensors are `classifier.weight` (C, D) and `classifier.bias` (C,); the backbone is
    `llama`, whose state_dict keys are the canonical names.
    """

    def __init__(self, config: LlamaConfig, n_classes: int, dropout: float = 0.0):
        super().__init__()
        self.config, self.n_classes = config, n_classes
        self.llama = Llama(config)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.dim, n_classes)
        nn.init.normal_(self.classifier.weight, std=0.02)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, tokens_BS: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """tokens (B, S) int, attention_mask (B, S) with at least one real token per row ->
        log-probabilities (B, C) float32."""
        h_BSD = self.llama.run(tokens_BS, attention_mask=attention_mask, lm_head=False).hidden
        last_B = last_real_index(attention_mask).to(h_BSD.device)
        h_BD = self.dropout(h_BSD[torch.arange(h_BSD.shape[0], device=h_BSD.device), last_B])
        return F.log_softmax(self.classifier(h_BD).float(), dim=-1)
# --8<-- [end:classifier]
