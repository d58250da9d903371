"""4-bit weights: the arithmetic both twins share.

A weight W (out, in) is cut into groups of GROUP = 32 consecutive input columns; each group of
each row has a float16 scale d and a float16 minimum m, and each weight a 4-bit q in 0..15:

    d = float16((max - min) / 15),  m = float16(min)  (d = 1 where a group is constant)
    q = round((W - m) / d)                            in 0..15, ties to even, with d and m as
                                                      rounded, so that q * d + m is nearest W
    W ~ q * d + m                                     |error| <= d / 2 per weight, but for the
                                                      ends of a group (m and d rounded: a little
                                                      more), before rounding

This is llama.cpp's Q4_1 (ggml-quants.c, quantize_row_q4_1_ref), whose d and m are float16 too:
0.625 bytes a weight (they were float32 until 2026-12-05: 0.75, and checkpoints saved so still
load, as they are). It holds both of llama.cpp's plain 4-bit types exactly (bridge.gguf.int4):
Q4_1 (d * q + m) as it is, and Q4_0 (d * (q - 8)) with m = -8 d, since d * q and -8 d are exact in
float32 for a float16 d and their sum, d * (q - 8), is too. A weight with values beyond float16's
range (65504) is refused, naming it; a group whose d rounds to 0 in float16 (a range below about
1e-6) holds m alone.

Two q share a byte, along the inputs: byte j of row o holds q[o, 2j] in its low nibble and
q[o, 2j + 1] in its high one, so the packed weight is (out, in / 2) uint8, in both twins (the
decode kernels read its rows whole). A checkpoint holds it so too (bridge.quantize: the native
format's "int4" method). Dequantised, q * d + m is computed in float32, then rounded to the
compute dtype. A float16 d times q is exact in float32 (11 bits times 4), so the result is rounded
once, whatever the order of the operations (fused or not); only for the float32 d of a checkpoint
saved before float16 may it round twice, and the twins' sums differ in their last bit.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np

from .errors import BridgeError
from .parallel import by_chunks
from .resources import aligned_empty
from .quantize import INT4_GROUP as GROUP  # inputs per scale and minimum
from .quantize import MIN_SUFFIX, SCALE_SUFFIX  # <name>_scale, <name>_min beside <name>

LEVELS = 15           # q in 0..LEVELS
F16_MAX = 65504.0     # float16's largest finite value


def check_int4(w_OI: np.ndarray, name: str = "weight") -> None:
    """Refuse a weight that is not 2-D with a multiple of GROUP input columns, naming it."""
    if w_OI.ndim != 2:
        raise BridgeError(f"tensor '{name}': expected a 2-D weight, got shape {w_OI.shape}")
    if w_OI.shape[1] % GROUP:
        raise BridgeError(f"tensor '{name}': {w_OI.shape[1]} input columns are not a multiple "
                          f"of the 4-bit group size {GROUP}")


def pack(q_OI: np.ndarray) -> np.ndarray:
    """q (out, in) in 0..15 -> (out, in / 2) uint8: q[o, 2j] | q[o, 2j + 1] << 4."""
    q = np.asarray(q_OI, np.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack(packed_OJ: np.ndarray) -> np.ndarray:
    """(out, in / 2) uint8 -> q (out, in) uint8 in 0..15."""
    packed = np.asarray(packed_OJ, np.uint8)
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def quantize_int4(w_OI: np.ndarray, name: str = "weight"
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W (out, in) float -> (packed (out, in / 2) uint8, d (out, in / 32) float16, m (out,
    in / 32) float16), computed in float32 (float64 for a float64 W)."""
    w = np.asarray(w_OI)
    check_int4(w, name)
    wide = np.float64 if w.dtype == np.float64 else np.float32
    O, I = w.shape
    blocks = w.astype(wide).reshape(O, I // GROUP, GROUP)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    if not (np.all(np.isfinite(low)) and np.all(np.isfinite(high))
            and max(-float(low.min(initial=0)), float(high.max(initial=0))) <= F16_MAX):
        raise BridgeError(f"tensor '{name}': values beyond float16's range ({F16_MAX:g}) or not "
                          f"finite, which 4-bit weights with float16 scales cannot hold")
    d = np.where(high > low, (high - low) / LEVELS, 1).astype(np.float16)  # at most 2 x 65504 / 15
    m = low.astype(np.float16)
    step = np.where(d > 0, d, 1).astype(wide)[..., None]  # d = 0: every q is 0, the group is m
    q = np.rint((blocks - m[..., None].astype(wide)) / step)
    q = np.where(d[..., None] > 0, np.clip(q, 0, LEVELS), 0).astype(np.uint8).reshape(O, I)
    return pack(q), d, m


