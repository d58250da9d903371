"""The decode kernels (jax_llama.model.kernels): few-row matmuls on XLA:CPU through the XLA FFI.

Each output is a float32 sum over the inputs (in blocks of 64, the blocks' sums added in order;
for the rows kernel, vector lanes added by a fixed tree), so the kernels are checked against a
float64 product within the float32 rounding of a sequential sum, a bound that also holds for the
blocked and lane-wise ones (|error| <= I * eps32 * sum |x * w|); a kernel
that drops the int8 scale or reads a wrong column fails it (the negative cases). In the model
they must change nothing but rounding: decoding gives the same tokens with and without them."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llama.model import kernels



@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    """The kernels are on unless JAX_LLAMA_KERNELS=0; on for these tests whatever the caller set.
    They are skipped where they cannot run (no C++ compiler to build them, another backend), but
    a compiler that refuses the source is a failure: a build broken for one instruction set (as
    AVX-512 without BF16 once was) would otherwise pass as a row of skips. conftest's
    decode_kernels_built has built them; this asks again for this CPU's variant (at once when
    built) to name the compiler's error."""
    monkeypatch.setenv("JAX_LLAMA_KERNELS", "1")
    if kernels.library.compiler() is not None:
        why = kernels.build([kernels.variant_for(kernels.cpu_flags())])
        failed = [f"{name}: {reason}" for name, reason in why.items() if reason]
        if failed:
            pytest.fail(f"the kernels did not compile: {failed[0]}")
    reason = kernels.unavailable_reason()
    if reason is not None:
        pytest.skip(f"kernels unavailable: {reason}")

EPS32 = float(np.finfo(np.float32).eps)


def bound(x, w, scale=None):
    """The float32 rounding bound of a sequential sum: I * eps * sum |x_i w_io| (times |scale|)."""
    mag = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64))
    if scale is not None:
        mag = mag * np.abs(scale.astype(np.float64))
    return x.shape[1] * EPS32 * mag + 1e-30


# SmolLM2's projections, odd sizes (vector tails), and 2048 x 2048 (4 MB of int8): sizes past
# the 64 KB from which a call shares its work with the helper threads, and below it
SHAPES = [(1, 576, 576), (1, 576, 192), (2, 96, 1536), (3, 1536, 72), (4, 64, 40), (5, 17, 13),
          (7, 128, 200), (8, 256, 64), (2, 2048, 2048)]


@pytest.mark.parametrize("M,I,O", SHAPES)
def test_float32_matvec_equals_the_product_to_float32_rounding(M, I, O):
    rng = np.random.default_rng(M * 1000 + O)
    x = rng.standard_normal((M, I)).astype(np.float32)
    w = rng.standard_normal((I, O)).astype(np.float32)
    got = np.asarray(jax.jit(kernels.matvec)(x, w), np.float64)
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert np.all(np.abs(got - want) <= bound(x, w))


@pytest.mark.parametrize("M,I,O", SHAPES)
def test_int8_matvec_equals_the_scaled_product_to_float32_rounding(M, I, O):
    rng = np.random.default_rng(M * 1000 + O + 1)
    x = rng.standard_normal((M, I)).astype(np.float32)
    q = rng.integers(-127, 128, (I, O)).astype(np.int8)
    scale = (rng.random((1, O)) / 127).astype(np.float32)
    got = np.asarray(jax.jit(kernels.matvec)(x, q, scale), np.float64)
    want = (x.astype(np.float64) @ q.astype(np.float64)) * scale.astype(np.float64)
    assert np.all(np.abs(got - want) <= bound(x, q, scale))
    # negative cases: the product without its scale, and one column off, are far outside it
    assert not np.all(np.abs(x.astype(np.float64) @ q.astype(np.float64) - want) <= bound(x, q, scale))
    if O > 1:
        assert not np.all(np.abs(np.roll(got, 1, axis=1) - want) <= bound(x, q, scale))


@pytest.mark.parametrize("M,I,O,G", [(1, 576, 576, 18), (2, 96, 1536, 3), (3, 1536, 72, 48),
                                     (8, 256, 64, 2), (4, 130, 7, 5), (2, 2048, 2048, 64)])
