"""A complete Hugging Face tokenizer (tokenizer.json + tokenizer_config.json +
special_tokens_map.json) and generation defaults for any bridge Tokenizer, so that

    transformers.AutoTokenizer.from_pretrained(directory).encode(text)
        == tokenizer.encode(text, bos=tokenizer.add_bos, eos=tokenizer.add_eos)

and decode(ids, skip_special_tokens=True) gives the text back. Every kind becomes a `tokenizers`
BPE that runs the same algorithm as the original:

    llama3  tiktoken ranks -> byte-level BPE; merge priority = rank of the merged token, exactly
            tiktoken's rule; LLaMA 3's split regex; the 256 special tokens at 128000+.
    llama2  SentencePiece BPE -> BPE over "▁"-escaped text with byte fallback; merge priority =
            the merged piece's score, exactly SentencePiece's rule (ties: see _sentencepiece_bpe).
    hf      its own tokenizer.json.
    bytes   byte-level BPE without merges: id b is byte b; <|bos|> <|eos|> <|pad|> at 256..258.
Every kind gets a post-processor that adds BOS / EOS exactly where the tokenizer's add_bos /
add_eos say, which is where transformers reads them from (bridge.tokenizer.bos_eos).

One difference is by design: text that spells a special token ("<|eot_id|>", "<s>") is plain
text to `Tokenizer.encode` but the special token to transformers' default encode (its chat
templates rely on that); transformers' `encode(text, split_special_tokens=True)` gives ours.

`tokenizers` is imported only inside the builders, so `bridge` keeps to numpy at import time.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import BridgeError
from .tokenizer import (LLAMA3_PATTERN, LLAMA3_SPECIALS, Tokenizer, _byte_level_chars,
                        bos_eos_post_processor)


def hf_tokenizer_files(tokenizer: Tokenizer, directory: str | Path, *, model_max_length: int,
                       chat_template: str | None = None) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for `tokenizer`
    into `directory` (created if needed); return their paths. `model_max_length` is the model's
    context length; `chat_template` (Jinja) goes into the config when given, else the template
    an "hf" tokenizer was loaded with, if any."""
    if not isinstance(model_max_length, int) or isinstance(model_max_length, bool) \
            or model_max_length <= 0:
        raise BridgeError(f"must be a positive integer (got {model_max_length!r})",
                          field="model_max_length")
    builders = {"llama3": _from_tiktoken, "llama2": _from_sentencepiece, "hf": _from_hf,
                "bytes": _from_bytes}
    if tokenizer.kind not in builders:
        raise BridgeError(f"no Hugging Face tokenizer for a tokenizer of kind {tokenizer.kind!r}")
    tok = builders[tokenizer.kind](tokenizer)

    names = {key: tok.id_to_token(i) for key, i in (("bos_token", tokenizer.bos_id),
                                                     ("eos_token", tokenizer.eos_id),
                                                     ("pad_token", tokenizer.pad_id))
             if i is not None}
    add_bos = tokenizer.add_bos and "bos_token" in names
    add_eos = tokenizer.add_eos and "eos_token" in names
    # The post-processor is what transformers reads the decision from (bridge.tokenizer.bos_eos).
    tok.post_processor = bos_eos_post_processor(
        tok.post_processor, (names["bos_token"], tokenizer.bos_id) if add_bos else None,
        (names["eos_token"], tokenizer.eos_id) if add_eos else None)
    if chat_template is None and tokenizer.kind == "hf":
        chat_template = tokenizer._config.get("chat_template")
    config = {
        # The generic fast class: it takes tokenizer.json as written. A model-specific class
        # (LlamaTokenizer) would rebuild parts of the pipeline from its own defaults. The
        # add_*_token keys repeat the post-processor's decision for readers older than
        # transformers 5 (which reads only the post-processor where there is a tokenizer.json).
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        # True would rewrite " ." as "." and so break the decode round trip.
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    if chat_template is not None:
        config["chat_template"] = chat_template

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / name for name in ("tokenizer.json", "tokenizer_config.json",
                                           "special_tokens_map.json")]
    tok.save(str(paths[0]))
    for path, obj in zip(paths[1:], (config, names)):
        path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return paths


