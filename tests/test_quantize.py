"""int8 weight-only quantisation: the arithmetic, both twins on the same int8 weights, the native
format that holds them, the commands, and what is refused."""

import dataclasses
import json
import re

import numpy as np
import pytest
import safetensors.numpy
import torch

import jax_llama
import torch_llama
from bridge.convert import convert
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from bridge.quantize import Quantization, dequantize_weight, quantize_weight
from conftest import (jax_logits, random_tokens, save_random_checkpoint, small_config, torch_logits,
                      torch_model)
from llama_twins.cli import bridge_main as bridge_cli, main as jax_cli, torch_main as torch_cli

# small_config's dims: 48 model, 80 ffn; 16 divides both
CONFIG = small_config()
# inputs of 128 and 160: the JAX twin's per-channel int8 matmul converts the weight in blocks of
# jax_llama.model.projections.INT8_BLOCK_ROWS (64) rows, or 32 where 64 does not divide (160),
# summed in a loop
BLOCKED = small_config(dim=128, n_heads=4, n_kv_heads=2, ffn_dim=160)


def softmax_kl(p_logits, q_logits) -> float:
    """Mean KL(p || q) over positions, from logits."""
    p = p_logits - p_logits.max(-1, keepdims=True)
    q = q_logits - q_logits.max(-1, keepdims=True)
    logp = p - np.log(np.exp(p).sum(-1, keepdims=True))
    logq = q - np.log(np.exp(q).sum(-1, keepdims=True))
    return float((np.exp(logp) * (logp - logq)).sum(-1).mean())


# -- the arithmetic --------------------------------------------------------------------------------

