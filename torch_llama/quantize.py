"""int8 weight-only quantisation of a torch_llama model, in place (bridge.quantize has the
arithmetic; jax_llama.quantize is the twin).

    torch_llama.quantize(model)                  # per output channel
    torch_llama.quantize(model, group_size=64)   # per 64 input columns of each row
    torch_llama.save(path, model)                # int8 + scales, declared in config.json
    torch_llama.quantize(model, method="int4")   # 4 bits, a scale and a minimum per 32 inputs

Each projection's `weight`, and the LM head's (the embedding's, when the head is tied to it),
becomes a frozen int8 tensor beside a float32 `weight_scale` buffer (state_dict keys `<name>` and
`<name>_scale`, the native format's); the norms, an untied embedding and LoRA adapters are left
as they are. method="int4" (bridge.int4): each Linear's weight becomes uint8 (out, in / 2)
beside `weight_scale` and `weight_min` (out, in / 32); a tied LM head (the embedding) becomes int8
with one scale per row, as method="int8" makes it; an untied embedding stays float. (A load of
4-bit weights whose minima are all -8 times their scales, llama.cpp's Q4_0, holds no `weight_min`,
as the JAX twin holds none.) torch_llama.save writes it as it is (bridge.quantize's "int4"
method; minima not held written as -8 scale), the same bits as JAX's.
"""

from __future__ import annotations

import torch
from torch import nn

from bridge.errors import BridgeError
from bridge.int4 import mixture_refused
from bridge.quantize import Quantization, check_quantizable

from .model import Llama
from .projections import Int8Weight, Linear


def quantize(model: Llama, group_size: int | None = None, method: str = "int8") -> Llama:
    """Quantise `model`'s projections and LM head in place and return it; refuses a model
    quantised already, and a group size that does not divide a weight's inputs (naming it)
    before anything is converted."""
    if quantization_of(model) is not None:
        raise BridgeError("already quantised", field="model")
    if method == "int4":
        from bridge.int4 import GROUP

        if group_size not in (None, GROUP):
            raise BridgeError(f"4-bit weights come in groups of {GROUP} inputs (got "
                              f"{group_size})", field="group_size")
        for name, module in int8_weights(model):
            if isinstance(module, Linear):
                module.quantize_int4(name + ".weight")
            else:  # the tied head's rows, int8 (jax_llama.quantize does the same)
                module.quantize(Quantization("int8", None), name + ".weight")
        return model
    quantization = Quantization(method, group_size)
    check_quantizable(model.config, quantization)
    for name, module in int8_weights(model):
        module.quantize(quantization, name + ".weight")
    return model


def int8_weights(model: nn.Module) -> list[tuple[str, Int8Weight]]:
    """(name, module) of every weight int8 quantisation covers (bridge.quantize.quantized_names):
    the Linears (wq ... w3, and an untied LM head) and, when the head is tied, the embedding."""
    tied = isinstance(model, Llama) and model.output is None
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, Linear) or (tied and m is model.tok_embeddings)]


def quantization_of(model: nn.Module) -> Quantization | None:
    """The Quantization `model` holds, from its first int8 weight; int4 where 4-bit weights are
    (every Linear then 4-bit: the mixture a nearest load of a file with 6- and 8-bit tensors
    makes is refused); None for a float model."""
    weights = int8_weights(model)
    if any(m.weight.dtype == torch.uint8 for _, m in weights):
        mixed = [name for name, m in weights if isinstance(m, Linear) and
                 m.weight.dtype != torch.uint8]
        if mixed:
            raise mixture_refused(mixed[0], field="model")
        return Quantization("int4")
    for name, m in int8_weights(model):
        if hasattr(m, "weight_scale"):
            groups = m.weight_scale.shape[1]
            return Quantization(group_size=None if groups == 1 else m.weight.shape[1] // groups)
    return None
