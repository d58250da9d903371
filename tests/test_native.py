"""bridge/native: the loading passes compiled (loading.cc), each giving numpy's bytes.

Both twins' loads, and the converter, run them where `jax-llama kernels build` has built them
(bridge.native.build); these tests build them where a C++ compiler is at hand and skip, saying why,
where none is. A compiler that refuses the source is a failure."""

from __future__ import annotations

import numpy as np
import pytest

from bridge import native


@pytest.fixture(scope="module")
def compiled():
    """bridge.gguf.native's compiled Helpers, built here if need be."""
    from bridge.gguf.native import helpers

    if native.compiler() is None:
        pytest.skip("no C++ compiler: loads run numpy's code")
    why = native.build()
    if why is not None:
        pytest.fail(f"bridge/native/loading.cc did not compile: {why}")
    if native.library() is None:
        pytest.skip("JAX_LLAMA_KERNELS=0 turns the compiled passes off")
    made = helpers()
    assert made.from_q4_blocks is not None
    return made


def _f16_bits(rng, n, low=-3.0, high=3.0):
    """n finite float16 scales' bytes (2 a scale)."""
    return rng.uniform(low, high, n).astype(np.float16).view(np.uint8).reshape(n, 2)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_compiled_q4_repacking_gives_numpys_bytes(kind, compiled):
    """bridge/native's from_q4_blocks (what both twins' loads run where it is built) writes
    numpy's bytes exactly, scales and minima
    included (any float16 bits: NaN and infinity are copied, not computed), in arrays aligned for
    XLA to hold as they are. Negative case: the blocks' own nibble order is not the layout's."""
    from bridge.gguf.int4 import BLOCK_BYTES, from_q4_blocks
    from bridge.gguf.native import Helpers, using

    rng = np.random.default_rng(7)
    O, I = 37, 96
    raw = rng.integers(0, 256, O * I // 32 * BLOCK_BYTES[kind], dtype=np.uint8)
    if kind == "Q4_0":  # Q4_0's scales within 8188 (the reader refuses larger ones)
        raw.reshape(-1, 18)[:, :2] = _f16_bits(rng, O * I // 32)
    with using(Helpers()):  # numpy's code
        numpy_ = from_q4_blocks(raw, kind, (O, I), chunk_bytes=200)
    with using(compiled):
        made = from_q4_blocks(raw, kind, (O, I), chunk_bytes=200)
    for a, b in zip(numpy_, made):
        assert (a is None) == (b is None)
        if a is not None:
            assert b.ctypes.data % 64 == 0
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    stored = raw.reshape(O, I // 32, -1)[..., -16:].reshape(O, I // 2)
    assert not np.array_equal(stored, made[0])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q6_K", "Q4_K"])
def test_compiled_int8_rows_give_numpys_bytes(kind, compiled):
    """bridge/native's int8_rows makes a Q8_0 or Q4_0 tensor's int8 rows and scales straight
    from its blocks with the bytes bridge.quantize.quantize_weight makes from the dequantised
    rows (a row of zeros: scale 1), and the error's squared sums to float32 rounding (float64
    sums in another order). Negative case: the weights truncated, not rounded, differ."""
    from bridge.gguf.native import INT8_ROWS_KINDS
    from bridge.gguf.read import _dequantize_plain, _dequantize_q4_k, _dequantize_q6_k
    from bridge.quantize import dequantize_weight, quantize_weight

    rng = np.random.default_rng(3)
    O, I = 41, 512
    weights, size = INT8_ROWS_KINDS[kind]
    blocks = rng.integers(0, 256, (O, I // weights, size), dtype=np.uint8)
    fields = {"Q8_0": [0], "Q4_0": [0], "Q6_K": [208], "Q4_K": [0, 2]}[kind]
    for at in fields:  # finite float16 scales
        blocks[..., at:at + 2] = _f16_bits(rng, O * I // weights).reshape(O, I // weights, 2)
    if kind in ("Q8_0", "Q4_0"):  # a row of zeros
        blocks[5, :, 2:] = 0 if kind == "Q8_0" else 0x88
    else:
        blocks[5, :, fields[0]:fields[0] + 2] = 0
        blocks[5, :, 2:4] = 0  # Q4_K's dmin
    raw = blocks.reshape(O, -1)
    w = (_dequantize_plain(raw, kind) if kind in ("Q8_0", "Q4_0") else
         _dequantize_q6_k(raw) if kind == "Q6_K" else _dequantize_q4_k(raw))
    assert not w[5].any()
    if kind in ("Q6_K", "Q4_K"):  # the numpy dequantisation is gguf's own, bit for bit
        import gguf
        np.testing.assert_array_equal(
            w, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(O, I))
    q_ref, s_ref = quantize_weight(w)
    q, s = np.empty((O, I), np.int8), np.empty((O, 1), np.float32)
    change, norm = compiled.int8_rows(raw, kind, q, s)
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(s.view(np.uint32), s_ref.view(np.uint32))
    assert s[5, 0] == 1 and not q[5].any()
    diff = dequantize_weight(q_ref, s_ref).astype(np.float64) - w
    np.testing.assert_allclose([change, norm], [np.sum(diff * diff), np.sum(w.astype(np.float64) ** 2)],
                               rtol=1e-5)
    truncated = np.clip(np.trunc(w / s_ref), -127, 127).astype(np.int8)
    assert not np.array_equal(truncated, q)


def test_compiled_q4_k_gives_numpys_bytes(compiled):
    """bridge/native's from_q4_k_blocks writes bridge.gguf.int4.from_q4_k_blocks's bytes
    (the q as stored, each scale d sc_j and minimum -dmin m_j rounded to float16, scales large
    and small: float16's subnormals, a rounding to infinity refused the same way) and its error
    sums to float64 rounding. Negative case: the 6-bit sc_j read from the wrong bytes (the
    minima's) changes the scales."""
    from bridge.errors import BridgeError
    from bridge.gguf.int4 import Q4_K_BYTES, from_q4_k_blocks
    from bridge.gguf.native import Helpers, using

    rng = np.random.default_rng(11)
    O, I = 13, 512
    blocks = rng.integers(0, 256, (O, I // 256, Q4_K_BYTES), dtype=np.uint8)
    d = np.concatenate([rng.uniform(-1, 1, 12), rng.uniform(-3e-6, 3e-6, 14)])
    blocks[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(O, I // 256, 2)
    blocks[..., 2:4] = rng.uniform(-1, 1, O * I // 256).astype(np.float16).view(
        np.uint8).reshape(O, I // 256, 2)
    raw = blocks.reshape(-1)
    with using(Helpers()):  # numpy's code
        numpy_ = from_q4_k_blocks(raw, (O, I), chunk_bytes=300)
    with using(compiled):
        made = from_q4_k_blocks(raw, (O, I), chunk_bytes=300)
    for a, b in zip(numpy_[:3], made[:3]):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    np.testing.assert_allclose(made[3:], numpy_[3:], rtol=1e-9)
    assert np.any(numpy_[1].view(np.uint16) & 0x7C00 == 0)  # subnormal scales among them
    swapped = blocks.copy()
    swapped[..., 4:8], swapped[..., 8:12] = blocks[..., 8:12], blocks[..., 4:8]
    with using(compiled):
        assert not np.array_equal(from_q4_k_blocks(swapped.reshape(-1), (O, I))[1], made[1])
    huge = blocks.copy()
    huge[0, 0, 0:2] = np.array([60000], np.float16).view(np.uint8)
    huge[0, 0, 4] = 63  # sc_0 = 63: 60000 x 63 beyond float16
    for helpers in (Helpers(), compiled):
        with using(helpers), pytest.raises(BridgeError, match="beyond float16"):
            from_q4_k_blocks(huge.reshape(-1), (O, I))


def _gguf_with_strings(path, strings: list[bytes], claimed: int | None = None):
    """A GGUF v3 file whose one key holds `strings` (raw bytes, each length-prefixed), its count
    `claimed` (default their number) and a second key after it."""
    import struct
    body = b"".join(struct.pack("<Q", len(s)) + s for s in strings)
    key = lambda name: struct.pack("<Q", len(name)) + name  # noqa: E731
    data = (b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
            + key(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, claimed or len(strings))
            + body + key(b"general.name") + struct.pack("<I", 8) + key(b"after"))
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("strings", [
    [b"a", b"", "\u00e9t\u00e9 \u2581the".encode(), b"\n", "\U0001f600".encode()] * 50,
    [b"zero\x00inside", b"b"],  # a zero byte: the strings are read one by one, the same
])
def test_a_string_array_reads_the_same_compiled_and_in_python(strings, compiled, tmp_path):
    """A GGUF string array (a vocabulary) is walked by loading.cc's string_ends and decoded at
    once: the same strings, and the key after it, as Python's loop reads them. Negative cases:
    a string that is not UTF-8 and one that runs past the end are refused by name both ways."""
    from bridge.errors import BridgeError
    from bridge.gguf.container import read_gguf
    from bridge.gguf.native import Helpers, using

    path = _gguf_with_strings(tmp_path / "v.gguf", strings)
    fast = read_gguf(path).fields
    with using(Helpers()):
        slow = read_gguf(path).fields
    assert fast == slow and fast["tokenizer.ggml.tokens"] == [s.decode() for s in strings]
    assert fast["general.name"] == "after"
    for name, bad, claimed in (("not UTF-8", [b"ok", b"\xe2\x82", b"\xac"], None),
                               ("past the end", [b"ok"], 1000)):
        path = _gguf_with_strings(tmp_path / f"{name}.gguf", bad, claimed)
        for chosen in (compiled, Helpers()):
            with using(chosen), pytest.raises(BridgeError, match="truncated or corrupt"):
                read_gguf(path)
