"""`llama-bridge merge-lora`: the merged weights against float64 arithmetic and against PEFT's own
merge_and_unload (for our adapters and for PEFT-made ones), streaming memory, the adapter
description in `inspect`, and every refusal (exit 2, one line, nothing written)."""

import json
import tracemalloc

import numpy as np
import pytest
import torch

from bridge.convert import convert
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint, write_native
from bridge.lora import Adapter, LoraConfig, adapter_shapes, count_adapter_params, write_peft
from bridge.merge import merge_lora
from bridge.tensors import canonical_shapes
from bridge.tokenizer import ByteTokenizer
from conftest import random_tokens, small_config
from test_convert import expect_refusal, run_cli

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# dim 48, 6 heads / 2 kv heads of 8: wq and wk permute differently in HF; 259 ids: the byte
# tokenizer's, which travels with the base
CONFIG = small_config(vocab_size=259)
LORA = LoraConfig(rank=4, alpha=6.0)  # scale 1.5, not a power of two
# The merge runs in float32, as PEFT's does: W + scale * B @ A of O(0.1) values, each rounded to
# float32 (eps 1.2e-7) a few times, is within ~1e-7 of the float64 result; 1e-6 catches any
# misplaced row, which moves values by O(0.01).
ATOL = 1e-6


def random_base(path, config=CONFIG, seed=0):
    """A native checkpoint of random O(0.1) weights (norms near 1), with a tokenizer file."""
    rng = np.random.default_rng(seed)
    tensors = {name: (1.0 if "norm" in name else 0.0) + 0.1 * rng.standard_normal(shape, np.float32)
               for name, shape in canonical_shapes(config).items()}
    write_native(path, config, {n: (t.shape, t.dtype) for n, t in tensors.items()}, tensors.get)
    ByteTokenizer().save(path)
    return path


def random_adapter(path, config=CONFIG, lora=LORA, seed=1) -> Adapter:
    """A random adapter (B non-zero, unlike a fresh one) written as PEFT writes it."""
    rng = np.random.default_rng(seed)
    adapter = Adapter(lora, {name: 0.1 * rng.standard_normal(shape, np.float32)
                             for name, shape in adapter_shapes(config, lora).items()})
    write_peft(path, config, adapter)
    return adapter


def expected_f64(base, adapter: Adapter) -> dict[str, np.ndarray]:
    """W + alpha / r * B @ A in float64, for every tensor of `base` (untouched ones as stored)."""
    out = {}
    for name, w in open_checkpoint(base):
        a, b = (adapter.tensors.get(name.replace(".weight", f".lora_{x}.weight")) for x in "AB")
        out[name] = w.astype(np.float64)
        if a is not None:
            out[name] += adapter.lora.scale * (b.astype(np.float64) @ a.astype(np.float64))
    return out


@pytest.fixture
def base(tmp_path):
    return random_base(tmp_path / "base")


@pytest.fixture
def adapter_dir(tmp_path):
    random_adapter(tmp_path / "adapter")
    return tmp_path / "adapter"


# -- the merged weights ---------------------------------------------------------------------------

@pytest.mark.parametrize("to, targets", [("native", LORA.targets), ("hf", LORA.targets),
                                         ("native", ("wq", "wk", "w2"))])
def test_merge_equals_float64_update(tmp_path, base, capsys, to, targets):
    lora = LoraConfig(rank=4, alpha=6.0, targets=targets)
    adapter = random_adapter(tmp_path / "adapter", lora=lora)
    code, out, _ = run_cli(["merge-lora", base, tmp_path / "adapter", tmp_path / "out", "--to", to,
                            "--quiet"], capsys)
    assert code == 0 and out.strip() == str(tmp_path / "out")
    merged, expected = open_checkpoint(tmp_path / "out"), expected_f64(base, adapter)
    assert merged.format == to and list(merged.specs) == list(expected)
    assert (tmp_path / "out" / "tokenizer.json").is_file()  # travels as in convert
    changed = 0
    for name, got in merged:
        assert got.dtype == np.float32, name
        np.testing.assert_allclose(got, expected[name], rtol=0, atol=ATOL, err_msg=name)
        changed += not np.array_equal(got, open_checkpoint(base).tensor(name))
    assert changed == CONFIG.n_layers * len(targets)  # the adapted weights, and only those


