"""DPO: the loss, rewards and gradients against TRL's DPOTrainer and between the twins; the LoRA
reference; the pairs' formats and their bad input; the command and its demo."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import save_random_checkpoint, small_config

from bridge.errors import BridgeError
from tasks.preference import Pair, encode_pair, encode_pairs, pair_rows, read_pairs
from jax_llama.training import dpo as dpo_lib
from jax_llama.training.spec import DpoSpec

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "rug", "red", "blue", "big", "small", "quickly", "slowly", "and", "then", "it", "was", "here", "there"]
SPECIALS = ["<pad>", "<s>", "</s>"]
LOSS_CASES = [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.1)]


def word_tokenizer():
    """A whitespace word-level Hugging Face tokenizer over WORDS (ids 3..) that opens each text
    with BOS, as LLaMA's do: what TRL tokenizes the pairs with."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + list(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def random_records(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(rng.choice(WORDS, k))
    return [{"prompt": words(int(rng.integers(2, 6))),
             "chosen": " " + words(int(rng.integers(1, 5))),
             "rejected": " " + words(int(rng.integers(1, 6)))} for _ in range(n)]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Native and Hugging Face copies of two random models of the word tokenizer's vocabulary:
    the policy (seed 0) and the reference (seed 1), so that the log-ratios are not zero."""
    pytest.importorskip("transformers")
    from bridge.convert import convert

    root = tmp_path_factory.mktemp("dpo-models")
    config = small_config(vocab_size=len(SPECIALS) + len(WORDS))
    paths = {}
    for name, seed in (("policy", 0), ("reference", 1)):
        save_random_checkpoint(root / name, config, seed=seed)
        convert(root / name, root / f"{name}-hf", to="hf", progress=False)
        paths[name] = root / name
        paths[f"{name}-hf"] = root / f"{name}-hf"
    return config, paths


def jax_side(config, paths, pairs, seq_len, loss, smoothing, beta=0.1):
    """(loss, metrics, the gradient of layer 0's w2 kernel) in JAX for these pairs."""
    import jax_llama

    model, policy = jax_llama.load(paths["policy"])
    _, reference = jax_llama.load(paths["reference"])
    rows = pair_rows(pairs, seq_len, pad_id=0)
    ref = dpo_lib.sequence_logps(model, reference, rows)
    batch = {**rows, "ref_logps": ref}
    spec = DpoSpec(beta=beta, loss=loss, label_smoothing=smoothing)
    (value, metrics), grads = jax.value_and_grad(
        lambda p: dpo_lib.batch_loss(model, p, batch, spec), has_aux=True)(policy)
    w2 = np.asarray(grads["layers_0"]["feed_forward"]["w2"]["kernel"]).T  # (out, in), as torch
    return float(value), {k: float(v) for k, v in metrics.items()}, w2, rows


@pytest.mark.parametrize("loss,smoothing", LOSS_CASES)
def test_loss_rewards_and_gradients_equal_trl(two_models, tmp_path, loss, smoothing):
    """TRL's DPOTrainer tokenizes and collates the pairs and computes its loss on the Hugging
    Face copies; jax_llama.training.dpo on the same ids. Tolerance: float32 on both sides, sums of a few
    dozen log-probs: rtol 1e-4 (rewards: see below; the gradient: 1e-4 of its largest
    entry)."""
    trl = pytest.importorskip("trl")
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM

    config, paths = two_models
    policy = LlamaForCausalLM.from_pretrained(paths["policy-hf"], torch_dtype=torch.float32)
    reference = LlamaForCausalLM.from_pretrained(paths["reference-hf"], torch_dtype=torch.float32)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.1, loss_type=[loss],
                         label_smoothing=smoothing, report_to=[], use_cpu=True,
                         per_device_train_batch_size=6, dataset_num_proc=None)
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args,
                             train_dataset=Dataset.from_list(random_records(6, seed=3)),
                             processing_class=word_tokenizer())
    examples = [trainer.train_dataset[i] for i in range(6)]
    batch = trainer.data_collator(examples)
    trainer.model.train()  # TRL files its metrics under "train" in train mode (no dropout here)
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    trl_w2 = trainer.model.model.layers[0].mlp.down_proj.weight.grad.numpy()

    pairs = [Pair(np.asarray(e["prompt_ids"], np.int32), np.asarray(e["chosen_ids"], np.int32),
                  np.asarray(e["rejected_ids"], np.int32), f"trl:{i}")
             for i, e in enumerate(examples)]
    L = batch["input_ids"].shape[1]
    value, metrics, w2, rows = jax_side(config, paths, pairs, L - 1, loss, smoothing)
    # the same rows: TRL's input ids (right-padded) and completion mask, shifted
    np.testing.assert_array_equal(rows["inputs"], batch["input_ids"][:, :-1].numpy())
    np.testing.assert_array_equal(rows["mask"], batch["completion_mask"][:, 1:].numpy())
    np.testing.assert_allclose(value, trl_loss.item(), rtol=1e-4, atol=1e-5)
    scale = abs(trl_metrics["logps/chosen"]) + abs(trl_metrics["logps/rejected"])
    for name in dpo_lib.METRICS:
        # A reward is beta times a difference of two such sums, so its tolerance is absolute:
        # beta * 1e-4 of the log-probs' size (TRL runs its reference under no_grad, where torch
        # may pick another CPU attention kernel: the reference's sums differ by ~1e-5 relative).
        atol = 1e-5 if name.startswith("logps") else 0.1 * 1e-4 * scale
        np.testing.assert_allclose(metrics[name], trl_metrics[name], rtol=1e-4, atol=atol,
                                   err_msg=name)
    assert np.abs(trl_w2).max() > 0
    np.testing.assert_allclose(w2, trl_w2, rtol=0, atol=1e-4 * np.abs(trl_w2).max())


