"""LoRA in the JAX model: a fresh adapter changes nothing, an adapter's logits are those of the
merged weights, training moves only the adapters (optax's partition: no state for the base), and
it composes with scan, remat, bfloat16 bases, accumulation, resume and the command line."""

import json
import re
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_llama
from bridge.errors import BridgeError
from bridge.lora import LoraConfig, adapter_shapes, read_peft
from bridge.tensors import canonical_shapes
from conftest import interrupted_at, random_tokens, save_random_checkpoint, small_config
from test_train import corpus  # noqa: F401  (a fixture)
from jax_llama.checkpoint import params_from_tensors, tensor_specs
from jax_llama.lora import (add_lora, adapter_of, combine, count, merge_lora, save_adapter, split,
                            trainable)
from jax_llama.training.step import TrainConfig, init_state, lm_loss, lr_schedule, make_optimizer, make_train_step

LORA = LoraConfig(rank=4, alpha=8.0)


def with_random_b(params, seed=1, scale=0.05):
    """B is zero in a fresh adapter; random B makes the adapter do something."""
    key = jax.random.key(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (scale * jax.random.normal(jax.random.fold_in(key, zlib.crc32(str(path).encode()) % 2**31),
                                                   x.shape)).astype(x.dtype)
        if "lora_B" in str(path) else x, params)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_fresh_adapter_changes_nothing(scan_layers):
    config = small_config()
    model, params = jax_llama.init(config, seed=0, scan_layers=scan_layers)
    tokens = random_tokens(config)
    lora_model, lora_params = add_lora(model, params, LORA, seed=3)
    np.testing.assert_array_equal(np.asarray(lora_model.apply({"params": lora_params}, tokens)),
                                  np.asarray(model.apply({"params": params}, tokens)))
    adapter = adapter_of(lora_model, lora_params)
    # PEFT's init: A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0.
    a = adapter.tensors["layers.1.feed_forward.w2.lora_A.weight"]
    assert a.shape == (4, config.ffn_dim) and np.abs(a).max() <= 1 / np.sqrt(config.ffn_dim)
    assert np.abs(a).max() > 0.8 / np.sqrt(config.ffn_dim)
    assert not any(np.any(t) for n, t in adapter.tensors.items() if "lora_B" in n)
    assert set(adapter.tensors) == set(adapter_shapes(config, LORA))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_adapter_logits_equal_the_merged_weights_computed_in_numpy(scan_layers):
    config = small_config()
    model, params = jax_llama.init(config, seed=0, scan_layers=scan_layers)
    lora = LoraConfig(rank=4, alpha=12.0, targets=("wq", "wv", "w2"))
    lora_model, lora_params = add_lora(model, params, lora)
    lora_params = with_random_b(lora_params)
    tokens = random_tokens(config)
    adapted = np.asarray(lora_model.apply({"params": lora_params}, tokens))

    # W + (alpha / r) B @ A in float64, written into a plain model's canonical tensors.
    adapter = adapter_of(lora_model, lora_params)
    _, fetch = tensor_specs(params, config)
    merged = {}
    for name in canonical_shapes(config):
        w = fetch(name).astype(np.float64)
        a = adapter.tensors.get(name.replace(".weight", ".lora_A.weight"))
        if a is not None:
            b = adapter.tensors[name.replace(".weight", ".lora_B.weight")]
            w = w + 3.0 * (b.astype(np.float64) @ a.astype(np.float64))
        merged[name] = w.astype(np.float32)
    plain = np.asarray(model.apply({"params": params_from_tensors(
        merged.__getitem__, config, scan_layers=scan_layers)}, tokens))
    base = np.asarray(model.apply({"params": params}, tokens))
    # float32: the two compute the same function in a different order (x W + s (x A) B against
    # x (W + s B A)); rounding of O(1) logits is ~1e-6, while the adapter moved them by ~1e-1.
    assert np.abs(adapted - base).max() > 1e-2
    np.testing.assert_allclose(adapted, plain, rtol=0, atol=2e-5)
    merged_model, merged_params = merge_lora(lora_model, lora_params)
    assert merged_model.projections.lora is None and not split(merged_params)[1]
    np.testing.assert_allclose(np.asarray(merged_model.apply({"params": merged_params}, tokens)),
                               plain, rtol=0, atol=2e-5)


