"""bridge.chat: chat templates rendered and tokenized exactly as transformers' apply_chat_template
does (the real LLaMA 3 / 2 tokenizers, skipped without ../shared, and a BPE trained here), the
built-ins against the published formats, the assistant-only mask token by token (generation
blocks, the prefix method, transformers' return_assistant_tokens_mask, and the refusals), reading
conversations, finding and saving templates, show_mask and truncate."""

import json
import pickle
import re

import numpy as np
import pytest

from bridge.chat import BUILTIN, ChatTemplate, find_template

from tasks.chats import Example, encode_example, read_chats, show_mask, truncate
from bridge.errors import BridgeError
from bridge.tokenizer import (LLAMA3_PATTERN, LLAMA3_SPECIALS, ByteTokenizer, load_tokenizer,
                             train_tokenizer)
from conftest import TOKENIZER_FILES

transformers = pytest.importorskip("transformers")

LLAMA3_FILE, LLAMA2_FILE = TOKENIZER_FILES["llama3"], TOKENIZER_FILES["llama2"]

# Multi-turn, a system message, unicode, and spaces around contents for the templates to strip.
CHAT = [{"role": "system", "content": " You are terse. "},
        {"role": "user", "content": "  Hi there!  "},
        {"role": "assistant", "content": " Olá — ça va? ☕ "},
        {"role": "user", "content": "Dites «bonjour»\n"},
        {"role": "assistant", "content": "Bonjour.\n\nÀ bientôt. "}]
SHORT = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
CHATS = [CHAT, SHORT, CHAT[1:3]]
PROMPTS = [CHAT[:2], CHAT[:4], SHORT[:1]]  # each ending with a user turn: add_generation_prompt

# A ChatML-like template with its own generation blocks (the reply and its <|im_end|>).
CHATML = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# Replies without two leading spaces: after "\n" the first would share a token with the "\n".
CHATML_CHAT = [{"role": "system", "content": "  Be kind.  "},
               {"role": "user", "content": " Hi  there! "},
               {"role": "assistant", "content": "Olá — ça va? ☕  "},
               {"role": "user", "content": "Again?"},
               {"role": "assistant", "content": "Oui,\n\ntoujours."}]


def without_generation(source: str) -> str:
    """The template with its {% generation %} tags removed, rendering the same text."""
    return source.replace("{%- generation %}{{", "{{-").replace("{% endgeneration %}", "")


def hf_ids(out) -> list[int]:
    """apply_chat_template(tokenize=True)'s ids: transformers 5 returns a BatchEncoding."""
    return list(out) if isinstance(out, list) else list(out["input_ids"])


# -- tokenizers: ours and transformers' for the same vocabulary -----------------------------------

@pytest.fixture(scope="module")
def hf_llama3(llama3):
    """transformers' BPE from the same tiktoken ranks, the 256 specials at 128000+."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(LLAMA3_FILE), pattern=LLAMA3_PATTERN,
                            extra_special_tokens=LLAMA3_SPECIALS).converted()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                              eos_token="<|eot_id|>")
    assert hf.convert_tokens_to_ids("<|eot_id|>") == llama3.special_tokens["<|eot_id|>"] == 128009
    return hf


def sentencepiece_hf(legacy: bool):
    """transformers' SentencePiece-backed (slow) LLaMA tokenizer. legacy=True is the one whose
    ids are the SentencePiece model's own: legacy=False drops the "▁" that SentencePiece puts
    before the text after <s> ("[" rather than "▁[" in "<s>[INST]"), unlike Meta's reference
    encoding; transformers' tokenizers-backed LlamaTokenizer converted from tokenizer.model
    differs from SentencePiece on runs of spaces (either setting)."""
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    return SentencePieceBackend(vocab_file=str(LLAMA2_FILE), legacy=legacy, bos_token="<s>",
                                eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE trained here with ChatML's specials, saved as tokenizer.json."""
    texts = [m["content"] for chat in (CHAT, SHORT, CHATML_CHAT) for m in chat] * 20
    texts += ["a line\n  indented"] * 20  # so that "\n " is one token
    directory = tmp_path_factory.mktemp("bpe")
    train_tokenizer(texts, 400, CHATML_SPECIALS).save(directory)
    return directory


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return load_tokenizer(bpe_dir / "tokenizer.json")