def test_a_different_beta_does_not_match_trl(two_models, tmp_path):
    """The negative case: the same batch with beta 0.2 against TRL's 0.1 differs beyond the
    tolerance the comparison uses."""
    pytest.importorskip("trl")
    config, paths = two_models
    pairs = [encode_pair(r, f"r{i}", _our_word_tokenizer(), None)
             for i, r in enumerate(random_records(6, seed=3))]
    a = jax_side(config, paths, pairs, 16, "sigmoid", 0.0, beta=0.1)[0]
    b = jax_side(config, paths, pairs, 16, "sigmoid", 0.0, beta=0.2)[0]
    assert abs(a - b) > 1e-4 * abs(a) + 1e-5


def _our_word_tokenizer():
    """The word tokenizer, as the bridge reads it (its tokenizer.json)."""
    import tempfile

    from bridge.tokenizer import load_tokenizer

    directory = tempfile.mkdtemp()
    word_tokenizer().save_pretrained(directory)
    return load_tokenizer(directory)


def test_standard_pairs_tokenize_as_trl_does(two_models, tmp_path):
    """Our encoding of plain-text pairs gives TRL's prompt_ids / chosen_ids / rejected_ids."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import LlamaForCausalLM

    records = random_records(5, seed=4)
    hf = LlamaForCausalLM.from_pretrained(two_models[1]["policy-hf"])
    trainer = trl.DPOTrainer(model=hf, args=trl.DPOConfig(output_dir=str(tmp_path), report_to=[],
                                                          use_cpu=True),
                             train_dataset=Dataset.from_list(records),
                             processing_class=word_tokenizer())
    tokenizer = _our_word_tokenizer()
    for i, record in enumerate(records):
        ours, theirs = encode_pair(record, f"r{i}", tokenizer, None), trainer.train_dataset[i]
        assert ours.prompt.tolist() == theirs["prompt_ids"]
        assert ours.chosen.tolist() == theirs["chosen_ids"]
        assert ours.rejected.tolist() == theirs["rejected_ids"]


@pytest.mark.parametrize("loss,smoothing", LOSS_CASES)
def test_the_twins_compute_the_same_loss_and_gradients(two_models, loss, smoothing):
    """torch_llama.dpo on the torch twin against jax_llama.training.dpo, same checkpoint, same rows.
    Tolerance: float32 both, rtol 1e-5 / atol 1e-6; the gradient 1e-4 of its largest entry."""
    import torch

    import torch_llama
    from torch_llama import dpo as torch_dpo

    config, paths = two_models
    tokenizer = _our_word_tokenizer()
    pairs = [encode_pair(r, f"r{i}", tokenizer, None)
             for i, r in enumerate(random_records(5, seed=5))]
    value, metrics, w2, rows = jax_side(config, paths, pairs, 16, loss, smoothing)
    policy, reference = (torch_llama.load(paths[n], device="cpu") for n in ("policy", "reference"))
    with torch.no_grad():
        ref = torch_dpo.sequence_logps(reference, rows)
    logps = torch_dpo.sequence_logps(policy, rows)
    n, B = torch.as_tensor(rows["n_tokens"]), len(pairs)
    t_value, t_metrics = torch_dpo.dpo_loss(logps[:B], logps[B:], ref[:B], ref[B:], n[:B], n[B:],
                                            beta=0.1, loss=loss, label_smoothing=smoothing)
    t_value.backward()
    np.testing.assert_allclose(value, float(t_value), rtol=1e-5, atol=1e-6)
    for name in dpo_lib.METRICS:
        np.testing.assert_allclose(metrics[name], float(t_metrics[name]), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    t_w2 = dict(policy.named_parameters())["layers.0.feed_forward.w2.weight"].grad.numpy()
    np.testing.assert_allclose(w2, t_w2, rtol=0, atol=1e-4 * np.abs(t_w2).max())


def test_with_lora_the_reference_is_the_base_exactly():
    """The LoRA reference (adapters left out of the policy's own params) gives the base model's
    log-probs bit for bit, even with adapters far from zero; the policy with them does not."""
    import jax_llama
    from bridge.lora import LoraConfig

    config = small_config()
    base_model, base = jax_llama.init(config, seed=0)
    model, params = jax_llama.add_lora(base_model, base, LoraConfig(rank=4), seed=0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.5 if "lora_B" in str(path) else x, params)
    rng = np.random.default_rng(0)
    pairs = [Pair(rng.integers(3, 97, 4).astype(np.int32), rng.integers(3, 97, 3).astype(np.int32),
                  rng.integers(3, 97, 5).astype(np.int32), f"p{i}") for i in range(3)]
    rows = pair_rows(pairs, 12, pad_id=0)
    reference = dpo_lib.Reference(model)
    got = np.asarray(reference.logps(params, rows))
    want = np.asarray(jax.jit(lambda p: dpo_lib.sequence_logps(base_model, p, rows))(base))
    np.testing.assert_array_equal(got, want)
    adapted = np.asarray(dpo_lib.sequence_logps(model, params, rows))
    assert np.abs(adapted - want).max() > 1e-3


def test_rows_put_chosen_first_and_mask_only_the_completions():
    pairs = [Pair(np.array([5, 6], np.int32), np.array([7], np.int32), np.array([8, 9], np.int32),
                  "a"),
             Pair(np.array([5], np.int32), np.array([10, 11], np.int32), np.array([12], np.int32),
                  "b")]
    rows = pair_rows(pairs, 4, pad_id=0)
    full = np.concatenate([rows["inputs"][:, :1], rows["targets"]], axis=1)
    assert full.tolist() == [[5, 6, 7, 0, 0], [5, 10, 11, 0, 0], [5, 6, 8, 9, 0], [5, 12, 0, 0, 0]]
    assert rows["mask"].tolist() == [[0, 1, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 0]]
    assert rows["n_tokens"].tolist() == [1, 2, 2, 1]


def test_the_losses_at_zero_log_ratio():
    """At the start (policy = reference): sigmoid log 2, hinge 1, ipo 1 / (2 beta)^2; rewards 0
    and no pair counted as won (TRL's strict >)."""
    zeros, ones = jnp.zeros(3), jnp.ones(3)
    for loss, want in (("sigmoid", np.log(2)), ("hinge", 1.0), ("ipo", 25.0), ("robust", np.log(2))):
        value, metrics = dpo_lib.dpo_loss(zeros, zeros, zeros, zeros, ones, ones, beta=0.1,
                                          loss=loss)
        np.testing.assert_allclose(float(value), want, rtol=1e-6)
        assert float(metrics["rewards/accuracies"]) == 0.0


# -- pairs from files: formats and bad input --------------------------------------------------------

def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_both_formats_are_read(tmp_path):
    conv = {"prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "go away"}]}
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "a", "chosen": "b",
                                                          "rejected": "c"}), "",
                                              json.dumps(conv)])
    pairs = read_pairs(path)
    assert [w for w, _ in pairs] == [f"{path}:1", f"{path}:3"]
    assert pairs[1][1]["chosen"][0]["content"] == "hello"


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "a", "chosen": "b"', "p.jsonl:2: malformed JSON"),
    ('{"prompt": "a", "chosen": "b"}', "p.jsonl:2: missing 'rejected'"),
    ('{"prompt": "a", "chosen": "b", "rejected": 3}', "p.jsonl:2: prompt, chosen and rejected "
                                                       "must all be strings or all message lists"),
    ('{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}],'
     ' "rejected": [{"role": "assistant", "content": "c"}]}', "p.jsonl:2: chosen: ends with a "
                                                             "user turn"),
    ('[1, 2]', "p.jsonl:2: expected a JSON object"),
])
def test_a_bad_line_is_refused_naming_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt": "a", "chosen": "b", "rejected": "c"}',
                                              line])
    with pytest.raises(BridgeError, match=message.replace("(", r"\(")):
        read_pairs(path)


