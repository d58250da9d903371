"""Cross-framework checks that load both twins (the one place besides tests and benchmarks that
imports jax_llama and torch_llama together; both are imported inside the functions)."""

from __future__ import annotations

from typing import Sequence

from .sampling import Sampler


def greedy_parity(path: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  stop_ids: Sequence[int] = (), dtype: str | None = None) -> dict:
    """Greedy continuations of the same prompts by both twins from the checkpoint at `path`.

    Returns {"identical": bool, "rows": [{"jax": ids, "torch": ids, "first_difference": index
    or None}]}: where the twins first disagree, per prompt."""
    import jax_llama
    import torch_llama
    from jax_llama.generate import generate as jax_generate

    model, params = jax_llama.load(path, dtype=dtype)
    tmodel = torch_llama.load(path, device="cpu", dtype=dtype)
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
