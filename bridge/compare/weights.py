"""The weights section of `llama-bridge compare A B`: tensor by tensor, is B's tensor A's?

Each canonical tensor is read from both checkpoints, one pair in memory at a time (an 8B pair's
largest, the embedding, is 2 GB of float32 a side), and compared a chunk of rows at a time:

    largest relative difference   max |b - a| / max |a|
    RMS relative error            sqrt(sum (b - a)^2 / sum a^2)

Float on both sides, a tensor is the same when every element is within the rounding of the
coarser storage dtype (FLOAT_ROUNDING: half a bfloat16 ulp, half a float16 ulp, float32's 1e-7).
A tensor one side holds quantised (a GGUF's Q8_0, Q4_K, ..., a native checkpoint's int8 or int4)
is judged against what its type costs: where the type can be quantised here (gguf.quants'
REQUANTISABLE types, the bridge's own int8 and int4), the other side's tensor is quantised with
it again, and the reference is that re-quantisation's error, per tensor and per row; for the
other types (the K-quants, which only llama.cpp writes) the reference is the type's relative RMS
error on gaussian rows (TYPE_COST). A tensor within TENSOR_LIMIT of its reference,
and with no row beyond ROW_LIMIT of its reference row, is "the same within quantisation". When
both sides are quantised, B's type is judged against A, then A's against B (_measure).

A tensor that differs is named, with the rows that differ, and the classic ways a converter gets
a tensor wrong are tried on it (patterns.diagnose): q/k rows in the other RoPE layout, a head written one
row off or replaced by the embedding, a transposed or scaled matrix, a norm with a (1 + w)
offset, two tensors swapped or the layers one off, a few broken rows.
"""

from __future__ import annotations

from typing import Callable

import ml_dtypes
import numpy as np

from ..formats.base import Checkpoint
from ..int4 import bits_per_weight, dequantize_int4, quantize_int4
from ..quantize import (MIN_SUFFIX, SCALE_SUFFIX, dequantize_weight, int4_names, quantize_weight,
                        quantized_names)
from ..tensors import canonical_shapes
from . import patterns
from .patterns import RESHUFFLED
from .report import DIFFERENT, SAME, WITHIN, Finding

# Relative RMS error, sqrt(sum (q - x)^2 / sum x^2), of each type on rows of standard gaussian
# numbers (rows of 256), measured for this table: the 32-element block types and MXFP4 by
# gguf.quants (gguf 0.19) on 4096 rows; the K-quants by llama.cpp's own quantiser
# (llama-cpp-python 0.3.36, no importance matrix) on a random gaussian model of dim 256, each
# type pooled over the tensors llama.cpp gave it under q2_k ... q6_k.
# The native format's int8 (per channel; "int8-g32" ... in groups: less) and int4 (bridge.quantize,
# bridge.int4) by their own quantisers, likewise.
TYPE_COST = {"Q2_K": 0.296, "Q3_K": 0.151, "Q4_K": 0.0713, "Q5_K": 0.0361, "Q6_K": 0.0177,
             "Q4_0": 0.0860, "Q4_1": 0.0782, "Q5_0": 0.0427, "Q5_1": 0.0378, "Q8_0": 0.00535,
             "MXFP4": 0.115, "int8": 0.00697, "int4": 0.0782}
# A type the table does not hold (the IQ and TQ types): 2 * 2^-bits a weight, the table's own rule
# of thumb (Q8_0 1.95 * 2^-8.5, Q6_K 1.67 * 2^-6.56, Q4_0 1.95 * 2^-4.5, Q2_K 1.83 * 2^-2.625), an
# upper bound for the IQ types' codebooks; UNKNOWN_COST where gguf does not know the type's size.
UNKNOWN_COST = 0.35
# The types gguf.quants quantises as llama.cpp does, bit for bit (bridge.gguf.write uses it); the
# native format's int8 and int4 are re-quantised by the bridge's own quantisers.
REQUANTISABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")