def test_identical_pairs_are_skipped_and_counted_and_a_long_prompt_refused(capsys):
    tokenizer = _our_word_tokenizer()
    records = [("f:1", {"prompt": "the cat", "chosen": " sat", "rejected": " ran"}),
               ("f:2", {"prompt": "the dog", "chosen": " sat", "rejected": " sat"})]
    pairs, counts = encode_pairs(records, tokenizer, None, seq_len=8)
    assert [p.where for p in pairs] == ["f:1"] and counts["identical"] == 1
    assert "skipped 1 pair(s) whose chosen and rejected are the same tokens (first: f:2)" in \
        capsys.readouterr().err
    long = [("f:3", {"prompt": " ".join(["the"] * 12), "chosen": " sat", "rejected": " ran"})]
    with pytest.raises(BridgeError, match="f:3: the prompt's 13 tokens leave no room for the "
                                          "completion within 9"):
        encode_pairs(long, tokenizer, None, seq_len=8)


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "llama_twins.cli.main", "dpo", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "a", "chosen": "b"}\n', "missing 'rejected'"),
    ('{"prompt": "a", "chosen": "b", "rejected": "c"\n', "malformed JSON"),
])
def test_the_command_refuses_bad_pairs_in_one_line_and_writes_nothing(tmp_path, content, message):
    data = tmp_path / "pairs.jsonl"
    data.write_text(content)
    out = tmp_path / "run"
    result = run_cli("--data", str(data), "--out", str(out), "--steps", "2")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "pairs.jsonl:1" in lines[0], result.stderr
    assert not out.exists()


