"""`llama-bridge compare`'s framework-neutral sections (issue 80): the config by meaning, the
tokenizer and its BOS/EOS decisions, the chat template.

Faithful pairs are SmolLM2's GGUF against its own conversions (HF, native, a float32 GGUF written
from the HF export): every section the same. Each planted bug is a copy of the HF export with one
file edited (the weights hard-linked, not copied) and must come back DIFFERENT, its cause naming
what was changed; the faithful copy beside each is the negative case.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import real_tokenizer

from bridge.compare import DIFFERENT, SAME, SKIPPED
from bridge.compare.config import compare_config
from bridge.compare.template import CONVERSATION, compare_templates
from bridge.compare.tokenizer import PROBES, compare_tokenizers
from bridge.config import LlamaConfig
from bridge.convert import convert
from bridge.formats import open_checkpoint

TEXT = ("The quick brown fox jumps over the lazy dog in 1987, doesn't it?\n\n"
        "  Indented code: x = f(42)  # naïve café 東京\n") * 8


@pytest.fixture(scope="module")
def exports(smollm2, tmp_path_factory) -> dict[str, Path]:
    """SmolLM2's GGUF and its conversions: hf (bfloat16), native (from hf), f32.gguf (from hf)."""
    root = tmp_path_factory.mktemp("compare_sections")
    hf = convert(smollm2, root / "hf", "hf", dtype="bfloat16", progress=False)
    native = convert(hf, root / "native", "native", progress=False)
    f32 = convert(hf, root / "gguf" / "f32.gguf", "gguf", dtype="float32", progress=False)
    return {"gguf": smollm2, "hf": hf, "native": native, "f32.gguf": f32}


def planted(exports: dict[str, Path], tmp_path: Path, name: str = "planted") -> Path:
    """A copy of the HF export whose small files are copies (to be edited) and whose weights are
    a hard link (a symbolic one would be refused as a link outside the checkpoint)."""
    out = tmp_path / name
    out.mkdir()
    for f in exports["hf"].iterdir():
        if f.suffix == ".safetensors":
            os.link(f, out / f.name)
        else:
            shutil.copy(f, out / f.name)
    return out


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def sections(a: Path, b: Path):
    ca, cb = open_checkpoint(a), open_checkpoint(b)
    return compare_config(ca, cb), compare_tokenizers(ca, cb, TEXT), compare_templates(ca, cb)


# -- faithful pairs ------------------------------------------------------------------------------

@pytest.mark.parametrize("other", ["hf", "native", "f32.gguf"])
def test_smollm2_against_its_conversions_is_the_same_in_every_section(exports, other):
    config, tokenizer, template = sections(exports["gguf"], exports[other])
    assert [f.verdict for f in (config, tokenizer, template)] == [SAME, SAME, SAME], \
        [(f.section, f.cause) for f in (config, tokenizer, template)]
    assert config.figures["differs"] == [] and config.figures["b"]["rope_theta"] == 100000.0
    assert tokenizer.figures["text_tokens"][0] == tokenizer.figures["text_tokens"][1] > 100
    assert tokenizer.figures["probes_differing"] == 0
    assert template.figures["same_source"]
    assert template.figures["conversation"]["first_difference"] is None
    assert all(f.cause is None for f in (config, tokenizer, template))


# -- the config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, field, check", [
    ("rope_theta", 10000.0, "rope_theta", "PR #8676"),
    ("rms_norm_eps", 1e-6, "norm_eps", "a library's default"),
])
def test_a_changed_config_field_is_named_with_both_values(exports, tmp_path, key, value, field,
                                                          check):
    b = planted(exports, tmp_path)
    edit_json(b / "config.json", lambda c: c.update({key: value}))
    a = open_checkpoint(exports["hf"])
    found = compare_config(a, open_checkpoint(b))
    assert found.verdict == DIFFERENT
    assert found.cause == f"config: {field} {getattr(a.config, field)} in A, {value} in B"
    assert check in found.check_next
    assert [d["field"] for d in found.figures["differs"]] == [field]
    faithful = planted(exports, tmp_path, "faithful")
    assert compare_config(a, open_checkpoint(faithful)).verdict == SAME


def changed(checkpoint, **fields):
    """A stand-in for an opened checkpoint whose config has `fields` changed (a config the weights
    would not open with: the comparison reads only the config)."""
    return type("Opened", (), {"config": checkpoint.config.replace(**fields)})()


