"""torch-llama: the PyTorch twin of jax_llama (same math, same canonical tensor names).

    tmodel = torch_llama.load(path, device="auto", dtype=None)
    logits = tmodel(tokens)                               # int (B, S) -> float32 (B, S, V)
    out = tmodel.run(tokens, cache=cache)                 # LlamaOutput, as in jax_llama
    torch_llama.save(path, tmodel)
    tmodel = torch_llama.load(path, adapter=peft_dir)     # a LoRA adapter merged in as it loads
    torch_llama.add_lora(tmodel, LoraConfig(rank=8))      # frozen base, trainable adapters
    torch_llama.save_adapter(peft_dir, tmodel)            # or merge_lora(tmodel), then save
    torch_llama.quantize(tmodel)                          # int8 projections and head, in place
    opt = torch_llama.AdamW(params, lr=schedule, betas=(0.9, 0.95), weight_decay=0.1,
                            mask=torch_llama.decay_mask)    # optax.adamw's exact semantics

jax_llama exports the same names wherever the concept exists in both twins
(tests/test_layers.py compares the two lists).
"""

from bridge.config import PRESETS, LlamaConfig
from bridge.lora import LoraConfig
from bridge.sampling import Generation, Sampler

from .checkpoint import load, save
from .classify import Classifier, load_classifier, predict
from .eval import evaluate
from .generate import generate
from .heads import LlamaClassifier, last_real_index
from .inputs import check_inputs
from .lora import adapter_of, add_lora, merge_lora, save_adapter
from .model import (Attention, Block, FeedForward, KVCache, Llama, LlamaOutput, RMSNorm,
                    apply_rope, init, resolve_device, resolve_dtype, rope_cos_sin)
from .optim import (AdamW, clip_by_global_norm, cosine_decay_schedule, decay_mask, linear_schedule,
                    warmup_cosine_decay_schedule)
from .quantize import quantize

__all__ = ["AdamW", "Attention", "Block", "Classifier", "FeedForward", "Generation", "KVCache",
           "Llama", "LlamaClassifier", "LlamaConfig", "LlamaOutput", "LoraConfig",
           "PRESETS", "RMSNorm", "Sampler", "adapter_of", "add_lora", "apply_rope",
           "check_inputs", "clip_by_global_norm", "cosine_decay_schedule", "decay_mask",
           "evaluate", "generate", "init", "last_real_index", "linear_schedule", "load",
           "load_classifier", "merge_lora", "predict", "quantize", "resolve_device",
           "resolve_dtype", "rope_cos_sin", "save", "save_adapter", "warmup_cosine_decay_schedule"]
