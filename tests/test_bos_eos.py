"""BOS and EOS decided as transformers decides them (bridge.tokenizer.bos_eos), checked against
`transformers.AutoTokenizer` on a matrix of tokenizer layouts built here from files on this
machine: LLaMA 2's SentencePiece model as tokenizer.model and as transformers' own converted
tokenizer.json, LLaMA 3's as our HF export writes it, SmolLM2's as transformers saves it from the
GGUF; each with the post-processor changed (BOS on, off, absent; EOS on) and tokenizer_config.json's
add_bos_token / add_eos_token set, unset and contradicting it, and the tokenizer classes that
impose flags of their own.

Every variant encodes held-out text (SST dev, and hard strings) exactly as AutoTokenizer does:
special-token text read as plain text (our default) against `split_special_tokens=True`, and
with `allow_special` against transformers' default. The rules are transformers 5.25.0's (the
version the [test] extra installs here, `TRANSFORMERS_VERSION`); another version may decide
otherwise, and these tests would say where.
"""

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED, TOKENIZER_FILES

from bridge.errors import BridgeError
from bridge.hf_tokenizer import hf_tokenizer_files
from bridge.tokenizer import find_tokenizer, load_tokenizer
from bridge.tokenizer.bos_eos import TRANSFORMERS_VERSION, added_tokens

transformers = pytest.importorskip("transformers")

DEV = SHARED / "data" / "sst" / "dev.txt"
HARD = ["Hello world", "  leading and trailing  ", "end .  The next", "\tTabs\tand\nnew\r\nlines",
        "café naïve 日本語 🎉", "123456789 1,000.5",
        "<|im_start|> <|begin_of_text|> <s> </s> <|endoftext|> as text"]
LAYOUT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "chat_template.jinja")


def _held_out() -> list[str]:
    if not DEV.is_file():
        pytest.skip(f"the SST dev set is not at {DEV}")
    lines = DEV.read_text(encoding="utf-8").splitlines()
    return [line.split(" ||| ", 1)[1] for line in lines[:300] if " ||| " in line] + HARD


def _mismatches(ours, theirs, texts) -> list[str]:
    """The texts that `ours` encodes (with the BOS / EOS it decides to add) other than
    transformers does, in both readings of special-token text."""
    plain = theirs(texts, split_special_tokens=True)["input_ids"]
    special = theirs(texts)["input_ids"]
    return [t for t, a, b in zip(texts, plain, special)
            if ours.encode(t, bos=ours.add_bos, eos=ours.add_eos) != a
            or ours.encode(t, bos=ours.add_bos, eos=ours.add_eos, allow_special=True) != b]