@pytest.mark.parametrize("group_size", [None, 4, 16])
def test_quantize_weight_is_symmetric_and_within_half_a_step(group_size, rng):
    w = rng.normal(size=(24, 32)).astype(np.float32)
    w[3] = 0.0  # an all-zero row: scale 1, values 0, no division by zero
    q, scale = quantize_weight(w, group_size)
    groups = 1 if group_size is None else 32 // group_size
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (24, groups)
    assert np.abs(q).max() == 127 and q.min() >= -127  # symmetric: -128 never used
    assert np.all(q[3] == 0) and np.all(scale[3] == 1)
    blocks = np.abs(w).reshape(24, groups, -1).max(-1)
    np.testing.assert_allclose(scale[np.arange(24) != 3], (blocks / 127)[np.arange(24) != 3],
                               rtol=1e-6, atol=0)
    step = np.repeat(scale, 32 // groups, axis=1)
    # Rounding to the nearest step: the error is at most half a step (plus float32 rounding).
    assert np.all(np.abs(dequantize_weight(q, scale) - w) <= step / 2 * (1 + 1e-5))


def test_quantize_weight_by_hand():
    w = np.array([[1.27, -0.635, 0.0, 0.005]], np.float32)
    q, scale = quantize_weight(w)
    np.testing.assert_allclose(scale, [[0.01]], rtol=1e-6)
    # 0.005 / 0.01 = 0.5 rounds to even (0), as jnp.round and torch.round do
    assert q.tolist() == [[127, -64, 0, 0]]


def test_group_size_that_does_not_divide_is_refused_naming_the_tensor():
    with pytest.raises(BridgeError, match="group_size: 32 does not divide the 80 input columns "
                                          "of 'layers.0.feed_forward.w2.weight'"):
        Quantization(group_size=32).groups(80, "layers.0.feed_forward.w2.weight")
    for bad in (0, -4, 2.5, True):
        with pytest.raises(BridgeError, match="group_size: must be a positive integer"):
            Quantization(group_size=bad)
    with pytest.raises(BridgeError, match="quantize: unknown method 'int3'"):
        Quantization("int3")
    with pytest.raises(BridgeError, match="group_size: 4-bit weights come in groups of 32"):
        Quantization("int4", 64)
    assert Quantization("int4").group_size == 32


# -- the twins on the same int8 weights --------------------------------------------------------------

@pytest.fixture(params=[(False, None, CONFIG), (False, 16, CONFIG), (True, None, CONFIG),
                        (False, None, BLOCKED)], ids=["untied", "group16", "tied", "blocked"])
def float_checkpoint(request, tmp_path):
    tied, group_size, base = request.param
    config = dataclasses.replace(base, tie_embeddings=tied)
    return save_random_checkpoint(tmp_path / "float", config), config, group_size


def test_both_twins_and_the_bridge_quantise_to_the_same_tensors(float_checkpoint, tmp_path):
    path, config, group_size = float_checkpoint
    model, params = jax_llama.load(path)
    jax_llama.save(tmp_path / "jax", config, jax_llama.quantize(params, group_size))
    torch_llama.save(tmp_path / "torch",
                     torch_llama.quantize(torch_llama.load(path, device="cpu"), group_size))
    convert(path, tmp_path / "bridge", quantize="int8", group_size=group_size, progress=False)
    files = [safetensors.numpy.load_file(tmp_path / d / "model.safetensors")
             for d in ("jax", "torch", "bridge")]
    assert files[0].keys() == files[1].keys() == files[2].keys()
    scales = [n for n in files[0] if n.endswith("_scale")]
    assert len(scales) == 7 * config.n_layers + 1  # and the LM head's
    for name in files[0]:
        for other in files[1:]:
            np.testing.assert_array_equal(files[0][name], other[name], err_msg=name)
    assert files[0]["layers.0.attention.wq.weight"].dtype == np.int8
    # a tied head is the embedding, int8 with a scale per token (row); an untied one is output,
    # and the embedding, only looked up, keeps its dtype
    head = "tok_embeddings.weight" if config.tie_embeddings else "output.weight"
    assert files[0][head].dtype == np.int8
    groups = 1 if group_size is None else config.dim // group_size
    assert files[0][head + "_scale"].shape == (config.vocab_size, groups)
    if not config.tie_embeddings:
        assert files[0]["tok_embeddings.weight"].dtype == np.float32
    declared = json.loads((tmp_path / "jax" / "config.json").read_text())["quantization"]
    assert declared == {"method": "int8", "group_size": group_size}


def test_twins_give_the_same_logits_on_int8_weights(float_checkpoint, tmp_path):
    path, config, group_size = float_checkpoint
    convert(path, tmp_path / "q", quantize="int8", group_size=group_size, progress=False)
    tokens = random_tokens(config, batch=2, seq_len=12)
    model, params = jax_llama.load(tmp_path / "q")
    tmodel = torch_llama.load(tmp_path / "q", device="cpu")
    # int8 is held as int8 in memory, in both twins
    assert params["layers_0"]["attention"]["wq"]["kernel"].dtype == np.int8
    assert tmodel.layers[0].attention.wq.weight.dtype == torch.int8
    ours, theirs = jax_logits(model, params, tokens), torch_logits(tmodel, tokens)
    # float32: the same products of the same int8 values and scales, summed in two orders
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5)
    # ... and different from the float model's: the weights really are int8
    float_model, float_params = jax_llama.load(path)
    float_logits = jax_logits(float_model, float_params, tokens)
    assert np.abs(ours - float_logits).max() > 1e-4
    # but close to it: int8 rounding moves each weight by at most half a step (0.4% of its
    # row's largest), which moves the next-token distributions by a KL far below a nat
    assert softmax_kl(float_logits, ours) < 1e-3


