"""A tokenizer as GGUF's tokenizer.ggml.* keys (export), and those keys as a tokenizer file again
(import).

Export, as llama.cpp's converter writes them:
    llama2  tokenizer.ggml.model "llama" (SentencePiece): pieces, scores and token types straight
            from the model; pre "default".
    llama3  "gpt2" (byte-level BPE), pre "llama-bpe": the 128,000 ranks as GPT-2 byte-level
            strings, merges, the 256 special tokens as CONTROL.
    hf      "gpt2" for a byte-level BPE tokenizer.json: pre "llama-bpe" when it splits with LLaMA
            3's pattern, "gpt-2" when with GPT-2's (the ByteLevel default, which our BPE training
            uses); others (a SentencePiece-style BPE with byte fallback) are refused by name.
    bytes   "gpt2", pre "gpt-2", no merges: id b is byte b.
The byte-level vocabularies and merges are those of bridge.hf_tokenizer's tokenizer.json, so one
construction serves both exports. Ids up to the model's vocab_size that the tokenizer does not
use become "[PAD{i}]" (UNUSED), as llama.cpp pads them. BOS, EOS, EOT / EOM (LLaMA 3), UNK, pad
ids; add_bos_token true, add_eos_token false.

Import rebuilds the file the vocabulary came from where it can be told exactly: a LLaMA 3 vocabulary
("llama-bpe" with LLaMA 3's 256 special tokens after its ranks) as tiktoken's tokenizer.model, a
"llama" vocabulary as a SentencePiece tokenizer.model (BPE, byte fallback, LLaMA's normaliser);
any other "gpt2" vocabulary as a tokenizer.json (+ tokenizer_config.json naming BOS / EOS).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from .errors import BridgeError
from .tokenizer import LLAMA3_PATTERN, LLAMA3_SPECIALS, Tokenizer, _byte_level_chars

# llama.cpp's token types (gguf.TokenType), the same numbers as SentencePiece's piece types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _pad(i: int) -> str:
    return f"[PAD{i}]"


# -- export ----------------------------------------------------------------------------------------

def vocab_keys(tokenizer: Tokenizer, vocab_size: int, chat_template: str | None = None
               ) -> list[tuple[str, object]]:
    """(GGUFWriter method, value) pairs that write `tokenizer` as llama.cpp reads it, for a model
    of `vocab_size` ids."""
    if tokenizer.vocab_size > vocab_size:
        raise BridgeError(f"the tokenizer's {tokenizer.vocab_size} ids do not fit the model's "
                          f"vocab_size {vocab_size}", field="tokenizer")
    if tokenizer.kind == "llama2":
        keys = _sentencepiece_keys(tokenizer, vocab_size)
    elif tokenizer.kind in ("llama3", "hf", "bytes"):
        keys = _byte_level_keys(tokenizer, vocab_size)
    else:
        raise BridgeError(f"no GGUF vocabulary for a tokenizer of kind {tokenizer.kind!r}",
                          field="tokenizer")
    ids = [("add_bos_token_id", tokenizer.bos_id), ("add_eos_token_id", tokenizer.eos_id),
           ("add_pad_token_id", tokenizer.pad_id)]
    specials = tokenizer.special_tokens
    ids += [("add_eot_token_id", specials.get("<|eot_id|>")),
            ("add_eom_token_id", specials.get("<|eom_id|>"))]
    if tokenizer.kind == "llama2":
        ids.append(("add_unk_token_id", tokenizer._sp.unk_id()))
    keys += [(method, i) for method, i in ids if i is not None]
    keys += [("add_add_bos_token", tokenizer.bos_id is not None), ("add_add_eos_token", False)]
    if chat_template is None and tokenizer.kind == "hf":
        chat_template = tokenizer._config.get("chat_template")
    if isinstance(chat_template, str):
        keys.append(("add_chat_template", chat_template))
    return keys


def _sentencepiece_keys(tokenizer: Tokenizer, vocab_size: int) -> list[tuple[str, object]]:
    sp = tokenizer._sp
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        kind = (UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else
                UNUSED if sp.is_unused(i) else BYTE if sp.is_byte(i) else NORMAL)
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        types.append(kind)
    for i in range(len(tokens), vocab_size):  # llama.cpp's filler for ids the model has spare
        tokens.append(_pad(i))
        scores.append(-10000.0)
        types.append(UNUSED)
    return [("add_tokenizer_model", "llama"), ("add_tokenizer_pre", "default"),
            ("add_token_list", tokens), ("add_token_scores", scores), ("add_token_types", types)]


def _byte_level_keys(tokenizer: Tokenizer, vocab_size: int) -> list[tuple[str, object]]:
    from .hf_tokenizer import _from_bytes, _from_hf, _from_tiktoken

    build = {"llama3": _from_tiktoken, "hf": _from_hf, "bytes": _from_bytes}[tokenizer.kind]
    spec = json.loads(build(tokenizer).to_str())
    model = spec["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback") or \
            "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise BridgeError(f"a {tokenizer.kind} tokenizer that is not a byte-level BPE (model "
                          f"{model.get('type')}, byte_fallback {model.get('byte_fallback')}): "
                          f"GGUF's gpt2 vocabulary cannot hold it; pass the original "
                          f"tokenizer.model", field="tokenizer")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = _pre_name(spec.get("pre_tokenizer"), bool(merges))
    tokens = [_pad(i) for i in range(vocab_size)]
    types = [UNUSED] * vocab_size
    for token, i in model["vocab"].items():
        tokens[i], types[i] = token, NORMAL
    for added in spec.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    keys = [("add_tokenizer_model", "gpt2"), ("add_tokenizer_pre", pre),
            ("add_token_list", tokens), ("add_token_types", types)]
    if merges:
        keys.append(("add_token_merges", merges))
    return keys


def _pre_name(pre_tokenizer: dict | None, has_merges: bool) -> str:
    """llama.cpp's name for the pre-tokenizer (the split pattern that cuts text before BPE)."""
    text = json.dumps(pre_tokenizer)
    if json.dumps(LLAMA3_PATTERN)[1:-1] in text:
        return "llama-bpe"
    parts = (pre_tokenizer or {}).get("pretokenizers", [pre_tokenizer or {}])
    byte_level = [p for p in parts if p.get("type") == "ByteLevel"]
    if len(parts) == 1 and byte_level and byte_level[0].get("use_regex", True):
        return "gpt-2"
    if not has_merges:  # each byte its own token: how the text is cut cannot change the ids
        return "gpt-2"
    raise BridgeError(f"a byte-level BPE whose pre-tokenizer llama.cpp has no name for "
                      f"({text[:120]}); GGUF export takes LLaMA 3's or GPT-2's split",
                      field="tokenizer")