def _template(before: list[tuple[str, int]], after: list[tuple[str, int]]) -> dict:
    """A TemplateProcessing post-processor in tokenizer.json's own JSON form."""
    single = ([{"SpecialToken": {"id": t, "type_id": 0}} for t, _ in before] +
              [{"Sequence": {"id": "A", "type_id": 0}}] +
              [{"SpecialToken": {"id": t, "type_id": 0}} for t, _ in after])
    return {"type": "TemplateProcessing", "single": single,
            "pair": single + [{"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in before + after}}


_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
               "use_regex": True}


def _post_processor(kind: str, bos: tuple[str, int], eos: tuple[str, int]):
    return {"null": None, "off": _template([], []), "bos": _template([bos], []),
            "bos+eos": _template([bos], [eos]), "eos": _template([], [eos]),
            "bytelevel": _BYTE_LEVEL,
            "bytelevel+bos": {"type": "Sequence",
                              "processors": [_BYTE_LEVEL, _template([bos], [])]}}[kind]


KEYS = {"": {}, "bos-key-on": {"add_bos_token": True}, "bos-key-off": {"add_bos_token": False},
        "eos-key-on": {"add_eos_token": True}}


# -- the layouts, built once from files on this machine ------------------------------------------

@pytest.fixture(scope="module")
def layouts() -> dict:
    """name -> (directory with the layout's files, (BOS token, id), (EOS token, id)), filled as
    the tests ask for them (_base)."""
    return {}


def _base(layouts, name, tmp_path_factory, request):
    if name in layouts:
        return layouts[name]
    root = tmp_path_factory.mktemp(name)
    if name in ("llama2", "llama2-converted"):
        if not TOKENIZER_FILES["llama2"].is_file():
            pytest.skip(f"the real llama2 tokenizer is not at {TOKENIZER_FILES['llama2']}")
        shutil.copy(TOKENIZER_FILES["llama2"], root / "tokenizer.model")
        if name == "llama2-converted":  # transformers' own conversion of tokenizer.model
            (root / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
            transformers.AutoTokenizer.from_pretrained(root).save_pretrained(root / "out")
            (root / "tokenizer.model").unlink()
            for f in (root / "out").iterdir():
                shutil.move(f, root / f.name)
        specials = ("<s>", 1), ("</s>", 2)
    elif name == "llama3":  # as our HF export writes it
        if not TOKENIZER_FILES["llama3"].is_file():
            pytest.skip(f"the real llama3 tokenizer is not at {TOKENIZER_FILES['llama3']}")
        hf_tokenizer_files(load_tokenizer(TOKENIZER_FILES["llama3"]), root, model_max_length=8192)
        specials = ("<|begin_of_text|>", 128000), ("<|end_of_text|>", 128001)
    else:  # SmolLM2 as transformers saves it from the GGUF file
        gguf = request.getfixturevalue("smollm2")
        transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name) \
            .save_pretrained(root)
        specials = ("<|im_start|>", 1), ("<|im_end|>", 2)
    layouts[name] = (root, *specials)
    return layouts[name]


def _variant(base, tmp_path, post_processor: str, keys: dict, tokenizer_class: str | None = None):
    """A copy of the base layout with the post-processor ("as saved": kept) and config changed."""
    root, bos, eos = base
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in LAYOUT_FILES:
        if (root / name).is_file():
            shutil.copy(root / name, tmp_path / name)
    if post_processor != "as saved":
        data = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
        data["post_processor"] = _post_processor(post_processor, bos, eos)
        (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config = {k: v for k, v in config.items() if k not in ("add_bos_token", "add_eos_token")}
    config.update(keys)
    if tokenizer_class:
        config["tokenizer_class"] = tokenizer_class
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tmp_path


# The default run takes one variant of each rule and layout (a case costs about 2 s, mostly
# transformers reading tokenizer.json); `pytest -m slow` runs the whole product.
QUICK = {("smollm2", "as saved", ""), ("smollm2", "as saved", "bos-key-on"),
         ("smollm2", "bos", "bos-key-off"), ("smollm2", "null", "eos-key-on"),
         ("smollm2", "bos+eos", ""), ("smollm2", "bytelevel+bos", ""),
         ("llama2-converted", "as saved", ""), ("llama2-converted", "bos", "eos-key-on"),
         ("llama2-converted", "off", "bos-key-on")}


def _cases():
    full = ["as saved", "null", "off", "bos", "bos+eos", "eos"]
    for base in ("smollm2", "llama2-converted"):
        for pp in full + (["bytelevel", "bytelevel+bos"] if base == "smollm2" else []):
            for keys in KEYS:
                marks = () if (base, pp, keys) in QUICK else pytest.mark.slow
                yield pytest.param(base, pp, keys, None, marks=marks)
    for pp, keys in (("as saved", ""), ("off", "bos-key-on")):
        yield "llama3", pp, keys, None  # a 128,256-id vocabulary: two variants
    yield pytest.param("llama3", "as saved", "bos-key-off", None, marks=pytest.mark.slow)
    yield pytest.param("llama3", "bos+eos", "", None, marks=pytest.mark.slow)
    # the Hub's own SmolLM2 layout (a ByteLevel post-processor, GPT2Tokenizer), and the classes
    # whose __init__ imposes flags whatever the files say
    yield "smollm2", "bytelevel", "", "GPT2Tokenizer"
    yield "llama2-converted", "off", "", "CodeLlamaTokenizer"
    yield "smollm2", "bos", "bos-key-on", "GPTNeoXTokenizer"


def _ids(value) -> str:
    return str(value or "-").replace(" ", "-")


@pytest.mark.parametrize("base, post_processor, keys, tokenizer_class", list(_cases()), ids=_ids)
def test_a_tokenizer_json_layout_adds_what_transformers_adds(layouts, tmp_path_factory, request,
                                                             tmp_path, base, post_processor,
                                                             keys, tokenizer_class):
    directory = _variant(_base(layouts, base, tmp_path_factory, request), tmp_path,
                         post_processor, KEYS[keys], tokenizer_class)
    texts = _held_out()
    ours = find_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    bad = _mismatches(ours, theirs, texts)
    assert not bad, (f"transformers {transformers.__version__} (rules from {TRANSFORMERS_VERSION}) "
                     f"encodes {len(bad)} of {len(texts)} texts otherwise; ours: add_bos "
                     f"{ours.add_bos}, add_eos {ours.add_eos} ({ours.decided_by}); first: "
                     f"{bad[0]!r}")


def test_smollm2_as_transformers_saves_it_adds_no_bos(layouts, tmp_path_factory, request):
    """The layout of the issue: bos_token <|im_start|>, no add_bos_token, a template that adds
    nothing. Negative case: the old rule (BOS whenever there is a BOS token) differs from
    transformers on every held-out text, which the comparison above reports."""
    root, _, _ = _base(layouts, "smollm2", tmp_path_factory, request)
    ours, texts = find_tokenizer(root), _held_out()
    assert (ours.bos_id, ours.add_bos, ours.add_eos) == (1, False, False)
    assert ours.decided_by == "tokenizer.json's post-processor adds nothing"
    theirs = transformers.AutoTokenizer.from_pretrained(root)
    ours.add_bos = True  # the old rule
    assert _mismatches(ours, theirs, texts) == texts


def test_a_bare_tokenizer_model_keeps_its_bos_rule(tmp_path):
    """A tokenizer.model alone gets BOS whenever its vocabulary has one (Meta's reference
    encoding, and transformers 4's LlamaTokenizer default); transformers 5.25 converts it without
    BOS. The departure, shown; the text between is the same."""
    if not TOKENIZER_FILES["llama2"].is_file():
        pytest.skip(f"the real llama2 tokenizer is not at {TOKENIZER_FILES['llama2']}")
    shutil.copy(TOKENIZER_FILES["llama2"], tmp_path / "tokenizer.model")
    ours = find_tokenizer(tmp_path)
    assert (ours.add_bos, ours.add_eos) == (True, False)
    assert ours.decided_by == "the rule for a tokenizer.model: BOS whenever the vocabulary has one"
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.encode("Hello world", bos=ours.add_bos) == [1] + theirs("Hello world").input_ids


@pytest.mark.parametrize("keys", [{"add_bos_token": True}, {"add_bos_token": False},
                                  {"add_eos_token": True},
                                  {"add_bos_token": True, "add_eos_token": True}], ids=str)
def test_a_tokenizer_model_with_config_keys_adds_what_transformers_adds(tmp_path, keys):
    """Beside a tokenizer.model (no tokenizer.json) transformers reads the keys, the missing one
    as false; so do we. Compared on SST dev lines: transformers' own SentencePiece conversion
    differs from SentencePiece on runs of spaces (test_hf_tokenizer.py), which these lack."""
    if not TOKENIZER_FILES["llama2"].is_file():
        pytest.skip(f"the real llama2 tokenizer is not at {TOKENIZER_FILES['llama2']}")
    shutil.copy(TOKENIZER_FILES["llama2"], tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", **keys}))
    ours = find_tokenizer(tmp_path)
    assert (ours.add_bos, ours.add_eos) == (keys.get("add_bos_token", False),
                                            keys.get("add_eos_token", False))
    texts = [t for t in _held_out() if "  " not in t and not t.startswith(" ")
             and "<" not in t]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert [ours.encode(t, bos=ours.add_bos, eos=ours.add_eos) for t in texts] == \
        theirs(texts)["input_ids"]


def test_exports_write_the_decision_as_transformers_reads_it(layouts, tmp_path_factory, request,
                                                             tmp_path):
    """A native save and an HF export of the SmolLM2 tokenizer (no BOS), and of the same one told
    to add BOS and EOS: each reads back the same, here and in transformers (a round trip changes
    nothing)."""
    root, _, _ = _base(layouts, "smollm2", tmp_path_factory, request)
    texts = _held_out()[:50]
    for add in ((False, False), (True, True)):
        ours = find_tokenizer(root)
        ours.add_bos, ours.add_eos = add
        for how, out in (("native", tmp_path / f"native-{add}"), ("hf", tmp_path / f"hf-{add}")):
            if how == "native":
                ours.save(out)
            else:
                hf_tokenizer_files(ours, out, model_max_length=8192)
            again = find_tokenizer(out)
            assert (again.add_bos, again.add_eos) == add, (how, again.decided_by)
            assert not _mismatches(again, transformers.AutoTokenizer.from_pretrained(out), texts)
            if add == (False, False) and how == "native":  # the post-processor kept as it was
                assert json.loads((out / "tokenizer.json").read_text())["post_processor"] == \
                    json.loads((root / "tokenizer.json").read_text())["post_processor"]


def test_tokenizer_model_saves_carry_the_decision(tmp_path):
    """A tokenizer.model kind told not to add BOS (a GGUF SentencePiece vocabulary whose
    add_bos_token is false, say) writes tokenizer_config.json beside it, so it reads back so."""
    if not TOKENIZER_FILES["llama2"].is_file():
        pytest.skip(f"the real llama2 tokenizer is not at {TOKENIZER_FILES['llama2']}")
    ours = load_tokenizer(TOKENIZER_FILES["llama2"])
    ours.add_bos = False
    ours.save(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "add_eos_token": False}
    again = find_tokenizer(tmp_path)
    assert (again.add_bos, again.decided_by) == (
        False, "tokenizer_config.json: add_bos_token false, add_eos_token false")


@pytest.mark.parametrize("processor, says", [
    ({"type": "Sequence", "processors": [_template([("<s>", 1)], []), _template([("<s>", 1)], [])]},
     "a Sequence of 2 processors that each add tokens"),
    ({"type": "Split"}, "a Split post-processor, not one this project reads"),
    (_template([("<s>", 1), ("<s>", 1)], []), r"puts \['<s>', '<s>'\] before each text"),
    (_template([], [("<s>", 1)]), r"puts \['<s>'\] after each text, but the eos_token is 2"),
])
def test_post_processors_this_project_cannot_follow_are_refused(processor, says):
    from bridge.tokenizer import bos_eos_as_transformers

    with pytest.raises(BridgeError, match=says):
        bos_eos_as_transformers({}, 1, 2, tokenizer_json=True, post_processor=processor,
                                names={1: "<s>"}, where="x/tokenizer.json")


def test_added_tokens_reads_every_kind():
    assert added_tokens(None, "t") == ([], [])
    assert added_tokens(_BYTE_LEVEL, "t") == ([], [])
    assert added_tokens({"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0]},
                        "t") == ([0], [2])
    assert added_tokens(_post_processor("bytelevel+bos", ("<s>", 1), ("</s>", 2)), "t") == ([1], [])
    assert added_tokens(_template([("<s>", 1)], [("</s>", 2)]), "t") == ([1], [2])


def test_inspect_shows_the_decision_and_where_it_came_from(layouts, tmp_path_factory, request,
                                                            tmp_path, capsys):
    """A random model with SmolLM2's tokenizer as transformers saves it, then the same files
    with add_bos_token true stamped in as the old rule did: inspect says no BOS, and why."""
    from conftest import save_random_checkpoint, small_config
    from llama_twins.cli import bridge_main as bridge_cli

    ckpt = save_random_checkpoint(tmp_path / "ckpt", small_config(vocab_size=49152))
    _variant(_base(layouts, "smollm2", tmp_path_factory, request), ckpt, "as saved", {})
    assert bridge_cli.main(["inspect", str(ckpt), "--no-scan"]) == 0
    assert ("  tokenizer   hf, 49,152 ids; bos <|im_start|> not added, eos <|im_end|> not added: "
            "tokenizer.json's post-processor adds nothing\n") in capsys.readouterr().out
    _variant(_base(layouts, "smollm2", tmp_path_factory, request), ckpt, "as saved",
             {"add_bos_token": True})
    assert bridge_cli.main(["inspect", str(ckpt), "--no-scan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokenizer"] == {
        "kind": "hf", "vocab_size": 49152, "bos": "<|im_start|>", "eos": "<|im_end|>",
        "add_bos": False, "add_eos": False,
        "decided_by": "tokenizer.json's post-processor adds nothing (tokenizer_config.json's "
                      "add_bos_token true is not read where there is a tokenizer.json, by "
                      "transformers 5 nor here)"}


# -- every path that encodes plain text, and the issue's figures end to end -----------------------

def test_every_plain_text_path_adds_what_transformers_adds(layouts, tmp_path_factory, request,
                                                           tmp_path):
    """With SmolLM2's tokenizer as transformers saves it (no BOS) and with a variant whose
    post-processor adds BOS: training text, classifier rows, zero-shot prompts, plain-text
    preference pairs, eval documents and generate's prompts all open as AutoTokenizer's ids do,
    and each EOS a path appends on purpose (a document's end, a classifier's last token, a
    completion's end) stays."""
    from tasks.classification import encode_texts
    from tasks.evaluation import Text, tokenize
    from tasks.preference import encode_pair
    from tasks.prompts import encode_prompts
    from jax_llama.classify import zero_shot_rows
    from jax_llama.training.data import tokenize_corpus

    base = _base(layouts, "smollm2", tmp_path_factory, request)
    text, more = "the film was good", " and the cast fine"
    (tmp_path / "doc.txt").write_text(text)
    for post_processor in ("as saved", "bos"):
        directory = _variant(base, tmp_path / post_processor, post_processor, {})
        tok = find_tokenizer(directory)
        theirs = transformers.AutoTokenizer.from_pretrained(directory)
        ids, whole, eos = theirs(text).input_ids, theirs(text + more).input_ids, [tok.eos_id]
        assert (ids[0] == tok.bos_id) == (post_processor == "bos")  # the variants differ
        corpus = tokenize_corpus([tmp_path / "doc.txt"], tok, tmp_path / f"cache-{post_processor}")
        assert corpus.tolist() == ids + eos
        assert encode_texts(tok, [text], 64)[0] == [ids + eos]
        assert zero_shot_rows(tok, [text], ["good"], "{text}", 64)[0] == [ids]
        pair = encode_pair({"prompt": text, "chosen": more, "rejected": " and bad"}, "x", tok, None)
        assert pair.prompt.tolist() + pair.chosen.tolist() == whole + eos
        (doc,) = tokenize([Text("t.txt", "t.txt", text)], tok)
        assert doc.ids.tolist() == ids
        assert encode_prompts(tok, [text], 256) == [ids]


@pytest.mark.slow
def test_smollm2_as_a_hugging_face_directory_scores_as_transformers(smollm2, tmp_path):
    """The issue's figures after the fix: SmolLM2 converted to a Hugging Face directory with its
    tokenizer as transformers saves it. The server's echo log-probs on one sentence and
    `jax-llama eval` on SST dev text equal transformers' on the same directory: the same count of
    tokens, sums within rtol 1e-4 (the issue's bound; float32 over 30 layers in other orders
    measured ~1e-6). With the old rule the server scored a BOS more: a sum 35% lower."""
    import importlib.util

    import httpx
    import torch

    import jax_llama
    from bridge.chat import find_template
    from bridge.convert import convert
    from jax_llama.inference.serving import Engine
    from llama_twins.cli import main as jax_cli
    from llama_twins.server import Server, serve_in_thread

    directory = tmp_path / "hf"
    convert(smollm2, directory, to="hf")
    transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name) \
        .save_pretrained(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                                 dtype=torch.float32).eval()

    sentence = "The moon orbits the Earth once a month."
    tok = find_tokenizer(directory)
    model, params = jax_llama.load(directory)
    server = Server(Engine(model, params, max_batch=1), model, params, tok,
                    find_template(str(directory), tok, None), "smollm2", None)
    url, stop = serve_in_thread(server)
    try:
        echo = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": "smollm2", "prompt": sentence, "echo": True, "max_tokens": 0,
            "logprobs": 1}).json()["choices"][0]["logprobs"]["token_logprobs"]
    finally:
        stop()
    ids = theirs(sentence, return_tensors="pt").input_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(ids).logits[0], -1)
    expected = [float(logp[i, ids[0, i + 1]]) for i in range(ids.shape[1] - 1)]
    assert len(echo) == ids.shape[1] and echo[0] is None
    np.testing.assert_allclose(sum(echo[1:]), sum(expected), rtol=1e-4, atol=0)

    lines = DEV.read_text(encoding="utf-8").splitlines()[:100] if DEV.is_file() else HARD * 20
    data = tmp_path / "dev.txt"
    data.write_text("\n".join(line.split(" ||| ", 1)[-1] for line in lines) + "\n")
    spec = importlib.util.spec_from_file_location(
        "eval_transformers", Path(__file__).resolve().parents[1] / "scripts" / "eval_transformers.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    ids = theirs(data.read_text(), return_tensors="pt").input_ids
    nll, n_tokens = reference.guide_nll(hf_model, ids, 256, 128)
    out = tmp_path / "eval.json"
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        assert jax_cli.main(["eval", str(directory), "--data", str(data), "--seq-len", "256",
                             "--stride", "128", "--json"]) == 0
    report = json.loads(out.read_text())
    assert (report["bos"], report["tokens"]) == (False, n_tokens)
    np.testing.assert_allclose(report["nll_per_token"], nll / n_tokens, rtol=1e-4, atol=0)
