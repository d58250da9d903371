"""The parity report behind `llama-bridge parity`: its stages in order, and its text form."""

from __future__ import annotations

from typing import Callable

from bridge.dtypes import numpy_dtype
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint

from .components import _norm_check, _rope_check, _weights_check
from .forward import _forward_checks, _jax_forward, _random_batch, _torch_forward
from .greedy import _greedy_check
from .judgement import BUDGET
from .memory import _check_memory, _freed_memory_returned, _give_back
from .references import REFERENCES, _import_error, _llama_cpp_checks, _transformers_forward
from .training import (ADAMW_EPS, ADAMW_STEPS, _float64_recipe, _optimizer_check,
                       _training_checks)


def parity_report(path, dtype: str = "float32", batch: int = 2, seq_len: int = 16,
                  new_tokens: int = 16, reference: str | None = None, seed: int = 0,
                  torch_model=None, jax_model=None, reference_f64: bool = True,
                  progress: Callable[[str], object] | None = None) -> dict:
    """Run the checkpoint at `path` through both twins (and `reference`) on one random batch of
    `batch` x `seq_len` ids and measure how far apart they are, and how far each is from the
    float64 answer (unless reference_f64 is False). torch_model stands in for the torch twin
    loaded from `path`, jax_model (a (Llama module, params) pair) for the JAX one (a test passes
    deliberately broken ones); neither is modified. progress(message) hears each stage.

    Returns {"path", "dtype", "batch", "seq_len", "new_tokens", "seed", "judged_by": "float64"
    or "the twins' difference", "checks": [{"figure", "compared", "kind", "ops", "value" (the
    difference), "errors" ({implementation: its error against float64}), "tolerance" (the
    budget each error is held to; the difference's bound without float64), "margin", "ok",
    "culprit", "detail", ...}], "first_divergence": {compared: None, or where the first figure
    out of bounds starts: {"block", "sublayer", "tensors", "implementation", "beyond"}},
    "culprit": {compared: the implementation beyond its budget where the first figure failed,
    or None}, "nearest_part": {compared: the largest error / budget of any part of any block},
    "reference": None or {"name", "status": "ok" or "skipped", "reason"}, "notes": [str],
    "passed": bool}.
    Bad arguments or a checkpoint the twins do not support raise BridgeError naming the field."""
    with _freed_memory_returned():
        return _report(path, dtype, batch, seq_len, new_tokens, reference, seed, torch_model,
                       jax_model, reference_f64, progress)


