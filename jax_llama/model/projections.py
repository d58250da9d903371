"""How the model's projections, its embedding and its attention over the KV cache run: float,
int8 or 4-bit weights, a LoRA adapter, XLA or the CPU decode kernels.

jax_llama.model.llama says what the LLaMA computes; this module is the implementation it is handed,
one `Projections` (the field `Llama.projections`), made by one function, `choose(kernels, lora)`:

    kernels  auto     the decode kernels (jax_llama.model.kernels) wherever they serve the shapes -
                      up to 8 float32 rows on a single CPU device, float32, int8 or 4-bit weights -
                      else XLA. What every command ran before the choice had a name;
                      JAX_LLAMA_KERNELS=0 makes it xla.
             xla      XLA's matmuls and jax_llama.model.attention.attend only.
             kernels  as auto, but a model whose kernels cannot run here is refused (the reason
                      named).
    lora     a LoRA adapter (bridge.lora.LoraConfig) on the projections it targets, or None;
             jax_llama.lora adds, saves and merges adapters and hands the model the choice.

Both kernels choices give the same numbers to float32 rounding (the kernels' sums run in another
order), and the same greedy tokens (tests/test_kernels.py decodes both ways). `implementation`
is the one place that turns the choice into "kernels" or "xla" - from the backend, the device
count and JAX_LLAMA_KERNELS - when a model is made (init, load) and while it traces; whether one
call is served (its rows, dtypes, shapes) jax_llama.model.kernels' `usable` says.

Storage is what a projection's params say: a `scale` beside the `kernel` (or the tied embedding)
means int8 weights (jax_llama.quantize), multiplied by int8_matmul or by the kernels; a uint8
`kernel` with `scale` (and `min`) means 4-bit weights (bridge.int4), multiplied by int4_matmul or
by the kernels. The model names none of this: the params it is given decide.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bridge.errors import BridgeError
from bridge.int4 import activations
from bridge.lora import LoraConfig

from . import kernels as decode_kernels
from .kernels import dequantize_int4, dequantize_int8
from .attention import AttentionMask, attend
from .attention import choose as choose_attention

log = logging.getLogger(__name__)
Dtype = Any

KERNELS = ("auto", "xla", "kernels")


def implementation(kernels: str = "auto") -> str:
    """The implementation a model with `kernels` (auto, xla or kernels) runs its decode steps on:
    "kernels" or "xla". auto is "kernels" where they can run in this process (a single CPU device,
    the kernels built for this CPU by `jax-llama kernels build`, JAX_LLAMA_KERNELS not 0), else
    "xla"; "kernels" where they cannot raises BridgeError naming why. Nothing is compiled here:
    where none is built, why is logged once (jax_llama.model.kernels)."""
    if kernels not in KERNELS:
        raise BridgeError(f"{kernels!r}: expected one of {', '.join(KERNELS)}", field="kernels")
    if kernels == "xla":
        return "xla"
    reason = decode_kernels.unavailable_reason()
    if reason is None:
        return "kernels"
    if kernels == "kernels":
        raise BridgeError(f"the decode kernels cannot run here: {reason}", field="kernels")
    return "xla"


def _kernels_on(kernels: str) -> bool:
    """Whether a module with this choice may call the kernels (each call still asks `usable`)."""
    return implementation(kernels) == "kernels"


class Linear(nn.Module):
    """A bias-free projection x @ kernel (LLaMA has no biases), kernel (in, out) in param_dtype;
    or, when its params also hold a `scale` (jax_llama.quantize), an int8 kernel and float32
    scales (G, out), multiplied by int8_matmul. A few float32 rows on CPU (decoding) go through
    jax_llama.model.kernels instead when `kernels` allows, float32 or int8 (the same numbers to
    float32 rounding).

    With `lora`, a low-rank adapter is added: x @ kernel + scale * dropout(x) @ A @ B, with A
    (in, r) and B (r, out) in float32 whatever the kernel's dtype (`lora_A/kernel`,
    `lora_B/kernel`: the canonical `lora_A.weight` and `lora_B.weight` transposed). A starts
    Kaiming-uniform as PEFT starts it, B at zero, so a fresh adapter changes nothing. Dropout
    applies when the call is given a 'dropout' rng (training) and lora.dropout > 0."""

    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Any = nn.initializers.normal(0.02)
    lora: LoraConfig | None = None
    kernels: str = "auto"

    @nn.compact
    def __call__(self, x_MD):
        x_MD = x_MD.astype(self.dtype)
        four = self.has_variable("params", "kernel") and \
            self.get_variable("params", "kernel").dtype == jnp.uint8
        if four:  # 4-bit weights, (out, in / 2); no `min`: Q4_0's -8 scale
            kernel, scale, low = (self.get_variable("params", n) for n in ("kernel", "scale", "min"))
            if _kernels_on(self.kernels) and decode_kernels.usable(x_MD, kernel, scale, low):
                out = decode_kernels.matvec_int4(x_MD, [(kernel, scale, low)])[0]
            else:
                out = int4_matmul(x_MD, kernel, scale, low, self.dtype)
        elif self.has_variable("params", "scale"):  # int8 weights (jax_llama.quantize)
            kernel, scale = (self.get_variable("params", n) for n in ("kernel", "scale"))
            x_q = int8_input(x_MD)  # the adapter below takes x as it is, in both twins
            if _kernels_on(self.kernels) and decode_kernels.usable(x_q, kernel, scale):
                out = decode_kernels.matvec(x_q, kernel, scale).astype(self.dtype)
            else:
                out = int8_matmul(x_q, kernel, scale, self.dtype)
        else:
            kernel = self.param("kernel", self.kernel_init, (x_MD.shape[-1], self.features),
                                self.param_dtype)
            if _kernels_on(self.kernels) and decode_kernels.usable(x_MD, kernel):
                out = decode_kernels.matvec(x_MD, kernel)  # float32, a few rows on CPU
            else:
                out = jnp.dot(x_MD, kernel.astype(self.dtype))
        if self.lora is None:
            return out
        r = self.lora.rank
        # U(-1/sqrt(in), 1/sqrt(in)): torch's kaiming_uniform_(a=sqrt(5)), PEFT's init of A
        a = nn.Dense(r, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32,
                     kernel_init=nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
                     name="lora_A")
        b = nn.Dense(self.features, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32,
                     kernel_init=nn.initializers.zeros, name="lora_B")
        if self.lora.dropout > 0 and self.has_rng("dropout"):
            x_MD = nn.Dropout(self.lora.dropout, deterministic=False)(x_MD)
        return out + b(a(x_MD)) * jnp.asarray(self.lora.scale, self.dtype)


@dataclasses.dataclass(frozen=True)
class Projections:
    """How a model runs its projections x @ W, its embedding and its attention over the KV cache:
    the one object jax_llama.model.llama is handed for them (`Llama.projections`), made by
    `choose`. kernels: auto, xla or kernels (the module docstring); lora: a LoRA adapter on the
    projections lora.targets names (bridge.lora.LoraConfig), or None."""

    kernels: str = "auto"
    lora: LoraConfig | None = None

    def replace(self, **changes) -> Projections:
        """These projections with `changes` (kernels=, lora=)."""
        return dataclasses.replace(self, **changes)

    def project(self, module: nn.Module, x_MD, kernel_init, **features: int) -> list[jax.Array]:
        """[x @ W for each projection named in `features` (name=outputs)], all reading the same
        x (q, k, v; gate, up; or one alone), as Linears named so under `module`, in its dtypes
        (initialised by kernel_init), with an adapter where lora targets one. Ones without
        adapters that the decode kernels serve (kernels allowing; a few rows on CPU, all float32,
        all int8 or all 4-bit) are one kernel call, their weights read by the same threads (the
        same numbers to float32 rounding)."""
        params = [module.variables.get("params", {}).get(name, {}) for name in features]
        weights = [(p.get("kernel"), p.get("scale"), p.get("min")) for p in params]
        lora = self.lora
        adapted = lora is not None and any(n in lora.targets for n in features)
        x = x_MD.astype(module.dtype)
        if (not adapted and _kernels_on(self.kernels)
                and all(w[0] is not None and decode_kernels.usable(x, *w) for w in weights)):
            if all(s is None for _, s, _ in weights):
                return decode_kernels.matvec_f32(x, [w for w, _, _ in weights])
            if all(w.dtype == jnp.int8 for w, _, _ in weights):
                return [y.astype(module.dtype) for y in decode_kernels.matvec_int8(
                    int8_input(x), [(w, s) for w, s, _ in weights])]
            if all(w.dtype == jnp.uint8 for w, _, _ in weights):  # 4-bit, with minima or not
                return decode_kernels.matvec_int4(x, weights)
        return [Linear(f, dtype=module.dtype, param_dtype=module.param_dtype,
                       kernel_init=kernel_init,
                       lora=lora if lora is not None and name in lora.targets else None,
                       kernels=self.kernels, name=name)(x_MD)
                for name, f in features.items()]

    def attend_cache(self, module: nn.Module, q_BKGSH, k_LBKTH, v_LBKTH, layer,
                     mask: AttentionMask):
        """The queries' attention over layer `layer` of the cache (L, B, K, T, H), in module's
        `attention` implementation and dtype. A few float32 queries on a CPU, where `attention`
        means xla and kernels allows, are one kernel call that reads the layer in place
        (jax_llama.model.kernels.attend_cache: XLA ran a dozen small operations a layer); else
        the layer's slice goes through jax_llama.model.attention.attend."""
        S, T, H = q_BKGSH.shape[3], k_LBKTH.shape[3], q_BKGSH.shape[4]
        if (_kernels_on(self.kernels)
                and choose_attention(module.attention, S, T, False, H) == "xla"
                and decode_kernels.usable_attention(q_BKGSH, k_LBKTH, mask)):
            return decode_kernels.attend_cache(q_BKGSH, k_LBKTH, v_LBKTH, layer, mask)
        k_BKTH = jax.lax.dynamic_index_in_dim(k_LBKTH, layer, keepdims=False)
        v_BKTH = jax.lax.dynamic_index_in_dim(v_LBKTH, layer, keepdims=False)
        return attend(q_BKGSH, k_BKTH.astype(module.dtype), v_BKTH.astype(module.dtype), mask,
                      module.attention)

    def embedding(self, vocab_size: int, dim: int, **kw) -> Embed:
        """The token embedding (vocab_size, dim) and tied LM head (Embed; kw: nn.Embed's)."""
        return Embed(vocab_size, dim, **kw, kernels=self.kernels)


