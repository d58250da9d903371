"""Decode kernels for XLA:CPU (matvec.cc): what batch-1 to batch-8 decoding runs.

    y = matvec(x_MI, w_IO)                          # float32 weights
    y = matvec(x_MI, q_IO, scale_GO)                # int8 weights, per-output-channel scales
    q, k, v = matvec_f32(x_MI, [w_IO, ...])         # several float32 weights reading one x
    q, k, v = matvec_int8(x_MI, [(q_IO, scale_GO), ...])   # the same, int8
    q, k, v = matvec_int4(x_MI, [(packed_OJ, scale_OG, min_OG), ...])   # 4-bit (bridge.int4),
                                                    # stored a row per output
    y = matvec_rows(x_MI, w_OI)                     # weights stored (out, in): a tied LM head
    y = matvec_rows(x_MI, q_OI, scale_OG)           # (the embedding), float32 or int8 with
                                                    # per-row scales
    out = attend_cache(q_BKGSH, k_LBKTH, v_LBKTH, layer, mask)   # attention over a KV cache

At decode time a projection multiplies a few rows by a weight it reads once, so its speed is how
fast the weight streams in. XLA:CPU converts an int8 weight to float32 in a pass of its own (a
float copy written and read back: results/decode/int8_matmul.md); matvec.cc reads a block of a weight's
rows in strips of columns, converts each weight in a register and multiplies it into float32
sums held in registers. Its own helper threads share every call of 64 KB or more with the
caller, and spin between the calls of a decode step rather than sleep (XLA's threads took about
as long to wake as a SmolLM2 projection takes to read). jax_llama.model.projections runs every
projection of up to 8 rows through it (a model's `kernels` allowing), float32 or int8 (q, k and
v in one call, gate and up in another), a tied LM head through matvec_rows, and attention of a
few float32 queries over the KV cache through attend_cache: one call a layer that reads the layer in place, where XLA ran a dozen small
operations (the layer sliced and transposed, two batched matmuls, the softmax's passes).
One prompt path too: 4-bit and int8 weights with bfloat16 activations (generation's prefill)
meet PROMPT_ROWS rows or more in matvec.cc's prompt kernels, which multiply bfloat16 pairs where
the library has AVX512_BF16 (twice float32's products a cycle; a prompt is bound by arithmetic,
not by reading weights). On SmolLM2 at batch 1 (a 2-core AMD EPYC, every row alternating with llama.cpp's;
results/decode/generate_smollm2.md): float32 0.88x llama.cpp's F32 (XLA alone 0.65x), int8 1.05x its
Q8_0 (XLA's int8 matmul 0.25x).

Nothing is compiled when a model runs: `jax-llama kernels build` (README's set-up runs it)
compiles the source ahead of time with the system's C++ compiler, against the XLA FFI headers
jaxlib ships, once per instruction set this CPU runs (AVX-512 with or without VNNI and BF16, AVX2
+ FMA, plain C++; jax_llama.model.kernels.library), and a model's first use loads the best one
built for this CPU and registers it with jax.ffi. Where none is built for it (no compiler when
the build ran, a new jaxlib since) or it cannot run here (not a CPU backend, several devices)
`usable` says False, the reason and the command that builds them are logged once, and
jax_llama.model.projections uses XLA's matmul: the kernels are an accelerator, never a
requirement (a model with kernels="kernels" is refused instead). `jax-llama kernels` says what is
built and which variant this CPU runs; `JAX_LLAMA_KERNEL_MARCH` names another (x86-64-v3: the
AVX2 one on an AVX-512 machine), `JAX_LLAMA_KERNEL_CACHE` where they are built.
`JAX_LLAMA_KERNELS=0` turns them off (kernels="auto" is then xla); `JAX_LLAMA_KERNEL_THREADS=N` sets the threads a call
may use (the caller and N - 1 helpers; default: the CPUs this process may run on, at most 8).

Within each block of 64 inputs an output is one float32 sum in order, and the block sums are
added in block order (the int8 scale multiplies the total; grouped int8 scales, one row per
group of inputs, scale each group's sum into its block's in order); in matvec_rows an output is a dot
product in vector lanes added by a fixed tree; attend_cache computes each query alone (its
scores, softmax and weighted sum in a fixed order). So results differ from XLA's by float32
rounding only, and a row's bits depend neither on how many rows share the call nor on the
threads (the prompt kernel's rows: the same bits in any call of PROMPT_ROWS rows or more); a
gradient, where one is asked for, is XLA's (custom_vjp).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from bridge.int4 import activations
from bridge.native import enabled  # JAX_LLAMA_KERNELS=0 turns them off

from . import library
from .library import VARIANTS, NotBuilt, build, choose, cpu_flags, variant_for  # noqa: F401

log = logging.getLogger(__name__)

# The kernels serve up to this many rows (batch x new tokens); more go to XLA. With their sums in
# registers (matvec.cc's strips) they are ahead of XLA's float32 matmul at every batch up to 8:
# SmolLM2 float32 decode ran 209 against 141 tokens/s at batch 4, 326-368 against 214-231 at
# batch 8 (alternating runs, 2-core AMD EPYC).
MAX_ROWS = 8
# 4-bit weights are served up to this many rows (a short prompt's prefill, a chat turn's chunk of
# 64), 8 at a time with the weights' rows still in cache: XLA expands the whole weight to float32
# and multiplies that. SmolLM2's 35-token prefill ran in 0.12 s against 0.15-0.20 s, and its
# first run in 0.25 s against 1.0 s (XLA's first run of its dot fusions plans each of them; 2-core
# AMD EPYC Zen 4).
MAX_ROWS_INT4 = 64
# With bfloat16 activations (generation's default) and a library that multiplies bfloat16 pairs
# (AVX512_BF16: prompt_bf16), 4-bit weights meet this many rows or more through matvec.cc's prompt
# kernel ("jax_llama_prompt_int4_bf16"), however many: a 512-token prompt through LLaMA 3 8B's
# 4096 x 14336 weight took 200 ms against XLA's 390-430 ms, SmolLM2's 576 x 1536 3.6 against 6.0-7.4
# ms; from 32 rows it is ahead of the decode kernel's chunks of 8 (SmolLM2 1.4-2.0x, LLaMA 3 8B's
# 1.5-1.7x at 64), behind it at 8 (0.5-0.8x). 2-core AMD EPYC Zen 4, scripts/prompt_int4.py.
# int8 weights (one scale an output) too, from this many rows ("jax_llama_prompt_int8_bf16"):
# LLaMA 3 8B's shapes 1.7-1.8x XLA's float32 product (about 300 against 178 GFLOP/s), SmolLM2's
# 1.1-2.6x (scripts/prompt_int4.py --weights int8, the same CPU).
PROMPT_ROWS = 32
TARGETS = {"jax_llama_matvec_f32": "JaxLlamaMatvecF32",
           "jax_llama_matvec_int8": "JaxLlamaMatvecInt8",
           "jax_llama_matvec_int4": "JaxLlamaMatvecInt4",
           "jax_llama_matvec_int4_q8": "JaxLlamaMatvecInt4Q8",
           "jax_llama_matvec_int4_bf16": "JaxLlamaMatvecInt4Bf16",
           "jax_llama_prompt_int4_bf16": "JaxLlamaPromptInt4Bf16",
           "jax_llama_prompt_int8_bf16": "JaxLlamaPromptInt8Bf16",
           "jax_llama_matvec_int8_rows": "JaxLlamaMatvecInt8Rows",
           "jax_llama_matvec_f32_rows": "JaxLlamaMatvecF32Rows",
           "jax_llama_decode_attention": "JaxLlamaDecodeAttention"}


@functools.cache
def _load() -> tuple[str | None, Path | None]:
    """Load and register the library this CPU runs (library.choose), once a process: (None, its
    path) when done, else (why not, None). Nothing is compiled here."""
    if not enabled():
        return "off (JAX_LLAMA_KERNELS=0)", None
    try:
        variant, path = library.choose()
        lib = ctypes.cdll.LoadLibrary(str(path))
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: use XLA's matmul instead
        log.warning("jax_llama: decode kernels unavailable (%s); using XLA's matmul", e)
        return str(e), None
    log.debug("jax_llama: decode kernels %s (%s)", variant.name, path)
    return None, path


def lanes() -> int:
    """float32 lanes of the loaded kernels' vectors: 16 (AVX-512), 8 (AVX2 + FMA) or 1 (plain)."""
    _check()
    return ctypes.cdll.LoadLibrary(str(_load()[1])).jax_llama_matvec_lanes()


