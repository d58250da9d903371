"""Cross-framework checks that load both twins: the parity report behind `llama-bridge parity` and
the greedy comparison behind `jax-llama generate --compare-torch`.

Like everything in llama_twins it sits above both twins; jax_llama, torch_llama (and transformers)
are imported inside the functions, so that the commands start fast and a missing reference is
reported rather than fatal.

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

import contextlib
import copy
import importlib
import math
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bridge.dtypes import dtype_name, numpy_dtype
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from bridge.resources import available_memory as _available_memory
from bridge.sampling import Sampler

REFERENCES = ("transformers", "llama.cpp")
# llama.cpp's logits (--reference llama.cpp) against the float64 answer (JAX's without it),
# relative to their scale, per report dtype. It is not float32 inside: its KV cache is F16 (11
# bits of mantissa) and a BF16 file's products take BF16 activations. Measured on SmolLM2-135M
# (30 layers, logits up to ~36): F32 1.2e-3, BF16 0.12 against JAX's bfloat16 run; the
# bounds sit ~8x and ~2x above, far below a wrong RoPE or q/k row order (O(1)). See
# results/parity_memory.md.
LLAMA_CPP_LOGITS = {"float32": 1e-2, "bfloat16": 0.25}
ADAMW_STEPS = 10
# The training figures run the project's own recipe (jax_llama.train.TrainConfig defaults: lr
# 3e-3, b1 0.9, b2 0.95, weight decay 0.1 on 2-D weights, clipping at 1.0, warmup then cosine)
# but for eps. With eps = 1e-8 Adam divides by sqrt(nu), so a gradient entry that is a cancelling
# sum, near zero and with a relative rounding error of order 1 (its sign, even), steps by up to lr
# differently in the two twins: nothing bounds the figure below ~lr per step, about what a wrong
# decay mask or missing clipping gives (0.5 lr and 1.5 lr measured after 10 steps), though tiny
# models measure 1e-3 - 7e-3 lr. eps = 1e-3, a fraction of a typical clipped gradient entry of a
# small model, keeps Adam's normalisation for the large entries while a near-zero one steps by
# ~lr * g / eps, smooth in g: rounding then moves parameters by 4e-5 lr (tests/test_train.py
# uses eps = 1 for the same reason).
ADAMW_EPS = 1e-3
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
# times it. On the correct checkpoints of the calibration (results/parity.md) r was at most 1.7
# between the twins, which compute RoPE's frequencies identically, and 3.2 for transformers, whose
# frequencies are computed in float32 (on the trained 6-layer model); FACTOR = 6 allows r up to 5,
# while a bug in one twin puts it r = 10 - 10^9 times farther off than the other.
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


def greedy_parity(path: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  stop_ids: Sequence[int] = (), dtype: str | None = None,
                  adapter: str | None = None) -> dict:
    """Greedy continuations of the same prompts by both twins from the checkpoint at `path`
    (with the PEFT LoRA `adapter` merged in, when given).

    Returns {"identical": bool, "rows": [{"jax": ids, "torch": ids, "first_difference": index
    or None}]}: where the twins first disagree, per prompt."""
    import jax_llama
    import torch_llama

    model, params = jax_llama.load(path, dtype=dtype, adapter=adapter)
    tmodel = torch_llama.load(path, device="cpu", dtype=dtype, adapter=adapter)
    return compare_greedy(model, params, tmodel, prompts, max_new_tokens, stop_ids)


def compare_greedy(model, params, tmodel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   stop_ids: Sequence[int] = ()) -> dict:
    """greedy_parity on models already loaded: a Flax Llama with its params, a torch_llama.Llama."""
    import torch_llama
    from jax_llama.generate import generate as jax_generate

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


# -- the parity report ----------------------------------------------------------------------------

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
    or "fixed tolerances", "checks": [{"figure", "compared", "value", "errors", "tolerance",
    "margin", "ok", "culprit", "detail", ...}], "first_divergence": {compared: first block out of
    bounds or None}, "culprit": {compared: the implementation far from float64 where the first
    figure failed, or None}, "reference": None or {"name", "status": "ok" or "skipped",
    "reason"}, "notes": [str], "passed": bool}.
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
    if dtype not in TOLERANCES:
        raise BridgeError(f"expected one of {', '.join(TOLERANCES)}, got {dtype!r}", field="dtype")
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
    from jax_llama.train import TrainConfig

    notes = []
    tokens, mask = _random_batch(config, batch, seq_len, seed)
    real = mask.astype(bool)
    tc = TrainConfig(steps=ADAMW_STEPS, batch_size=batch, seq_len=seq_len - 1, eps=ADAMW_EPS)
    # The weights the twins hold, exactly: the checkpoint rounded to the dtype, read once for the
    # float64 run, the weights figure and the optimizer figure's starting point.
    held = {name: t.astype(numpy_dtype(dtype)) for name, t in ckpt}
    truth = None
    if reference_f64:
        from .float64 import truth as float64_truth

        say(f"the float64 reference: forward, gradients and {ADAMW_STEPS} AdamW steps")
        truth = float64_truth(held, config, tokens, mask, _float64_recipe(tc))
    else:
        notes.append("judged by fixed tolerances (no float64 reference): these were measured on "
                     "small models and may fail a correct port of a large or trained one")
    # loaded after the float64 run, whose peak is the report's largest
    say(f"loading {path} into both twins ({dtype})")
    model, params = jax_model if jax_model is not None else jax_llama.load(path, dtype=dtype)
    tmodel = torch_model if torch_model is not None else torch_llama.load(path, device="cpu",
                                                                          dtype=dtype)

    say("RoPE over the context, and the forward pass: the hidden state after every block, "
        "and the logits")
    rope = _rope_check(model, tmodel, config, seed, reference_f64)
    say("the weights each twin holds, and RMSNorm")
    weights = _weights_check(model, params, tmodel, held, dtype)
    norm = _norm_check(model, tmodel, config, seed, reference_f64)
    checks, first_divergence = [rope, weights, norm], {}
    jax_out = _jax_forward(model, params, tokens, mask)
    truth_out = (truth.hidden, truth.logits) if truth is not None else None
    first_divergence["torch vs JAX"] = _forward_checks(
        checks, "torch", jax_out, _torch_forward(tmodel, tokens, mask), truth_out, real, dtype)
    if first_divergence["torch vs JAX"] is None:
        # A bug too small for the forward figures (in bfloat16) that a component figure sees: a
        # wrong weight diverges at its block, RoPE and RMSNorm at the first (they run in all).
        first_divergence["torch vs JAX"] = (weights["block"] if not weights["ok"] else
                                            0 if not (rope["ok"] and norm["ok"]) else None)
    logits_row = next(c for c in checks if c["figure"] == "logits")
    logit_bound = logits_row["tolerance"] * logits_row["scale"]  # absolute

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
            first_divergence["transformers vs JAX"] = _forward_checks(
                checks, "transformers", jax_out, _transformers_forward(path, dtype, tokens, mask),
                truth_out, real, dtype)
    elif reference == "llama.cpp":
        from . import llama_cpp_reference

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
            "judged_by": "float64" if reference_f64 else "fixed tolerances", "checks": checks,
            "first_divergence": first_divergence, "culprit": culprit, "reference": ref,
            "notes": notes, "passed": all(c["ok"] for c in checks)}


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

    import jax_llama.model as jm
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
        from .float64 import rotation
        truth = rotation(x, config, positions)
    return _compare(f"RoPE, positions 0-{P - 1}", "torch vs JAX",
                    {"JAX": np.asarray(ours), "torch": theirs.numpy()}, truth, "float32", "rope",
                    detail="float32 in every dtype (both twins' RoPE is float32)")


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
                     detail), block=block)


def _ulp(x: np.ndarray) -> np.ndarray:
    """The spacing of x's dtype at each value of x (its ulp), float64; at 0 the least normal's."""
    import ml_dtypes

    info = ml_dtypes.finfo(x.dtype)
    magnitude = np.abs(x.astype(np.float64))
    exponent = np.floor(np.log2(np.maximum(magnitude, float(info.smallest_normal))))
    return np.exp2(exponent - info.nmant)


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

    import jax_llama.model as jm
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
        from .float64 import rms_norm
        truth = np.broadcast_to(rms_norm(x, eps), theirs.shape)
    return _compare(f"RMSNorm, mean squares {eps / 100:.0e}-{eps * 100:.0e}", "torch vs JAX",
                    {"JAX": np.broadcast_to(ours, theirs.shape), "torch": theirs}, truth,
                    "float32", "norm",
                    detail=f"float32 in every dtype (both twins' statistics are float32); "
                           f"{len(norms)} torch norms")


def _optimizer_check(model, tmodel, tc, held: dict[str, np.ndarray], grads0: dict,
                     reference_f64: bool) -> dict:
    """Both twins' optimizers (jax_llama.train.make_optimizer; torch_llama's clipping and AdamW
    with its decay mask) for tc.steps steps from `held` (the checkpoint in the report's dtype),
    held in float32 as training keeps its master weights, each step given the same gradients: grads0
    (the float64 run's first gradients) scaled at step k to a global norm of (k + 2) x the
    clipping threshold, so that clipping acts at every step, by a different factor. The model's
    own gradients do not enter, so the figure sees the optimizer alone and is judged as float32 in
    every report: in bfloat16 a wrong decay mask or missing clipping moves the parameters less
    than their rounding, and the figure of the training steps cannot see it."""
    import jax
    import optax
    import torch

    import torch_llama
    from jax_llama.checkpoint import params_from_tensors, tensor_specs
    from jax_llama.train import make_optimizer

    names = list(held)
    start = {n: held[n].astype(np.float32) for n in names}
    norm = _global_norm(grads0.__getitem__, names)
    factor = (tc.grad_clip or 1.0) / norm if norm > 0 else 0.0

    def step_grad(name: str, k: int) -> np.ndarray:  # made when needed: one tensor's at a time
        return (np.asarray(grads0[name], np.float64) * ((k + 2) * factor)).astype(np.float32)

    optimizer = make_optimizer(tc)

    def step(grads, state, trained):
        updates, state = optimizer.update(grads, state, trained)
        return optax.apply_updates(trained, updates), state
    step = jax.jit(step, donate_argnums=(0, 1, 2))
    trained = params_from_tensors(start.__getitem__, model.config, dtype="float32")
    state = optimizer.init(trained)
    for k in range(tc.steps):
        trained, state = step(params_from_tensors(lambda n, k=k: step_grad(n, k), model.config,
                                                  dtype="float32"), state, trained)
    del state
    jax_trained = tensor_specs(jax.tree.map(np.asarray, trained), model.config)[1]

    twin = copy.deepcopy(tmodel).float()  # float32 master weights; the caller's model stays
    twin.load_state_dict({n: torch.from_numpy(start[n]) for n in names})
    del start
    weights = dict(twin.named_parameters())
    opt = _torch_optimizer(list(weights.values()), tc)
    for k in range(tc.steps):
        for n, p in weights.items():
            p.grad = torch.from_numpy(step_grad(n, k))
        torch_llama.clip_by_global_norm(list(weights.values()), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    del opt, weights
    torch_trained = twin.state_dict()

    truth = None
    if reference_f64:
        from .float64 import adamw_steps
        recipe = _float64_recipe(tc)
        # the global norm of step k's gradients is (k + 2) x the clipping threshold, so the
        # float64 optimizer runs one tensor at a time
        norms = [(k + 2) * factor * norm for k in range(tc.steps)]

        def truth(n):
            return adamw_steps(held[n], lambda k: step_grad(n, k), norms, recipe)
    row = _compare_tensors(f"AdamW on shared gradients, {tc.steps} steps", "torch vs JAX", names,
                           {"JAX": jax_trained, "torch": torch_trained.get}, truth, "float32",
                           "adamw", scale=tc.lr,
                           detail="max abs / lr; float32 master weights in every dtype, the same "
                                  "gradients in both")
    return row


def _torch_optimizer(weights, tc):
    """torch_llama.AdamW with tc's hyperparameters, schedule and the decay mask (clipping is the
    caller's, torch_llama.clip_by_global_norm before each step)."""
    import torch_llama

    schedule = torch_llama.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.steps,
                                                        tc.lr * tc.end_lr_ratio)
    return torch_llama.AdamW(weights, lr=schedule, betas=(tc.b1, tc.b2), eps=tc.eps,
                             weight_decay=tc.weight_decay, mask=torch_llama.decay_mask)


def _float64_recipe(tc):
    """tc's optimizer as the float64 run takes it (llama_twins.float64.AdamW)."""
    from .float64 import AdamW

    return AdamW(steps=tc.steps, lr=tc.lr, warmup_steps=tc.warmup_steps,
                 end_lr_ratio=tc.end_lr_ratio, b1=tc.b1, b2=tc.b2, eps=tc.eps,
                 weight_decay=tc.weight_decay, grad_clip=tc.grad_clip)


# What the report holds at its peak, per parameter, measured as peak RSS on SmolLM2-135M
# (134.5M parameters; scripts/parity_memory.py, results/parity_memory.md): with the float64 run,
# its first gradients and weights after the AdamW steps (16 bytes) and the checkpoint as the twins
# hold it (4) stay while each twin trains in turn (its weights, gradients, two moments and a copy
# of the start, 20 in float32), next to both twins (8); the float64 run itself peaks lower (40).
# Without it, the twins' training alone. Plus what the runtimes (JAX, torch, XLA's compiled
# programs) take whatever the model: RUNTIME_BYTES.
FLOAT64_BYTES_PER_PARAMETER = 64
BYTES_PER_PARAMETER = 48
RUNTIME_BYTES = 1 << 30


def parity_memory(path, reference_f64: bool = True) -> int:
    """The peak memory, in bytes, the report on the checkpoint at `path` needs (an estimate from
    its parameter count: RUNTIME_BYTES plus (FLOAT64_)BYTES_PER_PARAMETER each)."""
    return _memory_needed(open_checkpoint(path), reference_f64)[0]


def _memory_needed(ckpt, reference_f64: bool) -> tuple[int, int, int]:
    """(bytes, parameters, bytes per parameter) of the report on `ckpt`."""
    parameters = sum(math.prod(shape) for shape, _ in ckpt.specs.values())
    per = FLOAT64_BYTES_PER_PARAMETER if reference_f64 else BYTES_PER_PARAMETER
    return RUNTIME_BYTES + parameters * per, parameters, per


def _check_memory(ckpt, reference_f64: bool, say) -> None:
    """Say what the report needs, and refuse, before anything is loaded, a report that would not
    fit in the memory available."""
    need, parameters, per = _memory_needed(ckpt, reference_f64)
    have = _available_memory()
    what = (f"about {need / 2**30:.1f} GiB ({parameters:,} parameters x {per} bytes"
            f"{' with the float64 reference' if reference_f64 else ''}, and "
            f"{RUNTIME_BYTES / 2**30:.0f} GiB for the runtimes)")
    if have is not None and need > have:
        raise BridgeError(
            f"{ckpt.path}: the parity report needs {what} and {have / 2**30:.1f} GiB are "
            f"available", hint=(("reference_f64", False,
                                 "use {} to judge by fixed tolerances and need less")
                                if reference_f64 else None))
    say(f"the report needs {what}"
        + (f"; {have / 2**30:.1f} GiB are available" if have is not None else ""))


@contextlib.contextmanager
def _freed_memory_returned():
    """Within the `with`, glibc's malloc gives a freed buffer of 1 MiB or more back to the
    system at once (M_MMAP_THRESHOLD), and each stage of the report starts by giving back what
    it holds free (_give_back): by default it keeps what it served from its heap for reuse, and
    the report's stages free and allocate whole models in different dtypes, which it would
    otherwise hold side by side (11.8 GB of peak RSS on SmolLM2 instead of 9.4). Afterwards the
    threshold is 32 MiB, the most glibc's own adjustment reaches. A no-op where the C library is
    not glibc."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)


_M_MMAP_THRESHOLD = -3


def _glibc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018  (glibc has both)
    except (OSError, AttributeError):
        return None
    return libc


def _give_back() -> None:
    """malloc_trim(0): what glibc's heap holds free goes back to the system."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _import_error(module: str) -> str | None:
    """Why `module` cannot be imported, or None when it can."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        return str(e)
    return None


def _random_batch(config, batch: int, seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, attention_mask), both int32 (B, S): uniform random ids from `seed`; with B > 1 the
    last row is left-padded (id 0, mask 0) over its first quarter, so padding is exercised."""
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq_len),
                                                  dtype=np.int32)
    mask = np.ones_like(tokens)
    if batch > 1:
        tokens[-1, :seq_len // 4] = 0
        mask[-1, :seq_len // 4] = 0
    return tokens, mask


# -- the three forward passes: (hidden state after each block [(B, S, D)], logits (B, S, V)) ------

def _jax_forward(model, params, tokens, mask) -> tuple[list[np.ndarray], np.ndarray]:
    """Hidden states through Flax's capture_intermediates, as float64 numpy."""
    import jax
    from jax_llama.model import Block

    def run(params, tokens, mask):
        return model.apply({"params": params}, tokens, attention_mask=mask,
                           capture_intermediates=lambda module, _: isinstance(module, Block))

    logits, state = jax.jit(run)(params, tokens, mask)
    # Each block's __call__ returned ((x, cache), None): its output x is [0][0][0] of the capture.
    blocks = state["intermediates"]
    hidden = [blocks[f"layers_{i}"]["__call__"][0][0][0] for i in range(model.config.n_layers)]
    return [_f64(h) for h in hidden], _f64(logits)


def _torch_forward(tmodel, tokens, mask) -> tuple[list[np.ndarray], np.ndarray]:
    """The same for torch_llama.Llama, through forward hooks on model.layers."""
    import torch

    with torch.inference_mode(), _capture(tmodel.layers) as hidden:
        logits = tmodel(torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask))
    return hidden, _f64(logits)


def _transformers_forward(path, dtype: str, tokens, mask) -> tuple[list[np.ndarray], np.ndarray]:
    """The same for transformers.LlamaForCausalLM, from the checkpoint as the bridge's HF writer
    writes it (a temporary directory). Hooks on the decoder layers rather than
    output_hidden_states, whose last entry has the final norm applied."""
    import torch
    import transformers

    from bridge.convert import convert

    with tempfile.TemporaryDirectory(prefix="llama-bridge-parity-") as tmp:
        # float32 on disk, which every transformers version loads as float32; then the parameters
        # (not RoPE's inv_freq buffer) are rounded to `dtype` to nearest even, as the twins do.
        hf_dir = convert(path, Path(tmp) / "hf", to="hf", dtype="float32", progress=False)
        hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    for p in hf.parameters():
        p.data = p.data.to(getattr(torch, dtype_name(dtype)))
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)  # real tokens counted, as the twins do
    with torch.inference_mode(), _capture(hf.model.layers) as hidden:
        logits = hf(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                    attention_mask=torch.as_tensor(mask, dtype=torch.long),
                    position_ids=torch.as_tensor(positions, dtype=torch.long)).logits
    return hidden, _f64(logits)