def minima_implied(d_OG: np.ndarray, m_OG: np.ndarray | None) -> bool:
    """Whether a 4-bit weight's minima are -8 times its scales throughout (llama.cpp's Q4_0:
    d (q - 8)), or None (a reader that knows them so: bridge.gguf.int4's Q4_0 blocks): then they
    need not be held, nor read (the decode kernels and XLA's path take min None as -8 scale,
    exactly: -8 d is a power of two times d)."""
    if m_OG is None:
        return True
    d_OG, m_OG = np.asarray(d_OG), np.asarray(m_OG)
    if m_OG.dtype != d_OG.dtype or m_OG.shape != d_OG.shape:
        return False
    m_, d_ = m_OG.reshape(-1), d_OG.reshape(-1)
    with np.errstate(over="ignore"):  # the first few tell most weights' answer (Q4_K's: no)
        return all(np.array_equal(m_[part], d_[part] * d_.dtype.type(-8))
                   for part in (slice(0, 64), slice(None)))


def dequantize_int4(packed_OJ: np.ndarray, d_OG: np.ndarray, m_OG: np.ndarray | None,
                    dtype=np.float32) -> np.ndarray:
    """The weight (out, in) in `dtype`: q * d + m in float32 (d and m float16, or float32 as
    checkpoints saved before 2026-12-05 hold them; m None: -8 d, Q4_0's form), rounded once to
    `dtype`."""
    q = unpack(packed_OJ)
    O, I = q.shape
    d = np.asarray(d_OG).astype(np.float32)
    m = -8 * d if m_OG is None else np.asarray(m_OG).astype(np.float32)
    w = q.reshape(O, I // GROUP, GROUP).astype(np.float32) * d[..., None] + m[..., None]
    return w.reshape(O, I).astype(dtype)


# A quantised GGUF type's nearest layout here: up to 5 bits a weight (Q4_0 4.5, Q4_1 5.0, Q4_K 4.5,
# IQ4_XS 4.25, Q3_K, Q2_K, ...) -> 4-bit weights, more (Q5_0 5.5, Q5_K 5.5, Q6_K 6.6, Q8_0 8.5)
# -> int8 with a scale per row.
INT4_MAX_BITS = 5.0
EXACT_INT4 = ("Q4_0", "Q4_1")  # the types this layout holds exactly (bridge.gguf.int4 reads them)
# the types whose 4-bit values it holds as stored, their scales rounded (bridge.gguf.int4 too)
ROUNDED_INT4 = ("Q4_K",)


ACTIVATIONS_ENV = "JAX_LLAMA_INT4_ACTIVATIONS"
ACTIVATIONS = ("float32", "int8", "bfloat16")
# the choice of an enclosing using_activations (None: none made), below the environment's
_CHOSEN: ContextVar[str | None] = ContextVar("int4_activations", default=None)


def activations() -> str:
    """How both twins' 4-bit projections take their input: "float32" (x as it is), "int8"
    (each group of GROUP inputs rounded to dx * round(x * (1 / dx)), dx = max |x| times
    float32(1 / 127), ties to even, within +-127, 0 for a group of zeros; the gradient passing
    straight through; the decode kernel then sums each group's products as integers,
    matvec.cc; what llama.cpp's Q4 dot products do to x, its Q8 activations) or "bfloat16"
    (each input rounded to the nearest bfloat16, ties to even, the gradient passing straight
    through; the decode kernel multiplies bfloat16 pairs where the CPU has AVX512_BF16, and
    factors each group's scale out of its exact products x' q with AVX2 alone). int8 weights
    (the projections; not a tied head) take x rounded to bfloat16 where that is the choice, so
    that a prompt meets them in bfloat16 pairs too, and as it is otherwise: 8-bit x is the
    4-bit kernels' alone (jax_llama.model.projections.int8_input).

    $JAX_LLAMA_INT4_ACTIVATIONS, where set, decides; else an enclosing using_activations; else
    float32 (generation: GENERATION_DEFAULT, generation_activations). Read when a program is
    traced: the generation programs take the choice as a static argument, so each is compiled
    for the one it runs."""
    import os

    value = os.environ.get(ACTIVATIONS_ENV, "").strip().lower()
    if not value:
        return _CHOSEN.get() or "float32"
    if value not in ACTIVATIONS:
        raise BridgeError(f"expected float32, int8 or bfloat16, got {value!r}",
                          field=ACTIVATIONS_ENV)
    return value


# What generation takes where neither the environment nor a caller chose: bfloat16. Not int8:
# with it SmolLM2's Q4_1 file asked "What is the capital of France?" in its chat template answers
# "L'Etoile, la Marseillaise, ..." greedily - and so does llama.cpp on the same file and ids
# (llama-cpp-python, 2026-12-05: "L'Etoile, la Cite, la Nation") - where float32 and bfloat16 x
# answer "The capital of France is Paris." (rounding x to 8 bits per 32 inputs costs this model
# its answers; bfloat16 keeps 8 bits of every input). Perplexity on SmolLM2's Q4_0 weights rises
# +23.00% over float32 with bfloat16 x, +22.96% with float32 x, +23.09% with 8-bit x (llama.cpp
# +23.11%), and with AVX512_BF16 its decode is 1.2x float32's (results/decode/generate_int4_bf16).
# int8 projections take it too (bfloat16 x; jax_llama.model.projections.int8_input): on SmolLM2's
# Q8_0 file the per-token KL from the float path goes from 6.93e-3 to 7.04e-3 (scripts/
# activation_kl.py), and a prompt meets int8 weights in bfloat16 pairs (LLaMA 3 8B's layout as
# Q8_0: pp512 0.87x -> 1.54x llama.cpp's, 2-core AMD EPYC Zen 4).
# The forward's default (activations) stays float32: training, evaluation and parity.
GENERATION_DEFAULT = "bfloat16"


def generation_activations() -> str:
    """The 4-bit activations generation runs with: the environment's or an enclosing
    using_activations' choice, else GENERATION_DEFAULT."""
    import os

    if os.environ.get(ACTIVATIONS_ENV, "").strip() or _CHOSEN.get() is not None:
        return activations()
    return GENERATION_DEFAULT


@contextmanager
def using_activations(kind: str):
    """Within this block, 4-bit projections take their input as `kind` (one of ACTIVATIONS)
    unless $JAX_LLAMA_INT4_ACTIVATIONS says otherwise (activations)."""
    if kind not in ACTIVATIONS:
        raise BridgeError(f"expected float32, int8 or bfloat16, got {kind!r}", field="activations")
    token = _CHOSEN.set(kind)
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def nearest_layout(type_name: str | None) -> str | None:
    """"int4" or "int8" for a GGUF quantisation type (by its bits a weight: INT4_MAX_BITS), None
    for a float type or None."""
    bits = bits_per_weight(type_name)
    if bits is None:
        return None
    return "int4" if bits <= INT4_MAX_BITS else "int8"


def bits_per_weight(type_name: str | None) -> float | None:
    """The bits a weight of a GGUF quantisation type takes (its blocks' bytes over their
    weights, from gguf's own table); None for float types and names gguf does not know."""
    import gguf

    if type_name is None or type_name in ("F32", "F16", "BF16", "F64"):
        return None
    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    except KeyError:
        return None
    return 8 * size / block


ROWS_CHUNK_ELEMENTS = 1 << 20  # weights read and quantised at a time by QuantisedReader


class QuantisedReader:
    """name -> the quantised form of a weight as the model will hold it, or None to read it as a
    float tensor; made by int4_reader or nearest_reader. Each form is (packed, scale, min) of a
    4-bit projection or (q, scale) of int8 weights with one scale per row, canonical (out, ...).
    Weights it quantises from floats (not read exactly from the file's own blocks) have their
    error recorded: `summary()` says it in one line."""

    def __init__(self, checkpoint, get, config, layout_of):
        from .tensors import canonical_shapes

        self.checkpoint, self.get, self.layout_of = checkpoint, get, layout_of
        self.shapes = shapes = canonical_shapes(config)
        # (name, index) -> get(name)[index], reading only those rows, where the caller has one
        # (a load that reads the checkpoint's tensors as they are: not a convert's transform)
        self.rows = None
        self.layouts = {name: layout for name in shapes
                        if (layout := layout_of(name)) is not None}
        for name, layout in self.layouts.items():
            if layout == "int4" and shapes[name][1] % GROUP:
                raise BridgeError(f"tensor '{name}': {shapes[name][1]} input columns are not a "
                                  f"multiple of the 4-bit group size {GROUP}", field="int4")
        self.exact: dict[str, int] = {}                  # "Q4_1 -> int4": tensors read exactly
        self.errors: dict[str, list[float]] = {}         # "Q8_0 -> int8": relative RMS errors
        self.rounded: dict[str, list[float]] = {}        # "Q4_K -> int4": q kept, scales rounded

    def __call__(self, name: str):
        layout = self.layouts.get(name)
        if layout is None:
            return None
        source = self.checkpoint.stored_type(name) or "float"
        key = f"{source} -> {layout}" + (" rows" if layout == "int8" else "")
        if layout == "int4":
            held = self.checkpoint.int4_tensor(name)
            if held is not None:
                self.exact[key] = self.exact.get(key, 0) + 1
                return held
            rounded = self.checkpoint.int4_rounded(name)
            if rounded is not None:  # its q kept, its scales rounded: the change measured
                *held, change, norm = rounded
                self.rounded.setdefault(key, []).append(_relative(change, norm))
                return tuple(held)
        elif (rows := self.checkpoint.int8_rows(name)) is not None:  # straight from its blocks
            q, scale, change, norm = rows
            self.errors.setdefault(key, []).append(_relative(change, norm))
            return q, scale
        return self._by_rows(name, key, layout)

    def _by_rows(self, name: str, key: str, layout: str):
        """The weight in `layout` (quantize_int4's 4-bit weights, or quantize_weight's int8 rows
        with one scale a row), quantised a chunk of rows at a time on the CPU's cores
        (bridge.parallel), its error summed chunk by chunk in order: the numbers of the whole
        tensor's, as each group of 32 (int4) or row (int8) is quantised alone. The rows come from
        `rows` where the load gave it, so that no float copy of the whole tensor is made (LLaMA 3
        8B's embedding and head are 2.1 GB each in float32, fresh memory that took longer to
        touch than to fill), else from get(name)."""
        from .quantize import dequantize_weight, quantize_weight

        O, I = self.shapes[name]
        if layout == "int4":
            quantise, back = quantize_int4, dequantize_int4
            out = (aligned_empty((O, I // 2), np.uint8), aligned_empty((O, I // GROUP), np.float16),
                   aligned_empty((O, I // GROUP), np.float16))
        else:
            quantise, back = quantize_weight, dequantize_weight
            out = (aligned_empty((O, I), np.int8), aligned_empty((O, 1), np.float32))
        if self.rows is not None:
            def read(index):
                return self.rows(name, index)
        else:
            w = self.get(name)
            if tuple(w.shape) != (O, I):
                raise BridgeError(f"tensor '{name}': shape {tuple(w.shape)}, config implies "
                                  f"{(O, I)}")

            def read(index):
                return w[index]

        def chunk(start: int, stop: int) -> tuple[float, float]:
            rows = np.asarray(read((slice(start, stop),)))
            got = quantise(rows, name=name)
            for whole, part in zip(out, got):
                whole[start:stop] = part
            rows = np.asarray(rows, np.float32).ravel()
            diff = back(*got).ravel()  # a fresh array: the change made in place
            np.subtract(diff, rows, out=diff)
            return float(np.dot(diff, diff)), float(np.dot(rows, rows))

        sums = by_chunks(chunk, O, ROWS_CHUNK_ELEMENTS // I)
        change, norm = sum(c for c, _ in sums), sum(n for _, n in sums)  # in chunk order
        self.errors.setdefault(key, []).append(_relative(change, norm))
        return out

    def summary(self) -> str | None:
        """One line: what was read exactly and what was quantised, with its error (RMS of the
        change over RMS of the weight, the median and the largest over tensors)."""
        parts = [f"{n} {key} exactly" for key, n in self.exact.items()]
        for key, errors in self.rounded.items():
            parts.append(f"{len(errors)} {key} with their 4-bit values as stored and the scales "
                         f"rounded to float16 (error {100 * np.median(errors):.2g}% RMS of the "
                         f"weights, at most {100 * max(errors):.2g}%)")
        for key, errors in self.errors.items():
            parts.append(f"{len(errors)} {key} quantised (error {np.median(errors):.2%} RMS of "
                         f"the weights, at most {max(errors):.2%})")
        return "; ".join(parts) or None


def _relative(change: float, norm: float) -> float:
    """The RMS of a change over the RMS of the weights, from their squared sums (0 for zeros)."""
    return float(np.sqrt(change / norm)) if norm > 0 else 0.0


def int4_reader(checkpoint, get, config) -> QuantisedReader:
    """The projections (the layers' wq ... w3 and an untied LM head) as 4-bit weights: the
    checkpoint's own 4-bit blocks where it has them exactly (Checkpoint.int4_tensor), else
    quantize_int4 of get(name), one tensor at a time; a tied LM head, the token embedding, as
    int8 rows (bridge.quantize.quantize_weight), which the decode kernels read row by row. Input
    widths are checked first."""
    from .quantize import quantized_names

    names = set(quantized_names(config))
    return QuantisedReader(checkpoint, get, config, lambda name: None if name not in names
                           else "int8" if name == EMBEDDING else "int4")


def int4_specs(config, specs: dict, reader: QuantisedReader):
    """A float checkpoint's `specs` (name -> (shape, dtype)) -> (the specs of its 4-bit native
    checkpoint (bridge.quantize's "int4" method: each projection's uint8 weight, scale and
    minimum; a tied head's int8 rows and scale; the rest as they are), stored(name) -> that
    checkpoint's tensor for the names quantisation decides, None for the others). Each weight is
    read once, through `reader` (int4_reader), and kept until its last part is written."""
    from .quantize import Quantization, checkpoint_shapes, stored_dtype_of

    quantization = Quantization("int4")
    out = {}
    for name, shape in checkpoint_shapes(config, quantization).items():
        dtype = stored_dtype_of(name, config, quantization)
        out[name] = (shape, dtype if dtype is not None else specs[name][1])
    held: dict[str, tuple] = {}

    def stored(name: str):
        if stored_dtype_of(name, config, quantization) is None:
            return None
        base = name.removesuffix(MIN_SUFFIX).removesuffix(SCALE_SUFFIX)
        if base not in held:
            held.clear()
            held[base] = reader(base)
        if name.endswith(MIN_SUFFIX) and held[base][2] is None:  # Q4_0's: -8 d, exact
            d = held[base][1]
            return d * d.dtype.type(-8)
        return held[base][0 if name == base else 1 if name.endswith(SCALE_SUFFIX) else 2]

    return out, stored


def nearest_reader(checkpoint, get, config) -> QuantisedReader:
    """Each weight a quantised file holds in its nearest layout (nearest_layout of its type:
    a GGUF's Q4_0 / Q4_1 as 4-bit weights exactly, Q4_K's with its 4-bit values as stored and
    its scales rounded to float16 (bridge.gguf.int4.from_q4_k_blocks), other types of up to 5
    bits quantised to 4 bits, Q5, Q6_K and Q8_0 to int8 rows); a tied head, and an untied
    embedding, of any quantised type as int8 rows (the embedding's a lookup table); float
    tensors as they are."""
    from .quantize import quantized_names

    projections = set(quantized_names(config)) - {EMBEDDING}

    def layout_of(name: str) -> str | None:
        nearest = nearest_layout(checkpoint.stored_type(name))
        if nearest is None:
            return None
        if name in projections:
            return nearest
        return "int8" if name == EMBEDDING else None
    return QuantisedReader(checkpoint, get, config, layout_of)


def int8_reader(checkpoint, get, config) -> QuantisedReader:
    """The projections and the LM head (a tied one: the embedding) as int8 with one scale per
    output channel, quantised as each is read (bridge.quantize.quantize_weight: the numbers of
    jax_llama.quantize and torch_llama.quantize), so the float model is never whole in memory."""
    from .quantize import quantized_names

    names = set(quantized_names(config))
    return QuantisedReader(checkpoint, get, config,
                           lambda name: "int8" if name in names else None)


def mixture_refused(name: str, field: str) -> BridgeError:
    """The refusal to save a model holding `name` as int8 beside 4-bit projections (a load in each
    tensor's nearest layout of a file with 6- or 8-bit tensors): no checkpoint holds both."""
    return BridgeError(f"{name}: int8 beside 4-bit projections (a load in each tensor's nearest "
                       f"layout): no checkpoint holds the mixture; load with quantize='int4' "
                       f"(--quantize int4) to hold every projection as 4-bit", field=field)


class StoredReader:
    """A 4-bit native checkpoint's quantised weights as it stores them (bridge.quantize: the
    "int4" method): name -> (packed, scale, min) of a 4-bit projection, (q, scale) of the int8
    head rows, None for the float tensors - the QuantisedReader interface, nothing quantised."""

    def __init__(self, checkpoint):
        from .quantize import int4_head, quantized_names

        self.checkpoint, self.head = checkpoint, int4_head(checkpoint.config)
        self.names = set(quantized_names(checkpoint.config))

    def __call__(self, name: str):
        if name not in self.names:
            return None
        read = self.checkpoint.tensor
        suffixes = (SCALE_SUFFIX,) if name == self.head else (SCALE_SUFFIX, MIN_SUFFIX)
        return (read(name), *(read(name + suffix) for suffix in suffixes))

    def summary(self) -> None:
        return None


def quantised_layouts(checkpoint) -> dict[str, int]:
    """What nearest_reader would make of `checkpoint`'s tensors, counted without reading them:
    {"Q4_1 -> int4 (exact)": 210, "Q8_0 -> int8 rows": 1}; empty for a float checkpoint."""
    reader = nearest_reader(checkpoint, None, checkpoint.config)
    counts: dict[str, int] = {}
    for name, layout in reader.layouts.items():
        source = checkpoint.stored_type(name)
        key = f"{source} -> {layout}" + (" rows" if layout == "int8" else "") + (
            " (exact)" if source in EXACT_INT4 and layout == "int4" else
            " (4-bit values as stored)" if source in ROUNDED_INT4 and layout == "int4" else "")
        counts[key] = counts.get(key, 0) + 1
    return counts


EMBEDDING = "tok_embeddings.weight"  # the token embedding: in quantized_names where the head is tied