def prompt_bf16() -> bool:
    """Whether the loaded kernels multiply a prompt's bfloat16 activations by 4-bit or int8
    weights in bfloat16 pairs (built with AVX512_BF16: Zen 4, Zen 5, Sapphire Rapids)."""
    return unavailable_reason() is None and _prompt_bf16(_load()[1])


@functools.cache
def _prompt_bf16(path) -> bool:
    return bool(ctypes.cdll.LoadLibrary(str(path)).jax_llama_prompt_bf16())


def _prompt(x_MI) -> bool:
    """Whether matvec_int4 and matvec_int8 take x through a prompt kernel: PROMPT_ROWS rows or
    more, bfloat16 activations and a library that multiplies them in pairs."""
    return x_MI.shape[0] >= PROMPT_ROWS and activations() == "bfloat16" and prompt_bf16()


def unavailable_reason() -> str | None:
    """Why the kernels cannot run in this process (None when they can)."""
    if not enabled():
        return "off (JAX_LLAMA_KERNELS=0)"
    if jax.default_backend() != "cpu":
        return f"the backend is {jax.default_backend()}, not cpu"
    if jax.device_count() != 1:
        return f"{jax.device_count()} devices (the kernels run unsharded)"
    return _load()[0]


def usable(x_MI, w_IO, scale_GO=None, min_GO=None) -> bool:
    """Whether matvec serves this matmul: float32 x of at most MAX_ROWS rows, a 2-D float32 or
    int8 weight (I, O) (int8 with scales (G, O): a row per group of I / G inputs, G = 1 one
    scale per output column), or a 4-bit one stored a row per
    output (packed (O, I / 2) uint8 with scales (O, I / 32) and minima of the same shape and
    dtype, float16 or float32, or none: Q4_0's m = -8 scale; matvec_int4), and the kernels
    loadable here. 4-bit weights are served up to MAX_ROWS_INT4 rows; 4-bit and int8 ones any
    number from PROMPT_ROWS where their bfloat16 activations go through a prompt kernel
    (prompt_bf16; int8: groups of a multiple of 32 inputs)."""
    four = w_IO.dtype == jnp.uint8
    rows = MAX_ROWS_INT4 if four else MAX_ROWS
    if x_MI.ndim != 2 or x_MI.dtype != jnp.float32 or w_IO.ndim != 2:
        return False
    I = x_MI.shape[1]
    int8 = w_IO.dtype == jnp.int8 and scale_GO is not None and scale_GO.ndim == 2
    if x_MI.shape[0] > rows and not (
            (four or (int8 and I % scale_GO.shape[0] == 0 and I // scale_GO.shape[0] % 32 == 0))
            and _prompt(x_MI)):
        return False
    if four:
        I, O = x_MI.shape[1], w_IO.shape[0]
        ok = (scale_GO is not None and I % 32 == 0 and w_IO.shape[1] * 2 == I
              and scale_GO.dtype in (jnp.float16, jnp.float32) and scale_GO.shape == (O, I // 32)
              and (min_GO is None or (min_GO.dtype == scale_GO.dtype
                                      and min_GO.shape == scale_GO.shape)))
    elif min_GO is not None:
        ok = False
    elif scale_GO is None:
        ok = w_IO.dtype == jnp.float32
    else:  # int8: a row of scales per group of I / G inputs (G = 1: per output)
        ok = (int8 and scale_GO.shape[1] == w_IO.shape[1] and scale_GO.shape[0] > 0
              and I % scale_GO.shape[0] == 0)
    return ok and unavailable_reason() is None


def usable_rows(x_MI, q_OI, scale_OG=None) -> bool:
    """Whether matvec_rows serves this product: float32 x of at most MAX_ROWS rows, a 2-D q
    (O, I), float32 without scales or int8 with one scale per row (O, 1) or per group of I / G
    inputs (O, G; I / G a multiple of 16, whole vectors of every build), and the kernels
    loadable here."""
    if x_MI.ndim != 2 or x_MI.shape[0] > MAX_ROWS or x_MI.dtype != jnp.float32:
        return False
    if q_OI.ndim != 2 or x_MI.shape[1] != q_OI.shape[1]:
        return False
    if scale_OG is None:
        ok = q_OI.dtype == jnp.float32
    else:
        O, I = q_OI.shape
        G = scale_OG.shape[-1] if scale_OG.ndim == 2 else 0
        ok = (q_OI.dtype == jnp.int8 and tuple(scale_OG.shape) == (O, G) and G > 0
              and I % G == 0 and (G == 1 or (I // G) % 16 == 0))
    return ok and unavailable_reason() is None


def _f32_call(x_MI, ws_IO):
    outs = tuple(jax.ShapeDtypeStruct((x_MI.shape[0], w.shape[1]), jnp.float32) for w in ws_IO)
    return jax.ffi.ffi_call("jax_llama_matvec_f32", outs, vmap_method="sequential")(x_MI, *ws_IO)


def _int8_call(x_MI, qs_IO, scales_O, target="jax_llama_matvec_int8"):
    outs = tuple(jax.ShapeDtypeStruct((x_MI.shape[0], q.shape[1]), jnp.float32) for q in qs_IO)
    args = [a for pair in zip(qs_IO, scales_O) for a in pair]
    return jax.ffi.ffi_call(target, outs, vmap_method="sequential")(x_MI, *args)


def quantise_activations(x_MI):
    """x (..., I) as the 4-bit kernel with 8-bit activations takes it (matvec.cc's QuantiseQ8),
    dequantised: each group of 32 inputs to dx * round(x * (1 / dx)) (ties to even, within +-127),
    dx = max |x| * float32(1 / 127), 0 for a group of zeros; in x's dtype, computed in float32. Its
    gradient passes straight through (the identity), as the kernel's does."""
    shape = x_MI.shape
    xg = x_MI.astype(jnp.float32).reshape(*shape[:-1], shape[-1] // 32, 32)
    dx = jnp.max(jnp.abs(xg), axis=-1, keepdims=True) * jnp.float32(1 / 127)
    inv = jnp.where(dx > 0, 1 / jnp.where(dx > 0, dx, 1), 0)
    xq = jnp.clip(jnp.round(xg * inv), -127, 127) * dx
    xq = xq.reshape(shape).astype(x_MI.dtype)
    return jax.lax.stop_gradient(xq) + (x_MI - jax.lax.stop_gradient(x_MI))  # exactly xq


def round_to_bfloat16(x_MI):
    """x rounded to the nearest bfloat16 (ties to even), in x's dtype: how the 4-bit kernel with
    bfloat16 activations takes it (matvec.cc's RoundBf16). Its gradient passes straight through."""
    xb = x_MI.astype(jnp.bfloat16).astype(x_MI.dtype)
    return jax.lax.stop_gradient(xb) + (x_MI - jax.lax.stop_gradient(x_MI))  # exactly xb


def _int4_call(x_MI, weights, target="jax_llama_matvec_int4"):
    outs = tuple(jax.ShapeDtypeStruct((x_MI.shape[0], q.shape[0]), jnp.float32)
                 for q, _, _ in weights)
    # no minima (m = -8 scale): an empty array of the scales' dtype says so
    args = [a for q, d, m in weights
            for a in (q, d, jnp.zeros((0,), d.dtype) if m is None else m)]
    return jax.ffi.ffi_call(target, outs, vmap_method="sequential")(x_MI, *args)


@jax.custom_vjp
def _matvec_f32(x_MI, ws_IO):
    return _f32_call(x_MI, ws_IO)


def _f32_fwd(x_MI, ws_IO):
    return _f32_call(x_MI, ws_IO), (x_MI, ws_IO)


def _f32_bwd(res, gs_MO):
    x_MI, ws_IO = res
    dx_MI = sum(g_MO @ w_IO.T for g_MO, w_IO in zip(gs_MO, ws_IO))
    return dx_MI, tuple(x_MI.T @ g_MO for g_MO in gs_MO)


_matvec_f32.defvjp(_f32_fwd, _f32_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matvec_int8(x_MI, qs_IO, scales_O, target):
    return _int8_call(x_MI, qs_IO, scales_O, target)


def _int8_fwd(x_MI, qs_IO, scales_O, target):
    return _int8_call(x_MI, qs_IO, scales_O, target), (qs_IO, scales_O)


def _int8_bwd(target, res, gs_MO):
    qs_IO, scales_O = res  # int8 weights and their scales are constants: no cotangent
    dx_MI = sum(g_MO @ dequantize_int8(q_IO, s.reshape(-1, q_IO.shape[1])).T
                for g_MO, q_IO, s in zip(gs_MO, qs_IO, scales_O))
    return dx_MI, None, None


_matvec_int8.defvjp(_int8_fwd, _int8_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matvec_int4(x_MI, weights, target):
    return _int4_call(x_MI, weights, target)


def _int4_fwd(x_MI, weights, target):
    return _int4_call(x_MI, weights, target), weights


def _int4_bwd(target, weights, gs_MO):
    # the weights are constants: no cotangent; x's 8-bit rounding (int4_q8) passes the gradient
    # straight through
    dx_MI = sum(g_MO @ dequantize_int4(*w, jnp.float32) for g_MO, w in zip(gs_MO, weights))
    return dx_MI, jax.tree.map(lambda _: None, weights)


_matvec_int4.defvjp(_int4_fwd, _int4_bwd)


def _rows_call(x_MI, q_OI, scale_O):
    out = jax.ShapeDtypeStruct((x_MI.shape[0], q_OI.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("jax_llama_matvec_int8_rows", out, vmap_method="sequential")(
        x_MI, q_OI, scale_O)


@jax.custom_vjp
def _matvec_rows(x_MI, q_OI, scale_O):
    return _rows_call(x_MI, q_OI, scale_O)


def _rows_fwd(x_MI, q_OI, scale_O):
    return _rows_call(x_MI, q_OI, scale_O), (q_OI, scale_O)


def _rows_bwd(res, g_MO):
    q_OI, scale = res  # constants, as in _int8_bwd; scale (O * G,) flattened from (O, G)
    return g_MO @ dequantize_int8(q_OI.T, scale.reshape(q_OI.shape[0], -1).T).T, None, None


_matvec_rows.defvjp(_rows_fwd, _rows_bwd)


def _f32_rows_call(x_MI, w_OI):
    out = jax.ShapeDtypeStruct((x_MI.shape[0], w_OI.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("jax_llama_matvec_f32_rows", out, vmap_method="sequential")(x_MI, w_OI)


@jax.custom_vjp
def _matvec_f32_rows(x_MI, w_OI):
    return _f32_rows_call(x_MI, w_OI)


def _f32_rows_fwd(x_MI, w_OI):
    return _f32_rows_call(x_MI, w_OI), (x_MI, w_OI)


def _f32_rows_bwd(res, g_MO):
    x_MI, w_OI = res
    return g_MO @ w_OI, g_MO.T @ x_MI


_matvec_f32_rows.defvjp(_f32_rows_fwd, _f32_rows_bwd)


def matvec(x_MI, w_IO, scale_GO=None):
    """x (M, I) float32 @ w (I, O) -> (M, O) float32; with int8 w and scales (G, O), x @ (w
    times each group's scales). Call only where `usable` said True."""
    if scale_GO is None:
        return matvec_f32(x_MI, [w_IO])[0]
    return matvec_int8(x_MI, [(w_IO, scale_GO)])[0]


def matvec_f32(x_MI, ws_IO):
    """[x @ w for each float32 w (I, O) of `ws_IO`]: projections that read the same x in one
    call, as matvec_int8. Call only where `usable` said True of each."""
    _check()
    return list(_matvec_f32(x_MI, tuple(ws_IO)))


def matvec_int8(x_MI, weights):
    """[x @ (q * scale) for each (q (I, O) int8, scale (G, O): a row per group of I / G inputs)
    of `weights`]: projections that read the same x (q, k and v; gate and up) in one call, their
    units shared by the same threads. With one scale an output (G = 1) each output's block sums
    are added and then scaled; with G > 1 each group's sums are scaled into the block's in
    input order.
    From PROMPT_ROWS rows of bfloat16 x' with AVX512_BF16 (_prompt), the prompt kernel
    ("jax_llama_prompt_int8_bf16": x' @ q * scale within float32 rounding, x' = x rounded to
    bfloat16, as the caller's activations rounded it already). Call only where `usable` said
    True of each."""
    _check()
    qs = tuple(q for q, _ in weights)
    scales = tuple(s.reshape(-1) for _, s in weights)
    target = "jax_llama_prompt_int8_bf16" if _prompt(x_MI) else "jax_llama_matvec_int8"
    return list(_matvec_int8(x_MI, qs, scales, target))


def dequantize_int8(q_IO, scale_GO):
    """The int8 weight (I, O) as float32: each group of I / G inputs times its row of scales
    (G, O) (G = 1: one scale an output; bridge.quantize's numbers)."""
    I, O = q_IO.shape
    G = scale_GO.shape[0]
    return (q_IO.reshape(G, I // G, O).astype(jnp.float32)
            * scale_GO.astype(jnp.float32)[:, None, :]).reshape(I, O)


def dequantize_int4(packed_OJ, scale_OG, min_OG, dtype):
    """The 4-bit weight (out, in) in `dtype`: q * scale + min in float32, rounded once
    (bridge.int4.dequantize_int4's numbers); min None: -8 scale (Q4_0's d (q - 8), exactly)."""
    O, J = packed_OJ.shape
    G = scale_OG.shape[1]
    q_OI = jnp.stack([packed_OJ & 0xF, packed_OJ >> 4], axis=-1).reshape(O, 2 * J)
    scale_OG = scale_OG.astype(jnp.float32)
    min_OG = -8 * scale_OG if min_OG is None else min_OG.astype(jnp.float32)
    w_OGi = (q_OI.reshape(O, G, 2 * J // G).astype(jnp.float32)
             * scale_OG[..., None] + min_OG[..., None])
    return w_OGi.reshape(O, 2 * J).astype(dtype)


def matvec_int4(x_MI, weights):
    """[x @ (q * scale + min)^T for each 4-bit (packed (O, I / 2) uint8, scale (O, I / 32), min
    (O, I / 32), or None: -8 scale, Q4_0's form, its bytes not read) of `weights`]: each output
    a dot product over a row read whole, the weights expanded in registers (AVX-512: looked up
    in a table of the group's 16 values; AVX2 and plain C++: matvec_rows' numbers on the
    dequantised float32 weights, bit for bit), within
    float32 rounding of the product on the dequantised weights. Weights that read the same x are
    one call. With JAX_LLAMA_INT4_ACTIVATIONS=int8 (bridge.int4.activations), x is first quantised
    per group of 32 inputs to 8 bits and each group summed as integers (matvec.cc,
    "jax_llama_matvec_int4_q8"): x' @ W^T within float32 rounding, x' the dequantised x. With
    bfloat16, x' is x rounded to bfloat16 (round_to_bfloat16), multiplied in bfloat16 pairs where
    the CPU has AVX512_BF16 ("jax_llama_matvec_int4_bf16"); with AVX2 alone, d (x' . q) + m sum x'
    group by group, each product x' q exact in float32. From PROMPT_ROWS rows of bfloat16 x'
    with AVX512_BF16, the prompt kernel ("jax_llama_prompt_int4_bf16": x' @ W^T within float32
    rounding, each group's exact products summed apart and scaled into the output in input
    order). Call only where `usable` said True of each."""
    _check()
    target = {"float32": "jax_llama_matvec_int4", "int8": "jax_llama_matvec_int4_q8",
              "bfloat16": "jax_llama_matvec_int4_bf16"}[activations()]
    if _prompt(x_MI):
        target = "jax_llama_prompt_int4_bf16"
    return list(_matvec_int4(x_MI, tuple(tuple(w) for w in weights), target))


def matvec_rows(x_MI, q_OI, scale_OG=None):
    """x (M, I) float32 @ q.T -> (M, O) float32 for q (O, I) float32, or int8 times its scales
    (O, 1), or (O, G): each group's lanes summed apart and scaled into the row's: each output a
    dot product over a row of q (a tied LM head: the embedding table). Call only where
    `usable_rows` said True."""
    _check()
    if scale_OG is None:
        return _matvec_f32_rows(x_MI, q_OI)
    return _matvec_rows(x_MI, q_OI, scale_OG.reshape(-1).astype(jnp.float32))


def usable_attention(q_BKGSH, k_LBKTH, mask) -> bool:
    """Whether attend_cache serves this attention over a cache: float32 queries and cache, at most
    MAX_ROWS rows times new tokens, a mask without segments, and the kernels loadable here."""
    if q_BKGSH.ndim != 5 or k_LBKTH.ndim != 5:
        return False
    B, S = q_BKGSH.shape[0], q_BKGSH.shape[3]
    folded = S == 1 or (mask.window is None and mask.k_slots is None)  # see attend_cache
    return (B * S <= MAX_ROWS and q_BKGSH.dtype == jnp.float32 and k_LBKTH.dtype == jnp.float32
            and mask.q_segments is None and folded and unavailable_reason() is None)


def _attention_reference(q_BKGSH, k_LBKTH, v_LBKTH, layer, q_slots_S, valid_BT):
    from ..attention import AttentionMask, attend  # the model's own xla attention
    k_BKTH = jax.lax.dynamic_index_in_dim(k_LBKTH, layer, keepdims=False)
    v_BKTH = jax.lax.dynamic_index_in_dim(v_LBKTH, layer, keepdims=False)
    return attend(q_BKGSH, k_BKTH, v_BKTH, AttentionMask(q_slots=q_slots_S, valid=valid_BT), "xla")


def _attention_call(q_BKGSH, k_LBKTH, v_LBKTH, layer, q_slots_S, valid_BT):
    out = jax.ShapeDtypeStruct(q_BKGSH.shape, jnp.float32)
    return jax.ffi.ffi_call("jax_llama_decode_attention", out, vmap_method="sequential")(
        q_BKGSH, k_LBKTH, v_LBKTH, layer, q_slots_S, valid_BT)


@jax.custom_vjp
def _attend_cache(q_BKGSH, k_LBKTH, v_LBKTH, layer, q_slots_S, valid_BT):
    return _attention_call(q_BKGSH, k_LBKTH, v_LBKTH, layer, q_slots_S, valid_BT)


def _attention_fwd(*args):
    return _attention_call(*args), args


def _attention_bwd(args, g):
    q, k, v, layer, q_slots, valid = args
    _, pullback = jax.vjp(lambda q, k, v: _attention_reference(q, k, v, layer, q_slots, valid),
                          q, k, v)
    return (*pullback(g), None, None, None)


_attend_cache.defvjp(_attention_fwd, _attention_bwd)


def attend_cache(q_BKGSH, k_LBKTH, v_LBKTH, layer, mask):
    """softmax(q k^T / sqrt(H) + mask) v over layer `layer` of a KV cache, read in place: q
    (B, K, G, S, H), caches (L, B, K, T, H) -> (B, K, G, S, H) float32, as
    jax_llama.model.attention.attend(..., "xla") on the layer's slice to float32 rounding (its
    gradient is that function's). Call only where `usable_attention` said True."""
    _check()
    B, T = q_BKGSH.shape[0], k_LBKTH.shape[3]
    q_slots_S = mask.q_slots
    if mask.window is not None or mask.k_slots is not None:
        # The kernel knows causality and valid slots only. One query's whole mask is one row of
        # valid slots, the window's and a rolling cache's order folded in: the kernel then reads
        # up to the query's own slot, or every entry of a rolling cache.
        valid_BT = jnp.broadcast_to(mask.dense(T)[:, 0], (B, T))
        q_slots_S = q_slots_S if mask.k_slots is None else jnp.full((1,), T - 1, jnp.int32)
    else:
        valid_BT = (jnp.ones((B, T), bool) if mask.valid is None
                    else jnp.broadcast_to(mask.valid, (B, T)))
    return _attend_cache(q_BKGSH, k_LBKTH, v_LBKTH, jnp.asarray(layer, jnp.int32),
                         q_slots_S.astype(jnp.int32), valid_BT)


def _check():
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"jax_llama.model.kernels: {reason}")