@pytest.mark.slow  # 40 s; the command end to end is in the default suite through the run tests
def test_the_demo_learns_the_preference(tmp_path):
    """A short run of the demo task from scratch: the model's own preference for the right
    answer on held-out pairs rises well above a coin flip (the full demo, 600 steps, is in the
    README)."""
    out = tmp_path / "run"
    result = run_cli("--out", str(out), "--steps", "80", "--demo-pairs", "800", "--eval-every", "40")
    assert result.returncode == 0, result.stderr[-2000:]
    scores = json.loads((out / "preference.json").read_text())
    before = scores["before"]["preference/accuracy"]
    after = scores["after"]["preference/accuracy"]
    assert 0.3 <= before <= 0.7
    assert after >= before + 0.15, (before, after)
    assert scores["after"]["rewards/accuracies"] > 0.6
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(k in records[0] for k in ("rewards/margins", "logps/chosen", "loss"))
    assert "eval/rewards/accuracies" in records[-1]
    assert (out / "model" / "chat_template.jinja").is_file()


# -- the run: resume, the precomputed reference ------------------------------------------------------

PAIRS = [{"prompt": "Name a colour.", "chosen": " green", "rejected": " seven"},
         {"prompt": "Say hello.", "chosen": " hello", "rejected": " goodbye"},
         {"prompt": "What is two plus two?", "chosen": " four", "rejected": " five"},
         {"prompt": "Pick an animal.", "chosen": " a cat", "rejected": " a chair"}] * 6


