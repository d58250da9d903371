"""LoRA on the JAX model: add adapters to a model and its params, train only them, save them in
PEFT's format, merge them into the weights.

The model is handed them as its projections' `lora` (jax_llama.model.projections.Projections:
`model.projections.lora`, None without adapters); the architecture itself names no adapter.
The adapters live in the params pytree beside the weights they adapt (`wq/lora_A/kernel`,
`wq/lora_B/kernel`, float32), so one pytree goes through apply, jit, the mesh and orbax as before.
Which leaves train is a label per leaf (`trainable`); the optimizer (jax_llama.training.step) partitions
on it with optax.multi_transform, so the frozen weights get no update and no optimizer state.
With lora.train_embeddings the embedding table trains too, whole and in float32 (`trainable_for`).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from bridge.errors import BridgeError
from bridge.lora import INT8_TABLE, Adapter, LoraConfig, adapter_shapes, write_peft

from .checkpoint import params_from_tensors, tensor_specs
from .params import has_adapters
from .model.heads import LlamaClassifier
from .model.llama import Llama
from .model.projections import Projections

ADAPTER_KEYS = ("lora_A", "lora_B")


def _is_adapter(path, embeddings: bool = False) -> bool:
    return any(key in ADAPTER_KEYS for key in path) or embeddings and "tok_embeddings" in path


def _backbone_key(model) -> tuple[str, ...]:
    """Where the Llama's params sit: at the top for a Llama, under `llama` for a classifier."""
    return ("llama",) if isinstance(model, LlamaClassifier) else ()


def _backbone(model, params):
    for key in _backbone_key(model):
        params = params[key]
    return params


def trainable(params, embeddings: bool = False):
    """True for the leaves a LoRA run trains: the adapters, the embedding table when
    `embeddings`, and whatever is not the backbone (a classifier's head); False for the
    backbone's weights, which stay frozen."""
    return traverse_util.path_aware_map(
        lambda path, _: _is_adapter(path, embeddings) or path[0] == "classifier", params)


def trainable_for(lora: LoraConfig):
    """The `trainable` labelling (params -> True/False tree) of a run with these settings."""
    return functools.partial(trainable, embeddings=lora.train_embeddings)


def split(params, embeddings: bool = False):
    """(weights, adapters): two pytrees that `combine` joins back; with `embeddings` the
    embedding table goes with the adapters."""
    flat = traverse_util.flatten_dict(params)
    weights = {k: v for k, v in flat.items() if not _is_adapter(k, embeddings)}
    adapters = {k: v for k, v in flat.items() if _is_adapter(k, embeddings)}
    return traverse_util.unflatten_dict(weights), traverse_util.unflatten_dict(adapters)


def combine(weights, adapters):
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(weights),
                                         **traverse_util.flatten_dict(adapters)})


def _with_lora(model, lora: LoraConfig | None):
    """`model` handed the same projections with `lora` (None: without adapters)."""
    return model.clone(projections=model.projections.replace(lora=lora))


def add_lora(model, params, lora: LoraConfig, seed: int = 0, adapter: Adapter | None = None):
    """(the model with LoRA on lora.targets, params with adapters): fresh ones (A drawn from
    `seed`, B zero), or `adapter`'s tensors when given. Works on a Llama or a LlamaClassifier,
    either layer layout; the weights in `params` are kept as they are (any dtype), except the
    embedding table when lora.train_embeddings: float32 (or the adapter's), as it trains."""
    if not isinstance(model, (Llama, LlamaClassifier)):
        raise BridgeError(f"expected a Llama or LlamaClassifier, got {type(model).__name__}",
                          field="model")
    if model.projections.lora is not None or has_adapters(params):
        raise BridgeError("already has LoRA adapters", field="model")
    if lora.train_embeddings and "scale" in _backbone(model, params)["tok_embeddings"]:
        raise BridgeError(INT8_TABLE, field="train_embeddings")
    config, lora_model = model.config, _with_lora(model, lora)
    if adapter is not None:
        if adapter.lora != lora:
            raise BridgeError(f"the adapter's settings {adapter.lora} differ from {lora}",
                              field="lora")
        adapter.check(config)
        adapters = params_from_tensors(adapter.tensors.__getitem__, config, dtype=jnp.float32,
                                       scan_layers=model.scan_layers,
                                       shapes=adapter_shapes(config, lora))
    else:  # initialise the whole backbone, keep the adapters: XLA drops the rest unbuilt
        backbone = Llama(config, scan_layers=model.scan_layers,
                         projections=Projections(lora=lora))
        fresh = lambda key: split(backbone.init(key, jnp.zeros((1, 1), jnp.int32))["params"])[1]  # noqa: E731
        adapters = jax.jit(fresh)(jax.random.key(seed))
        if lora.train_embeddings:
            table = _backbone(model, params)["tok_embeddings"]["embedding"]
            adapters["tok_embeddings"] = {"embedding": table.astype(jnp.float32)}
    for key in reversed(_backbone_key(model)):
        adapters = {key: adapters}
    return lora_model, combine(params, adapters)


def adapter_of(model, params, base_model: str | None = None) -> Adapter:
    """The adapters in `params` as a bridge Adapter: canonical numpy float32 tensors."""
    lora = model.projections.lora
    if lora is None:
        raise BridgeError("the model has no LoRA adapters", field="model")
    adapters = _backbone(model, split(params, lora.train_embeddings)[1])
    shapes = adapter_shapes(model.config, lora)
    _, fetch = tensor_specs(adapters, model.config, shapes=shapes)
    return Adapter(lora, {name: np.asarray(fetch(name), np.float32) for name in shapes},
                   base_model)


def save_adapter(path: str | os.PathLike, model, params, *, base_model: str | None = None,
                 overwrite: bool = False):
    """Write the adapters as Hugging Face PEFT writes a LoRA adapter (bridge.lora.write_peft)."""
    return write_peft(path, model.config, adapter_of(model, params, base_model),
                      overwrite=overwrite)


def merge_lora(model, params):
    """(the model without LoRA, params with scale * A @ B added into each adapted kernel, in
    float32 and then the kernel's dtype): a plain model, as fast as one never adapted. A trained
    embedding table is rounded to the final norm's dtype, the base's, as the bridge merges it."""
    lora = model.projections.lora
    if lora is None:
        return model, params
    weights, adapters = split(params)
    flat, flat_adapters = traverse_util.flatten_dict(weights), traverse_util.flatten_dict(adapters)
    scale = lora.scale
    for path, a in flat_adapters.items():
        if path[-2] != "lora_A":
            continue
        b = flat_adapters[path[:-2] + ("lora_B", "kernel")]
        kernel_path = path[:-2] + ("kernel",)
        kernel = flat[kernel_path]
        update = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32))  # (.., in, out)
        flat[kernel_path] = (kernel.astype(jnp.float32) + scale * update).astype(kernel.dtype)
    if lora.train_embeddings:
        where = _backbone_key(model)
        table = where + ("tok_embeddings", "embedding")
        flat[table] = flat[table].astype(flat[where + ("norm", "weight")].dtype)
    return _with_lora(model, None), traverse_util.unflatten_dict(flat)


def count(params, which=None) -> int:
    """Parameters in `params`, or in the leaves whose `which` label is True."""
    leaves = jax.tree_util.tree_leaves(params)
    if which is None:
        return sum(int(np.prod(x.shape)) for x in leaves)
    return sum(int(np.prod(x.shape)) for x, t in zip(leaves, jax.tree_util.tree_leaves(which)) if t)
