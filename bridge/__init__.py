"""bridge: the framework-neutral bottom layer of jax-llama, which both twins build on.

numpy, safetensors and ml_dtypes only (torch inside the .pth/.pt readers alone, JAX never): the
config and presets, canonical tensor names, RoPE frequencies, the dtype table, input rules and
padding, sampling rules, prompts and tokenizers, task files, the on-disk formats (native, Hugging
Face, Meta, llama2.c; GGUF's whole wing in gguf/), conversion, atomic writes and the one error type.
"""

from .config import PRESETS, LlamaConfig, RopeScaling
from .errors import BridgeError
from .formats import open_checkpoint, write_native
from . import gguf  # noqa: F401  (enters GGUF's tokenizer and template readers: bridge.gguf)
from .rope import rope_inv_freq
from .tensors import canonical_shapes, count_params

__all__ = ["BridgeError", "LlamaConfig", "PRESETS", "RopeScaling", "canonical_shapes",
           "count_params", "open_checkpoint", "rope_inv_freq", "write_native"]
