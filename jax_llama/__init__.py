"""jax-llama: a pure-functional Flax (Linen) LLaMA.

    model, params = jax_llama.init(config, seed=0)
    logits = model.apply({"params": params}, tokens)      # int32 (B, S) -> float32 (B, S, V)
    out = model.apply({"params": params}, tokens, cache=cache, method="run")   # LlamaOutput
    jax_llama.save(path, config, params)                  # native safetensors checkpoint
    model, params = jax_llama.load(path, dtype=None, adapter=None)   # adapter: a PEFT dir, merged
    model, params = jax_llama.add_lora(model, params, jax_llama.LoraConfig(rank=8))  # train adapters
    jax_llama.save_adapter(path, model, params)           # PEFT format; merge_lora folds them in
    qparams = jax_llama.quantize(params)                  # int8 weights and head, same module

torch_llama exports the same names wherever the concept exists in both twins
(tests/test_layers.py compares the two lists).
"""

from bridge.config import PRESETS, LlamaConfig
from bridge.lora import LoraConfig
from bridge.sampling import Generation, Sampler

from .checkpoint import load, save
from .classify import Classifier, load_classifier, predict
from .eval import evaluate
from .inference.generate import generate
from .lora import adapter_of, add_lora, merge_lora, save_adapter
from .model import (Attention, Block, FeedForward, KVCache, Llama, LlamaOutput, RMSNorm, apply_rope,
                    init, resolve_dtype, rope_cos_sin)
from .model.heads import LlamaClassifier, last_real_index
from .model.inputs import check_inputs
from .quantize import quantize
from .training.step import TrainConfig, decay_mask, make_optimizer, make_train_step

__all__ = ["Attention", "Block", "Classifier", "FeedForward", "Generation", "KVCache", "Llama",
           "LlamaClassifier", "LlamaConfig", "LlamaOutput", "LoraConfig", "PRESETS", "RMSNorm",
           "Sampler", "TrainConfig", "adapter_of", "add_lora", "apply_rope", "check_inputs",
           "decay_mask", "evaluate", "generate", "init", "last_real_index", "load",
           "load_classifier", "make_optimizer", "make_train_step", "merge_lora", "predict",
           "quantize", "resolve_dtype", "rope_cos_sin", "save", "save_adapter"]