def test_int8_matvec_with_grouped_scales_is_the_product_to_float32_rounding(M, I, O, G):
    """int8 weights with a row of scales per group of I / G inputs (scale (G, O); a Q8_0
    file's layout at G = I / 32): each group's sums scaled into its block's, within the float32
    bound of the float64 product of x and Q times its group's scales; a row alone gets the same
    bits. Negative cases: every group taking the first group's scales, and the groups' scales
    shifted by one group, fall outside the bound. The gradient in x is XLA's on Q times s."""
    rng = np.random.default_rng(M * 1000 + O + G)
    x = rng.standard_normal((M, I)).astype(np.float32)
    q = rng.integers(-127, 128, (I, O)).astype(np.int8)
    s = (rng.random((G, O)) * 0.01 + 1e-4).astype(np.float32)

    def weight(scales):
        return q.astype(np.float64) * np.repeat(scales.astype(np.float64), I // G, axis=0)
    assert kernels.usable(jnp.asarray(x), q, s)
    got = np.asarray(jax.jit(kernels.matvec)(x, q, s), np.float64)
    want, limit = x.astype(np.float64) @ weight(s), bound(x, weight(s))
    assert np.all(np.abs(got - want) <= limit)
    np.testing.assert_array_equal(np.asarray(kernels.matvec(x[-1:], q, s))[0], got[-1])
    for wrong in (np.repeat(s[:1], G, axis=0), np.roll(s, 1, axis=0)):
        assert not np.all(np.abs(np.asarray(kernels.matvec(x, q, wrong), np.float64) - want)
                          <= limit)
    assert not kernels.usable(jnp.asarray(x), q, np.ones((G, O + 1), np.float32))
    w = kernels.dequantize_int8(jnp.asarray(q), jnp.asarray(s))  # the gradient: XLA's on Q * s
    np.testing.assert_allclose(  # two float32 sums of O terms: within O eps of sum |w_i.|
        jax.grad(lambda x: kernels.matvec(x, q, s).sum())(jnp.asarray(x)),
        jax.grad(lambda x: (x @ w).sum())(jnp.asarray(x)), rtol=0,
        atol=2 * O * EPS32 * float(jnp.abs(w).sum(axis=1).max()))


# The rows kernel (int8 q stored (O, I): a tied LM head): I = 70 and 17 leave a vector tail, O not
# a multiple of the rows done at once leaves a row tail, and 8192 x 576 (4.5 MB of int8) is shared
# with the helper threads
ROWS_SHAPES = [(1, 576, 1000), (2, 70, 33), (3, 16, 5), (4, 17, 130), (5, 64, 7), (8, 70, 301),
               (1, 576, 8192), (8, 576, 8192)]


def int4_weight(rng, I, O, scales=np.float16):
    """A 4-bit weight in the kernels' layout - its canonical rows: packed (O, I / 2) uint8, scale
    and min (O, I / 32) - its scales and minima float16 values as a GGUF's Q4_0 / Q4_1 hold them
    (held as `scales`: float16 as bridge.int4 holds them now, or float32 as before), and the
    float32 weight (O, I) it stands for (bridge.int4.dequantize_int4)."""
    from bridge.int4 import dequantize_int4, pack
    q = rng.integers(0, 16, (O, I))
    d = (rng.random((O, I // 32)) * 0.02 + 1e-3).astype(np.float16)
    m = (np.float16(-8) * d) if I % 64 else (rng.standard_normal((O, I // 32)) * 0.05).astype(np.float16)
    packed = pack(q)
    return (packed, d.astype(scales), m.astype(scales)), dequantize_int4(packed, d, m)


# SHAPES with inputs in groups of 32, and ROWS_SHAPES' (a row tail: O not a multiple of the
# rows done at once; 8192 rows shared with the helper threads)
INT4_SHAPES = ([(M, I, O) for M, I, O in SHAPES if I % 32 == 0] + [(5, 32, 13), (6, 96, 37)]
               + [(M, I, O) for M, I, O in ROWS_SHAPES if I % 32 == 0])


@pytest.mark.parametrize("M,I,O", INT4_SHAPES)
def test_int4_matvec_is_within_float32_rounding_of_the_dequantised_product(M, I, O):
    """Each 4-bit weight is expanded in registers to q * d + m (one fused multiply-add, exact for
    a float16 d) and multiplied in: within the float32 bound of the float64 product on the
    dequantised weight. The AVX-512 build looks each weight up in a table of its group's 16
    values and sums the group's even inputs, then its odd ones, in each lane; the AVX2 and plain
    builds sum in input order as the rows kernel does, so there the outputs are the float32 rows
    kernel's on the dequantised weight, bit for bit (test_every_instruction_set_path_...).
    Negative cases: the nibbles of a byte swapped, and the minimum left out, are far outside."""
    rng = np.random.default_rng(M * 1000 + O + 7)
    x = rng.standard_normal((M, I)).astype(np.float32)
    (packed, d, m), w = int4_weight(rng, I, O)
    assert kernels.usable(jnp.asarray(x), packed, d, m)
    got = np.asarray(jax.jit(kernels.matvec_int4)(x, [(packed, d, m)])[0])
    if kernels.lanes() != 16:
        np.testing.assert_array_equal(got, np.asarray(jax.jit(kernels.matvec_rows)(x, w)))
    # the same values held as float32 (checkpoints saved before float16 scales): the same bits
    d32, m32 = d.astype(np.float32), m.astype(np.float32)
    np.testing.assert_array_equal(got, np.asarray(kernels.matvec_int4(x, [(packed, d32, m32)])[0]))
    assert not kernels.usable(jnp.asarray(x), packed, d32, m)  # one of each: not served
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.all(np.abs(got - want) <= bound(x, w.T))
    swapped = (packed >> 4) | (packed << 4)
    wrong = np.asarray(kernels.matvec_int4(x, [(swapped, d, m)])[0], np.float64)
    assert not np.all(np.abs(wrong - want) <= bound(x, w.T))
    wrong = np.asarray(kernels.matvec_int4(x, [(packed, d, np.zeros_like(m))])[0], np.float64)
    assert not np.all(np.abs(wrong - want) <= bound(x, w.T))


@pytest.mark.parametrize("M,I,O", [(1, 576, 576), (3, 1536, 72), (19, 256, 40), (1, 4096, 96)])
@pytest.mark.parametrize("acts", ["float32", "int8"])
def test_4_bit_weights_without_minima_are_q4_0s_and_give_the_same_bits(M, I, O, acts,
                                                                        monkeypatch):
    """A 4-bit weight given no minima (None) is Q4_0's d (q - 8), its minima neither held nor
    read: the kernel (float32 and 8-bit activations, float16 and float32 scales, a prefill's
    chunks, beside a weight with minima in one call), XLA's path (int4_matmul and its gradient)
    and a model's Linear give the bits of the same weight with its minima -8 d held (exact in
    float32). Negative: minima of -7 d differ; a min of another shape is not served."""
    from jax_llama.model.kernels import dequantize_int4
    from jax_llama.model.projections import Linear, int4_matmul

    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", acts)
    rng = np.random.default_rng(M * 100 + O)
    x = rng.standard_normal((M, I)).astype(np.float32)
    packed = rng.integers(0, 256, (O, I // 2)).astype(np.uint8)
    d = (rng.random((O, I // 32)) * 0.02 + 1e-3).astype(np.float16)
    m = np.float16(-8) * d
    for scales in (np.float16, np.float32):
        held = (packed, d.astype(scales), m.astype(scales))
        assert kernels.usable(jnp.asarray(x), packed, held[1], None)
        got = np.asarray(kernels.matvec_int4(x, [held])[0])
        alone = kernels.matvec_int4(x, [(packed, held[1], None)])[0]
        np.testing.assert_array_equal(got, np.asarray(alone))
    both = kernels.matvec_int4(x, [(packed, d, m), (packed, d, None)])
    np.testing.assert_array_equal(np.asarray(both[0]), np.asarray(both[1]))
    np.testing.assert_array_equal(np.asarray(dequantize_int4(packed, d, None, jnp.float32)),
                                  np.asarray(dequantize_int4(packed, d, m, jnp.float32)))
    xla = lambda low: int4_matmul(jnp.asarray(x), packed, d, low, jnp.float32)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(xla(None)), np.asarray(xla(m)))
    def grad(low):
        return jax.grad(lambda v: int4_matmul(v, packed, d, low, jnp.float32).sum())(
            jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(grad(None)), np.asarray(grad(m)))
    for kind in ("kernels", "xla"):
        layer = Linear(O, kernels=kind)
        np.testing.assert_array_equal(
            np.asarray(layer.apply({"params": {"kernel": packed, "scale": d}}, x)),
            np.asarray(layer.apply({"params": {"kernel": packed, "scale": d, "min": m}}, x)))
    other = np.asarray(kernels.matvec_int4(x, [(packed, d, np.float16(-7) * d)])[0])
    assert np.abs(other - np.asarray(both[0])).max() > 1e-3
    assert not kernels.usable(jnp.asarray(x), packed, d, m[:, :-1])
    assert not kernels.usable(jnp.asarray(x), packed, d, m.astype(np.float32))


@pytest.mark.parametrize("M", [9, 35, 64])
def test_int4_prefill_rows_are_served_eight_at_a_time_with_the_bits_of_a_row_alone(M):
    """Up to MAX_ROWS_INT4 rows (a short prefill) go through the 4-bit kernel, 8 rows at a time
    over each group of weight rows: every row gets the bits it gets in a call of 8 rows or of its
    own, within the float32 bound of the float64 product. Negative case: rows shifted by one
    chunk (what a wrong offset into x or y would give) differ."""
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, 96)).astype(np.float32)
    (packed, d, m), w = int4_weight(rng, 96, 1100)  # 1100: a tail of the unit's R rows at once
    four = [(packed, d, m)]
    assert kernels.usable(jnp.asarray(x), packed, d, m)
    assert not kernels.usable(jnp.zeros((kernels.MAX_ROWS_INT4 + 1, 96)), packed, d, m)
    assert not kernels.usable(jnp.asarray(x), w.T.copy())  # float32 weights: still 8 rows
    got = np.asarray(jax.jit(kernels.matvec_int4)(x, four)[0])
    for m0 in range(0, M, 8):
        chunk = slice(m0, min(m0 + 8, M))
        np.testing.assert_array_equal(got[chunk], np.asarray(kernels.matvec_int4(x[chunk], four)[0]))
    np.testing.assert_array_equal(got[-1], np.asarray(kernels.matvec_int4(x[-1:], four)[0])[0])
    assert not np.array_equal(got[8:16], np.asarray(kernels.matvec_int4(x[:8], four)[0]))
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.all(np.abs(got - want) <= bound(x, w.T))


def test_int4_weights_that_share_an_input_are_one_call_and_rows_stand_alone():
    """q, k and v as 4-bit weights in one call equal each alone, bit for bit; and a row's
    outputs are the same bits alone or beside 7 others."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((8, 576)).astype(np.float32)
    weights = [int4_weight(rng, 576, o)[0] for o in (576, 192, 192)]
    together = jax.jit(kernels.matvec_int4)(x, weights)
    assert len(together) == 3
    for weight, got in zip(weights, together):
        np.testing.assert_array_equal(np.asarray(got),
                                      np.asarray(kernels.matvec_int4(x, [weight])[0]))
        for m in range(8):
            np.testing.assert_array_equal(
                np.asarray(kernels.matvec_int4(x[m:m + 1], [weight])[0])[0], np.asarray(got)[m])



def quantise_q8(x):
    """x (M, I) as the 4-bit kernel with 8-bit activations takes it, in float64: each group of
    32 inputs to dx * round(x * (1 / dx)) (ties to even, within +-127), dx = max |x| times
    float32(1 / 127), and 0 where the group is all zero."""
    M, I = x.shape
    xg = x.reshape(M, I // 32, 32)
    dx = np.abs(xg).max(-1) * np.float32(1 / 127)
    inv = np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), 0).astype(np.float32)
    xq = np.clip(np.rint(xg * inv[..., None]), -127, 127)
    return (xq * dx[..., None].astype(np.float64)).reshape(M, I)


@pytest.mark.parametrize("M,I,O", INT4_SHAPES + [(20, 576, 64), (64, 96, 37)])
def test_int4_with_8_bit_activations_is_the_quantised_x_times_the_weight(M, I, O, monkeypatch):
    """JAX_LLAMA_INT4_ACTIVATIONS=int8: x quantised to 8 bits per group of 32 (quantise_q8) and
    each group's products summed as integers, as llama.cpp's Q4 types do: within the float32
    bound of the float64 product of the quantised x and the dequantised weight. Each row gets
    the same bits alone. Negative cases: float32 activations (the default kernel) and swapped
    nibbles are outside that bound; a wrong setting is refused by name."""
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "int8")
    rng = np.random.default_rng(M * 1000 + O + 11)
    x = rng.standard_normal((M, I)).astype(np.float32)
    x[0, :32] = 0  # a group of zeros: scale 0
    (packed, d, m), w = int4_weight(rng, I, O)
    got = np.asarray(kernels.matvec_int4(x, [(packed, d, m)])[0])  # read when traced: no jit
    xd = quantise_q8(x)
    want = xd @ w.T.astype(np.float64)
    assert np.all(np.abs(got - want) <= bound(xd, w.T))
    alone = np.asarray(kernels.matvec_int4(x[-1:], [(packed, d, m)])[0])[0]
    np.testing.assert_array_equal(got[-1], alone)
    # float16 scales are read in place and converted in registers; float32 ones (checkpoints
    # saved before) give the same bits
    as32 = [(packed, d.astype(np.float32), m.astype(np.float32))]
    np.testing.assert_array_equal(got, np.asarray(kernels.matvec_int4(x, as32)[0]))
    swapped = (packed >> 4) | (packed << 4)
    wrong = np.asarray(kernels.matvec_int4(x, [(swapped, d, m)])[0], np.float64)
    assert not np.all(np.abs(wrong - want) <= bound(xd, w.T))
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "float32")
    plain = np.asarray(kernels.matvec_int4(x, [(packed, d, m)])[0], np.float64)
    assert not np.all(np.abs(plain - want) <= bound(xd, w.T))
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "int4")
    from bridge.errors import BridgeError
    with pytest.raises(BridgeError,
                       match="JAX_LLAMA_INT4_ACTIVATIONS.*expected float32, int8 or bfloat16"):
        kernels.matvec_int4(x, [(packed, d, m)])


def round_bf16(x):
    """x (float32) rounded to the nearest bfloat16, ties to even, in float64: its top 16 bits
    after adding half of the last one kept (less one where that bit is even)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def bound_bf16(xb, packed, d, m):
    """The float32 rounding bound of the bfloat16-activation kernel's sums: eps times the
    longest chain of additions an output goes through (I / lanes in a lane, the groups' scaled
    sums, a horizontal sum) times the sum of |terms|. Its terms: with AVX512_BF16 it adds
    (16 x')(1 + q / 16) = 16 x' + q x' (so 16 |x'| d beside |q x' d|) and then (m - 16 d) sum x';
    with AVX2, d (x' . q) + m sum x'; in the plain build x' (q d + m). The bound takes the
    largest."""
    from bridge.int4 import unpack
    q = unpack(packed).astype(np.float64)
    dd, mm = (np.repeat(a.astype(np.float64), 32, axis=1) for a in (d, m))
    terms = np.abs(xb) @ (q * dd + 32 * dd + np.abs(mm)).T
    depth = xb.shape[1] / kernels.lanes() + 64
    return depth * EPS32 * terms + 1e-30


@pytest.mark.parametrize("M,I,O", [(1, 576, 576), (1, 576, 192), (2, 2048, 600), (5, 32, 13),
                                   (6, 96, 37), (8, 256, 64), (20, 576, 64)])
def test_int4_with_bfloat16_activations_is_the_rounded_x_times_the_weight(M, I, O, monkeypatch):
    """JAX_LLAMA_INT4_ACTIVATIONS=bfloat16: x rounded to the nearest bfloat16 (round_bf16, bit for
    bit what kernels.round_to_bfloat16 and XLA give), then multiplied by the 4-bit weight: within
    the float32 bound of its sums (bound_bf16) of the float64 product of the rounded x and the
    dequantised weight, with float16 or float32 scales, and a row alone gets the same bits as
    beside others. Negative cases: float32 activations and swapped nibbles are outside it."""
    rng = np.random.default_rng(M * 1000 + O + 23)
    x = rng.standard_normal((M, I)).astype(np.float32)
    x[0, :5] = [3e4, -1e-3, 0.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8]  # big, small, ties
    (packed, d, m), w = int4_weight(rng, I, O)
    xb = round_bf16(x)
    np.testing.assert_array_equal(np.asarray(kernels.round_to_bfloat16(jnp.asarray(x))), xb)
    assert xb[0, 3] == 1.0 and xb[0, 4] == 1.0 + 2.0 ** -6  # ties go to even
    want = xb @ w.T.astype(np.float64)
    limit = bound_bf16(xb, packed, d, m)
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "bfloat16")
    got = np.asarray(kernels.matvec_int4(x, [(packed, d, m)])[0])  # read when traced: no jit
    assert np.all(np.abs(got - want) <= limit)
    np.testing.assert_array_equal(
        got[-1], np.asarray(kernels.matvec_int4(x[-1:], [(packed, d, m)])[0])[0])
    as32 = [(packed, d.astype(np.float32), m.astype(np.float32))]
    np.testing.assert_array_equal(got, np.asarray(kernels.matvec_int4(x, as32)[0]))
    swapped = (packed >> 4) | (packed << 4)
    wrong = np.asarray(kernels.matvec_int4(x, [(swapped, d, m)])[0], np.float64)
    assert not np.all(np.abs(wrong - want) <= limit)
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "float32")
    plain = np.asarray(kernels.matvec_int4(x, [(packed, d, m)])[0], np.float64)
    assert not np.all(np.abs(plain - want) <= limit)


@pytest.mark.parametrize("M,I,O,minima", [(32, 96, 37, True), (37, 576, 100, True),
                                           (130, 64, 200, False), (40, 2048, 48, False)])
def test_a_prompt_of_4_bit_weights_is_the_rounded_x_times_the_weight(M, I, O, minima,
                                                                     monkeypatch):
    """From PROMPT_ROWS rows with bfloat16 activations (generation's prefill) the prompt kernel
    multiplies bfloat16 pairs: within bound_bf16 of the float64 product of the rounded x and the
    dequantised weight, with minima or without (Q4_0's -8 d: the weights held as q - 8),
    float16 or float32 scales, several weights in one call equal each alone, and a row gets the
    same bits in any prompt (5 rows later in another; the tail after the last tile of 4).
    Negative cases: swapped nibbles and the unrounded x are outside the bound, and with float32
    activations the prompt kernel is not what runs."""
    from bridge.int4 import unpack
    if not kernels.prompt_bf16():
        pytest.skip("the prompt kernel needs AVX512_BF16 (this library runs the decode kernel)")
    rng = np.random.default_rng(M + I + O)
    x = rng.standard_normal((M, I)).astype(np.float32)
    x[0, :3] = [3e4, -1e-3, 0.0]
    (packed, d, m), w = int4_weight(rng, I, O)
    if not minima:
        m = None
        w = (unpack(packed) - 8.0) * np.repeat(d.astype(np.float64), 32, axis=1)
    xb = round_bf16(x)
    want = xb @ w.T.astype(np.float64)
    limit = bound_bf16(xb, packed, d, np.float16(-8) * d if m is None else m)
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "bfloat16")
    weight = (packed, d, m)
    assert M >= kernels.PROMPT_ROWS and kernels.usable(jnp.asarray(x), packed, d, m)
    assert "jax_llama_prompt_int4_bf16" in str(jax.make_jaxpr(kernels.matvec_int4)(x, [weight]))
    got = np.asarray(kernels.matvec_int4(x, [weight])[0])
    assert np.all(np.abs(got - want) <= limit)
    later = np.asarray(kernels.matvec_int4(np.vstack([x[-5:], x]), [weight])[0])
    np.testing.assert_array_equal(later[5:], got)
    scales32 = (packed, d.astype(np.float32), None if m is None else m.astype(np.float32))
    (other, d2, m2), _ = int4_weight(rng, I, 40)
    other = (other, d2, None if m is None else m2)
    both = kernels.matvec_int4(x, [scales32, other])
    np.testing.assert_array_equal(np.asarray(both[0]), got)
    np.testing.assert_array_equal(np.asarray(both[1]),
                                  np.asarray(kernels.matvec_int4(x, [other])[0]))
    swapped = (packed >> 4) | (packed << 4)
    wrong = np.asarray(kernels.matvec_int4(x, [(swapped, d, m)])[0], np.float64)
    assert not np.all(np.abs(wrong - want) <= limit)
    unrounded = x.astype(np.float64) @ w.T.astype(np.float64)
    assert not np.all(np.abs(unrounded - want) <= limit)
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "float32")
    assert "jax_llama_prompt_int4_bf16" not in str(jax.make_jaxpr(kernels.matvec_int4)(x[:8],
                                                                                       [weight]))
    assert not kernels.usable(jnp.zeros((kernels.MAX_ROWS_INT4 + 1, I)), packed, d, m)


@pytest.mark.parametrize("M,I,O,G", [(32, 96, 37, 3), (37, 576, 100, 1), (130, 64, 200, 1),
                                     (40, 2048, 48, 16)])
def test_a_prompt_of_int8_weights_is_the_rounded_x_times_the_weight(M, I, O, G, monkeypatch):
    """int8 weights (I, O) with one scale an output (G = 1) or a row of scales per group of
    I / G inputs meet PROMPT_ROWS rows of bfloat16 activations in the prompt kernel: within the
    float32 bound of the float64 product of the rounded x and Q times s (`bound`, with I / 16 + 64
    additions in a chain: each group's vdpbf16ps sums, then the groups scaled into the output),
    several weights in one call equal each alone, and a row gets the same bits in another prompt
    5 rows later. Negative cases: the weight's rows shifted by one input and the unrounded x
    fall outside the bound, float32 activations, I not a multiple of 32 and groups of 16 inputs
    do not take the prompt kernel."""
    if not kernels.prompt_bf16():
        pytest.skip("the prompt kernels need AVX512_BF16")
    rng = np.random.default_rng(M + I + O + 8)
    x = rng.standard_normal((M, I)).astype(np.float32)
    x[0, :3] = [3e4, -1e-3, 0.0]
    q = rng.integers(-127, 128, (I, O)).astype(np.int8)
    s = (rng.random((G, O)) * 0.01 + 1e-4).astype(np.float32)
    w = q.astype(np.float64) * np.repeat(s.astype(np.float64), I // G, axis=0)
    xb = round_bf16(x)
    want = xb @ w
    limit = (I / 16 + 64) / I * bound(xb, w)  # bound's I additions -> the chain's
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "bfloat16")
    assert kernels.usable(jnp.asarray(x), q, s)
    assert "jax_llama_prompt_int8_bf16" in str(jax.make_jaxpr(kernels.matvec_int8)(x, [(q, s)]))
    got = np.asarray(kernels.matvec_int8(x, [(q, s)])[0])
    assert np.all(np.abs(got - want) <= limit)
    later = np.asarray(kernels.matvec_int8(np.vstack([x[-5:], x]), [(q, s)])[0])
    np.testing.assert_array_equal(later[5:], got)
    other = (rng.integers(-127, 128, (I, 40)).astype(np.int8), np.full((1, 40), 0.5, np.float32))
    both = kernels.matvec_int8(x, [(q, s), other])
    np.testing.assert_array_equal(np.asarray(both[0]), got)
    np.testing.assert_array_equal(np.asarray(both[1]), np.asarray(kernels.matvec_int8(x, [other])[0]))
    shifted = np.asarray(kernels.matvec_int8(x, [(np.roll(q, 1, axis=0), s)])[0], np.float64)
    assert not np.all(np.abs(shifted - want) <= limit)
    unrounded = x.astype(np.float64) @ w
    assert not np.all(np.abs(unrounded - want) <= limit)
    assert not kernels.usable(jnp.zeros((M, I + 1)), np.zeros((I + 1, O), np.int8), s[:1])
    assert not kernels.usable(jnp.asarray(x), q, np.ones((I // 16, O), np.float32))
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "float32")
    assert not kernels.usable(jnp.asarray(x), q, s)


def test_every_variant_compiles():
    """Each instruction set's library compiles (built once into the kernel cache, at once where
    it is there): a CPU with AVX-512 but no AVX512_BF16 (Skylake to Cascade Lake), one with AVX2
    alone and one with no AVX each run their own paths, and a build that failed would leave such
    a CPU without kernels (and the tests here skipped there): the compiler's verdict on each."""
    assert kernels.build(kernels.VARIANTS) == {v.name: None for v in kernels.VARIANTS}
    assert all(kernels.library.library_path(v).stat().st_size > 0 for v in kernels.VARIANTS)


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="x86-64 -march names")
def test_the_avx2_build_multiplies_bfloat16_activations_factored_within_the_bound(tmp_path):
    """On AVX2 (no bfloat16 products) the kernel factors the weight out of each group, d (x' . q)
    + m sum x', every product x' q exact: built for x86-64-v3 in a subprocess (whatever this CPU
    is), within bound_bf16 of the float64 product of the rounded x and the weight, a row alone the
    same bits as beside others (also in a 19-row prefill's chunks), float16 and float32 scales the
    same bits, Q4_0's form (no minima held) the same bits as its minima held. Negative cases: the
    nibbles swapped, and float32 activations, fall outside the bound."""
    rng = np.random.default_rng(5)
    cases = {}
    for k, (M, I, O) in enumerate([(1, 576, 576), (2, 2048, 72), (19, 96, 37), (1, 1536, 40)]):
        x = rng.standard_normal((M, I)).astype(np.float32)
        x[0, :3] = [3e4, -1e-3, 1.0 + 2.0 ** -8]
        (packed, d, m), w = int4_weight(rng, I, O)
        cases.update({f"x{k}": x, f"q{k}": packed, f"d{k}": d, f"m{k}": m, f"w{k}": w})
    np.savez(tmp_path / "in.npz", **cases)
    script = (
        "import os, numpy as np\n"
        "from jax_llama.model import kernels\n"
        "z = dict(np.load(os.environ['CASES'])); out = {}\n"
        "for k in range(4):\n"
        "    x, q, d, m = (z[f'{n}{k}'] for n in 'xqdm')\n"
        "    four = lambda q, d, m: kernels.matvec_int4(x, [(q, d, m)])[0]\n"
        "    os.environ['JAX_LLAMA_INT4_ACTIVATIONS'] = 'bfloat16'\n"
        "    y = np.asarray(four(q, d, m))\n"
        "    assert np.array_equal(y, np.asarray(four(q, d.astype(np.float32), m.astype(np.float32))))\n"
        "    assert all(np.array_equal(y[i], np.asarray(kernels.matvec_int4(x[i:i + 1], [(q, d, m)])[0])[0])\n"
        "               for i in range(len(x)))\n"
        "    if np.array_equal(m, np.float16(-8) * d):\n"
        "        assert np.array_equal(y, np.asarray(four(q, d, None)))\n"
        "    out[f'y{k}'] = y\n"
        "    out[f'swapped{k}'] = np.asarray(four((q >> 4) | (q << 4), d, m))\n"
        "    os.environ['JAX_LLAMA_INT4_ACTIVATIONS'] = 'float32'\n"
        "    out[f'plain{k}'] = np.asarray(four(q, d, m))\n"
        "out['lanes'] = np.array(kernels.lanes())\n"
        "np.savez(os.environ['OUT'], **out)\n")
    env = dict(os.environ, JAX_LLAMA_KERNELS="1", JAX_LLAMA_KERNEL_MARCH="x86-64-v3",
               CASES=str(tmp_path / "in.npz"), OUT=str(tmp_path / "out.npz"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = np.load(tmp_path / "out.npz")
    assert int(out["lanes"]) == 8
    for k in range(4):
        x, packed, d, m, w = (cases[f"{n}{k}"] for n in "xqdmw")
        xb = round_bf16(x)
        want, limit = xb @ w.T.astype(np.float64), bound_bf16(xb, packed, d, m)
        assert np.all(np.abs(out[f"y{k}"] - want) <= limit), k
        assert not np.all(np.abs(out[f"swapped{k}"] - want) <= limit), k
        assert not np.all(np.abs(out[f"plain{k}"] - want) <= limit), k


def test_bfloat16_activations_are_the_same_products_on_xla_and_their_gradient_passes_through(
        monkeypatch):
    """With JAX_LLAMA_INT4_ACTIVATIONS=bfloat16 the XLA path of a 4-bit projection rounds x as the
    kernel does: on the same x, int4_matmul and the kernel are within the bound of the product
    of the rounded x, float32 activations are not; the gradient in x is the dequantised
    weight's (straight through)."""
    from jax_llama.model.projections import int4_matmul
    rng = np.random.default_rng(4)
    x = rng.standard_normal((70, 96)).astype(np.float32)
    (packed, d, m), w = int4_weight(rng, 96, 40)
    xb = round_bf16(x)
    want = xb @ w.T.astype(np.float64)
    limit = bound_bf16(xb, packed, d, m)
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "bfloat16")
    on_xla = np.asarray(int4_matmul(jnp.asarray(x), packed, d, m, jnp.float32), np.float64)
    on_kernel = np.asarray(kernels.matvec_int4(x[:8], [(packed, d, m)])[0], np.float64)
    assert np.all(np.abs(on_xla - want) <= limit)
    assert np.all(np.abs(on_kernel - want[:8]) <= limit[:8])
    g = rng.standard_normal((70, 40)).astype(np.float32)
    grad = jax.grad(lambda x: jnp.sum(int4_matmul(x, packed, d, m, jnp.float32) * g))(x)
    np.testing.assert_allclose(np.asarray(grad), g @ w, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "float32")
    plain = np.asarray(int4_matmul(jnp.asarray(x), packed, d, m, jnp.float32), np.float64)
    assert not np.all(np.abs(plain - want) <= limit)


def test_8_bit_activations_are_the_same_products_on_xla_and_their_gradient_passes_through(
        monkeypatch):
    """With JAX_LLAMA_INT4_ACTIVATIONS=int8 the XLA path of a 4-bit projection (more rows than
    the kernel serves, or kernels="xla") rounds x as the kernel does (quantise_activations equals
    the tests' quantise_q8 bit for bit in float32): on the same x, int4_matmul and the kernel are
    within the float32 bound of the product of the rounded x, and float32 activations are not.
    (Through a model's layers the paths' x differ in their last bits, and a last bit can move an
    8-bit input by a step: the rounding is not continuous, so whole models are compared by
    their figures in the docs, not here.) Its gradient in x is the dequantised weight's
    (straight through)."""
    from jax_llama.model.projections import int4_matmul
    rng = np.random.default_rng(3)
    x = rng.standard_normal((70, 96)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(kernels.quantise_activations(jnp.asarray(x))),
                                  quantise_q8(x).astype(np.float32))
    (packed, d, m), w = int4_weight(rng, 96, 40)
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "int8")
    xd = quantise_q8(x)
    want = xd @ w.T.astype(np.float64)
    on_xla = np.asarray(int4_matmul(jnp.asarray(x), packed, d, m, jnp.float32), np.float64)
    on_kernel = np.asarray(kernels.matvec_int4(x[:8], [(packed, d, m)])[0], np.float64)
    assert np.all(np.abs(on_xla - want) <= bound(xd, w.T))
    assert np.all(np.abs(on_kernel - want[:8]) <= bound(xd[:8], w.T))
    g = rng.standard_normal((70, 40)).astype(np.float32)
    grad = jax.grad(lambda x: jnp.sum(int4_matmul(x, packed, d, m, jnp.float32) * g))(x)
    np.testing.assert_allclose(np.asarray(grad), g @ w, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "float32")
    plain = np.asarray(int4_matmul(jnp.asarray(x), packed, d, m, jnp.float32), np.float64)
    assert not np.all(np.abs(plain - want) <= bound(xd, w.T))


@pytest.mark.parametrize("M,I,O", ROWS_SHAPES)
def test_int8_rows_matvec_equals_the_scaled_product_to_float32_rounding(M, I, O):
    rng = np.random.default_rng(M * 1000 + O + 2)
    x = rng.standard_normal((M, I)).astype(np.float32)
    q = rng.integers(-127, 128, (O, I)).astype(np.int8)
    scale = (rng.random((O, 1)) / 127).astype(np.float32)
    assert kernels.usable_rows(x, q, scale)
    got = np.asarray(jax.jit(kernels.matvec_rows)(x, q, scale), np.float64)
    want = (x.astype(np.float64) @ q.T.astype(np.float64)) * scale.T.astype(np.float64)
    limit = bound(x, q.T, scale.T)
    assert np.all(np.abs(got - want) <= limit)
    # negative cases: the product without its scale, and one row of q off, are far outside it
    assert not np.all(np.abs(x.astype(np.float64) @ q.T.astype(np.float64) - want) <= limit)
    if O > 1:
        assert not np.all(np.abs(np.roll(got, 1, axis=1) - want) <= limit)


@pytest.mark.parametrize("M,I,O,G", [(1, 576, 1000, 18), (3, 64, 33, 4), (8, 576, 8192, 18),
                                     (2, 96, 7, 3)])
def test_int8_rows_with_grouped_scales_are_the_product_to_float32_rounding(M, I, O, G):
    """A tied head held as int8 with a scale per group of I / G inputs (O, G): each group's lanes
    summed apart and scaled into the row's, within the float32 bound of the float64 product; a
    row alone the same bits. Negative cases: every group taking the first group's scale, and the
    scales shifted by one group, fall outside the bound; groups of 8 inputs (not whole vectors of
    every build) are not served. The gradient in x is XLA's on Q times s."""
    rng = np.random.default_rng(M * 1000 + O + G)
    x = rng.standard_normal((M, I)).astype(np.float32)
    q = rng.integers(-127, 128, (O, I)).astype(np.int8)
    scale = (rng.random((O, G)) / 127).astype(np.float32)

    def weight(s):
        return q.astype(np.float64) * np.repeat(s.astype(np.float64), I // G, axis=1)
    assert kernels.usable_rows(x, q, scale)
    got = np.asarray(jax.jit(kernels.matvec_rows)(x, q, scale), np.float64)
    want, limit = x.astype(np.float64) @ weight(scale).T, bound(x, weight(scale).T)
    assert np.all(np.abs(got - want) <= limit)
    np.testing.assert_array_equal(np.asarray(kernels.matvec_rows(x[-1:], q, scale))[0], got[-1])
    for wrong in (np.repeat(scale[:, :1], G, axis=1), np.roll(scale, 1, axis=1)):
        assert not np.all(np.abs(np.asarray(kernels.matvec_rows(x, q, wrong), np.float64) - want)
                          <= limit)
    assert not kernels.usable_rows(x, q, np.ones((O, I // 8), np.float32))
    w = kernels.dequantize_int8(jnp.asarray(q).T, jnp.asarray(scale).T)  # (I, O)
    np.testing.assert_allclose(
        jax.grad(lambda x: kernels.matvec_rows(x, q, scale).sum())(jnp.asarray(x)),
        jax.grad(lambda x: (x @ w).sum())(jnp.asarray(x)), rtol=0,
        atol=2 * O * EPS32 * float(jnp.abs(w).sum(axis=1).max()))


@pytest.mark.parametrize("M,I,O", ROWS_SHAPES)
def test_float32_rows_matvec_equals_the_product_to_float32_rounding(M, I, O):
    """The rows kernel on a float32 table (a tied float32 LM head): x @ w^T, w stored (O, I)."""
    rng = np.random.default_rng(M * 1000 + O + 3)
    x = rng.standard_normal((M, I)).astype(np.float32)
    w = rng.standard_normal((O, I)).astype(np.float32)
    assert kernels.usable_rows(x, w)
    got = np.asarray(jax.jit(kernels.matvec_rows)(x, w), np.float64)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    limit = bound(x, w.T)
    assert np.all(np.abs(got - want) <= limit)
    if O > 1:  # negative case: one row of w off is far outside it
        assert not np.all(np.abs(np.roll(got, 1, axis=1) - want) <= limit)


@pytest.mark.parametrize("I,O", [(70, 1003), (576, 8192)])
def test_rows_kernel_rows_do_not_depend_on_how_many_rows_share_the_call(I, O):
    """Each output of the rows kernel is the same bits whatever M (M sets how many rows of q are
    done at once: 8 for one row of x, 4 for two, fewer for more) and whether threads share it."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, I)).astype(np.float32)
    q = rng.integers(-127, 128, (O, I)).astype(np.int8)
    scale = rng.random((O, 1)).astype(np.float32)
    f = jax.jit(kernels.matvec_rows)
    together = np.asarray(f(x, q, scale))
    for m in range(8):
        np.testing.assert_array_equal(np.asarray(f(x[m:m + 1], q, scale))[0], together[m])
    for m0, m1 in ((0, 2), (2, 5), (1, 8)):
        np.testing.assert_array_equal(np.asarray(f(x[m0:m1], q, scale)), together[m0:m1])


def test_rows_kernel_refuses_shapes_it_does_not_serve():
    x, q, s = jnp.zeros((2, 16)), jnp.zeros((8, 16), jnp.int8), jnp.ones((8,))
    for scales in (7, 8 * 4):  # not a multiple of the rows; groups of 4 inputs, not vectors
        with pytest.raises(Exception, match=r"expected x \(M, I\), q \(O, I\), s \(O \* G,\)"):
            jax.block_until_ready(kernels._rows_call(x, q, jnp.ones((scales,))))
    with pytest.raises(Exception, match=r"expected x \(M, I\), q \(O, I\)"):
        jax.block_until_ready(kernels._rows_call(jnp.zeros((2, 15)), q, s))
    with pytest.raises(Exception, match="at most 8 rows"):
        jax.block_until_ready(kernels._rows_call(jnp.zeros((9, 16)), q, s))
    assert kernels._rows_call(x, q, s).shape == (2, 8)


def test_weights_that_share_an_input_are_one_call_with_the_same_numbers():
    """matvec_int8 with q, k and v (or gate and up) together equals each alone, bit for bit."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 576)).astype(np.float32)
    weights = [(rng.integers(-127, 128, (576, o)).astype(np.int8),
                (rng.random((1, o)) / 127).astype(np.float32)) for o in (576, 192, 192)]
    together = jax.jit(kernels.matvec_int8)(x, weights)
    assert len(together) == 3
    for (q, s), got in zip(weights, together):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(kernels.matvec)(x, q, s)))
    ws = [rng.standard_normal((576, o)).astype(np.float32) for o in (1536, 1536)]  # float32
    together = jax.jit(kernels.matvec_f32)(x, ws)
    assert len(together) == 2
    for w, got in zip(ws, together):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(kernels.matvec)(x, w)))


def test_outputs_do_not_depend_on_the_helper_threads():
    """Calls large enough to be shared (float32, int8 and 4-bit projections, both rows kernels) give the
    same bits on the caller alone (JAX_LLAMA_KERNEL_THREADS=1), with this machine's helpers (the
    default) and with 4 threads: each unit writes its own sums, added in a fixed order. The
    thread count is read once per process, so each count runs in a subprocess of its own."""
    script = (
        "import sys, numpy as np, jax\n"
        "from jax_llama.model import kernels\n"
        "rng = np.random.default_rng(0)\n"
        "x = rng.standard_normal((3, 576)).astype(np.float32)\n"
        "w = rng.standard_normal((576, 1536)).astype(np.float32)\n"
        "q = rng.integers(-127, 128, (576, 1536)).astype(np.int8)\n"
        "s = rng.random((1, 1536)).astype(np.float32)\n"
        "t = rng.standard_normal((8192, 576)).astype(np.float32)\n"
        "four = (rng.integers(0, 256, (1536, 288)).astype(np.uint8),\n"
        "        rng.random((1536, 18)).astype(np.float32), rng.random((1536, 18)).astype(np.float32))\n"
        "outs = [*kernels.matvec_f32(x, [w, w[:, :960]]), kernels.matvec(x, q, s),\n"
        "        kernels.matvec_rows(x, t), kernels.matvec_rows(x, q.T.copy(), s.T.copy()),\n"
        "        kernels.matvec_int4(x, [four])[0],\n"
        "        kernels.matvec_int4(rng.standard_normal((21, 576)).astype(np.float32), [four])[0]]\n"
        "import os; os.environ['JAX_LLAMA_INT4_ACTIVATIONS'] = 'int8'\n"
        "outs += [kernels.matvec_int4(x, [four])[0]]\n"
        "os.environ['JAX_LLAMA_INT4_ACTIVATIONS'] = 'bfloat16'\n"
        "outs += [kernels.matvec_int4(x, [four])[0], kernels.matvec_int4(x[:1], [four])[0]]\n"
        "np.save(sys.argv[1], np.concatenate([np.asarray(o).ravel() for o in outs]))\n")
    got = {}
    for threads in ("1", "", "4"):
        out = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{threads or 'default'}.npy"
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), out)
        subprocess.run([sys.executable, "-c", script, path], check=True,
                       env=dict(os.environ, JAX_LLAMA_KERNEL_THREADS=threads))
        got[threads] = np.load(path)
        os.unlink(path)
    np.testing.assert_array_equal(got[""], got["1"])
    np.testing.assert_array_equal(got["4"], got["1"])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_decoding_makes_one_call_per_shared_input(tied):
    """A decode step runs 4 kernel calls a layer (q/k/v, wo, gate/up, down), and one for the LM
    head: `output`, or the embedding of a tied model (matvec_rows), float32, int8 or 4-bit (whose
    tied head is int8 rows)."""
    import dataclasses

    import jax_llama
    from bridge.config import PRESETS
    # a feed-forward of 192: inputs in groups of 32 for the 4-bit weights
    config = dataclasses.replace(PRESETS["tiny"], tie_embeddings=tied, ffn_dim=192)
    model, params = jax_llama.init(config, seed=0)
    tokens = jnp.zeros((1, 1), jnp.int32)

    def jaxpr(p):
        return str(jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens))(p))
    int8 = jaxpr(jax_llama.quantize(params))
    assert int8.count("ffi_call") == 4 * config.n_layers + 1
    assert int8.count("jax_llama_matvec_int8_rows") == (1 if tied else 0)
    int4 = jaxpr(jax_llama.quantize(params, method="int4"))  # the tied head: int8 rows
    assert int4.count("ffi_call") == 4 * config.n_layers + 1
    assert int4.count("jax_llama_matvec_int4") == 4 * config.n_layers + (0 if tied else 1)
    f32 = jaxpr(params)
    assert f32.count("ffi_call") == 4 * config.n_layers + 1
    assert f32.count("jax_llama_matvec_f32_rows") == (1 if tied else 0)
    assert "jax_llama_matvec_int8" not in f32


def attention_float64(q, k, v, q_slots, valid):
    """softmax(q k^T / sqrt(H) + mask) v in float64: q (B, K, G, S, H), k and v (B, K, T, H); a
    query that may see no slot averages them all (jax_llama.model.attention's xla)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    T, H = k.shape[2], q.shape[-1]
    scores = np.einsum("bkgsh,bkth->bkgst", q, k) / np.sqrt(H)
    allowed = (np.arange(T)[None, :] <= np.asarray(q_slots)[:, None])[None] & \
        np.asarray(valid)[:, None, :]  # (B, S, T)
    scores = np.where(allowed[:, None, None], scores, -np.inf)
    scores = np.where(allowed.any(-1)[:, None, None, :, None], scores, 0.0)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bkgst,bkth->bkgsh", p / p.sum(-1, keepdims=True), v)


# (L, B, K, G, S, T, H): SmolLM2's decode step (9 heads on 3, 64 wide), several queries (a short
# prefill), rows past the vector width, an odd head width (vector tails), one slot
ATTENTION_SHAPES = [(3, 1, 3, 3, 1, 144, 64), (2, 2, 2, 4, 3, 37, 20), (2, 8, 1, 2, 1, 5, 128),
                    (1, 1, 1, 1, 1, 1, 7), (2, 3, 2, 1, 2, 300, 33)]


def attention_case(shape, seed=0):
    from jax_llama.model.attention import AttentionMask
    L, B, K, G, S, T, H = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, K, G, S, H)).astype(np.float32)
    k, v = (rng.standard_normal((L, B, K, T, H)).astype(np.float32) for _ in range(2))
    valid = rng.random((B, T)) < 0.8
    valid[0] = False  # row 0 sees no slot: the uniform average (its output is never read)
    if B == 1:
        valid[0, :T // 2] = True
    q_slots = np.arange(S, dtype=np.int32) + max(T - S - 3, 0)  # slots past the queries: causal
    return q, k, v, AttentionMask(q_slots=jnp.asarray(q_slots), valid=jnp.asarray(valid))


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_over_the_cache_equals_softmax_attention_in_float64(shape):
    """attend_cache reads layer l of the cache in place and matches float64 attention over that
    layer within 2e-6: the scores are O(1) (q, k standard normal, divided by sqrt(H)) and the
    output a convex combination of O(1) values, so float32 rounding in the H-term dot products,
    the exp and the weighted sum stays near 1e-6 (measured: under 5e-7). Reading the wrong layer
    or ignoring the mask fails by O(1)."""
    q, k, v, mask = attention_case(shape)
    f = jax.jit(kernels.attend_cache)
    for layer in range(shape[0]):
        want = attention_float64(q, k[layer], v[layer], mask.q_slots, mask.valid)
        np.testing.assert_allclose(np.asarray(f(q, k, v, layer, mask)), want, rtol=0, atol=2e-6)
    other = attention_float64(q, k[-1], v[-1], mask.q_slots, mask.valid)
    if shape[0] > 1:  # the negative case: another layer's keys and values
        assert np.abs(np.asarray(f(q, k, v, 0, mask)) - other).max() > 1e-2
    unmasked = attention_float64(q, k[0], v[0], mask.q_slots, np.ones_like(mask.valid))
    if shape[5] > 1:  # and the mask ignored (with one slot there is nothing to mask)
        assert np.abs(np.asarray(f(q, k, v, 0, mask)) - unmasked).max() > 1e-2


def test_attention_rows_do_not_depend_on_the_batch():
    """A row's attention is the same bits alone as beside others, and with the cache's other
    rows changed: each (row, kv head) is one unit that reads only its own slots."""
    q, k, v, mask = attention_case((2, 4, 3, 3, 1, 130, 64), seed=5)
    f = jax.jit(kernels.attend_cache)
    together = np.asarray(f(q, k, v, 1, mask))
    from jax_llama.model.attention import AttentionMask
    for b in range(4):
        alone = AttentionMask(q_slots=mask.q_slots, valid=mask.valid[b:b + 1])
        got = np.asarray(f(q[b:b + 1], k[:, b:b + 1], v[:, b:b + 1], 1, alone))[0]
        np.testing.assert_array_equal(got, together[b])


def test_attention_in_a_long_cache_reads_its_filled_slots_with_the_bits_of_all():
    """A decode step in a cache of 8,192 slots of which the first 21 are filled: the kernel
    stops at the query's own slot (rounded up to whole vectors), and gives the bits of the same
    step in a cache of 32 slots (the slots between add exact zeros), within float32 of the
    float64 softmax. A query with no slot to see (none valid up to its own) gets the uniform
    average of every slot, as xla's attention gives it."""
    from jax_llama.model.attention import AttentionMask
    rng = np.random.default_rng(8)
    B, K, G, S, H, T, filled = 2, 2, 3, 1, 64, 8192, 21
    q = rng.standard_normal((B, K, G, S, H)).astype(np.float32)
    k, v = (rng.standard_normal((2, B, K, T, H)).astype(np.float32) for _ in "kv")
    valid = np.zeros((B, T), bool)
    valid[:, :filled] = True
    valid[1, :3] = False  # row 1: left padding
    slots = np.array([filled - 1], np.int32)
    f = jax.jit(kernels.attend_cache)
    got = np.asarray(f(q, k, v, 1, AttentionMask(slots, valid)))
    short = np.asarray(f(q, k[..., :32, :], v[..., :32, :], 1, AttentionMask(slots, valid[:, :32])))
    np.testing.assert_array_equal(got, short)
    sc = np.einsum("bkgsh,bkth->bkgst", q.astype(float), k[1, :, :, :filled]) / np.sqrt(H)
    sc = np.where(valid[:, None, None, None, :filled], sc, -np.inf)
    pr = np.exp(sc - sc.max(-1, keepdims=True))
    want = np.einsum("bkgst,bkth->bkgsh", pr / pr.sum(-1, keepdims=True), v[1, :, :, :filled])
    assert np.abs(got - want).max() <= 2e-6
    nothing = np.zeros((B, T), bool)
    nothing[:, filled + 5] = True  # valid, but after the query's slot: not seen
    uniform = np.asarray(f(q, k, v, 1, AttentionMask(slots, nothing)))
    np.testing.assert_allclose(uniform, np.broadcast_to(v[1].mean(2)[:, :, None, None], got.shape),
                               rtol=0, atol=1e-5)


def test_attention_gradient_is_xlas_and_what_it_serves():
    from jax_llama.model.attention import AttentionMask, attend
    q, k, v, mask = attention_case((2, 2, 2, 2, 1, 40, 16), seed=6)
    g = np.random.default_rng(7).standard_normal(q.shape).astype(np.float32)
    got = jax.grad(lambda q, k, v: jnp.sum(kernels.attend_cache(q, k, v, 1, mask) * g),
                   argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda q, k, v: jnp.sum(attend(q, k[1], v[1], mask, "xla") * g),
                    argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # the same XLA function: exact
    assert kernels.usable_attention(jnp.asarray(q), jnp.asarray(k), mask)
    assert not kernels.usable_attention(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k), mask)
    assert not kernels.usable_attention(jnp.zeros((9, 2, 2, 1, 16)), jnp.asarray(k), mask)
    segmented = AttentionMask(q_slots=mask.q_slots, valid=mask.valid,
                              q_segments=jnp.zeros((2, 1), jnp.int32),
                              k_segments=jnp.zeros((2, 40), jnp.int32))
    assert not kernels.usable_attention(jnp.asarray(q), jnp.asarray(k), segmented)


def test_a_cached_decode_step_reads_each_layer_with_one_attention_call():
    """With a KV cache, a float32 step's attention is one kernel call a layer; bfloat16 keeps
    XLA's; an explicit attention="chunked" is respected."""
    import jax_llama
    from bridge.config import PRESETS
    from jax_llama.model import KVCache
    config = PRESETS["tiny"]
    tokens = jnp.zeros((1, 1), jnp.int32)

    def jaxpr(dtype=jnp.float32, attention="auto"):
        model, params = jax_llama.init(config, seed=0, dtype=dtype, attention=attention)
        cache = KVCache.create(config, 1, 16, dtype)
        return str(jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens, cache=cache,
                                                        method="run"))(params))
    assert jaxpr().count("jax_llama_decode_attention") == config.n_layers
    assert "jax_llama_decode_attention" not in jaxpr(jnp.bfloat16)
    assert "jax_llama_decode_attention" not in jaxpr(attention="chunked")


