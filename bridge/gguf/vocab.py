"""A tokenizer as GGUF's tokenizer.ggml.* keys (export).

Export, as llama.cpp's converter writes them:
    llama2  tokenizer.ggml.model "llama" (SentencePiece): pieces, scores and token types straight
            from the model; pre "default".
    llama3  "gpt2" (byte-level BPE), pre "llama-bpe": the 128,000 ranks as GPT-2 byte-level
            strings, merges, the 256 special tokens as CONTROL.
    hf      "gpt2" for a byte-level BPE tokenizer.json, pre the name bridge.gguf.pretokenizers
            gives its splits (the one it was rebuilt from GGUF with, where it was; else the
            writer's choice, "qwen2" for a Qwen model, where it fits); others (a
            SentencePiece-style BPE with byte fallback) are refused by name.
    bytes   "gpt2", pre "gpt-2", no merges: id b is byte b.
The byte-level vocabularies and merges are those of bridge.hf_tokenizer's tokenizer.json, so one
construction serves both exports. Ids up to the model's vocab_size that the tokenizer does not
use become "[PAD{i}]" (UNUSED), as llama.cpp pads them. BOS, EOS, EOT / EOM (LLaMA 3), UNK, pad
ids; add_bos_token / add_eos_token as the tokenizer's add_bos / add_eos.

Import (the keys as the tokenizer llama.cpp runs) is bridge.gguf.tokenizer's.
"""

from __future__ import annotations

import json

from ..errors import BridgeError
from ..hf_tokenizer import _from_bytes, _from_hf, _from_tiktoken
from ..tokenizer import Tokenizer
from .pretokenizers import PRE_TOKENIZERS, split_patterns
from .tokenizer import (BYTE, CONTROL, GGUF_PRE_KEY, NORMAL, UNKNOWN, UNUSED, USER_DEFINED,
                             _pad)

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


# -- export ----------------------------------------------------------------------------------------

def vocab_keys(tokenizer: Tokenizer, vocab_size: int, chat_template: str | None = None,
               pre: str | None = None) -> list[tuple[str, object]]:
    """(GGUFWriter method, value) pairs that write `tokenizer` as llama.cpp reads it, for a model
    of `vocab_size` ids; `pre` the pre-tokenizer name to write where it has the tokenizer's
    splits and no name came with the tokenizer (several names share one regex list)."""
    if tokenizer.vocab_size > vocab_size:
        raise BridgeError(f"the tokenizer's {tokenizer.vocab_size} ids do not fit the model's "
                          f"vocab_size {vocab_size}", field="tokenizer")
    if tokenizer.kind == "llama2":
        keys = _sentencepiece_keys(tokenizer, vocab_size)
    elif tokenizer.kind in ("llama3", "hf", "bytes"):
        keys = _byte_level_keys(tokenizer, vocab_size, pre)
    else:
        raise BridgeError(f"no GGUF vocabulary for a tokenizer of kind {tokenizer.kind!r}",
                          field="tokenizer")
    ids = [("add_bos_token_id", tokenizer.bos_id), ("add_eos_token_id", tokenizer.eos_id),
           ("add_pad_token_id", tokenizer.pad_id)]
    specials = tokenizer.special_tokens
    ids += [("add_eot_token_id", specials.get("<|eot_id|>")),
            ("add_eom_token_id", specials.get("<|eom_id|>"))]
    ids.append(("add_unk_token_id", tokenizer.unk_id))
    keys += [(method, i) for method, i in ids if i is not None]
    keys += [("add_add_bos_token", tokenizer.add_bos), ("add_add_eos_token", tokenizer.add_eos)]
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


def _byte_level_keys(tokenizer: Tokenizer, vocab_size: int, prefer: str | None
                     ) -> list[tuple[str, object]]:
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
    stored = tokenizer._config.get(GGUF_PRE_KEY) if tokenizer.kind == "hf" else None
    pre = _pre_name(spec.get("pre_tokenizer"), bool(model.get("ignore_merges")), bool(merges),
                    stored, prefer)
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


def _pre_name(pre_tokenizer: dict | None, ignore_merges: bool, has_merges: bool,
              stored: str | None = None, prefer: str | None = None) -> str:
    """llama.cpp's name for the pre-tokenizer (the splits that cut text before BPE): `stored`
    (the name a tokenizer rebuilt from GGUF came with) where it still describes it, else
    `prefer` where it does, else the first name of bridge.gguf.pretokenizers with the same
    splits and ignore_merges."""
    splits = _splits(pre_tokenizer)
    fits = [name for name, pre in PRE_TOKENIZERS.items() if pre.byte_level and
            split_patterns(pre) == splits and pre.ignore_merges == ignore_merges]
    for name in (stored, prefer):
        if name in fits:
            return name
    if fits:
        return next((name for name in ("gpt-2", "llama-bpe") if name in fits), fits[0])
    if not has_merges:  # each byte its own token: how the text is cut cannot change the ids
        return "gpt-2"
    raise BridgeError(f"a byte-level BPE whose pre-tokenizer llama.cpp has no name for "
                      f"({json.dumps(pre_tokenizer)[:120]}); GGUF export takes the splits of "
                      f"bridge.gguf.pretokenizers", field="tokenizer")


def _splits(pre_tokenizer: dict | None) -> tuple[str, ...] | None:
    """A tokenizer.json pre-tokenizer as the regexes it splits by, in Oniguruma's form (the
    case-insensitive (?i:'s|..) as llama.cpp's '[sS]|..); None if something else happens."""
    parts = (pre_tokenizer or {}).get("pretokenizers", [pre_tokenizer or {}])
    gpt2 = split_patterns(PRE_TOKENIZERS["gpt-2"])[0]
    out = []
    for i, part in enumerate(parts):
        kind = part.get("type")
        if kind == "Split" and part.get("behavior") == "Isolated" and not part.get("invert") \
                and "Regex" in part.get("pattern", {}):
            regex = part["pattern"]["Regex"].replace(
                "(?i:'s|'t|'re|'ve|'m|'ll|'d)",
                "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])")
            out.append(gpt2 if regex == GPT2_PATTERN else regex)
        elif kind == "Digits":
            out.append(r"\p{N}" if part.get("individual_digits") else r"\p{N}+")
        elif kind == "ByteLevel" and i == len(parts) - 1 and not part.get("add_prefix_space"):
            out += [gpt2] if part.get("use_regex", True) else []
        else:
            return None
    return tuple(out) if parts and parts[-1].get("type") == "ByteLevel" else None
