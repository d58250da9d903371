"""LoRA with the embedding table trained too (`--lora-train-embeddings`, PEFT's
modules_to_save=["embed_tokens"]): what trains in each twin, the same trajectory in both, the PEFT
files both ways (tied and untied LM heads), merging, the finetune command, and every refusal."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_llama
import torch_llama
from bridge.convert import convert
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from bridge.lora import EMBEDDING, LoraConfig, adapter_shapes, read_peft
from bridge.merge import merge_lora as merge_checkpoint
from conftest import random_tokens, small_config, torch_logits
from jax_llama.lora import add_lora, adapter_of, count, merge_lora, save_adapter, split, trainable_for
from llama_twins.cli import main as jax_cli
from test_classify import synthetic_lines
from test_lora import _batch, _steps, with_random_b

LORA = LoraConfig(rank=4, alpha=8.0, train_embeddings=True)
# float32 in two frameworks (or PEFT beside us): ~1e-6 apart on O(1) logits; a table that is not
# the trained one, or an LM head left untied, moves them by > 1e-2 (asserted where it matters).
ATOL = 1e-5


def trained(config, tied: bool, seed: int = 0):
    """(model, params, lora model, lora params): a random JAX model with an adapter whose B is
    random and whose embedding table has moved, as after training."""
    config = config.replace(tie_embeddings=tied)
    model, params = jax_llama.init(config, seed=seed)
    lora_model, lora_params = add_lora(model, params, LORA, seed=seed)
    lora_params = with_random_b(lora_params)
    table = lora_params["tok_embeddings"]["embedding"]
    noise = 0.05 * jax.random.normal(jax.random.key(seed + 7), table.shape)
    lora_params["tok_embeddings"]["embedding"] = table + noise
    return model, params, lora_model, lora_params


def logits(model, params, tokens) -> np.ndarray:
    return np.asarray(model.apply({"params": params}, tokens))


# -- what trains ----------------------------------------------------------------------------------

def test_the_table_trains_in_float32_beside_the_adapters_and_the_rest_stays():
    config = small_config()
    model, params = jax_llama.init(config, seed=0, param_dtype="bfloat16")
    model = model.clone(dtype=jnp.bfloat16)
    lora_model, lora_params = add_lora(model, params, LORA)
    labels = trainable_for(LORA)
    state, metrics = _steps(lora_model, lora_params, jax_llama.TrainConfig(steps=10, lr=1e-2),
                            [_batch(config, seed=s) for s in range(3)], labels)
    frozen_before, trained_before = split(lora_params, embeddings=True)
    frozen_after, trained_after = split(state.params, embeddings=True)
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(frozen_after)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    table = ("tok_embeddings", "embedding")
    assert trained_after[table[0]][table[1]].dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(frozen_after)} == {jnp.dtype(jnp.bfloat16)}
    moved = float(jnp.abs(trained_after[table[0]][table[1]] - trained_before[table[0]][table[1]]).max())
    assert moved > 1e-3  # ~lr per step on the rows of the batches' tokens
    n_trained = count(trained_before)
    assert n_trained == count(lora_params, labels(lora_params))
    assert n_trained == config.vocab_size * config.dim + count(split(lora_params)[1])
    assert sum(x.size for x in jax.tree.leaves(state.opt_state) if x.size > 1) == 2 * n_trained
    assert all(np.isfinite(m["loss"]) for m in metrics)

    merged_model, merged = merge_lora(lora_model, state.params)
    assert merged[table[0]][table[1]].dtype == jnp.bfloat16  # back to the base's dtype


def test_torch_trains_the_table_too_and_merging_restores_its_dtype():
    config = small_config(tie_embeddings=True)
    model = torch_llama.Llama(config).to(torch.bfloat16)
    torch_llama.add_lora(model, LORA)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert EMBEDDING in names and all(n == EMBEDDING or ".lora_" in n for n in names)
    assert model.tok_embeddings.weight.dtype == torch.float32
    tokens = torch.as_tensor(random_tokens(config))
    model(tokens).float().sum().backward()  # the bf16 body and the float32 table run together
    assert model.tok_embeddings.weight.grad.abs().max() > 0
    assert set(torch_llama.adapter_of(model).tensors) == set(adapter_shapes(config, LORA))
    torch_llama.merge_lora(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_both_twins_follow_the_same_trajectory(tmp_path):
    from test_cross_framework import jax_run, learnable_batches, torch_run

    config = small_config()
    tc = jax_llama.TrainConfig(steps=20, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=3)
    batches = learnable_batches(config, tc)
    model, params = jax_llama.init(config, seed=0)
    jax_llama.save(tmp_path / "init", config, params)
    lora_model, lora_params = add_lora(model, params, LORA, seed=5)
    start = adapter_of(lora_model, lora_params)
    state, jax_losses = jax_run(lora_model, lora_params, tc, batches, trainable_for(LORA))
    tmodel = torch_llama.load(tmp_path / "init", device="cpu").train()
    torch_llama.add_lora(tmodel, LORA, adapter=start)
    torch_losses = torch_run(tmodel, tc, batches)
    # The bounds of test_cross_framework's LoRA run (float32 in both, the same AdamW).
    np.testing.assert_allclose(torch_losses, jax_losses, rtol=2e-6, atol=0)
    ours, theirs = adapter_of(lora_model, state.params).tensors, torch_llama.adapter_of(tmodel).tensors
    assert float(np.abs(ours[EMBEDDING] - start.tensors[EMBEDDING]).max()) > 1e-2  # it trained
    for name, tensor in theirs.items():
        np.testing.assert_allclose(tensor, ours[name], rtol=0, atol=2e-5, err_msg=name)


# -- the PEFT files -------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_peft_runs_our_adapter_as_we_do(tmp_path, tied):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    config = small_config(tie_embeddings=tied)
    model, params, lora_model, lora_params = trained(config, tied)
    jax_llama.save(tmp_path / "base", config, params)
    convert(tmp_path / "base", tmp_path / "hf", to="hf", progress=False)
    save_adapter(tmp_path / "adapter", lora_model, lora_params)

    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["modules_to_save"] == ["embed_tokens"] and saved["ensure_weight_tying"] == tied
    from safetensors import safe_open
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert "base_model.model.model.embed_tokens.weight" in keys
    assert ("base_model.model.lm_head.weight" in keys) == tied
    back = read_peft(tmp_path / "adapter", config)
    assert back.lora == LORA
    np.testing.assert_array_equal(back.tensors[EMBEDDING],
                                  np.asarray(lora_params["tok_embeddings"]["embedding"]))

    tokens = random_tokens(config)
    expected = logits(lora_model, lora_params, tokens)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = peft_model(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    # Negative case: the base's table instead of the trained one is far off.
    without = merge_lora(lora_model, {**lora_params, "tok_embeddings": params["tok_embeddings"]})
    assert np.abs(logits(*without, tokens) - expected).max() > 1e-2


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_peft_made_adapter_with_embed_tokens_runs_as_peft_runs_it(tmp_path, tied):
    pytest.importorskip("peft")
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    config = small_config(tie_embeddings=tied)
    model, params = jax_llama.init(config, seed=0)
    jax_llama.save(tmp_path / "base", config, params)
    convert(tmp_path / "base", tmp_path / "hf", to="hf", progress=False)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    peft_model = get_peft_model(hf, PeftLoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "down_proj"],
        modules_to_save=["embed_tokens"], ensure_weight_tying=tied))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
            elif "modules_to_save" in name:  # PEFT's trained copy of the table
                p.add_(0.05 * torch.randn_like(p))
    peft_model.eval().save_pretrained(tmp_path / "theirs")
    tokens = random_tokens(config)
    with torch.no_grad():
        expected = peft_model(torch.as_tensor(tokens)).logits.numpy()

    adapter = read_peft(tmp_path / "theirs", config)
    assert adapter.lora.train_embeddings and adapter.lora.targets == ("wq", "wk", "w2")
    jax_model, jax_params = add_lora(model, params, adapter.lora, adapter=adapter)
    np.testing.assert_allclose(logits(jax_model, jax_params, tokens), expected, rtol=0, atol=ATOL)
    loaded = torch_llama.load(tmp_path / "base", device="cpu", adapter=tmp_path / "theirs")
    np.testing.assert_allclose(torch_logits(loaded, tokens), expected, rtol=0, atol=ATOL)
    # merge-lora streams the table in place of the base's: the same model again.
    merge_checkpoint(tmp_path / "base", tmp_path / "theirs", tmp_path / "merged", progress=False)
    np.testing.assert_array_equal(dict(open_checkpoint(tmp_path / "merged"))[EMBEDDING],
                                  adapter.tensors[EMBEDDING])
    merged_model, merged_params = jax_llama.load(tmp_path / "merged")
    np.testing.assert_allclose(logits(merged_model, merged_params, tokens), expected, rtol=0,
                               atol=ATOL)


def _edit(path, config_changes=None, tensors=None):
    from safetensors.numpy import load_file, save_file

    cfg = path / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **(config_changes or {})}))
    if tensors is not None:
        weights = path / "adapter_model.safetensors"
        save_file(tensors(load_file(str(weights))), str(weights))


HEAD, TABLE = "base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"


def test_a_tied_base_without_ensure_weight_tying_is_refused_because_peft_unties_it(tmp_path):
    """PEFT with modules_to_save=["embed_tokens"] alone trains a copy of the table and leaves a
    tied LM head on the old one: a model ours cannot hold. Read, it would run differently."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    config = small_config(tie_embeddings=True)
    model, params, lora_model, lora_params = trained(config, tied=True)
    jax_llama.save(tmp_path / "base", config, params)
    convert(tmp_path / "base", tmp_path / "hf", to="hf", progress=False)
    save_adapter(tmp_path / "adapter", lora_model, lora_params)
    # What PEFT itself writes without ensure_weight_tying: the table alone.
    _edit(tmp_path / "adapter", {"ensure_weight_tying": False},
          lambda t: {k: v for k, v in t.items() if k != HEAD})
    with pytest.raises(BridgeError, match="modules_to_save embed_tokens without "
                                          "ensure_weight_tying or an lm_head tensor, on a base"):
        read_peft(tmp_path / "adapter", config)
    tokens = random_tokens(config)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        untied = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(
            torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(untied - logits(lora_model, lora_params, tokens)).max() > 1e-2


@pytest.mark.parametrize("tied, config_changes, tensors, message", [
    (False, {"modules_to_save": ["lm_head"]}, None,
     "modules_to_save 'lm_head' is not supported (only embed_tokens, the embedding table)"),
    (False, {"modules_to_save": None}, None,
     f"tensor '{TABLE}' is a whole module, which modules_to_save does not list"),
    (False, None, lambda t: {**t, HEAD: t[TABLE]},
     f"tensor '{HEAD}' trains the LM head, which is not supported"),
    (True, None, lambda t: {**t, HEAD: t[TABLE] + 1},
     f"tensor '{HEAD}' differs from the embedding table, which the base model ties it to"),
    (False, None, lambda t: {k: v for k, v in t.items() if k != TABLE},
     "tensor 'tok_embeddings.weight' is missing"),
    (False, None, lambda t: {**t, TABLE: t[TABLE][:-1]},
     "tensor 'tok_embeddings.weight' has shape (96, 48)"),
], ids=["lm_head-listed", "not-listed", "untied-head", "tied-head-differs", "no-table", "shape"])
def test_refusals_name_the_field_or_tensor(tmp_path, tied, config_changes, tensors, message):
    config = small_config(tie_embeddings=tied)
    _, _, lora_model, lora_params = trained(config, tied)
    save_adapter(tmp_path / "adapter", lora_model, lora_params)
    _edit(tmp_path / "adapter", config_changes, tensors)
    with pytest.raises(BridgeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_peft(tmp_path / "adapter", config)


def test_the_setting_must_be_a_bool():
    with pytest.raises(BridgeError) as caught:
        LoraConfig(train_embeddings="yes")
    assert caught.value.field == "lora_train_embeddings"


# -- the finetune command -------------------------------------------------------------------------

def test_finetune_with_lora_and_the_table_writes_both_and_predicts_as_it_reported(tmp_path, capsys):
    (tmp_path / "train.txt").write_text(synthetic_lines(200, seed=0))
    (tmp_path / "dev.txt").write_text(synthetic_lines(60, seed=1))
    (tmp_path / "labels.json").write_text('["negative", "positive"]')
    out = tmp_path / "run"
    assert jax_cli.main(["finetune", "--train", str(tmp_path / "train.txt"), "--dev",
                         str(tmp_path / "dev.txt"), "--labels", str(tmp_path / "labels.json"),
                         "--out", str(out), "--vocab-size", "300", "--epochs", "2",
                         "--max-len", "64", "--lora-rank", "2", "--lora-train-embeddings",
                         "--lr", "5e-3"]) == 0
    captured = capsys.readouterr()
    assert "LoRA rank 2 on wq, wk, wv, wo, w1, w2, w3, the embedding table and the head" in captured.err
    best = out / "model"
    saved = json.loads((best / "adapter" / "adapter_config.json").read_text())
    assert saved["modules_to_save"] == ["embed_tokens"]
    config = jax_llama.load(best)[0].config
    adapter = read_peft(best / "adapter", config)
    # The merged backbone holds the trained table (float32 base: the adapter's exactly).
    np.testing.assert_array_equal(dict(open_checkpoint(best))[EMBEDDING], adapter.tensors[EMBEDDING])
    accuracy = json.loads((best / "classifier.json").read_text())["dev_accuracy"]
    assert jax_cli.main(["predict", str(out), "--data", str(tmp_path / "dev.txt")]) == 0
    assert f"classifier accuracy {accuracy:.4f}" in capsys.readouterr().err
