"""bridge.hf_tokenizer: the exported tokenizer.json + config, loaded by transformers'
AutoTokenizer, encodes exactly as our Tokenizer.encode(text, bos=True) and decodes back.

Checked token for token on every line of the SST train/dev and CFIMDB train texts (11,352 lines
each for LLaMA 3, LLaMA 2 and a byte-level BPE trained on SST; skipped where ../shared lacks the
files) and on hard strings (runs of spaces, tabs, exotic whitespace, accents, emoji, special-token
text). The same comparison catches transformers' own SentencePiece converter, which cuts runs of
spaces differently."""

import json

import pytest
from conftest import SHARED, TOKENIZER_FILES, real_tokenizer

from bridge.errors import BridgeError
from bridge.hf_tokenizer import generation_config, hf_tokenizer_files
from bridge.tokenizer import ByteTokenizer, train_tokenizer

transformers = pytest.importorskip("transformers")

FILES = TOKENIZER_FILES
DATA = [SHARED / "data" / "sst" / "train.txt", SHARED / "data" / "sst" / "dev.txt",
        SHARED / "data" / "cfimdb" / "train.txt"]
HARD = [
    "", " ", "   ", "Hello world", "  leading and trailing  ", "a" + " " * 17 + "b",
    "end .  The next", "end .    The next", " " * 40 + "x" + " " * 33,
    "\tTabs\tand\nnew\r\nlines\n\n\n x",
    "\x0b\x0c\x1c\x1d\x1e\x1f\x85 odd controls", "nbsp\u00a0em\u2003ideo\u3000space",
    "café naïve Ærøskøbing Gérard señor Zürich", "日本語のテキスト", "emoji 🎉👩‍👩‍👧 mixed",
    "def f(x):\n\treturn x  # tab\r\n", "123456789 1,000.5", "\x00\x01\x7f control",
    "it's THEY'RE we'Ve", "<|eot_id|> <|begin_of_text|> <s> </s> <|bos|> as plain text",
]
CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _corpus() -> list[str]:
    return [line.rstrip("\n").split(" ||| ", 1)[1]
            for path in DATA if path.is_file()
            for line in path.read_text(encoding="utf-8").splitlines() if " ||| " in line]


@pytest.fixture(scope="module")
def corpus():
    return _corpus()


@pytest.fixture(scope="module", params=["llama3", "llama2", "trained", "bytes"])
def pair(request, tmp_path_factory):
    """(our Tokenizer, transformers' tokenizer loaded from the exported files, directory)."""
    kind = request.param
    if kind in FILES:
        ours = real_tokenizer(kind)
    elif kind == "trained":
        texts = _corpus()[:8544] or HARD * 20
        ours = train_tokenizer(texts, vocab_size=1000)
    else:
        ours = ByteTokenizer()
    directory = tmp_path_factory.mktemp(kind)
    hf_tokenizer_files(ours, directory, model_max_length=4096, chat_template=CHAT)
    return ours, transformers.AutoTokenizer.from_pretrained(directory), directory


def _mismatches(ours, hf, texts, **hf_kw) -> tuple[list[str], list[str]]:
    """The texts whose ids differ, and those whose HF decode is not the text (only where our
    own decode round-trips: LLaMA 2 turns a literal "▁" into a space, for one)."""
    theirs = hf(texts, **hf_kw)["input_ids"]
    mine = [ours.encode(t, bos=True) for t in texts]
    decoded = hf.batch_decode(theirs, skip_special_tokens=True)
    bad_ids = [t for t, a, b in zip(texts, mine, theirs) if a != b]
    bad_text = [t for t, d, m in zip(texts, decoded, mine)
                if d != t and ours.decode(m[1:]) == t]
    return bad_ids, bad_text


