"""Greedy decoding by both twins: the comparison behind `jax-llama generate --compare-torch`, and
the report's greedy-tokens figure, where a first difference passes only at a near-tie."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from bridge.formats import Checkpoint, open_checkpoint
from bridge.sampling import Sampler

from .judgement import NEAR_TIE, _check, _f64


def greedy_parity(path: str | os.PathLike | Checkpoint, prompts: Sequence[Sequence[int]],
                  max_new_tokens: int, stop_ids: Sequence[int] = (), dtype: str | None = None,
                  adapter: str | None = None) -> dict:
    """Greedy continuations of the same prompts by both twins from the checkpoint at `path` (a
    path, or a checkpoint already opened by bridge.formats.open_checkpoint; either way both twins
    read it from one opening), with the PEFT LoRA `adapter` merged in, when given.

    Returns {"identical": bool, "rows": [{"jax": ids, "torch": ids, "first_difference": index
    or None}]}: where the twins first disagree, per prompt."""
    import jax_llama
    import torch_llama

    checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    model, params = jax_llama.load(checkpoint, dtype=dtype, adapter=adapter)
    tmodel = torch_llama.load(checkpoint, device="cpu", dtype=dtype, adapter=adapter)
    return compare_greedy(model, params, tmodel, prompts, max_new_tokens, stop_ids)


def compare_greedy(model, params, tmodel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   stop_ids: Sequence[int] = ()) -> dict:
    """greedy_parity on models already loaded: a Flax Llama with its params, a torch_llama.Llama."""
    import torch_llama
    from jax_llama.inference.generate import generate as jax_generate

    a = jax_generate(model, params, prompts, max_new_tokens, Sampler(), stop_ids).tokens
    b = torch_llama.generate(tmodel, prompts, max_new_tokens, Sampler(), stop_ids).tokens
    rows = []
    for x, y in zip(a, b):
        first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q),
                     None if len(x) == len(y) else min(len(x), len(y)))
        rows.append({"jax": x, "torch": y, "first_difference": first})
    return {"identical": all(r["first_difference"] is None for r in rows), "rows": rows}


def format_greedy_parity(report: dict, decode) -> str:
    lines = []
    for i, r in enumerate(report["rows"]):
        n = len(r["jax"])
        if r["first_difference"] is None:
            lines.append(f"prompt {i}: JAX and torch agree on all {n} greedy tokens")
        else:
            k = r["first_difference"]
            lines.append(f"prompt {i}: first difference at new token {k}: JAX {r['jax'][k:k + 1]} "
                         f"vs torch {r['torch'][k:k + 1]} after {decode(r['jax'][:k])!r}")
    return "\n".join(lines)


def _greedy_check(model, params, tmodel, tokens, real, n_new: int, logit_bound: float) -> dict:
    """Greedy continuations of each row's real tokens by both twins (compare_greedy). Passes when
    they agree, or when each first difference is a near-tie (NEAR_TIE), the gap measured by a
    plain forward pass of the common prefix in each twin. value: the earliest first difference."""
    import torch

    prompts = [row[keep].tolist() for row, keep in zip(tokens, real)]
    rows = compare_greedy(model, params, tmodel, prompts, n_new)["rows"]
    allowed, notes, ok = NEAR_TIE * logit_bound, [], True
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        k = row["first_difference"]
        if k is None:
            continue
        if k >= min(len(row["jax"]), len(row["torch"])):  # one twin stopped (a stop id) early
            gap = float("inf")
        else:
            prefix = np.asarray([prompt + row["jax"][:k]], np.int32)
            pair = [row["jax"][k], row["torch"][k]]  # the two tokens chosen
            jax_last = _f64(model.apply({"params": params}, prefix))[0, -1, pair]
            with torch.inference_mode():
                torch_last = _f64(tmodel(torch.as_tensor(prefix)))[0, -1, pair]
            gap = max(abs(jax_last[0] - jax_last[1]), abs(torch_last[0] - torch_last[1]))
        ok = ok and gap <= allowed
        notes.append(f"row {i} at token {k}: JAX {row['jax'][k:k + 1]} vs torch "
                     f"{row['torch'][k:k + 1]}, logit gap {gap:.2e}")
    firsts = [r["first_difference"] for r in rows if r["first_difference"] is not None]
    detail = ("; ".join(notes) + f" (a near-tie if the gap <= {allowed:.1e})" if notes
              else f"all {len(rows)} rows agree on {n_new} tokens")
    check = _check("greedy tokens, first difference", "torch vs JAX",
                   min(firsts) if firsts else None, "near-tie", ok=ok, detail=detail)
    return dict(check, rows=rows)
