"""JAX generation: cache vs full forward, padded batches, one compilation per bucket, sampling,
greedy agreement with the torch twin and with transformers, and the CLIs."""

import subprocess
import warnings

import jax
import numpy as np
import pytest
import torch

import jax_llama
import torch_llama
from bridge.chat import find_template
from tasks.prompts import encode_prompts, stop_ids
from bridge.errors import BridgeError
from bridge.sampling import Sampler
from bridge.tokenizer import load_tokenizer
from conftest import (ATTENTION_KINDS, SHARED, cached_logits, random_tokens, save_random_checkpoint,
                      small_config)
from llama_twins.cli import main as jax_cli
from jax_llama.inference.generate import compilations, first_max, generate, top_p_mask

LLAMA3 = SHARED / "tokenizers" / "llama3" / "tokenizer.model"


@pytest.fixture(scope="module")
def tiny():
    config = small_config(vocab_size=259, max_seq_len=64)
    model, params = jax_llama.init(config, seed=1)
    return config, model, params


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("kind", ["gqa", "mqa"])
def test_cached_logits_equal_the_full_forward_step_by_step(scan, kind):
    config = small_config(n_kv_heads=ATTENTION_KINDS[kind])
    model, params = jax_llama.init(config, seed=2, scan_layers=scan)
    tokens = random_tokens(config, batch=2, seq_len=14)
    mask = np.ones_like(tokens)
    mask[1, :3] = 0  # row 1 left-padded
    full = np.asarray(model.apply({"params": params}, tokens, attention_mask=mask))
    got = cached_logits(model, params, tokens, mask, prefill=6, cache_len=32)
    # Same float32 math over the same keys, in another order (a masked slot contributes an exact
    # zero): differences are rounding, ~1e-7 on logits of O(1).
    np.testing.assert_allclose(got[mask.astype(bool)], full[mask.astype(bool)], rtol=0, atol=1e-5)


def test_left_padded_batch_gives_each_prompt_alone(tiny):
    _, model, params = tiny
    prompts = [[5, 6, 7], list(range(20, 31)), [100]]
    batch = generate(model, params, prompts, 12)
    for i, p in enumerate(prompts):
        alone = generate(model, params, [p], 12)
        assert batch.tokens[i] == alone.tokens[0]
        np.testing.assert_allclose(batch.logprobs[i], alone.logprobs[0], rtol=0, atol=1e-5)


def test_greedy_equals_argmax_of_the_full_forward_with_logprobs(tiny):
    """Each generated token is the argmax of the full forward (no cache) over everything before
    it, and its logprob that forward's. One forward of the whole sequence gives them all: the
    model is causal, so position t's logits are those of the first t + 1 tokens alone."""
    _, model, params = tiny
    prompt, out = [1, 2, 3, 4], generate(model, params, [[1, 2, 3, 4]], 10)
    seq = prompt + out.tokens[0]
    logits = np.asarray(model.apply({"params": params}, np.array([seq])))[0]
    for i, (token, logprob) in enumerate(zip(out.tokens[0], out.logprobs[0])):
        at = logits[len(prompt) - 1 + i]  # the logits that chose token i
        assert token == int(at.argmax())
        assert logprob == pytest.approx(float(jax.nn.log_softmax(at)[token]), abs=1e-5)


