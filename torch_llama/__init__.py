"""torch-llama: the PyTorch twin of jax_llama (same math, same canonical tensor names).

    tmodel = torch_llama.load(path, device="auto", dtype=None)
    logits = tmodel(tokens)                               # int (B, S) -> float32 (B, S, V)
    torch_llama.save(path, tmodel)
    opt = torch_llama.AdamW(params, lr=schedule, betas=(0.9, 0.95), weight_decay=0.1,
                            mask=torch_llama.decay_mask)    # optax.adamw's exact semantics
"""

from bridge.config import PRESETS, LlamaConfig

from .checkpoint import load, load_classifier, resolve_device, resolve_dtype, save
from .generate import Generation, Sampler, generate
from .model import (Attention, Block, FeedForward, KVCache, Llama, LlamaClassifier, RMSNorm,
                    apply_rope, check_inputs)
from .optim import (AdamW, clip_by_global_norm, cosine_decay_schedule, decay_mask, linear_schedule,
                    warmup_cosine_decay_schedule)

__all__ = ["AdamW", "Attention", "Block", "FeedForward", "Generation", "KVCache", "Llama", "LlamaClassifier", "LlamaConfig", "PRESETS", "RMSNorm",
           "apply_rope", "check_inputs", "clip_by_global_norm", "cosine_decay_schedule",
           "decay_mask", "generate", "linear_schedule", "load", "load_classifier", "resolve_device", "resolve_dtype",
           "Sampler", "save", "warmup_cosine_decay_schedule"]