def test_any_base_format_and_dtype(tmp_path, base, adapter_dir):
    """An hf base merges as the native one does; --dtype rounds the float32 merge once."""
    convert(base, tmp_path / "hf", to="hf", progress=False)
    merge_lora(base, adapter_dir, tmp_path / "a", progress=False)
    merge_lora(tmp_path / "hf", adapter_dir, tmp_path / "b", progress=False)
    merge_lora(base, adapter_dir, tmp_path / "c", dtype="bfloat16", progress=False)
    for (name, a), (_, b), (_, c) in zip(*(open_checkpoint(tmp_path / d) for d in "abc")):
        np.testing.assert_array_equal(b, a, err_msg=name)
        np.testing.assert_array_equal(c, a.astype(c.dtype), err_msg=name)


# -- against PEFT itself --------------------------------------------------------------------------

def peft_merged(hf_base, adapter_dir) -> dict[str, np.ndarray]:
    """PEFT's merge_and_unload of `adapter_dir` onto the HF checkpoint `hf_base`, by HF name."""
    model = transformers.LlamaForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return {k: v.numpy() for k, v in merged.state_dict().items()}


def ours_hf(path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_same_model(ours: dict, theirs: dict, names=None):
    for name in names or ours:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=ATOL, err_msg=name)


def test_our_adapter_merges_as_peft_merges_it(tmp_path, base, adapter_dir):
    convert(base, tmp_path / "hf", to="hf", progress=False)
    merge_lora(base, adapter_dir, tmp_path / "merged", to="hf", progress=False)
    ours, theirs = ours_hf(tmp_path / "merged"), peft_merged(tmp_path / "hf", adapter_dir)
    assert set(ours) == set(theirs)
    assert_same_model(ours, theirs)
    # and the same logits, transformers running both (weights equal to ~1e-7 give logits of
    # O(1) equal to float32 rounding, as in test_hf)
    tokens = torch.as_tensor(random_tokens(CONFIG), dtype=torch.long)
    with torch.no_grad():
        got = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged")(tokens).logits
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
        want = peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()(tokens).logits
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)


@pytest.fixture
def peft_made(tmp_path, base):
    """An adapter made by PEFT itself on our HF export of `base`, B random, as save_pretrained
    writes it; and that HF export."""
    convert(base, tmp_path / "hf", to="hf", progress=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj",
                                                              "o_proj", "up_proj"])
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    model.save_pretrained(tmp_path / "peft")
    return tmp_path / "hf", tmp_path / "peft"


def test_peft_made_adapter_merges_as_peft_merges_it(tmp_path, base, peft_made):
    hf_base, adapter = peft_made
    merge_lora(base, adapter, tmp_path / "merged", to="hf", progress=False)
    assert_same_model(ours_hf(tmp_path / "merged"), peft_merged(hf_base, adapter))


