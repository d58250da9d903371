"""bridge.layout: how a load holds a checkpoint's weights, decided once for both twins and every
command - the decision table, both twins' equal layouts and logits, a library load against the
command line's on SmolLM2, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

import jax_llama
import torch_llama
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from bridge.layout import Layout, decide_layout, held_as
from conftest import random_tokens, save_random_checkpoint, small_config, torch_logits
from jax_llama.checkpoint import held_layouts
from torch_llama.checkpoint import held_layouts as torch_held_layouts

# Untied, dims that 4-bit groups of 32 divide (64, 96); vocab 259 for the byte tokenizer.
FITS = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=259, tie_embeddings=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every kind of checkpoint a request meets: float (native), a float one whose 48 inputs do
    not fit 4-bit groups, native int8 and 4-bit, and Q4_0 / Q4_1 / Q8_0 GGUF files of the float
    one (the bridge's exporter: the output projection Q8_0)."""
    from bridge.convert import convert
    from bridge.tokenizer import ByteTokenizer

    root = tmp_path_factory.mktemp("layout")
    native = save_random_checkpoint(root / "float", small_config(**FITS), seed=3, tokenizer=True)
    narrow = save_random_checkpoint(root / "narrow", small_config(vocab_size=259), seed=3,
                                    tokenizer=True)
    config = open_checkpoint(native).config
    params = jax_llama.load(native)[1]
    jax_llama.save(root / "int8", config, jax_llama.quantize(params))
    jax_llama.save(root / "int4", config, jax_llama.quantize(params, method="int4"))
    ByteTokenizer().save(root / "int4")
    out = {"float": native, "narrow": narrow, "int8": root / "int8", "int4": root / "int4"}
    for t in ("q4_0", "q4_1", "q8_0"):
        out[t] = convert(native, root / f"model-{t}.gguf", to="gguf", dtype=t, progress=False)
    return out


# (checkpoint, quantize, group_size, dtype, adapter) -> (weights, group_size, after, native)
TABLE = [
    ("float", None, None, None, False, ("float", None, False, False)),
    ("float", "auto", None, None, False, ("float", None, False, False)),
    ("float", "stored", None, None, False, ("float", None, False, False)),
    ("float", "int8", None, None, False, ("int8", None, False, False)),
    ("float", "int8", 16, None, False, ("int8", 16, True, False)),
    ("float", "int8", None, None, True, ("int8", None, True, False)),
    ("float", "int4", None, None, False, ("int4", 32, False, False)),
    ("float", "int4", 32, "bfloat16", False, ("int4", 32, False, False)),
    ("q4_0", None, None, None, False, ("float", None, False, False)),
    ("q4_0", "auto", None, None, False, ("stored", None, False, False)),
    ("q4_0", "auto", None, "float32", False, ("float", None, False, False)),
    ("q4_0", "auto", None, None, True, ("float", None, False, False)),
    ("q4_1", "stored", None, "bfloat16", False, ("stored", None, False, False)),
    ("q4_1", "int4", None, None, False, ("int4", 32, False, False)),
    ("q8_0", "auto", None, None, False, ("stored", None, False, False)),
    ("q8_0", "int8", None, None, False, ("int8", None, False, False)),
    ("int8", None, None, None, False, ("int8", None, False, True)),
    ("int8", "auto", None, None, False, ("int8", None, False, True)),
    ("int8", "int8", None, None, False, ("int8", None, False, True)),
    ("int4", None, None, None, False, ("int4", 32, False, True)),
    ("int4", "stored", None, None, False, ("int4", 32, False, True)),
    ("int4", "int4", 32, None, False, ("int4", 32, False, True)),
]


@pytest.mark.parametrize("kind, quantize, group_size, dtype, adapter, want", TABLE)
def test_the_decision_table(files, kind, quantize, group_size, dtype, adapter, want):
    layout = decide_layout(open_checkpoint(files[kind]), quantize, group_size, dtype,
                           adapter=adapter)
    assert (layout.weights, layout.group_size, layout.after, layout.native) == want
    assert layout.dtype == dtype
    assert (layout.describe("f") is not None) == (layout.weights == "stored")


