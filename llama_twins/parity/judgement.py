"""The judgement of one figure, and the rows the report is made of.

How the figures are measured. Differences are taken over the real (non-padding) tokens only, in
float64 on the host, relative to the scale of what they measure: max |a - b| / max |truth|, with
`truth` the float64 answer (llama_twins.float64; the JAX value when the float64 run is off). The
hidden states and the logits are taken relative to each token's own scale (the largest value of
its row), the worst token counting: a pretrained model carries a few huge activations (SmolLM2:
2.6e4 in one channel of one token, next to values of order 1), and a scale taken over the whole
batch would hide a bug in every other token. An elementwise relative error is dominated by
values near zero and proves nothing.

How a figure is judged (`judge`). Each implementation is held to its own error budget against
the float64 run, whatever the other does: what rounding can make of that figure in correct code,

    error <= budget = BUDGET[dtype][kind] x ops + storage

ops counting what stands behind the figure: the blocks the hidden state has passed through, all
of them and the head for the logits, the loss and the gradients, the AdamW steps of the
trajectories, the positions of the RoPE figure. Rounding errors add along the path a value takes,
so the budget grows with it, linearly: the worst case, and what a fine-tuned model shows (SmolLM2
after LoRA SFT: 79 U a block after block 12, 44 U after block 2 as shipped; a budget growing as
sqrt(ops), the random walk of independent roundings, failed it at block 12). RoPE's angle p f
carries a rounding that grows with the position p. storage: what keeping the weights in the
dtype costs the AdamW figures, one rounding of the largest weight per step (U x max |w| / lr
each), which no implementation can avoid. BUDGET (in units of the
dtype's unit roundoff U, or of the learning rate) was calibrated on correct checkpoints - the
project's own small models and SmolLM2-135M as shipped and fine-tuned four ways, AVX-512 and
AVX2 code paths (scripts/parity_calibration.py, docs/explanation/parity.md) - after the bugs it
must catch had been fixed (llama_twins/parity/planted.py). When a figure fails, the report names
the implementation beyond its budget: that one has the bug, and no longer "the one farther from
float64", which blamed the other twin's luck. The twins' difference is shown but needs no bound
of its own: d <= e_a + e_b <= 2 x budget whenever both pass. Without the float64 run
(`reference_f64=False`, for models whose float64 copy does not fit in memory) only d is known,
and it is held to that sum of the two budgets, naming no culprit.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from ..float64 import _squares

# The unit roundoff of each dtype: half the spacing of its numbers near 1 (float32 carries 24
# bits of mantissa, bfloat16 8).
U = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8 / 2}
U32, U16 = U["float32"], U["bfloat16"]

# The weights figure's bound, in ulps of the dtype (see components._weights_check): exact.
WEIGHT_ULPS = 1.0

# What an implementation's error may be per unit of OPS, per dtype and kind of figure, in the
# figure's units (relative to its scale, or in learning rates for the AdamW figures). Calibrated
# in docs/explanation/parity.md: the largest error of a correct implementation per op, and the
# smallest planted bug each figure catches, are in its table beside these.
BUDGET = {
    "float32": {
        "hidden": 150 * U32,     # per block behind it
        "logits": 150 * U32,     # per block, and the head
        "loss": 150 * U32,       # per block and the head, forward and backward
        "grad_norm": 150 * U32,
        "grad": 150 * U32,
        "adamw": 0.05,           # lr per step of the trajectory (and the storage; training.py),
                                 # or SPREAD_MULTIPLE x the perturbed runs' spread
        "optimizer": 1e-5,       # lr per step (and the storage), on shared gradients
        "rope": 4 * U32,         # per position: the angle p f carries p f U of rounding
        "norm": 8 * U32,         # one RMSNorm
        "weights": WEIGHT_ULPS,  # ulps, not per anything
    },
    "bfloat16": {
        "hidden": 40 * U16,
        "logits": 40 * U16,
        "loss": 40 * U16,
        "grad_norm": 40 * U16,
        "grad": 40 * U16,
        "adamw": 0.3,
        "optimizer": 1e-5,       # float32 master weights in every dtype
        "rope": 4 * U32,         # float32 in every dtype
        "norm": 8 * U32,
        "weights": WEIGHT_ULPS,
    },
}
# The figures whose error grows with the model's own dynamics, not only with the arithmetic: the
# parameters after several AdamW steps, each step's gradients taken at the weights the steps
# before left (an error in them moves the next gradients by the model's curvature, and Adam
# divides by the gradients' own size). A fixed budget per step cannot follow that: calibrated on
# the project's fine-tunes (largest 0.51 of it), it failed correct twins on a sharper one
# (SmolLM2 after LoRA SFT at lr 1e-3, 1.24 of it, both twins together). Such a figure is also
# held to SPREAD_MULTIPLE x the spread of the perturbed float64 runs (float64.Perturbation:
# rounding-sized noise grown by this model over the same steps), whichever is larger: the twins
# measured 0.76-3.11x that spread on SmolLM2 and eight fine-tunes of it, calm and with the
# report's step raised until the trajectory turns chaotic (results/parity/finetunes/parity.md),
# on an AMD EPYC Zen 4. 30 leaves room for a CPU whose float32 arithmetic errs more: the twins'
# gradients measured up to 110 U a block on an Intel Xeon's AVX2 code paths where they measure 22
# here, and their trajectory up to 0.026 lr a step there against 0.004 here (3.11 x 5, twice).
# The fixed budget stays 0.05 lr a step in float32: 0.01 would catch torch's gradients never
# zeroed on SmolLM2 after LoRA SFT (0.128 lr, 161x the spread), but failed correct twins after 4
# LoRA steps on the AVX2 paths (JAX 0.084, torch 0.177 lr, 196x a spread of 9e-4: the noise,
# relative to each tensor's own largest gradient, is too small for the tensors whose gradients
# are small next to the model's largest, where Adam's eps makes an absolute error count).
COMPOUNDING = ("adamw",)
SPREAD_MULTIPLE = 30.0
# Greedy decoding may differ only at a near-tie: if the twins' logits agree within d, each twin's
# logits of the two tokens they chose are within 2d of each other (JAX's a >= b and torch's
# b >= a, each logit moved by at most d), with d the bound on the logits' difference times the
# scale of the logits.
NEAR_TIE = 2.0


def growth(kind: str, ops: float) -> float:
    """How a budget grows with the ops behind a figure: linearly, for every kind."""
    return max(ops, 1)


def budget(dtype: str, kind: str, ops: float = 1, storage: float = 0.0,
           spread: float | None = None) -> float:
    """What one correct implementation's error may be on a figure of `kind` with `ops` behind it
    (storage: the rounding its dtype forces on what it keeps, in the figure's units; spread: for
    a COMPOUNDING kind, how far the perturbed float64 runs ended from the plain one)."""
    per = BUDGET[dtype][kind]
    if kind == "weights":
        return per
    fixed = per * growth(kind, ops) + storage
    if spread is None or kind not in COMPOUNDING:
        return fixed
    return max(fixed, SPREAD_MULTIPLE * spread)


def judge(difference: float, errors: dict[str, float] | None, dtype: str, kind: str,
          ops: float = 1, storage: float = 0.0, spread: float | None = None) -> dict:
    """How one figure is judged: {"bound", "difference_bound", "ok", "culprit"}.

    errors: each implementation's error against float64, in the figure's units; each must be
    within bound = budget(dtype, kind, ops, storage, spread); culprit: those beyond it. None (no
    float64 run): the difference must be within twice the budget, and no culprit can be named.
    NaN fails."""
    each = budget(dtype, kind, ops, storage, spread)
    twice = each if kind == "weights" else 2 * each  # ulps off the checkpoint: exact for both
    if errors is None:
        return {"bound": twice, "difference_bound": twice, "ok": bool(difference <= twice),
                "culprit": None}
    beyond = [name for name, e in errors.items() if not e <= each]
    ok = not beyond and difference == difference
    culprit = None if ok else " and ".join(beyond) or max(errors, key=lambda n: errors[n])
    return {"bound": each, "difference_bound": twice, "ok": ok, "culprit": culprit}


def _row(figure: str, compared: str, difference: float, errors: dict[str, float] | None,
         dtype: str, kind: str, detail: str = "", ops: float = 1, storage: float = 0.0,
         spread: float | None = None, **extra) -> dict:
    """One judged row of the report. tolerance: the bound each error is held to (the difference's
    without float64); margin: tolerance / the largest error (the difference without float64;
    above 1 passes, None when it is 0); spread: the perturbed float64 runs' (COMPOUNDING
    kinds), None without them."""
    difference = float(difference)
    errors = None if errors is None else {k: float(v) for k, v in errors.items()}
    verdict = judge(difference, errors, dtype, kind, ops, storage, spread)
    worst = difference if errors is None else max(errors.values())
    margin = verdict["bound"] / worst if worst > 0 else None
    return {"figure": figure, "compared": compared, "kind": kind, "dtype": dtype, "ops": ops,
            "storage": storage, "spread": spread, "value": difference,
            "errors": errors, "tolerance": verdict["bound"],
            "difference_bound": verdict["difference_bound"], "margin": margin,
            "ok": verdict["ok"], "culprit": verdict["culprit"], "detail": detail, **extra}


def _check(figure: str, compared: str, value, tolerance, ok: bool, detail: str = "",
           culprit: str | None = None) -> dict:
    """A row judged by its own rule (the greedy tokens)."""
    return {"figure": figure, "compared": compared, "kind": None,
            "value": None if value is None else float(value), "errors": None,
            "tolerance": tolerance, "margin": None, "ok": bool(ok), "culprit": culprit,
            "detail": detail}


def _compare(figure: str, compared: str, values: dict[str, np.ndarray], truth, dtype: str,
             kind: str, scale: float | None = None, detail: str | None = None, ops: float = 1,
             per_row: bool = False) -> dict:
    """values: {"JAX": a, other: b}. The difference max |a - b| and each error max |x - truth|,
    relative to `scale` (default max |truth|, or max |a| without a truth); per_row: a, b and
    truth are (rows, features) and each row is taken relative to its own scale, the worst row
    counting (the row's "scale" is then the largest of them)."""
    (name_a, a), (name_b, b) = values.items()
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if truth is not None:
        truth = np.asarray(truth, np.float64)
    base = np.abs(a if truth is None else truth)
    if per_row:
        scales = base.max(axis=-1, keepdims=True)
        scale = float(scales.max())
    else:
        scale = float(base.max()) if scale is None else scale
        scales = np.asarray(scale)
    positive = scales > 0

    def relative(x):  # the worst of x's entries, each relative to its row's scale
        x = np.abs(x)
        return float(np.where(positive, x / np.where(positive, scales, 1.0),
                              np.where(x == 0, 0.0, np.inf)).max())
    max_abs = float(np.abs(a - b).max())
    errors = None
    if truth is not None:
        errors = {name_a: relative(a - truth), name_b: relative(b - truth)}
    detail = f"max abs {max_abs:.2e}" if detail is None else detail
    if per_row:
        detail += "; each token relative to its own scale"
    return _row(figure, compared, relative(a - b), errors, dtype, kind, detail, ops=ops,
                max_abs=max_abs, scale=scale)


def _compare_tensors(figure: str, compared: str, names: Sequence[str],
                     values: dict[str, Callable[[str], object]], truth: Callable | None,
                     dtype: str, kind: str, scale: float | None = None,
                     detail: str | None = None, ops: float = 1, storage: float = 0.0,
                     spread: float | None = None) -> dict:
    """_compare over a whole model without a copy of it: values {"JAX": get_a, other: get_b} and
    truth (None, or get_t) fetch the tensor of a name; the maxima are taken one tensor at a
    time, each in float64. largest: the tensor where the difference is largest; off: for each
    implementation, the tensor where its error is."""
    (name_a, get_a), (name_b, get_b) = values.items()
    top = difference = 0.0
    off, largest = {name_a: 0.0, name_b: 0.0}, None
    where = {name_a: None, name_b: None}
    for n in names:
        a, b = _host(get_a(n)), _host(get_b(n))
        here = _max_abs(a, b)
        if here > difference or here != here:
            difference, largest = here, n
        if truth is None:
            top = max(top, _max_abs(a))
            continue
        t = np.asarray(truth(n), np.float64)
        top = max(top, _max_abs(t))
        for name, x in ((name_a, a), (name_b, b)):
            e = _max_abs(x, t)
            if e > off[name] or e != e:
                off[name], where[name] = e, n
    scale = top if scale is None else scale

    def relative(x):
        return x / scale if scale > 0 else (0.0 if x == 0 else float("inf"))
    errors = None if truth is None else {k: relative(v) for k, v in off.items()}
    detail = f"max abs {difference:.2e}" if detail is None else detail
    return _row(figure, compared, relative(difference), errors, dtype, kind,
                detail + (f"; largest in {largest}" if largest else ""), ops=ops,
                storage=storage, spread=spread, max_abs=difference, scale=scale, largest=largest,
                tensors=None if truth is None else where)


def _global_norm(get: Callable[[str], object], names: Sequence[str]) -> float:
    """sqrt of the sum of squares of the tensors get(name), in float64, one tensor at a time."""
    return math.sqrt(sum(_squares(_f64(get(n))) for n in names))


def _host(x) -> np.ndarray:
    """A JAX array or a torch tensor as a numpy array in its own dtype (bfloat16 as float32)."""
    if hasattr(x, "detach"):
        import torch

        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    return np.asarray(x)


_CHUNK = 1 << 16  # entries: a chunk's float64 temporaries stay in cache


def _max_abs(x: np.ndarray, y: np.ndarray | None = None) -> float:
    """max |x - y| (max |x| without y) in float64, chunk by chunk (no float64 copy of a whole
    tensor); NaN if any entry is NaN."""
    x = x.reshape(-1)
    y = None if y is None else y.reshape(-1)
    top = 0.0
    for i in range(0, x.size, _CHUNK):
        d = x[i:i + _CHUNK].astype(np.float64)
        if y is not None:
            d -= y[i:i + _CHUNK]
        m = float(np.abs(d, out=d).max())
        if m != m:
            return m
        top = max(top, m)
    return top


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
