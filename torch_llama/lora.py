"""LoRA on the torch model (jax_llama.lora's twin): add adapters to a model, train only them, save
them in PEFT's format, merge them into the weights.

The adapters are submodules of the projections they adapt (projections.Linear: `wq.lora_A`,
`wq.lora_B`, float32), so state_dict() holds the canonical adapter names beside the canonical
weights. What trains is requires_grad: the base is frozen, so an optimizer given every parameter
updates only the adapters (and a classifier's head). With lora.train_embeddings the embedding
table trains too, whole and in float32 (a tied LM head with it), as in the JAX twin.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from bridge.errors import BridgeError
from bridge.lora import EMBEDDING, INT8_TABLE, MODULES, Adapter, LoraConfig, write_peft

from .heads import LlamaClassifier
from .model import Llama
from .projections import Linear, lora_of


def _backbone(model) -> Llama:
    """The Llama that carries the adapters: the model itself, or a classifier's `llama`."""
    if isinstance(model, LlamaClassifier):
        return model.llama
    if not isinstance(model, Llama):
        raise BridgeError(f"expected a Llama or LlamaClassifier, got {type(model).__name__}",
                          field="model")
    return model


def add_lora(model: Llama | LlamaClassifier, lora: LoraConfig, seed: int = 0,
             adapter: Adapter | None = None) -> Llama | LlamaClassifier:
    """Give every projection in lora.targets of every layer a LoRA adapter, in place, and return
    `model`. A and B are float32 on the model's device: A drawn from `seed` (the caller's torch
    RNG is left as it was) and B zero, so the logits are unchanged, or `adapter`'s tensors (an
    adapter with these settings, checked against the model's config). Every base parameter is
    frozen; the adapters train, and so does a LlamaClassifier's head, and the embedding table
    (made float32; its output is cast to the model's dtype) when lora.train_embeddings."""
    llama = _backbone(model)
    if lora_of(llama) is not None:
        raise BridgeError("already has LoRA adapters", field="model")
    if lora.train_embeddings and llama.tok_embeddings.weight.dtype == torch.int8:
        raise BridgeError(INT8_TABLE, field="train_embeddings")
    if adapter is not None:
        if adapter.lora != lora:
            raise BridgeError(f"the adapter's settings {adapter.lora} differ from {lora}",
                              field="lora")
        adapter.check(llama.config)
    model.requires_grad_(False)
    if isinstance(model, LlamaClassifier):
        model.classifier.requires_grad_(True)
    if lora.train_embeddings:
        llama.tok_embeddings.float().requires_grad_(True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for block in llama.layers:
            for target in lora.targets:
                getattr(getattr(block, MODULES[target]), target).add_adapter(lora)
    if adapter is not None:
        with torch.no_grad():
            for name, array in adapter.tensors.items():
                llama.get_parameter(name).copy_(torch.from_numpy(np.array(array, np.float32)))
    return model


def adapter_of(model: Llama | LlamaClassifier, base_model: str | None = None) -> Adapter:
    """The model's adapters as a bridge Adapter: its LoraConfig and canonical numpy float32
    tensors; `base_model` is recorded for PEFT's adapter_config.json."""
    llama = _backbone(model)
    lora = lora_of(llama)
    if lora is None:
        raise BridgeError("the model has no LoRA adapters", field="model")
    return Adapter(lora, {name: t.detach().float().cpu().numpy()
                          for name, t in llama.state_dict().items()
                          if ".lora_" in name or name == EMBEDDING and lora.train_embeddings},
                   base_model)


def save_adapter(path: str | os.PathLike, model: Llama | LlamaClassifier, *,
                 base_model: str | None = None, overwrite: bool = False):
    """Write the adapters as Hugging Face PEFT writes a LoRA adapter (bridge.lora.write_peft)."""
    return write_peft(path, _backbone(model).config, adapter_of(model, base_model),
                      overwrite=overwrite)


def merge_lora(model: Llama | LlamaClassifier) -> Llama | LlamaClassifier:
    """Fold each adapter into its projection (W + scale * B A, in float32, then W's dtype) and
    remove the adapters, in place: a plain model again, every parameter trainable, whose
    state_dict holds the canonical names only; a trained embedding table is rounded to the base's
    dtype (the final norm's). A model without adapters is returned as it is."""
    llama = _backbone(model)
    if lora_of(llama) is None:
        return model
    for module in llama.modules():
        if isinstance(module, Linear) and module.lora is not None:
            module.merge_adapter()
    llama.tok_embeddings.to(llama.norm.weight.dtype)
    return model.requires_grad_(True)