def test_stored_says_what_each_type_becomes(files):
    """A Q4_1 file's projections are read exactly as 4-bit weights; its Q8_0 head and quantised
    embedding become int8 rows: said, with how to dequantise."""
    layout = decide_layout(open_checkpoint(files["q4_1"]), "auto")
    assert dict(layout.stored) == {"Q4_1 -> int4 (exact)": 14, "Q4_1 -> int8 rows": 1,
                                   "Q8_0 -> int8 rows": 1}
    assert layout.describe("m.gguf") == (
        "m.gguf: read in its nearest quantised layout (1 Q4_1 -> int8 rows, 14 Q4_1 -> int4 "
        "(exact), 1 Q8_0 -> int8 rows); --dtype float32 dequantises")
    assert layout.quantization is None and Layout("int8", 16).quantization.group_size == 16


# (checkpoint, request) -> the field named and a piece of the one line
REFUSED = [
    ("float", dict(quantize="nearest"), "quantize", "expected one of int8, int4, stored, auto"),
    ("float", dict(quantize="auto", group_size=16), "group_size", "int8 weights"),
    ("float", dict(quantize="int4", group_size=64), "group_size", "groups of 32 inputs"),
    ("float", dict(quantize="int8", group_size=48), "group_size", "48 does not divide the 64"),
    ("float", dict(quantize="int4", adapter=True), "quantize", "without an adapter"),
    ("float", dict(quantize="int8", whole="scan_layers"), "quantize", "without scan_layers"),
    ("float", dict(dtype="float64"), "dtype", "expected one of float32"),
    ("narrow", dict(quantize="int4"), "quantize",
     "'layers.0.attention.wq.weight': 48 input columns are not a multiple of the 4-bit group"),
    ("q4_0", dict(quantize="stored", adapter=True), "quantize", "stored weights are read"),
    ("int8", dict(quantize="int4"), "quantize", "holds int8 weights (quantize='int4' reads"),
    ("int8", dict(quantize="int8", group_size=16), "group_size", "quantised with group size"),
    ("int8", dict(adapter=True), "adapter", "cannot be merged into"),
    ("int4", dict(quantize="int8"), "quantize", "holds int4 weights"),
    ("int4", dict(whole="scan_layers"), None, "cannot be read with scan_layers"),
]


@pytest.mark.parametrize("kind, request_, field, words", REFUSED)
def test_what_a_checkpoint_cannot_satisfy_is_refused_naming_the_field(files, kind, request_,
                                                                      field, words):
    with pytest.raises(BridgeError) as caught:
        decide_layout(open_checkpoint(files[kind]), **request_)
    assert caught.value.field == field
    assert words in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("kind, quantize, held", [
    ("float", None, {"float32"}),
    ("float", "int8", {"int8", "float32"}),
    ("float", "int4", {"int4", "float32"}),
    ("q4_0", "auto", {"int4", "int8", "float32"}),
    ("q4_1", "stored", {"int4", "int8", "float32"}),
    ("q4_1", "int4", {"int4", "float32"}),
    ("int4", None, {"int4", "float32"}),
])
def test_both_twins_hold_the_same_layout_and_agree(files, kind, quantize, held):
    """jax_llama.load and torch_llama.load, given the same request, hold every weight the same
    way (the projections as the table says, the norms float32) and compute the same logits to
    float32 rounding (atol 2e-5: sums of the same products in another order, logits of about 1)."""
    model, params = jax_llama.load(files[kind], quantize=quantize)
    tmodel = torch_llama.load(files[kind], device="cpu", quantize=quantize)
    layouts = held_layouts(params, model.config)
    assert layouts == torch_held_layouts(tmodel)
    assert set(layouts.values()) == held
    assert layouts["layers.1.attention_norm.weight"] == "float32"
    tokens = random_tokens(model.config)
    np.testing.assert_allclose(torch_logits(tmodel, tokens),
                               np.asarray(model.apply({"params": params}, tokens)), rtol=0,
                               atol=2e-5)