def test_first_max_is_argmax():
    """Greedy's two-pass first maximum picks what jnp.argmax picks: the first of tied maxima, the
    first NaN where there is one, the first of all -inf; a last-of-ties pick fails here."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((6, 1000)).astype(np.float32)
    rows[1, [3, 700]] = 50.0                      # tied maxima
    rows[2, [10, 20]] = np.nan                    # NaN wins, the first one
    rows[3] = -np.inf
    rows[4, [5, 9]] = np.inf
    rows[5] = np.round(rows[5])                   # many ties at the top value
    want = np.asarray(jax.numpy.argmax(rows, axis=-1))
    np.testing.assert_array_equal(np.asarray(jax.jit(first_max)(rows)), want)
    assert want[1] == 3 and want[2] == 10 and want[3] == 0 and want[4] == 5
    last_of_ties = rows.shape[1] - 1 - np.argmax(rows[1, ::-1])
    assert last_of_ties != want[1]


def test_one_compilation_for_prompts_within_a_bucket():
    # A model of its own (max_seq_len no other test uses): jit's cache is keyed by the model, and
    # another test in this process may already have compiled `tiny`'s programs for these shapes.
    model, params = jax_llama.init(small_config(vocab_size=259, max_seq_len=72), seed=1)
    before = compilations()  # jax.jit's own cache of the prefill program
    for length in (3, 9, 16):  # all in the 16-token prompt bucket
        generate(model, params, [list(range(1, length + 1))] * 2, 8)
    assert compilations() - before == 1
    generate(model, params, [list(range(1, 20))] * 2, 8)  # the 32-token bucket: one more
    assert compilations() - before == 2
    streamed = []  # streaming runs the same programs: no new compilation
    out = generate(model, params, [list(range(1, 20))] * 2, 8,
                   on_token=lambda row, token: streamed.append((row, token)))
    assert compilations() - before == 2
    assert [t for r, t in streamed if r == 0] == out.tokens[0]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 9])
def test_streaming_reports_each_rows_tokens_once_up_to_its_stop(tiny, max_new_tokens):
    """The streaming loop reads token k while the call for token k + 1 runs: every row's tokens
    still arrive once each, in order, up to and including its stop token, and none after."""
    _, model, params = tiny
    prompts = [[1, 2, 3], [7, 8], [5]]
    free = generate(model, params, prompts, 9).tokens
    # row 0 stops at its first token that is new after its first one; the others where they meet it
    k = next(i for i, t in enumerate(free[0]) if i and t not in free[0][:i])
    stop = free[0][k]
    out = generate(model, params, prompts, max_new_tokens, stop_ids=[stop])
    streamed = []
    again = generate(model, params, prompts, max_new_tokens, stop_ids=[stop],
                     on_token=lambda row, token: streamed.append((row, token)))
    assert again.tokens == out.tokens
    for row, tokens in enumerate(out.tokens):
        assert [t for r, t in streamed if r == row] == tokens
    assert len(out.tokens[0]) == min(k + 1, max_new_tokens)


def test_sampling_top_k_1_is_greedy_and_seeds_reproduce(tiny):
    _, model, params = tiny
    prompts = [[1, 2, 3], [7, 8]]
    greedy = generate(model, params, prompts, 10).tokens
    assert generate(model, params, prompts, 10, Sampler(temperature=1.0, top_k=1)).tokens == greedy
    hot = Sampler(temperature=1.5)
    a = generate(model, params, prompts, 10, hot, seed=3).tokens
    assert generate(model, params, prompts, 10, hot, seed=3).tokens == a
    assert generate(model, params, prompts, 10, hot, seed=4).tokens != a


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([[0.15, 0.5, 0.05, 0.3]], np.float32)  # shuffled 0.5, 0.3, 0.15, 0.05
    kept = lambda p: set(np.flatnonzero(np.asarray(top_p_mask(probs, p))[0]))  # noqa: E731
    assert kept(0.4) == {1}
    assert kept(0.8) == {1, 3}        # 0.5 + 0.3 reaches 0.8 exactly: no third token
    assert kept(0.81) == {1, 3, 0}
    assert kept(1.0) == {0, 1, 2, 3}


def test_stop_tokens_end_each_row(tiny):
    _, model, params = tiny
    prompts = [[1, 2, 3], [7, 8]]
    free = generate(model, params, prompts, 12).tokens
    stop = free[0][4]
    out = generate(model, params, prompts, 12, stop_ids=[stop])
    assert out.tokens[0] == free[0][:free[0].index(stop) + 1]
    assert out.tokens[1] == (free[1][:free[1].index(stop) + 1] if stop in free[1] else free[1])


def test_bad_generation_input(tiny):
    config, model, params = tiny
    for kw, message in [(dict(temperature=-1), "temperature: must be >= 0"),
                        (dict(top_p=0.0), r"top_p: must be in \(0, 1\]"),
                        (dict(top_p=1.5), r"top_p: must be in \(0, 1\]"),
                        (dict(top_k=-1), "top_k: must be an integer >= 0")]:
        with pytest.raises(BridgeError, match=message):
            Sampler(**kw)
    with pytest.raises(BridgeError, match=r"prompts\[1\]: empty prompt"):
        generate(model, params, [[1], []], 4)
    with pytest.raises(BridgeError, match=r"prompts\[0\]: 64 tokens leave no room in max_seq_len 64"):
        generate(model, params, [[1] * 64], 4)
    with pytest.warns(UserWarning, match="max_new_tokens 30 clipped to 14"):
        out = generate(model, params, [[1] * 50], 30)
    assert len(out.tokens[0]) == 14
    with pytest.raises(BridgeError, match="tokens: id 300 is outside the vocabulary"):
        generate(model, params, [[300]], 4)


def test_greedy_agrees_with_the_torch_twin_and_transformers(tmp_path):
    """A random transformers model, converted through the bridge: 64 greedy tokens from each."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # initializer_range 0.2 makes logits decisive, so no argmax is a near-tie that float32
    # rounding could flip (checked below): the comparison is of the models, not of luck.
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, vocab_size=97, max_position_embeddings=128,
        initializer_range=0.2)).eval()
    hf.save_pretrained(tmp_path / "hf")
    prompts = [[1, 5, 9, 3], [1, 42, 17, 60, 2, 8, 11]]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=64, min_new_tokens=64, do_sample=False,
                              pad_token_id=0, eos_token_id=None, output_scores=True,
                              return_dict_in_generate=True)
        expected.append(out.sequences[0, len(p):].tolist())
        top2 = torch.stack(out.scores)[:, 0].topk(2).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3
    model, params = jax_llama.load(tmp_path / "hf")
    assert generate(model, params, prompts, 64).tokens == expected
    assert torch_llama.generate(torch_llama.load(tmp_path / "hf", device="cpu"), prompts, 64).tokens == expected


