"""The config section: two checkpoints' architectures compared by meaning, not by key.

Both sides are already LlamaConfig (each format's reader maps its own keys: HF's rms_norm_eps,
a GGUF's llama.attention.layer_norm_rms_epsilon and Meta's norm_eps all land in `norm_eps`), so a
key spelled differently across formats is never a difference here. What is compared is what
changes the computation; the family's name only where its deltas differ (a Mistral read back from
a GGUF as family llama computes the same). max_seq_len is shown but judged by no one: formats
disagree on what they write there, and the model computes the same within either length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..config import LlamaConfig, RopeScaling
from .report import DIFFERENT, SAME, Finding

# The fields that change what the model computes, in the order a difference is named.
FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size",
          "tie_embeddings", "rope_theta", "rope_scaling", "norm_eps", "sliding_window",
          "qkv_bias", "qk_norm")
_ROPE_SUBFIELDS = tuple(f.name for f in dataclasses.fields(RopeScaling))

# What to check next when a field differs: where converters are known to lose it.
_CHECK_NEXT = {
    "rope_theta": "the converter dropped or rewrote rope_theta (llama.cpp PR #8676): RoPE turns "
                  "each position by a different angle, so every token after the first is off",
    "rope_scaling": "the converter dropped or rewrote rope_scaling (llama.cpp PR #8676, "
                    "ik_llama.cpp #2291): short texts barely change, long contexts fall apart",
    "norm_eps": "the norm epsilon was written with a library's default (HF rms_norm_eps, GGUF "
                "llama.attention.layer_norm_rms_epsilon, Meta norm_eps)",
    "tie_embeddings": "the tied head was lost or untied in the conversion (llama.cpp #12567): "
                      "compare the output head with the token embeddings (the weights section)",
    "sliding_window": "the sliding window was dropped or changed (HF sliding_window, GGUF "
                      "<arch>.attention.sliding_window): positions beyond it attend differently",
    "qkv_bias": "the family's q/k/v biases were dropped or added: was the model written as "
                "another family?",
    "qk_norm": "the family's q/k norms were dropped or added: was the model written as another "
               "family?",
    "n_kv_heads": "the grouped-query heads differ (HF num_key_value_heads, GGUF "
                  "<arch>.attention.head_count_kv): a config from another model?",
}
_OTHER_MODEL = "the architecture's sizes differ: is B a conversion of another model, or its config?"


def _same_value(x: Any, y: Any) -> bool:
    """Equal, floats within float32 rounding (a GGUF stores them as float32)."""
    if isinstance(x, float) or isinstance(y, float):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y)):
            return False
        return math.isclose(x, y, rel_tol=1e-6, abs_tol=0.0)
    return x == y


def _show(value: Any) -> str:
    if isinstance(value, RopeScaling):
        return f"{value.type} (" + ", ".join(f"{sub} {getattr(value, sub)}" for sub in
                                              _ROPE_SUBFIELDS if sub != "type") + ")"
    return "none" if value is None else str(value)


def _differences(a: LlamaConfig, b: LlamaConfig) -> list[tuple[str, Any, Any]]:
    """(field, A's value, B's value) for each computing field that differs; rope_scaling by
    sub-field (rope_scaling.factor ...), or as a whole where one side has none."""
    found = []
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if name == "rope_scaling" and x is not None and y is not None:
            found += [(f"rope_scaling.{sub}", getattr(x, sub), getattr(y, sub))
                      for sub in _ROPE_SUBFIELDS
                      if not _same_value(getattr(x, sub), getattr(y, sub))]
        elif name == "sliding_window" and _window_reaches(a, b):
            continue
        elif not _same_value(x, y):
            found.append((name, x, y))
    return found


def _window_reaches(a: LlamaConfig, b: LlamaConfig) -> bool:
    """Whether each side's sliding window (none: unbounded) covers both sides' max_seq_len, so
    that no query within them attends differently."""
    longest = max(a.max_seq_len, b.max_seq_len)
    return all(c.sliding_window is None or c.sliding_window >= longest for c in (a, b))


def _as_dict(config: LlamaConfig) -> dict[str, Any]:
    d = dataclasses.asdict(config)
    d["eos_ids"] = list(config.eos_ids)
    return d


def compare_config(a, b) -> Finding:
    """The config section for two opened checkpoints (bridge.formats.open_checkpoint): SAME when
    every field that changes the computation agrees, else DIFFERENT naming the first that does
    not (its values in A and B) and where converters are known to lose it."""
    ca, cb = a.config, b.config
    differs = _differences(ca, cb)
    lines = []
    for name, x, y in differs:
        lines.append(f"{name}: {_show(x)} in A, {_show(y)} in B  <- differs")
    if ca.deltas != cb.deltas or (differs and ca.family != cb.family):
        lines.append(f"family: {ca.family} in A, {cb.family} in B")
    elif ca.family != cb.family:
        lines.append(f"family: {ca.family} in A, {cb.family} in B; the same decoder (no delta "
                     f"differs), so not a difference")
    agreeing = [n for n in FIELDS if not any(d[0].split(".")[0] == n for d in differs)]
    lines.append("the same in both: " + ", ".join(
        f"{n} {_show(getattr(ca, n))}" for n in agreeing))
    if ca.sliding_window != cb.sliding_window and _window_reaches(ca, cb):
        lines.append(f"sliding_window: {_show(ca.sliding_window)} in A, "
                     f"{_show(cb.sliding_window)} in B; not a difference: no window is shorter "
                     f"than max_seq_len {max(ca.max_seq_len, cb.max_seq_len)}")
    if ca.max_seq_len != cb.max_seq_len:
        lines.append(f"max_seq_len: {ca.max_seq_len} in A, {cb.max_seq_len} in B; shown, not "
                     f"judged: formats disagree on the length they write, and the model "
                     f"computes the same within either")
    for name, what in (("bos_id", "BOS id"), ("eos_ids", "EOS ids")):
        x, y = getattr(ca, name), getattr(cb, name)
        said = _show(x) if x == y else f"{_show(x)} in A, {_show(y)} in B"
        lines.append(f"{name}: {said} (the config's {what}; the tokenizer section judges "
                     f"BOS and EOS)")
    figures = {"a": _as_dict(ca), "b": _as_dict(cb),
               "differs": [{"field": n, "a": x if not isinstance(x, RopeScaling) else
                            dataclasses.asdict(x), "b": y if not isinstance(y, RopeScaling) else
                            dataclasses.asdict(y)} for n, x, y in differs]}
    if not differs:
        return Finding("config", SAME, f"the same architecture ({ca.n_layers} layers, dim "
                       f"{ca.dim}, {ca.n_heads} heads / {ca.n_kv_heads} kv heads, rope_theta "
                       f"{ca.rope_theta:g}, norm_eps {ca.norm_eps:g})", lines, figures=figures)
    name, x, y = differs[0]
    family = (f" ({ca.family} in A, {cb.family} in B)"
              if ca.deltas != cb.deltas and ca.family != cb.family else "")
    cause = f"config: {name} {_show(x)} in A, {_show(y)} in B{family}"
    base = name.split(".")[0]
    summary = (f"{len(differs)} field{'s' * (len(differs) > 1)} differ: "
               + ", ".join(n for n, _, _ in differs))
    return Finding("config", DIFFERENT, summary, lines, cause=cause,
                   check_next=_CHECK_NEXT.get(base, _OTHER_MODEL), figures=figures)
