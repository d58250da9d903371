"""What a tensor that differs looks like: the classic ways a converter, a quantiser or a merge
writes a tensor wrong, tried one by one on A's tensor and B's (diagnose), for the weights
section of `llama-bridge compare`.

In the order tried: a LoRA merge whose update is the adapter's times another scale (or not
merged at all); q/k rows in the other RoPE layout, or permuted with the wrong head count; a head
one row off or replaced by the embedding; a transposed matrix; a norm with a (1 + w) offset; a
tensor all zeros; a tensor scaled as a whole; a few rows swapped among themselves (token ids
reordered) or broken; two tensors swapped or the layers one off.
"""

from __future__ import annotations

import numpy as np

from ..formats.hf import _heads_to_permute, from_half_split, to_half_split

RESHUFFLED = ("the converter's tensor names and the layer order; whether B was written from "
              "another checkpoint")
# Rows swapped among themselves are looked for among this many broken rows at most.
PERMUTED_ROWS = 64


def diagnose(a, name: str, x: np.ndarray, y: np.ndarray, near: float, bad_rows: list[int],
             n_rows: int, within: str) -> tuple[str, str]:
    """(what B's tensor is, in words, what to check next) for a tensor of A (`x`) that B (`y`)
    does not match. `near`: a relative RMS difference this small is the same numbers (the
    storage type's error); `bad_rows`: the rows beyond it, of `n_rows`; `within`: what the
    other rows are the same within ("float rounding", "quantisation")."""
    x, y = (np.asarray(m, np.float32) for m in (x, y))  # float32: one temporary of each size

    def same(u: np.ndarray, v: np.ndarray, tolerance: float = near) -> bool:
        if u.shape != v.shape:
            return False
        d, v = (u - v).ravel(), v.ravel()
        return float(np.dot(d, d)) <= tolerance ** 2 * max(float(np.dot(v, v)), 1e-60)

    merge = _merge_pattern(a, name, y, same)
    if merge:
        return merge
    heads = _heads_to_permute(name, a.config)
    if heads is not None:
        found = _rope_pattern(x, y, heads, a.config, same)
        if found:
            return found
    if x.ndim == 2:
        pattern = _head_pattern(a, name, x, y, same)
        if pattern:
            return pattern, ("the LM head: whether the model ties it to the embedding, and the "
                             "row offset the writer used (a BOS or padding row added or dropped: "
                             "llama.cpp #12567)")
        if x.shape[0] == x.shape[1] and same(x.T, y):
            return "B is A transposed", "the writer's (out, in) against (in, out) layout"
    if x.ndim == 1 or name.endswith("norm.weight"):
        for offset in (1.0, -1.0):
            if same(x + offset, y):
                return (f"B is A {'+' if offset > 0 else '-'} 1 (a norm's (1 + w) convention "
                        f"applied or undone)", "how the writer stores norm weights (Gemma's "
                                               "1 + w against LLaMA's w)")
    if not np.any(y):
        return "B's tensor is all zeros", "whether the writer wrote this tensor's data at all"
    dot = float(np.dot(x.ravel(), x.ravel()))
    if dot:
        c = float(np.dot(x.ravel(), y.ravel())) / dot
        # scaled as a whole: what is left after the scale is the storage's error, and small
        # next to the scale's own change (a 0.1% scale of float32 numbers is still a scale)
        if abs(c - 1.0) > 1e-6 and same(c * x, y, min(near, abs(c - 1.0) / 4)):
            return f"B is A times {c:.6g}", ("a scale the writer applied: a norm's (1 + w) "
                                              "convention, a multiplier folded in, a dtype's "
                                              "scale left in")
    if bad_rows and len(bad_rows) <= max(1, n_rows // 10):
        moved = _rows_moved(x, y, bad_rows, same)
        if moved:
            return moved, ("the vocabulary's order in both (a token added, removed or renumbered "
                           "in the conversion: the tokenizer section)" if "embedding" in name or
                           name == "output.weight" else "the writer's row order")
        return (f"{len(bad_rows)} of {n_rows} rows broken, the rest the same within {within}",
                "the file's blocks at those rows (a bad write, a corrupted download: compare "
                "the file's checksum) or the tool that wrote them")
    other = _another_tensor(a, name, y, same)
    if other:
        return (f"B's tensor is A's {other} (two tensors swapped, or the layers one off)",
                "the converter's name table (w1 is the gate, w3 the up projection) and its "
                "layer numbering")
    return "the whole tensor differs", RESHUFFLED


def _merge_pattern(a, name: str, y: np.ndarray, same) -> tuple[str, str] | None:
    """Where A is a checkpoint with a LoRA adapter (it has adapter_update) and B a merge of it:
    B = base + k x the adapter's update with k != 1 (the merge's alpha / r, or rsLoRA's
    alpha / sqrt(r), not the adapter's), or B is the base (k = 0: not merged)."""
    parts = getattr(a, "adapter_update", lambda _: None)(name)
    if parts is None:
        return None
    base, update = (np.asarray(m, np.float32) for m in parts)
    uu = float(np.dot(update.ravel(), update.ravel()))
    if not uu:
        return None
    k = float(np.dot((y - base).ravel(), update.ravel())) / uu
    if abs(k - 1.0) < 1e-3 or not same(base + k * update, y):
        return None
    if abs(k) < 1e-3:
        return ("B is A's base without the adapter's update (not merged)",
                "whether the merge ran on this tensor: the adapter's target_modules against the "
                "merge tool's")
    return (f"B is A's base plus {k:.4g} x the adapter's update (the merge scaled it by "
            f"{k:.4g} times the adapter's alpha / r)",
            "the LoRA scale the merge used: the adapter's lora_alpha and r "
            "(adapter_config.json), alpha / r against rsLoRA's alpha / sqrt(r) (unsloth #2142)")


def _rope_pattern(x, y, heads, config, same) -> tuple[str, str] | None:
    """q/k rows in the other RoPE layout, with the right head count or a wrong one."""
    tried = dict.fromkeys((heads, config.n_heads, config.n_kv_heads, 1))
    # a wrong count's permutation undone with the right one (the reader's) is tried first
    for h in tried:
        if x.shape[0] % (2 * h):
            continue
        for permute in (to_half_split, from_half_split):
            if same(permute(x, h), y):
                how = "" if h == heads else (f" with {h} heads where {heads} are due (a "
                                             f"grouped-query model's n_kv_heads)")
                return (f"B's rows are A's in the other RoPE layout ({permute.__name__}"
                        f"{how}: a q/k RoPE permutation)",
                        "the converter's q/k permutation: Hugging Face's half-split rows "
                        "against the interleaved ones of Meta and GGUF, applied the wrong "
                        "way, twice, or with n_heads for wk on a grouped-query model "
                        "(llama.cpp #2376, #3364)")
    pairs = sorted(((h1, h2) for h1 in tried for h2 in tried if h1 != h2),
                   key=lambda pair: pair[1] != heads)
    for h1, h2 in pairs:  # permuted to Hugging Face's layout with one count, back with another
        if not x.shape[0] % (2 * h1) and not x.shape[0] % (2 * h2) and \
                same(from_half_split(to_half_split(x, h1), h2), y):
            return (f"B's rows are A's permuted to the half-split RoPE layout with {h1} "
                    f"heads and back with {h2} (a q/k RoPE permutation with the wrong head "
                    f"count)",
                    "the head count the converter permuted wq/wk with: n_kv_heads for wk on "
                    "a grouped-query model (llama.cpp #3364, transformers #31788)")
    return None


def _rows_moved(x, y, bad_rows: list[int], same) -> str | None:
    """Where each of B's broken rows is one of A's other broken rows (rows swapped or rotated
    among themselves): 'B's row i is A's row j, ...'."""
    if len(bad_rows) < 2 or len(bad_rows) > PERMUTED_ROWS:
        return None
    source = {}
    for i in bad_rows:
        j = next((j for j in bad_rows if j != i and same(x[j], y[i])), None)
        if j is None:
            return None
        source[i] = j
    shown = ", ".join(f"row {i} is A's row {j}" for i, j in list(source.items())[:4])
    more = f" and {len(source) - 4} more" if len(source) > 4 else ""
    return f"{len(source)} rows moved among themselves: B's {shown}{more}"


def _another_tensor(a, name: str, y: np.ndarray, same) -> str | None:
    """The name of another of A's tensors that B's `y` is: one of the same shape in the same
    layer (the gate and up projections swapped), or this one of the layer before or after."""
    if not name.startswith("layers."):
        return None
    _, layer, suffix = name.split(".", 2)
    siblings = [n for n in a.specs if n.startswith(f"layers.{layer}.") and n != name
                and a.specs[n][0] == a.specs[name][0]]
    neighbours = [f"layers.{int(layer) + d}.{suffix}" for d in (-1, 1)]
    for other in siblings + [n for n in neighbours if n in a.specs]:
        if same(np.asarray(a.tensor(other), np.float32), y):
            return other
    return None


def _head_pattern(a, name: str, x: np.ndarray, y: np.ndarray, same) -> str | None:
    """For the LM head or the embedding: B's is one row off from A's, or is A's embedding."""
    if name not in ("output.weight", "tok_embeddings.weight"):
        return None
    sources = [("A's", x)]
    if name == "output.weight" and "output.weight" in a.specs:
        sources.append(("A's token embedding",
                        np.asarray(a.tensor("tok_embeddings.weight"), np.float32)))
        if same(sources[-1][1], y):
            return "B's LM head is A's token embedding (a head tied where A's is its own)"
    for label, source in sources:
        if same(source[:-1], y[1:]):
            return f"B's rows are {label} one row down (row i holds A's row i-1)"
        if same(source[1:], y[:-1]):
            return f"B's rows are {label} one row up (row i holds A's row i+1)"
    return None
