"""The forward passes the report compares - the JAX twin, the torch twin, and transformers as a
reference - each giving (hidden state after each block [(B, S, D)], logits (B, S, V)) in float64,
on one random batch; and the figures made of them: each block's hidden state, the logits, and KL."""

from __future__ import annotations

import contextlib

import numpy as np

from .judgement import _check, _compare, _f64, _kl, _log_softmax, budget


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


# The parts of a block, in the order they run: x + attention(attention_norm(x)), then
# h + feed_forward(ffn_norm(h)). Both twins name their modules so; transformers' are mapped.
SUBLAYERS = ("attention_norm", "attention", "ffn_norm", "feed_forward")
HF_SUBLAYERS = {"input_layernorm": "attention_norm", "self_attn": "attention",
                "post_attention_layernorm": "ffn_norm", "mlp": "feed_forward"}
# The tensors nearest to each part, named in a FAIL that points at it.
TENSORS = {"attention_norm": ("attention_norm.weight",),
           "attention": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                         "attention.wo.weight"),
           "ffn_norm": ("ffn_norm.weight",),
           "feed_forward": ("feed_forward.w1.weight", "feed_forward.w3.weight",
                            "feed_forward.w2.weight")}


def _jax_forward(model, params, tokens, mask):
    """(hidden state after each block, logits, each block's {sub-layer: output}), float64 numpy,
    through Flax's capture_intermediates."""
    import jax
    from jax_llama.model import Block

    def wanted(module, _):
        return isinstance(module, Block) or (module.name in SUBLAYERS
                                             and isinstance(module.parent, Block))

    def run(params, tokens, mask):
        return model.apply({"params": params}, tokens, attention_mask=mask,
                           capture_intermediates=wanted)

    logits, state = jax.jit(run)(params, tokens, mask)
    # Each block's __call__ returned ((x, cache), None): its output x is [0][0][0] of the capture;
    # the attention returned (output, cache).
    blocks = [state["intermediates"][f"layers_{i}"] for i in range(model.config.n_layers)]
    hidden = [_f64(b["__call__"][0][0][0]) for b in blocks]
    parts = [{name: _f64(_first(b[name]["__call__"][0])) for name in SUBLAYERS} for b in blocks]
    return hidden, _f64(logits), parts


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _torch_forward(tmodel, tokens, mask):
    """The same for torch_llama.Llama, through forward hooks on model.layers and their parts."""
    import torch

    with torch.inference_mode(), _capture(tmodel.layers) as hidden, \
            _capture_parts(tmodel.layers, {n: n for n in SUBLAYERS}) as parts:
        logits = tmodel(torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask))
    return hidden, _f64(logits), parts


@contextlib.contextmanager
def _capture(layers):
    """Within the `with`, the list it gives fills with the output of each module of `layers` (the
    first element when a module returns a tuple) as float64 numpy, through forward hooks."""
    hidden = []

    def hook(module, inputs, output):
        hidden.append(_f64(_first(output)))
    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        yield hidden
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _capture_parts(layers, names: dict[str, str]):
    """Within the `with`, the list it gives holds one {part: output} per layer of `layers`,
    filled through forward hooks on each layer's submodules named by `names` (attribute -> the
    part's name in SUBLAYERS)."""
    parts = [{} for _ in layers]
    handles = []
    for layer, into in zip(layers, parts):
        for attribute, part in names.items():
            def hook(module, inputs, output, into=into, part=part):
                into[part] = _f64(_first(output))
            handles.append(getattr(layer, attribute).register_forward_hook(hook))
    try:
        yield parts
    finally:
        for handle in handles:
            handle.remove()


def _part_ratios(jax_parts, other_parts, truth_parts, real, other: str, dtype: str
                 ) -> list[dict[str, dict[str, float]]]:
    """Per block, per part (SUBLAYERS, then the block's "output"): each implementation's error
    against float64 / the hidden state's budget at that depth ({"other vs JAX": the twins'
    difference / twice the budget} without float64). Token by token, a norm's output is taken
    relative to its own scale, an attention's or a feed-forward's relative to the residual
    stream it adds to (x + attention, and the block's output): a part's error is measured where
    it lands, not against a later, larger stream that would hide it."""
    ratios = []
    for i, (mine, theirs) in enumerate(zip(jax_parts, other_parts)):
        exact = None if truth_parts is None else truth_parts[i]
        bound = budget(dtype, "hidden", i + 1)
        base = exact or mine
        streams = {"attention": (base["output"] - base["feed_forward"])[real],
                   "feed_forward": base["output"][real]}
        here = {}
        for part in SUBLAYERS + ("output",):
            a, b = mine[part][real], theirs[part][real]
            t = None if exact is None else exact[part][real]
            reference = streams.get(part, t if t is not None else a)
            scale = np.abs(reference).max(axis=-1, keepdims=True)
            scale = np.where(scale > 0, scale, 1.0)
            if t is None:
                here[part] = {f"{other} vs JAX": float((np.abs(a - b) / scale).max()) / (2 * bound)}
            else:
                here[part] = {"JAX": float((np.abs(a - t) / scale).max()) / bound,
                              other: float((np.abs(b - t) / scale).max()) / bound}
        ratios.append(here)
    return ratios