@contextlib.contextmanager
def _capture(layers):
    """Within the `with`, the list it gives fills with the output of each module of `layers` (the
    first element when a module returns a tuple) as float64 numpy, through forward hooks."""
    hidden = []

    def hook(module, inputs, output):
        hidden.append(_f64(output[0] if isinstance(output, tuple) else output))
    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        yield hidden
    finally:
        for handle in handles:
            handle.remove()


def _f64(x) -> np.ndarray:
    """A JAX array or a torch tensor (bfloat16 included) as a float64 numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x).astype(np.float64)


# -- the judgement --------------------------------------------------------------------------------

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


def _forward_checks(checks: list, other: str, jax_out, other_out, truth_out, real,
                    dtype: str) -> int | None:
    """Append the per-block, logit and KL figures of `other` against JAX over the real tokens;
    return the first block out of its bound (None: none is)."""
    (jax_hidden, jax_logits), (other_hidden, other_logits) = jax_out, other_out
    truth_hidden, truth_logits = truth_out if truth_out is not None else (None, None)
    compared, first = f"{other} vs JAX", None
    for i, (a, b) in enumerate(zip(jax_hidden, other_hidden)):
        t = truth_hidden[i][real] if truth_hidden is not None else None
        checks.append(_compare(f"hidden after block {i}", compared,
                               {"JAX": a[real], other: b[real]}, t, dtype, "hidden"))
        if first is None and not checks[-1]["ok"]:
            first = i
    t = truth_logits[real] if truth_logits is not None else None
    logits = _compare("logits", compared, {"JAX": jax_logits[real], other: other_logits[real]}, t,
                      dtype, "logits")
    checks.append(logits)
    # KL, not a distance: its bound follows from the logits' one. If every logit of a position
    # agrees within d, KL <= d^2 / 2 (Hoeffding's lemma), d = the logits' bound x their scale.
    kl_bound = (logits["tolerance"] * logits["scale"]) ** 2 / 2
    log_p, log_q = _log_softmax(jax_logits[real]), _log_softmax(other_logits[real])
    kl = _kl(log_p, log_q)  # KL(JAX || other) per position, nats
    kl_errors = None
    if t is not None:
        log_t = _log_softmax(t)
        kl_errors = {"JAX": _kl(log_t, log_p), other: _kl(log_t, log_q)}
    for statistic, reduce in (("max", np.max), ("mean", np.mean)):
        errors = None if kl_errors is None else {k: float(reduce(v)) for k, v in kl_errors.items()}
        value = float(reduce(kl))
        ok = value <= kl_bound and logits["ok"]
        culprit = None if ok else (logits["culprit"] or
                                   (max(errors, key=errors.get) if errors else None))
        checks.append(dict(_check(f"KL, {statistic} over positions", compared, value, kl_bound,
                                  ok, culprit=culprit), kind="kl", errors=errors,
                           margin=kl_bound / value if value > 0 else None))
    return first


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _kl(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    return np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)


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


def _training_checks(model, params, tmodel, tokens, tc, truth, dtype: str
                     ) -> tuple[list[dict], dict[str, np.ndarray]]:
    """(rows, JAX's gradients of the first step by canonical name). Loss and gradients of one
    step of mean next-token cross-entropy on the batch (the same ids, no padding:
    jax_llama.train.loss_fn takes no attention mask), then the parameters after
    tc.steps steps on that batch of jax_llama.train's optimizer and of torch_llama.AdamW with the
    same hyperparameters and schedule; each against the float64 run of the same (`truth`).
    Memory: one twin trains at a time, and only its first gradients and its last parameters
    outlive its run; the figures are reduced tensor by tensor."""
    import jax
    import optax
    import torch
    import torch_llama
    from jax_llama.checkpoint import tensor_specs
    from jax_llama.train import loss_fn, make_optimizer

    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "mask": np.ones(tokens[:, 1:].shape, np.int32)}
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, model, b)))
    optimizer = make_optimizer(tc)

    def step(grads, opt_state, trained):
        updates, opt_state = optimizer.update(grads, opt_state, trained)
        return optax.apply_updates(trained, updates), opt_state
    # the step's inputs are consumed (params, the caller's, is copied first)
    step = jax.jit(step, donate_argnums=(0, 1, 2))
    trained = jax.tree.map(lambda x: x.copy(), params)
    opt_state = optimizer.init(trained)
    for i in range(tc.steps):
        loss, grads = grad_fn(trained, batch)
        if i == 0:
            jax_loss = float(loss)
            jax_grads = jax.tree.map(np.array, grads)
        trained, opt_state = step(grads, opt_state, trained)
    del opt_state
    jax_grads = tensor_specs(jax_grads, model.config)[1]
    jax_trained = tensor_specs(jax.tree.map(np.asarray, trained), model.config)[1]

    twin = copy.deepcopy(tmodel).train()  # the caller's model stays as it was
    weights = list(twin.parameters())
    opt = _torch_optimizer(weights, tc)
    inputs = torch.as_tensor(batch["inputs"])
    targets = torch.as_tensor(batch["targets"], dtype=torch.long).flatten()
    for i in range(tc.steps):
        loss = torch.nn.functional.cross_entropy(twin(inputs).flatten(0, 1), targets)  # all real
        loss.backward()
        if i == 0:
            torch_loss = float(loss.detach())
            torch_grads = {name: p.grad.detach().clone() for name, p in twin.named_parameters()}
        torch_llama.clip_by_global_norm(weights, tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    del opt, weights
    torch_trained = twin.state_dict()

    names = list(torch_grads)
    compared, exact = "torch vs JAX", truth is not None
    t_loss = truth.loss if exact else None
    norms = {"JAX": _global_norm(jax_grads, names), "torch": _global_norm(torch_grads.get, names)}
    t_norm = _global_norm(truth.grads.get, names) if exact else None
    grads = _compare_tensors("gradients", compared, names, {"JAX": jax_grads,
                                                             "torch": torch_grads.get},
                             truth.grads.get if exact else None, dtype, "grad")
    grads["detail"] = f"relative to the largest; max abs {grads['max_abs']:.2e}"
    return [
        _compare("loss, one step", compared, {"JAX": jax_loss, "torch": torch_loss}, t_loss, dtype,
                 "loss", detail=f"relative; loss {jax_loss:.6f}"),
        _compare("gradient norm", compared, norms, t_norm, dtype, "grad_norm",
                 detail=f"relative; norm {norms['JAX']:.4g}"),
        grads,
        _compare_tensors(f"parameters after {tc.steps} AdamW steps", compared, names,
                         {"JAX": jax_trained, "torch": torch_trained.get},
                         truth.trained.get if exact else None, dtype, "adamw", scale=tc.lr,
                         detail=f"max abs / lr; lr {tc.lr:g}, eps {tc.eps:g}"),
    ], {name: np.asarray(jax_grads(name)) for name in names}


def _global_norm(get: Callable[[str], object], names: Sequence[str]) -> float:
    """sqrt of the sum of squares of the tensors get(name), in float64, one tensor at a time."""
    return math.sqrt(sum(float(np.sum(np.square(_f64(get(n))))) for n in names))


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


def _llama_cpp_checks(path, dtype: str, model, params, tokens, real, n_new: int, jax_logits,
                      truth) -> list[dict]:
    """llama.cpp (llama_twins.llama_cpp_reference) on each row's real tokens: its logits against
    the float64 answer (or JAX's) within LLAMA_CPP_LOGITS[dtype], and its greedy continuation
    against JAX's, a first difference passing only at a near-tie of JAX's own logits."""
    from . import llama_cpp_reference

    prompts = [row[keep].tolist() for row, keep in zip(tokens, real)]
    theirs, greedy = llama_cpp_reference.run(path, dtype, prompts, n_new)
    ours = jax_logits[real]
    exact = truth.logits[real] if truth is not None else ours
    theirs = np.concatenate(theirs).astype(np.float64)
    scale = float(np.abs(exact).max())
    bound = LLAMA_CPP_LOGITS[dtype]
    off = float(np.abs(theirs - exact).max()) / scale
    errors = None if truth is None else {"JAX": float(np.abs(ours - exact).max()) / scale,
                                         "llama.cpp": off}
    against = "float64" if truth is not None else "JAX"
    logits = dict(_check("logits", "llama.cpp vs JAX", float(np.abs(theirs - ours).max()) / scale,
                         bound, off <= bound,
                         detail=f"llama.cpp's own bound ({dtype_name(dtype)} GGUF, F16 KV "
                                f"cache), on its error against {against}: {off:.2e}",
                         culprit=None if off <= bound else
                         "llama.cpp" if truth is not None else "llama.cpp or JAX"),
                  kind="llama.cpp", errors=errors, margin=bound / off if off > 0 else None)
    rows = [logits]
    if n_new > 0:
        import jax_llama  # noqa: F401  (the JAX twin's greedy run, as in the twins' check)
        from jax_llama.generate import generate as jax_generate

        mine = jax_generate(model, params, prompts, n_new, Sampler(), ()).tokens
        allowed, notes, ok, firsts = NEAR_TIE * bound * scale, [], True, []
        for i, (prompt, a, b) in enumerate(zip(prompts, mine, greedy)):
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if k is None:
                continue
            firsts.append(k)
            prefix = np.asarray([prompt + list(a[:k])], np.int32)
            last = _f64(model.apply({"params": params}, prefix))[0, -1, [a[k], b[k]]]
            gap = abs(last[0] - last[1])
            ok = ok and gap <= allowed
            notes.append(f"row {i} at token {k}: JAX {a[k]} vs llama.cpp {b[k]}, JAX's logit gap "
                         f"{gap:.2e}")
        detail = ("; ".join(notes) + f" (a near-tie if the gap <= {allowed:.1e})" if notes
                  else f"all {len(prompts)} rows agree on {n_new} tokens")
        rows.append(_check("greedy tokens, first difference", "llama.cpp vs JAX",
                           min(firsts) if firsts else None, "near-tie", ok=ok, detail=detail,
                           culprit=None if ok else
                           "llama.cpp" if truth is not None else "llama.cpp or JAX"))
    return rows


# -- output ---------------------------------------------------------------------------------------

def format_parity_report(report: dict) -> str:
    """The report as a compact table (figure, compared, difference, each side's error against
    float64, bound, margin, result, detail), then the first diverging block and the culprit of
    each comparison that has one, the notes and the verdict."""
    exact = report.get("judged_by", "float64") == "float64"
    lines = [f"parity of {report['path']}: {report['dtype']}, {report['batch']} x "
             f"{report['seq_len']} random tokens (seed {report['seed']}); judged against "
             + ("a float64 run of the same weights" if exact else "fixed tolerances")
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
    for compared, block in report["first_divergence"].items():
        culprit = report.get("culprit", {}).get(compared)
        if block is not None:
            lines.append(f"first divergence ({compared}): block {block}"
                         + (f", in {culprit} (the one far from float64)" if culprit else ""))
        elif culprit:
            lines.append(f"culprit ({compared}): {culprit} (the one far from float64)")
    lines += report["notes"]
    failed = sum(not c["ok"] for c in report["checks"])
    lines.append("parity: " + (f"FAIL, {failed} figures out of bounds" if failed else
                               "ok, every figure within its bound"))
    return "\n".join(line.rstrip() for line in lines)


def _number(x) -> str:
    return "-" if x is None else x if isinstance(x, str) else f"{x:.2e}"