@pytest.mark.parametrize("config", [CONFIG, BLOCKED], ids=["small", "blocked"])
def test_bfloat16_twins_on_int8_weights_agree_to_bfloat16_rounding(tmp_path, config):
    path = save_random_checkpoint(tmp_path / "float", config)
    convert(path, tmp_path / "q", quantize="int8", progress=False)
    tokens = random_tokens(config, batch=2, seq_len=12)
    model, params = jax_llama.load(tmp_path / "q", dtype="bfloat16")
    tmodel = torch_llama.load(tmp_path / "q", device="cpu", dtype="bfloat16")  # int8 kernel
    ours, theirs = jax_logits(model, params, tokens), torch_logits(tmodel, tokens)
    f32_model, f32_params = jax_llama.load(tmp_path / "q")
    exact = jax_logits(f32_model, f32_params, tokens)
    scale = np.abs(exact).max()
    # each bfloat16 run within a few bfloat16 steps (2^-8 relative) of the float32 run of the
    # same int8 weights, and so within twice that of each other
    for logits in (ours, theirs):
        assert np.abs(logits - exact).max() < 4 * 2**-8 * scale
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=8 * 2**-8 * scale)


def test_scan_layers_quantise_the_same(tmp_path):
    path = save_random_checkpoint(tmp_path / "float", CONFIG)
    model, params = jax_llama.load(path)
    _, scanned = jax_llama.load(path, scan_layers=True)  # the same weights, stacked
    tokens = random_tokens(CONFIG)
    jax_llama.save(tmp_path / "a", CONFIG, jax_llama.quantize(params, 16))
    jax_llama.save(tmp_path / "b", CONFIG, jax_llama.quantize(scanned, 16))
    a = safetensors.numpy.load_file(tmp_path / "a" / "model.safetensors")
    b = safetensors.numpy.load_file(tmp_path / "b" / "model.safetensors")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    loaded_model, loaded = jax_llama.load(tmp_path / "a", scan_layers=True)
    np.testing.assert_allclose(jax_logits(loaded_model, loaded, tokens),
                               jax_logits(model, jax_llama.quantize(params, 16), tokens),
                               rtol=0, atol=1e-5)  # scanned and unrolled blocks: summation order


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_int8_generation_is_identical_in_both_twins(tmp_path, tied):
    # A sharpened head (conftest.torch_model) so greedy choices are not float32 near-ties; tied,
    # the head is the int8 embedding (the decode kernels' matvec_rows in JAX at batch 2).
    config = dataclasses.replace(CONFIG, tie_embeddings=tied)
    torch_llama.save(tmp_path / "float", torch_model(config, seed=3, head_scale=30.0))
    convert(tmp_path / "float", tmp_path / "q", quantize="int8", progress=False)
    prompts = [[5, 7, 11], [3, 1, 4, 1, 5, 9, 2]]
    model, params = jax_llama.load(tmp_path / "q")
    ours = jax_llama.generate(model, params, prompts, 24).tokens
    theirs = torch_llama.generate(torch_llama.load(tmp_path / "q", device="cpu"), prompts, 24).tokens
    assert ours == theirs and len(ours[0]) == 24


@pytest.mark.parametrize("group_size", [None, 16])
def test_an_int8_tied_embedding_looks_up_its_dequantised_rows_in_both_twins(tmp_path, group_size):
    config = dataclasses.replace(CONFIG, tie_embeddings=True)
    path = save_random_checkpoint(tmp_path / "float", config)
    convert(path, tmp_path / "q", quantize="int8", group_size=group_size, progress=False)
    files = safetensors.numpy.load_file(tmp_path / "q" / "model.safetensors")
    table = dequantize_weight(files["tok_embeddings.weight"], files["tok_embeddings.weight_scale"])
    tokens = random_tokens(config, batch=2, seq_len=5)
    model, params = jax_llama.load(tmp_path / "q")
    assert params["tok_embeddings"]["embedding"].dtype == np.int8
    ours = model.apply({"params": params}, tokens, method=lambda m, t: m.run(t, lm_head=False))
    tmodel = torch_llama.load(tmp_path / "q", device="cpu")
    assert tmodel.tok_embeddings.weight.dtype == torch.int8
    # the lookup alone, both twins: the rows of Q * s, bit for bit
    embed = jax_llama.model.projections.Embed(config.vocab_size, config.dim)
    rows = embed.apply({"params": params["tok_embeddings"]}, tokens)
    np.testing.assert_array_equal(np.asarray(rows), table[tokens])
    with torch.no_grad():
        np.testing.assert_array_equal(tmodel.tok_embeddings(torch.from_numpy(tokens)).numpy(),
                                      table[tokens])
    # the head multiplies by the same table: the logits are h @ (Q * s)^T
    h = np.asarray(ours.hidden).reshape(-1, config.dim)
    logits = jax_logits(model, params, tokens).reshape(-1, config.vocab_size)
    np.testing.assert_allclose(logits, h @ table.T, rtol=0, atol=2e-5)  # float32 summation order