def _first_divergence(ratios, hidden_rows, outs: dict | None = None, local=None, real=None,
                      dtype: str = "float32") -> dict | None:
    """Where the first figure out of its budget starts. Returns {"block", "sublayer", "tensors"
    (the weights nearest to it), "implementation" (None without float64), "beyond" (its error
    / its budget)}, or None when every block is within bounds.

    With `local` (float64's parts_from: each part of block i on the input an implementation gave
    it), each part of each block up to the first failing one is run in float64 on each
    implementation's own input to that part, and the first part (attention_norm, attention,
    ffn_norm, feed_forward, then the output) whose own error is beyond one block's budget is
    named: the error a part hands on is not the next one's, so a bug is placed where it acts,
    not where it first shows. Without it (no float64), the first part of
    the first failing block whose accumulated ratio (`ratios`, _part_ratios) is beyond 1."""
    first = next((i for i, row in enumerate(hidden_rows) if not row["ok"]), None)
    if first is None:
        return None
    if local is not None:
        where = _first_local(outs, local, real, dtype, first)
        if where is not None:
            return where
    else:
        for i in range(first + 1):
            for part in SUBLAYERS + ("output",):
                beyond = {name: r for name, r in ratios[i][part].items() if not r <= 1}
                if beyond:
                    name = max(beyond, key=lambda n: beyond[n])
                    return {"block": i, "sublayer": part,
                            "tensors": [f"layers.{i}.{n}" for n in TENSORS.get(part, ())],
                            "implementation": None if " vs " in name else name,
                            "beyond": beyond[name]}
    row = hidden_rows[first]
    worst = max((row["errors"] or {"-": row["value"]}).values())
    return {"block": first, "sublayer": "output", "tensors": [],
            "implementation": row["culprit"], "beyond": worst / row["tolerance"]}


def _first_local(outs: dict, local, real, dtype: str, last: int) -> dict | None:
    """The first (block, part) up to block `last` whose local error (see _first_divergence) is
    beyond one block's budget, in any implementation of `outs` ({name: its parts per block,
    with "output"}); where none is (a block's output off although each part's own error is
    within it), the part with the largest own error."""
    bound = budget(dtype, "hidden", 1)
    largest = None
    for i in range(last + 1):
        found = {}
        for name, parts in outs.items():
            x = None if i == 0 else parts[i - 1]["output"]
            exact = local(i, parts[i], x)
            ours = parts[i]
            streams = {"attention": (ours["output"] - ours["feed_forward"])[real],
                       "feed_forward": ours["output"][real]}
            for part in SUBLAYERS + ("output",):
                t = exact[part][real]
                scale = np.abs(streams.get(part, t)).max(axis=-1, keepdims=True)
                scale = np.where(scale > 0, scale, 1.0)
                r = float((np.abs(ours[part][real] - t) / scale).max()) / bound
                if largest is None or r > largest[3]:
                    largest = (i, part, name, r)
                if not r <= 1:
                    found[name] = (SUBLAYERS + ("output",)).index(part), part, r
                    break
        if found:  # the earliest part; every implementation beyond its budget there is named
            name = min(found, key=lambda n: (found[n][0], -found[n][2]))
            _, part, r = found[name]
            named = [n for n in found if found[n][1] == part]
            return {"block": i, "sublayer": part,
                    "tensors": [f"layers.{i}.{n}" for n in TENSORS.get(part, ())],
                    "implementation": " and ".join(named), "beyond": r}
    if largest is None:
        return None
    i, part, name, r = largest
    return {"block": i, "sublayer": part,
            "tensors": [f"layers.{i}.{n}" for n in TENSORS.get(part, ())],
            "implementation": name, "beyond": r}


def _forward_checks(checks: list, other: str, jax_out, other_out, truth_out, real,
                    dtype: str, local=None) -> tuple[dict | None, float]:
    """Append the per-block, logit and KL figures of `other` against JAX over the real tokens;
    each *_out is (hidden, logits, parts) as the forward functions give them (truth_out: None
    without float64; local: float64's block_from on this batch, see _first_divergence). Returns
    (the first divergence or None, the largest part ratio of any block: how close to its budget
    the nearest part came)."""
    (jax_hidden, jax_logits, jax_parts), (other_hidden, other_logits, other_parts) = (jax_out,
                                                                                     other_out)
    truth_hidden, truth_logits, truth_parts = truth_out if truth_out is not None else (None,) * 3
    compared, rows = f"{other} vs JAX", []
    for i, (a, b) in enumerate(zip(jax_hidden, other_hidden)):
        t = truth_hidden[i][real] if truth_hidden is not None else None
        rows.append(_compare(f"hidden after block {i}", compared,
                             {"JAX": a[real], other: b[real]}, t, dtype, "hidden", ops=i + 1,
                             per_row=True))
    checks += rows

    def with_output(parts, hidden):
        return None if parts is None else [dict(p, output=h) for p, h in zip(parts, hidden)]
    outs = {"JAX": with_output(jax_parts, jax_hidden), other: with_output(other_parts,
                                                                          other_hidden)}
    ratios = _part_ratios(outs["JAX"], outs[other], with_output(truth_parts, truth_hidden), real,
                          other, dtype)
    nearest = max(r for block in ratios for part in block.values() for r in part.values())
    t = truth_logits[real] if truth_logits is not None else None
    logits = _compare("logits", compared, {"JAX": jax_logits[real], other: other_logits[real]}, t,
                      dtype, "logits", ops=len(jax_hidden) + 1, per_row=True)
    checks.append(logits)
    # KL, not a distance: its bound follows from the logits' one. If every logit of a position
    # agrees within d, KL <= d^2 / 2 (Hoeffding's lemma), d = the bound on the logits' difference
    # x their scale.
    kl_bound = (logits["difference_bound"] * logits["scale"]) ** 2 / 2
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
    return (_first_divergence(ratios, rows, outs, local if truth_out is not None else None,
                              real, dtype), nearest)