def test_dropout_only_with_a_dropout_rng():
    config = small_config()
    model, params = jax_llama.init(config, seed=0)
    lora_model, lora_params = add_lora(model, params, LoraConfig(rank=4, dropout=0.5))
    lora_params = with_random_b(lora_params)
    tokens = random_tokens(config)
    plain = lora_model.apply({"params": lora_params}, tokens)
    again = lora_model.apply({"params": lora_params}, tokens)
    dropped = lora_model.apply({"params": lora_params}, tokens, rngs={"dropout": jax.random.key(0)})
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(again))
    assert float(jnp.abs(dropped - plain).max()) > 1e-3


def _steps(model, params, tc, batches, labels=trainable):
    optimizer = make_optimizer(tc, labels)
    step = jax.jit(make_train_step(lm_loss(model), optimizer, lr_schedule(tc), tc.grad_accum,
                                   trainable=labels))
    state = init_state(params, optimizer)
    metrics = []
    for batch in batches:
        state, m = step(state, batch)
        metrics.append(jax.device_get(m))
    return state, metrics


def _batch(config, rows=4, seq=12, seed=0):
    tokens = random_tokens(config, batch=rows, seq_len=seq, seed=seed)
    return {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1),
            "mask": np.ones((rows, seq), np.float32)}


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_training_moves_only_the_adapters_and_keeps_no_state_for_the_base(base_dtype):
    config = small_config()
    model, params = jax_llama.init(config, seed=0, param_dtype=base_dtype)
    model = model.clone(dtype=jnp.dtype(base_dtype))
    lora_model, lora_params = add_lora(model, params, LORA)
    tc = TrainConfig(steps=10, lr=1e-2, warmup_steps=0)
    state, metrics = _steps(lora_model, lora_params, tc, [_batch(config, seed=s) for s in range(3)])
    weights_before, adapters_before = split(lora_params)
    weights_after, adapters_after = split(state.params)
    for a, b in zip(jax.tree.leaves(weights_before), jax.tree.leaves(weights_after)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = [float(jnp.abs(a - b).max()) for a, b in
             zip(jax.tree.leaves(adapters_before), jax.tree.leaves(adapters_after))]
    assert min(moved) > 1e-4  # every adapter tensor trained (B from zero, A once B is not zero)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adapters_after))
    assert {x.dtype for x in jax.tree.leaves(weights_after)} == {jnp.dtype(base_dtype)}
    # AdamW's mu and nu for the adapters only: 2 x the adapter parameters, plus scalar counters.
    n_adapter = count(split(lora_params)[1])
    state_sizes = [x.size for x in jax.tree.leaves(state.opt_state)]
    assert sum(s for s in state_sizes if s > 1) == 2 * n_adapter
    assert n_adapter == count(lora_params, trainable(lora_params))
    assert all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in metrics)


def test_grad_norm_counts_the_adapters_only():
    config = small_config()
    model, params = jax_llama.init(config, seed=0)
    lora_model, lora_params = add_lora(model, params, LORA)
    lora_params = with_random_b(lora_params)
    batch = _batch(config)
    grads = jax.grad(lambda p: lm_loss(lora_model)(p, batch, None))(lora_params)
    adapter_norm = float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(split(grads)[1]))))
    _, (m,) = _steps(lora_model, lora_params, TrainConfig(steps=10), [batch])
    # the same float32 reduction in another order
    assert m["grad_norm"] == pytest.approx(adapter_norm, rel=1e-5)