@pytest.fixture(scope="module")
def hf_bpe(bpe_dir):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"),
                                                bos_token="<|bos|>", eos_token="<|eos|>")


# -- 1. the ids transformers gives, and the published formats --------------------------------------

def assert_same_as_transformers(template, ours, hf):
    for chat in CHATS:
        assert template.render(chat, ours)[0] == hf.apply_chat_template(
            chat, chat_template=template.source, tokenize=False)
        assert template.encode(chat, ours) == hf_ids(hf.apply_chat_template(
            chat, chat_template=template.source, tokenize=True))
    for chat in PROMPTS:
        assert template.encode(chat, ours, add_generation_prompt=True) == hf_ids(
            hf.apply_chat_template(chat, chat_template=template.source, tokenize=True,
                                   add_generation_prompt=True))


def test_llama3_builtin_gives_transformers_ids(llama3, hf_llama3):
    template = find_template(None, llama3, "llama3")
    assert_same_as_transformers(template, llama3, hf_llama3)
    ids = template.encode(CHAT, llama3)
    assert ids[0] == llama3.bos_id and ids.count(llama3.bos_id) == 1  # the template's BOS only


def test_llama2_builtin_gives_transformers_and_metas_ids(llama2):
    template = find_template(None, llama2, "llama2")
    assert_same_as_transformers(template, llama2, sentencepiece_hf(legacy=True))
    not_legacy = sentencepiece_hf(legacy=False)
    assert template.encode(CHAT, llama2) != hf_ids(not_legacy.apply_chat_template(
        CHAT, chat_template=template.source, tokenize=True))
    # Meta's chat_completion: each exchange encoded as one text with BOS and EOS ids around it,
    # the system prompt folded into the first user turn before stripping.
    first = "<<SYS>>\n" + CHAT[0]["content"] + "\n<</SYS>>\n\n" + CHAT[1]["content"]
    meta = []
    for user, reply in [(first, CHAT[2]["content"]), (CHAT[3]["content"], CHAT[4]["content"])]:
        meta += llama2.encode(f"[INST] {user.strip()} [/INST] {reply.strip()} ", bos=True, eos=True)
    assert template.encode(CHAT, llama2) == meta