# -- the command lines -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("gen") / "ckpt",
                                  small_config(vocab_size=259, max_seq_len=64), seed=1,
                                  tokenizer=True)


def test_generate_clis_agree_and_stream(checkpoint):
    jax_run = subprocess.run(["jax-llama", "generate", checkpoint, "--prompt", "hello", "--max-new-tokens",
                              "12"], capture_output=True, text=True, timeout=300)
    torch_run = subprocess.run(["torch-llama", "generate", checkpoint, "--prompt", "hello",
                                "--max-new-tokens", "12", "--device", "cpu"],
                               capture_output=True, text=True, timeout=300)
    assert jax_run.returncode == torch_run.returncode == 0, jax_run.stderr + torch_run.stderr
    assert jax_run.stdout == torch_run.stdout and jax_run.stdout.strip()
    tok = load_tokenizer(checkpoint)
    model, params = jax_llama.load(checkpoint)
    ids = generate(model, params, [tok.encode("hello", bos=True)], 12, stop_ids=tok.stop_ids).tokens[0]
    assert jax_run.stdout == tok.decode([t for t in ids if t not in tok.stop_ids]) + "\n"


def test_compare_torch_reports_agreement(checkpoint, capsys):
    assert jax_cli.main(["generate", str(checkpoint), "--prompt", "abc", "--max-new-tokens", "16",
                         "--compare-torch"]) == 0
    assert "agree on all 16 greedy tokens" in capsys.readouterr().out


def test_prompt_file_batch(checkpoint, tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("abc\n\nxyz\n")  # the empty line starts from BOS
    assert jax_cli.main(["generate", str(checkpoint), "--prompt-file", str(tmp_path / "prompts.txt"),
                         "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- ") == 3 and "--- abc\n" in out and "--- xyz\n" in out


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "a" * 80], "prompt 0: 81 tokens, but the context holds 64 (pass --truncate left"),
    (["--prompt", "x", "--temperature", "-0.5"], "temperature: must be >= 0"),
    (["--prompt", "x", "--top-k", "-2"], "top_k: must be an integer >= 0"),
    (["--prompt", "x", "--system", "be brief"], "--system: a system message needs --chat"),
    (["--prompt", "x", "--stop", "ab"], "--stop: 'ab' is 2 tokens"),
])
def test_generate_cli_refusals(checkpoint, capsys, argv, message):
    assert jax_cli.main(["generate", str(checkpoint), *argv]) == 2
    assert message in capsys.readouterr().err


def test_missing_tokenizer_and_truncation(checkpoint, tmp_path, capsys):
    bare = tmp_path / "bare"
    model, params = jax_llama.load(checkpoint)
    jax_llama.save(bare, model.config, params)
    assert jax_cli.main(["generate", str(bare), "--prompt", "x"]) == 2
    assert ("no tokenizer.json or tokenizer.model beside the weights (pass --tokenizer PATH)"
            in capsys.readouterr().err)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert jax_cli.main(["generate", str(bare), "--tokenizer", str(checkpoint), "--prompt",
                             "a" * 80, "--truncate", "left", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "prompt 0 cut from the left to 63 tokens" in captured.err
    assert "clipped to 1" in captured.err


@pytest.mark.skipif(not LLAMA3.is_file(), reason=f"the real LLaMA 3 tokenizer is not at {LLAMA3}")
def test_chat_template_with_the_llama3_tokenizer():
    tok = load_tokenizer(LLAMA3)
    (ids,) = encode_prompts(tok, ["Hi"], 8192, chat=find_template(None, tok))
    assert ids[:2] == [128000, 128006] and ids[-5:] == [128009, 128006, 78191, 128007, 271]
    assert 128009 in stop_ids(tok)  # <|eot_id|> ends the assistant's turn