def choose(kernels: str = "auto", lora: LoraConfig | None = None) -> Projections:
    """The Projections a model is handed: how its decode steps run (`kernels`: auto, xla or
    kernels; one that cannot run here refused as `implementation` refuses it) and the LoRA
    adapter its projections carry (None: none). jax_llama.init, jax_llama.load and
    jax_llama.lora.add_lora choose through it."""
    implementation(kernels)
    return Projections(kernels, lora)


class Embed(nn.Embed):
    """The token embedding `embedding` (vocab, dim): nn.Embed's lookup, and its `attend` (x @
    embedding^T) as the LM head of a tied model. When its params also hold a `scale` (vocab, G)
    (jax_llama.quantize of a tied model), the table is int8: a token's row is Q[t] * s[t] in
    float32, rounded once to dtype (bridge.quantize.dequantize_weight's numbers), and the head
    multiplies by Q as an int8 Linear does. For a few rows on CPU either head goes through the
    decode kernels' matvec_rows when `kernels` allows."""

    kernels: str = "auto"

    def setup(self):
        super().setup()
        self.scale_VG = self.get_variable("params", "scale")  # None: a float table

    def __call__(self, tokens):
        if self.scale_VG is None:
            return super().__call__(tokens)
        q_D, s_G = jnp.take(self.embedding, tokens, axis=0), jnp.take(self.scale_VG, tokens, axis=0)
        rows = q_D.reshape(*q_D.shape[:-1], s_G.shape[-1], -1).astype(jnp.float32) * s_G[..., None]
        return rows.reshape(q_D.shape).astype(self.dtype)

    def attend(self, x_MD):
        x_MD = x_MD.astype(self.dtype)
        on = _kernels_on(self.kernels)
        if self.scale_VG is None:
            if on and decode_kernels.usable_rows(x_MD, self.embedding):  # float32, a few rows
                return decode_kernels.matvec_rows(x_MD, self.embedding)
            return super().attend(x_MD)
        if on and decode_kernels.usable_rows(x_MD, self.embedding, self.scale_VG):
            return decode_kernels.matvec_rows(x_MD, self.embedding, self.scale_VG).astype(
                self.dtype)
        return int8_matmul(x_MD, self.embedding.T, self.scale_VG.T, self.dtype)