# -- refused -------------------------------------------------------------------------------------------

def test_lora_that_trains_an_int8_embedding_is_refused_in_both_twins():
    config = dataclasses.replace(CONFIG, tie_embeddings=True)
    lora = jax_llama.LoraConfig(rank=4, train_embeddings=True)
    model, params = jax_llama.init(config)
    with pytest.raises(BridgeError, match="train_embeddings: the embedding table is int8"):
        jax_llama.add_lora(model, jax_llama.quantize(params), lora)
    with pytest.raises(BridgeError, match="train_embeddings: the embedding table is int8"):
        torch_llama.add_lora(torch_llama.quantize(torch_model(config)), lora)
    # adapters on the projections alone (QLoRA's way) still go on an int8 model
    adapted = torch_llama.add_lora(torch_llama.quantize(torch_model(config)),
                                   jax_llama.LoraConfig(rank=4))
    assert torch_llama.projections.lora_of(adapted) == jax_llama.LoraConfig(rank=4)


def test_quantising_twice_is_refused(tmp_path):
    _, params = jax_llama.init(CONFIG)
    with pytest.raises(BridgeError, match="params: already quantised"):
        jax_llama.quantize(jax_llama.quantize(params))
    tmodel = torch_llama.quantize(torch_model(CONFIG))
    with pytest.raises(BridgeError, match="model: already quantised"):
        torch_llama.quantize(tmodel)


def test_group_size_refused_in_both_twins_before_anything_changes():
    _, params = jax_llama.init(CONFIG)
    with pytest.raises(BridgeError, match="group_size: 32 does not divide the 48 input columns"):
        jax_llama.quantize(params, 32)
    tmodel = torch_model(CONFIG)
    with pytest.raises(BridgeError, match="group_size: 32 does not divide the 48 input columns"):
        torch_llama.quantize(tmodel, 32)
    assert tmodel.layers[0].attention.wq.weight.dtype == torch.float32  # untouched


def test_int8_checkpoints_are_not_converted_or_merged_into(tmp_path):
    path = save_random_checkpoint(tmp_path / "float", CONFIG)
    convert(path, tmp_path / "q", quantize="int8", progress=False)
    for to in ("native", "hf", "meta", "llama2c"):
        with pytest.raises(BridgeError, match="holds int8-quantised weights"):
            convert(tmp_path / "q", tmp_path / f"out-{to}", to, progress=False)
        assert not (tmp_path / f"out-{to}").exists()
    with pytest.raises(BridgeError, match="quantize: int8 weights are stored in the native "
                                          "format only, not hf"):
        convert(path, tmp_path / "hf", "hf", quantize="int8", progress=False)
    with pytest.raises(BridgeError, match="adapter: .* holds int8 weights"):
        jax_llama.load(tmp_path / "q", adapter=tmp_path / "any")
    with pytest.raises(BridgeError, match="adapter: .* holds int8 weights"):
        torch_llama.load(tmp_path / "q", adapter=tmp_path / "any")


