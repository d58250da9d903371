"""Run by test_multiprocess.py with 8 simulated CPU devices: a checkpoint loaded straight onto a
mesh (jax_llama.load(path, mesh=...)) against a plain load, for native and HF files, three
meshes, both layer layouts. Prints one JSON line per case: whether every parameter is equal bit
for bit, and the largest part of any tensor read at once against a device's share of it.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_load.py DIR
"""

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np

import jax_llama
from bridge.config import LlamaConfig
from bridge.convert import convert
from bridge.formats import open_checkpoint
from jax_llama.checkpoint import params_on_mesh
from jax_llama.params import flax_path
from jax_llama.sharding import make_mesh, spec_for
from jax.sharding import NamedSharding

MESHES = ["fsdp=8", "data=2,fsdp=2,tensor=2", "tensor=8"]


def main(root: Path) -> None:
    assert jax.device_count() == 8, jax.devices()
    # 8 query heads and 4 kv heads of 8: with tensor=8, wk's 32 rows split in half-heads, which
    # the HF reader must un-permute from whole heads and cut.
    config = LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=128,
                         max_seq_len=32, rope_theta=10000.0)
    _, params = jax_llama.init(config, seed=0)
    jax_llama.save(root / "native", config, params)
    convert(root / "native", root / "hf", to="hf", progress=False)
    for fmt in ("native", "hf"):
        ckpt = open_checkpoint(root / fmt)
        for spec in MESHES:
            mesh = make_mesh(spec)
            for scan in (False, True):
                reads: dict[str, int] = {}

                def read(name, index):
                    part = ckpt.tensor_slice(name, index)
                    reads[name] = max(reads.get(name, 0), part.size)
                    return part

                on_mesh = params_on_mesh(read, config, mesh, scan_layers=scan, dtype="float32")
                _, loaded = jax_llama.load(root / fmt, scan_layers=scan, mesh=mesh)
                _, plain = jax_llama.load(root / fmt, scan_layers=scan)
                equal = all(np.array_equal(np.asarray(a), np.asarray(b)) and
                            np.array_equal(np.asarray(a), np.asarray(c))
                            for a, b, c in zip(jax.tree.leaves(plain), jax.tree.leaves(loaded),
                                               jax.tree.leaves(on_mesh)))
                worst, share = 0.0, 0.0
                for name, (shape, _) in ckpt.specs.items():
                    path, layer, transposed = flax_path(name, False)
                    leaf_shape = tuple(reversed(shape)) if transposed else shape
                    keys = [jax.tree_util.DictKey(k) for k in path]
                    sharding = NamedSharding(mesh, spec_for(keys, leaf_shape, mesh))
                    part = math.prod(sharding.shard_shape(leaf_shape))
                    if fmt == "hf" and name.endswith(("wq.weight", "wk.weight")):
                        rows = sharding.shard_shape(leaf_shape)[1]  # whole heads are read
                        part = part // rows * (-(-rows // config.head_dim) * config.head_dim)
                    fraction, expected = reads[name] / math.prod(shape), part / math.prod(shape)
                    if fraction - expected > worst - share:
                        worst, share = fraction, expected
                print(json.dumps({"format": fmt, "mesh": spec, "scan_layers": scan,
                                  "equal": bool(equal), "largest_read_fraction": worst,
                                  "expected_fraction": share}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