def int8_input(x_MI):
    """x as an int8 projection takes it: rounded to bfloat16 where the activations chosen are
    bfloat16 (bridge.int4.activations: generation's default), so that a prompt's rows can meet
    the weights in bfloat16 pairs (jax_llama.model.kernels' prompt kernel) and its decode steps
    take the same x'; as it is otherwise (8-bit activations are the 4-bit kernels' alone). The
    tied LM head (Embed.attend) takes x as it is. torch_llama.projections.Linear's twin."""
    return decode_kernels.round_to_bfloat16(x_MI) if activations() == "bfloat16" else x_MI


def int8_matmul(x_MI, q_IO, scale_GO, dtype):
    """x @ (Q * s) for int8 Q (in, out) and float32 scales s (G, out), one row of scales per G
    groups of in / G consecutive inputs (bridge.quantize). Per channel (G = 1) the scale
    multiplies the output, (x @ Q) * s, so the int8 weights are never scaled element by element;
    group-wise, each group's weights are dequantised in float32 and rounded once to `dtype`.
    torch_llama.projections.int8_linear computes the same, in the same order."""
    G = scale_GO.shape[0]
    I, O = q_IO.shape
    K = math.gcd(I, INT8_BLOCK_ROWS)  # rows per block: 64, or fewer where 64 does not divide I
    # by blocks on a CPU only: on a GPU each block would be a kernel of its own, per token
    if G == 1 and K >= INT8_BLOCK_ROWS // 4 and I > K and jax.default_backend() == "cpu":
        if math.prod(x_MI.shape[:-1]) >= INT8_COLUMN_ROWS:  # a prompt, a training batch
            return _int8_columns_matmul(x_MI, q_IO, scale_GO, K, dtype)
        return _int8_blocks_matmul(x_MI, q_IO, scale_GO, K, dtype)
    # The weight is made to depend on x, so that it is dequantised only once x exists, right
    # before its matmul. Independent of x it is a constant of any loop around the model (the
    # decode loop) and XLA hoists its conversion out of the loop, or schedules every weight's
    # conversion first: either way a float copy of every weight lives beside the int8 one, more
    # memory than the float model. (An optimization barrier does not hold on XLA:CPU: it is
    # expanded away before scheduling.) Where x[0, 0] is NaN, the output is NaN either way.
    q_IO = jnp.where(jnp.isnan(x_MI[0, 0]), jnp.zeros((), q_IO.dtype), q_IO)
    if G == 1:
        return jnp.dot(x_MI, q_IO.astype(dtype)) * scale_GO[0].astype(dtype)
    return jnp.dot(x_MI, dequantize_int8(q_IO, scale_GO).astype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def int4_matmul(x_MI, packed_OJ, scale_OG, min_OG, dtype):
    """x @ W^T for 4-bit W (bridge.int4), stored as its canonical rows (not transposed as float
    kernels are): packed (out, in / 2) uint8, two weights a byte along the inputs, and scales and
    minima (out, in / 32) (min None: -8 scale, Q4_0's form). W = q * scale + min is dequantised in
    float32, right before its matmul (made to depend on x, as int8_matmul's is, so that no float
    copy of every weight is hoisted out of the decode loop), and rounded once to `dtype`.

    Its gradient (a LoRA adapter trained on a 4-bit base, QLoRA) dequantises W again rather than
    keeping the forward's float copy for the backward pass: what is saved is the 4-bit weight
    itself, so training holds no float copy of the base. The 4-bit weights are constants: no
    gradient flows to them.

    With JAX_LLAMA_INT4_ACTIVATIONS=int8, x is first rounded to 8 bits per group of 32 inputs
    as the decode kernel rounds it (decode_kernels.quantise_activations); with bfloat16, to
    bfloat16 (decode_kernels.round_to_bfloat16): on the same x, the same products to float32
    rounding."""
    return _int4_dot(x_MI, packed_OJ, scale_OG, min_OG, dtype)


def _int4_dot(x_MI, packed_OJ, scale_OG, min_OG, dtype):
    if activations() == "int8":  # its gradient: straight through (_int4_bwd)
        x_MI = decode_kernels.quantise_activations(x_MI)
    elif activations() == "bfloat16":
        x_MI = decode_kernels.round_to_bfloat16(x_MI)
    packed_OJ = jnp.where(jnp.isnan(x_MI[0, 0]), jnp.zeros((), packed_OJ.dtype), packed_OJ)
    return jnp.dot(x_MI, dequantize_int4(packed_OJ, scale_OG, min_OG, dtype).T)


def _int4_fwd(x_MI, packed_OJ, scale_OG, min_OG, dtype):
    return _int4_dot(x_MI, packed_OJ, scale_OG, min_OG, dtype), (packed_OJ, scale_OG, min_OG)


def _int4_bwd(dtype, saved, g_MO):
    packed_OJ, scale_OG, min_OG = saved
    packed_OJ = jnp.where(jnp.isnan(g_MO.ravel()[0]), jnp.zeros((), packed_OJ.dtype), packed_OJ)
    dx_MI = jnp.dot(g_MO, dequantize_int4(packed_OJ, scale_OG, min_OG, dtype))
    return dx_MI, None, None, None


int4_matmul.defvjp(_int4_fwd, _int4_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _int8_blocks_matmul(x_MI, q_IO, scale_GO, K: int, dtype):
    """(x @ Q) * s by blocks of K rows of Q (_int8_dot_by_blocks). Its gradient converts Q by
    blocks again, as the forward does, rather than keeping each block's float copy for the
    backward pass (XLA's gradient of the loop would: a float copy of the whole weight, 2 GB for
    LLaMA 3 8B's int8 LM head); Q and its scales are constants, with no gradient."""
    return _int8_dot_by_blocks(x_MI, q_IO, K, dtype).astype(dtype) * scale_GO[0].astype(dtype)


def _int8_blocks_fwd(x_MI, q_IO, scale_GO, K, dtype):
    return _int8_blocks_matmul(x_MI, q_IO, scale_GO, K, dtype), (q_IO, scale_GO)


def _int8_blocks_bwd(K, dtype, saved, g_MO):
    q_IO, scale_GO = saved
    I = q_IO.shape[0]
    gs_MO = g_MO.astype(jnp.float32) * scale_GO[0]

    def block(i, dx_MI):
        q_KO = jax.lax.dynamic_slice_in_dim(q_IO, i * K, K, axis=0).astype(jnp.float32)
        dx_MK = jnp.dot(gs_MO, q_KO.T).astype(dx_MI.dtype)
        return jax.lax.dynamic_update_slice_in_dim(dx_MI, dx_MK, i * K, axis=dx_MI.ndim - 1)

    dx_MI = jax.lax.fori_loop(0, I // K, block, jnp.zeros((*g_MO.shape[:-1], I), g_MO.dtype))
    return dx_MI, None, None


_int8_blocks_matmul.defvjp(_int8_blocks_fwd, _int8_blocks_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _int8_columns_matmul(x_MI, q_IO, scale_GO, K: int, dtype):
    """(x @ Q) * s for many rows of x (a prompt, a training batch) by blocks of Q's columns
    (_int8_dot_by_columns); its gradient is _int8_blocks_matmul's (Q converted by blocks of K
    rows again, no float copy kept)."""
    return _int8_dot_by_columns(x_MI, q_IO, scale_GO, dtype)


def _int8_columns_fwd(x_MI, q_IO, scale_GO, K, dtype):
    return _int8_columns_matmul(x_MI, q_IO, scale_GO, K, dtype), (q_IO, scale_GO)


_int8_columns_matmul.defvjp(_int8_columns_fwd, _int8_blocks_bwd)


# Rows of an int8 weight converted at a time by _int8_dot_by_blocks (at most).
INT8_BLOCK_ROWS = 64
# From this many rows of x, an int8 weight is multiplied by blocks of its columns
# (_int8_dot_by_columns): with many rows, the block loop's accumulator (rows x out, float32) is
# read and written again for each of in / 64 blocks, and each product is only 64 deep - a
# 512-token prompt through SmolLM2's int8 head rewrote 100 MB nine times.
INT8_COLUMN_ROWS = 32
# Bytes of float weights a column block converts at a time (its columns: this over 4 x in).
INT8_COLUMN_BYTES = 8 << 20


def _int8_dot_by_columns(x_MI, q_IO, scale_GO, dtype):
    """(x @ Q.astype(dtype)) * s, C columns of Q at a time in a loop: each block converted
    (I x C floats, about INT8_COLUMN_BYTES, in cache), multiplied over the whole depth of x and
    written once into its columns of the output. The last block starts earlier where C does not
    divide out, overlapping the one before it with the same numbers. Its conversion depends on
    the loop index: no float copy of the whole weight exists, none is hoisted out of a loop."""
    I, O = q_IO.shape
    C = min(O, max(128, INT8_COLUMN_BYTES // (4 * I) // 128 * 128))
    n = -(-O // C)
    s_O = scale_GO[0].astype(dtype)

    def block(i, out_MO):
        start = jnp.minimum(i * C, O - C)
        q_IC = jax.lax.dynamic_slice_in_dim(q_IO, start, C, axis=1).astype(dtype)
        s_C = jax.lax.dynamic_slice_in_dim(s_O, start, C)
        y_MC = jnp.dot(x_MI, q_IC, preferred_element_type=jnp.float32).astype(dtype) * s_C
        return jax.lax.dynamic_update_slice_in_dim(out_MO, y_MC, start, axis=out_MO.ndim - 1)

    return jax.lax.fori_loop(0, n, block, jnp.zeros((*x_MI.shape[:-1], O), dtype))


def _int8_dot_by_blocks(x_MI, q_IO, K: int, dtype):
    """x @ Q.astype(dtype), converting K rows of Q at a time in a loop, each block's
    product added to the output. XLA:CPU does not fuse an int8 -> float conversion into a
    matmul: converted whole, Q's float copy is written to memory and read back, 8 bytes of traffic
    a weight beside the int8 byte, slower than the float32 model (results/decode/int8_matmul.md). A block
    of 64 rows stays in cache. Its conversion depends on the loop index, so XLA cannot hoist it
    out of the decode loop either: only one block's float copy exists at a time. The products
    are summed in float32 (bfloat16 too), as one matmul accumulates."""
    I, O = q_IO.shape

    def add_block(i, acc_MO):
        q_KO = jax.lax.dynamic_slice_in_dim(q_IO, i * K, K, axis=0).astype(dtype)
        x_MK = jax.lax.dynamic_slice_in_dim(x_MI, i * K, K, axis=x_MI.ndim - 1)
        return acc_MO + jnp.dot(x_MK, q_KO, preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(0, I // K, add_block,
                             jnp.zeros((*x_MI.shape[:-1], O), jnp.float32))
