"""Cross-framework checks that load both twins: the parity report behind `llama-bridge parity` and
the greedy comparison behind `jax-llama generate --compare-torch`.

Like everything in llama_twins it sits above both twins; jax_llama, torch_llama (and transformers)
are imported inside the functions, so that the commands start fast and a missing reference is
reported rather than fatal.

How the figures are measured. Differences are taken over the real (non-padding) tokens only, in
float64 on the host. "Relative" means relative to the scale of the tensor, max |a - b| / max |a|
with `a` the JAX value: an elementwise relative error is dominated by values near zero and proves
nothing. Each figure is judged against TOLERANCES[dtype][figure].
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bridge.dtypes import dtype_name
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from bridge.sampling import Sampler

REFERENCES = ("transformers",)
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

# Tolerances per compute dtype, each on a figure relative to the scale of what it measures.
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
    },
    "bfloat16": {
        "hidden": 5e-2,      # measured <= 7.3e-3
        "logits": 5e-2,      # measured <= 1.0e-2
        "loss": 1e-3,        # measured <= 7.2e-5
        "grad_norm": 1e-2,   # measured <= 1.2e-3
        "grad": 1e-1,        # measured <= 1.7e-2
        # A parameter near 1 (a norm gain) has a bfloat16 spacing of 8e-3, 2.6 lr: a rounding that
        # differs costs a few lr, and smaller steps vanish in both twins, so this figure catches
        # only gross errors (a wrong lr or sign); the float32 report checks the optimizer.
        "adamw": 10.0,       # measured 0.24 - 1.3
    },
}
# Greedy decoding may differ only at a near-tie: if the twins' logits agree within d, each twin's
# logits of the two tokens they chose are within 2d of each other (JAX's a >= b and torch's
# b >= a, each logit moved by at most d), with d the logit tolerance times max |logit|.
NEAR_TIE = 2.0


def greedy_parity(path: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  stop_ids: Sequence[int] = (), dtype: str | None = None) -> dict:
    """Greedy continuations of the same prompts by both twins from the checkpoint at `path`.

    Returns {"identical": bool, "rows": [{"jax": ids, "torch": ids, "first_difference": index
    or None}]}: where the twins first disagree, per prompt."""
    import jax_llama
    import torch_llama

    model, params = jax_llama.load(path, dtype=dtype)
    tmodel = torch_llama.load(path, device="cpu", dtype=dtype)
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
                  torch_model=None, progress: Callable[[str], object] | None = None) -> dict:
    """Run the checkpoint at `path` through both twins (and `reference`) on one random batch of
    `batch` x `seq_len` ids and measure how far apart they are. torch_model stands in for the
    torch twin loaded from `path` (a test passes a deliberately corrupted one); it is not
    modified. progress(message) hears each stage.

    Returns {"path", "dtype", "batch", "seq_len", "new_tokens", "seed", "checks": [{"figure",
    "compared", "value", "tolerance", "ok", "detail", ...}], "first_divergence": {compared:
    first block out of tolerance or None}, "reference": None or {"name", "status": "ok" or
    "skipped", "reason"}, "notes": [str], "passed": bool}.
    Bad arguments or a checkpoint the twins do not support raise BridgeError naming the field."""
    say = progress or (lambda message: None)
    if dtype not in TOLERANCES:
        raise BridgeError(f"expected one of {', '.join(TOLERANCES)}, got {dtype!r}", field="dtype")
    if reference is not None and reference not in REFERENCES:
        raise BridgeError(f"expected one of {', '.join(REFERENCES)}, got {reference!r}",
                          field="reference")
    for name, value, least in (("batch", batch, 1), ("seq_len", seq_len, 2),
                               ("new_tokens", new_tokens, 0)):
        if value < least:  # seq_len 2 at least: the loss needs a next token
            raise BridgeError(f"must be at least {least} (got {value})", field=name)
    config = open_checkpoint(path).config  # an unsupported config is refused here, by field
    if seq_len > config.max_seq_len:
        raise BridgeError(f"{seq_len} exceeds the checkpoint's max_seq_len {config.max_seq_len}",
                          field="seq_len")
    import jax_llama
    import torch_llama

    tol, notes = TOLERANCES[dtype], []
    say(f"loading {path} into both twins ({dtype})")
    model, params = jax_llama.load(path, dtype=dtype)
    tmodel = torch_model if torch_model is not None else torch_llama.load(path, device="cpu",
                                                                          dtype=dtype)
    tokens, mask = _random_batch(config, batch, seq_len, seed)
    real = mask.astype(bool)

    say("forward pass: the hidden state after every block, and the logits")
    jax_hidden, jax_logits = _jax_forward(model, params, tokens, mask)
    logit_tolerance = tol["logits"] * float(np.abs(jax_logits[real]).max())  # absolute
    checks, first_divergence = [], {}
    compared = "torch vs JAX"
    first_divergence[compared] = _forward_checks(checks, compared, (jax_hidden, jax_logits),
                                                 _torch_forward(tmodel, tokens, mask), real, tol,
                                                 logit_tolerance)

    n_new = min(new_tokens, config.max_seq_len - seq_len)
    if 0 < n_new < new_tokens:
        notes.append(f"greedy tokens: {n_new}, not {new_tokens}, to fit max_seq_len "
                     f"{config.max_seq_len}")
    if n_new > 0:
        say(f"greedy generation of {n_new} tokens by both twins")
        checks.append(_greedy_check(model, params, tmodel, tokens, real, n_new, logit_tolerance))
    else:
        why = ("new_tokens 0" if new_tokens == 0 else
               f"seq_len {seq_len} leaves no room in max_seq_len {config.max_seq_len}")
        notes.append(f"greedy tokens: skipped ({why})")

    say(f"one training step, then {ADAMW_STEPS} AdamW steps in both twins")
    checks += _training_checks(model, params, tmodel, tokens, tol)

    ref = None
    if reference == "transformers":
        ref = {"name": "transformers", "status": "ok", "reason": None}
        missing = _import_error("transformers")
        if missing:
            ref.update(status="skipped", reason=f"transformers is not importable: {missing}")
            notes.append(f"reference transformers: skipped ({ref['reason']})")
        else:
            say("forward pass in transformers.LlamaForCausalLM")
            compared = "transformers vs JAX"
            first_divergence[compared] = _forward_checks(
                checks, compared, (jax_hidden, jax_logits),
                _transformers_forward(path, dtype, tokens, mask), real, tol, logit_tolerance)
    return {"path": str(path), "dtype": dtype, "batch": batch, "seq_len": seq_len,
            "new_tokens": n_new, "seed": seed, "checks": checks,
            "first_divergence": first_divergence, "reference": ref, "notes": notes,
            "passed": all(c["ok"] for c in checks)}


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


# -- the figures ----------------------------------------------------------------------------------

def _check(figure: str, compared: str, value, tolerance, ok: bool | None = None,
           detail: str = "") -> dict:
    """One row of the report; ok defaults to value <= tolerance (False for NaN)."""
    value = None if value is None else float(value)
    return {"figure": figure, "compared": compared, "value": value, "tolerance": tolerance,
            "ok": bool(value <= tolerance) if ok is None else bool(ok), "detail": detail}


def _difference(figure: str, compared: str, a: np.ndarray, b: np.ndarray, tolerance: float) -> dict:
    """max |a - b| relative to max |a| (the value judged), with max |a - b| itself as max_abs."""
    diff, scale = float(np.abs(a - b).max()), float(np.abs(a).max())
    relative = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    return dict(_check(figure, compared, relative, tolerance, detail=f"max abs {diff:.2e}"),
                max_abs=diff)


def _forward_checks(checks: list, compared: str, jax_out, other_out, real, tol,
                    logit_tolerance: float) -> int | None:
    """Append the per-block, logit and KL figures of `other` against JAX over the real tokens;
    return the first block whose hidden state is out of tolerance (None: none is)."""
    (jax_hidden, jax_logits), (other_hidden, other_logits) = jax_out, other_out
    first = None
    for i, (a, b) in enumerate(zip(jax_hidden, other_hidden)):
        checks.append(_difference(f"hidden after block {i}", compared, a[real], b[real],
                                  tol["hidden"]))
        if first is None and not checks[-1]["ok"]:
            first = i
    checks.append(_difference("logits", compared, jax_logits[real], other_logits[real],
                              tol["logits"]))
    log_p, log_q = _log_softmax(jax_logits[real]), _log_softmax(other_logits[real])
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)  # KL(JAX || other) per position, nats
    kl_tolerance = logit_tolerance ** 2 / 2  # see TOLERANCES
    checks.append(_check("KL, max over positions", compared, kl.max(), kl_tolerance))
    checks.append(_check("KL, mean over positions", compared, kl.mean(), kl_tolerance))
    return first


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _greedy_check(model, params, tmodel, tokens, real, n_new: int, logit_tolerance: float) -> dict:
    """Greedy continuations of each row's real tokens by both twins (compare_greedy). Passes when
    they agree, or when each first difference is a near-tie (NEAR_TIE), the gap measured by a
    plain forward pass of the common prefix in each twin. value: the earliest first difference."""
    import torch

    prompts = [row[keep].tolist() for row, keep in zip(tokens, real)]
    rows = compare_greedy(model, params, tmodel, prompts, n_new)["rows"]
    allowed, notes, ok = NEAR_TIE * logit_tolerance, [], True
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


def _training_checks(model, params, tmodel, tokens, tol) -> list[dict]:
    """Loss and gradients of one step of mean next-token cross-entropy on the batch (the same ids,
    no padding: jax_llama.train.loss_fn takes no attention mask), then the parameters after
    ADAMW_STEPS steps on that batch of jax_llama.train's optimizer and of torch_llama.AdamW with
    the same hyperparameters and schedule."""
    import jax
    import optax
    import torch
    import torch_llama
    from jax_llama.checkpoint import tensor_specs
    from jax_llama.train import TrainConfig, loss_fn, make_optimizer

    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "mask": np.ones(tokens[:, 1:].shape, np.int32)}
    tc = TrainConfig(steps=ADAMW_STEPS, batch_size=len(tokens), seq_len=tokens.shape[1] - 1,
                     eps=ADAMW_EPS)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, model, b)))
    optimizer = make_optimizer(tc)
    update, opt_state, trained = jax.jit(optimizer.update), optimizer.init(params), params
    for i in range(ADAMW_STEPS):
        loss, grads = grad_fn(trained, batch)
        if i == 0:
            jax_loss, jax_grads = float(loss), tensor_specs(grads, model.config)[1]
        updates, opt_state = update(grads, opt_state, trained)
        trained = optax.apply_updates(trained, updates)

    twin = copy.deepcopy(tmodel).train()  # the caller's model stays as it was
    weights = list(twin.parameters())
    schedule = torch_llama.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.steps,
                                                        tc.lr * tc.end_lr_ratio)
    opt = torch_llama.AdamW(weights, lr=schedule, betas=(tc.b1, tc.b2), eps=tc.eps,
                            weight_decay=tc.weight_decay, mask=torch_llama.decay_mask)
    inputs = torch.as_tensor(batch["inputs"])
    targets = torch.as_tensor(batch["targets"], dtype=torch.long).flatten()
    for i in range(ADAMW_STEPS):
        loss = torch.nn.functional.cross_entropy(twin(inputs).flatten(0, 1), targets)  # all real
        loss.backward()
        if i == 0:
            torch_loss = float(loss.detach())
            torch_grads = {name: _f64(p.grad) for name, p in twin.named_parameters()}
        torch_llama.clip_by_global_norm(weights, tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    names = list(torch_grads)
    g_jax = np.concatenate([_f64(jax_grads(n)).ravel() for n in names])
    g_torch = np.concatenate([torch_grads[n].ravel() for n in names])
    norm_jax, norm_torch = np.linalg.norm(g_jax), np.linalg.norm(g_torch)
    jax_params, torch_params = tensor_specs(trained, model.config)[1], twin.state_dict()
    moved = max(float(np.abs(_f64(jax_params(n)) - _f64(torch_params[n])).max()) for n in names)
    compared = "torch vs JAX"
    return [
        _check("loss, one step", compared, abs(jax_loss - torch_loss) / jax_loss, tol["loss"],
               detail=f"relative; loss {jax_loss:.6f}"),
        _check("gradient norm", compared, abs(norm_jax - norm_torch) / norm_jax, tol["grad_norm"],
               detail=f"relative; norm {norm_jax:.4g}"),
        _difference("gradients", compared, g_jax, g_torch, tol["grad"]),
        _check(f"parameters after {ADAMW_STEPS} AdamW steps", compared, moved / tc.lr,
               tol["adamw"], detail=f"max abs / lr; lr {tc.lr:g}, eps {tc.eps:g}"),
    ]


# -- output ---------------------------------------------------------------------------------------

def format_parity_report(report: dict) -> str:
    """The report as a compact table (figure, compared, value, tolerance, result, detail), then
    the first diverging block of each comparison that has one, the notes and the verdict."""
    lines = [f"parity of {report['path']}: {report['dtype']}, {report['batch']} x "
             f"{report['seq_len']} random tokens (seed {report['seed']}); differences relative to "
             f"the scale of what they compare, KL in nats"]
    rows = [("figure", "compared", "value", "tolerance", "result", "detail")]
    for c in report["checks"]:
        rows.append((c["figure"], c["compared"], _number(c["value"]), _number(c["tolerance"]),
                     "ok" if c["ok"] else "FAIL", c["detail"]))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[5]
              for row in rows]
    lines += [f"first divergence ({compared}): block {block}"
              for compared, block in report["first_divergence"].items() if block is not None]
    lines += report["notes"]
    failed = sum(not c["ok"] for c in report["checks"])
    lines.append("parity: " + (f"FAIL, {failed} figures out of tolerance" if failed else
                               "ok, every figure within tolerance"))
    return "\n".join(line.rstrip() for line in lines)


def _number(x) -> str:
    return "-" if x is None else x if isinstance(x, str) else f"{x:.2e}"
