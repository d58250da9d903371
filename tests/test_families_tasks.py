"""Everything beyond the forward pass on Qwen2 (q/k/v biases, a tied head) and Qwen3 (head norms,
head_dim set apart): LoRA adapters that peft loads onto transformers' class and merges that keep
the deltas, the trainers (train, sft, dpo, finetune, zero-shot) writing checkpoints that keep
their family and export to transformers' class, int8 and 4-bit weights with the deltas left in
float, perplexity, the server and `models`; Mistral (without its window: v0.2 on) for the
adapters and `models`. Transformers' own classes are the references: small
random models saved with `save_pretrained`, the byte-level tokenizer beside them."""

from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax_llama  # noqa: E402
import torch_llama  # noqa: E402
from bridge.errors import BridgeError  # noqa: E402
from bridge.formats import open_checkpoint  # noqa: E402
from bridge.int4 import dequantize_int4  # noqa: E402
from bridge.lora import LoraConfig  # noqa: E402
from bridge.quantize import dequantize_weight  # noqa: E402
from bridge.tokenizer import ByteTokenizer, find_tokenizer  # noqa: E402
from conftest import SHARED, add_to_hub_cache, torch_logits  # noqa: E402
from jax_llama.lora import add_lora, save_adapter  # noqa: E402
from llama_twins.cli import bridge_main as bridge_cli  # noqa: E402
from llama_twins.cli import main as jax_cli  # noqa: E402
from llama_twins.cli import torch_main as torch_cli  # noqa: E402
from test_lora import with_random_b  # noqa: E402
from test_train import WORDS  # noqa: E402

# The byte tokenizer's 259 ids; 96 ffn inputs and 64 or 128 attention outputs are multiples of
# the 4-bit group (32), so every projection quantises to 4 bits.
SMALL = dict(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-6)
FAMILIES = {  # name: (model class, settings, the config fields of its delta)
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True), {"qkv_bias": True}),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False),
              {"qk_norm": True, "head_dim": 32}),
    "mistral": ("MistralForCausalLM", dict(sliding_window=None), {}),  # v0.2 on: LLaMA's block
}
QWENS = ["qwen2", "qwen3"]
DELTA_TENSORS = {"qwen2": 6, "qwen3": 4, "mistral": 0}  # q/k/v biases, q/k norms (2 layers)
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 9))


def _hf_model(family: str):
    """A small random transformers model of `family`: random q/k/v biases and head norms, so
    that a delta dropped or permuted shows; Qwen3's untied head scaled by 4, so that greedy
    choices are far from ties."""
    model_class, extra, _ = FAMILIES[family]
    tokenizer = ByteTokenizer()
    torch.manual_seed(0)
    config = getattr(transformers, model_class.replace("ForCausalLM", "Config"))(
        **SMALL, **extra, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "q_norm.weight", "k_norm.weight")):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
        if not config.tie_word_embeddings:
            model.lm_head.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """family -> its small random model's directory as transformers saves it, with the byte
    tokenizer's files."""
    made = {}

    def save(family: str) -> Path:
        if family not in made:
            path = tmp_path_factory.mktemp(family) / "hf"
            _hf_model(family).save_pretrained(path)
            ByteTokenizer().save(path)
            made[family] = path
        return made[family]
    return save


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few KB of grammatical nonsense (test_train's words), one text file."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("corpus") / "doc.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS, size=6)).capitalize() + "."
                              for _ in range(200)) + "\n")
    return path


def _logits(model) -> np.ndarray:
    """A transformers (or peft) model's logits on TOKENS."""
    with torch.inference_mode():
        return model(torch.as_tensor(TOKENS)).logits.float().numpy()


def _jax_logits(path, **load) -> np.ndarray:
    model, params = jax_llama.load(path, **load)
    return np.asarray(model.apply({"params": params}, TOKENS))


def _assert_close(got, want, rel=1e-5):
    """Within `rel` of the largest logit: float32 in two frameworks summing in different orders."""
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * np.abs(want).max())


def _delta_fields(config) -> dict:
    return {"family": config.family, "qkv_bias": config.qkv_bias, "qk_norm": config.qk_norm,
            "head_dim": config.head_dim, "tie_embeddings": config.tie_embeddings}