@pytest.mark.parametrize("fields, cause, check", [
    ({"tie_embeddings": False}, "config: tie_embeddings True in A, False in B", "#12567"),
    ({"n_kv_heads": 9}, "config: n_kv_heads 3 in A, 9 in B", "head_count_kv"),
    ({"sliding_window": 4096}, "config: sliding_window none in A, 4096 in B", "sliding window"),
])
def test_a_changed_head_or_window_is_named(exports, fields, cause, check):
    found = compare_config(open_checkpoint(exports["hf"]), changed(
        open_checkpoint(exports["hf"]), **fields))
    assert (found.verdict, found.cause) == (DIFFERENT, cause)
    assert check in found.check_next


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_rope_scaling_dropped_or_changed_is_named(exports, tmp_path):
    scaled = planted(exports, tmp_path, "scaled")
    edit_json(scaled / "config.json", lambda c: c.update(rope_scaling=LLAMA3_SCALING))
    stretched = planted(exports, tmp_path, "stretched")
    edit_json(stretched / "config.json",
              lambda c: c.update(rope_scaling=dict(LLAMA3_SCALING, factor=32.0)))
    a = open_checkpoint(scaled)
    dropped = compare_config(a, open_checkpoint(exports["hf"]))
    assert dropped.verdict == DIFFERENT
    assert dropped.cause.startswith("config: rope_scaling llama3 (factor 8.0, low_freq_factor 1.0")
    assert dropped.cause.endswith("in A, none in B")
    assert "ik_llama.cpp #2291" in dropped.check_next
    changed = compare_config(a, open_checkpoint(stretched))
    assert changed.cause == "config: rope_scaling.factor 8.0 in A, 32.0 in B"
    assert compare_config(a, open_checkpoint(scaled)).verdict == SAME  # negative case


def test_a_window_no_shorter_than_the_context_is_not_a_difference(exports):
    a = open_checkpoint(exports["hf"])
    found = compare_config(a, changed(a, sliding_window=8192))
    assert found.verdict == SAME
    assert "sliding_window: none in A, 8192 in B; not a difference" in "\n".join(found.lines)


def test_family_max_seq_len_and_special_ids_are_shown_not_judged(exports):
    a = open_checkpoint(exports["hf"])
    b = changed(a, family="mistral", max_seq_len=2048, bos_id=0)
    found = compare_config(a, b)
    assert found.verdict == SAME
    text = "\n".join(found.lines)
    assert "family: llama in A, mistral in B; the same decoder" in text
    assert "max_seq_len: 8192 in A, 2048 in B; shown, not judged" in text
    assert "bos_id: 1 in A, 0 in B" in text
    # a family whose delta differs is named beside the field
    qwen = changed(a, family="qwen2", qkv_bias=True)
    found = compare_config(a, qwen)
    assert found.cause == "config: qkv_bias False in A, True in B (llama in A, qwen2 in B)"


def test_float32_rounding_of_a_field_is_not_a_difference(exports):
    a = open_checkpoint(exports["hf"])
    b = changed(a, norm_eps=float(np.float32(1e-5)))
    assert b.config.norm_eps != a.config.norm_eps
    assert compare_config(a, b).verdict == SAME


# -- the tokenizer -------------------------------------------------------------------------------

def _set_pre_tokenizer(tokenizer_json: dict, change) -> None:
    change(tokenizer_json["pre_tokenizer"]["pretokenizers"])


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_another_pre_tokenizer_is_named_with_the_text_around_it(exports, tmp_path):
    b = planted(exports, tmp_path)
    # LLaMA 3's split (llama.cpp's llama-bpe) written where SmolLM2's belongs
    edit_json(b / "tokenizer.json", lambda t: _set_pre_tokenizer(
        t, lambda ps: ps[1]["pattern"].update(Regex=LLAMA3_SPLIT)))
    found = compare_tokenizers(open_checkpoint(exports["gguf"]), open_checkpoint(b), TEXT)
    assert found.verdict == DIFFERENT
    # SmolLM2 keeps the space before a word with the newlines; LLaMA 3's split gives it alone
    assert found.cause == ("tokenizer: the pre-tokenizer differs: the text's ids part at "
                           "position 20: \"'t\" ' it' '?' "
                           "['\\n\\n '] ' Ind' 'ented' ' code' in A, \"'t\" ' it' '?' "
                           "['\\n\\n'] ' ' ' Ind' 'ented' in B")
    assert "llama.cpp #7724" in found.check_next
    assert any(line.startswith("tokenizer.json's pre_tokenizer is written differently")
               for line in found.lines)