def test_the_kernels_choice_chooses_how_a_decode_step_runs(monkeypatch):
    """kernels="xla" keeps every projection and the cached attention on XLA, "kernels" and
    "auto" (here, where they load) run them on the decode kernels; a bad name, and "kernels"
    where they cannot run, are refused naming the field; JAX_LLAMA_KERNELS=0 makes auto xla."""
    import jax_llama
    from bridge.config import PRESETS
    from bridge.errors import BridgeError
    from jax_llama.model import KVCache
    from jax_llama.model.projections import implementation
    config = PRESETS["tiny"]
    tokens = jnp.zeros((1, 1), jnp.int32)

    def calls(kernels):
        model, params = jax_llama.init(config, seed=0, kernels=kernels)
        cache = KVCache.create(config, 1, 16)
        return str(jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens, cache=cache,
                                                        method="run"))(params)).count("ffi_call")
    assert calls("xla") == 0
    assert calls("kernels") == calls("auto") == 5 * config.n_layers + 1
    assert implementation("auto") == implementation("kernels") == "kernels"
    with pytest.raises(BridgeError, match="kernels.*one of auto, xla, kernels"):
        jax_llama.init(config, kernels="fast")
    monkeypatch.setenv("JAX_LLAMA_KERNELS", "0")
    assert implementation("auto") == implementation("xla") == "xla"
    with pytest.raises(BridgeError, match="kernels.*JAX_LLAMA_KERNELS=0"):
        implementation("kernels")


