"""int8 weight-only quantisation of a params pytree (bridge.quantize has the arithmetic).

    qparams = jax_llama.quantize(params)                  # per output channel
    qparams = jax_llama.quantize(params, group_size=64)   # per 64 input columns of each row
    logits = model.apply({"params": qparams}, tokens)     # the same module: a Linear whose
                                                          # params hold a `scale` runs int8
    jax_llama.save(path, config, qparams)                 # int8 + scales, declared in config.json

Each projection's `kernel` becomes int8 (in, out) beside a float32 `scale` (in / G, out). A tied
LM head is the embedding: its `embedding` becomes int8 (vocab, dim) beside a `scale` (vocab, dim /
G), one row per token. The norms, an untied embedding and any LoRA adapters are left as they are.
The numbers are those of bridge.quantize.quantize_weight on the canonical (out, in) weight, the
same the torch twin and `llama-bridge convert --quantize int8` compute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bridge.errors import BridgeError
from bridge.quantize import Quantization, quantize_weight

from .checkpoint import host_array, modules, quantization_of

PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")


def quantize(params, group_size: int | None = None, method: str = "int8"):
    """A copy of `params` with every projection and the LM head int8 (see the module docstring);
    refuses params that are quantised already, and a group size that does not divide a weight's
    inputs (naming it) before anything is converted."""
    quantization = Quantization(method, group_size)
    if quantization_of(params) is not None:
        raise BridgeError("already quantised", field="params")
    kernels = list(_projection_kernels(params))
    tables = list(_tied_embeddings(params))
    for path, leaf in kernels:
        quantization.groups(leaf.shape[-2], "/".join(path))
    for path, leaf in tables:
        quantization.groups(leaf.shape[-1], "/".join(path))

    def one(kernel_IO: np.ndarray, name: str):
        q_OI, scale_OG = quantize_weight(kernel_IO.T, group_size, name)
        return q_OI.T, scale_OG.T

    out = jax.tree_util.tree_map(lambda x: x, params)  # a new tree; the arrays are shared
    for path, leaf in kernels:
        host = host_array(leaf)
        name = "/".join(path)
        if host.ndim == 3:  # scan_layers: (L, in, out)
            pairs = [one(layer, f"{name}[{i}]") for i, layer in enumerate(host)]
            q, scale = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
        else:
            q, scale = one(host, name)
        _replace(out, path, q, scale)
    for path, leaf in tables:  # (vocab, dim) is the head's (out, in) as it is
        _replace(out, path, *quantize_weight(host_array(leaf), group_size, "/".join(path)))
    return out


def _replace(params, path, q, scale) -> None:
    """The weight at `path` (a kernel or an embedding) becomes int8 `q`, with `scale` beside it."""
    node = params
    for key in path[:-1]:
        node = node[key]
    node[path[-1]], node["scale"] = jnp.asarray(q), jnp.asarray(scale)


def _tied_embeddings(params):
    """(path to the table, table) of the token embedding of a model whose LM head is tied to it:
    a `tok_embeddings` beside no `output`."""
    for path, node in modules(params):
        table = node.get("tok_embeddings", {}).get("embedding")
        if table is not None and "output" not in node:
            yield path + ("tok_embeddings", "embedding"), table


def _projection_kernels(params):
    """(path to the kernel, kernel) of every projection: a module named wq ... w3 or output."""
    for path, node in modules(params):
        if path and path[-1] in PROJECTIONS and "kernel" in node:
            yield path + ("kernel",), node["kernel"]
