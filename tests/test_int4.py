"""4-bit weights (bridge.int4): the arithmetic against float64, llama.cpp's Q4_0 and Q4_1 blocks
held exactly, a JAX model on 4-bit params equal to the same model on the weights they stand for,
both twins on the same bits, and 4-bit checkpoints written and read back."""

from unittest import mock

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_llama
from bridge.errors import BridgeError
from bridge.gguf.int4 import from_q4_blocks
from bridge.int4 import GROUP, dequantize_int4, pack, quantize_int4, unpack
from conftest import random_tokens, small_config
from jax_llama.params import modules


def test_pack_round_trips_and_keeps_input_order():
    q = np.arange(64, dtype=np.uint8).reshape(2, 32) % 16
    packed = pack(q)
    assert packed.shape == (2, 16) and packed[0, 0] == (0 | 1 << 4)  # q[0], q[1] share byte 0
    np.testing.assert_array_equal(unpack(packed), q)


def test_quantize_int4_is_within_half_a_step_of_float64():
    """|W - (q d + m)| <= d / 2 for each weight, computed in float64 from the float16 d and m
    (q chosen with d and m as rounded); the float32 dequantisation adds at most one rounding of
    the product and one of the sum (2 ulp of the group's largest magnitude)."""
    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    w[3, :32] = 0.5  # a constant group: d = 1, every q 0, exact
    packed, d, m = quantize_int4(w)
    assert packed.shape == (24, 48) and packed.dtype == np.uint8 and d.shape == m.shape == (24, 3)
    assert d.dtype == m.dtype == np.float16  # 0.625 bytes a weight, as llama.cpp's Q4_1
    q = unpack(packed).reshape(24, 3, GROUP).astype(np.float64)
    exact = q * d[..., None].astype(np.float64) + m[..., None].astype(np.float64)
    step = d[..., None].astype(np.float64)
    assert np.all(np.abs(w.reshape(24, 3, GROUP) - exact) <= step / 2 * (1 + 1e-6))
    ulp = np.spacing(np.abs(w).reshape(24, 3, GROUP).max(-1, keepdims=True))
    got = dequantize_int4(packed, d, m).reshape(24, 3, GROUP)
    assert np.all(np.abs(got - exact) <= 2 * ulp)
    np.testing.assert_array_equal(got[3, 0], 0.5)
    # negative: the nibbles read in the wrong order put weights a step or more away
    swapped = np.stack([packed >> 4, packed & 0xF], axis=-1).reshape(24, 96)
    wrong = (swapped.reshape(24, 3, GROUP) * d[..., None] + m[..., None])
    assert np.abs(w.reshape(24, 3, GROUP) - wrong).max() > step.max()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_llama_cpps_4_bit_blocks_are_held_exactly(kind):
    """gguf's own quantiser and dequantiser (llama.cpp's reference rounding, in numpy) against
    our layout: the same float32 weights, bit for bit."""
    w = np.random.default_rng(1).standard_normal((8, 128)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(w, qtype)
    theirs = gguf.quants.dequantize(raw, qtype)
    packed, d, m = from_q4_blocks(raw, kind, w.shape)
    np.testing.assert_array_equal(dequantize_int4(packed, d, m), theirs)
    # negative: Q4_0 blocks read as Q4_1 are refused by size, and a block's halves swapped differ
    with pytest.raises(BridgeError, match="bytes of"):
        from_q4_blocks(raw, "Q4_1" if kind == "Q4_0" else "Q4_0", w.shape)
    q = unpack(packed).reshape(8, 4, 2, 16)[:, :, ::-1].reshape(8, 128)
    assert not np.array_equal(dequantize_int4(pack(q), d, m), theirs)
    # rows in chunks of a few blocks (a large tensor's way), and byte by byte (a big-endian
    # CPU's): the same bytes
    for chunk, order in ((50, "little"), (1 << 20, "big")):
        with mock.patch("sys.byteorder", order):
            again = from_q4_blocks(raw, kind, w.shape, chunk_bytes=chunk)
        assert all(np.array_equal(a, b) for a, b in zip(again, (packed, d, m)))


def test_refusals_name_the_weight():
    with pytest.raises(BridgeError, match="'wq': 48 input columns are not a multiple of"):
        quantize_int4(np.zeros((4, 48), np.float32), "wq")
    # values float16 scales cannot hold: beyond 65504, or not finite
    big = np.zeros((2, 32), np.float32)
    big[1, 3] = -7e4
    with pytest.raises(BridgeError, match="'w2': values beyond float16's range"):
        quantize_int4(big, "w2")
    big[1, 3] = np.nan
    with pytest.raises(BridgeError, match="'w2': values beyond float16's range"):
        quantize_int4(big, "w2")
    # a Q4_0 scale whose minimum -8 d float16 cannot hold
    block = np.zeros(18, np.uint8)
    block[:2] = np.array([9000], np.float16).view(np.uint8)
    with pytest.raises(BridgeError, match="'wo': a Q4_0 scale beyond 8188"):
        from_q4_blocks(block, "Q4_0", (1, 32), "wo")
    with pytest.raises(BridgeError, match="Q5_0 is not a 4-bit type held exactly"):
        from_q4_blocks(np.zeros(10, np.uint8), "Q5_0", (1, 32))


def dequantized(params):
    """The float32 params that 4-bit params stand for (bridge.int4's numbers), in the Flax
    layout: each kernel (in, out) = dequantize_int4 of its canonical rows, transposed."""
    out = jax.tree_util.tree_map(lambda x: x, params)
    for _, node in modules(out):
        if getattr(node.get("kernel"), "dtype", None) == np.uint8:  # "min" absent: -8 scale
            packed, d, m = (np.asarray(node.pop(k)) if k in node else None
                            for k in ("kernel", "scale", "min"))
            node["kernel"] = jax.numpy.asarray(dequantize_int4(packed, d, m).T)
    return out


def test_a_model_on_4_bit_params_is_the_model_on_their_weights():
    config = small_config(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97)
    model, params = jax_llama.init(config, seed=2)
    q = jax_llama.quantize(params, method="int4")
    wq = q["layers_0"]["attention"]["wq"]
    assert wq["kernel"].dtype == np.uint8 and wq["kernel"].shape == (64, 32)  # its rows
    assert wq["scale"].shape == wq["min"].shape == (64, 2)
    tokens = random_tokens(config)
    got = np.asarray(model.apply({"params": q}, tokens))
    want = np.asarray(model.apply({"params": dequantized(q)}, tokens))
    # the same float32 weights, dequantised inside the matmul or before it: XLA may fuse the
    # product and the sum (one rounding instead of two), so the weights may differ in their
    # last bit, and the logits by a few float32 ulps of their size
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    float_logits = np.asarray(model.apply({"params": params}, tokens))
    assert np.abs(got - float_logits).max() > 1e-3  # 4 bits do change the model
    # the decode loop runs on them, greedy tokens as the dequantised model's
    out = jax_llama.generate(model, q, [[1, 5, 9]], 6)
    assert out.tokens == jax_llama.generate(model, dequantized(q), [[1, 5, 9]], 6).tokens


@pytest.mark.parametrize("tied", [True, False])
def test_4_bit_params_are_saved_and_read_back_bit_for_bit_by_both_twins(tmp_path, tied):
    """jax_llama.save writes 4-bit params in the native format (config.json's quantization
    "int4"; each projection's uint8 rows, scale and minimum; a tied head's int8 rows); the torch
    twin reads them, saves them again, and JAX reads that back: the same bits all the way, and
    the twins' logits within float32 rounding of each other."""
    import json

    import torch

    import torch_llama
    from conftest import torch_logits

    config = small_config(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, tie_embeddings=tied)
    model, params = jax_llama.init(config, seed=2)
    q = jax_llama.quantize(params, method="int4")
    jax_llama.save(tmp_path / "jax", config, q)
    assert json.loads((tmp_path / "jax" / "config.json").read_text())["quantization"] == \
        {"method": "int4", "group_size": 32}
    tmodel = torch_llama.load(tmp_path / "jax", device="cpu")
    assert tmodel.layers[0].attention.wq.weight.dtype == torch.uint8
    torch_llama.save(tmp_path / "torch", tmodel)
    _, back = jax_llama.load(tmp_path / "torch")
    assert jax.tree.structure(back) == jax.tree.structure(q)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(back)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = random_tokens(config, 2, 9)
    ours = np.asarray(model.apply({"params": back}, jnp.asarray(tokens)))
    assert np.abs(ours - torch_logits(tmodel, tokens)).max() <= 1e-5 * max(1, np.abs(ours).max())


def test_minima_are_implied_only_where_every_one_is_minus_8_scale():
    """minima_implied looks at a weight's first minima before all of them (a Q4_K weight's
    answer, no, comes at once); a weight whose only odd minimum is its last, past that first
    look, is still seen to hold its own; None (a Q4_0 reader's) is implied."""
    from bridge.int4 import minima_implied

    d = np.random.default_rng(5).standard_normal((40, 96)).astype(np.float16)
    m = d * np.float16(-8)
    assert minima_implied(d, m) and minima_implied(d, None)
    for index in ((0, 0), (39, 95), (20, 7)):
        odd = m.copy()
        odd[index] += np.float16(1)
        assert not minima_implied(d, odd), index
    assert not minima_implied(d, m.astype(np.float32))  # another dtype: held as it is
    assert not minima_implied(d, m[:, :48])


def test_q4_0s_minima_are_held_by_neither_twin_and_saved_as_minus_8_scale(tmp_path):
    """4-bit weights whose minima are all -8 times their scales (llama.cpp's Q4_0) load without
    them in both twins (0.5625 bytes a weight), compute what they compute with them held (bit for
    bit in torch), and are saved with them (-8 scale) by both: the same file, tensor by tensor.
    Negative case: one minimum off -8 scale, and the weight's minima are held again."""
    import torch

    import torch_llama
    from bridge.formats import open_checkpoint
    from conftest import torch_logits

    config = small_config(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96)
    model, params = jax_llama.init(config, seed=3)
    q = jax_llama.quantize(params, method="int4")
    for _, node in modules(q):
        if "min" in node:
            node["min"] = node["scale"] * np.float16(-8)
    q["layers_1"]["attention"]["wo"]["min"] = q["layers_1"]["attention"]["wo"]["min"].at[0, 0].add(1)
    jax_llama.save(tmp_path / "jax", config, q)
    _, jq = jax_llama.load(tmp_path / "jax")
    tmodel = torch_llama.load(tmp_path / "jax", device="cpu")
    assert set(jq["layers_0"]["attention"]["wq"]) == {"kernel", "scale"}
    assert not hasattr(tmodel.layers[0].attention.wq, "weight_min")
    assert "min" in jq["layers_1"]["attention"]["wo"]  # the negative case
    assert tmodel.layers[1].attention.wo.weight_min.dtype == torch.float16
    tokens = random_tokens(config, 2, 9)
    logits = torch_logits(tmodel, tokens)
    held = torch_llama.load(tmp_path / "jax", device="cpu")
    for module in held.modules():
        if isinstance(module, torch_llama.projections.Linear) and not hasattr(module, "weight_min"):
            module.register_buffer("weight_min", module.weight_scale * -8)
    np.testing.assert_array_equal(torch_logits(held, tokens), logits)
    ours = np.asarray(model.apply({"params": jq}, jnp.asarray(tokens)))
    assert np.abs(ours - logits).max() <= 1e-5 * max(1, np.abs(ours).max())
    torch_llama.save(tmp_path / "torch", tmodel)
    a, b = open_checkpoint(tmp_path / "jax"), open_checkpoint(tmp_path / "torch")
    assert set(a.specs) == set(b.specs)
    for name in a.specs:
        np.testing.assert_array_equal(a.tensor(name), b.tensor(name))


def test_4_bit_checkpoints_with_float32_scales_still_load_as_they_are(tmp_path):
    """4-bit checkpoints saved before 2026-12-05 hold float32 scales and minima: both twins read
    them as stored (float32, not rounded to float16) and compute what the float16 ones do (the
    same values here: bit for bit in JAX, within float32 rounding across the twins). Negative: a
    float64 scale is refused, naming the tensor."""
    import shutil

    from safetensors.numpy import load_file, save_file

    import torch_llama
    from conftest import torch_logits

    config = small_config(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96)
    model, params = jax_llama.init(config, seed=3)
    jax_llama.save(tmp_path / "new", config, jax_llama.quantize(params, method="int4"))
    tensors = load_file(tmp_path / "new" / "model.safetensors")
    four = [n for n in tensors if n.endswith(("_scale", "_min")) and tensors[n].dtype == np.float16]
    assert len(four) == 2 * (7 * config.n_layers + 1)  # each projection's and the head's
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(tmp_path / "new" / "config.json", old / "config.json")
    save_file({n: t.astype(np.float32) if n in four else t for n, t in tensors.items()},
              old / "model.safetensors")
    _, new_params = jax_llama.load(tmp_path / "new")
    _, old_params = jax_llama.load(old)
    scale = old_params["layers_0"]["attention"]["wq"]["scale"]
    assert scale.dtype == jnp.float32  # held as stored
    tokens = random_tokens(config, 2, 7)
    want = np.asarray(model.apply({"params": new_params}, jnp.asarray(tokens)))
    got = np.asarray(model.apply({"params": old_params}, jnp.asarray(tokens)))
    np.testing.assert_array_equal(got, want)
    tmodel = torch_llama.load(old, device="cpu")
    assert tmodel.layers[0].attention.wq.weight_scale.dtype == torch_dtype("float32")
    assert np.abs(torch_logits(tmodel, tokens) - want).max() <= 1e-5 * max(1, np.abs(want).max())
    bad = old / "model.safetensors"
    save_file({n: t.astype(np.float64) if n == four[0] else t for n, t in tensors.items()}, bad)
    with pytest.raises(BridgeError, match=f"tensor '{four[0]}' has dtype float64"):
        jax_llama.load(old)


def torch_dtype(name):
    import torch
    return getattr(torch, name)


def tokenizer_of(gguf_file):
    """The tokenizer.json the random GGUF's native source was saved with."""
    return next(gguf_file.parent.glob("native/tokenizer.*"))


def test_4_bit_saves_and_loads_refuse_what_they_cannot_hold(tmp_path, gguf_files, capsys):
    """A mixture of 4-bit and int8 projections (a nearest load of a file with 8-bit tensors) is
    refused, naming a projection, with nothing written; so is a group size other than 32, a
    4-bit checkpoint whose weights are not uint8 (naming the tensor), --quantize int8 on a 4-bit
    checkpoint, and its conversion to another format (exit 2, one line)."""
    from safetensors.numpy import load_file, save_file

    from llama_twins.cli import main as jax_cli
    from llama_twins.cli.bridge_main import main as bridge_cli

    model, nearest = jax_llama.load(gguf_files["q8_0"], quantize="stored")  # int8 rows everywhere
    _, four = jax_llama.load(gguf_files["q4_0"], quantize="stored")  # Q4_0 layers, a Q8_0 head
    with pytest.raises(BridgeError, match="output: int8 beside 4-bit projections"):
        jax_llama.save(tmp_path / "mixed", model.config, four)
    assert not (tmp_path / "mixed").exists()
    with pytest.raises(BridgeError, match="groups of 32"):
        jax_llama.quantize(jax_llama.init(model.config)[1], group_size=64, method="int4")

    _, whole = jax_llama.load(gguf_files["q4_0"], quantize="int4")
    jax_llama.save(tmp_path / "q4", model.config, whole)
    assert jax_cli.main(["generate", str(tmp_path / "q4"), "--prompt", "hi", "--quantize",
                         "int8", "--max-new-tokens", "2", "--tokenizer",
                         str(tokenizer_of(gguf_files["q4_0"]))]) == 2
    assert "holds int4 weights (--quantize int8 reads a float or GGUF" in capsys.readouterr().err
    assert bridge_cli(["convert", str(tmp_path / "q4"), str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert "holds int4-quantised weights" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    tensors = load_file(tmp_path / "q4" / "model.safetensors")
    tensors["layers.1.feed_forward.w2.weight"] = tensors["layers.1.feed_forward.w2.weight"].view(
        np.int8)
    save_file(tensors, tmp_path / "q4" / "model.safetensors")
    with pytest.raises(BridgeError, match="tensor 'layers.1.feed_forward.w2.weight' has dtype "
                                          "int8, but config.json declares int4"):
        jax_llama.load(tmp_path / "q4")


def test_convert_writes_a_4_bit_checkpoint_as_a_4_bit_load_reads_it(tmp_path, gguf_files, capsys):
    """`llama-bridge convert SRC DST --to native --quantize int4`: a GGUF's Q4_0 blocks as they
    are, the rest quantised as read (said on stderr, with the error); the checkpoint holds the
    very params jax_llama.load(SRC, quantize="int4") makes, and generates the same greedy tokens."""
    from llama_twins.cli.bridge_main import main as bridge_cli

    assert bridge_cli(["convert", str(gguf_files["q4_0"]), str(tmp_path / "q4"), "--to",
                       "native", "--quantize", "int4", "--no-progress"]) == 0
    said = capsys.readouterr().err
    assert "14 Q4_0 -> int4 exactly" in said and "Q8_0 -> int4 quantised (error" in said
    model, stored = jax_llama.load(tmp_path / "q4")
    _, direct = jax_llama.load(gguf_files["q4_0"], quantize="int4")
    assert jax.tree.structure(stored) == jax.tree.structure(direct)
    for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(direct)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert bridge_cli(["convert", str(gguf_files["q4_0"]), str(tmp_path / "g"), "--to",
                       "native", "--quantize", "int4", "--group-size", "64"]) == 2
    assert "groups of 32" in capsys.readouterr().err and not (tmp_path / "g").exists()
    prompt = [[1, 5, 9, 2]]
    assert jax_llama.generate(model, stored, prompt, 5).tokens == \
        jax_llama.generate(model, direct, prompt, 5).tokens


def test_both_twins_compute_the_same_4_bit_model():
    """The same float weights, quantised by each twin (bridge.int4 both ways: the same bits),
    give the same logits; float32 tolerance of the twins' float parity (their matmuls sum in
    different orders), and a negative case: the float model is far from both."""
    import torch

    import torch_llama
    from conftest import torch_logits, torch_model

    config = small_config(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97)
    tmodel = torch_model(config, seed=4)
    with torch.no_grad():
        float_logits = torch_logits(tmodel, random_tokens(config))
    model, _ = jax_llama.init(config)
    params = jax_llama.checkpoint.params_from_tensors(
        lambda n: tmodel.state_dict()[n].numpy(), config)
    q = jax_llama.quantize(params, method="int4")
    torch_llama.quantize(tmodel, method="int4")
    wq = tmodel.layers[0].attention.wq
    np.testing.assert_array_equal(wq.weight.numpy(),
                                  np.asarray(q["layers_0"]["attention"]["wq"]["kernel"]))
    tokens = random_tokens(config)
    got = torch_logits(tmodel, tokens)
    np.testing.assert_allclose(got, np.asarray(model.apply({"params": q}, tokens)), rtol=0,
                               atol=2e-5)
    assert np.abs(got - float_logits).max() > 1e-3
    with pytest.raises(BridgeError, match="already quantised"):
        torch_llama.quantize(tmodel)


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
def test_both_twins_round_the_4_bit_activations_the_same_way(kind, monkeypatch):
    """JAX_LLAMA_INT4_ACTIVATIONS=int8 or bfloat16: the torch twin's 4-bit Linear rounds x as
    JAX's does (bit for bit) and so computes the same products to float32 rounding (1e-5 of the
    sum of |terms|), on XLA's path and on the decode kernel; float32 activations are outside
    that; the gradient in x passes straight through the rounding in both. (Compared a projection
    at a time: through a model's layers a last-bit difference can move an 8-bit input by a
    step.)"""
    import torch

    from jax_llama.model import kernels
    from jax_llama.model.projections import int4_matmul
    from torch_llama.projections import int4_linear, quantise_activations, round_to_bfloat16

    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    packed, d, m = quantize_int4(rng.standard_normal((48, 128)).astype(np.float32) * 0.05)
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", kind)
    rounding = {"int8": (quantise_activations, kernels.quantise_activations),
                "bfloat16": (round_to_bfloat16, kernels.round_to_bfloat16)}[kind]
    np.testing.assert_array_equal(rounding[0](torch.from_numpy(x)).numpy(),
                                  np.asarray(rounding[1](jnp.asarray(x))))
    xt = torch.from_numpy(x).requires_grad_()
    theirs = int4_linear(xt, *(torch.from_numpy(a) for a in (packed, d, m)))
    ours = {"xla": np.asarray(int4_matmul(jnp.asarray(x), packed, d, m, jnp.float32))}
    if kernels.unavailable_reason() is None:
        ours["kernel"] = np.asarray(kernels.matvec_int4(jnp.asarray(x), [(packed, d, m)])[0])
    w = dequantize_int4(packed, d, m).astype(np.float64)
    xd = np.asarray(rounding[1](jnp.asarray(x)), np.float64)
    scale = np.abs(xd) @ np.abs(w).T
    for path, y in ours.items():
        assert np.all(np.abs(theirs.detach().numpy() - y) <= 1e-5 * scale), path
    theirs.sum().backward()
    np.testing.assert_allclose(xt.grad.numpy(), np.ones((6, 48)) @ w, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "float32")
    plain = int4_linear(torch.from_numpy(x), *(torch.from_numpy(a) for a in (packed, d, m)))
    assert not np.all(np.abs(plain.numpy() - ours["xla"]) <= 1e-5 * scale)


def test_generation_takes_the_4_bit_activations_its_caller_chose(tmp_path, monkeypatch):
    """Both twins' generation runs 4-bit projections on the activations chosen for it: by
    default GENERATION_DEFAULT (bfloat16: its log-probabilities are the forward's under
    bfloat16, not the plain float32 forward's); within using_activations("int8") the forward's
    under int8; the environment decides over the caller; each choice is its own compiled program
    (the same call in one process gives each its numbers). The server's engine takes the choice
    of the context it is made in; bad choices are refused, naming the field."""
    import torch_llama
    from bridge.int4 import GENERATION_DEFAULT, generation_activations, using_activations
    from conftest import save_random_checkpoint
    from jax_llama.inference.serving import Engine

    monkeypatch.delenv("JAX_LLAMA_INT4_ACTIVATIONS", raising=False)
    config = small_config(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=259)
    ckpt = save_random_checkpoint(tmp_path / "ckpt", config, seed=3)
    model, params = jax_llama.load(ckpt)
    q = jax_llama.quantize(params, method="int4")
    prompt = [[1, 5, 9, 44]]

    def run():
        out = jax_llama.generate(model, q, prompt, 5)
        return out.tokens[0], np.array(out.logprobs[0])

    def first_logprob(kind, token):  # a first new token's log-probability under a forward
        with using_activations(kind):
            logits = np.asarray(model.apply({"params": q}, np.array(prompt, np.int32)))[0, -1]
        logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        return logp[token]

    assert generation_activations() == GENERATION_DEFAULT == "bfloat16"
    plain_tokens, plain = run()
    assert abs(plain[0] - first_logprob("bfloat16", plain_tokens[0])) < 1e-5
    assert abs(plain[0] - first_logprob("float32", plain_tokens[0])) > 1e-5
    with using_activations("float32"):  # x as it is, the plain forward's numbers
        f32_tokens, f32 = run()
    assert abs(f32[0] - first_logprob("float32", f32_tokens[0])) < 1e-5
    with using_activations("int8"):
        tokens, logps = run()
    assert abs(logps[0] - first_logprob("int8", tokens[0])) < 1e-5
    assert abs(logps[0] - first_logprob("float32", tokens[0])) > 1e-4  # the rounding shows
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "int8")
    with using_activations("float32"):  # the environment decides over the caller
        same_tokens, same = run()
    assert same_tokens == tokens and np.array_equal(same, logps)
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "bfloat16")
    assert run()[0] == plain_tokens and np.array_equal(run()[1], plain)
    monkeypatch.delenv("JAX_LLAMA_INT4_ACTIVATIONS")

    # the torch twin's generation: the same choice, the same greedy tokens and log-probs
    tq = torch_llama.quantize(torch_llama.load(ckpt, device="cpu"), method="int4")
    with using_activations("int8"):
        theirs = torch_llama.generate(tq, prompt, 5)
    assert theirs.tokens[0] == tokens
    np.testing.assert_allclose(theirs.logprobs[0], logps, rtol=0, atol=1e-4)
    assert abs(torch_llama.generate(tq, prompt, 5).logprobs[0][0] - plain[0]) < 1e-4

    with using_activations("int8"):
        assert (Engine(model, q).activations, generation_activations()) == ("int8", "int8")
    assert Engine(model, q).activations == "bfloat16"
    with pytest.raises(BridgeError,
                       match="activations: expected float32, int8 or bfloat16, got 'int4'"):
        with using_activations("int4"):
            pass
    monkeypatch.setenv("JAX_LLAMA_INT4_ACTIVATIONS", "int16")
    with pytest.raises(BridgeError,
                       match="JAX_LLAMA_INT4_ACTIVATIONS: expected float32, int8 or bfloat16"):
        generation_activations()


def test_smollm2s_q4_1_projections_load_as_4_bits_exactly(smollm2):
    """The real model's 210 Q4_1 projections read as the file holds them (no float copy), and its
    tied head (Q8_0 in the file) as int8 rows: its logits are those of the float model whose
    projections are the file's dequantised ones - the same float32 weights, the product d * q
    being exact for a float16 d - and whose embedding is its int8 rows' (1e-4: float32 sums in
    another order over 30 layers). The params take about a fifth of the float model's bytes."""
    from bridge.formats import open_checkpoint
    from bridge.quantize import dequantize_weight, quantize_weight

    ckpt = open_checkpoint(smollm2)
    assert ckpt.tensor_types["Q4_1"] == 210
    model, q = jax_llama.load(ckpt, quantize="int4")
    _, f = jax_llama.load(ckpt)
    wq = q["layers_0"]["attention"]["wq"]
    assert wq["kernel"].dtype == np.uint8 and wq["kernel"].shape == (576, 288)
    np.testing.assert_array_equal(
        np.asarray(dequantized({"m": dict(wq)})["m"]["kernel"]),
        np.asarray(f["layers_0"]["attention"]["wq"]["kernel"]))
    table = q["tok_embeddings"]
    assert table["embedding"].dtype == np.int8 and table["scale"].shape == (49152, 1)
    rows = dequantize_weight(*quantize_weight(np.asarray(f["tok_embeddings"]["embedding"])))
    same_head = dict(f, tok_embeddings={"embedding": jnp.asarray(rows)})
    tokens = np.array([[1, 504, 3458, 282, 4649, 314, 1345, 30]], np.int32)
    got = np.asarray(model.apply({"params": q}, tokens))
    np.testing.assert_allclose(got, np.asarray(model.apply({"params": same_head}, tokens)),
                               rtol=0, atol=1e-4)
    assert np.abs(got - np.asarray(model.apply({"params": f}, tokens))).max() > 1e-3  # int8 rows
    size = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    assert size(q) < 0.21 * size(f)  # 108 MB against 538 MB


def test_quantize_int4_on_both_generate_commands(tmp_path, capsys):
    """--quantize int4: the JAX twin reads 4-bit weights as it loads, the torch twin quantises
    once loaded - the same bits, so the same greedy text; refusals before any weight is read."""
    from conftest import save_random_checkpoint
    from llama_twins.cli import main as jax_cli
    from llama_twins.cli import torch_main

    ckpt = save_random_checkpoint(tmp_path / "ckpt", small_config(
        dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=259, tie_embeddings=False),
        seed=5, tokenizer=True)
    argv = ["generate", str(ckpt), "--prompt", "hello", "--max-new-tokens", "12"]
    assert jax_cli.main([*argv, "--quantize", "int4"]) == 0
    jax_out = capsys.readouterr().out
    assert torch_main.main([*argv, "--quantize", "int4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == jax_out
    assert jax_cli.main(argv) == 0
    assert capsys.readouterr().out != jax_out  # 4 bits change a random model's greedy text
    assert jax_cli.main([*argv, "--quantize", "int4", "--group-size", "64"]) == 2
    assert "--group-size: 4-bit weights come in groups of 32" in capsys.readouterr().err


def test_both_twins_read_a_gguf_as_the_same_4_bit_weights(smollm2):
    """torch_llama.load(..., quantize="int4") reads SmolLM2's Q4_1 blocks and its int8 head rows as
    jax_llama.load does (the same bits, in the same layout); their logits agree to float32 rounding of
    sums in another order (2e-4 over 30 layers); and an adapter is refused, naming the field."""
    import torch

    import torch_llama
    from bridge.formats import open_checkpoint
    from conftest import torch_logits

    ckpt = open_checkpoint(smollm2)
    model, q = jax_llama.load(ckpt, quantize="int4")
    tmodel = torch_llama.load(ckpt, device="cpu", quantize="int4")
    wq = tmodel.layers[3].attention.wq
    assert wq.weight.dtype == torch.uint8
    for leaf, tensor in (("kernel", wq.weight), ("scale", wq.weight_scale), ("min", wq.weight_min)):
        np.testing.assert_array_equal(tensor.numpy(),
                                      np.asarray(q["layers_3"]["attention"]["wq"][leaf]))
    np.testing.assert_array_equal(tmodel.tok_embeddings.weight.numpy(),
                                  np.asarray(q["tok_embeddings"]["embedding"]))
    tokens = np.array([[1, 504, 3458, 282, 4649, 314, 1345, 30]], np.int32)
    np.testing.assert_allclose(torch_logits(tmodel, tokens),
                               np.asarray(model.apply({"params": q}, tokens)), rtol=0, atol=2e-4)
    with pytest.raises(BridgeError, match="int4"):
        torch_llama.load(ckpt, device="cpu", quantize="int4", adapter="somewhere")


# -- a quantised file in its nearest layout ---------------------------------------------------------

def test_each_gguf_type_has_its_nearest_layout():
    """Up to 5 bits a weight -> 4-bit weights (Q4_0 and Q4_1 exactly), more -> int8 rows; float
    types stay float. The bits come from gguf's own block table."""
    from bridge.int4 import bits_per_weight, nearest_layout

    assert bits_per_weight("Q4_0") == 4.5 and bits_per_weight("Q8_0") == 8.5
    assert {t: nearest_layout(t) for t in ("Q4_0", "Q4_1", "Q4_K", "IQ4_XS", "Q3_K", "Q5_0",
                                           "Q5_K", "Q6_K", "Q8_0", "F16", "BF16", "F32")} == {
        "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "IQ4_XS": "int4", "Q3_K": "int4",
        "Q5_0": "int8", "Q5_K": "int8", "Q6_K": "int8", "Q8_0": "int8", "F16": None,
        "BF16": None, "F32": None}
    assert nearest_layout(None) is None and nearest_layout("NOT_A_TYPE") is None


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """A small untied random model as Q4_0 and Q8_0 GGUF files (the bridge's exporter: each
    projection and the embedding in the file type, the output projection Q8_0)."""
    from bridge.convert import convert
    from conftest import save_random_checkpoint

    root = tmp_path_factory.mktemp("nearest")
    native = save_random_checkpoint(root / "native", small_config(
        dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=259, tie_embeddings=False),
        seed=6, tokenizer=True)
    return {t: convert(native, root / f"model-{t}.gguf", to="gguf", dtype=t, progress=False)
            for t in ("q4_0", "q8_0")}


def test_a_quantised_gguf_loads_in_its_nearest_layout_in_both_twins(gguf_files):
    """Q4_0 projections as 4-bit weights (exactly: the dequantised file's numbers), the Q8_0 head
    and the quantised embedding as int8 rows; each re-quantised tensor's error is the RMS of its
    change over the RMS of the file's weight, said in the summary; the torch twin holds the same
    bits, without Q4_0's minima as the JAX twin, and computes the same logits to float32
    rounding."""
    import torch

    import torch_llama
    from bridge.formats import open_checkpoint
    from bridge.int4 import nearest_reader, quantised_layouts
    from conftest import torch_logits

    ckpt = open_checkpoint(gguf_files["q4_0"])
    assert quantised_layouts(ckpt) == {"Q4_0 -> int4 (exact)": 14, "Q8_0 -> int8 rows": 1,
                                       "Q4_0 -> int8 rows": 1}
    model, q = jax_llama.load(ckpt, quantize="stored")
    _, f = jax_llama.load(ckpt)
    wq = q["layers_1"]["attention"]["wq"]
    assert wq["kernel"].dtype == np.uint8
    # Q4_0's minima are -8 d: not held (0.5625 bytes a weight), the same numbers as held
    assert set(wq) == {"kernel", "scale"}
    np.testing.assert_array_equal(np.asarray(dequantized({"m": dict(wq)})["m"]["kernel"]),
                                  np.asarray(f["layers_1"]["attention"]["wq"]["kernel"]))
    assert q["output"]["kernel"].dtype == np.int8 and q["output"]["scale"].shape == (1, 259)
    assert q["tok_embeddings"]["embedding"].dtype == np.int8
    tokens = random_tokens(model.config)
    logits = np.asarray(model.apply({"params": q}, tokens))
    held = jax.tree_util.tree_map(lambda x: x, q)
    for _, node in modules(held):
        if set(node) == {"kernel", "scale"} and node["kernel"].dtype == np.uint8:
            node["min"] = node["scale"] * np.float16(-8)
    np.testing.assert_array_equal(np.asarray(model.apply({"params": held}, tokens)), logits)
    assert 0 < sum(x.nbytes for x in jax.tree.leaves(held)) - sum(
        x.nbytes for x in jax.tree.leaves(q)) == sum(node["min"].nbytes for _, node in modules(held)
                                                     if "min" in node)
    assert 1e-4 < np.abs(logits - np.asarray(model.apply({"params": f}, tokens))).max() < 0.1
    tmodel = torch_llama.load(ckpt, device="cpu", quantize="stored")
    assert tmodel.output.weight.dtype == torch.int8 and tmodel.tok_embeddings.weight.dtype == torch.int8
    twq = tmodel.layers[1].attention.wq
    np.testing.assert_array_equal(twq.weight.numpy(), np.asarray(wq["kernel"]))
    np.testing.assert_array_equal(twq.weight_scale.numpy(), np.asarray(wq["scale"]))
    assert not hasattr(twq, "weight_min")  # Q4_0's minima are -8 d: not held here either
    np.testing.assert_allclose(torch_logits(tmodel, tokens), logits, rtol=0, atol=2e-5)
    # the error said of the head: RMS(change) / RMS(weight), against the file's float weight
    reader = nearest_reader(ckpt, ckpt.tensor, ckpt.config)
    q_head, s_head = reader("output.weight")
    w = ckpt.tensor("output.weight").astype(np.float64)
    want = np.sqrt(np.mean((q_head * s_head.astype(np.float64) - w) ** 2) / np.mean(w ** 2))
    assert reader.errors["Q8_0 -> int8 rows"] == [pytest.approx(want, rel=1e-3)]
    assert f"(error {want:.2%} RMS of the weights" in reader.summary()


def test_int8_as_it_is_read_is_quantize_after_loading(gguf_files):
    """load(quantize="int8") quantises each tensor as it is read: the same bits as loading the float
    model and quantising it (jax_llama.quantize, torch_llama.quantize); an unknown mode is refused."""
    import torch_llama

    path = gguf_files["q8_0"]
    _, streamed = jax_llama.load(path, quantize="int8")
    _, f = jax_llama.load(path)
    after = jax_llama.quantize(f)
    for a, b in zip(jax.tree_util.tree_leaves(streamed), jax.tree_util.tree_leaves(after)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    t_streamed = torch_llama.load(path, device="cpu", quantize="int8").state_dict()
    t_after = torch_llama.quantize(torch_llama.load(path, device="cpu")).state_dict()
    assert t_streamed.keys() == t_after.keys()
    for name in t_after:
        np.testing.assert_array_equal(t_streamed[name].numpy(), t_after[name].numpy())
    with pytest.raises(BridgeError, match="expected one of int8, int4, stored, auto or None"):
        jax_llama.load(path, quantize="nearest")
    with pytest.raises(BridgeError, match="expected one of int8, int4, stored, auto or None"):
        torch_llama.load(path, device="cpu", quantize=True)


def counting_bar(monkeypatch) -> tuple[list, list]:
    """(the ticks, the totals) of every progress bar a load opens (bridge.progress.bar)."""
    counted, totals = [], []
    monkeypatch.setattr("bridge.progress.bar", lambda **kw: (totals.append(kw["total"]), type(
        "Bar", (), {"update": lambda self, n: counted.append(n), "__enter__": lambda self: self,
                    "__exit__": lambda self, *a: None, "close": lambda self: None})())[1])
    return counted, totals


def recording_slices(monkeypatch) -> list:
    """The names a GGUF's tensor_slice reads, in order, as it reads them."""
    from bridge.gguf.read import GGUFCheckpoint

    sliced, read_slice = [], GGUFCheckpoint.tensor_slice
    monkeypatch.setattr(GGUFCheckpoint, "tensor_slice", lambda self, name, index: (
        sliced.append(name), read_slice(self, name, index))[1])
    return sliced


def test_int8_rows_are_read_and_quantised_a_chunk_of_rows_at_a_time_with_the_same_numbers(
        gguf_files, monkeypatch, tmp_path_factory):
    """A GGUF's tensor_slice of leading rows dequantises only those rows, the numbers of the
    whole tensor's (any other index: the whole tensor, sliced); the nearest layout's int8 rows
    (the Q4_0 embedding, the Q8_0 head) are quantised from such chunks, the same bytes and the
    same summary as from the whole float tensor, with every tensor counted on the load's bar
    (and every weight of a 4-bit native checkpoint, its parts read by the reader).
    Negative case: a chunk's rows read in the wrong order change the bytes."""
    import bridge.int4
    from bridge.formats import open_checkpoint
    from bridge.gguf.read import GGUFCheckpoint
    from bridge.tensors import canonical_shapes

    ckpt = open_checkpoint(gguf_files["q4_0"])
    for name in ("tok_embeddings.weight", "output.weight", "layers.0.attention.wq.weight",
                 "norm.weight"):
        whole = ckpt.tensor(name)
        for index in ((slice(3, 40),), (slice(250, 400),), (slice(0, 7, 2),)) + (
                ((slice(0, 1), slice(None)), (slice(None), slice(5, 9))) if whole.ndim == 2 else ()):
            np.testing.assert_array_equal(ckpt.tensor_slice(name, index), whole[index])
    monkeypatch.setattr(bridge.int4, "ROWS_CHUNK_ELEMENTS", 64 * 10)  # 10 rows a chunk
    monkeypatch.setenv("JAX_LLAMA_KERNELS", "0")  # numpy's reading (tests/test_native.py: the same)
    counted, totals = counting_bar(monkeypatch)
    sliced = recording_slices(monkeypatch)
    _, by_rows = jax_llama.load(gguf_files["q4_0"], quantize="stored")
    assert len(counted) == totals[-1] == len(ckpt.specs)  # every tensor, those read by rows too
    quantised = tmp_path_factory.mktemp("stored") / "int4"  # a 4-bit native checkpoint's too
    model, params = jax_llama.load(gguf_files["q4_0"])
    jax_llama.save(quantised, model.config, jax_llama.quantize(params, method="int4"))
    counted.clear()
    jax_llama.load(quantised)
    assert len(counted) == totals[-1] == len(canonical_shapes(model.config))  # not its parts
    # 259 rows, 10 a chunk: 26 reads each of the embedding and the head
    assert sliced == ["tok_embeddings.weight"] * 26 + ["output.weight"] * 26
    monkeypatch.setattr(GGUFCheckpoint, "reads_rows", False)
    _, whole = jax_llama.load(gguf_files["q4_0"], quantize="stored")
    assert len(sliced) == 52  # read whole: no slices
    for module, key in (("tok_embeddings", "embedding"), ("tok_embeddings", "scale"),
                        ("output", "kernel"), ("output", "scale")):
        np.testing.assert_array_equal(np.asarray(by_rows[module][key]),
                                      np.asarray(whole[module][key]))
    reader = bridge.int4.nearest_reader(ckpt, ckpt.tensor, ckpt.config)
    rows_reader = bridge.int4.nearest_reader(ckpt, ckpt.tensor, ckpt.config)
    rows_reader.rows = ckpt.tensor_slice
    for name in ("tok_embeddings.weight", "output.weight"):
        for a, b in zip(reader(name), rows_reader(name)):
            np.testing.assert_array_equal(a, b)
    assert reader.summary() == rows_reader.summary()
    np.testing.assert_array_equal(rows_reader("output.weight")[0],
                                  np.asarray(whole["output"]["kernel"]).T)  # the model's bytes
    wrong_reader = bridge.int4.nearest_reader(ckpt, ckpt.tensor, ckpt.config)
    wrong_reader.rows = lambda name, index: ckpt.tensor_slice(name, index)[::-1]  # negative
    wrong = wrong_reader("output.weight")
    assert not np.array_equal(wrong[0], np.asarray(whole["output"]["kernel"]).T)


def test_generate_reads_a_quantised_gguf_in_its_nearest_layout_unless_told(gguf_files, capsys):
    """By default the generate commands read a Q4_0 file as 4-bit weights and say so (and how to
    dequantise); both twins write the same greedy text; --dtype float32 reads it as before."""
    from llama_twins.cli import main as jax_cli
    from llama_twins.cli import torch_main

    argv = ["generate", str(gguf_files["q4_0"]), "--prompt", "hello", "--max-new-tokens", "12"]
    assert jax_cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert ("read in its nearest quantised layout (1 Q4_0 -> int8 rows, 14 Q4_0 -> int4 (exact), "
            "1 Q8_0 -> int8 rows); --dtype float32 dequantises") in err
    assert "Q8_0 -> int8 rows quantised (error " in err
    assert torch_main.main([*argv, "--device", "cpu"]) == 0
    assert capsys.readouterr().out == out
    assert jax_cli.main([*argv, "--dtype", "float32"]) == 0
    assert "nearest" not in capsys.readouterr().err


def test_lora_on_a_4_bit_base_trains_as_on_its_dequantised_weights():
    """QLoRA: the adapters' gradients on 4-bit params equal those on the float model of the same
    (dequantised) weights, to float32 rounding of sums in another order; and the backward pass
    saves no float copy of a base weight (what the forward keeps for it is the 4-bit weight:
    jax's own account of the saved residuals has no float32 array of a projection's shape)."""
    from jax._src.ad_checkpoint import saved_residuals

    from bridge.lora import LoraConfig
    from jax_llama.lora import add_lora, combine, split

    config = small_config(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97)
    model, params = jax_llama.init(config, seed=2)
    q = jax_llama.quantize(params, method="int4")
    lora = LoraConfig(rank=4, alpha=8.0, targets=("wq", "wv", "w2"))
    lora_model, lq = add_lora(model, q, lora, seed=1)
    _, lf = add_lora(model, dequantized(q), lora, seed=1)
    tokens = random_tokens(config)

    def grads(p):
        weights, adapters = split(p)

        def loss(adapters):
            logits = lora_model.apply({"params": combine(weights, adapters)}, tokens)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0])
        return loss, adapters
    loss_q, aq = grads(lq)
    loss_f, af = grads(lf)
    gq, gf = jax.grad(loss_q)(aq), jax.grad(loss_f)(af)
    for a, b in zip(jax.tree_util.tree_leaves(gq), jax.tree_util.tree_leaves(gf)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert max(float(jnp.abs(a).max()) for a in jax.tree_util.tree_leaves(gq)) > 1e-4
    shapes = {tuple(w.shape) for w in jax.tree_util.tree_leaves(params) if w.ndim == 2}
    kept = [aval for aval, _ in saved_residuals(loss_q, aq)]
    assert not [a for a in kept if a.dtype == jnp.float32 and tuple(a.shape) in shapes
                and tuple(a.shape) != (config.vocab_size, config.dim)]
    assert any(a.dtype == jnp.uint8 for a in kept)  # the 4-bit weights themselves


def test_the_torch_twin_reads_rows_as_the_jax_twin_does_and_counts_every_tensor(
        gguf_files, monkeypatch, tmp_path_factory):
    """torch_llama.load(quantize="stored") quantises the int8 rows from a chunk of the file's rows at
    a time, as jax_llama.load does: the same bytes as from the whole tensor, and the JAX twin's.
    Its bar counts every tensor of a GGUF (those read exactly as 4-bit weights too) and every
    stored part of a 4-bit native checkpoint, so that it ends. Negative case: without the ticks
    of the reader's weights, the count of tensors read whole falls short."""
    import bridge.int4
    import torch_llama
    from bridge.gguf.read import GGUFCheckpoint

    monkeypatch.setattr(bridge.int4, "ROWS_CHUNK_ELEMENTS", 64 * 10)  # 10 rows a chunk
    monkeypatch.setenv("JAX_LLAMA_KERNELS", "0")  # numpy's reading (tests/test_native.py: the same)
    counted, totals = counting_bar(monkeypatch)
    sliced = recording_slices(monkeypatch)
    path = gguf_files["q4_0"]
    by_rows = torch_llama.load(path, device="cpu", quantize="stored").state_dict()
    assert sum(counted) == totals[-1] == len(GGUFCheckpoint(path).specs)
    assert sliced == ["tok_embeddings.weight"] * 26 + ["output.weight"] * 26
    monkeypatch.setattr(GGUFCheckpoint, "reads_rows", False)
    whole = torch_llama.load(path, device="cpu", quantize="stored").state_dict()
    assert len(sliced) == 52
    assert by_rows.keys() == whole.keys()
    for name in by_rows:
        np.testing.assert_array_equal(by_rows[name].numpy(), whole[name].numpy())
    _, jax_params = jax_llama.load(path, quantize="stored")
    np.testing.assert_array_equal(by_rows["output.weight"].numpy(),
                                  np.asarray(jax_params["output"]["kernel"]).T)
    stored = tmp_path_factory.mktemp("stored") / "int4"  # a 4-bit native checkpoint
    model, params = jax_llama.load(path)
    jax_llama.save(stored, model.config, jax_llama.quantize(params, method="int4"))
    counted.clear()
    torch_llama.load(stored, device="cpu")
    from bridge.formats import open_checkpoint
    assert sum(counted) == totals[-1] == len(open_checkpoint(stored).specs)
    # negative: counting the tensors read whole (what the torch twin counted before) falls
    # short of the total: the 4-bit weights read exactly and the rows read by chunks are not
    reads, read_whole = [], GGUFCheckpoint.tensor
    monkeypatch.setattr(GGUFCheckpoint, "tensor", lambda self, name: (
        reads.append(name), read_whole(self, name))[1])
    monkeypatch.setattr(GGUFCheckpoint, "reads_rows", True)
    torch_llama.load(path, device="cpu", quantize="stored")
    assert 0 < len(reads) < len(GGUFCheckpoint(path).specs)


def test_a_stored_load_holds_the_readers_arrays_and_lets_go_of_the_files_pages(gguf_files):
    """jax_llama.load of a Q4_0 GGUF in the stored layout: each 4-bit weight's params are the very
    arrays the reader made (aligned to 64 bytes, XLA's CPU client holds them as they are: the
    load's memory is the params once, not twice), with the same numbers whether bridge/native's
    compiled passes read the blocks or numpy does, in both twins; GGUFFile.release drops a tensor's pages
    from the process and its bytes still read the same. Negative case: an array 16 bytes past
    the alignment (numpy's own big arrays are) is copied."""
    import mmap

    from bridge.gguf.container import read_gguf
    from bridge.gguf.native import Helpers, using
    from bridge.resources import aligned_empty

    made = []
    original = jax_llama.checkpoint._on_device

    def on_device(values):
        made.extend(values)
        return original(values)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax_llama.checkpoint, "_on_device", on_device)
        _, params = jax_llama.load(gguf_files["q4_0"], quantize="stored")
    kernel = params["layers_0"]["attention"]["wq"]["kernel"]
    host = next(v for v in made if v.dtype == np.uint8 and v.shape == kernel.shape
                and np.array_equal(v, np.asarray(kernel)))
    assert host.ctypes.data % 64 == 0 and kernel.unsafe_buffer_pointer() == host.ctypes.data
    with using(Helpers()):  # numpy's reading of the blocks
        _, by_numpy = jax_llama.load(gguf_files["q4_0"], quantize="stored")
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(by_numpy)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    import torch_llama  # the torch twin reads through the same passes
    with using(Helpers()):
        numpy_state = torch_llama.load(gguf_files["q4_0"], device="cpu", quantize="stored").state_dict()
    state = torch_llama.load(gguf_files["q4_0"], device="cpu", quantize="stored").state_dict()
    assert state.keys() == numpy_state.keys()
    for key in state:
        np.testing.assert_array_equal(state[key].numpy(), numpy_state[key].numpy())

    off = aligned_empty((1 << 16) + 16, np.uint8)[16:]
    off[:] = 1
    assert jax.device_put(off).unsafe_buffer_pointer() != off.ctypes.data

    file = read_gguf(gguf_files["q4_0"])
    t = max(file.tensors, key=lambda t: t.n_bytes)
    assert t.n_bytes > 2 * mmap.PAGESIZE
    before = file.raw(t).copy()
    file.release(t)
    np.testing.assert_array_equal(file.raw(t), before)
