"""GGUF vocabularies rebuilt to tokenize as llama.cpp does (bridge.gguf.tokenizer): llama.cpp's own
tokenizer suite (its ggml-vocab-*.gguf files with .inp texts and .out ids, encoded as
test-tokenizer-0 does: add_special false, parse_special false), the pre-tokenizer table against
llama-vocab.cpp itself, the real SmolLM2 vocabulary against transformers' GGUF tokenizer and
(slow) against llama.cpp, round trips through tokenizer files and GGUF keys, and the refusals."""

from __future__ import annotations

import json
import random
import re
import tarfile

import gguf
import pytest

from bridge.errors import BridgeError
from bridge.gguf.pretokenizers import NOT_REBUILT, PRE_TOKENIZERS
from bridge.gguf.container import read_gguf
from bridge.gguf.vocab import vocab_keys
from bridge.gguf.tokenizer import tokenizer_files, tokenizer_from_gguf
from bridge.hf_tokenizer import hf_tokenizer_files
from bridge.tokenizer import _byte_level_chars, find_tokenizer, load_tokenizer
from conftest import SDIST_DIR, SHARED

# every vocabulary of llama.cpp's suite that has .inp / .out, BPE or SentencePiece
VOCABS = ("gpt-2", "llama-bpe", "llama-spm", "phi-3", "deepseek-llm", "deepseek-coder", "falcon",
          "mpt", "starcoder", "refact", "command-r", "qwen2", "qwen35", "gemma-4")
UNBUILT = {"bert-bge": "tokenizer.ggml.model 'bert', pre 'bert-bge'"}  # WordPiece


def vocab_cases(directory, name) -> list[tuple[str, list[int]]]:
    """(text, ids) as test-tokenizer-0.cpp reads <file>.inp / .out: texts separated by
    "\\n__ggml_vocab_test__\\n" lines, one line of space-separated ids per text."""
    path = directory / f"ggml-vocab-{name}.gguf"
    raw = path.with_name(path.name + ".inp").read_bytes().decode("utf-8")
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":  # the file ends with a separator
        texts.pop()
    ids = [[int(i) for i in line.split()] for line in
           path.with_name(path.name + ".out").read_text().splitlines()]
    assert len(texts) == len(ids), name
    return list(zip(texts, ids))


# -- llama.cpp's tokenizer suite -------------------------------------------------------------------

@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_tokenizer_suite(llama_cpp_vocab, name):
    tok = load_tokenizer(llama_cpp_vocab / f"ggml-vocab-{name}.gguf")
    cases = vocab_cases(llama_cpp_vocab, name)
    wrong = [(text, ids, tok.encode(text)) for text, ids in cases if tok.encode(text) != ids]
    assert not wrong, f"{len(wrong)} of {len(cases)} texts differ, first {wrong[0]}"
    # llama.cpp's detokenizer gives these texts back from the ids; so does ours
    assert [tok.decode(ids) for _, ids in cases] == [text for text, _ in cases]


def test_the_suite_covers_every_vocabulary_with_tests(llama_cpp_vocab):
    tested = {p.name[len("ggml-vocab-"):-len(".gguf.inp")]
              for p in llama_cpp_vocab.glob("ggml-vocab-*.gguf.inp")}
    assert tested == set(VOCABS) | set(UNBUILT)
    for name, why in UNBUILT.items():
        with pytest.raises(BridgeError, match=re.escape(f"tokenizer not rebuilt: {why}")) as e:
            load_tokenizer(llama_cpp_vocab / f"ggml-vocab-{name}.gguf")
        assert f"ggml-vocab-{name}.gguf" in str(e.value) and "--tokenizer FILE" in str(e.value)


