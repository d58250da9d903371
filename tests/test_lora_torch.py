"""LoRA in the torch twin: adapters that change nothing until trained, the update against a float64
model of the merged weights, what trains, dropout, names, merging (in memory and while loading),
the PEFT files both ways, a bfloat16 base, the generate command, and PEFT itself on our files."""

import numpy as np
import pytest
import torch

import torch_llama
from bridge.config import LlamaConfig
from bridge.convert import convert
from bridge.errors import BridgeError
from bridge.lora import LoraConfig, adapter_shapes, read_peft, write_peft
from bridge.tensors import canonical_shapes
from bridge.tokenizer import ByteTokenizer
from conftest import random_tokens, small_config, torch_logits, torch_model
from llama_twins import float64
from llama_twins.cli import torch_main as torch_cli

CONFIG = small_config()
LORA = LoraConfig(rank=4, alpha=12.0)  # scale 3; rank 4 is none of the model's sizes

# Logits are O(1) (asserted where it matters). Adapters add one more float32 matmul pair per
# projection: against float64 the twin is off by float32 rounding, ~4e-7 measured; merged against
# unmerged, the same. 1e-5 leaves room yet is far below any real error (a missing adapter or a
# wrong scale moves the logits by ~1).
ATOL = 1e-5


def lora_model(config: LlamaConfig = CONFIG, lora: LoraConfig = LORA, seed: int = 0,
               classifier: bool = False):
    """A random model with adapters whose B is random too (a fresh B is zero: no update)."""
    torch.manual_seed(seed)
    model = (torch_llama.LlamaClassifier(config, n_classes=3) if classifier
             else torch_model(config, seed)).eval()
    torch_llama.add_lora(model, lora, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return model


def numpy_state(model) -> dict[str, np.ndarray]:
    return {name: t.detach().float().numpy().copy() for name, t in model.state_dict().items()}


# -- the forward ----------------------------------------------------------------------------------

def test_a_fresh_adapter_changes_nothing_and_is_drawn_as_peft_draws_it():
    model, tokens = torch_model(CONFIG), random_tokens(CONFIG)
    before, rng_before = torch_logits(model, tokens), torch.random.get_rng_state()
    torch_llama.add_lora(model, LORA, seed=3)
    np.testing.assert_array_equal(torch_logits(model, tokens), before)  # B = 0: bit for bit
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG untouched

    adapter = torch_llama.adapter_of(model)
    a = adapter.tensors["layers.1.feed_forward.w2.lora_A.weight"]  # w2's input is ffn_dim, 80
    assert a.shape == (4, 80) and a.dtype == np.float32
    assert 0.9 / np.sqrt(80) < np.abs(a).max() <= 1 / np.sqrt(80)  # U(-1/sqrt(in), 1/sqrt(in))
    assert not any(t.any() for name, t in adapter.tensors.items() if "lora_B" in name)
    again = torch_llama.adapter_of(torch_llama.add_lora(torch_model(CONFIG), LORA, seed=3))
    other = torch_llama.adapter_of(torch_llama.add_lora(torch_model(CONFIG), LORA, seed=4))
    np.testing.assert_array_equal(again.tensors["layers.0.attention.wq.lora_A.weight"],
                                  adapter.tensors["layers.0.attention.wq.lora_A.weight"])
    assert not np.array_equal(other.tensors["layers.0.attention.wq.lora_A.weight"],
                              adapter.tensors["layers.0.attention.wq.lora_A.weight"])


def test_adapters_give_the_logits_of_the_merged_weights_in_float64():
    model, tokens = lora_model(), random_tokens(CONFIG)
    state = {name: t.astype(np.float64) for name, t in numpy_state(model).items()}
    base = {name: w for name, w in state.items() if ".lora_" not in name}
    merged = dict(base)
    for name, w in base.items():
        a, b = (state.get(name.replace(".weight", f".lora_{x}.weight")) for x in "AB")
        if a is not None:
            merged[name] = w + LORA.scale * b @ a
    expected = float64.logits(merged, CONFIG, tokens)
    assert 0.1 < np.abs(expected).max() < 10
    np.testing.assert_allclose(torch_logits(model, tokens), expected, rtol=0, atol=ATOL)
    # The adapters matter: the base alone is far off.
    assert np.abs(float64.logits(base, CONFIG, tokens) - expected).max() > 1000 * ATOL


def test_state_dict_names_are_the_canonical_ones_plus_the_adapters():
    lora = LoraConfig(rank=4, alpha=8.0, targets=("wq", "wv", "w2"))
    model = lora_model(lora=lora)
    expected = {**canonical_shapes(CONFIG), **adapter_shapes(CONFIG, lora)}
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == expected
    assert "layers.0.attention.wk.lora_A.weight" not in model.state_dict()


# -- training -------------------------------------------------------------------------------------

@pytest.mark.parametrize("classifier", [False, True])
def test_only_the_adapters_and_a_classifier_head_train(classifier):
    model = lora_model(classifier=classifier)
    adapters = set(adapter_shapes(CONFIG, LORA))
    if classifier:
        adapters = {f"llama.{n}" for n in adapters}
    head = {"classifier.weight", "classifier.bias"} if classifier else set()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapters | head

    before = numpy_state(model)
    # Every parameter goes to the optimizer, with weight decay: frozen ones (no gradient) are
    # still not touched.
    optimizer = torch_llama.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = torch.as_tensor(random_tokens(CONFIG))
    model.train()
    out = (model(tokens, torch.ones_like(tokens)) if classifier else model(tokens))
    out.logsumexp(-1).mean().backward()
    optimizer.step()
    after = numpy_state(model)
    changed = {n for n in before if not np.array_equal(before[n], after[n])}
    assert changed == adapters | head


def test_dropout_acts_in_train_mode_only():
    tokens = torch.as_tensor(random_tokens(CONFIG))
    model = lora_model(lora=LoraConfig(rank=4, alpha=12.0, dropout=0.5))
    no_dropout = lora_model()  # the same tensors (same seeds), dropout 0
    with torch.no_grad():
        eval_logits = model.eval()(tokens)
        assert torch.equal(eval_logits, model(tokens))
        assert torch.equal(eval_logits, no_dropout(tokens))
        train_logits = model.train()(tokens)
        assert not torch.allclose(train_logits, eval_logits, rtol=0, atol=1e-3)
        assert not torch.equal(train_logits, model(tokens))  # a fresh mask each call
        assert torch.equal(no_dropout.train()(tokens), eval_logits)  # the adapter's is the only one


def test_bfloat16_base_with_float32_adapters_runs_and_trains():
    model = torch_model(CONFIG).to(torch.bfloat16)
    torch_llama.add_lora(model, LORA)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == (torch.float32 if ".lora_" in n else torch.bfloat16) for n, d in dtypes.items())
    tokens = torch.as_tensor(random_tokens(CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.05)
    model.train()
    logits = model(tokens)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)


