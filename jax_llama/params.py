"""The Flax params pytree as the rest of jax_llama reads it: where each canonical tensor lives in
it, which modules it holds, how their weights are held (float, int8, 4-bit; LoRA adapters beside
them), and one array gathered onto this host. jax_llama.checkpoint (load, save) and
jax_llama.quantize both build on these.

The map is a rule, not a table: `tok_embeddings.weight` is the Embed's `embedding`, `*norm.weight`
is an RMSNorm's `weight` (q_norm and k_norm included), a projection's bias (`*.wq.bias`) its
Attention's `wq_bias`, and every other 2-D weight is a Dense `kernel`, stored transposed
(Flax kernels are (in, out), canonical weights (out, in)). `layers.{i}.*` lives under `layers_{i}`,
or, with scan_layers, under `layers` with the layer index as the leading axis.
"""

from __future__ import annotations

import jax
import numpy as np

from bridge.int4 import mixture_refused
from bridge.quantize import MIN_SUFFIX, SCALE_SUFFIX, Quantization


PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")  # modules quantisation covers


def flax_path(name: str, scan_layers: bool) -> tuple[tuple[str, ...], int | None, bool]:
    """Canonical name -> (path in the params pytree, layer index on a stacked axis, transposed?).
    An int8 projection's `<name>_scale` (out, in / G) is its module's `scale` (in / G, out); an
    int8 embedding's (vocab, dim / G) is its `scale` as it is. (A 4-bit projection's `kernel`,
    `scale` and `min` are its canonical rows, not transposed: tensor_specs sees to that.)"""
    if name.endswith(MIN_SUFFIX):
        path, layer, _ = flax_path(name.removesuffix(MIN_SUFFIX), scan_layers)
        return (*path[:-1], "min"), layer, False
    module, leaf = name.rsplit(".", 1)  # drop ".weight" / ".weight_scale"
    parts = module.split(".")
    layer = None
    if parts[0] == "layers":
        layer = int(parts[1])
        parts = (["layers"] if scan_layers else [f"layers_{layer}"]) + parts[2:]
        layer = layer if scan_layers else None
    if parts == ["tok_embeddings"]:  # (vocab, dim) as it is; int8, its scale (vocab, G) too
        return (*parts, "scale" if leaf == "weight" + SCALE_SUFFIX else "embedding"), layer, False
    if parts[-1].endswith("norm"):
        return (*parts, "weight"), layer, False
    if leaf == "bias":  # a projection's bias (qkv_bias) is its Attention's `<projection>_bias`
        return (*parts[:-1], f"{parts[-1]}_bias"), layer, False
    return (*parts, "scale" if leaf == "weight" + SCALE_SUFFIX else "kernel"), layer, True


def int8_only(quantization: Quantization | None) -> Quantization | None:
    """The quantisation a load reads tensor by tensor, its scales beside the weights: int8's.
    (A 4-bit checkpoint's weights come whole from bridge.int4.StoredReader.)"""
    return quantization if quantization is not None and quantization.method == "int8" else None


def has_adapters(params) -> bool:
    """True when the params pytree holds LoRA adapters (lora_A / lora_B entries)."""
    return any(getattr(k, "key", None) in ("lora_A", "lora_B")
               for path, _ in jax.tree_util.tree_leaves_with_path(params) for k in path)


def quantization_of(params) -> Quantization | None:
    """The Quantization a params pytree holds (jax_llama.quantize), read from its first `scale`:
    int8, the group size in / G (G = 1: per channel); int4 where a kernel is 4-bit (uint8
    rows, with a `min` or without: Q4_0's -8 scale; every projection then 4-bit: a mixture, as
    a nearest load of a file with 6- and 8-bit tensors holds it, is refused). None for float
    params."""
    if any(four_bit(node) for _, node in modules(params)):
        mixed = [path for path, node in modules(params)
                 if "kernel" in node and not four_bit(node) and path[-1] in PROJECTIONS]
        if mixed:
            raise mixture_refused("/".join(mixed[0]), field="params")
        return Quantization("int4")
    for path, node in modules(params):
        if "scale" in node and "kernel" in node:
            inputs, groups = node["kernel"].shape[-2], node["scale"].shape[-2]
        elif "scale" in node and "embedding" in node:  # a tied head: (vocab, dim), (vocab, G)
            inputs, groups = node["embedding"].shape[-1], node["scale"].shape[-1]
        else:
            continue
        return Quantization(group_size=None if groups == 1 else inputs // groups)
    return None


def four_bit(node: dict) -> bool:
    """Whether a module's params are a 4-bit weight (its kernel uint8 rows)."""
    kernel = node.get("kernel")
    return getattr(kernel, "dtype", None) == np.uint8


def modules(params, path=()):
    """(path, dict) of every module's params in the tree, depth first."""
    if isinstance(params, dict):
        yield path, params
        for key, value in params.items():
            yield from modules(value, path + (key,))


def is_scanned(params) -> bool:
    """True when the params pytree holds the blocks stacked under `layers` (scan_layers=True)."""
    return "layers" in params


def host_array(x) -> np.ndarray:
    """One array on this host, whole: from its devices, or, sharded over several processes,
    gathered from all of them (a collective: every process must ask, in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