def test_int8_in_groups_is_quantised_after_the_read_in_both_twins(files):
    """A group size: the float model read, then quantised whole - the numbers of
    jax_llama.quantize / torch_llama.quantize of the float load."""
    _, params = jax_llama.load(files["float"], quantize="int8", group_size=16)
    want = jax_llama.quantize(jax_llama.load(files["float"])[1], group_size=16)
    wq, want_wq = params["layers_0"]["attention"]["wq"], want["layers_0"]["attention"]["wq"]
    assert wq["scale"].shape == (64 // 16, 64)
    for leaf in ("kernel", "scale"):
        np.testing.assert_array_equal(np.asarray(wq[leaf]), np.asarray(want_wq[leaf]))
    tmodel = torch_llama.load(files["float"], device="cpu", quantize="int8", group_size=16)
    np.testing.assert_array_equal(tmodel.layers[0].attention.wq.weight.numpy(),
                                  np.asarray(want_wq["kernel"]).T)


def test_held_as_names_what_a_weight_is():
    import ml_dtypes
    import torch

    assert [held_as(d) for d in (np.uint8, np.int8, np.float32, ml_dtypes.bfloat16,
                                 torch.uint8, torch.bfloat16)] == [
        "int4", "int8", "float32", "bfloat16", "int4", "bfloat16"]
    with pytest.raises(BridgeError, match="expected one of float32"):
        held_as(np.int32)


def test_a_library_load_is_what_generate_loads(smollm2, monkeypatch, capsys):
    """One keyword, quantize="auto", gives a library caller of SmolLM2's Q4_1 file what `jax-llama
    generate` holds: the same layout of every weight, the same bits, the same logits."""
    import jax

    import jax_llama.checkpoint
    from llama_twins.cli import main as jax_cli

    loaded = []
    real = jax_llama.checkpoint.load

    def keep(*args, **kwargs):
        loaded.append(real(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(jax_llama.checkpoint, "load", keep)
    assert jax_cli.main(["generate", str(smollm2), "--prompt", "Paris is", "--max-new-tokens",
                         "2", "--no-progress"]) == 0
    capsys.readouterr()
    (cli_model, cli_params), = loaded
    model, params = real(smollm2, quantize="auto")
    layouts = held_layouts(params, model.config)
    assert layouts == held_layouts(cli_params, cli_model.config)
    assert layouts["layers.0.attention.wq.weight"] == "int4"
    assert layouts["tok_embeddings.weight"] == "int8"  # the tied head, Q8_0: int8 rows
    assert jax.tree.structure(params) == jax.tree.structure(cli_params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(cli_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.array([[1, 504, 3458, 282]], np.int32)
    np.testing.assert_array_equal(np.asarray(model.apply({"params": params}, tokens)),
                                  np.asarray(cli_model.apply({"params": cli_params}, tokens)))
    _, floats = real(smollm2)  # without the keyword: float32, dequantised
    assert set(held_layouts(floats, model.config).values()) == {"float32"}


def test_commands_refuse_a_bad_request_in_one_line(files, capsys, tmp_path):
    """The commands pass their flags to the library, whose refusal becomes one line naming the
    flag and exit code 2."""
    from llama_twins.cli import main as jax_cli
    from llama_twins.cli import torch_main

    argv = ["generate", str(files["narrow"]), "--prompt", "a", "--quantize", "int4"]
    assert jax_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --quantize: tensor 'layers.0.attention.wq.weight': 48 input "
                          "columns") and err.count("\n") == 1
    assert torch_main.main([*argv, "--device", "cpu"]) == 2
    assert capsys.readouterr().err == err
    (tmp_path / "a.txt").write_text("some text to score")
    assert jax_cli.main(["eval", str(files["int4"]), "--data", str(tmp_path / "a.txt"),
                         "--quantize", "int8"]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: --quantize: {files['int4']} holds int4 weights (--quantize int8 reads a float")


def test_a_load_onto_a_mesh_reads_float_weights_only(files):
    """A mesh load reads each process's slices of float tensors: a quantised layout is refused,
    naming mesh, before any weight is read; the float request loads."""
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    for kind, quantize in (("float", "int8"), ("q4_0", "auto"), ("int4", None)):
        with pytest.raises(BridgeError, match="load it whole") as caught:
            jax_llama.load(files[kind], mesh=mesh, quantize=quantize)
        assert caught.value.field == "mesh"
    _, params = jax_llama.load(files["q4_0"], mesh=mesh)
    assert set(held_layouts(params, open_checkpoint(files["q4_0"]).config).values()) == {"float32"}