# -- the table is llama.cpp's ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_vocab_cpp() -> str:
    """vendor/llama.cpp/src/llama-vocab.cpp from the llama-cpp-python source distribution."""
    found = sorted(SDIST_DIR.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        pytest.skip(f"no llama-cpp-python source distribution in {SDIST_DIR}")
    with tarfile.open(found[-1]) as tar:
        for member in tar:
            if member.name.endswith("vendor/llama.cpp/src/llama-vocab.cpp"):
                return tar.extractfile(member).read().decode("utf-8")
    pytest.skip(f"{found[-1].name} holds no llama-vocab.cpp")


def _c_strings(code: str) -> list[str]:
    """The C string literals of `code` (comments dropped), escapes decoded, then control
    characters written as the regex escapes our table uses (llama.cpp writes both "[\\r\\n]" and
    "[\\\\r\\\\n]", which match alike)."""
    code = re.sub(r"^\s*//.*$", "", code, flags=re.M)
    out = []
    for lit in re.findall(r'"((?:[^"\\]|\\.)*)"', code):
        text = re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r", "t": "\t"}.get(m[1], m[1]), lit)
        out.append(text.replace("\r", r"\r").replace("\n", r"\n").replace("\t", r"\t"))
    return out


def test_the_pre_tokenizer_table_is_llama_vocab_cpps(llama_vocab_cpp):
    """Every name, flag and regex of bridge.gguf.pretokenizers as llama-vocab.cpp has it, and
    every name it knows in the table or in NOT_REBUILT: an update of llama.cpp shows up here."""
    src = llama_vocab_cpp
    ctor = src[src.index("llm_tokenizer_bpe(const llama_vocab & vocab) {"):]
    ctor = ctor[:ctor.index("std::vector<std::string> regex_exprs;")]
    splits, byte_level, labels = {}, {}, []
    for m in re.finditer(r"case (LLAMA_VOCAB_PRE_TYPE_\w+):|default:|regex_exprs = \{(.*?)\};|"
                         r"byte_encode = false|break;", ctor, re.S):
        if m[0].startswith(("case", "default")):
            labels.append(m[1] or "LLAMA_VOCAB_PRE_TYPE_DEFAULT")
        elif m[2] is not None:
            splits.update({t: tuple(_c_strings(m[2])) for t in labels})
        elif m[0] == "byte_encode = false":
            byte_level.update({t: False for t in labels})
        else:
            labels = []
    chain = src[src.index('tokenizer_pre == "default"'):src.index("unknown pre-tokenizer type")]
    # "workaround for Gemma 4": add_bos forced on for these pre types
    forced = set(re.findall(r"if \(pre_type == (LLAMA_VOCAB_PRE_TYPE_\w+) && !add_bos\)", src))
    assert forced == {"LLAMA_VOCAB_PRE_TYPE_GEMMA4"}
    seen = set()
    for block in re.split(r"\}\s*else if \(", chain):
        names = re.findall(r'tokenizer_pre == "([^"]+)"', block)
        kind = re.search(r"pre_type = (LLAMA_VOCAB_PRE_TYPE_\w+);", block)[1]
        seen.update(names)
        for name in names:
            if name in NOT_REBUILT:
                continue
            pre = PRE_TOKENIZERS[name]
            expanded = tuple(re.sub(r"\\x\{([0-9A-F]+)\}", lambda m: chr(int(m[1], 16)), r)
                             for r in pre.splits)
            assert expanded == splits[kind], name
            assert (pre.ignore_merges, pre.add_bos, pre.bos, pre.byte_level, pre.force_bos) == (
                "ignore_merges = true" in block, "add_bos = true" in block,
                "special_bos_id = LLAMA_TOKEN_NULL" not in block, byte_level.get(kind, True),
                kind in forced), name
    assert seen == set(PRE_TOKENIZERS) | set(NOT_REBUILT)


# -- SmolLM2 -------------------------------------------------------------------------------------

EXTRA_TEXTS = [
    "def f(x):\n    return x**2  # square\n\tif x: pass\n", "for i in range(10):\n    print(i)",
    "1234567890 3.14159 1,000,000 2024-01-01", "x  12   345", "a  b   c    d\n\n\n  \t x",
    "  leading", "trailing   ", "中文测试，你好世界。", "Привет, как дела? Ёлка", "مرحبا بالعالم",
    "🦙🚀 emoji 👍🏽 👨‍👩‍👧", "naïve café ñ", "\u3000全角\u00a0nbsp", "x\r\ny\rz",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]


def real_texts() -> list[str]:
    """The SST and CFIMDB lines of ../shared/data (skip when absent), and EXTRA_TEXTS."""
    files = [SHARED / "data" / f for f in ("sst/train.txt", "sst/dev.txt", "cfimdb/train.txt")]
    if not all(f.is_file() for f in files):
        pytest.skip(f"the SST / CFIMDB data is not in {SHARED / 'data'}")
    return [line.split(" ||| ", 1)[1] for f in files for line in
            f.read_text(encoding="utf-8").splitlines()] + EXTRA_TEXTS


@pytest.fixture(scope="module")
def smol(smollm2):
    return load_tokenizer(smollm2)


def test_smollm2_vocabulary(smollm2, smol):
    assert (smol.kind, smol.vocab_size) == ("hf", 49152)
    assert smol.add_bos is False and smol.add_eos is False
    assert (smol.bos_id, smol.eos_id, smol.pad_id, smol.unk_id) == (1, 2, 2, 0)
    # EOS <|im_end|>, <|endoftext|> by name, and <reponame>, which llama.cpp takes for FIM repo
    assert smol.stop_ids == (2, 0, 4)
    assert find_tokenizer(smollm2).stop_ids == smol.stop_ids  # a GGUF's own vocabulary
    chat = "<|im_start|>user\nHi<|im_end|>\n"
    assert smol.encode(chat, allow_special=True) == [1, 4093, 198, 26843, 2, 198]
    plain = smol.encode(chat)
    assert 1 not in plain and 2 not in plain and smol.decode(plain) == chat
    assert smol.encode(chat, bos=smol.add_bos) == plain  # no BOS: SmolLM2 opens with no token


@pytest.mark.slow  # ~10 s, most of it transformers' import and gguf's reader of the file
def test_smollm2_against_transformers(smollm2, smol):
    """transformers' own GGUF tokenizer agrees but where llama.cpp's smollm pre-tokenizer splits
    digits first (\\p{N}, then GPT-2's regex): transformers 5.24 has no split for "smollm"
    (integrations/gguf/gguf_tokenizer_mapping.py, GGUF_PRE_TOKENIZER_SPLITS) and keeps
    ByteLevel's GPT-2 regex alone. The ids differ only where spaces precede a digit: llama.cpp
    cuts "   100" into "   " + 1 0 0, GPT-2's regex into "  " + " 100" (and " 1" is no token)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers

    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    texts = real_texts()
    ours = [smol.encode(t) for t in texts]

    def theirs():
        return [e.ids for e in hf.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]

    hf.backend_tokenizer.encode_special_tokens = True  # special-token text stays text, as ours
    wrong = [t for t, a, b in zip(texts, ours, theirs()) if a != b]
    assert 0 < len(wrong) <= 10, len(wrong)  # 7 of 11,367 texts: 6 SST / CFIMDB lines, 1 extra
    assert all(re.search(r"\s\s\d", t) for t in wrong), wrong
    # with llama.cpp's digit split in front, transformers' tokenizer gives our ids on every text
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    assert theirs() == ours


@pytest.mark.slow
def test_smollm2_against_llama_cpp(smollm2, smol):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(smollm2), vocab_only=True, verbose=False)
    texts = real_texts()
    wrong = [t for t in texts if llm.tokenize(t.encode("utf-8"), add_bos=False, special=False)
             != smol.encode(t)]
    assert wrong == []
    chats = [f"<|im_start|>{role}\n{t}<|im_end|>\n" for role, t in
             zip(["system", "user", "assistant"] * 400, texts[:1200] + EXTRA_TEXTS)]
    chats.append("<|im_start|><|im_end|><|endoftext|><reponame>x<|im_start|> user")
    wrong = [t for t in chats if llm.tokenize(t.encode("utf-8"), add_bos=False, special=True)
             != smol.encode(t, allow_special=True)]
    assert wrong == []
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    assert tuple(i for i in range(smol.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)) \
        == tuple(sorted(smol.stop_ids))
    assert llama_cpp.llama_vocab_get_add_bos(vocab) == smol.add_bos


def test_smollm2_files_load_back_the_same(smol, tmp_path):
    paths = smol.save(tmp_path)
    assert [p.name for p in paths] == ["tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (config["add_bos_token"], config["bos_token"], config["gguf_tokenizer_pre"]) == \
        (False, "<|im_start|>", "smollm")
    again = load_tokenizer(tmp_path)
    for attr in ("add_bos", "add_eos", "bos_id", "eos_id", "pad_id", "unk_id", "stop_ids",
                 "special_tokens", "vocab_size"):
        assert getattr(again, attr) == getattr(smol, attr), attr
    for text in EXTRA_TEXTS:
        for special in (False, True):
            assert again.encode(text, allow_special=special) == \
                smol.encode(text, allow_special=special)


def test_smollm2_gguf_keys_round_trip(smollm2, smol, tmp_path):
    """GGUF -> tokenizer -> GGUF keys, straight and through the saved files: the same tokens,
    types, merges, pre-tokenizer name and ids."""
    fields = read_gguf(smollm2).fields
    smol.save(tmp_path)
    for tok in (smol, load_tokenizer(tmp_path)):
        keys = dict(vocab_keys(tok, 49152))
        assert keys["add_tokenizer_pre"] == "smollm"
        assert keys["add_token_list"] == fields["tokenizer.ggml.tokens"]
        assert keys["add_token_types"] == fields["tokenizer.ggml.token_type"]
        assert keys["add_token_merges"] == fields["tokenizer.ggml.merges"]
        assert keys["add_add_bos_token"] is False
        assert [keys[f"add_{k}_token_id"] for k in ("bos", "eos", "pad", "unk")] == \
            [fields[f"tokenizer.ggml.{k}_token_id"] for k in
             ("bos", "eos", "padding", "unknown")]
        assert keys["add_chat_template"] == fields["tokenizer.chat_template"]


def test_hf_export_adds_no_bos_where_the_vocabulary_does_not(smol, tmp_path):
    from tokenizers import Tokenizer

    hf_tokenizer_files(smol, tmp_path, model_max_length=2048)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (config["add_bos_token"], config["add_eos_token"]) == (False, False)
    exported = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    exported.encode_special_tokens = True
    for text in EXTRA_TEXTS:
        assert exported.encode(text).ids == smol.encode(text)  # add_special_tokens: no BOS


# -- small vocabularies of our own ---------------------------------------------------------------

BYTES = _byte_level_chars()  # "Ġ" is the space


def vocab_file(path, tokens=None, types=None, merges=("Ġ t", "Ġt h"), model="gpt2",
               pre="gpt-2", **ids):
    """A vocabulary-only GGUF file (no tensors, as llama.cpp's ggml-vocab-*.gguf): by default the
    256 byte symbols, "Ġt", "Ġth", then <|endoftext|> (control) and <x> (user-defined)."""
    tokens = list(BYTES) + ["Ġt", "Ġth", "<|endoftext|>", "<x>"] if tokens is None else tokens
    types = [1] * (len(tokens) - 2) + [3, 4] if types is None else types
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(list(merges))
    for key, value in ids.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def test_a_small_vocabulary_through_the_reader(tmp_path):
    path = vocab_file(tmp_path / "v.gguf", eos_token_id=258)
    tok, note = tokenizer_from_gguf(read_gguf(path).fields, path)
    assert note == "tokenizer: tokenizer.json rebuilt from the GGUF vocabulary (gpt2, pre gpt-2)"
    # <x>, user-defined, is a token in any text; <|endoftext|>, control, only where allowed
    assert tok.encode(" the <x><|endoftext|>") == [257, BYTES.index("e"), BYTES.index("Ġ"), 259,
                                                   *[BYTES.index(c) for c in "<|endoftext|>"]]
    assert tok.encode("<|endoftext|>", allow_special=True) == [258]
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.stop_ids) == (11, 258, False, (258,))
    paths, note = tokenizer_files(read_gguf(path).fields, tmp_path / "out", path)
    assert [p.name for p in paths] == ["tokenizer.json", "tokenizer_config.json"]
    assert load_tokenizer(tmp_path / "out").encode(" the") == [257, BYTES.index("e")]


def test_find_tokenizer_takes_the_gguf_vocabulary_unless_told(tmp_path):
    from bridge.tokenizer import ByteTokenizer

    path = vocab_file(tmp_path / "v.gguf")
    ByteTokenizer().save(tmp_path)  # a tokenizer.json beside it loses to the GGUF's own
    assert find_tokenizer(path).vocab_size == 260
    assert find_tokenizer(path, tmp_path / "tokenizer.json").vocab_size == 259


@pytest.mark.parametrize("pre, why", [("kimi-k2", "hand-written Han"),
                                      ("nonsense", "does not know")])
def test_unknown_tokenizers_are_named(tmp_path, pre, why):
    path = vocab_file(tmp_path / "v.gguf", pre=pre)
    tok, note = tokenizer_from_gguf(read_gguf(path).fields, path)
    assert tok is None and note.startswith(
        f"tokenizer not rebuilt: tokenizer.ggml.model 'gpt2', pre {pre!r} (") and why in note
    t5 = vocab_file(tmp_path / "t5.gguf", model="t5", pre=None, merges=None)
    with pytest.raises(BridgeError, match=r"t5\.gguf: tokenizer not rebuilt: tokenizer.ggml.model "
                                          r"'t5', pre 'default' \(a tokenizer model other"):
        load_tokenizer(t5)


def test_bad_vocabularies_are_refused_by_file_and_key(tmp_path):
    cases = [
        (dict(types=[1, 1]), r"tokenizer.ggml.token_type has 2 entries for 260 tokens"),
        (dict(merges=["Ġt", "Ġ t"]), r"tokenizer.ggml.merges\[0\] is 'Ġt', not two tokens"),
        (dict(bos_token_id=260), r"tokenizer.ggml.bos_token_id is 260, not an id of the 260"),
        (dict(eos_token_id=999), r"tokenizer.ggml.eos_token_id is 999"),
        (dict(tokens=list(BYTES) + ["a"], types=[1] * 257),
         r"tokenizer.ggml.tokens holds 'a' twice \(ids 97 and 256\)"),
    ]
    for i, (kwargs, message) in enumerate(cases):
        path = vocab_file(tmp_path / f"bad{i}.gguf", **kwargs)
        with pytest.raises(BridgeError, match=rf"bad{i}\.gguf: {message}"):
            load_tokenizer(path)
    data = vocab_file(tmp_path / "good.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    with pytest.raises(BridgeError, match=r"cut\.gguf: truncated or corrupt GGUF file"):
        load_tokenizer(tmp_path / "cut.gguf")


# -- every pre-tokenizer against llama.cpp ---------------------------------------------------

def fuzz_texts(n: int, seed: int) -> list[str]:
    """Short random texts over what the split rules tell apart: cases, digits of several
    scripts, whitespace (ASCII and not), contractions, punctuation, CJK, marks, emoji."""
    alphabet = (list("abcxyzABCXYZ") * 4 + list("0123456789") * 2 + [" "] * 12 + ["\n"] * 3 +
                list("\r\t\v\f\x1c\x85") + list(".,!?;:'\"()[]<>/\\|@#$%^&*-_+=~`") +
                ["'s", "'t", "'re", "'LL", "'S", "'ve", "'D"] + list("éßЖжǅʰΩπ中文字가あア") +
                ["\u0301", "\u093f"] + list("٣²Ⅻ൧€©¬µ") +
                ["\u00a0", "\u3000", "\u2003", "\u202f", "\u200b", "🦙", "\ufffd"] +
                list("。，、！？…") + ["<sentinel:12>", "IMGIMGABZ", "    ", "123456789", "\n\n",
                                     " the", "Hello", "ſ", "K", "İ"])
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(n)]


@pytest.mark.slow
def test_every_pre_tokenizer_against_llama_cpp(llama_cpp_vocab, tmp_path):
    """Each name of the table on a vocabulary of its kind (GPT-2's for the byte-level ones,
    Gemma 4's for the SPM-style ones), on llama.cpp's suite texts and random ones: llama.cpp's
    ids, every one. (About a minute.)"""
    llama_cpp = pytest.importorskip("llama_cpp")
    reader = gguf.GGUFReader(llama_cpp_vocab / "ggml-vocab-gpt-2.gguf")
    base = {k: (f.types, f.contents()) for k, f in reader.fields.items()
            if not k.startswith(("GGUF.", "tokenizer."))}
    gpt2, gemma = (read_gguf(llama_cpp_vocab / f"ggml-vocab-{name}.gguf").fields
                   for name in ("gpt-2", "gemma-4"))
    texts = list(dict.fromkeys(t for name in VOCABS for t, _ in
                               vocab_cases(llama_cpp_vocab, name))) + fuzz_texts(300, 7)
    wrong = {}
    for name, pre in PRE_TOKENIZERS.items():
        source = gpt2 if pre.byte_level else gemma
        path = tmp_path / f"{name}.gguf"
        w = gguf.GGUFWriter(path, "gpt2")
        for key, (types, value) in base.items():
            if key != "general.architecture":
                w.add_key_value(key, value, types[0])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(name)
        w.add_token_list(source["tokenizer.ggml.tokens"])
        w.add_token_types(source["tokenizer.ggml.token_type"])
        w.add_token_merges(source["tokenizer.ggml.merges"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        ours = load_tokenizer(path)
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        bad = [t for t in texts if llm.tokenize(t.encode("utf-8"), add_bos=False, special=False)
               != ours.encode(t)]
        if bad:
            wrong[name] = (len(bad), bad[0])
        del llm
    assert wrong == {}
