"""int8 weight-only quantisation of a params pytree (bridge.quantize has the arithmetic).

    qparams = jax_llama.quantize(params)                  # per output channel
    qparams = jax_llama.quantize(params, group_size=64)   # per 64 input columns of each row
    qparams = jax_llama.quantize(params, method="int4")   # 4 bits, a scale and a minimum per 32
    logits = model.apply({"params": qparams}, tokens)     # the same module: a Linear whose
                                                          # params hold a `scale` runs int8
    jax_llama.save(path, config, qparams)                 # int8 + scales, declared in config.json

Each projection's `kernel` becomes int8 (in, out) beside a float32 `scale` (in / G, out). A tied
LM head is the embedding: its `embedding` becomes int8 (vocab, dim) beside a `scale` (vocab, dim /
G), one row per token. The norms, an untied embedding and any LoRA adapters are left as they are.
The numbers are those of bridge.quantize.quantize_weight on the canonical (out, in) weight, the
same the torch twin and `llama-bridge convert --quantize int8` compute.

method="int4" (bridge.int4): each projection's `kernel` becomes uint8 (out, in / 2) - stored as
its canonical rows, which the decode kernels read whole (matvec_int4), not transposed as float
kernels are - two 4-bit weights a byte, beside a float16 `scale` and `min` (out, in / 32); a tied
LM head (the embedding) becomes int8 with one scale per row, as method="int8" makes it (the decode
kernels read its rows; 4-bit rows would be read no faster); an untied embedding and the norms stay
as they are. Such params run (jax_llama.model.projections: the decode kernels' matvec_int4, else
int4_matmul), and jax_llama.save writes them as they are (bridge.quantize's "int4" method).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bridge.errors import BridgeError
from bridge.int4 import quantize_int4
from bridge.progress import LOAD_DELAY_S, bar
from bridge.quantize import Quantization, quantize_weight

from .params import PROJECTIONS, host_array, modules, quantization_of


def quantize(params, group_size: int | None = None, method: str = "int8",
             progress: bool = False):
    """A copy of `params` with every projection and the LM head int8 (see the module docstring);
    refuses params that are quantised already, and a group size that does not divide a weight's
    inputs (naming it) before anything is converted. progress: a bar on stderr counting the
    weights quantised, once it has taken a few seconds (bridge.progress)."""
    if quantization_of(params) is not None:
        raise BridgeError("already quantised", field="params")
    if method == "int4":
        return _quantize_int4(params, group_size)
    quantization = Quantization(method, group_size)
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
    shown = bar(desc="quantising", unit="weight", total=len(kernels) + len(tables),
                enabled=progress, leave=False, delay=LOAD_DELAY_S)
    for path, leaf in kernels:
        shown.update(1)
        host = host_array(leaf)
        name = "/".join(path)
        if host.ndim == 3:  # scan_layers: (L, in, out)
            pairs = [one(layer, f"{name}[{i}]") for i, layer in enumerate(host)]
            q, scale = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
        else:
            q, scale = one(host, name)
        _replace(out, path, q, scale)
    for path, leaf in tables:  # (vocab, dim) is the head's (out, in) as it is
        shown.update(1)
        _replace(out, path, *quantize_weight(host_array(leaf), group_size, "/".join(path)))
    shown.close()
    return out


def _quantize_int4(params, group_size: int | None):
    """quantize(params, method="int4"): every projection's kernel as 4-bit weights."""
    from bridge.int4 import GROUP

    if group_size not in (None, GROUP):
        raise BridgeError(f"4-bit weights come in groups of {GROUP} inputs (got {group_size})",
                          field="group_size")
    kernels = list(_projection_kernels(params))
    for path, leaf in kernels:
        if leaf.shape[-2] % GROUP:
            raise BridgeError(f"{'/'.join(path)}: {leaf.shape[-2]} input columns are not a "
                              f"multiple of {GROUP}", field="params")

    def one(kernel_IO: np.ndarray, name: str):  # the canonical (out, ...) rows, not transposed
        return quantize_int4(kernel_IO.T, name)

    out = jax.tree_util.tree_map(lambda x: x, params)
    for path, leaf in _tied_embeddings(params):  # the head's rows, int8 (as method="int8")
        _replace(out, path, *quantize_weight(host_array(leaf), None, "/".join(path)))
    for path, leaf in kernels:
        host, name = host_array(leaf), "/".join(path)
        if host.ndim == 3:  # scan_layers: (L, in, out) -> (L, out, in / 2) ...
            parts = [one(layer, f"{name}[{i}]") for i, layer in enumerate(host)]
            packed, scale, low = (np.stack([p[k] for p in parts]) for k in range(3))
        else:
            packed, scale, low = one(host, name)
        _replace(out, path, packed, scale, low)
    return out


def _replace(params, path, q, scale, low=None) -> None:
    """The weight at `path` (a kernel or an embedding) becomes int8 `q`, with `scale` beside it
    (4-bit: packed `q`, `scale` and the minimum `low`, as `min`)."""
    node = params
    for key in path[:-1]:
        node = node[key]
    node[path[-1]], node["scale"] = jnp.asarray(q), jnp.asarray(scale)
    if low is not None:
        node["min"] = jnp.asarray(low)


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