def test_rows_do_not_depend_on_how_many_rows_share_the_call():
    """A row's output is the same bits whether it is decoded alone or beside 7 others (its sum
    runs in the same order whatever the row blocking): batch 1 and batch 8 decode the same."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 576)).astype(np.float32)
    w = rng.standard_normal((576, 1536)).astype(np.float32)
    q = rng.integers(-127, 128, (576, 1536)).astype(np.int8)
    scale = rng.random((1, 1536)).astype(np.float32)
    f = jax.jit(kernels.matvec)
    for args in ((w,), (q, scale)):
        together = np.asarray(f(x, *args))
        for m in range(8):
            np.testing.assert_array_equal(np.asarray(f(x[m:m + 1], *args))[0], together[m])


def test_gradients_are_xlas():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 80)), jnp.float32)
    q = jnp.asarray(rng.integers(-127, 128, (48, 80)), jnp.int8)
    scale = jnp.asarray(rng.random((1, 80)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, 80)), jnp.float32)

    def loss(f):
        return lambda *a: jnp.sum(f(*a) * g)
    got = jax.grad(loss(kernels.matvec), argnums=(0, 1))(x, w)
    want = jax.grad(loss(jnp.dot), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # float32 sums in another order
    got = jax.grad(loss(kernels.matvec))(x, q, scale)
    want = jax.grad(loss(lambda x, q, s: (x @ q.astype(jnp.float32)) * s))(x, q, scale)
    # int8 weights up to 127: sums of terms up to ~300, so float32 rounding is ~1e-5 of that
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(jnp.abs(want).max()) * 48)
    # float32 weights that share x, one call: dx summed over them, and each dw
    w2 = jnp.asarray(rng.standard_normal((48, 80)), jnp.float32)
    got = jax.grad(lambda x, w, w2: loss(lambda *a: sum(kernels.matvec_f32(*a)))(x, [w, w2]),
                   argnums=(0, 1, 2))(x, w, w2)
    want = jax.grad(lambda x, w, w2: jnp.sum((x @ w + x @ w2) * g), argnums=(0, 1, 2))(x, w, w2)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # the float32 rows kernel (w stored (O, I), a tied head): dx and dw
    got = jax.jit(jax.grad(loss(kernels.matvec_rows), argnums=(0, 1)))(x, w.T)
    want = jax.grad(loss(lambda x, w: x @ w.T), argnums=(0, 1))(x, w.T)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # the rows kernel (q stored (O, I)): dx only, through jit too
    q_OI, scale_O1 = q.T, scale.T
    got = jax.jit(jax.grad(loss(kernels.matvec_rows)))(x, q_OI, scale_O1)
    want = jax.grad(loss(lambda x, q, s: x @ (q.astype(jnp.float32) * s).T))(x, q_OI, scale_O1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(jnp.abs(want).max()) * 80)
    # 4-bit weights: dx through the dequantised weight, none for the weights
    four, w4 = int4_weight(rng, 64, 80)
    x64 = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    got = jax.jit(jax.grad(lambda x: jnp.sum(kernels.matvec_int4(x, [four])[0] * g)))(x64)
    want = jax.grad(lambda x: jnp.sum((x @ w4.T) * g))(x64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_vmap_runs_each_slice():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 2, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 24)), jnp.float32)
    got = jax.vmap(kernels.matvec, in_axes=(0, None))(x, w)
    np.testing.assert_allclose(got, jnp.einsum("bmi,io->bmo", x, w), rtol=1e-5, atol=1e-5)


def test_usable_only_for_what_the_kernels_serve():
    x = jnp.zeros((1, 16), jnp.float32)
    assert kernels.usable(x, jnp.zeros((16, 8), jnp.float32))
    assert kernels.usable(x, jnp.zeros((16, 8), jnp.int8), jnp.ones((1, 8)))
    # float32 and int8 weights alike up to MAX_ROWS rows
    x8 = jnp.zeros((kernels.MAX_ROWS, 16), jnp.float32)
    assert kernels.usable(x8, jnp.zeros((16, 8), jnp.float32))
    assert kernels.usable(x8, jnp.zeros((16, 8), jnp.int8), jnp.ones((1, 8)))
    assert kernels.usable_rows(x8, jnp.zeros((8, 16), jnp.float32))
    assert kernels.usable_rows(x8, jnp.zeros((8, 16), jnp.int8), jnp.ones((8, 1)))
    assert not kernels.usable(jnp.zeros((kernels.MAX_ROWS + 1, 16)), jnp.zeros((16, 8)))
    assert not kernels.usable(x.astype(jnp.bfloat16), jnp.zeros((16, 8), jnp.bfloat16))
    assert kernels.usable(x, jnp.zeros((16, 8), jnp.int8), jnp.ones((2, 8)))  # group-wise
    assert not kernels.usable(x, jnp.zeros((16, 8), jnp.int8), jnp.ones((3, 8)))  # 3 does not divide 16
    assert not kernels.usable(x, jnp.zeros((16, 8), jnp.int8), jnp.ones((2, 7)))
    q_OI, scale_O1 = jnp.zeros((8, 16), jnp.int8), jnp.ones((8, 1))
    assert kernels.usable_rows(x, q_OI, scale_O1)
    assert not kernels.usable_rows(x, q_OI, jnp.ones((8, 2)))  # groups of 8: not whole vectors
    assert not kernels.usable_rows(jnp.zeros((kernels.MAX_ROWS + 1, 16)), q_OI, scale_O1)
    assert not kernels.usable_rows(x.astype(jnp.float16), q_OI, scale_O1)
    assert not kernels.usable_rows(x, q_OI.astype(jnp.float32), scale_O1)  # scales: int8 only
    assert kernels.usable_rows(x, q_OI.astype(jnp.float32))  # a float32 table
    assert not kernels.usable_rows(x, q_OI.astype(jnp.bfloat16))
    assert not kernels.usable_rows(x, q_OI)  # int8 without its scales
    assert not kernels.usable_rows(x, q_OI.T, jnp.ones((16, 1)))  # stored (I, O): not rows
    # 4-bit: its rows, packed (O, I / 2) uint8 with float16 scales and minima (O, I / 32)
    x32 = jnp.zeros((2, 64), jnp.float32)
    packed, d = jnp.zeros((8, 32), jnp.uint8), jnp.ones((8, 2))
    assert kernels.usable(x32, packed, d, d)
    assert not kernels.usable(x32, packed, d, jnp.ones((8, 1)))  # minima of another shape
    assert not kernels.usable(x32, packed, d.astype(jnp.float16), d)  # float16 scales
    assert not kernels.usable(x32, packed.astype(jnp.int8), d, d)
    assert not kernels.usable(x32, packed.T, d.T, d.T)  # stored (I / 2, O): not rows
    assert not kernels.usable(jnp.zeros((2, 48)), jnp.zeros((8, 24), jnp.uint8),
                              jnp.ones((8, 1)), jnp.ones((8, 1)))  # 48 inputs: not groups of 32


def test_decoding_gives_the_same_tokens_with_and_without_the_kernels(tmp_path):
    """Greedy tokens of a small model, float32, int8 and 4-bit, batch 1 and 3 (and int8 and
    4-bit after a 40-token prompt: the prompt kernels' prefill), in two processes: one with the
    kernels, one with JAX_LLAMA_KERNELS=0 (XLA's matmuls); and in each, the same model with
    kernels="xla"."""
    script = (
        "import dataclasses, json, jax_llama\n"
        "from bridge.config import PRESETS\n"
        "from jax_llama.model import kernels\n"
        "from jax_llama.inference.generate import generate\n"
        "config = dataclasses.replace(PRESETS['tiny'], ffn_dim=192)  # groups of 32\n"
        "model, params = jax_llama.init(config, seed=0)\n"
        "out = {'kernels': kernels.unavailable_reason() is None}\n"
        "for name, p in (('f32', params), ('int8', jax_llama.quantize(params)),\n"
        "                ('int4', jax_llama.quantize(params, method='int4'))):\n"
        "    for batch in (1, 3):\n"
        "        prompts = [[5, 9, 2, 7][: 2 + b] for b in range(batch)]\n"
        "        out[f'{name}/{batch}'] = generate(model, p, prompts, 12).tokens\n"
        "        xla = model.clone(projections=model.projections.replace(kernels='xla'))\n"
        "        out[f'{name}/{batch}/xla'] = generate(xla, p, prompts, 12).tokens\n"
        "long = [[(7 * i) % 200 + 3 for i in range(40)]]  # past PROMPT_ROWS: the prompt kernel\n"
        "for name, p in (('int8', jax_llama.quantize(params)),\n"
        "                ('int4', jax_llama.quantize(params, method='int4'))):\n"
        "    out[f'{name}/long'] = generate(model, p, long, 12).tokens\n"
        "    out[f'{name}/long/xla'] = generate(xla, p, long, 12).tokens\n"
        "print(json.dumps(out))\n")
    runs = {}
    for flag in ("1", "0"):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=dict(os.environ, JAX_LLAMA_KERNELS=flag), check=True)
        runs[flag] = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert runs["1"].pop("kernels") is True and runs["0"].pop("kernels") is False
    assert runs["1"] == runs["0"]
    assert all(tokens == runs["1"][key.removesuffix("/xla")] for key, tokens in runs["1"].items())


def test_a_failed_build_says_why_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    out = tmp_path / "k.so"
    with pytest.raises(RuntimeError, match="false failed"):
        kernels.library.compile_library(kernels.VARIANTS[-1], out)
    assert list(tmp_path.iterdir()) == []


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("JAX_LLAMA_KERNELS", "0")
    assert kernels.unavailable_reason() == "off (JAX_LLAMA_KERNELS=0)"
    assert not kernels.usable(jnp.zeros((1, 16)), jnp.zeros((16, 8)))
    with pytest.raises(RuntimeError, match="JAX_LLAMA_KERNELS=0"):
        kernels.matvec(jnp.zeros((1, 16)), jnp.zeros((16, 8)))
    rows = (jnp.zeros((1, 16)), jnp.zeros((8, 16), jnp.int8), jnp.ones((8, 1)))
    assert not kernels.usable_rows(*rows)
    with pytest.raises(RuntimeError, match="JAX_LLAMA_KERNELS=0"):
        kernels.matvec_rows(*rows)


ISAS = {"x86-64-v3": 8, "x86-64": 1}  # -march -> lanes: the AVX2 path and the plain C++ one


@pytest.mark.slow
@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="x86-64 -march names")
@pytest.mark.parametrize("arch", ISAS)
def test_every_instruction_set_path_computes_the_same_products(arch, tmp_path):
    """The kernels built for AVX2 and for no vector extension (what CPUs without AVX-512 or
    without AVX2 compile) pass the same float32 bound (the 4-bit kernel: the float32 rows kernel's
    bits on the dequantised weight, its float16 scales the bits of the same values in float32)
    and give each row the same bits alone or
    beside others (the rows kernel too, given the same weights stored (O, I); attention over a
    cache, with each build's own exp, to the same tolerance as AVX-512's); in a
    subprocess each, JAX_LLAMA_KERNEL_MARCH choosing the variant."""
    script = (
        "import json, numpy as np, jax\n"
        "from jax_llama.model import kernels\n"
        "rng = np.random.default_rng(0)\n"
        "worst = 0.0\n"
        "for M, I, O in [(1, 576, 576), (3, 1536, 72), (5, 17, 13), (2, 2048, 2048)]:\n"
        "    x = rng.standard_normal((M, I)).astype(np.float32)\n"
        "    q = rng.integers(-127, 128, (I, O)).astype(np.int8)\n"
        "    s = (rng.random((1, O)) / 127).astype(np.float32)\n"
        "    w = rng.standard_normal((I, O)).astype(np.float32)\n"
        "    rows = (np.ascontiguousarray(q.T), np.ascontiguousarray(s.T))\n"
        "    if I % 32 == 0:\n"
        "        four = (rng.integers(0, 256, (O, I // 2)).astype(np.uint8),\n"
        "                (rng.random((O, I // 32)) / 8).astype(np.float16).astype(np.float32),\n"
        "                rng.standard_normal((O, I // 32)).astype(np.float16).astype(np.float32))\n"
        "        half = (four[0], four[1].astype(np.float16), four[2].astype(np.float16))\n"
        "        from bridge.int4 import dequantize_int4\n"
        "        y4 = np.asarray(kernels.matvec_int4(x, [four])[0])\n"
        "        assert np.array_equal(y4, np.asarray(kernels.matvec_int4(x, [half])[0]))\n"
        "        w4 = dequantize_int4(*four)\n"
        "        assert np.array_equal(y4, np.asarray(kernels.matvec_rows(x, w4))), (M, I, O)\n"
        "        import os; os.environ['JAX_LLAMA_INT4_ACTIVATIONS'] = 'int8'\n"
        "        xg = x.reshape(M, I // 32, 32)  # tests' quantise_q8: no group is all zero\n"
        "        dx = np.abs(xg).max(-1) * np.float32(1 / 127)\n"
        "        xq = np.clip(np.rint(xg * (np.float32(1) / dx)[..., None]), -127, 127)\n"
        "        xd = (xq * dx[..., None].astype(float)).reshape(M, I)\n"
        "        y8 = np.asarray(kernels.matvec_int4(x, [four])[0])\n"
        "        assert np.all(abs(y8 - xd @ w4.T.astype(float))\n"
        "                      <= I * 1.2e-7 * (abs(xd) @ abs(w4.T.astype(float)))), (M, I, O)\n"
        "        assert np.array_equal(y8[-1], np.asarray(kernels.matvec_int4(x[-1:], [four])[0])[0])\n"
        "        assert np.array_equal(y8, np.asarray(kernels.matvec_int4(x, [half])[0]))\n"
        "        del os.environ['JAX_LLAMA_INT4_ACTIVATIONS']\n"
        "        x19 = rng.standard_normal((19, I)).astype(np.float32)  # a prefill: in chunks\n"
        "        y19 = np.asarray(kernels.matvec_int4(x19, [four])[0])\n"
        "        assert np.array_equal(y19, np.asarray(kernels.matvec_int4(x19, [half])[0]))\n"
        "        q40 = (half[0], half[1], np.float16(-8) * half[1])  # Q4_0: no minima held\n"
        "        for xs in (x, x19):\n"
        "            for a in ('float32', 'int8'):\n"
        "                os.environ['JAX_LLAMA_INT4_ACTIVATIONS'] = a\n"
        "                assert np.array_equal(np.asarray(kernels.matvec_int4(xs, [q40])[0]),\n"
        "                    np.asarray(kernels.matvec_int4(xs, [q40[:2] + (None,)])[0])), a\n"
        "            del os.environ['JAX_LLAMA_INT4_ACTIVATIONS']\n"
        "        assert all(np.array_equal(y19[i:i + 8], np.asarray(kernels.matvec_rows(\n"
        "            x19[i:i + 8], w4))) for i in (0, 8, 16)), (M, I, O)\n"
        "    for f, args, want, mag in (\n"
        "            (kernels.matvec, (q, s), (x.astype(float) @ q) * s, (abs(x) @ abs(q)) * s),\n"
        "            (kernels.matvec, (w,), x.astype(float) @ w, abs(x) @ abs(w)),\n"
        "            (kernels.matvec_rows, rows, (x.astype(float) @ q) * s, (abs(x) @ abs(q)) * s),\n"
        "            (kernels.matvec_rows, (np.ascontiguousarray(w.T),), x.astype(float) @ w,\n"
        "             abs(x) @ abs(w))):\n"
        "        got = np.asarray(f(x, *args), float)\n"
        "        worst = max(worst, float((abs(got - want) / (I * 1.2e-7 * mag + 1e-30)).max()))\n"
        "        alone = np.asarray(f(x[-1:], *args))[0]\n"
        "        assert np.array_equal(alone, np.asarray(got[-1], np.float32)), (f, M, I, O)\n"
        "from jax_llama.model.attention import AttentionMask\n"
        "attention = 0.0\n"
        "for B, K, G, S, T, H in [(2, 3, 3, 1, 144, 64), (1, 2, 2, 3, 37, 20)]:\n"
        "    q = rng.standard_normal((B, K, G, S, H)).astype(np.float32)\n"
        "    k, v = (rng.standard_normal((2, B, K, T, H)).astype(np.float32) for _ in 'kv')\n"
        "    valid = rng.random((B, T)) < 0.8\n"
        "    slots = np.arange(S, dtype=np.int32) + T - S - 3\n"
        "    got = np.asarray(kernels.attend_cache(q, k, v, 1, AttentionMask(slots, valid)))\n"
        "    sc = np.einsum('bkgsh,bkth->bkgst', q.astype(float), k[1]) / np.sqrt(H)\n"
        "    ok = (np.arange(T)[None] <= slots[:, None])[None] & valid[:, None]\n"
        "    sc = np.where(ok[:, None, None], sc, -np.inf)\n"
        "    p = np.exp(sc - sc.max(-1, keepdims=True))\n"
        "    want = np.einsum('bkgst,bkth->bkgsh', p / p.sum(-1, keepdims=True), v[1])\n"
        "    attention = max(attention, float(abs(got - want).max()))\n"
        "    alone = kernels.attend_cache(q[-1:], k[:, -1:], v[:, -1:], 1,\n"
        "                                 AttentionMask(slots, valid[-1:]))\n"
        "    assert np.array_equal(np.asarray(alone)[0], got[-1])\n"
        "print(json.dumps({'lanes': kernels.lanes(), 'worst': worst, 'attention': attention}))\n")
    env = dict(os.environ, JAX_LLAMA_KERNELS="1", JAX_LLAMA_KERNEL_MARCH=arch)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert out["lanes"] == ISAS[arch]
    assert out["worst"] <= 1.0  # every output within I * eps32 * sum |x w| of the float64 product
    assert out["attention"] <= 2e-6  # as test_attention_over_the_cache_equals_softmax_..._float64


def test_the_generate_command_names_its_kernels_and_gives_the_same_text(tmp_path, capsys):
    """--kernels is said on stderr (one line, after the model is loaded); xla and kernels write
    the same greedy text; a bad name is one error line naming the flag, before any weight is
    read."""
    from conftest import save_random_checkpoint, small_config
    from llama_twins.cli import main as jax_cli
    save_random_checkpoint(tmp_path / "m", small_config(vocab_size=259), tokenizer=True)
    out = {}
    for choice in ("kernels", "xla"):
        assert jax_cli.main(["generate", str(tmp_path / "m"), "--prompt", "hi",
                             "--max-new-tokens", "6", "--kernels", choice]) == 0
        captured = capsys.readouterr()
        out[choice] = captured.out
        assert captured.err.splitlines() == [
            f"projections and cached attention: {choice} (--kernels {choice})"]
    assert out["kernels"] == out["xla"] and out["xla"].strip()
    assert jax_cli.main(["generate", str(tmp_path / "m"), "--prompt", "hi",
                         "--kernels", "fast"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --kernels: 'fast': expected one of auto, xla, kernels"]