@pytest.fixture(scope="module")
def dpo_base(tmp_path_factory):
    """A small base trained for two steps with a BPE of the pairs' text, and the pairs' file."""
    from llama_twins.cli import main as jax_cli

    root = tmp_path_factory.mktemp("dpo")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    text = root / "text.txt"
    text.write_text("\n".join(p["prompt"] + p["chosen"] + p["rejected"] for p in PAIRS) + "\n")
    assert jax_cli.main(["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                         "--data", str(text), "--vocab-size", "300", "--sample-tokens", "0",
                         "--out", str(root / "base")]) == 0
    return root


def dpo_args(root, out, *extra):
    return ["dpo", "--data", str(root / "pairs.jsonl"), "--init", str(root / "base" / "model"),
            "--steps", "6", "--batch-size", "2", "--seq-len", "24", "--lr", "1e-3",
            "--checkpoint-every", "3", "--eval-every", "3", "--out", str(out), *extra]


def losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra", [[], ["--lora-rank", "2"]], ids=["full", "lora"])
def test_interrupted_and_resumed_ends_where_a_straight_run_ends(dpo_base, tmp_path, extra):
    """The full run's reference (a copy of the starting weights) is rebuilt from --init on
    resume, the LoRA run's is its own frozen base: either way the resumed run ends bitwise
    where the straight one does."""
    from conftest import interrupted_at

    from llama_twins.cli import main as jax_cli

    straight, again = tmp_path / "straight", tmp_path / "again"
    assert jax_cli.main(dpo_args(dpo_base, straight, *extra)) == 0
    with interrupted_at(4):  # after the checkpoint at step 3
        jax_cli.main(dpo_args(dpo_base, again, *extra))
    assert jax_cli.main(["dpo", "--out", str(again), "--resume"]) == 0
    assert (straight / "model/model.safetensors").read_bytes() == \
        (again / "model/model.safetensors").read_bytes()
    assert losses(again)[-3:] == losses(straight)[-3:]
    for name in ("run.json", "preference.json", "metrics.jsonl", "model/config.json"):
        assert (straight / name).is_file(), name


def test_a_precomputed_reference_trains_as_the_per_batch_one(dpo_base, tmp_path):
    """--precompute-ref (every pair's reference log-probs before training, the copy dropped)
    gives the per-batch run's losses. Tolerance: rtol 1e-5 (the reference rows are batched
    differently, and XLA may sum a row differently in another batch)."""
    from llama_twins.cli import main as jax_cli

    a, b = tmp_path / "per-batch", tmp_path / "precomputed"
    assert jax_cli.main(dpo_args(dpo_base, a)) == 0
    assert jax_cli.main(dpo_args(dpo_base, b, "--precompute-ref")) == 0
    np.testing.assert_allclose(losses(b), losses(a), rtol=1e-5, atol=1e-7)
    assert losses(a)[0] == pytest.approx(np.log(2), rel=1e-5)  # policy = reference at step 1


def test_on_a_mesh_of_two_devices_it_trains_as_on_one(dpo_base, tmp_path):
    """The pairs' rows split over data=2 (two host devices, the run in its own process): the same
    losses as on one device. Tolerance: rtol 1e-5 (the loss is summed in another order)."""
    from conftest import with_host_devices
    from llama_twins.cli import main as jax_cli

    one, two = tmp_path / "one", tmp_path / "two"
    assert jax_cli.main(dpo_args(dpo_base, one)) == 0
    result = subprocess.run([sys.executable, "-m", "llama_twins.cli.main",
                             *dpo_args(dpo_base, two, "--mesh", "data=2")],
                            capture_output=True, text=True, env=with_host_devices(2), timeout=600,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5, atol=1e-7)