def generation_config(tokenizer: Tokenizer) -> dict:
    """The token ids of a generation_config.json: bos_token_id, eos_token_id (a list of every
    id that ends a generation - for LLaMA 3 <|end_of_text|>, <|eom_id|>, <|eot_id|>) and
    pad_token_id when the tokenizer has a pad token."""
    out: dict = {}
    if tokenizer.bos_id is not None:
        out["bos_token_id"] = tokenizer.bos_id
    stops = list(dict.fromkeys([*tokenizer.stop_ids] +
                               ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])))
    if stops:
        out["eos_token_id"] = stops
    if tokenizer.pad_id is not None:
        out["pad_token_id"] = tokenizer.pad_id
    return out


# -- LLaMA 3: tiktoken ranks -> byte-level BPE ---------------------------------------------------

def _from_tiktoken(tokenizer: Tokenizer):
    """tiktoken merges, at each step, the adjacent pair whose concatenation has the lowest rank,
    and takes a whole pre-token that is itself a token as is. A `tokenizers` BPE does the same
    when every split (a, b) of every token t into two tokens is a merge of priority rank(t),
    and ignore_merges=True (as in Meta's own tokenizer.json)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    to_chars = {b: c for b, c in enumerate(_byte_level_chars())}
    # rank order = merge priority order; bytes -> GPT-2's printable stand-ins, one char per byte
    tokens = [t.decode("latin-1").translate(to_chars)
              for t, _ in sorted(tokenizer._ranks.items(), key=lambda kv: kv[1])]
    vocab = {t: rank for rank, t in enumerate(tokens)}
    merges = [(t[:i], t[i:]) for t in tokens for i in range(1, len(t))
              if t[:i] in vocab and t[i:] in vocab]

    tok = RustTokenizer(models.BPE(vocab, merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in LLAMA3_SPECIALS])
    _check_specials(tok, tokenizer)
    return tok


# -- LLaMA 2: SentencePiece BPE -> BPE with byte fallback ----------------------------------------

def _from_sentencepiece(tokenizer: Tokenizer):
    """SentencePiece's BPE merges, at each step, the adjacent pair whose concatenation is a
    normal piece of the highest score, the leftmost on a tie. A `tokenizers` BPE does the same
    when every split of every normal piece into two normal pieces is a merge, ordered by the
    piece's score. LLaMA 2's whitespace pieces ▁▁ .. ▁×16 all score -1e9, so they come
    last (ranking ▁+▁ first, by the id 259 of ▁▁, as transformers' converter does, turns two
    spaces before "The" into ▁▁ + The where SentencePiece gives ▁ + ▁The). Within one score
    SentencePiece grows the leftmost symbol a ▁ at a time; "longer piece first" does too."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as RustTokenizer

    sp = tokenizer._sp
    if sp.id_to_piece(sp.unk_id()) != "<unk>" or sp.bos_id() < 0:
        raise BridgeError(f"SentencePiece model: expected <unk> and a bos piece, as LLaMA 2 has "
                          f"(unk {sp.id_to_piece(sp.unk_id())!r}, bos id {sp.bos_id()})")
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {p: i for i, p in enumerate(pieces)}
    normal = {p: sp.get_score(i) for i, p in enumerate(pieces)
              if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))}
    merges = sorted(((p[:k], p[k:]) for p in normal for k in range(1, len(p))
                     if p[:k] in normal and p[k:] in normal),
                    key=lambda m: (-normal[m[0] + m[1]], -len(m[0] + m[1]), vocab[m[0] + m[1]]))

    tok = RustTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    # add_dummy_prefix: a "▁" in front; spaces become "▁". No pre-tokenizer: like SentencePiece,
    # BPE sees the whole text as one word.
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False)
                            for i, p in enumerate(pieces) if sp.is_control(i) or sp.is_unknown(i)])
    _check_specials(tok, tokenizer)
    return tok


# -- a tokenizer.json already, or raw bytes ------------------------------------------------------

def _from_hf(tokenizer: Tokenizer):
    """A copy of the tokenizer (the post-processor gets replaced; the original stays as is)."""
    from tokenizers import Tokenizer as RustTokenizer

    return RustTokenizer.from_str(tokenizer._tok.to_str())


def _from_bytes(tokenizer: Tokenizer):
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    tok = RustTokenizer(models.BPE({c: b for b, c in enumerate(_byte_level_chars())}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in tokenizer.SPECIALS])
    _check_specials(tok, tokenizer)
    return tok


def _check_specials(tok, tokenizer: Tokenizer) -> None:
    """The special tokens must land on the ids the model was trained with."""
    for name, i in tokenizer.special_tokens.items():
        if tok.token_to_id(name) != i:
            raise BridgeError(f"{tokenizer.kind} tokenizer: special token {name!r} would get id "
                              f"{tok.token_to_id(name)} in tokenizer.json, expected {i}")
