"""Bugs planted in one twin or both, for the parity report's negative cases
(tests/test_parity_bugs.py, tests/test_gpu.py and scripts/parity_calibration.py). Each is a
context manager that yields the keyword arguments of parity_report (torch_model= and/or
jax_model=) for the broken twin(s), and patches module attributes for the optimizer bugs only
while it is open. The float64 reference reads the checkpoint and builds its own optimizer, so no
bug reaches it: a bug in both twins is caught against it, naming both."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

BLOCK = 1  # the block a weight bug is planted in
ROW = 0    # the row of feed_forward.w2 (an output channel of the block) the row bug scales

BUGS = ("weight", "decay_mask", "no_clipping", "qk_permuted_twice", "rope_theta", "norm_eps",
        "row_scaled", "rope_theta_small", "norm_eps_small", "no_zero_grad")
DESCRIPTIONS = {
    "weight": f"0.01 added to one weight of block {BLOCK} (feed_forward.w2[3, 5])",
    "decay_mask": "AdamW weight decay on every tensor (the norm gains too)",
    "no_clipping": "no gradient clipping",
    "qk_permuted_twice": "wq and wk rows permuted for half-split RoPE once more",
    "rope_theta": "RoPE theta 1% too large",
    "norm_eps": "RMSNorm eps 10x too large",
    "row_scaled": f"one row of block {BLOCK}'s feed_forward.w2 (row {ROW}) x (1 + 1e-3)",
    "rope_theta_small": "RoPE theta 0.1% too large",
    "norm_eps_small": "RMSNorm eps 2x too large",
    "no_zero_grad": "torch's gradients never zeroed between steps (each step adds to the last's)",
}
# Bugs only one twin can have: torch keeps its gradients between steps (optimizer.zero_grad
# clears them); JAX returns them. Only the training trajectory sees this one: the first step's
# loss and gradients come before it acts, and the optimizer figure sets the gradients itself.
TORCH_ONLY = ("no_zero_grad",)
# The subtle ones are targets in float32 only: in bfloat16 one rounding (4e-3) is larger than
# what they change. So is the gradients never zeroed: in bfloat16 the trajectory is its weights'
# rounding (a norm gain near 1 does not move by a step of 3e-3 at all, in either twin), and the
# figures that see an optimizer bug in bfloat16 (AdamW on shared gradients) set the gradients.
FLOAT32_ONLY = ("row_scaled", "rope_theta_small", "norm_eps_small", "no_zero_grad")
# The factor each config bug multiplies its field by.
FACTORS = {"rope_theta": 1.01, "rope_theta_small": 1.001, "norm_eps": 10.0,
           "norm_eps_small": 2.0, "row_scaled": 1.001}


# The twins a bug can be planted in: one of them, or both at once (a shared bug, which comparing
# the twins with each other cannot see and the float64 run can).
TWINS = ("torch", "JAX", "both")


@contextlib.contextmanager
def planted(bug: str, twin: str, path, dtype: str = "float32"):
    """Open `bug` in `twin` ("torch", "JAX" or "both") of the checkpoint at `path`; yields the
    keyword arguments for parity_report."""
    import jax_llama
    import torch_llama

    if twin not in TWINS or (bug in TORCH_ONLY and twin != "torch"):
        raise ValueError(f"{bug} in {twin}")
    with contextlib.ExitStack() as stack:
        kwargs = {}
        if twin in ("torch", "both"):
            tmodel = torch_llama.load(path, device="cpu", dtype=dtype)
            stack.enter_context(torch_bug(bug, tmodel))
            kwargs["torch_model"] = tmodel
        if twin in ("JAX", "both"):
            model, params = jax_llama.load(path, dtype=dtype)
            kwargs["jax_model"] = stack.enter_context(jax_bug(bug, model, params, path, dtype))
        yield kwargs


@contextlib.contextmanager
def torch_bug(bug: str, tmodel):
    """Open `bug` in the torch model `tmodel` itself (its weights or modules changed in place)."""
    import torch

    import torch_llama
    from bridge.formats.hf import to_half_split
    from bridge.rope import rope_inv_freq
    from torch_llama.model import RMSNorm

    c = tmodel.config
    with torch.no_grad():
        if bug == "weight":
            tmodel.layers[BLOCK].feed_forward.w2.weight[3, 5] += 0.01
        elif bug == "row_scaled":
            tmodel.layers[BLOCK].feed_forward.w2.weight[ROW] *= FACTORS[bug]
        elif bug == "qk_permuted_twice":
            for layer in tmodel.layers:
                for w, heads in ((layer.attention.wq, c.n_heads), (layer.attention.wk, c.n_kv_heads)):
                    permuted = to_half_split(w.weight.float().cpu().numpy(), heads)
                    w.weight.copy_(torch.from_numpy(permuted).to(w.weight.device, w.weight.dtype))
        elif bug in ("rope_theta", "rope_theta_small"):
            tmodel._inv_freq = rope_inv_freq(c.head_dim, c.rope_theta * FACTORS[bug],
                                             c.rope_scaling)
            tmodel._inv_freq_on.clear()
        elif bug in ("norm_eps", "norm_eps_small"):
            for module in tmodel.modules():
                if isinstance(module, RMSNorm):
                    module.eps *= FACTORS[bug]
    if bug == "decay_mask":
        with _patched(torch_llama, "decay_mask", lambda p: True):
            yield
    elif bug == "no_zero_grad":
        with _patched(torch_llama.AdamW, "zero_grad", lambda self, set_to_none=True: None):
            yield
    elif bug == "no_clipping":
        with _patched(torch_llama, "clip_by_global_norm", lambda parameters, max_norm: None):
            yield
    else:
        yield


@contextlib.contextmanager
def jax_bug(bug: str, model, params, path, dtype):
    """Open `bug` in the JAX twin loaded from `path`; yields the broken (model, params)."""
    import jax
    import optax

    import jax_llama.training.step as train
    from bridge.formats import open_checkpoint
    from bridge.formats.hf import to_half_split
    from jax_llama.checkpoint import params_from_tensors

    c = model.config
    if bug in ("weight", "qk_permuted_twice", "row_scaled"):
        ckpt = open_checkpoint(path)

        def get(name):
            t = ckpt.tensor(name).astype(np.float32)
            if bug == "weight" and name == f"layers.{BLOCK}.feed_forward.w2.weight":
                t = t.copy()
                t[3, 5] += 0.01
            if bug == "row_scaled" and name == f"layers.{BLOCK}.feed_forward.w2.weight":
                t = t.copy()
                t[ROW] *= np.float32(FACTORS[bug])
            if bug == "qk_permuted_twice" and name.endswith(("attention.wq.weight",
                                                             "attention.wk.weight")):
                t = to_half_split(t, c.n_heads if name.endswith("wq.weight") else c.n_kv_heads)
            return t
        yield model, params_from_tensors(get, c, dtype=dtype)
    elif bug in ("rope_theta", "norm_eps", "rope_theta_small", "norm_eps_small"):
        field = "rope_theta" if bug.startswith("rope") else "norm_eps"
        value = getattr(c, field) * FACTORS[bug]
        yield model.clone(config=dataclasses.replace(c, **{field: value})), params
    elif bug == "decay_mask":
        with _patched(train, "decay_mask", lambda p: jax.tree_util.tree_map(lambda _: True, p)):
            yield model, params
    elif bug == "no_clipping":
        original = train.make_optimizer

        def unclipped(tc):
            return optax.adamw(train.lr_schedule(tc), b1=tc.b1, b2=tc.b2, eps=tc.eps,
                               weight_decay=tc.weight_decay, mask=train.decay_mask)
        with _patched(train, "make_optimizer", unclipped):
            yield model, params
        assert train.make_optimizer is original
    else:
        raise ValueError(bug)


@contextlib.contextmanager
def _patched(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
