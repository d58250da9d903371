"""torch-llama: the PyTorch twin of jax_llama (same math, same canonical tensor names).

    tmodel = torch_llama.load(path, device="auto", dtype=None)
    logits = tmodel(tokens)                               # int (B, S) -> float32 (B, S, V)
    torch_llama.save(path, tmodel)
"""

from bridge.config import PRESETS, LlamaConfig

from .checkpoint import load, resolve_device, resolve_dtype, save
from .model import Attention, Block, FeedForward, Llama, RMSNorm, apply_rope, check_inputs

__all__ = ["Attention", "Block", "FeedForward", "Llama", "LlamaConfig", "PRESETS", "RMSNorm",
           "apply_rope", "check_inputs", "load", "resolve_device", "resolve_dtype", "save"]