def _rewrite(path, change_config=None, change_tensors=None):
    if change_config:
        config = json.loads((path / "config.json").read_text())
        change_config(config)
        (path / "config.json").write_text(json.dumps(config))
    if change_tensors:
        tensors = safetensors.numpy.load_file(path / "model.safetensors")
        change_tensors(tensors)
        safetensors.numpy.save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize("change_config, change_tensors, message", [
    (None, lambda t: t.pop("layers.1.feed_forward.w2.weight_scale"),
     "tensor 'layers.1.feed_forward.w2.weight_scale' is missing"),
    (None, lambda t: t.update({"layers.0.attention.wq.weight":
                               t["layers.0.attention.wq.weight"].astype(np.float32)}),
     "tensor 'layers.0.attention.wq.weight' has dtype float32, but config.json declares int8"),
    (None, lambda t: t.update({"output.weight_scale": t["output.weight_scale"].astype(np.float16)}),
     "tensor 'output.weight_scale' has dtype float16, expected float32 scales"),
    (lambda c: c["quantization"].update(group_size=16), None,
     "tensor 'layers.0.attention.wq.weight_scale' has shape \\(48, 1\\), but config.json "
     "implies \\(48, 3\\)"),
    (lambda c: c["quantization"].update(group_size=7), None,
     "config.json: quantization.group_size: 7 does not divide the 48 input columns"),
    (lambda c: c["quantization"].update(method="int3"), None,
     "config.json: quantization.quantize: unknown method 'int3'"),
    (lambda c: c.update(quantization="int8"), None, "'quantization' must be an object"),
], ids=["missing-scale", "float-weight", "f16-scale", "wrong-groups", "bad-group", "bad-method",
        "not-object"])
def test_a_damaged_int8_checkpoint_is_refused_naming_the_tensor(tmp_path, change_config,
                                                                change_tensors, message):
    convert(save_random_checkpoint(tmp_path / "float", CONFIG), tmp_path / "q", quantize="int8",
            progress=False)
    _rewrite(tmp_path / "q", change_config, change_tensors)
    with pytest.raises(BridgeError, match=message):
        open_checkpoint(tmp_path / "q")
    with pytest.raises(BridgeError, match=message):
        jax_llama.load(tmp_path / "q")


def test_an_int8_checkpoint_with_a_float_tied_head_is_refused_with_what_to_do(tmp_path):
    """What int8 files held before a tied head was quantised too: a float embedding, no scale."""
    config = dataclasses.replace(CONFIG, tie_embeddings=True)
    path = save_random_checkpoint(tmp_path / "float", config)
    convert(path, tmp_path / "q", quantize="int8", progress=False)
    floats = safetensors.numpy.load_file(path / "model.safetensors")

    def old_style(t):
        t.pop("tok_embeddings.weight_scale")
        t["tok_embeddings.weight"] = floats["tok_embeddings.weight"]

    _rewrite(tmp_path / "q", change_tensors=old_style)
    message = ("tensor 'tok_embeddings.weight_scale' is missing: the tied LM head .* is int8 too "
               "now; quantise the float checkpoint again")
    with pytest.raises(BridgeError, match=message):
        jax_llama.load(tmp_path / "q")
    with pytest.raises(BridgeError, match=message):
        torch_llama.load(tmp_path / "q", device="cpu")


# -- the commands ----------------------------------------------------------------------------------------

