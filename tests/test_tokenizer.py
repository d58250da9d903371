"""bridge.tokenizer: known ids from the real LLaMA 2 / 3 tokenizers (skipped without ../shared),
round trips on any text (hypothesis), detection by content and its refusals, and training a
byte-level BPE."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.errors import BridgeError
from conftest import TOKENIZER_FILES
from bridge.tokenizer.bos_eos import added_tokens, post_processor_json
from bridge.tokenizer import (ByteTokenizer, _split_long_runs, detect_tokenizer_kind,
                              load_tokenizer, train_tokenizer)

LLAMA3_FILE, LLAMA2_FILE = TOKENIZER_FILES["llama3"], TOKENIZER_FILES["llama2"]
needs_llama3 = pytest.mark.skipif(not LLAMA3_FILE.is_file(),
                                  reason=f"the real LLaMA 3 tokenizer is not at {LLAMA3_FILE}")
needs_llama2 = pytest.mark.skipif(not LLAMA2_FILE.is_file(),
                                  reason=f"the real LLaMA 2 tokenizer is not at {LLAMA2_FILE}")

VARIED = [
    "", "Hello world", "  leading and trailing  ", "café naïve Ærøskøbing", "日本語のテキスト",
    "emoji 🎉👩‍👩‍👧 mixed", "def f(x):\n\treturn x  # tab\r\n", " " * 3000 + "x" + "\n" * 50,
    "<|eot_id|> <|bos|> <s> look like specials", "123456789 1,000.5", "\x00\x01\x7f control",
]
SENTENCES = ["Hello world", "The quick brown fox jumps over the lazy dog.",
             "It's a truly, madly, deeply moving film -- see it!", "Ünïcödé and 日本語 too.",
             "Numbers like 3.14159 and 2024 stay."]
CORPUS = [f"{w} the {w}s were {n} in number, said {name}. Ça va? 日本 {n * 7}\n"
          for n, (w, name) in enumerate([("cat", "Ann"), ("dog", "Bob"), ("bird", "Cé"),
                                         ("fish", "Dee")] * 30)]
FAST = settings(max_examples=150, deadline=None)


@pytest.fixture(scope="module")
def trained():
    return train_tokenizer(CORPUS, vocab_size=300)


# -- LLaMA 3 -------------------------------------------------------------------------------------

def test_llama3_known_ids(llama3):
    assert llama3.kind == "llama3" and llama3.vocab_size == 128256
    assert llama3.encode("Hello world") == [9906, 1917]
    assert llama3.encode("Hello world", bos=True) == [128000, 9906, 1917]
    assert llama3.encode("Hello world", bos=True, eos=True) == [128000, 9906, 1917, 128001]
    assert (llama3.bos_id, llama3.eos_id, llama3.pad_id) == (128000, 128001, None)
    assert sorted(llama3.stop_ids) == [128001, 128008, 128009]
    specials = llama3.special_tokens
    assert len(specials) == 256 and sorted(specials.values()) == list(range(128000, 128256))
    assert specials["<|begin_of_text|>"] == 128000 and specials["<|eot_id|>"] == 128009
    assert specials["<|start_header_id|>"] == 128006 and specials["<|python_tag|>"] == 128010
    assert specials["<|reserved_special_token_3|>"] == 128011
    assert specials["<|reserved_special_token_247|>"] == 128255
    assert llama3.decode([128000, 9906, 1917]) == "<|begin_of_text|>Hello world"


def test_llama3_special_text_is_plain_unless_allowed(llama3):
    assert llama3.encode("<|eot_id|>", allow_special=True) == [128009]
    plain = llama3.encode("<|eot_id|>")
    assert plain != [128009] and 128009 not in plain
    assert llama3.decode(plain) == "<|eot_id|>"
    header = "<|start_header_id|>user<|end_header_id|>"
    assert llama3.encode(header, allow_special=True)[::2] == [128006, 128007]


@pytest.mark.parametrize("text", VARIED)
def test_llama3_round_trip_varied(llama3, text):
    assert llama3.decode(llama3.encode(text)) == text


@FAST
@given(text=st.text())
def test_llama3_round_trip_any_text(llama3, text):
    assert llama3.decode(llama3.encode(text)) == text


@pytest.mark.parametrize("text", [" " * 1_000_000, "a" * 1_000_000, "ab \n" * 250_000])
def test_llama3_megabyte_runs_are_chunked(llama3, text):
    ids = llama3.encode(text)
    assert llama3.decode(ids) == text


def test_split_long_runs_cuts_like_meta():
    # Runs longer than the limit are cut every `limit` characters; shorter runs are left whole.
    assert list(_split_long_runs("aaaaaaa  b", 3)) == ["aaa", "aaa", "a  b"]
    assert list(_split_long_runs("ab   cd", 3)) == ["ab   cd"]
    assert list(_split_long_runs("a    b", 3)) == ["a   ", " b"]
    assert list(_split_long_runs("", 3)) == [""]


# -- LLaMA 2 -------------------------------------------------------------------------------------

def test_llama2_known_ids(llama2):
    assert llama2.kind == "llama2" and llama2.vocab_size == 32000
    assert llama2.encode("Hello world") == [15043, 3186]
    assert llama2.encode("Hello world", bos=True) == [1, 15043, 3186]
    assert (llama2.bos_id, llama2.eos_id, llama2.pad_id) == (1, 2, None)
    assert llama2.stop_ids == (2,)
    assert llama2.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2}


def test_llama2_specials(llama2):
    assert 1 not in llama2.encode("<s>hi")
    ids = llama2.encode("<s>hi</s>", allow_special=True)
    assert ids[0] == 1 and ids[-1] == 2 and llama2.decode(ids) == "hi"


@pytest.mark.parametrize("text", SENTENCES)
def test_llama2_round_trip_sentences(llama2, text):
    assert llama2.decode(llama2.encode(text, bos=True, eos=True)) == text


# -- bytes ---------------------------------------------------------------------------------------

def test_bytes_known_ids():
    tok = ByteTokenizer()
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == ("bytes", 259, 256, 257, 258)
    assert tok.encode("Aé", bos=True, eos=True) == [256, 65, 0xC3, 0xA9, 257]
    assert tok.encode("<|eos|>") == list(b"<|eos|>")
    assert tok.encode("x<|eos|>", allow_special=True) == [120, 257]
    assert tok.decode([256, 65, 0xC3, 0xA9, 257]) == "<|bos|>Aé<|eos|>"
    assert tok.decode([0xC3]) == "\ufffd"  # a cut UTF-8 sequence is replaced, not an error


@FAST
@given(text=st.text())
def test_bytes_round_trip_any_text(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_bytes_saved_as_equivalent_tokenizer_json(tmp_path):
    tok = ByteTokenizer()
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert (loaded.kind, loaded.vocab_size, loaded.bos_id, loaded.eos_id, loaded.pad_id) == \
        ("hf", 259, 256, 257, 258)
    for text in VARIED:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.encode(text, allow_special=True) == tok.encode(text, allow_special=True)
        assert loaded.decode(tok.encode(text)) == text


# -- training a byte-level BPE -------------------------------------------------------------------

def test_train_specials_and_size(trained):
    assert trained.kind == "hf" and trained.vocab_size == 300
    assert trained.special_tokens == {"<|bos|>": 0, "<|eos|>": 1, "<|pad|>": 2}
    assert (trained.bos_id, trained.eos_id, trained.pad_id) == (0, 1, 2)
    assert trained.stop_ids == (1,)
    assert trained.encode("x", bos=True, eos=True) == [0, *trained.encode("x"), 1]
    # Merges were learnt: a frequent corpus word is one token, not one per byte.
    assert len(trained.encode(" number")) == 1


def test_train_small_corpus_stops_below_request():
    tok = train_tokenizer(["ab ab ab"], vocab_size=5000)
    assert 259 < tok.vocab_size < 5000


def test_train_is_deterministic(tmp_path, trained):
    again = train_tokenizer(CORPUS, vocab_size=300)
    trained.save(tmp_path / "a")
    again.save(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == \
        (tmp_path / "b" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("text", VARIED)
def test_trained_round_trip_varied(trained, text):
    assert trained.decode(trained.encode(text)) == text


@FAST
@given(text=st.text())
def test_trained_round_trip_any_text(trained, text):
    assert trained.decode(trained.encode(text)) == text


def test_trained_special_text_is_plain_unless_allowed(trained):
    assert trained.encode("<|eos|>", allow_special=True) == [1]
    assert 1 not in trained.encode("<|eos|>")
    assert trained.decode(trained.encode("<|eos|>")) == "<|eos|>"


def test_trained_save_load_round_trip(tmp_path, trained):
    paths = trained.save(tmp_path)
    assert sorted(p.name for p in paths) == ["tokenizer.json", "tokenizer_config.json"]
    loaded = load_tokenizer(tmp_path)
    assert (loaded.kind, loaded.vocab_size) == ("hf", 300)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (0, 1, 2)
    for text in VARIED:
        assert loaded.encode(text, bos=True) == trained.encode(text, bos=True)


def test_custom_specials_come_back_through_tokenizer_config(tmp_path):
    tok = train_tokenizer(CORPUS, vocab_size=280, special_tokens=("[START]", "[END]"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, None)
    tok.save(tmp_path)
    assert (load_tokenizer(tmp_path).bos_id, load_tokenizer(tmp_path).eos_id) == (0, 1)
    # Without tokenizer_config.json the BOS is still the token the post-processor adds ...
    (tmp_path / "tokenizer_config.json").unlink()
    assert (load_tokenizer(tmp_path).bos_id, load_tokenizer(tmp_path).eos_id) == (0, None)
    # ... and without that either, the unusual names are not recognised.
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert load_tokenizer(tmp_path).bos_id is None


def test_tokenizer_config_token_as_object(tmp_path, trained):
    trained.save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<|bos|>"},
                                                                "pad_token": {"content": "<|eos|>"}}))
    assert load_tokenizer(tmp_path / "tokenizer.json").pad_id == 1
    # A BOS that is not the token the post-processor adds before each text is refused, naming it.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<|pad|>"}}))
    with pytest.raises(BridgeError, match=r"tokenizer.json: the post-processor puts \['<\|bos\|>'\] "
                                          r"before each text, but the bos_token is '<\|pad\|>'"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_add_bos_add_eos_come_from_the_post_processor(tmp_path, trained):
    """Where there is a tokenizer.json its post-processor decides BOS / EOS (as transformers 5
    does: tests/test_bos_eos.py); tokenizer_config.json's add_bos_token / add_eos_token are
    written to match it and are not read; null tokens come from the config."""
    assert (trained.add_bos, trained.add_eos) == (True, False)  # train_tokenizer: BOS opens a text
    assert trained.decided_by == "tokenizer.json's post-processor adds <|bos|> $A"
    trained.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["add_bos_token"], config["add_eos_token"], config["unk_token"]) == \
        (True, False, None)
    config.update(add_bos_token=False, add_eos_token=True, pad_token=None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert (tok.add_bos, tok.add_eos, tok.bos_id, tok.pad_id) == (True, False, 0, None)
    assert "add_bos_token false, add_eos_token true is not read" in tok.decided_by
    tok.add_bos, tok.add_eos = False, True  # told otherwise: the files it writes say so
    tok.save(tmp_path / "again")
    again = load_tokenizer(tmp_path / "again")
    assert (again.add_bos, again.add_eos, again.bos_id, again.pad_id) == (False, True, 0, None)
    assert again.decided_by == "tokenizer.json's post-processor adds $A <|eos|>"
    # the rewrite went to the file only: tok's own post-processor still adds BOS
    assert added_tokens(post_processor_json(tok._tok), "tok") == ([0], [])


def test_stop_ids_by_llama_cpps_names(tmp_path):
    """EOS, then every token llama.cpp ends a generation at by its name (<|im_end|>,
    <|endoftext|>, ..., a FIM pad / repo / separator token), less its exception for <|end|>."""
    tok = train_tokenizer(CORPUS, vocab_size=290, special_tokens=(
        "<s>", "</eos>", "<pad>", "<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|end|>",
        "<im_end>"))
    assert tok.stop_ids == (1, 3, 4, 5, 6)
    harmony = train_tokenizer(CORPUS, vocab_size=290, special_tokens=(
        "<s>", "</eos>", "<pad>", "<|end|>", "<|return|>", "<|call|>"))
    assert harmony.stop_ids == (1, 4, 5)  # <|end|> ends a message, not the generation


@pytest.mark.parametrize("vocab_size", [259, 100, 300.0, "500"])
def test_train_refuses_small_vocab(vocab_size):
    with pytest.raises(BridgeError, match="vocab_size"):
        train_tokenizer(CORPUS, vocab_size=vocab_size)


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [ByteTokenizer, lambda: train_tokenizer(CORPUS, 280)])
@pytest.mark.parametrize("bad", [-1, 10**6])
def test_decode_out_of_range_names_the_id(make, bad):
    tok = make()
    with pytest.raises(BridgeError, match=f"token id {bad} "):
        tok.decode([5, bad])


def test_llama3_decode_out_of_range(llama3):
    with pytest.raises(BridgeError, match="token id 128256 "):
        llama3.decode([128256])


def test_encode_bos_without_bos_token():
    tok = train_tokenizer(CORPUS, vocab_size=280, special_tokens=())
    with pytest.raises(BridgeError, match="bos"):
        tok.encode("x", bos=True)


# -- detection -----------------------------------------------------------------------------------

@needs_llama3
def test_detect_llama3():
    assert detect_tokenizer_kind(LLAMA3_FILE) == "llama3"
    assert detect_tokenizer_kind(LLAMA3_FILE.parent) == "llama3"


@needs_llama2
def test_detect_llama2():
    assert detect_tokenizer_kind(LLAMA2_FILE) == "llama2"


def test_detect_hf_and_directory_order(tmp_path, trained):
    trained.save(tmp_path)
    assert detect_tokenizer_kind(tmp_path / "tokenizer.json") == "hf"
    (tmp_path / "tokenizer.model").write_bytes(b"garbage")
    assert detect_tokenizer_kind(tmp_path) == "hf"  # tokenizer.json wins
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(BridgeError, match="tokenizer.model"):
        detect_tokenizer_kind(tmp_path)


@needs_llama3
@needs_llama2
def test_real_files_save_byte_identical(tmp_path, llama3, llama2):
    path3, _ = llama3.save(tmp_path / "3")  # and a tokenizer_config.json with the BOS decision
    path2, _ = llama2.save(tmp_path / "2")
    assert path3.read_bytes() == LLAMA3_FILE.read_bytes()
    assert path2.read_bytes() == LLAMA2_FILE.read_bytes()
    assert load_tokenizer(tmp_path / "3").encode("Hello world") == [9906, 1917]
    assert load_tokenizer(tmp_path / "2").encode("Hello world") == [15043, 3186]


@pytest.mark.parametrize("content, says", [
    (b"", "empty file"),
    (b"\n  \n", "empty file"),
    (b"\x00\x01garbage\xff" * 50, "not a tokenizer file"),
    (b"hello world\n", "not a tokenizer file"),
    (b'{"model": ', "invalid JSON"),
    (b'{"version": "1.0"}', "without a 'model' key"),
    (b'{"model": {"type": "Nonsense"}}', "not a tokenizer.json"),
    (b"IQ== 0\nIg== one\n", "line 2"),
    (b"IQ== 0\nIg== 5\n", "ranks are not"),
    (b"IQ== 0\nIg== 1\n", "no rank for byte 0"),
])
def test_refuses_bad_files_naming_them(tmp_path, content, says):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(BridgeError, match=says) as err:
        load_tokenizer(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


@needs_llama2
def test_refuses_truncated_sentencepiece(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(LLAMA2_FILE.read_bytes()[:200_000])
    with pytest.raises(BridgeError, match="not a tokenizer file") as err:
        detect_tokenizer_kind(path)
    assert str(path) in str(err.value)


@needs_llama3
def test_refuses_truncated_tiktoken_mid_line(tmp_path):
    data = LLAMA3_FILE.read_bytes()
    path = tmp_path / "tokenizer.model"
    path.write_bytes(data[:data.index(b"\n", 1000) - 3])
    with pytest.raises(BridgeError, match="line") as err:
        load_tokenizer(path)
    assert str(path) in str(err.value)


def test_refuses_missing_paths(tmp_path):
    with pytest.raises(BridgeError, match="no such file"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(BridgeError, match="no tokenizer.json or tokenizer.model"):
        load_tokenizer(tmp_path)
