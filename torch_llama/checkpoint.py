"""load / save for the torch twin: the state_dict already uses the canonical names, so the only
work is numpy <-> torch (bfloat16 included), choosing a device, and merging a LoRA adapter in."""

from __future__ import annotations

import os

import numpy as np
import torch

from bridge.dtypes import numpy_dtype
from bridge.errors import BridgeError
from bridge.formats import Checkpoint, open_checkpoint, write_native
from bridge.formats.torch_files import from_numpy as to_torch
from bridge.formats.torch_files import to_numpy
from bridge.int4 import MIN_SUFFIX, minima_implied
from bridge.layout import decide_layout, held_as
from bridge.lora import read_peft
from bridge.progress import note, reading
from bridge.quantize import SCALE_SUFFIX
from bridge.resources import small_pages

from .model import Llama, resolve_device, resolve_dtype
from .projections import lora_of
from .quantize import int8_weights, quantization_of


def load(path: str | os.PathLike | Checkpoint, device: str | torch.device = "auto", dtype=None,
         adapter: str | os.PathLike | None = None, progress: bool = False,
         quantize: str | None = None, group_size: int | None = None) -> Llama:
    """A Llama in eval mode from a checkpoint of any supported format: a path, or a checkpoint
    already opened (bridge.formats.open_checkpoint), which is then not opened again.

    dtype None keeps the stored dtype (float32 when tensors are mixed). Tensors are read and moved
    to the device one at a time; the module is built on the meta device so nothing is allocated
    twice. `adapter`, a PEFT LoRA adapter directory (bridge.lora.read_peft), is checked against
    the checkpoint's config before any weight is read, then merged into each weight as it
    streams in, in the model's dtype as merge_lora merges: a plain model. progress: a bar on
    stderr counting the tensors read (bridge.progress). quantize, group_size: how the weights
    are held - None float, "int8", "int4", "stored" (each quantised tensor of a file in its
    nearest layout) or "auto" - decided by bridge.layout.decide_layout as jax_llama.load
    decides it, so both twins hold the same weights in the same layout.
    """
    with small_pages():  # its arrays become its tensors (bridge.resources)
        return _load(path, device, dtype, adapter, progress, quantize, group_size)


def _load(path, device, dtype, adapter, progress, quantize, group_size) -> Llama:
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    layout = decide_layout(ckpt, quantize, group_size, dtype, adapter=adapter is not None)
    if progress and (said := layout.describe(ckpt.path)):
        note(said)
    make = layout.reader(ckpt)
    device = resolve_device(device)
    dtype = resolve_dtype(ckpt.stored_dtype() if dtype is None else dtype)
    lora = None if adapter is None else read_peft(adapter, ckpt.config)

    def tensor(name, array) -> torch.Tensor:
        if lora is not None:
            array = lora.merged(name, array.astype(numpy_dtype(dtype), copy=False))
        keep = array.dtype == np.int8 or name.endswith(SCALE_SUFFIX)  # int8 and its scales
        return to_torch(array).to(device=device, dtype=None if keep else dtype)

    with torch.device("meta"):
        model = Llama(ckpt.config)
        if ckpt.quantization is not None and ckpt.quantization.method == "int8":
            for name, module in int8_weights(model):
                module.make_int8(ckpt.specs[name + ".weight" + SCALE_SUFFIX][0][1])
    read, shown = reading(ckpt.tensor, len(ckpt.specs), enabled=progress)
    four = None if make is None else make(ckpt.tensor)  # no adapter with these
    if four is not None and getattr(ckpt, "reads_rows", False):
        four.rows = ckpt.tensor_slice  # what it quantises, read a chunk of rows at a time
    state, implied = {}, set()
    with shown:
        for name in ckpt.specs:
            if name in state or name in implied:  # a 4-bit weight's scale and minimum, read
                continue                           # with it (its minima, where -8 d: not held)
            quantised = None if four is None else four(name)
            if quantised is None:
                state[name] = tensor(name, read(name))
                continue
            # a weight the reader gave (its parts read as it likes): a tick for it and for each
            # part the checkpoint stores beside it (a 4-bit native checkpoint's scale and min)
            shown.update(1 + sum(name + suffix in ckpt.specs
                                 for suffix in (SCALE_SUFFIX, MIN_SUFFIX)))
            module = model.get_submodule(name.removesuffix(".weight"))
            if len(quantised) == 3 and minima_implied(*quantised[1:]):
                quantised = quantised[:2]  # Q4_0's form, m = -8 d: as the JAX twin holds it
                implied.add(name + MIN_SUFFIX)
                module.make_int4(minima=False)
            elif len(quantised) == 3:
                module.make_int4()
            else:
                module.make_int8(1)
            for suffix, value in zip(("", SCALE_SUFFIX, MIN_SUFFIX), quantised):
                state[name + suffix] = to_torch(value).to(device)
    model.load_state_dict(state, strict=True, assign=True)
    if four is not None and progress and four.summary():
        note(f"{ckpt.path}: {four.summary()}")
    if layout.after:  # int8 in groups of inputs, or of weights an adapter was merged into
        from .quantize import quantize as quantized
        quantized(model, layout.group_size)
    return model.eval()


def held_layouts(model: Llama) -> dict[str, str]:
    """Canonical weight name -> how `model` holds it: "int4", "int8" or its float dtype's name
    (bridge.layout.held_as; jax_llama.checkpoint.held_layouts is the twin)."""
    from bridge.tensors import canonical_shapes

    state = model.state_dict()
    return {name: held_as(state[name].dtype) for name in canonical_shapes(model.config)}


def save(path: str | os.PathLike, model: Llama, *, overwrite: bool = False,
         max_shard_size: int | None = None) -> None:
    """Write `model` as a native checkpoint at `path` (atomically; tensors in their own dtype)."""
    if not isinstance(model, Llama):
        raise BridgeError(f"model: expected a torch_llama.Llama, got {type(model).__name__}")
    if lora_of(model) is not None:
        raise BridgeError("holds LoRA adapters, which a checkpoint cannot: merge them "
                          "(torch_llama.merge_lora) or save the adapter alone "
                          "(torch_llama.save_adapter, i.e. bridge.lora.write_peft(path, "
                          "model.config, adapter_of(model)))", field="model")
    own, state = model.state_dict(), {}
    for name, t in own.items():  # 4-bit weights held without minima (Q4_0's form): written
        state[name] = t          # with them, -8 scale (exact), as the JAX twin writes them
        weight = name.removesuffix(SCALE_SUFFIX)
        if name != weight and own[weight].dtype == torch.uint8 and weight + MIN_SUFFIX not in own:
            state[weight + MIN_SUFFIX] = t * -8
    held = {torch.int8: np.dtype(np.int8), torch.uint8: np.dtype(np.uint8)}  # int8, 4-bit
    specs = {name: (tuple(t.shape), held.get(t.dtype) or
                    numpy_dtype(t.dtype, field=f"tensor '{name}'"))
             for name, t in state.items()}
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    write_native(path, model.config, specs, lambda name: to_numpy(state[name]), overwrite=overwrite,
                 quantization=quantization_of(model), **kwargs)
