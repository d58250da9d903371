"""The parity report behind `llama-bridge parity`: its stages in order, and its text form."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import numpy as np

from bridge.dtypes import numpy_dtype
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from bridge.sampling import Sampler

from .components import (_jax_norm, _jax_rope, _norm_check, _norm_row, _rope_check, _rope_row,
                         _torch_norm, _torch_rope, _weights_check, _weights_off, _weights_row)
from .forward import _forward_checks, _jax_forward, _random_batch, _torch_forward
from .greedy import _greedy_check
from .judgement import BUDGET, COMPOUNDING, SPREAD_MULTIPLE, _check
from .memory import _freed_memory_returned, _give_back, _plan_memory, training_skipped
from .products import NOTE as PRODUCTS_NOTE
from .products import float32_products, torch_lacks_bfloat16_kernel
from .references import REFERENCES, _import_error, _llama_cpp_checks, _transformers_forward
from .training import (ADAMW_EPS, ADAMW_STEPS, PERTURBED_RUNS, _float64_recipe,
                       _optimizer_check, _training_checks, perturbation)


def parity_report(path, dtype: str = "float32", batch: int = 2, seq_len: int = 16,
                  new_tokens: int = 16, reference: str | None = None, seed: int = 0,
                  torch_model=None, jax_model=None, reference_f64: bool = True,
                  training: bool | None = None, training_lr: float | None = None,
                  progress: Callable[[str], object] | None = None) -> dict:
    """Run the checkpoint at `path` through both twins (and `reference`) on one random batch of
    `batch` x `seq_len` ids and measure how far apart they are, and how far each is from the
    float64 answer (unless reference_f64 is False). torch_model stands in for the torch twin
    loaded from `path`, jax_model (a (Llama module, params) pair) for the JAX one (a test passes
    deliberately broken ones); neither is modified. training: whether the training figures run
    (both twins in memory, each trained in turn); None: when they fit in the memory available,
    else the forward, component and greedy figures run with one twin in memory at a time, the
    float64 reference block by block. training_lr: the peak learning rate of the training
    figures' AdamW steps (None: the training recipe's, 3e-3). progress(message) hears each
    stage.

    Returns {"path", "dtype", "batch", "seq_len", "new_tokens", "seed", "judged_by": "float64"
    or "the twins' difference", "checks": [{"figure", "compared", "kind", "ops", "value" (the
    difference), "errors" ({implementation: its error against float64}), "tolerance" (the
    budget each error is held to; the difference's bound without float64), "margin", "ok",
    "culprit", "detail", ...}], "first_divergence": {compared: None, or where the first figure
    out of bounds starts: {"block", "sublayer", "tensors", "implementation", "beyond"}},
    "culprit": {compared: the implementation beyond its budget where the first figure failed,
    or None}, "nearest_part": {compared: the largest error / budget of any part of any block},
    "reference": None or {"name", "status": "ok" or "skipped", "reason"}, "notes": [str],
    "advice": [str] (for a failed figure that compounds: how far beyond what rounding grows to
    on this model, and what to try), "passed": bool}.
    Bad arguments or a checkpoint the twins do not support raise BridgeError naming the field."""
    with _freed_memory_returned():
        return _report(path, dtype, batch, seq_len, new_tokens, reference, seed, torch_model,
                       jax_model, reference_f64, training, training_lr, progress)


def _report(path, dtype, batch, seq_len, new_tokens, reference, seed, torch_model, jax_model,
            reference_f64, training, training_lr, progress) -> dict:
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
    if training_lr is not None and not 0 < training_lr < float("inf"):
        raise BridgeError(f"must be a positive learning rate (got {training_lr})",
                          field="training_lr")
    ckpt = open_checkpoint(path)  # an unsupported config is refused here, by field
    config = ckpt.config
    if ckpt.quantization is not None:  # gradients and AdamW steps need float weights
        raise BridgeError(f"{ckpt.path}: holds int8-quantised weights (config.json "
                          f"'quantization'), which the report cannot train or compare with "
                          f"float64: run it on the float checkpoint they were made from")
    if seq_len > config.max_seq_len:
        raise BridgeError(f"{seq_len} exceeds the checkpoint's max_seq_len {config.max_seq_len}",
                          field="seq_len")
    training = _plan_memory(ckpt, dtype, reference_f64, training, say)
    from jax_llama.training.step import TrainConfig

    notes = []
    tokens, mask = _random_batch(config, batch, seq_len, seed)
    real = mask.astype(bool)
    tc = TrainConfig(steps=ADAMW_STEPS, batch_size=batch, seq_len=seq_len - 1, eps=ADAMW_EPS,
                     **({} if training_lr is None else {"lr": training_lr}))
    # The weights the twins hold, exactly: the checkpoint rounded to the dtype, read a tensor at
    # a time when a figure needs it (the float64 run, the weights figure, the optimizer's start).
    held = _Held(ckpt, dtype)
    truth = None
    if reference_f64:
        from ..float64 import truth as float64_truth

        say("the float64 reference: forward" + (
            f", gradients and {ADAMW_STEPS} AdamW steps, then {PERTURBED_RUNS} perturbed runs of "
            "them" if training else ", block by block"))
        truth = float64_truth(held, config, tokens, mask,
                              _float64_recipe(tc) if training else None, progress=heard,
                              perturbation=perturbation(config, dtype, seed))
    else:
        notes.append("no float64 reference: each figure judges the twins' difference against "
                     "the sum of their rounding budgets, and a FAIL cannot say which twin is off")
    n_new = min(new_tokens, config.max_seq_len - seq_len)
    if 0 < n_new < new_tokens:
        notes.append(f"greedy tokens: {n_new}, not {new_tokens}, to fit max_seq_len "
                     f"{config.max_seq_len}")
    elif n_new <= 0:
        why = ("new_tokens 0" if new_tokens == 0 else
               f"seq_len {seq_len} leaves no room in max_seq_len {config.max_seq_len}")
        notes.append(f"greedy tokens: skipped ({why})")
    work = _Batch(ckpt, config, dtype, tokens, mask, real, seed, max(n_new, 0), truth, held,
                    reference_f64, path)
    wide = dtype == "bfloat16" and torch_lacks_bfloat16_kernel()
    if wide:
        notes.append(PRODUCTS_NOTE)
    if not training:
        notes.append(f"training figures: skipped ({training_skipped(ckpt, reference_f64)}); "
                     "the twins were loaded one at a time")
    with float32_products() if wide else nullcontext():
        if training:
            checks, first_divergence, nearest, jax_out, twins = _both_twins(
                work, tc, torch_model, jax_model, reference, say)
        else:
            checks, first_divergence, nearest, jax_out, twins = _one_twin_at_a_time(
                work, torch_model, jax_model, reference, say)
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
                                _transformers_forward(path, dtype, tokens, mask), work.truth_out,
                                real,
                                dtype, work.local))
    elif reference == "llama.cpp":
        ref = {"name": "llama.cpp", "status": "ok", "reason": None}
        missing = twins["llama.cpp"]
        if missing is not None:
            ref.update(status="skipped", reason=missing)
            notes.append(f"reference llama.cpp: skipped ({missing})")
    culprit = {}
    for compared in first_divergence:
        failed = [c for c in checks if c["compared"] == compared and not c["ok"]]
        culprit[compared] = failed[0].get("culprit") if failed else None
    return {"path": str(path), "dtype": dtype, "batch": batch, "seq_len": seq_len,
            "new_tokens": max(n_new, 0), "seed": seed, "training": training,
            "judged_by": "float64" if reference_f64 else "the twins' difference",
            "checks": checks, "first_divergence": first_divergence, "culprit": culprit,
            "nearest_part": nearest, "reference": ref, "notes": notes,
            "advice": advice(checks, tc.lr), "passed": all(c["ok"] for c in checks)}


class _Held(Mapping):
    """The checkpoint's tensors rounded to the report's dtype (round to nearest even, as both
    twins' loaders do), each read from the checkpoint when asked for: never a copy of the
    model."""

    def __init__(self, ckpt, dtype: str):
        self._ckpt, self._dtype = ckpt, numpy_dtype(dtype)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._ckpt.tensor(name).astype(self._dtype, copy=False)

    def __iter__(self):
        return iter(self._ckpt.specs)

    def __len__(self) -> int:
        return len(self._ckpt.specs)


@dataclass
class _Batch:
    """What every stage of one report works on."""

    ckpt: object
    config: object
    dtype: str
    tokens: np.ndarray
    mask: np.ndarray
    real: np.ndarray
    seed: int
    n_new: int
    truth: object
    held: _Held
    reference_f64: bool
    path: object

    @property
    def truth_out(self):
        t = self.truth
        return None if t is None else (t.hidden, t.logits, t.sublayers)

    def local(self, i: int, parts: dict, x):
        """Each part of block i in float64 on the input an implementation gave it (x: its input
        to the block, None for the embedding)."""
        from ..float64 import parts_from

        return parts_from(self.held.__getitem__, self.config, i, parts, x, self.tokens,
                          self.mask)


def _jax_twin(b: _Batch, given):
    import jax_llama

    return given if given is not None else jax_llama.load(b.ckpt, dtype=b.dtype)


def _torch_twin(b: _Batch, given):
    import torch_llama

    return given if given is not None else torch_llama.load(b.ckpt, device="cpu", dtype=b.dtype)


def _both_twins(b: _Batch, tc, torch_model, jax_model, reference, say):
    """The full report: both twins in memory, the forward, component, greedy and training
    figures (and llama.cpp's, with that reference). Returns (checks, first_divergence,
    nearest_part, JAX's forward, {"llama.cpp": why it was skipped, or None, when it ran})."""
    say(f"loading {b.path} into both twins ({b.dtype})")
    # both from the checkpoint opened above: the file is not opened again
    model, params = _jax_twin(b, jax_model)
    tmodel = _torch_twin(b, torch_model)
    say("RoPE over the context, and the forward pass: the hidden state after every block, "
        "and the logits")
    rope = _rope_check(model, tmodel, b.config, b.seed, b.reference_f64)
    say("the weights each twin holds, and RMSNorm")
    weights = _weights_check(model, params, tmodel, b.held, b.dtype)
    norm = _norm_check(model, tmodel, b.config, b.seed, b.reference_f64)
    checks, first_divergence, nearest = [rope, weights, norm], {}, {}
    jax_out = _jax_forward(model, params, b.tokens, b.mask)
    first_divergence["torch vs JAX"], nearest["torch vs JAX"] = _forward_checks(
        checks, "torch", jax_out, _torch_forward(tmodel, b.tokens, b.mask), b.truth_out, b.real,
        b.dtype, b.local)
    if first_divergence["torch vs JAX"] is None:
        # A bug too small for the forward figures (in bfloat16) that a component figure sees: a
        # wrong weight diverges at its block, RoPE and RMSNorm at the first (they run in all).
        first_divergence["torch vs JAX"] = _component_divergence(weights, rope, norm)
    if b.n_new > 0:
        say(f"greedy generation of {b.n_new} tokens by both twins")
        checks.append(_greedy_check(model, params, tmodel, b.tokens, b.real, b.n_new,
                                    _logit_bound(checks)))
    say(f"one training step, then {ADAMW_STEPS} AdamW steps in both twins")
    training, jax_grads = _training_checks(model, params, tmodel, b.tokens, tc, b.truth, b.dtype)
    checks += training
    if b.truth is not None:
        b.truth.trained.clear()  # measured; freed before the optimizer figure's own runs
    say(f"{ADAMW_STEPS} AdamW steps of both twins' optimizers on the same gradients, float32")
    checks.append(_optimizer_check(model, tmodel, tc, b.held,
                                   b.truth.grads if b.truth is not None else jax_grads,
                                   b.reference_f64))
    del tmodel
    twins = {}
    if reference == "llama.cpp":
        twins["llama.cpp"] = _run_llama_cpp(b, model, params, jax_out, checks, say)
    return checks, first_divergence, nearest, jax_out, twins


def _one_twin_at_a_time(b: _Batch, torch_model, jax_model, reference, say):
    """The report of a model whose training figures do not fit in memory: the forward, component
    and greedy figures, with one twin in memory at a time (each measured, then freed) and the
    near-tie of a greedy difference judged on the float64 logits. Returns as _both_twins, with
    {"llama.cpp": why it was skipped, or None} for its last item when it ran (while the JAX
    twin was loaded)."""
    import torch_llama
    from jax_llama.checkpoint import tensor_specs
    from jax_llama.inference.generate import generate as jax_generate

    prompts = [row[keep].tolist() for row, keep in zip(b.tokens, b.real)]
    say(f"loading {b.path} into the JAX twin ({b.dtype}); the torch twin after it")
    model, params = _jax_twin(b, jax_model)
    say("the JAX twin: RoPE, its weights, RMSNorm, the forward pass"
        + (f", greedy generation of {b.n_new} tokens" if b.n_new else ""))
    mine = {"rope": _jax_rope(model, b.config, b.seed), "norm": _jax_norm(model, b.config, b.seed),
            "weights": _weights_off(tensor_specs(params, model.config)[1], b.held, b.dtype),
            "forward": _jax_forward(model, params, b.tokens, b.mask),
            "greedy": jax_generate(model, params, prompts, b.n_new, Sampler(), ()).tokens
            if b.n_new else None}
    twins, checks = {}, []
    if reference == "llama.cpp":
        twins["llama.cpp"] = _run_llama_cpp(b, model, params, mine["forward"], checks, say)
    del model, params
    _give_back()
    say(f"loading {b.path} into the torch twin ({b.dtype})")
    tmodel = _torch_twin(b, torch_model)
    say("the torch twin: RoPE, its weights, RMSNorm, the forward pass"
        + (f", greedy generation of {b.n_new} tokens" if b.n_new else ""))
    theirs = {"rope": _torch_rope(tmodel, b.config, b.seed),
              "norm": _torch_norm(tmodel, b.config, b.seed),
              "weights": _weights_off(tmodel.state_dict().__getitem__, b.held, b.dtype),
              "forward": _torch_forward(tmodel, b.tokens, b.mask),
              "greedy": torch_llama.generate(tmodel, prompts, b.n_new, Sampler(), ()).tokens
              if b.n_new else None}
    del tmodel
    _give_back()
    rope = _rope_row(mine["rope"], theirs["rope"], b.config, b.seed, b.reference_f64)
    weights = _weights_row(mine["weights"], theirs["weights"], None, b.dtype)
    norm = _norm_row(mine["norm"], theirs["norm"], b.config, b.seed, b.reference_f64)
    forward = [rope, weights, norm]
    first_divergence, nearest = {}, {}
    first_divergence["torch vs JAX"], nearest["torch vs JAX"] = _forward_checks(
        forward, "torch", mine["forward"], theirs["forward"], b.truth_out, b.real, b.dtype,
        b.local)
    if first_divergence["torch vs JAX"] is None:
        first_divergence["torch vs JAX"] = _component_divergence(weights, rope, norm)
    if b.n_new > 0:
        forward.append(_greedy_by_float64(b, prompts, mine["greedy"], theirs["greedy"],
                                          _logit_bound(forward)))
    return forward + checks, first_divergence, nearest, mine["forward"], twins


def _greedy_by_float64(b: _Batch, prompts, ours, theirs, logit_bound: float) -> dict:
    """The greedy figure from each twin's tokens, run apart: a first difference passes only at a
    near-tie of the float64 logits of the common prefix (each twin within its budget of them
    can choose either token only when they are within the logits' difference bound)."""
    from ..float64 import forward_blocks

    import jax

    notes, ok, firsts = [], True, []
    for i, (prompt, x, y) in enumerate(zip(prompts, ours, theirs)):
        k = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q),
                 None if len(x) == len(y) else min(len(x), len(y)))
        if k is None:
            continue
        firsts.append(k)
        if k >= min(len(x), len(y)):  # one twin stopped (a stop id) early
            gap = float("inf")
        else:
            prefix = np.asarray([prompt + list(x[:k])], np.int32)
            with jax.enable_x64(True):
                exact = forward_blocks(b.held.__getitem__, b.config, prefix,
                                       np.ones_like(prefix))[1][0, -1]
            gap = abs(exact[x[k]] - exact[y[k]])
        ok = ok and gap <= logit_bound
        notes.append(f"row {i} at token {k}: JAX {x[k:k + 1]} vs torch {y[k:k + 1]}, float64 "
                     f"logit gap {gap:.2e}")
    detail = ("; ".join(notes) + f" (a near-tie if the gap <= {logit_bound:.1e})" if notes
              else f"all {len(prompts)} rows agree on {b.n_new} tokens")
    return _check("greedy tokens, first difference", "torch vs JAX",
                  min(firsts) if firsts else None, "near-tie", ok=ok, detail=detail)


def _logit_bound(checks: list) -> float:
    """The absolute bound on the twins' logits' difference (the logits row's, times its scale)."""
    logits = next(c for c in checks if c["figure"] == "logits")
    return logits["difference_bound"] * logits["scale"]


def _run_llama_cpp(b: _Batch, model, params, jax_out, checks: list, say) -> str | None:
    """Append llama.cpp's rows (its logits and greedy tokens against float64 and JAX); returns
    why it was skipped, or None."""
    from .. import llama_cpp_reference

    missing = llama_cpp_reference.unavailable()
    if missing is None:
        say("the checkpoint exported to GGUF and run by llama.cpp: logits and greedy tokens")
        try:
            checks += _llama_cpp_checks(b.path, b.dtype, model, params, b.tokens, b.real,
                                        b.n_new, jax_out[1], b.truth)
        except BridgeError as e:
            missing = e.message
    return missing


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


def advice(checks: list[dict], lr: float) -> list[str]:
    """For each failed figure that compounds (judgement.COMPOUNDING: the AdamW trajectory), what
    the report knows and what to try: which twins depart from float64, how many times the
    perturbed float64 runs' spread that is, the first figure to fail, a smaller step and
    --no-training."""
    lines = []
    first = next((c for c in checks if not c["ok"]), None)
    for c in checks:
        if c["ok"] or c.get("kind") not in COMPOUNDING:
            continue
        figure = f"'{c['figure']}'"
        if c["errors"] is None:
            lines.append(f"{figure} fails on the twins' difference alone: without the float64 run "
                         "the report cannot tell how far rounding carries on this model; rerun "
                         "without --no-reference-f64")
            continue
        beyond = [n for n, e in c["errors"].items() if not e <= c["tolerance"]]
        each = ", ".join(f"{n} {e:.2g} lr" for n, e in c["errors"].items())
        text = (f"both twins depart from float64 together on {figure} ({each})"
                if len(beyond) == len(c["errors"]) else
                f"{' and '.join(beyond)} departs from float64 on {figure} ({each})")
        text += f", beyond its bound of {c['tolerance']:.2g} lr"
        spread, worst = c.get("spread"), max(c["errors"].values())
        if spread:
            text += (f" (the larger of its fixed budget and {SPREAD_MULTIPLE:g}x the spread of the "
                     f"perturbed float64 runs): {worst / spread:.3g}x that spread ({spread:.2g} "
                     "lr, rounding-sized noise grown by this model over the same steps), so "
                     "rounding does not explain it.")
        else:
            text += "."
        optimizer = next((o for o in checks if o.get("kind") == "optimizer"), None)
        if first is not c:
            text += (f" The first figure to fail is '{first['figure']}': look there first, "
                     "the steps carry on what it gets wrong.")
        elif optimizer is not None and not optimizer["ok"]:
            text += (f" '{optimizer['figure']}' fails too: the optimizer itself departs (its "
                     "decay mask, clipping, schedule or moments); look there first.")
        else:
            text += (" The loss, the gradients and AdamW on shared gradients are within their "
                     "bounds, so each step's parts agree with float64 and their chaining departs "
                     "(what a step hands the next: the weights, the moments, the schedule, "
                     "gradients not zeroed).")
        text += (f" To try: a smaller step (--training-lr {lr / 10:g}), where rounding's growth "
                 "shrinks with the step and the spread shows it while a bug's departure, in "
                 "learning rates, stays; --no-training checks the model alone.")
        lines.append(text)
    return lines


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
            lines.append(f"culprit ({compared}): {culprit} (beyond "
                         + ("their rounding budgets)" if " and " in culprit else
                            "its rounding budget)"))
    lines += [f"advice: {line}" for line in report.get("advice", [])]
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
    if who and where["beyond"] <= 1:  # no part beyond its own budget: the largest own error
        text += (f": {who}'s largest error of a part's own ({where['beyond']:.3g}x one block's "
                 f"rounding budget; together they put the block beyond it)")
    else:
        text += (f": {who} {where['beyond']:.3g}x its rounding budget" if who else
                 f": the twins' difference {where['beyond']:.3g}x the sum of their budgets")
    if who:
        text += f"; look there in {who}"
    return text


def _number(x) -> str:
    return "-" if x is None else x if isinstance(x, str) else f"{x:.2e}"