def test_a_reader_skipping_the_q_k_permutation_is_caught(tmp_path, base, peft_made, monkeypatch):
    """Negative case: with B's q/k rows left in HF's half-split order, q_proj and k_proj no longer
    match PEFT (v_proj, unpermuted, still does) - so the test above can fail."""
    hf_base, adapter = peft_made
    monkeypatch.setattr("bridge.lora.from_half_split", lambda w, heads: w)
    merge_lora(base, adapter, tmp_path / "merged", to="hf", progress=False)
    ours, theirs = ours_hf(tmp_path / "merged"), peft_merged(hf_base, adapter)
    for proj in ("q_proj", "k_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        assert np.abs(ours[name] - theirs[name]).max() > 100 * ATOL, proj
    assert_same_model(ours, theirs, ["model.layers.0.self_attn.v_proj.weight"])


# -- streaming ------------------------------------------------------------------------------------

def test_memory_is_about_one_tensor(tmp_path):
    """Merging a 36 MB model (16 layers) peaks at a few of its largest tensor (0.5 MB: the read
    one and the merge's float32 temporaries) plus the adapter (1 MB, read whole) - an eighth of
    the model, where holding it would take all of it."""
    config = small_config(dim=256, n_heads=8, n_kv_heads=2, ffn_dim=512, n_layers=16)
    random_base(tmp_path / "base", config)
    adapter = random_adapter(tmp_path / "adapter", config)
    shapes = canonical_shapes(config).values()
    largest, model = 4 * max(map(np.prod, shapes)), 4 * sum(map(np.prod, shapes))
    adapter_bytes = sum(a.nbytes for a in adapter.tensors.values())
    tracemalloc.start()  # numpy reports its allocations to tracemalloc
    try:
        merge_lora(tmp_path / "base", tmp_path / "adapter", tmp_path / "out", progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * largest + 2 * adapter_bytes, (peak, largest, adapter_bytes)
    assert peak < model / 8, (peak, model)


# -- inspect on an adapter ------------------------------------------------------------------------

def test_inspect_describes_an_adapter(adapter_dir, capsys):
    code, out, _ = run_cli(["inspect", adapter_dir], capsys)
    assert code == 0
    assert "(PEFT LoRA adapter)" in out and "rank 4, alpha 6.0 (scale 1.5)" in out
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, down_proj, up_proj" in out
    code, out, _ = run_cli(["inspect", adapter_dir, "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["tensors"] == 2 * 7 * CONFIG.n_layers
    assert report["layers"] == CONFIG.n_layers
    assert report["parameters"] == count_adapter_params(CONFIG, LORA)


# -- refusals: exit 2, one line naming the problem, nothing at DST --------------------------------

def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("case, message", [
    ("no base", "base: no such file or directory"),
    ("no adapter_config.json", "not a PEFT adapter directory (no adapter_config.json)"),
    ("not LoRA", "peft_type 'IA3'; only LORA adapters are supported"),
    ("more layers", "adapter_model.safetensors: tensor 'layers.2.feed_forward.w2.lora_A.weight' "
                    "is for layer 2; the base model has 2 layers"),
    ("other dims", "adapter_model.safetensors: tensor 'layers.0.feed_forward.w2.lora_A.weight' "
                   "has shape (4, 96); the base model and rank 4 imply (4, 80)"),

    ("out inside base", "may not be the input or lie inside it"),
    ("out inside adapter", "may not be the input or lie inside it"),
])
def test_bad_input(tmp_path, base, adapter_dir, capsys, case, message):
    dst = tmp_path / "out"
    if case == "no base":
        base = tmp_path / "base-missing"
        message = message.replace("base", str(base), 1)
    elif case == "no adapter_config.json":
        (adapter_dir / "adapter_config.json").unlink()
    elif case == "not LoRA":
        edit_json(adapter_dir / "adapter_config.json", peft_type="IA3")
    elif case == "more layers":
        adapter_dir = tmp_path / "adapter3"
        random_adapter(adapter_dir, small_config(n_layers=3))
    elif case == "other dims":
        adapter_dir = tmp_path / "adapter96"
        random_adapter(adapter_dir, small_config(ffn_dim=96))
    elif case == "out inside base":
        dst = base / "out"
    elif case == "out inside adapter":
        dst = adapter_dir / "out"
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    expect_refusal(["merge-lora", base, adapter_dir, dst], dst, message, capsys)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_destination_exists(tmp_path, base, adapter_dir, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    code, _, err = run_cli(["merge-lora", base, adapter_dir, tmp_path / "out"], capsys)
    assert code == 2 and "already exists (use --force to replace it)" in err
    assert (tmp_path / "out" / "config.json").read_text() == "{}"
    code, _, _ = run_cli(["merge-lora", base, adapter_dir, tmp_path / "out", "--force", "--quiet"],
                         capsys)
    assert code == 0 and open_checkpoint(tmp_path / "out").format == "native"


def test_library_refusal_is_a_bridge_error(tmp_path, base):
    with pytest.raises(BridgeError, match="not a PEFT adapter directory"):
        merge_lora(base, tmp_path / "nowhere", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