def _report(path, dtype, batch, seq_len, new_tokens, reference, seed, torch_model, jax_model,
            reference_f64, progress) -> dict:
    heard = progress or (lambda message: None)

    def say(message: str) -> None:  # each stage starts with what the last one freed given back
        _give_back()
        heard(message)
    if dtype not in BUDGET:
        raise BridgeError(f"expected one of {', '.join(BUDGET)}, got {dtype!r}", field="dtype")
    if reference is not None and reference not in REFERENCES:
        raise BridgeError(f"expected one of {', '.join(REFERENCES)}, got {reference!r}",
                          field="reference")
    for name, value, least in (("batch", batch, 1), ("seq_len", seq_len, 2),
                               ("new_tokens", new_tokens, 0)):
        if value < least:  # seq_len 2 at least: the loss needs a next token
            raise BridgeError(f"must be at least {least} (got {value})", field=name)
    ckpt = open_checkpoint(path)  # an unsupported config is refused here, by field
    config = ckpt.config
    if ckpt.quantization is not None:  # gradients and AdamW steps need float weights
        raise BridgeError(f"{ckpt.path}: holds int8-quantised weights (config.json "
                          f"'quantization'), which the report cannot train or compare with "
                          f"float64: run it on the float checkpoint they were made from")
    if seq_len > config.max_seq_len:
        raise BridgeError(f"{seq_len} exceeds the checkpoint's max_seq_len {config.max_seq_len}",
                          field="seq_len")
    _check_memory(ckpt, reference_f64, say)
    import jax_llama
    import torch_llama
    from jax_llama.training.step import TrainConfig

    notes = []
    tokens, mask = _random_batch(config, batch, seq_len, seed)
    real = mask.astype(bool)
    tc = TrainConfig(steps=ADAMW_STEPS, batch_size=batch, seq_len=seq_len - 1, eps=ADAMW_EPS)
    # The weights the twins hold, exactly: the checkpoint rounded to the dtype, read once for the
    # float64 run, the weights figure and the optimizer figure's starting point.
    held = {name: t.astype(numpy_dtype(dtype)) for name, t in ckpt}
    truth = None
    if reference_f64:
        from ..float64 import truth as float64_truth

        say(f"the float64 reference: forward, gradients and {ADAMW_STEPS} AdamW steps")
        truth = float64_truth(held, config, tokens, mask, _float64_recipe(tc), progress=heard)
    else:
        notes.append("no float64 reference: each figure judges the twins' difference against "
                     "the sum of their rounding budgets, and a FAIL cannot say which twin is off")
    # loaded after the float64 run, whose peak is the report's largest
    say(f"loading {path} into both twins ({dtype})")
    # both from the checkpoint opened above: the file is not opened again
    model, params = jax_model if jax_model is not None else jax_llama.load(ckpt, dtype=dtype)
    tmodel = torch_model if torch_model is not None else torch_llama.load(ckpt, device="cpu",
                                                                          dtype=dtype)

    say("RoPE over the context, and the forward pass: the hidden state after every block, "
        "and the logits")
    rope = _rope_check(model, tmodel, config, seed, reference_f64)
    say("the weights each twin holds, and RMSNorm")
    weights = _weights_check(model, params, tmodel, held, dtype)
    norm = _norm_check(model, tmodel, config, seed, reference_f64)
    checks, first_divergence = [rope, weights, norm], {}
    jax_out = _jax_forward(model, params, tokens, mask)
    truth_out = (truth.hidden, truth.logits, truth.sublayers) if truth is not None else None
    nearest = {}
    first_divergence["torch vs JAX"], nearest["torch vs JAX"] = _forward_checks(
        checks, "torch", jax_out, _torch_forward(tmodel, tokens, mask), truth_out, real, dtype)
    if first_divergence["torch vs JAX"] is None:
        # A bug too small for the forward figures (in bfloat16) that a component figure sees: a
        # wrong weight diverges at its block, RoPE and RMSNorm at the first (they run in all).
        first_divergence["torch vs JAX"] = _component_divergence(weights, rope, norm)
    logits_row = next(c for c in checks if c["figure"] == "logits")
    logit_bound = logits_row["difference_bound"] * logits_row["scale"]  # absolute

    n_new = min(new_tokens, config.max_seq_len - seq_len)
    if 0 < n_new < new_tokens:
        notes.append(f"greedy tokens: {n_new}, not {new_tokens}, to fit max_seq_len "
                     f"{config.max_seq_len}")
    if n_new > 0:
        say(f"greedy generation of {n_new} tokens by both twins")
        checks.append(_greedy_check(model, params, tmodel, tokens, real, n_new, logit_bound))
    else:
        why = ("new_tokens 0" if new_tokens == 0 else
               f"seq_len {seq_len} leaves no room in max_seq_len {config.max_seq_len}")
        notes.append(f"greedy tokens: skipped ({why})")

    say(f"one training step, then {ADAMW_STEPS} AdamW steps in both twins")
    training, jax_grads = _training_checks(model, params, tmodel, tokens, tc, truth, dtype)
    checks += training
    if truth is not None:
        truth.trained.clear()  # measured; freed before the optimizer figure's own runs
    say(f"{ADAMW_STEPS} AdamW steps of both twins' optimizers on the same gradients, float32")
    checks.append(_optimizer_check(model, tmodel, tc, held,
                                   truth.grads if truth is not None else jax_grads,
                                   reference_f64))

    ref = None
    if reference == "transformers":
        ref = {"name": "transformers", "status": "ok", "reason": None}
        missing = _import_error("transformers")
        if missing:
            ref.update(status="skipped", reason=f"transformers is not importable: {missing}")
            notes.append(f"reference transformers: skipped ({ref['reason']})")
        else:
            say("forward pass in transformers.LlamaForCausalLM")
            first_divergence["transformers vs JAX"], nearest["transformers vs JAX"] = (
                _forward_checks(checks, "transformers", jax_out,
                                _transformers_forward(path, dtype, tokens, mask), truth_out, real,
                                dtype))
    elif reference == "llama.cpp":
        from .. import llama_cpp_reference

        ref = {"name": "llama.cpp", "status": "ok", "reason": None}
        missing = llama_cpp_reference.unavailable()
        if missing is None:
            say("the checkpoint exported to GGUF and run by llama.cpp: logits and greedy tokens")
            try:
                checks += _llama_cpp_checks(path, dtype, model, params, tokens, real, n_new,
                                            jax_out[1], truth)
            except BridgeError as e:
                missing = e.message
        if missing is not None:
            ref.update(status="skipped", reason=missing)
            notes.append(f"reference llama.cpp: skipped ({missing})")
    culprit = {}
    for compared in first_divergence:
        failed = [c for c in checks if c["compared"] == compared and not c["ok"]]
        culprit[compared] = failed[0].get("culprit") if failed else None
    return {"path": str(path), "dtype": dtype, "batch": batch, "seq_len": seq_len,
            "new_tokens": n_new, "seed": seed,
            "judged_by": "float64" if reference_f64 else "the twins' difference",
            "checks": checks, "first_divergence": first_divergence, "culprit": culprit,
            "nearest_part": nearest, "reference": ref,
            "notes": notes, "passed": all(c["ok"] for c in checks)}