def test_a_pre_tokenizer_rewritten_but_splitting_alike_is_the_same(exports, tmp_path):
    b = planted(exports, tmp_path)
    # the same pre-tokenizer inside a Sequence of one: another form, the same splits
    edit_json(b / "tokenizer.json", lambda t: t.update(pre_tokenizer={
        "type": "Sequence", "pretokenizers": [t["pre_tokenizer"]]}))
    found = compare_tokenizers(open_checkpoint(exports["gguf"]), open_checkpoint(b), TEXT)
    assert found.verdict == SAME
    assert any(line.startswith("tokenizer.json's pre_tokenizer is written differently")
               for line in found.lines)


def test_a_prefix_space_added_is_named(exports, tmp_path):
    b = planted(exports, tmp_path)
    edit_json(b / "tokenizer.json", lambda t: _set_pre_tokenizer(
        t, lambda ps: ps.__setitem__(-1, dict(ps[-1], add_prefix_space=True))))
    found = compare_tokenizers(open_checkpoint(exports["hf"]), open_checkpoint(b), TEXT)
    assert found.cause == "tokenizer: a prefix space is added to a text's first word in B only"
    assert "ollama #17698" in found.check_next


def test_a_token_added_or_renamed_is_named(exports, tmp_path):
    added = planted(exports, tmp_path, "added")
    edit_json(added / "tokenizer.json", lambda t: t["added_tokens"].append(
        {"id": 49152, "content": "<|tool|>", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}))
    a = open_checkpoint(exports["hf"])
    found = compare_tokenizers(a, open_checkpoint(added), TEXT)
    assert found.cause == "tokenizer: a vocabulary of 49152 ids in A, 49153 in B"
    swapped = planted(exports, tmp_path, "swapped")

    def swap(t):  # two tokens trade ids: the vocabulary's size is kept, its order is not
        vocab = t["model"]["vocab"]
        vocab["Ġthe"], vocab["Ġof"] = vocab["Ġof"], vocab["Ġthe"]
    edit_json(swapped / "tokenizer.json", swap)
    found = compare_tokenizers(a, open_checkpoint(swapped), TEXT)
    assert found.verdict == DIFFERENT
    vocab = json.loads((exports["hf"] / "tokenizer.json").read_text(encoding="utf-8"))
    first = min(vocab["model"]["vocab"]["Ġthe"], vocab["model"]["vocab"]["Ġof"])
    a_name, b_name = (("Ġthe", "Ġof") if first == vocab["model"]["vocab"]["Ġthe"]
                      else ("Ġof", "Ġthe"))
    assert found.cause == f"tokenizer: token {first} is {a_name!r} in A, {b_name!r} in B"
    assert found.figures["text_tokens"][0] == found.figures["text_tokens"][1]


