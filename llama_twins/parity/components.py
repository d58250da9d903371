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


def _rope_input(config, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions 0 .. P - 1, one random float32 vector per position (1, P, 1, head_dim))."""
    P = min(config.max_seq_len, ROPE_POSITIONS)
    x = np.random.default_rng(seed).standard_normal((1, P, 1, config.head_dim)).astype(np.float32)
    return np.arange(P), x


def _jax_rope(model, config, seed: int) -> np.ndarray:
    """The JAX twin's rotation of _rope_input: its config's frequencies, its own rope_cos_sin and
    rotate."""
    import jax.numpy as jnp

    import jax_llama.model.llama as jm
    from bridge.rope import rope_inv_freq

    c = model.config
    positions, x = _rope_input(config, seed)
    return np.asarray(jm.rotate(jnp.asarray(x), *jm.rope_cos_sin(
        positions, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))))


def _torch_rope(tmodel, config, seed: int) -> np.ndarray:
    """The torch twin's: its frequency buffer, its own rope_cos_sin and rotate."""
    import torch

    import torch_llama.model as tm

    positions, x = _rope_input(config, seed)
    return tm.rotate(torch.as_tensor(x), *tm.rope_cos_sin(
        torch.as_tensor(positions), tmodel._inv_freq_for(torch.device("cpu")))).numpy()


def _rope_check(model, tmodel, config, seed: int, reference_f64: bool) -> dict:
    """Each twin's rotation of one random float32 vector per position, against the exact
    rotation by the checkpoint's frequencies."""
    return _rope_row(_jax_rope(model, config, seed), _torch_rope(tmodel, config, seed), config,
                     seed, reference_f64)


def _rope_row(ours: np.ndarray, theirs: np.ndarray, config, seed: int,
              reference_f64: bool) -> dict:
    positions, x = _rope_input(config, seed)
    truth = None
    if reference_f64:
        from ..float64 import rotation
        truth = rotation(x, config, positions)
    P = len(positions)
    return _compare(f"RoPE, positions 0-{P - 1}", "torch vs JAX", {"JAX": ours, "torch": theirs},
                    truth, "float32", "rope",
                    detail="float32 in every dtype (both twins' RoPE is float32)", ops=P)


# The weights figure: every tensor each twin holds against the checkpoint's value rounded to the
# report's dtype (round to nearest even, what both twins' loaders do), in units of that value's
# spacing in the dtype (its ulp). A correct loader is 0 ulps off; the bound allows 1, for a loader
# that rounds another way. A wrong weight is many ulps off in any dtype: 0.01 on a weight of 0.05
# is 40 bfloat16 ulps, 5 million float32 ones. It is exact, so a bug that moves the outputs less
# than bfloat16 rounds them is still seen here, and the tensor names its block.


# Tensors are compared in slices of this many entries, so that a large embedding (262M entries
# in Llama-3.2-1B) never has several float64 copies at once.
WEIGHT_SLICE = 1 << 22


def _weights_off(tensor, held, dtype: str) -> dict[str, float]:
    """For each tensor of `held`, the twin's largest distance from it in ulps of `dtype`
    (tensor(name): the twin's tensor, any array type), slice by slice: never a float64 copy of
    the model."""
    off = {}
    for name in held:
        ours, truth = tensor(name), held[name]
        off[name] = max((_sliced_ulps(a, t) for a, t in _slices(ours, truth)), default=0.0)
    return off


def _slices(a, t):
    """Matching row slices of a (a twin's tensor) and t (the held numpy array), each of at most
    WEIGHT_SLICE entries."""
    rows = max(1, WEIGHT_SLICE // max(1, int(np.prod(t.shape[1:]))))
    for k in range(0, t.shape[0] if t.ndim else 1, rows):
        yield (a if t.ndim == 0 else a[k:k + rows]), (t if t.ndim == 0 else t[k:k + rows])


def _sliced_ulps(a, truth: np.ndarray, b=None) -> float:
    """max |a - truth| / ulp(truth) (with b: max |a - b| / ulp(truth)), float64; 0 without
    float64 arithmetic where the two hold the same bits (the usual case) and truth is finite."""
    mine, other = _bits(a), _bits(truth if b is None else b)
    if (mine.dtype == other.dtype and np.array_equal(mine, other)
            and np.isfinite(truth).all()):
        return 0.0
    spacing = _ulp(truth)
    other = truth.astype(np.float64) if b is None else _f64(b)
    return float((np.abs(_f64(a) - other) / spacing).max())


def _bits(x) -> np.ndarray:
    """x's raw bits as signed integers of its width (a torch tensor, a JAX or numpy array)."""
    if hasattr(x, "detach"):
        import torch

        x = x.detach().cpu().contiguous()
        return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]).numpy()
    x = np.ascontiguousarray(np.asarray(x))
    return x.view(f"i{x.dtype.itemsize}")


