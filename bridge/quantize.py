"""int8 weight-only quantisation: the arithmetic both twins share, and how a checkpoint holds it.

Every weight a decode step reads whole - the projections wq, wk, wv, wo, w1, w2, w3 and the LM
head (`output`, or the token embedding when the head is tied to it) - is held as W (out, in) and
becomes int8 values Q and float32 scales s, symmetric (no zero point), per output channel or per
group of `group_size` consecutive input columns:

    s[o, g] = max |W[o, g*G:(g+1)*G]| / 127        (1 where that block is all zeros)
    Q[o, i] = round(W[o, i] / s[o, i // G])        in [-127, 127], ties to even (numpy, jnp, torch)
    W ~ Q * s                                      |error| <= s / 2 per weight

Per channel is one group spanning the whole row (G = in), so the scales are always (out, in / G):
(out, 1) per channel. A tied embedding (vocab, dim) is the head's W as it is (out = vocab, in =
dim): int8 per row, each token's row looked up and dequantised, Q[t] * s[t], as llama.cpp's Q8_0
files hold it. The norms keep their dtype, and so does an untied embedding: only looked up, one
row per token, int8 would save nothing a decode step reads.

On disk (the native format) a quantised tensor is the int8 `<name>` (canonical shape, e.g.
`layers.0.attention.wq.weight`) plus its float32 `<name>_scale` (out, in / G), and config.json
declares it: `"quantization": {"method": "int8", "group_size": null | G}`.

4-bit weights (bridge.int4; `"quantization": {"method": "int4", "group_size": 32}`): every
projection (the layers' wq ... w3 and an untied `output`) is the uint8 `<name>` (out, in / 2), two
weights a byte in input order, with float16 `<name>_scale` and `<name>_min` (out, in / 32) (float32
in checkpoints saved before 2026-12-05, which load as they are); a tied LM head, the token
embedding, is int8 rows as above, `<name>_scale` (vocab, 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from .config import LlamaConfig
from .errors import BridgeError
from .tensors import canonical_shapes

METHODS = ("int8", "int4")
INT4_GROUP = 32  # bridge.int4.GROUP
MIN_SUFFIX = "_min"  # beside <name>_scale: a 4-bit weight's minima
QMAX = 127
SCALE_SUFFIX = "_scale"
# The canonical weights of a layer that are quantised (and the LM head: quantized_names).
QUANTIZED_SUFFIXES = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                      "attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
                      "feed_forward.w3.weight")


@dataclass(frozen=True)
class Quantization:
    """How a model's projection weights are quantised: `method` (int8 or int4) and `group_size`
    (int8: None, one scale per output channel, or G, one per G consecutive input columns of each
    row; int4: 32, which None stands for)."""

    method: str = "int8"
    group_size: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise BridgeError(f"unknown method {self.method!r}; known: {', '.join(METHODS)}",
                              field="quantize")
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g <= 0):
            raise BridgeError(f"must be a positive integer or None (got {g!r})",
                              field="group_size")
        if self.method == "int4":
            if g not in (None, INT4_GROUP):
                raise BridgeError(f"4-bit weights come in groups of {INT4_GROUP} inputs (got "
                                  f"{g})", field="group_size")
            object.__setattr__(self, "group_size", INT4_GROUP)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "group_size": self.group_size}

    @classmethod
    def from_dict(cls, d: Any, where: str = "config.json") -> "Quantization":
        if not isinstance(d, Mapping) or set(d) - {"method", "group_size"}:
            raise BridgeError(f"{where}: 'quantization' must be an object with 'method' and "
                              f"'group_size' (got {d!r})")
        try:
            return cls(d.get("method", "int8"), d.get("group_size"))
        except BridgeError as e:
            raise BridgeError(f"{where}: quantization.{e.field}: {e.message}") from None

    def groups(self, in_features: int, name: str = "weight") -> int:
        """Scale columns of a weight with `in_features` inputs; refuses a group size that does
        not divide them."""
        if self.method == "int4" and in_features % INT4_GROUP:
            raise BridgeError(f"tensor '{name}': {in_features} input columns are not a multiple "
                              f"of the 4-bit group size {INT4_GROUP}", field="quantize")
        if self.group_size is None:
            return 1
        if in_features % self.group_size:
            raise BridgeError(f"{self.group_size} does not divide the {in_features} input "
                              f"columns of '{name}'", field="group_size")
        return in_features // self.group_size


def quantized_names(config: LlamaConfig) -> list[str]:
    """The canonical tensors a quantised checkpoint of `config` holds as int8: the projections
    and the LM head (the token embedding when it is tied), in canonical order."""
    head = "tok_embeddings.weight" if config.tie_embeddings else "output.weight"
    return [n for n in canonical_shapes(config) if n == head or (
        n.startswith("layers.") and n.split(".", 2)[2] in QUANTIZED_SUFFIXES)]


def scale_shapes(config: LlamaConfig, quantization: Quantization) -> dict[str, tuple[int, int]]:
    """`<name>_scale` -> (out, in / G) for every quantised tensor; refuses, naming the first
    tensor, a group size that does not divide its input columns (checked before any work)."""
    shapes = canonical_shapes(config)
    head = int4_head(config) if quantization.method == "int4" else None
    return {name + SCALE_SUFFIX: (shapes[name][0], 1 if name == head else
                                  quantization.groups(shapes[name][1], name))
            for name in quantized_names(config)}


def int4_head(config: LlamaConfig) -> str | None:
    """The tensor a 4-bit model holds as int8 rows: the token embedding when the head is tied to
    it (a lookup table the decode kernels read row by row); None when the head is untied."""
    return "tok_embeddings.weight" if config.tie_embeddings else None


def checkpoint_shapes(config: LlamaConfig,
                      quantization: Quantization | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` holds, in order, as stored: bridge.tensors.
    canonical_shapes, with each quantised projection's `<name>_scale` right after it (and, 4-bit,
    its `<name>_min` after that, the weight itself (out, in / 2))."""
    shapes = canonical_shapes(config)
    if quantization is None:
        return shapes
    scales = scale_shapes(config, quantization)
    four = set(int4_names(config)) if quantization.method == "int4" else set()
    out = {}
    for name, shape in shapes.items():
        out[name] = (shape[0], shape[1] // 2) if name in four else shape
        if name + SCALE_SUFFIX in scales:
            out[name + SCALE_SUFFIX] = scales[name + SCALE_SUFFIX]
        if name in four:
            out[name + MIN_SUFFIX] = scales[name + SCALE_SUFFIX]
    return out


def int4_names(config: LlamaConfig) -> list[str]:
    """The tensors a 4-bit checkpoint holds as 4-bit weights: quantized_names but a tied head."""
    head = int4_head(config)
    return [n for n in quantized_names(config) if n != head]


def stored_dtype_of(name: str, config: LlamaConfig, quantization: Quantization) -> np.dtype | None:
    """The dtype a quantised checkpoint stores `name` in where quantisation decides it (uint8
    4-bit weights and their float16 scales and minima, int8 weights and their float32 scales);
    None for the float tensors. (OLD_INT4_SCALES: what 4-bit checkpoints held before.)"""
    if name.endswith((SCALE_SUFFIX, MIN_SUFFIX)):
        base = name.removesuffix(SCALE_SUFFIX).removesuffix(MIN_SUFFIX)
        four = quantization.method == "int4" and base != int4_head(config)
        return np.dtype(np.float16 if four else np.float32)
    if name in quantized_names(config):
        four = quantization.method == "int4" and name != int4_head(config)
        return np.dtype(np.uint8 if four else np.int8)
    return None


# 4-bit checkpoints saved before 2026-12-05 hold float32 scales and minima; they load as they are
OLD_INT4_SCALES = np.dtype(np.float32)


def check_quantizable(config: LlamaConfig, quantization: Quantization) -> None:
    """Refuse up front a model whose dims the group size does not divide."""
    scale_shapes(config, quantization)


def quantize_weight(w_OI: np.ndarray, group_size: int | None = None,
                    name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """W (out, in) float -> (Q (out, in) int8, s (out, in / G) float32), computed in float32
    (float64 for float64 W, so a float64 reference quantises the same way)."""
    w = np.asarray(w_OI)
    if w.ndim != 2:
        raise BridgeError(f"tensor '{name}': expected a 2-D weight, got shape {w.shape}")
    wide = np.float64 if w.dtype == np.float64 else np.float32
    O, I = w.shape
    groups = Quantization(group_size=group_size).groups(I, name)
    q = np.empty((O, I), np.int8)
    scale = np.empty((O, groups), np.float32)
    # rows a chunk at a time: each row's numbers alone, and the temporaries a few MB, not
    # several copies of the weight (fresh memory is slow to touch: 1.9 s against 0.1 s for
    # SmolLM2's embedding, 2-core AMD EPYC VM)
    step = max(1, CHUNK_ELEMENTS // max(I, 1))
    for r in range(0, O, step):
        blocks = w[r:r + step].astype(wide).reshape(-1, groups, I // groups)  # a copy
        amax = np.abs(blocks).max(axis=-1)
        s = np.where(amax > 0, amax / QMAX, 1).astype(np.float32)
        np.divide(blocks, s[..., None].astype(wide), out=blocks)  # in place: no temporaries
        np.clip(np.rint(blocks, out=blocks), -QMAX, QMAX, out=blocks)
        q[r:r + step] = blocks.reshape(-1, I)  # whole numbers within +-127
        scale[r:r + step] = s
    return q, scale


CHUNK_ELEMENTS = 1 << 20  # weights quantised at a time by quantize_weight


def dequantize_weight(q_OI: np.ndarray, scale_OG: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Q (out, in) int8 and s (out, in / G) -> Q * s (out, in) in `dtype` (the product in
    float32, then one rounding: what the twins' matmuls see)."""
    O, I = q_OI.shape
    groups = scale_OG.shape[1]
    w = q_OI.reshape(O, groups, I // groups).astype(np.float32) * scale_OG[..., None].astype(np.float32)
    return w.reshape(O, I).astype(dtype)


def quantized_specs(config: LlamaConfig, quantization: Quantization, specs: dict):
    """Float `specs` (name -> (shape, dtype)) -> (the specs of the quantised checkpoint: int8
    projections each followed by its float32 scale; quantized(name, read) -> (Q, s) of one
    projection, read(name) giving its float weight). Each weight is quantised once, when the
    first of its two tensors is asked for, and kept only until the other one is."""
    int8 = set(quantized_names(config))
    scales = scale_shapes(config, quantization)
    out = {}
    for name, (shape, dtype) in specs.items():
        out[name] = (shape, np.dtype(np.int8)) if name in int8 else (shape, dtype)
        if name in int8:
            out[name + SCALE_SUFFIX] = (scales[name + SCALE_SUFFIX], np.dtype(np.float32))
    held: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def quantized(name: str, read: Callable[[str], np.ndarray]):
        if name in held:
            return held.pop(name)
        held.clear()
        held[name] = quantize_weight(read(name), quantization.group_size, name)
        return held[name]

    return out, quantized