def test_bos_added_in_one_only_is_named_for_hf_and_gguf(exports, tmp_path):
    b = planted(exports, tmp_path)
    edit_json(b / "tokenizer.json", lambda t: t.update(post_processor={
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|im_start|>",
                                                                   "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                            "tokens": ["<|im_start|>"]}}}))
    hf = compare_tokenizers(open_checkpoint(exports["gguf"]), open_checkpoint(b), TEXT)
    assert hf.verdict == DIFFERENT
    assert hf.cause.startswith("tokenizer: BOS is not added to a text in A (the GGUF file's "
                               "tokenizer.ggml.add_bos_token")
    assert "added in B (tokenizer.json's post-processor adds <|im_start|> $A" in hf.cause
    assert "PR #7332" in hf.check_next
    assert hf.figures["add_bos"] == [False, True]
    # SmolLM2's template opens with <|im_start|> itself: B would give it twice to a caller that
    # encodes a rendering as a text; the template section says so, for B only
    template = compare_templates(open_checkpoint(exports["gguf"]), open_checkpoint(b))
    assert template.verdict == SAME
    assert [line[:2] for line in template.lines if "gets BOS twice" in line] == ["B'"]


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Path:
    """A one-layer native checkpoint with LLaMA 2's tokenizer.model beside it (BOS added: the
    rule for a tokenizer.model, written as add_bos_token true)."""
    from bridge.formats import write_checkpoint
    from bridge.tensors import canonical_shapes

    tokenizer = real_tokenizer("llama2")
    config = LlamaConfig(dim=48, n_layers=1, n_heads=6, n_kv_heads=2, ffn_dim=64,
                         vocab_size=tokenizer.vocab_size, max_seq_len=64, rope_theta=10000.0)
    shapes, rng = canonical_shapes(config), np.random.default_rng(0)
    path = write_checkpoint("native", tmp_path_factory.mktemp("sp") / "native", config,
                            {name: (shape, np.dtype(np.float32)) for name, shape in shapes.items()},
                            lambda name: rng.standard_normal(shapes[name], dtype=np.float32))
    tokenizer.save(path)
    return path


def test_a_sentencepiece_tokenizer_and_its_gguf_and_a_flipped_bos(sentencepiece, tmp_path):
    gguf = convert(sentencepiece, tmp_path / "sp.gguf", "gguf", progress=False)
    a = open_checkpoint(sentencepiece)
    same = compare_tokenizers(a, open_checkpoint(gguf), TEXT)
    assert same.verdict == SAME, same.cause
    assert same.figures["add_bos"] == [True, True] and same.lines[1].startswith("B: a llama2")
    # add_bos_token false beside the tokenizer.model: BOS is no longer added
    flipped = tmp_path / "flipped"
    shutil.copytree(sentencepiece, flipped)
    edit_json(flipped / "tokenizer_config.json", lambda c: c.update(add_bos_token=False))
    found = compare_tokenizers(a, open_checkpoint(flipped), TEXT)
    assert found.cause == ("tokenizer: BOS is added to a text in A (tokenizer_config.json: "
                           "add_bos_token true, add_eos_token false), not added in B "
                           "(tokenizer_config.json: add_bos_token false, add_eos_token false)")
    assert found.figures["text_first_difference"] == 0
    # and the same decision carried into a GGUF: its tokenizer.ggml.add_bos_token false
    flipped_gguf = convert(flipped, tmp_path / "flipped.gguf", "gguf", progress=False)
    found = compare_tokenizers(open_checkpoint(gguf), open_checkpoint(flipped_gguf), TEXT)
    assert found.cause.startswith("tokenizer: BOS is added to a text in A (the GGUF file's "
                                  "tokenizer.ggml.add_bos_token")
    assert "not added in B (the GGUF file's tokenizer.ggml.add_bos_token" in found.cause


def test_a_flipped_add_bos_token_key_is_named_though_the_post_processors_agree(exports,
                                                                              tmp_path):
    b = planted(exports, tmp_path)
    edit_json(b / "tokenizer_config.json", lambda c: c.update(add_bos_token=True))
    found = compare_tokenizers(open_checkpoint(exports["gguf"]), open_checkpoint(b), TEXT)
    assert found.verdict == DIFFERENT
    assert found.cause == ("tokenizer: tokenizer_config.json's add_bos_token is false in A, true "
                           "in B (the post-processors agree: BOS not added)")
    assert "llama.cpp's converter" in found.check_next
    assert found.figures["add_bos"] == [False, False]  # what transformers 5 and we add: the same


def test_a_normalizer_added_is_caught_by_the_probes(exports, tmp_path):
    b = planted(exports, tmp_path)
    edit_json(b / "tokenizer.json", lambda t: t.update(normalizer={"type": "NFKC"}))
    found = compare_tokenizers(open_checkpoint(exports["hf"]), open_checkpoint(b), TEXT)
    assert found.verdict == DIFFERENT
    assert found.cause == ("tokenizer: the normalizer differs: the probe 'ﬁne ＡＢＣ x² ½ Ⅻ' "
                           "splits differently from token 0")
    assert any(line.startswith("tokenizer.json's normalizer is written differently")
               for line in found.lines)


def test_a_changed_eos_token_is_named(exports, tmp_path):
    b = planted(exports, tmp_path)
    edit_json(b / "tokenizer_config.json", lambda c: c.update(eos_token="<|endoftext|>"))
    found = compare_tokenizers(open_checkpoint(exports["gguf"]), open_checkpoint(b), TEXT)
    assert found.cause == "tokenizer: EOS token 2 '<|im_end|>' in A, 0 '<|endoftext|>' in B"
    # llama.cpp's rule stops at both either way (<|endoftext|> by its name): shown, not a cause
    assert set(found.figures["stop_ids"][0]) == set(found.figures["stop_ids"][1]) == {0, 2, 4}
    assert "a generation stops at 2 '<|im_end|>', 0 '<|endoftext|>', 4 '<reponame>'" in found.lines


@pytest.mark.slow  # 11 s: SmolLM2's file rewritten twice through gguf's reader and writer
def test_an_eos_id_rewritten_in_a_gguf_is_named(exports, tmp_path):
    """The GGUF side alone: tokenizer.ggml.eos_token_id rewritten (what a converter that takes
    the EOS from the wrong config writes); the weights, vocabulary and template are the file's."""
    import gguf

    from test_gguf import rewrite

    def eos(writer):
        writer.add_uint32("tokenizer.ggml.eos_token_id", 4)
    b = rewrite(exports["gguf"], tmp_path / "eos.gguf", drop="tokenizer.ggml.eos_token_id",
                add=eos)
    assert gguf.GGUFReader(b).fields["tokenizer.ggml.eos_token_id"].contents() == 4
    found = compare_tokenizers(open_checkpoint(exports["gguf"]), open_checkpoint(b), TEXT)
    assert found.verdict == DIFFERENT
    assert found.cause == "tokenizer: EOS token 2 '<|im_end|>' in A, 4 '<reponame>' in B"
    # negative: the same rewrite keeping the id is the same file to the tokenizer section
    same = rewrite(exports["gguf"], tmp_path / "same.gguf")
    assert compare_tokenizers(open_checkpoint(exports["gguf"]), open_checkpoint(same),
                              TEXT).verdict == SAME


def test_a_checkpoint_without_a_tokenizer_is_skipped(exports, tmp_path):
    b = planted(exports, tmp_path)
    (b / "tokenizer.json").unlink()
    found = compare_tokenizers(open_checkpoint(exports["hf"]), open_checkpoint(b), TEXT)
    assert found.verdict == SKIPPED and found.summary == "no tokenizer in B: nothing to compare"
    assert found.lines[1].startswith("B: no tokenizer: no tokenizer.json or tokenizer.model")


def test_the_probes_start_texts_afresh_and_reach_the_pre_tokenizers_cases():
    assert any(p[0] == " " for p in PROBES) and any(p[0] != " " for p in PROBES)
    assert any(any(c.isdigit() for c in p) for p in PROBES) and any("'" in p for p in PROBES)


# -- the chat template ---------------------------------------------------------------------------

def test_a_retyped_template_is_named_at_its_first_differing_character(exports, tmp_path):
    b = planted(exports, tmp_path)
    source = (b / "chat_template.jinja").read_text(encoding="utf-8")
    retyped = source.replace("message['role'] + '\n'", "message['role'] + ' '")  # one character
    assert retyped != source and len(retyped) == len(source)
    (b / "chat_template.jinja").write_text(retyped, encoding="utf-8")
    found = compare_templates(open_checkpoint(exports["gguf"]), open_checkpoint(b))
    assert found.verdict == DIFFERENT
    at = len("<|im_start|>" + CONVERSATION[0]["role"])
    assert found.cause.startswith(f"template: the whole conversation renders differently from "
                                  f"character {at}: ")
    assert "re-typed" in found.check_next
    assert found.figures["prompt"]["first_difference"] == at


def test_a_retyped_default_system_prompt_is_found_without_a_system_turn(exports, tmp_path):
    b = planted(exports, tmp_path)
    source = (b / "chat_template.jinja").read_text(encoding="utf-8")
    (b / "chat_template.jinja").write_text(source.replace("named SmolLM", "named SmolLm"),
                                           encoding="utf-8")
    found = compare_templates(open_checkpoint(exports["gguf"]), open_checkpoint(b))
    at = len("<|im_start|>system\nYou are a helpful AI assistant named SmolL")
    assert found.cause.startswith(f"template: the conversation without its system turn renders "
                                  f"differently from character {at}: ")
    assert found.figures["conversation"]["first_difference"] is None  # a system turn hides it
    assert found.figures["no_system_prompt"]["first_difference"] == at


def test_a_template_written_differently_but_rendering_alike_is_the_same(exports, tmp_path):
    b = planted(exports, tmp_path)
    source = (b / "chat_template.jinja").read_text(encoding="utf-8")
    (b / "chat_template.jinja").write_text("{#- SmolLM2 -#}" + source, encoding="utf-8")
    found = compare_templates(open_checkpoint(exports["gguf"]), open_checkpoint(b))
    assert found.verdict == SAME and not found.figures["same_source"]
    assert any(line.startswith("the template texts differ from character 1 ") and
               line.endswith("but render these conversations alike: not judged")
               for line in found.lines)


def test_a_dropped_template_is_a_difference_and_none_on_both_sides_is_skipped(exports, tmp_path):
    b = planted(exports, tmp_path)
    (b / "chat_template.jinja").unlink()
    edit_json(b / "tokenizer_config.json", lambda c: c.pop("chat_template", None))
    found = compare_templates(open_checkpoint(exports["gguf"]), open_checkpoint(b))
    assert (found.verdict, found.cause) == (DIFFERENT, "template: chat template missing in B")
    ckpt = open_checkpoint(b)
    assert compare_templates(ckpt, ckpt).verdict == SKIPPED
    # the template kept only in tokenizer_config.json renders the same
    kept = planted(exports, tmp_path, "kept")
    (kept / "chat_template.jinja").unlink()
    assert compare_templates(open_checkpoint(exports["gguf"]),
                             open_checkpoint(kept)).verdict == SAME