def _weights_check(model, params, tmodel, held, dtype: str) -> dict:
    """Each twin's weights (JAX: its params in canonical layout; torch: its state_dict) against
    `held`, the checkpoint rounded to `dtype`, in ulps of the dtype, tensor by tensor."""
    from jax_llama.checkpoint import tensor_specs

    jax_tensor = tensor_specs(params, model.config)[1]
    torch_tensors = tmodel.state_dict()
    jax_off, torch_off, between = {}, {}, {}
    for name in held:  # each tensor read once, compared slice by slice
        truth = held[name]
        pieces = [(_sliced_ulps(a, t), _sliced_ulps(b, t), _sliced_ulps(a, t, b))
                  for (a, t), (b, _) in zip(_slices(jax_tensor(name), truth),
                                            _slices(torch_tensors[name], truth))]
        jax_off[name], torch_off[name], between[name] = (max(p) for p in zip(*pieces))
    return _weights_row(jax_off, torch_off, between, dtype)


def _weights_row(jax_off: dict, torch_off: dict, between: dict | None, dtype: str) -> dict:
    """The weights figure from each twin's distance per tensor (and the twins' own, `between`;
    None when the twins were not in memory together: then bounded by the sum of their
    distances, as the detail says)."""
    names = list(jax_off)
    if between is None:
        between = {n: jax_off[n] + torch_off[n] for n in names}
    first_off = next((n for n in names if max(jax_off[n], torch_off[n]) > WEIGHT_ULPS), None)
    worst_name = max(names, key=lambda n: between[n]) if names else None
    difference = between[worst_name] if worst_name else 0.0
    if not difference > 0:
        worst_name = None
    worst = {"JAX": max(jax_off.values(), default=0.0),
             "torch": max(torch_off.values(), default=0.0)}
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


def _norm_input(config, seed: int) -> np.ndarray:
    eps = config.norm_eps
    x = np.random.default_rng(seed).standard_normal((NORM_ROWS, config.dim))
    x /= np.sqrt(np.mean(x * x, axis=-1, keepdims=True))  # each row's mean square: 1
    return (x * np.sqrt(eps * np.logspace(-2, 2, NORM_ROWS))[:, None]).astype(np.float32)


def _jax_norm(model, config, seed: int) -> np.ndarray:
    """The JAX twin's RMSNorm (the eps of its config) on _norm_input, gain 1: (1, rows, dim)."""
    import jax.numpy as jnp

    import jax_llama.model.llama as jm

    x = _norm_input(config, seed)
    ones = jnp.ones((config.dim,), jnp.float32)
    return np.asarray(jm.RMSNorm(model.config.norm_eps).apply({"params": {"weight": ones}},
                                                              jnp.asarray(x)))[None]


def _torch_norm(tmodel, config, seed: int) -> np.ndarray:
    """Every torch norm module's own eps on _norm_input, gain 1: (norms, rows, dim)."""
    import torch

    import torch_llama.model as tm

    x = _norm_input(config, seed)
    norms = [m for m in tmodel.modules() if isinstance(m, tm.RMSNorm)]
    with torch.no_grad():
        return np.stack([tm.RMSNorm(config.dim, m.eps)(torch.as_tensor(x)).numpy()
                         for m in norms])


def _norm_check(model, tmodel, config, seed: int, reference_f64: bool) -> dict:
    """Every RMSNorm of each twin on the same float32 rows, against the float64 norm with the
    checkpoint's eps."""
    return _norm_row(_jax_norm(model, config, seed), _torch_norm(tmodel, config, seed), config,
                     seed, reference_f64)


def _norm_row(ours: np.ndarray, theirs: np.ndarray, config, seed: int,
              reference_f64: bool) -> dict:
    eps = config.norm_eps
    truth = None
    if reference_f64:
        from ..float64 import rms_norm
        truth = np.broadcast_to(rms_norm(_norm_input(config, seed), eps), theirs.shape)
    return _compare(f"RMSNorm, mean squares {eps / 100:.0e}-{eps * 100:.0e}", "torch vs JAX",
                    {"JAX": np.broadcast_to(ours, theirs.shape), "torch": theirs}, truth,
                    "float32", "norm",
                    detail=f"float32 in every dtype (both twins' statistics are float32); "
                           f"{len(theirs)} torch norms")
