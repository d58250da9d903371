"""The model: the LLaMA as one file, and beside it the implementations it is handed.

    llama.py        the architecture alone, in its order: RMSNorm, RoPE, the KV cache,
                    grouped-query attention, SwiGLU, Block, Llama
    attention.py    the attention implementations behind one function (xla, chunked, cudnn,
                    splash) and the mask they share
    projections.py  how a projection x @ W, the embedding and attention over the KV cache run:
                    float, int8 or 4-bit weights, a LoRA adapter, XLA or the decode kernels -
                    one Projections, made by choose(kernels, lora), handed to the model
    kernels/        the CPU decode kernels (matvec.cc) that projections.py may hand the model
    inputs.py       host-side checks of token ids and positions
    heads.py        the classifier head on a Llama and Blocks, a slice of its layers

The architecture's names are re-exported here (`from jax_llama.model import Llama, KVCache`).
"""

from .llama import (Attention, Block, FeedForward, KVCache, Llama, LlamaOutput, RMSNorm,
                    apply_rope, default_positions, init, resolve_dtype, rope_cos_sin)

__all__ = ["Attention", "Block", "FeedForward", "KVCache", "Llama", "LlamaOutput", "RMSNorm",
           "apply_rope", "default_positions", "init", "resolve_dtype", "rope_cos_sin"]