def test_gradient_accumulation_and_scan_remat_give_the_same_adapters():
    config = small_config()
    model, params = jax_llama.init(config, seed=0)
    lora_model, lora_params = add_lora(model, params, LORA)
    batch = _batch(config, rows=8)
    halves = [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}]
    # eps = 1 keeps AdamW's update ~ lr * g, smooth in the gradient (as in test_train)
    kw = dict(lr=1e-1, eps=1.0, warmup_steps=0)
    big, _ = _steps(lora_model, lora_params, TrainConfig(steps=10, **kw), [batch])
    accumulated, _ = _steps(lora_model, lora_params, TrainConfig(steps=20, grad_accum=2, **kw), halves)

    scanned_model = lora_model.clone(scan_layers=True, remat=True)
    # the same adapters and weights, stacked on a layer axis
    _, fetch = tensor_specs(params, config)
    scanned = dict(params_from_tensors(fetch, config, scan_layers=True))
    stacked_adapter = params_from_tensors(adapter_of(lora_model, lora_params).tensors.__getitem__,
                                          config, scan_layers=True,
                                          shapes=adapter_shapes(config, LORA))
    scan_state, _ = _steps(scanned_model, combine(scanned, stacked_adapter), TrainConfig(steps=10, **kw),
                           [batch])
    ref = adapter_of(lora_model, big.params).tensors
    moved = max(float(np.abs(ref[n] - t).max())
                for n, t in adapter_of(lora_model, lora_params).tensors.items())
    assert moved > 1e-3
    for other in (adapter_of(lora_model, accumulated.params), adapter_of(scanned_model, scan_state.params)):
        for name, tensor in other.tensors.items():
            # float32 sums in another order: ~1e-8 against moves of ~1e-2
            np.testing.assert_allclose(tensor, ref[name], rtol=0, atol=1e-6)


def test_save_refuses_unmerged_adapters_and_the_adapter_round_trips(tmp_path):
    config = small_config()
    model, params = jax_llama.init(config, seed=0)
    lora_model, lora_params = add_lora(model, params, LORA)
    lora_params = with_random_b(lora_params)
    with pytest.raises(BridgeError, match="params: params hold LoRA adapters"):
        jax_llama.save(tmp_path / "ckpt", config, lora_params)
    assert not (tmp_path / "ckpt").exists()
    save_adapter(tmp_path / "adapter", lora_model, lora_params)
    config_json = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config_json["peft_type"] == "LORA" and config_json["r"] == 4
    back = read_peft(tmp_path / "adapter", config)
    mine = adapter_of(lora_model, lora_params)
    for name, tensor in mine.tensors.items():
        np.testing.assert_array_equal(back.tensors[name], tensor)
    again_model, again = add_lora(model, params, back.lora, adapter=back)
    tokens = random_tokens(config)
    np.testing.assert_array_equal(np.asarray(again_model.apply({"params": again}, tokens)),
                                  np.asarray(lora_model.apply({"params": lora_params}, tokens)))
    # jax_llama.load with the adapter merges it as the weights are read
    jax_llama.save(tmp_path / "base", config, params)
    merged_model, merged = jax_llama.load(tmp_path / "base", adapter=tmp_path / "adapter")
    np.testing.assert_allclose(np.asarray(merged_model.apply({"params": merged}, tokens)),
                               np.asarray(lora_model.apply({"params": lora_params}, tokens)),
                               rtol=0, atol=2e-5)  # the merge's float32 rounding, as above


def test_adapter_for_another_model_is_refused(tmp_path):
    config = small_config()
    model, params = jax_llama.init(config, seed=0)
    save_adapter(tmp_path / "adapter", *add_lora(model, params, LORA))
    with pytest.raises(BridgeError, match="layers.2.attention.wq.lora_A.weight' is missing"):
        read_peft(tmp_path / "adapter", small_config(n_layers=3))
    with pytest.raises(BridgeError, match="is for layer 1; the base model has 1 layers"):
        read_peft(tmp_path / "adapter", small_config(n_layers=1))
    with pytest.raises(BridgeError, match=r"lora_B.weight' has shape \(48, 4\); the base model and rank 4 imply \(24, 4\)"):
        read_peft(tmp_path / "adapter", small_config(dim=24, n_heads=3, n_kv_heads=1))
    lora_model, lora_params = add_lora(model, params, LORA)
    with pytest.raises(BridgeError, match="model: already has LoRA adapters"):
        add_lora(lora_model, lora_params, LORA)


@pytest.mark.parametrize("kw, field", [(dict(rank=0), "lora_rank"), (dict(alpha=-1.0), "lora_alpha"),
                                       (dict(dropout=1.0), "lora_dropout"),
                                       (dict(targets=("wq", "q_proj")), "lora_targets"),
                                       (dict(targets=()), "lora_targets")])
