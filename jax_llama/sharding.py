"""Where each array lives on a (data, fsdp, tensor) device mesh.

  data    pure data parallelism: parameters replicated, the batch split
  fsdp    parameters and optimizer state split along their model dimension, the batch split too
  tensor  Megatron-style: column-parallel projections (wq wk wv w1 w3 and the LM head) split their
          output features, row-parallel ones (wo w2) their input features, the embedding its vocab

The rules are by parameter role (the Flax path), so the optimizer's mu / nu, whose paths end with
the parameter's, follow their parameter. A dimension that does not divide by its mesh axis stays
whole rather than failing. The same code runs on 1 CPU, 8 simulated CPUs, a GPU node or a pod.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bridge.errors import BridgeError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch is split over both: FSDP is data parallel in compute

# Flax kernels are (in, out); the embedding is (vocab, dim).
_COLUMN = ("fsdp", "tensor")   # output features over tensor
_ROW = ("tensor", "fsdp")      # input features over tensor
_RULES = {"wq": _COLUMN, "wk": _COLUMN, "wv": _COLUMN, "w1": _COLUMN, "w3": _COLUMN,
          "output": _COLUMN, "wo": _ROW, "w2": _ROW}


def parse_mesh(spec: str | None, n_devices: int) -> dict[str, int]:
    """'data=2,fsdp=4,tensor=1' -> axis sizes; None puts every device on data. Axes not named
    are 1; the product must be the number of devices."""
    if not spec:
        return {"data": n_devices, "fsdp": 1, "tensor": 1}
    sizes = dict.fromkeys(AXES, 1)
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in AXES:
            raise BridgeError(f"unknown axis {name!r} in {spec!r}; axes are {', '.join(AXES)}",
                              field="mesh")
        if not value.strip().isdigit() or int(value) < 1:
            raise BridgeError(f"{name} must be a positive integer (got {value!r})", field="mesh")
        sizes[name] = int(value)
    used = int(np.prod(list(sizes.values())))
    if used != n_devices:
        raise BridgeError(f"{spec!r} uses {used} devices, but {n_devices} are available",
                          field="mesh")
    return sizes


def make_mesh(spec: str | None = None) -> Mesh:
    sizes = parse_mesh(spec, jax.device_count())
    # Auto axes: the compiler propagates shardings from the inputs (GSPMD); the model code stays
    # free of sharding annotations.
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def spec_for(path, shape: tuple[int, ...], mesh: Mesh) -> P:
    """PartitionSpec of one array from its pytree path (the names of its enclosing dicts)."""
    names = [getattr(k, "key", None) for k in path]
    names = [n for n in names if isinstance(n, str)]
    leaf = names[-1] if names else None
    if leaf == "kernel" and len(names) >= 2 and names[-2] in _RULES:
        axes = _RULES[names[-2]]
    elif leaf == "embedding":
        axes = ("tensor", "fsdp")
    else:
        return P()  # norms, step counters, scalars: replicated
    axes = (None,) * (len(shape) - len(axes)) + axes  # a scanned stack keeps its layer axis whole
    return P(*(a if a is not None and shape[i] % mesh.shape[a] == 0 else None
               for i, a in enumerate(axes)))


def tree_shardings(tree, mesh: Mesh):
    """A NamedSharding for every array of a pytree (params, optimizer state, a TrainState)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, spec_for(path, np.shape(x), mesh)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Assemble the global batch from each process's own rows (one process: all of them)."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def check_batch(batch_size: int, mesh: Mesh) -> None:
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch_size % split or batch_size % jax.process_count():
        raise BridgeError(f"{batch_size} does not divide over data x fsdp = {split} "
                          f"mesh slots and {jax.process_count()} process(es)", field="batch_size")