# A quantised tensor's RMS error against its reference's. The same quantiser on the same numbers
# gives 1.0 exactly; on numbers rounded to bfloat16 first, ~1.02 (Q8_0) to 1.00 (Q4_0); a tensor
# from another model, or a permuted one, is 10x or more. Against TYPE_COST (gaussian rows) heavier
# tails cost more: SmolLM2's Q6_K 1.04x; a model of Student-t numbers (3 degrees of freedom,
# heavier-tailed than trained weights) 1.2x (Q2_K) to 1.56x (Q6_K) under llama.cpp's quantiser:
# 2.5 leaves room above that.
TENSOR_LIMIT = {"re-quantised": 1.5, "table": 2.5}
# A row's RMS error against its reference row's, each reference row counted at no less than half
# the tensor's RMS reference error (so that a row the type happens to hold nearly exactly does not
# stand out). Re-quantised, a faithful row is 1.0x (1.13x where B's numbers were rounded to
# bfloat16 before Q8_0 quantised them: a chain through a bfloat16 export), and a row scaled by
# 1.3 is 3.7x under Q4_0 (whose own error is ~9% of a row) and 56x under Q8_0: 3x. Against the
# table, a faithful row reaches 1.75x (SmolLM2, Q6_K) and 2.4x (the Student-t model, Q6_K): 5x,
# which still catches a row scaled by 1.5 under Q4_K (7x) and by 1.1 under Q6_K.
ROW_LIMIT = {"re-quantised": 3.0, "table": 5.0}

# Per storage dtype: (relative, absolute) rounding of one element, |b - a| <= rel * max(|a|, |b|)
# + abs. bfloat16 and float16 round to nearest: half an ulp, at most 2^-8 and 2^-11 of the value
# (and float16's subnormals: half their step, 2^-25); float32 1e-7 (its ulp is 1.2e-7 of it).
FLOAT_ROUNDING = {np.dtype(np.float64): (1e-7, 0.0), np.dtype(np.float32): (1e-7, 0.0),
                  np.dtype(np.float16): (2.0 ** -11, 2.0 ** -25),
                  np.dtype(ml_dtypes.bfloat16): (2.0 ** -8, 0.0)}
# Elements per chunk of rows (temporaries of a few MB whatever the tensor's size).
CHUNK = 1 << 20
# Differing tensors listed in the report's lines (all are counted).
LISTED = 10


def compare_weights(a, b, progress: Callable[[int, int], object] | None = None) -> Finding:
    """Compare checkpoints `a` and `b` (bridge.formats.base.Checkpoint) tensor by tensor; see the
    module's docstring. `progress(i, n)` hears each tensor done (i of n)."""
    a, b = (Dequantised(c) if c.quantization is not None else c for c in (a, b))
    names, lines, first = _names(a, b)
    if first is not None:
        return first
    results, types, floats = [], {}, {"tensors": 0, "max_rel": 0.0, "tensor": None}
    for i, name in enumerate(names):
        differing = sum(r["verdict"] == DIFFERENT for r in results)
        result = _compare_tensor(a, b, name, diagnose=differing < LISTED)
        if result["verdict"] != DIFFERENT:
            del result["row_rel"]  # kept only to describe the rows that differ
        results.append(result)
        if result["type"] is None:
            floats["tensors"] += 1
            if result["max_rel"] > floats["max_rel"] or floats["tensor"] is None:
                floats.update(max_rel=result["max_rel"], tensor=name)
        else:
            types.setdefault(result["type"], []).append(result)
        if progress is not None:
            progress(i + 1, len(names))
    return _finding(results, types, floats, lines)


