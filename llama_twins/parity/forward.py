"""The forward passes the report compares - the JAX twin, the torch twin, and transformers as a
reference - each giving (hidden state after each block [(B, S, D)], logits (B, S, V)) in float64,
on one random batch; and the figures made of them: each block's hidden state, the logits, and KL."""

from __future__ import annotations

import contextlib

import numpy as np

from .judgement import _compare, _check, _f64, _kl, _log_softmax


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
