"""Framework-neutral core of jax-llama: config, tensor names, on-disk formats (numpy only)."""

from .config import PRESETS, LlamaConfig, RopeScaling
from .errors import BridgeError
from .formats import open_checkpoint, write_native
from .rope import rope_inv_freq
from .tensors import canonical_shapes, count_params

__all__ = ["BridgeError", "LlamaConfig", "PRESETS", "RopeScaling", "canonical_shapes",
           "count_params", "open_checkpoint", "rope_inv_freq", "write_native"]