# -- merging, saving, loading, the PEFT files -----------------------------------------------------

def test_merge_lora_gives_the_same_logits_under_canonical_names_only():
    model, tokens = lora_model(), random_tokens(CONFIG)
    expected, adapter = torch_logits(model, tokens), torch_llama.adapter_of(model)
    state = numpy_state(model)
    torch_llama.merge_lora(model)
    assert list(model.state_dict()) == list(canonical_shapes(CONFIG))
    assert all(p.requires_grad for p in model.parameters())
    np.testing.assert_allclose(torch_logits(model, tokens), expected, rtol=0, atol=ATOL)
    name = "layers.1.attention.wk.weight"
    np.testing.assert_allclose(model.state_dict()[name].numpy(), adapter.merged(name, state[name]),
                               rtol=0, atol=1e-7)  # float32 sums of 4 terms, ordered differently
    assert torch_llama.merge_lora(model) is model  # nothing left to merge: as it is
    with pytest.raises(BridgeError, match="no LoRA adapters") as caught:
        torch_llama.adapter_of(model)
    assert caught.value.field == "model"


def test_save_refuses_unmerged_adapters(tmp_path):
    with pytest.raises(BridgeError, match=r"merge_lora.*save_adapter.*write_peft") as caught:
        torch_llama.save(tmp_path / "ckpt", lora_model())
    assert caught.value.field == "model" and not (tmp_path / "ckpt").exists()


def test_add_lora_refuses_a_second_adapter_and_a_mismatched_one():
    model = lora_model()
    with pytest.raises(BridgeError, match="already has LoRA adapters"):
        torch_llama.add_lora(model, LORA)
    adapter = torch_llama.adapter_of(model)
    with pytest.raises(BridgeError) as caught:
        torch_llama.add_lora(torch_model(CONFIG), LoraConfig(rank=4, alpha=8.0), adapter=adapter)
    assert caught.value.field == "lora"
    with pytest.raises(BridgeError, match="'layers.2.attention.wq.lora_A.weight' is missing"):
        torch_llama.add_lora(torch_model(small_config(n_layers=3)), LORA, adapter=adapter)


def test_peft_files_round_trip_and_load_merges_as_merge_lora_does(tmp_path):
    model, tokens = lora_model(), random_tokens(CONFIG)
    adapter = torch_llama.adapter_of(model)
    write_peft(tmp_path / "adapter", CONFIG, adapter)
    back = read_peft(tmp_path / "adapter", CONFIG)
    assert back.lora == LORA and back.tensors.keys() == adapter.tensors.keys()
    for name, t in adapter.tensors.items():
        np.testing.assert_array_equal(back.tensors[name], t)

    # The same adapter on a fresh copy of the base: the same logits, bit for bit.
    again = torch_llama.add_lora(torch_model(CONFIG), LORA, adapter=back)
    expected = torch_logits(model, tokens)
    np.testing.assert_array_equal(torch_logits(again, tokens), expected)

    torch_llama.save(tmp_path / "base", torch_model(CONFIG))
    loaded = torch_llama.load(tmp_path / "base", device="cpu", adapter=tmp_path / "adapter")
    assert list(loaded.state_dict()) == list(canonical_shapes(CONFIG))
    merged = torch_llama.merge_lora(model)
    for name, t in merged.state_dict().items():  # numpy's and torch's sums of 4 products
        np.testing.assert_allclose(loaded.state_dict()[name].numpy(), t.numpy(), rtol=0, atol=1e-7)
    np.testing.assert_allclose(torch_logits(loaded, tokens), expected, rtol=0, atol=ATOL)


