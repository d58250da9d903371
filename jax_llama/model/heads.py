"""What reads a Llama's hidden states besides its LM head: a classifier, and a Llama's blocks run
in two parts (the frozen lower blocks once, the ones above at every step) that a classifier with
frozen lower blocks trains on (jax_llama.training.finetune). Parameter paths are a Llama's (`llama/...`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.rope import rope_inv_freq

from .attention import AttentionMask
from .llama import Block, Llama, RMSNorm, _init, default_positions, rope_cos_sin
from .projections import Projections

Dtype = Any


def last_real_index(attention_mask_BS) -> jax.Array:
    """(B,) index of each row's last real token, wherever the padding is (left, right or both)."""
    mask_BS = jnp.asarray(attention_mask_BS).astype(bool)
    return mask_BS.shape[1] - 1 - jnp.argmax(mask_BS[:, ::-1], axis=1)


class Blocks(nn.Module):
    """Blocks [first, last) of a Llama, under the names Llama gives them (with tok_embeddings
    when first is 0, and the final norm when last is n_layers), so that a whole Llama's params
    apply. What a classifier with frozen lower blocks runs: their output once for every text
    (jax_llama.classify), then at each step only the blocks above."""

    config: LlamaConfig
    first: int
    last: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention: str = "auto"
    projections: Projections = Projections()  # how x @ W runs (jax_llama.model.projections)

    @nn.compact
    def __call__(self, x, attention_mask):
        """x: tokens (B, S) when first is 0, else the hidden states (B, S, D) entering block
        `first`; attention_mask (B, S), 1 on real tokens (positions count them, as in Llama.run)
        -> the hidden states (B, S, D) leaving block last - 1, normed when it is the last."""
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        if not 0 <= self.first < self.last <= c.n_layers:
            raise BridgeError(f"blocks [{self.first}, {self.last}) of {c.n_layers}",
                              field="layers")
        valid_BS = jnp.asarray(attention_mask).astype(bool)
        mask = AttentionMask.causal(valid_BS.shape[1], valid_BS, None)
        cos_BSh, sin_BSh = rope_cos_sin(default_positions(valid_BS), rope_inv_freq(
            c.head_dim, c.rope_theta, c.rope_scaling))
        if self.first == 0:
            x = self.projections.embedding(c.vocab_size, c.dim, **kw, embedding_init=_init(c),
                                           name="tok_embeddings")(x)
        for i in range(self.first, self.last):
            block = Block(c, **kw, attention=self.attention, projections=self.projections,
                          name=f"layers_{i}")
            (x, _), _ = block((x, None), i, cos_BSh, sin_BSh, mask)
        return RMSNorm(c.norm_eps, **kw, name="norm")(x) if self.last == c.n_layers else x


# --8<-- [start:classifier]
class LlamaClassifier(nn.Module):
    """A Llama backbone and a classification head: the final hidden state of each row's last real
    token, dropout, a linear layer to n_classes, log-softmax.

    The backbone's parameters sit under `llama` (the LM head's `output` kernel, unused here, is
    not created); the head's under `classifier` (kernel (D, C) and bias (C,)).

    first_layer > 0: the inputs are the hidden states (B, S, D) entering that block (computed
    once by Blocks(0, first_layer), the blocks below being frozen), and only the blocks from
    there up run, with the same params.
    """

    config: LlamaConfig
    n_classes: int
    dropout: float = 0.0
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    scan_layers: bool = False
    remat: bool = False
    attention: str = "auto"
    projections: Projections = Projections()  # how x @ W runs (jax_llama.model.projections)
    first_layer: int = 0

    @nn.compact
    def __call__(self, tokens_BS, attention_mask, deterministic: bool = True):
        """tokens (B, S) int (or, with first_layer, hidden states (B, S, D)), attention_mask
        (B, S) with at least one real token per row -> log-probabilities (B, C) float32.
        Training (deterministic=False) needs a 'dropout' rng."""
        if self.first_layer == 0:
            h_BSD = Llama(self.config, self.dtype, self.param_dtype, self.scan_layers, self.remat,
                          self.attention, self.projections, name="llama").run(
                tokens_BS, attention_mask=attention_mask, lm_head=False).hidden
        else:
            if self.scan_layers:
                raise BridgeError("needs one parameter set per block (not scan_layers)",
                                  field="first_layer")
            h_BSD = Blocks(self.config, self.first_layer, self.config.n_layers, self.dtype,
                           self.param_dtype, self.attention, self.projections,
                           name="llama")(tokens_BS, attention_mask)
        h_BD = h_BSD[jnp.arange(h_BSD.shape[0]), last_real_index(attention_mask)]
        h_BD = nn.Dropout(self.dropout)(h_BD, deterministic=deterministic)
        logits_BC = nn.Dense(self.n_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                             kernel_init=nn.initializers.normal(0.02), name="classifier")(h_BD)
        return jax.nn.log_softmax(logits_BC.astype(jnp.float32), axis=-1)
# --8<-- [end:classifier]
