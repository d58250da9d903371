"""Canonical flat tensors <-> the Flax params pytree, and the load/save contract on top of them.
Where each tensor lives in the pytree (the map is a rule, not a table) is jax_llama.params'.
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import numpy as np

from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.formats import Checkpoint, open_checkpoint, write_native
from bridge.formats.base import check_specs
from bridge.int4 import minima_implied
from bridge.layout import decide_layout, held_as
from bridge.lora import read_peft
from bridge.progress import note, reading
from bridge.resources import gc_paused, small_pages
from bridge.quantize import MIN_SUFFIX, checkpoint_shapes
from bridge.tensors import canonical_shapes

from .model.attention import choose
from .model.llama import Llama, resolve_dtype
from .model.projections import choose as choose_projections, implementation
from .params import (flax_path, four_bit, has_adapters, host_array, int8_only, is_scanned,
                     quantization_of)


def _on_device(values: list[np.ndarray]) -> list[jax.Array]:
    """Host arrays on the default device: one jax.device_put of them all, where jnp.asarray
    compiles a small program for each new shape (11 of SmolLM2's, 0.17 s of its load) and a
    device_put each took twice as long for SmolLM2's 693 small ones."""
    return jax.device_put([np.asarray(v) for v in values])


# Host bytes params_from_tensors holds before putting them on the device together (_on_device):
# a 4-bit or aligned array is aliased, not copied, so mostly none beside what the device holds.
PUT_TOGETHER_BYTES = 64 << 20


@jax.jit
def _transposed(x):
    """x.T on the device, by XLA: int8 rows (an untied LM head's, a file's 6- and 8-bit
    projections') as the (in, out) kernel their Linear holds. LLaMA 3 8B's head (128256 x 4096)
    in 0.28 s, where jax.device_put of numpy's transposed view took 0.42 s and numpy's own copy
    longer (AMD EPYC Zen 4, 2 cores); each new shape costs a compile (about 0.15 s)."""
    return x.T


def params_from_tensors(get: Callable[[str], np.ndarray], config: LlamaConfig, *,
                        scan_layers: bool = False, dtype=None, shapes=None, int4=None):
    """Build the params pytree, reading canonical tensors one at a time with `get(name)`.

    shapes: the tensors to read, name -> canonical shape; default the whole model's
    (bridge.tensors.canonical_shapes), or e.g. a LoRA adapter's (bridge.lora.adapter_shapes).
    With scan_layers each per-layer tensor is gathered into one (L, ...) host buffer, so peak
    host memory is one stacked tensor, not the model. int4(name) -> (packed, scale, min) of a
    4-bit projection or (q, scale) of int8 rows (bridge.int4.QuantisedReader), or None to read it
    as `get` gives it: its module then holds those weights, as jax_llama.quantize makes them.
    """
    dtype = None if dtype is None else np.dtype(resolve_dtype(dtype))
    shapes = canonical_shapes(config) if shapes is None else shapes
    params: dict = {}
    pending: list = []  # (node, leaf, host array, transposed), put on the device together
    held = 0  # their bytes

    def module(path) -> dict:  # the params of the module `path` ends in, made as needed
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        return node

    def flush():
        nonlocal held
        for (node, leaf, _, flip), value in zip(pending, _on_device([v for _, _, v, _ in pending])):
            node[leaf] = _transposed(value) if flip else value
        pending.clear()
        held = 0

    def later(node, leaf, value, flip=False):
        nonlocal held
        pending.append((node, leaf, value, flip))
        held += value.nbytes
        if held >= PUT_TOGETHER_BYTES:
            flush()

    def put(path, value):
        keep = dtype is None or value.dtype == np.int8 or path[-1] == "scale"  # int8 stays int8
        later(module(path), path[-1], value if keep else value.astype(dtype))

    def read(name: str) -> np.ndarray:  # in the Flax layout
        value = get(name)
        if tuple(value.shape) != shapes[name]:
            raise BridgeError(f"tensor '{name}': shape {tuple(value.shape)}, config implies "
                              f"{shapes[name]}")
        return value.T if flax_path(name, scan_layers)[2] else value

    for name in shapes:
        if not (scan_layers and name.startswith("layers.")):
            quantised = None if int4 is None else int4(name)
            if quantised is not None:  # (packed, scale, min) of a 4-bit projection: its rows as
                path, _, transposed = flax_path(name, scan_layers)  # they are; (q, scale) of
                node = module(path)  # int8 rows: transposed as a kernel is, where it is one
                flip = transposed and len(quantised) == 2
                if len(quantised) == 3 and minima_implied(*quantised[1:]):
                    quantised = quantised[:2]  # Q4_0's form: m = -8 d, not held (nor read)
                for leaf, value in zip((path[-1], "scale", "min"), quantised):
                    later(node, leaf, value, flip)
                continue
            put(flax_path(name, scan_layers)[0], read(name))
    if scan_layers:
        for suffix in [n.split(".", 2)[2] for n in shapes if n.startswith("layers.0.")]:
            first = read(f"layers.0.{suffix}")
            stacked = np.empty((config.n_layers, *first.shape), dtype=first.dtype)
            stacked[0] = first
            for i in range(1, config.n_layers):
                stacked[i] = read(f"layers.{i}.{suffix}")
            put(flax_path(f"layers.0.{suffix}", scan_layers)[0], stacked)
    flush()
    return params


def tensor_specs(params, config: LlamaConfig, shapes=None):
    """(specs, fetch) for writing `params` as canonical tensors, one host copy at a time.

    specs: name -> (canonical shape, numpy dtype); fetch(name) -> that tensor as a numpy array.
    shapes: the tensors `params` holds (as in params_from_tensors; default the whole model's).
    Refuses params that do not match (missing or extra leaves), naming the tensor.
    """
    scanned = is_scanned(params)
    leaves: dict[str, tuple] = {}
    whole_model = shapes is None
    if whole_model:
        shapes = checkpoint_shapes(config, quantization_of(params))
    implied = set()  # the minima of 4-bit weights held without them: written as -8 scale
    for name in shapes:
        path, layer, transposed = flax_path(name, scanned)
        node = parent = params
        for key in path:
            if (name.endswith(MIN_SUFFIX) and key == "min" and isinstance(node, dict)
                    and key not in node and four_bit(node)):
                implied.add(name)
                node = node["scale"]
                break
            if not isinstance(node, dict) or key not in node:
                raise BridgeError(f"params: no entry {'/'.join(path)} for tensor '{name}'")
            parent, node = node, node[key]
        if four_bit(parent) or name in implied:
            transposed = False  # 4-bit weights, their scales and minima: canonical rows
        leaves[name] = (node, layer, transposed)
    n_leaves = len(jax.tree_util.tree_leaves(params))
    n_expected = len({id(leaf) for n, (leaf, _, _) in leaves.items() if n not in implied})
    if whole_model and has_adapters(params):
        raise BridgeError("params hold LoRA adapters, which a checkpoint cannot: merge them "
                          "(jax_llama.merge_lora) or save the adapter alone "
                          "(jax_llama.save_adapter)", field="params")
    if n_leaves != n_expected:
        raise BridgeError(f"params: {n_leaves} arrays, but the config accounts for {n_expected} "
                          f"(extra entries would be lost)")

    def shape_of(leaf, layer, transposed):
        shape = leaf.shape[1:] if layer is not None else leaf.shape
        return tuple(reversed(shape)) if transposed else tuple(shape)

    specs = {name: (shape_of(*entry), np.dtype(entry[0].dtype)) for name, entry in leaves.items()}

    def fetch(name: str) -> np.ndarray:
        leaf, layer, transposed = leaves[name]
        value = host_array(leaf[layer] if layer is not None else leaf)
        if name in implied:
            value = value * value.dtype.type(-8)  # exact (bridge.int4.minima_implied)
        return value.T if transposed else value

    return specs, fetch


def save(path: str | os.PathLike, config: LlamaConfig, params, *, overwrite: bool = False,
         max_shard_size: int | None = None, extra_files=(), write_extra=None) -> None:
    """Write `params` (either layout) as a native checkpoint at `path`, atomically.
    extra_files (tokenizer files) are copied in; write_extra(directory) may add files.

    A model sharded over several processes is gathered one tensor at a time and written by
    process 0 alone; every process must call save (the gathers are collective)."""
    specs, fetch = tensor_specs(params, config)
    quantization = quantization_of(params)
    if jax.process_index() != 0:
        for name in check_specs(config, specs, "tensors to write",  # write_native's order
                                quantization=quantization):
            fetch(name)
        return
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    write_native(path, config, specs, fetch, overwrite=overwrite, extra_files=extra_files,
                 write_extra=write_extra, quantization=quantization, **kwargs)



def params_on_mesh(read: Callable[[str, tuple[slice, ...]], np.ndarray], config: LlamaConfig,
                   mesh, *, scan_layers: bool = False, dtype=None):
    """The params pytree built straight onto `mesh`, sharded by jax_llama.sharding's rules: each
    array is made with jax.make_array_from_callback, which asks only for the parts this
    process's devices hold, and read(name, index) reads just that part of a canonical tensor.
    Host memory is then this process's share of the model plus about one part."""
    from jax.sharding import NamedSharding

    from .sharding import spec_for

    dtype = None if dtype is None else np.dtype(resolve_dtype(dtype))
    shapes = canonical_shapes(config)
    groups: dict[tuple[str, ...], list[str]] = {}  # params path -> its canonical names, by layer
    for name in shapes:
        groups.setdefault(flax_path(name, scan_layers)[0], []).append(name)
    params: dict = {}
    for path, names in groups.items():
        _, layer, transposed = flax_path(names[0], scan_layers)
        shape = tuple(reversed(shapes[names[0]])) if transposed else shapes[names[0]]
        stacked = layer is not None
        if stacked:
            shape = (len(names), *shape)
        keys = [jax.tree_util.DictKey(k) for k in path]
        sharding = NamedSharding(mesh, spec_for(keys, shape, mesh))

        def part(index, names=names, stacked=stacked, transposed=transposed, shape=shape):
            index = tuple(index) + (slice(None),) * (len(shape) - len(index))
            layers = range(*index[0].indices(shape[0])) if stacked else [None]
            inner = index[1:] if stacked else index
            canonical = tuple(reversed(inner)) if transposed else inner
            pieces = []
            for i in layers:
                piece = read(names[0] if i is None else names[i], canonical)
                piece = piece.T if transposed else piece
                pieces.append(piece if dtype is None else piece.astype(dtype))
            return np.stack(pieces) if stacked else pieces[0]

        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jax.make_array_from_callback(shape, sharding, part)
    return params


def load(path: str | os.PathLike | Checkpoint, dtype=None, *, scan_layers: bool = False,
         remat: bool = False, attention: str = "auto", adapter: str | os.PathLike | None = None,
         mesh=None, kernels: str = "auto", progress: bool = False, quantize: str | None = None,
         group_size: int | None = None):
    """(Llama module, params) from a checkpoint of any supported format: a path, or a checkpoint
    already opened (bridge.formats.open_checkpoint), which is then not opened again.

    dtype None keeps the stored dtype (float32 when tensors are mixed); otherwise a dtype or its
    name, used for the params and for compute. attention: the implementation
    (jax_llama.model.attention).
    kernels: how projections and cached attention run, auto, xla or kernels
    (jax_llama.model.projections).
    adapter: a PEFT LoRA adapter directory, merged into the weights as they are read (a plain
    model; jax_llama.add_lora keeps an adapter separate, for training it further).
    mesh: build the params already sharded on it by the training rules (jax_llama.sharding),
    each process reading only the parts its devices hold: safetensors formats (native, HF) read
    those parts alone; Meta and llama2.c files, and a merged adapter, read each tensor whole.
    progress: a bar on stderr counting the tensors read (bridge.progress).
    quantize, group_size: how the weights are held (bridge.layout.decide_layout, which
    torch_llama.load asks too): None float; "int8" int8 with a scale per output channel (or per
    group_size inputs), quantised as each weight is read; "int4" the projections as 4-bit
    weights, read as the file holds them where it holds them so exactly (a GGUF's Q4_0 / Q4_1),
    else quantised as each is read, a tied LM head as int8 rows; "stored" each tensor a
    quantised file holds in its nearest layout (a GGUF's Q4_0 / Q4_1 as 4-bit weights exactly,
    Q5 ... Q8_0 as int8 rows), memory about the file's size; "auto" stored where the file
    holds quantised tensors and neither dtype nor adapter is given, else float - what the
    commands do without --quantize. A native int8 or 4-bit checkpoint loads as it is stored.
    With progress, the layout chosen, what was read how (and the error of what was quantised)
    are said on stderr.
    """
    choose(attention, 1, 1)
    implementation(kernels)  # a bad name, or kernels that cannot run here, refused as early
    with gc_paused(), small_pages():
        return _load(path, dtype, scan_layers, remat, attention, adapter, mesh, kernels, progress,
                     quantize, group_size)


def _load(path, dtype, scan_layers, remat, attention, adapter, mesh, kernels, progress, quantize,
          group_size):
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    layout = decide_layout(ckpt, quantize, group_size, dtype, adapter=adapter is not None,
                           whole="scan_layers" if scan_layers else None)
    if mesh is not None and (layout.native or layout.weights != "float"):
        raise BridgeError(f"not with {layout.weights} weights from {ckpt.path} (load it whole)",
                          field="mesh")
    if progress and (said := layout.describe(ckpt.path)):
        note(said)
    dtype = resolve_dtype(ckpt.stored_dtype() if dtype is None else dtype)
    get = ckpt.tensor
    read = ckpt.tensor_slice
    if adapter is not None:
        lora_adapter = read_peft(adapter, ckpt.config)
        get = lambda name: lora_adapter.merged(name, ckpt.tensor(name))  # noqa: E731
        read = lambda name, index: np.ascontiguousarray(get(name)[index])  # noqa: E731
    if mesh is not None:
        params = params_on_mesh(read, ckpt.config, mesh, scan_layers=scan_layers, dtype=dtype)
    else:
        make = layout.reader(ckpt)
        four = None if make is None else make(get)  # get is ckpt.tensor: no adapter with these
        if hasattr(four, "rows") and getattr(ckpt, "reads_rows", False):
            four.rows = ckpt.tensor_slice  # what it quantises, read a chunk of rows at a time
        shapes = checkpoint_shapes(ckpt.config, int8_only(ckpt.quantization))
        get, shown = reading(get, len(shapes), enabled=progress)  # a tick a name read

        def held(name: str):  # a weight the reader gives (its parts read as it likes): a tick
            value = four(name)
            if value is not None:
                shown.update(1)
            return value
        with shown:
            params = params_from_tensors(get, ckpt.config, scan_layers=scan_layers, dtype=dtype,
                                         shapes=shapes, int4=None if four is None else held)
        if four is not None and progress and four.summary():
            note(f"{ckpt.path}: {four.summary()}")
    if layout.after:  # int8 in groups of inputs, or of weights an adapter was merged into
        from .quantize import quantize as quantized
        params = quantized(params, layout.group_size, progress=progress)
    model = Llama(ckpt.config, dtype=dtype, param_dtype=dtype, scan_layers=scan_layers, remat=remat,
                  attention=attention, projections=choose_projections(kernels))
    return model, params


def held_layouts(params, config: LlamaConfig) -> dict[str, str]:
    """Canonical weight name -> how `params` hold it: "int4", "int8" or its float dtype's name
    (bridge.layout.held_as; torch_llama.checkpoint.held_layouts is the twin)."""
    scanned = is_scanned(params)
    out = {}
    for name in canonical_shapes(config):
        node = params
        for key in flax_path(name, scanned)[0]:
            node = node[key]
        out[name] = held_as(node.dtype)
    return out
