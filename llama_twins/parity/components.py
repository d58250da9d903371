"""The figures of one component each, apart from the forward pass: RoPE over the context, the
weights each twin holds, and RMSNorm near its eps. Each sees a bug too small for the forward
figures in bfloat16."""

from __future__ import annotations

import numpy as np

from bridge.dtypes import dtype_name

from .judgement import WEIGHT_ULPS, _compare, _f64, _row, _ulp

# The RoPE figure rotates one random vector per position at positions 0 .. P - 1, P the
# checkpoint's max_seq_len up to this: the 16 tokens of the batch turn the slow frequencies by
# next to nothing, so a wrong theta or llama3 scaling hides there; over thousands of positions it
# turns them by radians. Both twins compute RoPE's angles, cos and sin in float32 whatever the
# model's dtype, so the figure is judged as float32 in every report.
ROPE_POSITIONS = 4096


def _rope_check(model, tmodel, config, seed: int, reference_f64: bool) -> dict:
    """Each twin's rotation (its own frequencies: the JAX model's config, the torch model's
    buffer; its own rope_cos_sin and rotate) of one random float32 vector per position, against
    the exact rotation by the checkpoint's frequencies."""
    import jax.numpy as jnp
    import torch

    import jax_llama.model.llama as jm
    import torch_llama.model as tm
    from bridge.rope import rope_inv_freq

    c = model.config
    P = min(config.max_seq_len, ROPE_POSITIONS)
    positions = np.arange(P)
    x = np.random.default_rng(seed).standard_normal((1, P, 1, config.head_dim)).astype(np.float32)
    ours = jm.rotate(jnp.asarray(x), *jm.rope_cos_sin(
        positions, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)))
    theirs = tm.rotate(torch.as_tensor(x), *tm.rope_cos_sin(
        torch.as_tensor(positions), tmodel._inv_freq_for(torch.device("cpu"))))
    truth = None
    if reference_f64:
        from ..float64 import rotation
        truth = rotation(x, config, positions)
    return _compare(f"RoPE, positions 0-{P - 1}", "torch vs JAX",
                    {"JAX": np.asarray(ours), "torch": theirs.numpy()}, truth, "float32", "rope",
                    detail="float32 in every dtype (both twins' RoPE is float32)", ops=P)


# The weights figure: every tensor each twin holds against the checkpoint's value rounded to the
# report's dtype (round to nearest even, what both twins' loaders do), in units of that value's
# spacing in the dtype (its ulp). A correct loader is 0 ulps off; the bound allows 1, for a loader
# that rounds another way. A wrong weight is many ulps off in any dtype: 0.01 on a weight of 0.05
# is 40 bfloat16 ulps, 5 million float32 ones. It is exact, so a bug that moves the outputs less
# than bfloat16 rounds them is still seen here, and the tensor names its block.


def _weights_check(model, params, tmodel, held: dict[str, np.ndarray], dtype: str) -> dict:
    """Each twin's weights (JAX: its params in canonical layout; torch: its state_dict) against
    `held`, the checkpoint rounded to `dtype`, in ulps of the dtype, tensor by tensor."""
    from jax_llama.checkpoint import tensor_specs

    jax_tensor = tensor_specs(params, model.config)[1]
    torch_tensors = tmodel.state_dict()
    worst = {"JAX": 0.0, "torch": 0.0}
    difference, first_off, worst_name = 0.0, None, None
    for name, truth in held.items():
        spacing = _ulp(truth)
        truth = truth.astype(np.float64)
        ours, theirs = _f64(jax_tensor(name)), _f64(torch_tensors[name])
        off = {"JAX": float((np.abs(ours - truth) / spacing).max()),
               "torch": float((np.abs(theirs - truth) / spacing).max())}
        between = float((np.abs(ours - theirs) / spacing).max())
        if first_off is None and max(off.values()) > WEIGHT_ULPS:
            first_off = name
        if between > difference:
            difference, worst_name = between, name
        worst = {k: max(worst[k], off[k]) for k in worst}
    named = first_off or worst_name
    block = (int(named.split(".")[1]) if named is not None and named.startswith("layers.")
             else None)
    detail = (f"ulps of {dtype_name(dtype)}, every tensor against the checkpoint rounded to it"
              + (f"; first tensor off: {first_off}" if first_off else
                 f"; largest in {worst_name}" if worst_name else ""))
    return dict(_row("weights as loaded", "torch vs JAX", difference, worst, dtype, "weights",
                     detail), block=block, tensor=first_off)


# The RMSNorm figure: each twin's RMSNorm, with the eps it carries (the JAX config's, every torch
# module's own), on float32 rows whose mean square runs from eps / 100 to 100 eps, where eps
# weighs: in the model's activations (mean squares near 1, bfloat16 rounding 4e-3) an eps 10x too
# large moves a hidden state by ~1e-4 and hides. Both twins take the statistics in float32 whatever
# the model's dtype, so the figure is judged as float32 in every report; the gain is 1 (the
# weights figure checks the gains).
NORM_ROWS = 64


def _norm_check(model, tmodel, config, seed: int, reference_f64: bool) -> dict:
    """Every RMSNorm of each twin on the same float32 rows, against the float64 norm with the
    checkpoint's eps."""
    import jax.numpy as jnp
    import torch

    import jax_llama.model.llama as jm
    import torch_llama.model as tm

    eps = config.norm_eps
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((NORM_ROWS, config.dim))
    x /= np.sqrt(np.mean(x * x, axis=-1, keepdims=True))  # each row's mean square: 1
    x = (x * np.sqrt(eps * np.logspace(-2, 2, NORM_ROWS))[:, None]).astype(np.float32)
    ones = jnp.ones((config.dim,), jnp.float32)
    ours = np.asarray(jm.RMSNorm(model.config.norm_eps).apply({"params": {"weight": ones}},
                                                              jnp.asarray(x)))
    norms = [m for m in tmodel.modules() if isinstance(m, tm.RMSNorm)]
    with torch.no_grad():
        theirs = np.stack([tm.RMSNorm(config.dim, m.eps)(torch.as_tensor(x)).numpy()
                           for m in norms])
    truth = None
    if reference_f64:
        from ..float64 import rms_norm
        truth = np.broadcast_to(rms_norm(x, eps), theirs.shape)
    return _compare(f"RMSNorm, mean squares {eps / 100:.0e}-{eps * 100:.0e}", "torch vs JAX",
                    {"JAX": np.broadcast_to(ours, theirs.shape), "torch": theirs}, truth,
                    "float32", "norm",
                    detail=f"float32 in every dtype (both twins' statistics are float32); "
                           f"{len(norms)} torch norms")