def test_generate_quantize_in_both_commands(tmp_path, capsys):
    ckpt = save_random_checkpoint(tmp_path / "float", small_config(vocab_size=259), tokenizer=True)
    texts = []
    for main in (jax_cli.main, torch_cli.main):
        assert main(["generate", str(ckpt), "--prompt", "hi", "--max-new-tokens", "6",
                     "--quantize", "int8", "--group-size", "16"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
    assert bridge_cli.main(["convert", str(ckpt), str(tmp_path / "q"), "--quantize", "int8",
                            "--group-size", "16", "--quiet"]) == 0
    capsys.readouterr()
    # an int8 checkpoint runs as stored: --quantize with its own group size is accepted
    assert jax_cli.main(["generate", str(tmp_path / "q"), "--prompt", "hi", "--max-new-tokens",
                         "6", "--quantize", "int8"]) == 0
    assert capsys.readouterr().out == texts[0]
    assert bridge_cli.main(["inspect", str(tmp_path / "q"), "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quantization"] == {"method": "int8", "group_size": 16}
    assert "int8" in report["dtypes"]


@pytest.mark.parametrize("argv, message", [
    (["jax", "generate", "{float}", "--prompt", "a", "--group-size", "16"],
     "--group-size: one scale per this many inputs of int8 weights \\(with --quantize int8\\)"),
    (["torch", "generate", "{float}", "--prompt", "a", "--quantize", "int8", "--group-size", "32"],
     "--group-size: 32 does not divide the 48 input columns of 'layers.0.attention.wq.weight'"),
    (["jax", "generate", "{q}", "--prompt", "a", "--quantize", "int8", "--group-size", "16"],
     "--group-size: .*q holds int8 weights quantised with group size None"),
    (["jax", "generate", "{float}", "--prompt", "a", "--quantize", "int8", "--compare-torch"],
     "--compare-torch: not with --quantize"),
    (["bridge", "convert", "{float}", "{out}", "--quantize", "int8", "--group-size", "32"],
     "--group-size: 32 does not divide"),
    (["bridge", "convert", "{float}", "{out}", "--group-size", "16"],
     "--group-size: sets the int8 quantisation's groups \\(add --quantize int8\\)"),
    (["bridge", "convert", "{q}", "{out}"], "holds int8-quantised weights"),
    (["bridge", "convert", "{float}", "{out}", "--to", "hf", "--quantize", "int8"],
     "--quantize: int8 weights are stored in the native format only"),
])
def test_bad_quantize_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, argv, message):
    ckpt = save_random_checkpoint(tmp_path / "float", small_config(vocab_size=259), tokenizer=True)
    convert(ckpt, tmp_path / "q", quantize="int8", progress=False)
    main = {"jax": jax_cli.main, "torch": torch_cli.main, "bridge": bridge_cli.main}[argv[0]]
    paths = dict(float=ckpt, q=tmp_path / "q", out=tmp_path / "out")
    assert main([a.format(**paths) for a in argv[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "out").exists()


def test_eval_quantize_scores_the_int8_weights_in_both_commands(tmp_path, capsys):
    ckpt = save_random_checkpoint(tmp_path / "float", small_config(vocab_size=259), tokenizer=True)
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 4)
    perplexity = {}
    for name, main in (("jax", jax_cli.main), ("torch", torch_cli.main)):
        for quantize in ([], ["--quantize", "int8"]):
            assert main(["eval", str(ckpt), "--data", str(tmp_path / "text.txt"), "--seq-len",
                         "32", "--json", *quantize]) == 0
            report = json.loads(capsys.readouterr().out)
            assert report["quantize"] == (quantize[1] if quantize else None)
            perplexity[name, bool(quantize)] = report["perplexity"]
    # the twins agree on each (float32 sums in two orders), and int8 is not the float model
    for q in (False, True):
        assert perplexity["jax", q] == pytest.approx(perplexity["torch", q], rel=1e-5)
    assert perplexity["jax", True] != pytest.approx(perplexity["jax", False], rel=1e-7)


def test_the_decode_loop_holds_int8_weights_and_one_dequantised_matrix_at_a_time():
    """XLA would otherwise hoist the loop-invariant conversions out of the decode loop (or run
    them all first): a float32 copy of every weight beside the int8 ones for the whole
    generation. The compiled decode program's scratch memory shows which happened."""
    import importlib

    import jax
    import jax.numpy as jnp

    from bridge.sampling import Sampler
    from jax_llama.perf import matmul_params

    generate = importlib.import_module("jax_llama.inference.generate")
    config = small_config(n_layers=8)
    model, params = jax_llama.init(config)
    stops = np.full((8,), -1, np.int32)

    def scratch_bytes(p) -> int:
        d = generate._prefill(p, np.ones((1, 8), np.int32), np.ones((1, 8), bool), stops,
                              jax.random.key(0), model=model, sampler=Sampler(), cache_len=32)
        compiled = generate._decode.lower(p, d, jnp.int32(4), stops, model=model,
                                          sampler=Sampler()).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    float_weights = 4 * matmul_params(config)
    largest = 4 * config.dim * config.vocab_size  # the LM head, dequantised
    int8_scratch = scratch_bytes(jax_llama.quantize(params))
    assert int8_scratch < 2 * largest + scratch_bytes(params) < float_weights / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_projection_follows_scales_written_in_place(dtype):
    """The per-channel scales are kept converted to the activations' dtype between calls; a load
    writing weight_scale in place (or a new tensor) must still take effect at the next call."""
    from torch_llama.projections import Linear

    torch.manual_seed(0)
    layer = Linear(16, 8).to(dtype)
    layer.quantize(Quantization("int8"))
    x = torch.randn(2, 16, dtype=dtype)
    with torch.no_grad():
        before = layer(x)
        layer.weight_scale.mul_(2)   # in place, as loading a checkpoint writes it
        doubled = layer(x)
        layer.weight_scale = layer.weight_scale / 4   # replaced: a new tensor
        halved = layer(x)
    assert torch.equal(doubled, before * 2) and torch.equal(halved, before / 2)


def test_the_int8_matmul_by_blocks_is_the_whole_matmul():
    """_int8_dot_by_blocks sums 64-row blocks of x @ Q: the same products as one matmul, summed
    in another order (float32 rounding only); the scaled result is what int8_matmul returns."""
    import jax.numpy as jnp

    from jax_llama.model.projections import INT8_BLOCK_ROWS, _int8_dot_by_blocks, int8_matmul

    rng = np.random.default_rng(0)
    I, O = 3 * INT8_BLOCK_ROWS, 40
    q = rng.integers(-127, 128, (I, O)).astype(np.int8)
    x = rng.standard_normal((5, I)).astype(np.float32)
    scale = rng.uniform(0.01, 0.02, (1, O)).astype(np.float32)
    exact = x.astype(np.float64) @ q.astype(np.float64)
    by_blocks = np.asarray(_int8_dot_by_blocks(jnp.asarray(x), jnp.asarray(q), INT8_BLOCK_ROWS,
                                                 jnp.float32))
    np.testing.assert_allclose(by_blocks, exact, rtol=0, atol=1e-6 * np.abs(exact).max())
    scaled = np.asarray(int8_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale),
                                    jnp.float32))
    np.testing.assert_allclose(scaled, exact * scale, rtol=0,
                               atol=1e-6 * np.abs(exact * scale).max())
    # a block left out is far off: the loop covers every row
    partial = x[:, INT8_BLOCK_ROWS:].astype(np.float64) @ q[INT8_BLOCK_ROWS:].astype(np.float64)
    assert np.abs(by_blocks - partial).max() > 1e-2 * np.abs(exact).max()


def test_off_a_cpu_the_int8_matmul_is_one_dot_with_the_same_result(monkeypatch):
    """On a GPU the block loop would run as a kernel per 64-row block per token (17.9 tokens/s
    on an H200, results/gpu/gpu.md), so int8_matmul takes it on a CPU only. The backend is
    patched here: the one-dot path gives the block loop's result to float32 rounding, and the
    NaN guard still turns a NaN row into NaN; the block loop is not traced off a CPU."""
    import jax
    import jax.numpy as jnp

    from jax_llama.model import projections

    rng = np.random.default_rng(1)
    I, O = 4 * projections.INT8_BLOCK_ROWS, 24
    q = jnp.asarray(rng.integers(-127, 128, (I, O)).astype(np.int8))
    x = jnp.asarray(rng.standard_normal((3, I)).astype(np.float32))
    scale = jnp.asarray(rng.uniform(0.01, 0.02, (1, O)).astype(np.float32))
    on_cpu = np.asarray(projections.int8_matmul(x, q, scale, jnp.float32))
    loops = []
    real_loop = projections._int8_dot_by_blocks
    monkeypatch.setattr(projections, "_int8_dot_by_blocks",
                        lambda *a: loops.append(1) or real_loop(*a))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    off_cpu = np.asarray(projections.int8_matmul(x, q, scale, jnp.float32))
    assert loops == []
    np.testing.assert_allclose(off_cpu, on_cpu, rtol=0, atol=1e-6 * np.abs(on_cpu).max())
    nan_row = np.asarray(projections.int8_matmul(x.at[0, 0].set(jnp.nan), q, scale, jnp.float32))
    assert np.isnan(nan_row[0]).all()
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the negative case: the loop
    projections.int8_matmul(x, q, scale, jnp.float32)
    assert loops == [1]


def test_the_int8_block_matmuls_gradient_keeps_no_float_copy_of_the_weight():
    """int8_matmul by blocks (per channel, on a CPU: an int8 LM head under a LoRA or QLoRA run):
    its gradient is the dequantised matmul's to float32 rounding, and what the forward keeps for
    it is the int8 weight, not a float copy of each block (jax's account of saved residuals)."""
    import jax
    import jax.numpy as jnp
    from jax._src.ad_checkpoint import saved_residuals

    from jax_llama.model.projections import int8_matmul

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 5, 256)), jnp.float32)
    q = jnp.asarray(rng.integers(-127, 128, (256, 40)), jnp.int8)
    s = jnp.asarray(rng.random((1, 40)) / 127, jnp.float32)
    r = jnp.asarray(rng.standard_normal((3, 5, 40)), jnp.float32)

    def loss(x):
        return jnp.sum(int8_matmul(x, q, s, jnp.float32) * r)
    want = jax.grad(lambda x: jnp.sum((x @ (q.astype(jnp.float32) * s)) * r))(x)
    np.testing.assert_allclose(jax.grad(loss)(x), want, rtol=0, atol=1e-5)
    kept = [aval for aval, _ in saved_residuals(loss, x)]
    assert not [a for a in kept if a.dtype == jnp.float32 and a.size >= 64 * 40]