def test_bad_lora_settings_name_the_field(kw, field):
    with pytest.raises(BridgeError) as e:
        LoraConfig(**kw)
    assert e.value.field == field


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "llama_twins.cli.main", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("flags, message", [
    (["--lora-rank", "0"], "--lora-rank: must be a positive integer (got 0)"),
    (["--lora-rank", "4", "--lora-targets", "wq,q_proj"], "--lora-targets: unknown target 'q_proj'"),
    (["--lora-alpha", "8"], "--lora-alpha: needs --lora-rank"),
    (["--lora-train-embeddings"], "--lora-train-embeddings: needs --lora-rank"),
])
def test_cli_bad_lora_flags_exit_2_with_one_line(tmp_path, flags, message):
    result = run_cli("train", "--steps", 2, "--out", tmp_path / "run", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_cli_generate_with_a_mismatched_adapter_exits_2(tmp_path):
    config = small_config(vocab_size=259)
    save_random_checkpoint(tmp_path / "base", config, tokenizer=True)
    other = small_config(vocab_size=259, n_layers=3)
    model, params = jax_llama.init(other, seed=0)
    save_adapter(tmp_path / "adapter", *add_lora(model, params, LORA))
    result = run_cli("generate", tmp_path / "base", "--prompt", "hi", "--max-new-tokens", 2,
                     "--adapter", tmp_path / "adapter")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "adapter_model.safetensors: tensor 'layers.2." in lines[0]


def test_peft_and_the_jax_model_agree_on_adapters_both_ways(tmp_path):
    """Our adapter under peft.PeftModel gives our logits; a peft-made adapter under our loader
    gives peft's logits (the unmerged JAX model, not a merge)."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    from bridge.convert import convert

    config = small_config()
    model, params = jax_llama.init(config, seed=0)
    jax_llama.save(tmp_path / "base", config, params)
    convert(tmp_path / "base", tmp_path / "hf", to="hf", progress=False)
    tokens = random_tokens(config)

    def peft_logits(peft_model):
        with torch.inference_mode():
            return peft_model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()

    ours_model, ours = add_lora(model, params, LoraConfig(rank=4, alpha=8.0, targets=("wq", "wk", "w2")))
    ours = with_random_b(ours)
    save_adapter(tmp_path / "ours", ours_model, ours)
    theirs = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "hf"),
                                       tmp_path / "ours").eval()
    expected = np.asarray(ours_model.apply({"params": ours}, tokens))
    # float32 in two frameworks: ~1e-6 apart on O(1) logits; the adapter moved them by ~1e-1
    assert np.abs(expected - np.asarray(model.apply({"params": params}, tokens))).max() > 1e-2
    np.testing.assert_allclose(peft_logits(theirs), expected, rtol=0, atol=1e-5)

    hf_model = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    peft_model = get_peft_model(hf_model, PeftLoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                            "up_proj", "down_proj"], task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.eval().save_pretrained(tmp_path / "theirs")
    adapter = read_peft(tmp_path / "theirs", config)
    assert adapter.lora.rank == 4 and adapter.lora.scale == 4.0
    jax_model, jax_params = add_lora(model, params, adapter.lora, adapter=adapter)
    np.testing.assert_allclose(np.asarray(jax_model.apply({"params": jax_params}, tokens)),
                               peft_logits(peft_model), rtol=0, atol=1e-5)


def test_lora_run_interrupted_and_resumed_ends_where_a_straight_run_ends(tmp_path, corpus):
    """`train --init BASE --lora-rank R`: a run stopped after its checkpoint at step 6 and resumed
    writes the same adapter and merged model, bit for bit, as one never stopped; the base in
    the merged model is the init's, in its stored float32."""
    from jax_llama.training.loop import train
    from test_train import spec

    base = train(spec(tmp_path / "base", corpus, steps=5, eval_every=5, checkpoint_every=5))["model"]
    lora = LoraConfig(rank=2, alpha=4.0, dropout=0.1, targets=("wq", "wv", "w2"))

    def lora_spec(name, resume=False):
        s = spec(tmp_path / name, corpus, steps=12, eval_every=6, checkpoint_every=6,
                 grad_accum=2, dtype="bfloat16")
        s.init, s.lora, s.resume, s.sample_tokens = base, lora, resume, 0
        return s

    straight = train(lora_spec("straight"))
    with interrupted_at(8):  # after the checkpoint at step 6
        train(lora_spec("resumed"))
    resumed = train(lora_spec("resumed", resume=True))
    for part in ("adapter/adapter_model.safetensors", "model/model.safetensors"):
        a = (tmp_path / "straight" / "run" / part).read_bytes()
        assert a == (tmp_path / "resumed" / "run" / part).read_bytes(), part
    assert resumed["val_loss"] == straight["val_loss"]
    merged = jax_llama.load(straight["model"])[1]
    assert {x.dtype for x in jax.tree.leaves(merged)} == {jnp.dtype("float32")}
    # the adapter read back and merged again gives the merged model
    again = jax_llama.load(base, adapter=straight["adapter"])[1]
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cli_generate_with_an_adapter_decodes_as_the_torch_twin(tmp_path):
    config = small_config(vocab_size=259)
    save_random_checkpoint(tmp_path / "base", config, tokenizer=True)
    model, params = jax_llama.load(tmp_path / "base")
    lora_model, lora_params = add_lora(model, params, LORA)
    save_adapter(tmp_path / "adapter", lora_model, with_random_b(lora_params, scale=0.3))
    args = ["generate", tmp_path / "base", "--prompt", "hello", "--max-new-tokens", 12]
    plain, adapted = run_cli(*args), run_cli(*args, "--adapter", tmp_path / "adapter")
    assert plain.returncode == 0 and adapted.returncode == 0, adapted.stderr[-2000:]
    assert plain.stdout != adapted.stdout  # the adapter is applied
    # several prompts: a random model may stop at its EOS early on one of them (which token wins a
    # near-tie differs between CPUs), so agreement is asserted on every row and on enough tokens
    (tmp_path / "prompts.txt").write_text("hello\nthe cat sat\nabc\nzzz\n")
    both = run_cli("generate", tmp_path / "base", "--prompt-file", tmp_path / "prompts.txt",
                   "--max-new-tokens", 12, "--adapter", tmp_path / "adapter", "--compare-torch")
    assert both.returncode == 0, both.stdout + both.stderr[-2000:]
    rows = re.findall(r"prompt (\d): JAX and torch agree on all (\d+) greedy tokens", both.stdout)
    assert len(rows) == 4, both.stdout
    assert sum(int(n) for _, n in rows) >= 24, both.stdout


def test_a_bfloat16_base_is_not_copied_to_float32_whole_on_cpu():
    """XLA:CPU runs bfloat16 dots in float32; with scan_layers its loop-invariant code motion
    would convert every stacked frozen weight at once, outside the layer loop. jit_train_step
    compiles without that pass for narrow params on the CPU: the step's temporaries then hold
    no float32 copy of the layers. Compiled only, on shapes."""
    from jax_llama.training.step import compiler_options, jit_train_step
    from jax_llama.model.projections import choose
    from bridge.config import LlamaConfig

    config = LlamaConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=1024,
                         vocab_size=64, max_seq_len=64)
    model = jax_llama.Llama(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                            scan_layers=True, remat=True, projections=choose(lora=LORA))
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"])
    tc = TrainConfig(steps=10, dtype="bfloat16")
    optimizer = make_optimizer(tc, trainable)
    state = jax.eval_shape(lambda p: init_state(p, optimizer), params)
    batch = {k: jax.ShapeDtypeStruct((1, 64), d)
             for k, d in (("inputs", jnp.int32), ("targets", jnp.int32), ("mask", jnp.float32))}
    step = make_train_step(lm_loss(model), optimizer, lr_schedule(tc), trainable=trainable)

    def temporaries(jitted):
        return jitted.lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    assert compiler_options(params) is not None
    assert compiler_options(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)) is None
    hoisted = temporaries(jax.jit(step, donate_argnums=0))
    ours = temporaries(jit_train_step(lm_loss(model), optimizer, tc, state, trainable=trainable))
    layers_f32 = 4 * config.n_layers * (4 * 256 * 256 + 3 * 256 * 1024)  # 16.8 MB
    assert hoisted - ours > 0.8 * layers_f32, (hoisted, ours)