def _component_divergence(weights: dict, rope: dict, norm: dict) -> dict | None:
    """The first divergence a component figure names when the forward figures see none: a
    wrong weight's block and tensor, or RoPE / RMSNorm, which every block runs from block 0."""
    for row, part in ((weights, "weights"), (rope, "rope"), (norm, "norm")):
        if not row["ok"]:
            worst = max((row["errors"] or {"-": row["value"]}).values())
            return {"block": row.get("block", 0) or 0, "sublayer": part,
                    "tensors": [row["tensor"]] if row.get("tensor") else [],
                    "implementation": row["culprit"], "beyond": worst / row["tolerance"]}
    return None


def format_parity_report(report: dict) -> str:
    """The report as a compact table (figure, compared, difference, each side's error against
    float64, bound, margin, result, detail), then the first diverging block and the culprit of
    each comparison that has one, the notes and the verdict."""
    exact = report.get("judged_by", "float64") == "float64"
    lines = [f"parity of {report['path']}: {report['dtype']}, {report['batch']} x "
             f"{report['seq_len']} random tokens (seed {report['seed']}); judged against "
             + ("a float64 run of the same weights: each error within its rounding budget" if exact
                else "the twins' difference only: within the sum of their rounding budgets")
             + "; differences and errors relative to the scale of what they measure, KL in nats"]
    header = ("figure", "compared", "difference") + (("JAX vs f64", "other vs f64") if exact
                                                     else ()) + ("bound", "margin", "result")
    rows = [header + ("detail",)]
    for c in report["checks"]:
        errors = list((c["errors"] or {}).values())
        cells = (c["figure"], c["compared"], _number(c["value"]))
        if exact:
            cells += tuple(_number(e) for e in errors) if errors else ("-", "-")
        margin = "-" if c["margin"] is None else f"{c['margin']:.3g}x"
        result = "ok" if c["ok"] else "FAIL" + (f": {c['culprit']}" if c["culprit"] else "")
        rows.append(cells + (_number(c["tolerance"]), margin, result, c["detail"]))
    n = len(header)
    widths = [max(len(row[i]) for row in rows) for i in range(n)]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[n]
              for row in rows]
    for compared, where in report["first_divergence"].items():
        culprit = report.get("culprit", {}).get(compared)
        if where is not None:
            lines.append(f"first divergence ({compared}): {_where(where)}")
        elif culprit:
            lines.append(f"culprit ({compared}): {culprit} (beyond its rounding budget)")
    lines += report["notes"]
    failed = sum(not c["ok"] for c in report["checks"])
    lines.append("parity: " + (f"FAIL, {failed} figures out of bounds" if failed else
                               "ok, every figure within its bound"))
    return "\n".join(line.rstrip() for line in lines)


PARTS = {"attention_norm": "the attention norm", "attention": "the attention",
         "ffn_norm": "the feed-forward norm", "feed_forward": "the feed-forward",
         "output": "the block's output", "weights": "the weights as loaded",
         "rope": "RoPE", "norm": "RMSNorm"}


def _where(where: dict) -> str:
    """block 1, the feed-forward (layers.1.feed_forward.w1.weight, ...): torch 35x its rounding
    budget - check these tensors and this code in torch."""
    text = f"block {where['block']}, {PARTS.get(where['sublayer'], where['sublayer'])}"
    if where["tensors"]:
        text += f" (nearest tensors: {', '.join(where['tensors'])})"
    who = where["implementation"]
    text += (f": {who} {where['beyond']:.3g}x its rounding budget" if who else
             f": the twins' difference {where['beyond']:.3g}x the sum of their budgets")
    if who:
        text += f"; look there in {who}"
    return text


def _number(x) -> str:
    return "-" if x is None else x if isinstance(x, str) else f"{x:.2e}"