# -- import ----------------------------------------------------------------------------------------

def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def tokenizer_files(reader, directory: Path, where: Path) -> tuple[list[Path], str | None]:
    """The GGUF vocabulary of `reader` as tokenizer file(s) written into `directory`; returns
    (paths, a note for inspect or None)."""
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
        return [], "no tokenizer in the file (no tokenizer.ggml.* keys)"
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    types = _field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    pre = _field(reader, "tokenizer.ggml.pre")
    if len(types) != len(tokens):
        raise BridgeError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for "
                          f"{len(tokens)} tokens")
    while tokens and types[-1] == UNUSED and tokens[-1] == _pad(len(tokens) - 1):
        tokens, types = tokens[:-1], types[:-1]  # the model's spare ids, not the tokenizer's
    ids = {name: _field(reader, f"tokenizer.ggml.{name}_token_id")
           for name in ("bos", "eos", "pad")}
    if model == "gpt2" and pre == "llama-bpe" and _is_llama3(tokens):
        return [_write_tiktoken(tokens, directory)], \
            "tokenizer: LLaMA 3 ranks rebuilt from the GGUF vocabulary"
    if model == "llama":
        scores = _field(reader, "tokenizer.ggml.scores") or []
        path = _write_sentencepiece(tokens, scores[:len(tokens)], types, ids, directory, where)
        if path is None:
            return [], "tokenizer not rebuilt: writing a SentencePiece model needs protobuf"
        return [path], "tokenizer: SentencePiece model rebuilt from the GGUF vocabulary"
    if model == "gpt2" and pre in ("gpt-2", "llama-bpe"):
        merges = _field(reader, "tokenizer.ggml.merges") or []
        return _write_tokenizer_json(tokens, types, merges, pre, ids, directory), \
            f"tokenizer: tokenizer.json rebuilt from the GGUF vocabulary (pre {pre})"
    return [], (f"tokenizer not rebuilt: tokenizer.ggml.model {model!r}, pre {pre!r} is not one "
                f"we write")


def _is_llama3(tokens: list[str]) -> bool:
    n = len(tokens) - len(LLAMA3_SPECIALS)
    return n > 256 and tokens[n:] == LLAMA3_SPECIALS


def _write_tiktoken(tokens: list[str], directory: Path) -> Path:
    to_byte = {c: b for b, c in enumerate(_byte_level_chars())}
    lines = [base64.b64encode(bytes(to_byte[c] for c in t)) + b" %d\n" % rank
             for rank, t in enumerate(tokens[:len(tokens) - len(LLAMA3_SPECIALS)])]
    path = directory / "tokenizer.model"
    path.write_bytes(b"".join(lines))
    return path


def _write_sentencepiece(tokens, scores, types, ids, directory: Path, where: Path) -> Path | None:
    """A SentencePiece BPE model proto with LLaMA's settings: a dummy-prefix space, spaces as
    "▁", no whitespace clean-up, byte fallback when there are byte pieces."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError:
        return None
    proto = pb.ModelProto()
    for token, score, kind in zip(tokens, scores, types):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = token, float(score), int(kind)
    spec = proto.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = BYTE in types
    spec.unk_id = types.index(UNKNOWN) if UNKNOWN in types else 0
    spec.bos_id = ids["bos"] if ids["bos"] is not None else -1
    spec.eos_id = ids["eos"] if ids["eos"] is not None else -1
    spec.pad_id = ids["pad"] if ids["pad"] is not None else -1
    norm = proto.normalizer_spec
    norm.name, norm.add_dummy_prefix = "identity", True
    norm.remove_extra_whitespaces, norm.escape_whitespaces = False, True
    path = directory / "tokenizer.model"
    path.write_bytes(proto.SerializeToString())
    return path


def _write_tokenizer_json(tokens, types, merges, pre, ids, directory: Path) -> list[Path]:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = RustTokenizer(models.BPE(vocab, pairs, ignore_merges=pre == "llama-bpe"))
    pattern = LLAMA3_PATTERN if pre == "llama-bpe" else GPT2_PATTERN
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    paths = [directory / "tokenizer.json", directory / "tokenizer_config.json"]
    tok.save(str(paths[0]))
    config = {f"{name}_token": tokens[i] for name, i in ids.items()
              if i is not None and i < len(tokens)}
    paths[1].write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return paths