def _names(a, b) -> tuple[list[str], list[str], Finding | None]:
    """The canonical names to compare, in A's order, the lines to say about them, and a DIFFERENT
    Finding when a tensor is on one side only or its shapes differ. A tied head (no
    output.weight) against an untied one is the token embedding against the output."""
    lines = []
    only = [(n, "A") for n in a.specs if n not in b.specs and not _tied_stand_in(b, n)]
    only += [(n, "B") for n in b.specs if n not in a.specs and not _tied_stand_in(a, n)]
    if only:
        name, side = only[0]
        return [], lines, Finding(
            "weights", DIFFERENT, f"tensor {name} is in {side} only",
            lines=[f"tensor {n}: in {s} only" for n, s in only[:LISTED]],
            cause=f"tensor {name} is in {side} only ({len(only)} tensors on one side only)",
            check_next="the configs' layer counts, tied head and family deltas (biases, head "
                       "norms): the config section says which",
            figures={"only_in_one": [{"tensor": n, "side": s} for n, s in only]})
    names = list(a.specs) + [n for n in b.specs if n not in a.specs]
    for name in names:
        (shape_a, _), (shape_b, _) = _spec(a, name), _spec(b, name)
        if tuple(shape_a) != tuple(shape_b):
            return [], lines, Finding(
                "weights", DIFFERENT, f"tensor {name} has another shape",
                lines=[f"tensor {name}: shape {tuple(shape_a)} in A, {tuple(shape_b)} in B"],
                cause=f"tensor {name}: shape {tuple(shape_a)} in A, {tuple(shape_b)} in B",
                check_next="the configs' dims, heads and vocabulary size (a padded vocabulary "
                           "changes the embedding's rows)")
    for side, ckpt in (("A", a), ("B", b)):
        if "output.weight" in names and "output.weight" not in ckpt.specs:
            lines.append(f"{side}'s LM head is tied (its token embedding): compared as "
                         f"output.weight")
    return names, lines, None


def _tied_stand_in(ckpt, name: str) -> bool:
    return name == "output.weight" and ckpt.config.tie_embeddings


def _spec(ckpt, name: str):
    return ckpt.specs["tok_embeddings.weight" if name not in ckpt.specs else name]


def _tensor(ckpt, name: str) -> np.ndarray:
    """The tensor, a tied head's output.weight being the token embedding."""
    return ckpt.tensor("tok_embeddings.weight" if name not in ckpt.specs else name)


def _stored_type(ckpt, name: str) -> str | None:
    return ckpt.stored_type("tok_embeddings.weight" if name not in ckpt.specs else name)


def _cost(qtype: str | None) -> float:
    """The type's relative RMS error on gaussian rows: TYPE_COST's, else by its bits a weight."""
    if qtype is None:
        return 0.0
    if _family(qtype) in TYPE_COST:
        return TYPE_COST[_family(qtype)]
    bits = bits_per_weight(qtype)
    return UNKNOWN_COST if bits is None else 2.0 * 2.0 ** -bits


def _family(qtype: str) -> str:
    """The TYPE_COST key of a type: int8 in groups ("int8-g128") is int8's."""
    return qtype.split("-g")[0]


def _compare_tensor(a, b, name: str, diagnose: bool = True) -> dict:
    """One tensor's figures and verdict: a dict with name, type (the quantised type judged, or
    None), verdict, max_rel, rms_rel, ratio, row_ratio (against the reference), row_rel (each
    row's RMS relative error), bad_rows (indices), reference, and for a tensor that differs,
    with `diagnose`, pattern and check_next (_diagnose)."""
    result = _measure(a, b, name)
    if result["verdict"] == DIFFERENT and diagnose:
        x, y = result.pop("arrays")
        near = max(0.01, 2.0 * _cost(result["type"]))  # a relative RMS this close: the same
        result.update(zip(("pattern", "check_next"), patterns.diagnose(
            a, name, x, y, near, result["bad_rows"], result["row_rel"].size,
            "float rounding" if result["type"] is None else "quantisation")))
    result.pop("arrays", None)
    return result


def _measure(a, b, name: str) -> dict:
    """The tensor's figures and verdict (with its two arrays where it differs). A quantised side
    is judged with the other side as the true numbers: B's type against A first (B made from
    A), then, where A is quantised too, A's type against B (A and B both made from a third
    checkpoint, A the coarser); the first judgement that is not DIFFERENT stands."""
    x, y = _tensor(a, name), _tensor(b, name)
    rounding = tuple(map(max, zip(FLOAT_ROUNDING[np.dtype(_spec(a, name)[1])],
                                  FLOAT_ROUNDING[np.dtype(_spec(b, name)[1])])))
    type_a, type_b = _stored_type(a, name), _stored_type(b, name)
    judgements = [(t, truth) for t, truth in ((type_b, x), (type_a, y)) if t is not None]
    tried = []
    for qtype, true in judgements or [(None, x)]:
        tried.append(_judge(name, x, y, qtype, true, rounding))
        if tried[-1]["verdict"] != DIFFERENT:
            return tried[-1]
    return tried[0]


