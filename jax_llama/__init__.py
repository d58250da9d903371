"""jax-llama: a pure-functional Flax (Linen) LLaMA.

    model, params = jax_llama.init(config, seed=0)
    logits = model.apply({"params": params}, tokens)      # int32 (B, S) -> float32 (B, S, V)
    jax_llama.save(path, config, params)                  # native safetensors checkpoint
    model, params = jax_llama.load(path, dtype=None)
"""

from bridge.config import PRESETS, LlamaConfig

from .checkpoint import load, save
from .model import (Attention, Block, FeedForward, Llama, LlamaClassifier, RMSNorm, apply_rope,
                    check_inputs, init)

__all__ = ["Attention", "Block", "FeedForward", "Llama", "LlamaClassifier", "LlamaConfig", "PRESETS", "RMSNorm",
           "apply_rope", "check_inputs", "init", "load", "save"]
