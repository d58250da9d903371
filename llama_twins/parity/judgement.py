"""The judgement of one figure, and the rows the report is made of.

How the figures are measured. Differences are taken over the real (non-padding) tokens only, in
float64 on the host, relative to the scale of the tensor: max |a - b| / max |truth|, with `truth`
the float64 answer (llama_twins.float64; the JAX value when the float64 run is off). An
elementwise relative error is dominated by values near zero and proves nothing.

How a figure is judged (see `judge`). Each implementation's error against the float64 answer is
measured the same way. Two correct implementations in the same dtype differ by about as much as
each differs from the exact answer (both are rounding); a bug puts one of them far from it. So the
difference of the twins passes when it is within FACTOR times the smaller of their two errors,
clamped to [floor, ceiling] of LIMITS[dtype][kind]; an implementation whose own error is beyond
the ceiling fails whatever the other does. When a figure fails, the implementation far from
float64 is named: that is the one with the bug. Without the float64 run (`reference_f64=False`,
for models whose float64 copy does not fit in memory) each figure is judged by the fixed
TOLERANCES of the dtype instead, measured on small models, and the report says so.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

# The weights figure's bound, in ulps of the dtype (see _weights_check).
WEIGHT_ULPS = 1.0

# The fixed tolerances (reference_f64=False, and the old judgement): per compute dtype, each on a
# figure relative to the scale of what it measures.
# Measured: the tiny preset and the tests' small_config at random init (seeds 0-2, 2 x 16 and
# 4 x 32 tokens) and the tiny model `jax-llama train` makes (2 x 16).
# float32: the twins do the same float32 math in a different order (matmul blocking, fused
# softmax, order of sums), ~1e-7 of the scale per operation; the values sit 25-500x above the
# worst measured and far below what one wrong weight gives (0.01 added to one of block 1's
# weights: 4e-3 there). bfloat16: a rounding is up to 4e-3 (8 bits of mantissa) and the twins
# round at different places (XLA fuses, torch does not); the values sit 5-15x above the worst
# measured (a deeper model accumulates more rounding than these 2-layer ones).
# KL has no entry: if every logit of a position agrees within d, KL <= d^2 / 2 (Hoeffding's
# lemma), so its tolerance is (the logit tolerance * max |logit|)^2 / 2, the most that logits
# within tolerance allow. It fails only along with the logits; it is there to say, in nats, how
# far apart the predictions are.
TOLERANCES = {
    "float32": {
        "hidden": 1e-5,      # hidden state after a block; measured <= 3.9e-7
        "logits": 1e-5,      # measured <= 4.6e-7
        "loss": 1e-5,        # |loss difference| / loss; measured <= 3.1e-7
        "grad_norm": 1e-5,   # |norm difference| / norm; measured <= 6e-8
        "grad": 1e-4,        # max |gradient difference| / max |gradient|; measured <= 9.3e-7
        "adamw": 1e-3,       # max |parameter difference| / lr after 10 steps; measured <= 4e-5
        "rope": 1e-5,        # RoPE over the context (see ROPE_POSITIONS); measured <= 1.0e-7
        "norm": 1e-5,        # RMSNorm near eps (see _norm_check); measured <= 1.6e-7
        "weights": WEIGHT_ULPS,  # ulps (see _weights_check): correct loaders are 0 apart
    },
    "bfloat16": {
        "hidden": 5e-2,      # measured <= 7.3e-3
        "logits": 5e-2,      # measured <= 1.0e-2
        "loss": 1e-3,        # measured <= 7.2e-5
        "grad_norm": 1e-2,   # measured <= 1.2e-3
        "grad": 1e-1,        # measured <= 1.7e-2
        # A parameter near 1 (a norm gain) has a bfloat16 spacing of 8e-3, 2.6 lr: a rounding that
        # differs costs a few lr, and smaller steps vanish in both twins, so this figure catches
        # only gross errors (a wrong lr or sign); the AdamW figure on shared gradients (float32
        # master weights) checks the optimizer in every report.
        "adamw": 10.0,       # measured 0.24 - 1.3
        "weights": WEIGHT_ULPS,
    },
}
# The judgement against float64 (see the module docstring). FACTOR: how many times the smaller
# error against float64 the twins may differ by. Two correct implementations differ by at most the
# sum of their errors (the triangle inequality), (1 + r) times the smaller one when the larger is r
# times it. On the correct checkpoints of the calibration (results/parity/parity.md) r was at most
# 1.7 between the twins, which compute RoPE's frequencies identically, and 3.2 for transformers,
# whose frequencies are computed in float32 (on the trained 6-layer model); FACTOR = 6 allows r up
# to 5, while a bug in one twin puts it r = 10 - 10^9 times farther off than the other.
FACTOR = 6.0
# (floor, ceiling) per dtype and kind of figure, in the figure's units. The floor is the least
# bound: an error against float64 can be near zero by chance (a scalar such as the loss, or a sum
# whose roundings cancel), and a bound of 6x nothing would fail a correct twin. Floors sit at a few
# roundings of the dtype: float32 carries 24 bits (6e-8 relative), bfloat16 8 (3.9e-3); a scalar
# gets more (its one error may cancel to nothing). The ceiling is the most any correct
# implementation may be off the exact answer (and so the most the bound may grow to): 100x the
# fixed tolerance in float32, 5x it in bfloat16. An implementation beyond it fails even when the
# other is as far off (a shared error, e.g. in the checkpoint reader).
LIMITS = {
    "float32": {"hidden": (2.5e-7, 1e-3), "logits": (2.5e-7, 1e-3), "loss": (1e-6, 1e-3),
                "grad_norm": (1e-6, 1e-3), "grad": (2.5e-7, 1e-2), "adamw": (1e-4, 1e-1),
                # An angle near 4096 radians carries 2.4e-4 of float32 rounding (its spacing
                # there is 4.9e-4), in any correct implementation: the ceiling sits above it.
                "rope": (2.5e-7, 2e-3), "norm": (2.5e-7, 1e-3),
                # ulps: a twin more than one off the checkpoint's value holds another weight
                "weights": (WEIGHT_ULPS, WEIGHT_ULPS)},
    "bfloat16": {"hidden": (8e-3, 0.25), "logits": (8e-3, 0.25), "loss": (4e-3, 5e-2),
                 "grad_norm": (4e-3, 5e-2), "grad": (8e-3, 0.5), "adamw": (1.0, 50.0),
                 "weights": (WEIGHT_ULPS, WEIGHT_ULPS)},
}
# Greedy decoding may differ only at a near-tie: if the twins' logits agree within d, each twin's
# logits of the two tokens they chose are within 2d of each other (JAX's a >= b and torch's
# b >= a, each logit moved by at most d), with d the logit tolerance times max |logit|.
NEAR_TIE = 2.0


def judge(difference: float, errors: dict[str, float] | None, dtype: str, kind: str) -> dict:
    """How one figure is judged: {"bound", "ok", "culprit"}.

    errors: each implementation's error against float64, in the figure's units; None judges by
    the fixed TOLERANCES[dtype][kind]. With errors, bound = FACTOR x the smaller error, clamped to
    LIMITS[dtype][kind] = (floor, ceiling); the figure passes when `difference` is within the
    bound and no implementation is beyond the ceiling. culprit (when it fails): the
    implementation(s) beyond the ceiling, else the one farther from float64. NaN fails."""
    if errors is None:
        bound = TOLERANCES[dtype][kind]
        return {"bound": bound, "ok": bool(difference <= bound), "culprit": None}
    floor, ceiling = LIMITS[dtype][kind]
    bound = min(ceiling, max(floor, FACTOR * min(errors.values())))
    if not bound == bound:  # an error is NaN
        bound = floor
    beyond = sorted(name for name, e in errors.items() if not e <= ceiling)
    ok = bool(difference <= bound) and not beyond
    culprit = None
    if not ok:
        culprit = (" and ".join(beyond) if beyond else
                   max(errors, key=lambda name: errors[name]))
    return {"bound": bound, "ok": ok, "culprit": culprit}


def _row(figure: str, compared: str, difference: float, errors: dict[str, float] | None,
         dtype: str, kind: str, detail: str = "", **extra) -> dict:
    """One judged row of the report. margin: bound / difference (above 1 passes; None when the
    difference is 0)."""
    difference = float(difference)
    errors = None if errors is None else {k: float(v) for k, v in errors.items()}
    verdict = judge(difference, errors, dtype, kind)
    margin = verdict["bound"] / difference if difference > 0 else None
    return {"figure": figure, "compared": compared, "kind": kind, "value": difference,
            "errors": errors, "tolerance": verdict["bound"], "margin": margin,
            "ok": verdict["ok"], "culprit": verdict["culprit"], "detail": detail, **extra}


def _check(figure: str, compared: str, value, tolerance, ok: bool, detail: str = "",
           culprit: str | None = None) -> dict:
    """A row judged by its own rule (the greedy tokens)."""
    return {"figure": figure, "compared": compared, "kind": None,
            "value": None if value is None else float(value), "errors": None,
            "tolerance": tolerance, "margin": None, "ok": bool(ok), "culprit": culprit,
            "detail": detail}


def _compare(figure: str, compared: str, values: dict[str, np.ndarray], truth, dtype: str,
             kind: str, scale: float | None = None, detail: str | None = None) -> dict:
    """values: {"JAX": a, other: b}. The difference max |a - b| and each error max |x - truth|,
    relative to `scale` (default max |truth|, or max |a| without a truth)."""
    (name_a, a), (name_b, b) = values.items()
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if scale is None:
        scale = float(np.abs(a if truth is None else truth).max())
    max_abs = float(np.abs(a - b).max())

    def relative(x):
        return x / scale if scale > 0 else (0.0 if x == 0 else float("inf"))
    errors = None
    if truth is not None:
        truth = np.asarray(truth, np.float64)
        errors = {name_a: relative(float(np.abs(a - truth).max())),
                  name_b: relative(float(np.abs(b - truth).max()))}
    return _row(figure, compared, relative(max_abs), errors, dtype, kind,
                f"max abs {max_abs:.2e}" if detail is None else detail, max_abs=max_abs,
                scale=scale)


def _compare_tensors(figure: str, compared: str, names: Sequence[str],
                     values: dict[str, Callable[[str], object]], truth: Callable | None,
                     dtype: str, kind: str, scale: float | None = None,
                     detail: str | None = None) -> dict:
    """_compare over a whole model without a copy of it: values {"JAX": get_a, other: get_b} and
    truth (None, or get_t) fetch the tensor of a name; the maxima are taken one tensor at a
    time, each in float64."""
    (name_a, get_a), (name_b, get_b) = values.items()
    top = difference = 0.0
    off, largest = {name_a: 0.0, name_b: 0.0}, None
    for n in names:
        a, b = _f64(get_a(n)), _f64(get_b(n))
        here = float(np.abs(a - b).max())
        if here > difference:
            difference, largest = here, n
        if truth is None:
            top = max(top, float(np.abs(a).max()))
            continue
        t = np.asarray(truth(n), np.float64)
        top = max(top, float(np.abs(t).max()))
        off = {name_a: max(off[name_a], float(np.abs(a - t).max())),
               name_b: max(off[name_b], float(np.abs(b - t).max()))}
    scale = top if scale is None else scale

    def relative(x):
        return x / scale if scale > 0 else (0.0 if x == 0 else float("inf"))
    errors = None if truth is None else {k: relative(v) for k, v in off.items()}
    detail = f"max abs {difference:.2e}" if detail is None else detail
    return _row(figure, compared, relative(difference), errors, dtype, kind,
                detail + (f"; largest in {largest}" if largest else ""), max_abs=difference,
                scale=scale)


def _global_norm(get: Callable[[str], object], names: Sequence[str]) -> float:
    """sqrt of the sum of squares of the tensors get(name), in float64, one tensor at a time."""
    return math.sqrt(sum(float(np.sum(np.square(_f64(get(n))))) for n in names))


def _f64(x) -> np.ndarray:
    """A JAX array or a torch tensor (bfloat16 included) as a float64 numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x).astype(np.float64)


def _ulp(x: np.ndarray) -> np.ndarray:
    """The spacing of x's dtype at each value of x (its ulp), float64; at 0 the least normal's."""
    import ml_dtypes

    info = ml_dtypes.finfo(x.dtype)
    magnitude = np.abs(x.astype(np.float64))
    exponent = np.floor(np.log2(np.maximum(magnitude, float(info.smallest_normal))))
    return np.exp2(exponent - info.nmant)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _kl(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    return np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