def _hf_class(path) -> str:
    return type(transformers.AutoModelForCausalLM.from_pretrained(path)).__name__


# -- LoRA -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapters_go_both_ways_with_peft_on_transformers_class_and_merge_keeping_the_deltas(
        family, hf_dir, tmp_path):
    """An adapter on all seven projections with random B: peft.PeftModel over transformers'
    class (Qwen2, Qwen3, Mistral) gives the JAX and torch twins' adapted logits; `llama-bridge
    merge-lora --to hf` writes the same class with the same logits, its biases and head norms
    the base's, bit for bit."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model
    from safetensors.numpy import load_file

    path = hf_dir(family)
    model, params = jax_llama.load(path)
    lora_model, lora_params = add_lora(model, params, LoraConfig(rank=4, alpha=8.0), seed=1)
    lora_params = with_random_b(lora_params, scale=0.1)
    save_adapter(tmp_path / "adapter", lora_model, lora_params)
    base = transformers.AutoModelForCausalLM.from_pretrained(path)
    want = _logits(PeftModel.from_pretrained(base, tmp_path / "adapter").eval())
    ours = np.asarray(lora_model.apply({"params": lora_params}, TOKENS))
    base_logits = _jax_logits(path)
    assert np.abs(ours - base_logits).max() > 1e-2  # the adapter does something
    _assert_close(ours, want)
    _assert_close(_jax_logits(path, adapter=tmp_path / "adapter"), want)
    _assert_close(torch_logits(torch_llama.load(path, device="cpu", adapter=tmp_path / "adapter"),
                               TOKENS), want)

    assert bridge_cli.main(["merge-lora", str(path), str(tmp_path / "adapter"),
                            str(tmp_path / "merged"), "--to", "hf", "--quiet"]) == 0
    assert _hf_class(tmp_path / "merged") == FAMILIES[family][0]
    _assert_close(_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")),
                  want)
    before, after = load_file(path / "model.safetensors"), load_file(tmp_path / "merged" /
                                                                     "model.safetensors")
    kept = [n for n in before if n.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight"))]
    assert len(kept) == DELTA_TENSORS[family]
    for name in kept:
        np.testing.assert_array_equal(after[name], before[name])

    theirs = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path), PeftLoraConfig(
        r=4, lora_alpha=16, task_type="CAUSAL_LM", init_lora_weights=False,  # B random, not zero
        target_modules="all-linear"))  # written as each layer's module names
    theirs.eval().save_pretrained(tmp_path / "theirs")
    want = _logits(theirs)
    assert np.abs(want - base_logits).max() > 1e-2
    _assert_close(_jax_logits(path, adapter=tmp_path / "theirs"), want)
    _assert_close(torch_logits(torch_llama.load(path, device="cpu", adapter=tmp_path / "theirs"),
                               TOKENS), want)


# -- SFT masks in Qwen3's chat template ------------------------------------------------------------

# The rule of Qwen3's chat template (Qwen/Qwen3-0.6B's tokenizer_config.json) for replies,
# condensed: after the last user turn a reply gets its think block (an empty one when it is the
# last turn); before it, a reply loses its reasoning.
QWEN3_TEMPLATE = """
{%- set ns = namespace(last_query=0) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}
{%- endfor %}
{%- for m in messages %}
{%- if m.role != 'assistant' %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- else %}
{%- set reply = m.content.split('</think>')[-1].lstrip('\\n') %}
{%- set thought = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n')
        if '</think>' in m.content else '' %}
{%- if loop.index0 > ns.last_query and (loop.last or thought) %}
{{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + reply }}
{%- else %}{{ '<|im_start|>assistant\\n' + reply }}{% endif %}{{ '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""


def test_qwen3s_template_trains_each_reply_as_the_conversation_renders_it():
    """Rendered as the last turn, a Qwen3 reply has a think block in front that it loses once the
    conversation goes on: each reply is marked as the whole conversation renders it (earlier
    ones without their reasoning, the last with its think block), and a conversation of one
    reply as before."""
    from bridge.chat import ChatTemplate
    from tasks.chats import encode_example

    template, tokenizer = ChatTemplate(QWEN3_TEMPLATE, "qwen3.jinja"), ByteTokenizer()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "<think>add again</think>6"}]

    def trained(messages):
        example = encode_example(template, tokenizer, messages, "chats.jsonl:1")
        runs = [list(group) for marked, group in groupby(
            zip(example.ids.tolist(), example.trained.tolist()), key=lambda pair: pair[1])
            if marked]
        return [tokenizer.decode([i for i, _ in run]) for run in runs]

    assert trained(chat) == ["Hello<|im_end|>\n", "4<|im_end|>\n",
                             "<think>\nadd again\n</think>\n\n6<|im_end|>\n"]
    assert trained(chat[:3]) == ["<think>\n\n</think>\n\nHello<|im_end|>\n"]
    text, _ = template.render(chat, tokenizer)
    assert "<|im_start|>assistant\n4<|im_end|>" in text  # the reasoning gone from history
    # a template that leaves earlier replies out: only their end marker would be shared; refused
    elided = ChatTemplate(QWEN3_TEMPLATE.replace("{%- else %}{{ '<|im_start|>assistant\\n' + reply",
                                                 "{%- else %}{{ '<|im_start|>assistant\\n' + ''"),
                          "elided.jinja")
    assert elided.source != QWEN3_TEMPLATE
    with pytest.raises(BridgeError, match=r"^chats\.jsonl:1: assistant turn 1 cannot be found in "
                                          r"the rendered template \(elided\.jinja\)$"):
        encode_example(elided, tokenizer, chat, "chats.jsonl:1")