# -- the command line -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def generate_files(tmp_path_factory):
    """(base checkpoint, its adapter, the checkpoint with the adapter merged), byte tokenizer."""
    root = tmp_path_factory.mktemp("lora_cli")
    config = small_config(vocab_size=259)
    model = lora_model(config)
    with torch.no_grad():  # a decisive adapter, so that greedy tokens show whether it was used
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(5)
    torch_llama.save_adapter(root / "adapter", model)
    torch_llama.save(root / "base", torch_model(config))
    torch_llama.save(root / "merged", torch_llama.merge_lora(model))
    for path in ("base", "merged"):
        ByteTokenizer().save(root / path)
    return root / "base", root / "adapter", root / "merged"


def generate(capsys, checkpoint, *flags) -> str:
    argv = ["generate", str(checkpoint), "--prompt", "hello", "--max-new-tokens", "12",
            "--device", "cpu", *flags]
    assert torch_cli.main(argv) == 0
    return capsys.readouterr().out


def test_generate_with_an_adapter_is_generate_with_it_merged(generate_files, capsys):
    base, adapter, merged = generate_files
    with_adapter = generate(capsys, base, "--adapter", str(adapter))
    assert with_adapter == generate(capsys, merged) and with_adapter.strip()
    assert with_adapter != generate(capsys, base)


@pytest.mark.parametrize("change, tensor", [
    (dict(dim=96), "tensor 'layers.0.feed_forward.w2.lora_B.weight' has shape (96, 4); the base "
                   "model and rank 4 imply (48, 4)"),
    (dict(n_layers=3), "tensor 'layers.2.feed_forward.w2.lora_A.weight' is for layer 2; the "
                       "base model has 2 layers"),
])
def test_generate_refuses_an_adapter_for_another_model(generate_files, tmp_path, capsys, change,
                                                       tensor):
    base, _, _ = generate_files
    other = small_config(vocab_size=259, **change)
    write_peft(tmp_path / "other", other,
               torch_llama.adapter_of(torch_llama.add_lora(torch_model(other), LORA)))
    argv = ["generate", str(base), "--prompt", "hello", "--device", "cpu",
            "--adapter", str(tmp_path / "other")]
    assert torch_cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("error: ") and tensor in captured.err


# -- Hugging Face PEFT on the same base and our adapter files -------------------------------------

@pytest.fixture
def peft_files(tmp_path):
    """(our LoRA model, the HF export of its base, our adapter in PEFT format)."""
    pytest.importorskip("peft")
    model = lora_model()
    base = torch_model(CONFIG)  # lora_model's base: the same seed
    torch_llama.save(tmp_path / "native", base)
    convert(tmp_path / "native", tmp_path / "hf", to="hf", progress=False)
    write_peft(tmp_path / "adapter", CONFIG, torch_llama.adapter_of(model))
    return model, tmp_path / "hf", tmp_path / "adapter"


def peft_logits(hf_dir, adapter_dir, tokens) -> np.ndarray:
    import peft
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def test_peft_reads_our_adapter_as_we_run_it(peft_files):
    # transformers + PEFT and our twin do the same float32 math in a different order (half-split
    # RoPE on permuted rows, PEFT's x A^T B^T beside the base): float32 rounding, ~2.4e-7
    # measured, so ATOL. Without the permutation of B's rows the difference is ~0.07 (below).
    model, hf_dir, adapter_dir = peft_files
    tokens = random_tokens(CONFIG, seq_len=20)
    expected = torch_logits(model, tokens)
    assert 0.1 < np.abs(expected).max() < 10
    np.testing.assert_allclose(peft_logits(hf_dir, adapter_dir, tokens), expected, rtol=0,
                               atol=ATOL)


def test_peft_catches_an_adapter_written_without_the_qk_permutation(peft_files, monkeypatch):
    import bridge.lora

    model, hf_dir, adapter_dir = peft_files
    # B's rows of wq and wk in the canonical (interleaved) order, not HF's half-split one
    monkeypatch.setattr(bridge.lora, "to_half_split", lambda w, n_heads: w)
    raw = write_peft(adapter_dir.with_name("raw"), CONFIG, torch_llama.adapter_of(model))
    tokens = random_tokens(CONFIG, seq_len=20)
    diff = np.abs(peft_logits(hf_dir, raw, tokens) - torch_logits(model, tokens)).max()
    assert diff > 100 * ATOL