def _judge(name: str, x: np.ndarray, y: np.ndarray, qtype: str | None, true: np.ndarray,
           rounding: tuple[float, float]) -> dict:
    """A's tensor `x` against B's `y`, element by element within float `rounding` (relative,
    absolute), and where `qtype` is a quantised type one side holds, its error against that
    type's reference, `true` (x or y) standing for the numbers it quantised."""
    rel, absolute = rounding
    rows_x, rows_y, rows_t = (m.reshape(-1, m.shape[-1]) if m.ndim > 1 else m.reshape(1, -1)
                              for m in (x, y, true))
    n_rows, width = rows_x.shape
    reference = None if qtype is None else _requantiser(qtype, width)
    over, err2, true2, ref2 = (np.zeros(n_rows) for _ in range(4))
    max_diff, max_a = 0.0, 0.0
    step = max(1, CHUNK // max(width, 1))
    dtype = np.result_type(x.dtype, y.dtype, np.float32)  # float32 but for a float64 side
    for start in range(0, n_rows, step):
        cx, cy, ct = (m[start:start + step].astype(dtype) for m in (rows_x, rows_y, rows_t))
        diff = cy - cx
        over[start:start + step] = _beyond(cx, cy, diff, rel, absolute)
        err2[start:start + step] = np.square(diff).sum(axis=1, dtype=np.float64)
        true2[start:start + step] = np.square(ct).sum(axis=1, dtype=np.float64)
        max_diff = max(max_diff, float(np.abs(diff).max(initial=0.0)))
        max_a = max(max_a, float(np.abs(cx).max(initial=0.0)))
    if qtype is None and over.any():
        # float32 numbers that are all bfloat16's or float16's (a bfloat16 release's tensors,
        # written as float32 further down a chain of conversions) round as those did
        held = [_held_as(m) for m in (rows_x, rows_y)]
        wider = tuple(map(max, zip(rounding, *(FLOAT_ROUNDING[h] for h in held if h))))
        if wider != rounding:
            for start in range(0, n_rows, step):
                cx, cy = (m[start:start + step].astype(dtype) for m in (rows_x, rows_y))
                over[start:start + step] = _beyond(cx, cy, cy - cx, *wider)
    if reference is not None and over.any():  # only a tensor that is not the same needs it
        for start in range(0, n_rows, step):
            ct = rows_t[start:start + step]
            ref2[start:start + step] = np.square(reference(ct) - ct).sum(
                axis=1, dtype=np.float64)
    result = {"name": name, "type": qtype, "shape": tuple(x.shape),
              "max_rel": max_diff / max_a if max_a else max_diff,
              "rms_rel": float(np.sqrt(err2.sum() / true2.sum())) if true2.sum() else
              float(np.sqrt(err2.sum())),
              "ratio": None, "row_ratio": None, "reference": None}
    result["row_rel"] = np.sqrt(err2 / np.where(true2 > 0, true2, 1.0))
    if not over.any():
        return {**result, "verdict": SAME, "bad_rows": []}
    result["arrays"] = (x, y)
    if qtype is None:
        return {**result, "verdict": DIFFERENT, "bad_rows": np.flatnonzero(over).tolist()}
    how = "re-quantised" if reference is not None else "table"
    expected = ref2 if reference is not None else _cost(qtype) ** 2 * true2
    result["reference"] = f"{qtype} {how}" if reference is not None or _family(qtype) in \
        TYPE_COST else f"{qtype} by its bits a weight"
    floor = 0.25 * expected.mean()
    ratio = float(np.sqrt(err2.sum() / expected.sum())) if expected.sum() else np.inf
    row_ratios = np.sqrt(err2 / np.maximum(expected, floor)) if floor else np.where(err2 > 0,
                                                                                    np.inf, 0.0)
    bad = np.flatnonzero(~(row_ratios <= ROW_LIMIT[how]))  # a NaN row too
    result.update(ratio=ratio, row_ratio=float(np.max(row_ratios)))
    if ratio <= TENSOR_LIMIT[how] and not len(bad):
        return {**result, "verdict": WITHIN, "bad_rows": []}
    if not len(bad):  # too far off as a whole, no row alone: the rows above the tensor's limit
        bad = np.flatnonzero(~(row_ratios <= TENSOR_LIMIT[how]))
    return {**result, "verdict": DIFFERENT, "bad_rows": bad.tolist()}


def _beyond(cx: np.ndarray, cy: np.ndarray, diff: np.ndarray, rel: float, absolute: float
            ) -> np.ndarray:
    """Per row, the elements that differ by more than the rounding (rel, absolute) allows; a NaN
    or an infinity on either side always does."""
    return (~(np.abs(diff) <= rel * np.maximum(np.abs(cx), np.abs(cy)) + absolute)).sum(axis=1)


def _held_as(rows: np.ndarray) -> np.dtype | None:
    """bfloat16 or float16 where every one of the float32 `rows` is a number of that type (the
    narrower bfloat16 tried first), else None."""
    if rows.dtype != np.float32:
        return None
    step = max(1, CHUNK // max(rows.shape[1], 1))
    for narrow in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        if all(np.array_equal(part, part.astype(narrow).astype(np.float32))
               for part in (rows[i:i + step] for i in range(0, rows.shape[0], step))):
            return narrow
    return None


def _requantiser(qtype: str, width: int) -> Callable[[np.ndarray], np.ndarray] | None:
    """rows (float, `width` wide) -> their quantisation in `qtype`, dequantised (float32): by
    gguf.quants for the REQUANTISABLE GGUF types (rows of whole blocks), by bridge.quantize and
    bridge.int4 for the native format's int8 and int4; None for any other type."""
    if qtype == "int4":
        return lambda rows: dequantize_int4(*quantize_int4(np.asarray(rows, np.float32)))
    if _family(qtype) == "int8":
        group = int(qtype.split("-g")[1]) if "-g" in qtype else None
        return lambda rows: dequantize_weight(*quantize_weight(np.asarray(rows, np.float32),
                                                                group))
    if qtype not in REQUANTISABLE:
        return None
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if width % gguf.GGML_QUANT_SIZES[kind][0]:
        return None

    def requantise(rows: np.ndarray) -> np.ndarray:
        f32 = np.ascontiguousarray(rows, dtype=np.float32)
        return gguf.quants.dequantize(gguf.quants.quantize(f32, kind), kind).reshape(f32.shape)
    return requantise


class Dequantised(Checkpoint):
    """A native checkpoint of int8 or 4-bit weights (bridge.quantize) seen as float tensors: each
    quantised weight dequantised (float32) under its canonical name, its stored_type "int8"
    ("int8-g<G>" in groups of G) or "int4"; the scales and minima are not names of their own."""

    def __init__(self, inner: Checkpoint):
        q = inner.quantization
        self.inner, self.path, self.config, self.format = inner, inner.path, inner.config, \
            inner.format
        four = set(int4_names(inner.config)) if q.method == "int4" else set()
        int8 = "int8" if q.method == "int4" or q.group_size is None else f"int8-g{q.group_size}"
        self._types = {n: "int4" if n in four else int8 for n in quantized_names(inner.config)}
        self.specs = {n: (shape, np.dtype(np.float32) if n in self._types else inner.specs[n][1])
                      for n, shape in canonical_shapes(inner.config).items()}

    def tensor(self, name: str) -> np.ndarray:
        t, get = self._types.get(name), self.inner.tensor
        if t is None:
            return get(name)
        if t == "int4":
            return dequantize_int4(get(name), get(name + SCALE_SUFFIX), get(name + MIN_SUFFIX))
        return dequantize_weight(get(name), get(name + SCALE_SUFFIX))

    def stored_type(self, name: str) -> str | None:
        return self._types.get(name)


def _rows(indices: list[int]) -> str:
    """Row indices as 'row 5', 'rows 0-63' or 'rows 0-63 and 12 more'."""
    if not indices:
        return "no row"
    end = 0
    while end + 1 < len(indices) and indices[end + 1] == indices[end] + 1:
        end += 1
    first = (f"row {indices[0]}" if end == 0 else f"rows {indices[0]}-{indices[end]}")
    rest = len(indices) - end - 1
    return first + (f" and {rest} more" if rest else "")


def _describe(r: dict) -> str:
    """One differing tensor in a line: its rows, by how much, and what it looks like."""
    rows = r["bad_rows"] or list(range(r["row_rel"].size))
    worst, one = float(r["row_rel"][rows].max()), len(rows) == 1
    line = (f"tensor {r['name']}: {_rows(rows)} differ{'s' if one else ''} by {100 * worst:.3g}%"
            if np.isfinite(worst) else
            f"tensor {r['name']}: {_rows(rows)} hold{'s' if one else ''} a NaN or an infinity")
    if r["type"] is not None and r["ratio"] is not None:
        line += (f" ({r['ratio']:.3g}x the {r['reference']} error as a whole, worst row "
                 f"{r['row_ratio']:.3g}x)")
    return line + (f" ({r['pattern']})" if r.get("pattern") else "")


def _plain(figures):
    """The figures for --json: plain floats, None for a ratio over a reference error of 0
    (infinite) or a figure a NaN in a tensor made NaN."""
    if isinstance(figures, dict):
        return {k: _plain(v) for k, v in figures.items()}
    if isinstance(figures, list):
        return [_plain(v) for v in figures]
    if isinstance(figures, float):
        return float(figures) if np.isfinite(figures) else None
    return figures


def _finding(results: list[dict], types: dict, floats: dict, lines: list[str]) -> Finding:
    """The section's Finding over every tensor's result."""
    differing = [r for r in results if r["verdict"] == DIFFERENT]
    within = [r for r in results if r["verdict"] == WITHIN]
    figures = {"tensors": len(results), "same": len(results) - len(differing) - len(within),
               "within": len(within), "different": len(differing),
               "float": {"tensors": floats["tensors"], "largest_relative_difference":
                         floats["max_rel"], "tensor": floats["tensor"]},
               "types": {}}
    if floats["tensors"]:
        lines.append(f"float tensors: {floats['tensors']}, largest relative difference "
                     f"{floats['max_rel']:.3g} ({floats['tensor']})")
    for qtype, rs in sorted(types.items()):
        ratios = [r["ratio"] for r in rs if r["ratio"] is not None]
        rows = [r["row_ratio"] for r in rs if r["row_ratio"] is not None]
        figures["types"][qtype] = {
            "tensors": len(rs), "expected_relative_rms": round(_cost(qtype), 5),
            "reference": sorted({r["reference"] for r in rs if r["reference"]}),
            "median_ratio": float(np.median(ratios)) if ratios else None,
            "max_ratio": max(ratios) if ratios else None,
            "max_row_ratio": max(rows) if rows else None,
            "rms_relative": float(np.median([r["rms_rel"] for r in rs]))}
        t = figures["types"][qtype]
        exact = sum(r["verdict"] == SAME for r in rs)
        t["same"] = exact
        lines.append(f"{qtype}: {len(rs)} tensors"
                     + (f" ({exact} of them equal to A's within float rounding)" if exact else "")
                     + f", relative RMS error {t['rms_relative']:.3g} "
                     f"(median; the type's on gaussian rows {t['expected_relative_rms']})"
                     + (f", {t['median_ratio']:.3g}x (median) / {t['max_ratio']:.3g}x (max) "
                        f"its reference ({', '.join(t['reference'])}), worst row "
                        f"{t['max_row_ratio']:.3g}x" if ratios else ", equal to A's"))
    figures["different_tensors"] = [
        {"tensor": r["name"], "type": r["type"], "rows": len(r["bad_rows"]),
         "max_rel": r["max_rel"], "rms_rel": r["rms_rel"], "ratio": r["ratio"],
         "pattern": r.get("pattern")} for r in differing]
    figures = _plain(figures)
    lines += [_describe(r) for r in differing[:LISTED]]
    if len(differing) > LISTED:
        lines.append(f"... and {len(differing) - LISTED} more tensors differ")
    if differing:
        first = differing[0]
        return Finding("weights", DIFFERENT,
                       f"{len(differing)} of {len(results)} tensors differ, the first "
                       f"{first['name']}", lines=lines, cause=_describe(first),
                       check_next=first.get("check_next") or RESHUFFLED, figures=figures)
    if within:
        kinds = ", ".join(sorted(types))
        return Finding("weights", WITHIN,
                       f"{len(results)} tensors: {len(within)} within what {kinds} costs, the "
                       f"rest the same within float rounding", lines=lines, figures=figures)
    return Finding("weights", SAME, f"{len(results)} tensors, the same within float rounding",
                   lines=lines, figures=figures)