# -- the trainers ----------------------------------------------------------------------------------

STEPS = ["--steps", "3", "--batch-size", "2", "--eval-every", "3", "--checkpoint-every", "3",
         "--no-progress"]


@pytest.mark.parametrize("family, command", [
    ("qwen3", ["train", "--data", "{corpus}", "--seq-len", "32", "--lr", "1e-2",
               "--sample-tokens", "0"]),
    ("qwen2", ["sft", "--demo-examples", "16", "--seq-len", "96", "--skip-invalid",
               "--lora-rank", "4", "--lr", "1e-2"]),
    ("qwen3", ["dpo", "--demo-pairs", "16", "--seq-len", "128", "--lr", "1e-3"]),
])
def test_a_run_from_a_qwen_checkpoint_keeps_its_family_and_exports_to_its_class(
        family, command, hf_dir, corpus, tmp_path):
    """A few steps of train, sft (LoRA) and dpo from a Qwen directory: the run's model reads
    back with the family and its deltas, has moved, and exported to Hugging Face loads in
    transformers as the same class with the twins' logits. The LoRA run's adapter under peft on
    transformers' class gives the run's merged model."""
    path = hf_dir(family)
    command = [w.replace("{corpus}", str(corpus)) for w in command]
    assert jax_cli.main([*command, "--init", str(path), "--out", str(tmp_path / "run"),
                         *STEPS]) == 0
    model_dir = tmp_path / "run" / "model"
    assert _delta_fields(open_checkpoint(model_dir).config) == \
        _delta_fields(open_checkpoint(path).config)
    ours = _jax_logits(model_dir)
    assert np.abs(ours - _jax_logits(path)).max() > 1e-4  # it trained
    _assert_close(torch_logits(torch_llama.load(model_dir, device="cpu"), TOKENS), ours)
    assert bridge_cli.main(["convert", str(model_dir), str(tmp_path / "hf"), "--to", "hf",
                            "--quiet"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(exported).__name__ == FAMILIES[family][0]
    _assert_close(_logits(exported), ours)
    if "--lora-rank" in command:
        from peft import PeftModel

        base = transformers.AutoModelForCausalLM.from_pretrained(path)
        _assert_close(_logits(PeftModel.from_pretrained(base, tmp_path / "run" / "adapter")), ours)


def test_finetune_with_lora_and_zero_shot_on_qwen_checkpoints(hf_dir, tmp_path, capsys):
    """`finetune --init QWEN3 --lora-rank 2` (SST-5 lines): the classifier's backbone keeps the
    family and the twins' classifiers predict the same log-probabilities; `zero-shot` on a Qwen2
    directory scores every line."""
    sst = SHARED / "data" / "sst"
    if not (sst / "train.txt").is_file():
        pytest.skip(f"the SST data is not at {sst}")
    lines = (sst / "train.txt").read_text().splitlines()
    (tmp_path / "train.txt").write_text("\n".join(lines[:32]) + "\n")
    (tmp_path / "dev.txt").write_text("\n".join(lines[32:48]) + "\n")
    path = hf_dir("qwen3")
    assert jax_cli.main(["finetune", "--init", str(path), "--train", str(tmp_path / "train.txt"),
                         "--dev", str(tmp_path / "dev.txt"), "--labels", str(sst / "labels.json"),
                         "--lora-rank", "2", "--epochs", "1", "--batch-size", "8", "--max-len",
                         "32", "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    model_dir = tmp_path / "run" / "model"
    assert _delta_fields(open_checkpoint(model_dir).config) == \
        _delta_fields(open_checkpoint(path).config)
    from jax_llama.classify import load_classifier, predict
    from torch_llama.classify import load_classifier as torch_load_classifier
    from torch_llama.classify import predict as torch_predict

    texts = [line.split(" ||| ", 1)[1] for line in lines[32:40]]
    _, jax_logp, _ = predict(load_classifier(model_dir), texts)
    _, torch_logp, _ = torch_predict(torch_load_classifier(model_dir, device="cpu"), texts)
    np.testing.assert_allclose(torch_logp, jax_logp, rtol=0, atol=1e-5)
    capsys.readouterr()

    assert jax_cli.main(["zero-shot", str(hf_dir("qwen2")), "--data", str(tmp_path / "dev.txt"),
                         "--labels", str(sst / "labels.json"), "--max-len", "64",
                         "--no-progress"]) == 0
    out = capsys.readouterr()
    labels = json.loads((sst / "labels.json").read_text())
    predictions = out.out.split()
    assert len(predictions) == 16 and set(predictions) <= {str(i) for i in range(len(labels))}
    assert "zero-shot accuracy" in out.err and "/16)" in out.err


# -- int8 and 4-bit --------------------------------------------------------------------------------

def _dequantized_state(model) -> dict:
    """The float32 tensors a quantised torch twin's weights stand for (its biases and norms as
    they are): what a plain model of the same config loads."""
    state = {n: t.numpy() for n, t in model.state_dict().items()}
    out = {}
    for name, t in state.items():
        if name.endswith(("_scale", "_min")):
            continue
        if t.dtype == np.int8:
            t = dequantize_weight(t, state[name + "_scale"])
        elif t.dtype == np.uint8:
            t = dequantize_int4(t, state[name + "_scale"], state.get(name + "_min"))
        out[name] = torch.as_tensor(np.asarray(t, np.float32))
    return out


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", QWENS)
def test_quantised_weights_leave_the_deltas_in_float(family, method, hf_dir):
    """Both twins loaded with quantize=int8 / int4: each projection is quantised, the q/k/v
    biases and head norms stay float32 and equal to the checkpoint's; the logits are those of a
    plain model on the weights the quantised ones stand for (float32 rounding), the twins agree,
    and int8 is within 2% of the float model's largest logit."""
    path = hf_dir(family)
    float_logits = _jax_logits(path)
    quantised = torch_llama.load(path, device="cpu", quantize=method)
    attention = quantised.layers[0].attention
    assert attention.wq.weight.dtype == (torch.int8 if method == "int8" else torch.uint8)
    stored = open_checkpoint(path)
    deltas = [n for n in stored.specs
              if n.endswith(("wq.bias", "wk.bias", "wv.bias", "q_norm.weight", "k_norm.weight"))]
    assert len(deltas) == DELTA_TENSORS[family]
    state = quantised.state_dict()
    for name in deltas:
        assert state[name].dtype == torch.float32
        np.testing.assert_array_equal(state[name].numpy(), stored.tensor(name))

    plain = torch_llama.Llama(quantised.config)
    plain.load_state_dict(_dequantized_state(quantised))
    want = torch_logits(plain.eval(), TOKENS)
    got = torch_logits(quantised, TOKENS)
    _assert_close(got, want)
    model, params = jax_llama.load(path, quantize=method)
    jax_got = np.asarray(model.apply({"params": params}, TOKENS))
    _assert_close(jax_got, got, rel=2e-5)
    layer = params["layers_0"]["attention"]
    for key in ("wq_bias", "wk_bias", "wv_bias", "q_norm", "k_norm"):
        if key in layer:
            leaf = layer[key] if key.endswith("bias") else layer[key]["weight"]
            assert leaf.dtype == np.float32
    difference = np.abs(got - float_logits).max()
    assert difference > 1e-4  # quantised at all
    if method == "int8":
        assert difference < 2e-2 * np.abs(float_logits).max()


@pytest.mark.parametrize("family, method", [("qwen2", "int8"), ("qwen3", "int4")])
def test_quantised_greedy_generation_is_the_same_in_both_twins_and_commands(family, method, hf_dir,
                                                                           capsys):
    from bridge.sampling import Sampler
    from torch_llama.generate import generate as torch_generate

    path, prompt, greedy = hf_dir(family), [[256, 72, 105, 33]], Sampler(temperature=0.0)
    model, params = jax_llama.load(path, quantize=method)
    tokens = jax_llama.generate(model, params, prompt, 8, greedy).tokens
    assert len(tokens[0]) == 8 or tokens[0][-1] == ByteTokenizer().eos_id
    assert torch_generate(torch_llama.load(path, device="cpu", quantize=method), prompt, 8,
                          greedy).tokens == tokens
    texts = []
    for main in (jax_cli.main, torch_cli.main):
        assert main(["generate", str(path), "--prompt", "Hi!", "--max-new-tokens", "8",
                     "--temperature", "0", "--quantize", method, "--no-progress"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]


# -- eval, serve, models ---------------------------------------------------------------------------

def test_perplexity_of_a_qwen2_directory_is_transformers(hf_dir, tmp_path, capsys):
    """`eval --json` in both twins on a text shorter than one window: the NLL per token is
    transformers' mean cross-entropy on BOS and the text's bytes."""
    path = hf_dir("qwen2")
    text = "The cat sat on the mat, and the dog sat on the log.\n"
    (tmp_path / "text.txt").write_text(text)
    ids = find_tokenizer(str(path)).encode(text, bos=True)
    with torch.inference_mode():
        want = float(transformers.AutoModelForCausalLM.from_pretrained(path)(
            torch.as_tensor([ids]), labels=torch.as_tensor([ids])).loss)
    for main in (jax_cli.main, torch_cli.main):
        assert main(["eval", str(path), "--data", str(tmp_path / "text.txt"), "--seq-len", "64",
                     "--json", "--no-progress"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["tokens"] == len(ids) - 1
        assert report["nll_per_token"] == pytest.approx(want, rel=1e-5)


def test_the_server_answers_a_completion_on_a_qwen3_directory_as_transformers(hf_dir):
    """One /v1/completions request, greedy, on a Qwen3 directory: transformers' greedy tokens."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn", reason="uvicorn is not installed (.[serve])")
    from bridge.chat import find_template
    from jax_llama.inference.serving import Engine
    from llama_twins.server import Server, serve_in_thread

    path = hf_dir("qwen3")
    tokenizer = find_tokenizer(str(path))
    prompt = "Once upon"
    ids = tokenizer.encode(prompt, bos=tokenizer.add_bos)
    with torch.inference_mode():
        out = _hf_model("qwen3").generate(torch.as_tensor([ids]), max_new_tokens=8,
                                          do_sample=False)[0, len(ids):].tolist()
    want = out[:out.index(tokenizer.eos_id)] if tokenizer.eos_id in out else out
    model, params = jax_llama.load(path)
    server = Server(Engine(model, params, max_batch=2), model, params, tokenizer,
                    find_template(str(path), tokenizer, None), "qwen3")
    url, stop = serve_in_thread(server)
    try:
        reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "qwen3", "prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    finally:
        stop()
    assert reply["choices"][0]["text"] == tokenizer.decode(want)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["usage"]["completion_tokens"] == len(out)


def test_models_lists_qwen_repos_in_the_hub_cache_as_readable(hf_dir, tmp_path, capsys):
    for family in FAMILIES:
        files = {p.name: p for p in hf_dir(family).iterdir()}
        add_to_hub_cache(tmp_path / "hub", f"Qwen/tiny-{family}", f"{len(family):040d}", files,
                         refs=("main",))
    assert jax_cli.main(["models", "--hub-cache", str(tmp_path / "hub"), "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    for family in FAMILIES:
        row = rows[f"Qwen/tiny-{family}"]
        assert row["unreadable"] is None and row["format"] == "hf"
        assert row["parameters"] == _hf_model(family).num_parameters()