def test_corpus_encodes_and_decodes_identically(pair, corpus):
    ours, hf, _ = pair
    if not corpus:
        pytest.skip(f"none of {[str(p) for p in DATA]} is there")
    bad_ids, bad_text = _mismatches(ours, hf, corpus)
    print(f"{ours.kind}: {len(corpus)} lines, {len(bad_ids)} id mismatches, "
          f"{len(bad_text)} decode mismatches")
    assert (len(bad_ids), len(bad_text)) == (0, 0), (bad_ids[:3], bad_text[:3])


def test_hard_strings(pair):
    ours, hf, _ = pair
    # split_special_tokens: "<|eot_id|>" in text stays text, as in our encode (see next test)
    assert _mismatches(ours, hf, HARD, split_special_tokens=True) == ([], [])
    assert hf.encode("Hi")[0] == ours.bos_id and ours.eos_id not in hf.encode("Hi")


def test_special_token_text_is_special_by_default_in_transformers(pair):
    ours, hf, _ = pair
    """...as transformers' chat templates need; split_special_tokens=True gives our default."""
    for name in ours.special_tokens:
        text = f"a {name} b"
        assert hf.encode(text) == ours.encode(text, bos=True, allow_special=True)
        assert hf.encode(text, split_special_tokens=True) == ours.encode(text, bos=True)
        assert ours.encode(text, allow_special=True) != ours.encode(text)  # the two differ


def test_config_files(pair):
    ours, hf, directory = pair
    config = json.loads((directory / "tokenizer_config.json").read_text())
    specials = json.loads((directory / "special_tokens_map.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["model_max_length"], config["chat_template"]) == (4096, CHAT)
    assert (config["add_bos_token"], config["add_eos_token"]) == (True, False)
    assert hf.bos_token_id == ours.bos_id and hf.eos_token_id == ours.eos_id
    assert hf.pad_token_id == ours.pad_id
    assert specials == {k: config[k] for k in ("bos_token", "eos_token", "pad_token")
                        if k in config}
    assert hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "x"


def test_generation_config(pair):
    ours, _, _ = pair
    expected = {"llama3": {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
                "llama2": {"bos_token_id": 1, "eos_token_id": [2]},
                "hf": {"bos_token_id": 0, "eos_token_id": [1], "pad_token_id": 2},
                "bytes": {"bos_token_id": 256, "eos_token_id": [257], "pad_token_id": 258}}
    assert generation_config(ours) == expected[ours.kind]


def test_transformers_own_converter_differs_on_runs_of_spaces(tmp_path):
    """The negative case: transformers' LlamaTokenizer built from tokenizer.model ranks the
    merge ▁+▁ first, and so cuts an even run of spaces before a word differently: "a  The" is
    ▁▁ + The to it, ▁ + ▁The to SentencePiece (and our export). The comparisons above would
    catch that (65 of the corpus lines have such a run)."""
    ours = real_tokenizer("llama2")
    (tmp_path / "tokenizer.model").write_bytes(FILES["llama2"].read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "end .  The next"
    assert ours._sp.encode(text, out_type=str)[2:4] == ["▁", "▁The"]
    assert theirs.tokenize(text)[2:4] == ["▁▁", "The"]


def test_a_tokenizer_without_add_bos_exports_without_it(tmp_path):
    """add_bos false (SmolLM2's GGUF, say): no BOS post-processor, add_bos_token false, and
    transformers encodes as ours does without BOS; add_eos true appends EOS in both."""
    ours = train_tokenizer(HARD * 20, vocab_size=400)
    ours.add_bos, ours.add_eos = False, True
    hf_tokenizer_files(ours, tmp_path, model_max_length=64)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["add_bos_token"], config["add_eos_token"]) == (False, True)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in HARD[1:]:
        assert theirs.encode(text, split_special_tokens=True) == ours.encode(text, eos=True)


def test_bad_model_max_length():
    with pytest.raises(BridgeError, match="model_max_length: must be a positive integer"):
        hf_tokenizer_files(ByteTokenizer(), "unused", model_max_length=0)