def test_a_custom_template_gives_transformers_ids_and_mask(bpe, hf_bpe):
    template = ChatTemplate(CHATML, "chatml")
    for chat in (CHATML_CHAT, SHORT):
        ids = template.encode(chat, bpe)
        out = hf_bpe.apply_chat_template(chat, chat_template=CHATML, tokenize=True,
                                         return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(out["input_ids"])
        example = encode_example(template, bpe, chat, "chat:1")
        assert example.ids.tolist() == ids
        assert example.trained.tolist() == [bool(m) for m in out["assistant_masks"]]
        assert 0 < example.trained.sum() < len(ids)
    assert_same_as_transformers(template, bpe, hf_bpe)


def test_the_environment_is_transformers(bpe, hf_bpe):
    """tojson without HTML escaping, loop controls, raise_exception, strftime_now, bos/eos text."""
    source = ("{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}|{% for m in messages %}"
              "{% if loop.index > 2 %}{% break %}{% endif %}{{ m.role }},{% endfor %}|"
              "{{ strftime_now('%Y') }}|{{ bos_token }}{{ eos_token }}")
    chat = [{"role": "user", "content": "<b>é & \"q\"</b>"}] + SHORT
    text, spans = ChatTemplate(source, "t").render(chat, bpe)
    assert text == hf_bpe.apply_chat_template(chat, chat_template=source, tokenize=False)
    assert '"<b>é & \\"q\\"</b>"' in text and "|user,user,|" in text and spans == []
    assert text.endswith("<|bos|><|eos|>")
    with pytest.raises(BridgeError, match=r"^t: the chat template does not render "
                                          r"\(TemplateError: no way\)$"):
        ChatTemplate("{{ raise_exception('no way') }}", "t").render(chat, bpe)


def bpe_with(*specials):
    """A small BPE whose first three specials are its bos, eos and pad."""
    return train_tokenizer(["hello world"] * 5, 300, specials)


def test_builtins_render_the_published_formats():
    llama3 = bpe_with("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
    llama2 = bpe_with("<s>", "</s>", "<unk>")
    chat = CHAT[:3]
    assert ChatTemplate(BUILTIN["llama3"], "llama3").render(chat, llama3, True)[0] == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nOlá — ça va? ☕<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # Meta strips the first user turn with the system prompt folded in, as one text
    text, spans = ChatTemplate(BUILTIN["llama2"], "llama2").render(CHAT, llama2)
    assert text == (
        "<s>[INST] <<SYS>>\n You are terse. \n<</SYS>>\n\n  Hi there! [/INST]"
        " Olá — ça va? ☕ </s>"
        "<s>[INST] Dites «bonjour» [/INST] Bonjour.\n\nÀ bientôt. </s>")
    assert [text[a:b] for a, b in spans] == [" Olá — ça va? ☕ </s>",
                                             " Bonjour.\n\nÀ bientôt. </s>"]


# -- 2-3. the mask ---------------------------------------------------------------------------------

def test_the_llama3_mask_is_the_replies_and_their_eot_token_by_token(llama3):
    example = encode_example(find_template(None, llama3), llama3, CHAT, "chats.jsonl:7")
    assert example.ids.dtype == np.int32 and example.trained.dtype == bool

    def header(role):
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"

    # the expected ids and mask, built piece by piece: (text, trained)
    pieces = [("<|begin_of_text|>" + header("system") + "You are terse.<|eot_id|>" + header("user")
               + "Hi there!<|eot_id|>" + header("assistant"), False),
              ("Olá — ça va? ☕<|eot_id|>", True),
              (header("user") + "Dites «bonjour»<|eot_id|>" + header("assistant"), False),
              ("Bonjour.\n\nÀ bientôt.<|eot_id|>", True)]
    ids = [i for text, _ in pieces for i in llama3.encode(text, allow_special=True)]
    trained = [flag for text, flag in pieces for _ in llama3.encode(text, allow_special=True)]
    assert example.ids.tolist() == ids and example.trained.tolist() == trained
    eot = llama3.special_tokens["<|eot_id|>"]
    eots = np.flatnonzero(example.ids == eot)
    assert example.trained[eots].tolist() == [False, False, True, False, True]
    assert not example.trained[0] and example.ids[0] == llama3.bos_id


def test_the_llama2_mask_is_metas_reply_tokens(llama2):
    """SentencePiece starts each piece with a space of its own, so the span edges are found by
    tokenizing prefixes: the replies' tokens are the tail of Meta's per-exchange encoding."""
    example = encode_example(find_template(None, llama2), llama2, CHAT, "c:1")
    first = "<<SYS>>\n" + CHAT[0]["content"] + "\n<</SYS>>\n\n" + CHAT[1]["content"]
    expected = []
    for user, reply in [(first, CHAT[2]["content"]), (CHAT[3]["content"], CHAT[4]["content"])]:
        prompt = llama2.encode(f"[INST] {user.strip()} [/INST]")
        turn = llama2.encode(f"[INST] {user.strip()} [/INST] {reply.strip()} ")
        assert turn[:len(prompt)] == prompt
        expected += turn[len(prompt):] + [llama2.eos_id]
    assert example.ids[example.trained].tolist() == expected


@pytest.mark.parametrize("name", ["llama3", "llama2"])
def test_without_generation_blocks_the_prefix_method_gives_the_same_mask(name, request):
    tok = request.getfixturevalue(name)
    plain = ChatTemplate(without_generation(BUILTIN[name]), "plain.jinja")
    assert "endgeneration" not in plain.source
    assert plain.render(CHAT, tok) == (ChatTemplate(BUILTIN[name], name).render(CHAT, tok)[0], [])
    marked = encode_example(ChatTemplate(BUILTIN[name], name), tok, CHAT, "c:1")
    found = encode_example(plain, tok, CHAT, "c:1")
    assert found.ids.tolist() == marked.ids.tolist()
    assert found.trained.tolist() == marked.trained.tolist() and found.trained.any()


def test_the_prefix_method_refuses_a_template_whose_renderings_are_not_prefixes(bpe):
    counted = ChatTemplate("{{ messages | length }}\n" + without_generation(BUILTIN["llama3"]),
                           "counted.jinja")
    with pytest.raises(BridgeError, match=r"^chats\.jsonl:4: assistant turn 1 cannot be found in "
                                          r"the rendered template \(counted\.jinja\)$"):
        encode_example(counted, bpe, CHAT, "chats.jsonl:4")


def test_a_token_across_a_reply_edge_is_refused(bpe, hf_bpe):
    """After "\\n", the first of a reply's two leading spaces joins the newline in one token
    ("\\n "): half prompt, half reply. transformers marks it trained (it overlaps the reply); we
    refuse."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Olá"}]
    out = hf_bpe.apply_chat_template(chat, chat_template=CHATML, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    across = list(out["input_ids"]).index(hf_bpe.convert_tokens_to_ids("\u010a\u0120"))  # "\n "
    assert out["assistant_masks"][across] == 1 and out["assistant_masks"][across - 1] == 0
    with pytest.raises(BridgeError, match=r"^chats\.jsonl:9: a token of the rendered template "
                                          r"\(chatml\) straddles character \d+"):
        encode_example(ChatTemplate(CHATML, "chatml"), bpe, chat, "chats.jsonl:9")


# -- 4. reading conversations ----------------------------------------------------------------------

GOOD = json.dumps({"messages": SHORT})


@pytest.mark.parametrize("line, why", [
    ('{"messages": [}', r"malformed JSON \(Expecting value at column 15\)"),
    ('[1, 2]', r"expected a JSON object \(got list\)"),
    ('{"text": "hi"}',
     r"expected \"messages\", or \"prompt\" and \"completion\" \(got keys 'text'\)"),
    ('{"prompt": "hi"}', r"expected \"messages\", or \"prompt\" and \"completion\""),
    ('{"messages": {"role": "user"}}', r"messages: expected a list \(got dict\)"),
    ('{"messages": []}', r"messages: empty list"),
    ('{"messages": ["hi"]}', r"message 1: expected an object with \"role\" and \"content\""),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', r"message 1: unknown role 'robot'"),
    ('{"messages": [{"role": "user", "content": ["hi"]}]}',
     r"message 1: content must be a string \(got list\)"),
    ('{"prompt": "hi", "completion": 4}', r"message 2: content must be a string \(got int\)"),
    ('{"messages": [{"role": "user", "content": "hi"}]}',
     r"the conversation ends with a user turn; it must end with an assistant turn"),
], ids=["malformed", "not-object", "neither", "prompt-only", "messages-not-list", "empty",
        "message-not-object", "unknown-role", "content-not-string", "completion-not-string",
        "no-assistant-turn"])
def test_read_chats_refuses_naming_file_and_line(tmp_path, line, why):
    path = tmp_path / "chats.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")
    with pytest.raises(BridgeError, match=rf"^{re.escape(str(path))}:3: {why}") as e:
        read_chats(path)
    assert "\n" not in str(e.value)


def test_read_chats_reads_both_forms_and_skips_blank_lines(tmp_path):
    path = tmp_path / "chats.jsonl"
    pair = {"prompt": "Q\u2028?", "completion": "A", "id": 3}  # U+2028 unescaped in the line
    path.write_text(json.dumps({"messages": CHAT}) + "\n  \n" + json.dumps(pair, ensure_ascii=False)
                    + "\n", encoding="utf-8")
    assert read_chats(path) == [(f"{path}:1", CHAT),
                                (f"{path}:3", [{"role": "user", "content": "Q\u2028?"},
                                               {"role": "assistant", "content": "A"}])]
    with pytest.raises(BridgeError, match=r"nowhere\.jsonl: cannot read the conversations "
                                          r"\(No such file or directory\)"):
        read_chats(tmp_path / "nowhere.jsonl")


# -- 5. finding a template -------------------------------------------------------------------------

def test_find_template_prefers_the_checkpoints_own(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from config"}))
    assert find_template(tmp_path, tok) == ChatTemplate("from config",
                                                        str(tmp_path / "tokenizer_config.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}))
    assert find_template(tmp_path, tok).source == "plain"
    (tmp_path / "chat_template.jinja").write_text("from file")  # the file wins over the config
    assert find_template(tmp_path, tok) == ChatTemplate("from file",
                                                        str(tmp_path / "chat_template.jinja"))
    assert find_template(tmp_path, tok, "llama3").name == "llama3"  # a choice wins over both


def test_find_template_falls_back_by_tokenizer(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert find_template(tmp_path, ByteTokenizer()).name == "llama2"
    assert find_template(None, bpe_with("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>")).name \
        == "llama2"
    llama3_like = bpe_with("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>",
                           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    assert find_template(None, llama3_like) == ChatTemplate(BUILTIN["llama3"], "llama3")


@pytest.mark.parametrize("config, why", [
    ({"chat_template": [{"name": "tool_use", "template": "x"}]},
     r": chat_template: a list of templates without one named 'default' \(names: tool_use\)"),
    ({"chat_template": 3},
     r": chat_template: expected a string or a list of named templates \(got int\)"),
    ("{", r": cannot read it as JSON"),
    ({"chat_template": "{% for %}"}, r":1: chat template: TemplateSyntaxError: "),
], ids=["no-default", "not-a-string", "bad-json", "syntax-error"])
def test_find_template_refuses_a_bad_tokenizer_config(tmp_path, config, why):
    path = tmp_path / "tokenizer_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(BridgeError, match=f"^{re.escape(str(path))}{why}"):
        find_template(tmp_path, ByteTokenizer())


def test_find_template_refuses_a_bad_choice(tmp_path):
    with pytest.raises(BridgeError, match=r"^chat_template: llama4: neither a built-in template "
                                          r"\(llama3, llama2\) nor a file$"):
        find_template(None, ByteTokenizer(), "llama4")
    (tmp_path / "bad.jinja").write_text("hi\n{{ m.content | nosuchfilter }}")
    with pytest.raises(BridgeError, match=rf"^{re.escape(str(tmp_path / 'bad.jinja'))}:2: chat "
                                          r"template: TemplateAssertionError: No filter named"):
        find_template(None, ByteTokenizer(), str(tmp_path / "bad.jinja"))


# -- 6. save, render failures, show_mask, truncate -------------------------------------------------

def test_save_and_find_again(tmp_path):
    template = ChatTemplate(CHATML, "chatml")
    path = template.save(tmp_path / "ckpt")
    assert path == tmp_path / "ckpt" / "chat_template.jinja" and path.read_text() == CHATML
    assert find_template(tmp_path / "ckpt", ByteTokenizer()) == ChatTemplate(CHATML, str(path))
    assert pickle.loads(pickle.dumps(template)) == template  # e.g. to a data-loading process


def test_a_template_that_fails_to_render_names_itself(bpe):
    llama2 = ChatTemplate(BUILTIN["llama2"], "llama2")
    with pytest.raises(BridgeError, match=r"^llama2: the chat template does not render "
                                          r"\(TemplateError: roles must alternate"):
        llama2.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], bpe)
    with pytest.raises(BridgeError, match=r"^t\.jinja: the chat template does not render "
                                          r"\(TypeError: "):
        ChatTemplate("{{ 1 + messages[0]['content'] }}", "t.jinja").render(SHORT, bpe)


def test_show_mask_marks_exactly_the_trained_text(bpe):
    example = encode_example(ChatTemplate(CHATML, "chatml"), bpe, CHATML_CHAT, "chats.jsonl:2")
    shown = show_mask(example, bpe)
    first, body = shown.split("\n", 1)
    assert first == f"chats.jsonl:2: {example.trained.sum()} of {len(example.ids)} tokens trained"
    assert re.findall("«(.*?)»", body, re.DOTALL) == ["Olá — ça va? ☕  <|im_end|>",
                                                 "Oui,\n\ntoujours.<|im_end|>"]
    assert body.replace("«", "").replace("»", "") == ChatTemplate(CHATML, "c").render(
        CHATML_CHAT, bpe)[0]


def test_show_mask_keeps_sentencepiece_spaces_and_control_tokens(llama2):
    example = encode_example(find_template(None, llama2), llama2, SHORT, "c:1")
    assert show_mask(example, llama2).split("\n", 1)[1] == "<s>[INST] 2+2? [/INST]« 4 </s>»"


def test_truncate_cuts_and_drops_what_leaves_nothing_to_train():
    example = Example(np.arange(6, dtype=np.int32), np.array([0, 0, 0, 1, 1, 0], bool), "x:1")
    cut = truncate(example, 4)
    assert cut.ids.tolist() == [0, 1, 2, 3] and cut.trained.tolist() == [0, 0, 0, 1]
    assert cut.where == "x:1"
    assert truncate(example, 3) is None
    assert truncate(example, 100).ids.tolist() == example.ids.tolist()
    with pytest.raises(BridgeError, match=r"^max_len: must be a positive integer \(got 0\)$"):
        truncate(example, 0)