@pytest.mark.parametrize("rows", [6, 40])
def test_int8_projections_take_the_bfloat16_activations_generation_chooses_in_both_twins(
        rows, monkeypatch):
    """With bfloat16 activations chosen (generation's default, bridge.int4.activations) an int8
    Linear takes x rounded to bfloat16 in both twins - on XLA's path and on the kernels' (a decode
    step's 6 rows, a prompt's 40: the prompt kernel where the library has AVX512_BF16) - within
    1e-5 of the sum of |terms| of the float64 product of the rounded x and Q * s; with float32
    activations (training's, evaluation's) x is taken as it is, outside that bound of the
    rounded product. 8-bit activations are the 4-bit kernels' alone: int8 weights take x as it
    is then."""
    import jax.numpy as jnp

    from bridge.int4 import using_activations
    from jax_llama.model.projections import Linear
    from torch_llama.projections import Linear as TorchLinear

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    q, s = quantize_weight(rng.standard_normal((48, 64)).astype(np.float32) * 0.05)
    params = {"params": {"kernel": jnp.asarray(q.T), "scale": jnp.asarray(s.T)}}
    theirs = TorchLinear(64, 48)
    theirs.make_int8(1)
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(q))
        theirs.weight_scale.copy_(torch.from_numpy(s))
    w = q.astype(np.float64) * s.astype(np.float64)
    xb = x.astype(jnp.bfloat16).astype(np.float64)
    want, scale = xb @ w.T, np.abs(xb) @ np.abs(w).T
    monkeypatch.delenv("JAX_LLAMA_INT4_ACTIVATIONS", raising=False)

    def outputs(kind):
        with using_activations(kind):
            ours = {k: np.asarray(Linear(48, kernels=k).apply(params, jnp.asarray(x)))
                    for k in ("xla", "auto")}
            with torch.no_grad():
                ours["torch"] = theirs(torch.from_numpy(x)).numpy()
        return ours

    for path, y in outputs("bfloat16").items():
        assert np.all(np.abs(y - want) <= 1e-5 * scale), path
    for kind in ("float32", "int8"):
        for path, y in outputs(kind).items():
            assert not np.all(np.abs(y - want) <= 1e-5 * scale), (kind, path)
            np.testing.assert_allclose(y, x.astype(np.float64) @ w.T, atol=1e-5, err_msg=path)
