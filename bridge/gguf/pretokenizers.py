"""llama.cpp's BPE pre-tokenizers as data: for each tokenizer.ggml.pre name, the regexes that cut
text into pieces before BPE, and the flags that change ids. (The tokens llama.cpp knows by name,
those that end a generation and the FIM ones, hold for every tokenizer: bridge.tokenizer.stops.)

Source: llama-cpp-python 0.3.36, vendor/llama.cpp/src/llama-vocab.cpp - the regex lists are the
`regex_exprs` of `llm_tokenizer_bpe`'s constructor, one per LLAMA_VOCAB_PRE_TYPE_* (the constant
names below; a comment lists every type that shares one list), and the name -> type / flag table
is `llama_vocab::impl::load`'s `tokenizer_pre == ...` chain, in its order. Each regex splits every
piece the one before it left; its matches and the gaps between them both become pieces
(unicode.cpp, unicode_regex_split) - `tokenizers`' Split(behavior="isolated") in a Sequence.

The strings are llama.cpp's (its "adapted" forms, e.g. '[sS] for (?i:'s)), with every non-ASCII
character written as Oniguruma's \\x{HHHH}, so that the file is ASCII and no editor's Unicode
normalisation can change a range (NFC turns U+1F7D into U+03CE, emptying DEEPSEEK_LLM's range
U+1F5F-U+1F7D). `oniguruma` turns one into the pattern that `tokenizers` (Oniguruma) runs with
the same matches; the notes there say where llama.cpp's regex engine and Oniguruma part.

Left out, since llama.cpp implements them in code no regex expresses: kimi-k2 (its Han / non-Han
letter rules, unicode_regex_split_custom_kimi_k2) and whitespace (tokenizer model "whitespace",
its own session); see NOT_REBUILT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Pre:
    """One pre-tokenizer: `splits` as llama.cpp writes them, and its flags."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is taken whole, unmerged
    add_bos: bool = False        # BOS opens a text where tokenizer.ggml.add_bos_token is absent
    bos: bool = True             # False: no default BOS id (only tokenizer.ggml.bos_token_id)
    byte_level: bool = True      # False: BPE over raw UTF-8, spaces as "\u2581", <0xXX> bytes
    force_bos: bool = False      # BOS opens a text even where add_bos_token is false (Gemma 4)


# -- the regex lists, one per LLAMA_VOCAB_PRE_TYPE_* ---------------------------------------------

_LLAMA3 = (  # LLAMA3, DBRX, SMAUG, CHATGLM4
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_JAIS2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|"
    r"\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
)
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-z\x{00B5}\x{00C0}-\x{00D6}\x{00D8}-\x{00F6}\x{00F8}-\x{01BA}\x{01BC}-\x{01BF}"
    r"\x{01C4}-\x{0293}\x{0295}-\x{02AF}\x{0370}-\x{0373}\x{0376}\x{0377}\x{037B}-\x{037D}"
    r"\x{037F}\x{0386}\x{0388}-\x{038A}\x{038C}\x{038E}-\x{03A1}\x{03A3}-\x{03F5}\x{03F7}-"
    r"\x{0481}\x{048A}-\x{052F}\x{0531}-\x{0556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-"
    r"\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-"
    r"\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-"
    r"\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}"
    r"\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}"
    r"\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-"
    r"\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}"
    r"\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-"
    r"\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-"
    r"\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-"
    r"\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}"
    r"-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+",
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
    r"\s+$",
    r"[\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}]+",
    r"\p{N}+",
)
_DEEPSEEK3_LLM = (  # DEEPSEEK3_LLM, HUNYUAN_DENSE, JOYAI_LLM, HY_V4
    r"\p{N}{1,3}",
    r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
    r'[!"#$%&'
    r"'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_SPARK2_5 = (
    r"\p{N}{1,3}",
    r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
    r'[!"#$%&'
    r"'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
    r"\p{N}",
)
_YOUTU = (
    r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}"
    r"\x{2014}\x{FF1A}\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|"
    r"[\x{3105}-\x{312F}]+|[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|"
    r"'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{L"
    r"o}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|"
    r"'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEEPSEEK_CODER = (
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    r"[\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}]+",
    r"\p{N}",
)
_FALCON = (
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
)
_STARCODER = (  # STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)
_GPT2 = (  # GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)
_STABLELM2 = (  # STABLELM2, QWEN2, HUNYUAN, SOLAR_OPEN, GROK_2
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
    r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
)
_PORO = (  # PORO, BLOOM, GPT3_FINNISH
    r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{0964}\x{06D4}\x{060C})]+",
)
_VIKING = (
    r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{0964}\x{06D4}\x{060C})]+",
    r"\p{N}",
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|"
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_CHAMELEON = (
    r"<sentinel:[0-9]+>",
    r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    r"([\t\n]|    |  )",
    r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)
_GPT4O = (  # GPT4O, MINIMAX_M2
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|"
    r"'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+("
    r"(?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|"
    r"'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_GRANITE_EMB_MULTI = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|"
    r"'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z"
    r"]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|"
    r"'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
)
_TINY_AYA = (
    r"\d{1,3}(?=(?:\d{3})*\b)",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|"
    r"'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{L"
    r"o}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|"
    r"'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
)
_SUPERBPE = (
    r"\p{N}+",
    r"(?=(\d{3})+(?!\d))",
)
_BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
)
_SEED_CODER = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_UFAKZEKA = (
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_AFMOE = (
    r"\p{AFMoE_digits}",
    r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{8C48}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF}"
    r"\x{FF65}-\x{FF9F}\x{2F00}-\x{2FDF}\x{0E40}-\x{0E7F}\x{0E80}-\x{0EFF}\x{1780}-\x{17FF}"
    r"\x{1000}-\x{109F}\x{AA60}-\x{AA7F}\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+",
    r'[!"#$%&'
    r"'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_LAGUNA = (
    r"[^\n]+|[\n]+",
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_EXAONE_MOE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
    r"[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
)
_GEMMA4 = (  # GEMMA4, SARVAM_MOE
    r"[^\n]+|[\n]+",
)
_MINICPM5 = (
    r"\p{N}{1,3}",
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


# -- tokenizer.ggml.pre name -> pre-tokenizer ----------------------------------------------------
# (A missing tokenizer.ggml.pre is "default", as llama.cpp takes it; a comment names the type
# where it is not the constant's.)

PRE_TOKENIZERS: dict[str, Pre] = {
    "default": Pre(_DEFAULT),
    "minicpm5": Pre(_MINICPM5, ignore_merges=True),
    "llama3": Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "llama-v3": Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "llama-bpe": Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "falcon3": Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "falcon-h1": Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "pixtral": Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "midm-2.0": Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "lfm2": Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "jina-v5-nano": Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    "deepseek-llm": Pre(_DEEPSEEK_LLM),
    "deepseek-coder": Pre(_DEEPSEEK_CODER),
    "deepseek-v3": Pre(_DEEPSEEK3_LLM),
    "spark2_5": Pre(_SPARK2_5),
    "youtu": Pre(_YOUTU, ignore_merges=True),
    "falcon": Pre(_FALCON),
    "mpt": Pre(_GPT2),  # MPT
    "starcoder": Pre(_STARCODER),
    "gpt-2": Pre(_GPT2),
    "phi-2": Pre(_GPT2),
    "jina-es": Pre(_GPT2),
    "jina-de": Pre(_GPT2),
    "gigachat": Pre(_GPT2),
    "jina-v2-es": Pre(_GPT2),
    "jina-v2-de": Pre(_GPT2),
    "a.x-4.0": Pre(_GPT2),
    "mellum": Pre(_GPT2),
    "modern-bert": Pre(_GPT2),
    "jais-2": Pre(_JAIS2),
    "gemma4": Pre(_GEMMA4, byte_level=False, force_bos=True),
    "granite-embed-multi-311m": Pre(_GEMMA4, byte_level=False, force_bos=True),  # GEMMA4
    "sarvam-moe": Pre(_GEMMA4, byte_level=False),  # SARVAM_MOE
    "jina-v1-en": Pre(_GPT2),
    "jina-v2-code": Pre(_GPT2),
    "roberta-bpe": Pre(_GPT2),
    "refact": Pre(_STARCODER),  # REFACT
    "command-r": Pre(_STARCODER),  # COMMAND_R
    "qwen2": Pre(_STABLELM2),  # QWEN2
    "deepseek-r1-qwen": Pre(_STABLELM2),  # QWEN2
    "kormo": Pre(_STABLELM2),  # QWEN2
    "f2llmv2": Pre(_STABLELM2),  # QWEN2
    "qwen35": Pre(_QWEN35),
    "stablelm2": Pre(_STABLELM2),
    "olmo": Pre(_GPT2),  # OLMO
    "dbrx": Pre(_LLAMA3),  # DBRX
    "smaug-bpe": Pre(_LLAMA3),  # SMAUG
    "poro-chat": Pre(_PORO),
    "chatglm-bpe": Pre(_LLAMA3, bos=False),  # CHATGLM4
    "glm4": Pre(_LLAMA3, ignore_merges=True, bos=False),  # CHATGLM4
    "glm5": Pre(_LLAMA3, ignore_merges=True, bos=False),  # CHATGLM4
    "viking": Pre(_VIKING),
    "jais": Pre(_GPT2),  # JAIS
    "tekken": Pre(_TEKKEN, ignore_merges=True, add_bos=True),
    "smollm": Pre(_STARCODER),  # SMOLLM
    "codeshell": Pre(_STARCODER),  # CODESHELL
    "bloom": Pre(_PORO),  # BLOOM
    "gpt3-finnish": Pre(_PORO),  # GPT3_FINNISH
    "exaone": Pre(_STARCODER),  # EXAONE
    "exaone4": Pre(_GPT2),
    "exaone-moe": Pre(_EXAONE_MOE),
    "chameleon": Pre(_CHAMELEON, add_bos=True),
    "minerva-7b": Pre(_STARCODER),  # MINERVA
    "megrez": Pre(_STABLELM2),  # QWEN2
    "gpt-4o": Pre(_GPT4O),
    "llama4": Pre(_GPT4O),
    "kanana2": Pre(_GPT4O),
    "talkie": Pre(_GPT4O),
    "granite-embed-multi-97m": Pre(_GRANITE_EMB_MULTI, ignore_merges=True),
    "tiny_aya": Pre(_TINY_AYA),
    "cohere2moe": Pre(_TINY_AYA),
    "superbpe": Pre(_SUPERBPE),
    "trillion": Pre(_GPT2),  # TRILLION
    "granite-docling": Pre(_GPT2),  # GRANITE_DOCLING
    "bailingmoe": Pre(_BAILINGMOE),
    "bailingmoe2": Pre(_BAILINGMOE),
    "llada-moe": Pre(_BAILINGMOE),
    "seed-coder": Pre(_SEED_CODER),
    "hunyuan": Pre(_STABLELM2),  # HUNYUAN
    "hunyuan-dense": Pre(_DEEPSEEK3_LLM),  # HUNYUAN_DENSE
    "hy_v4": Pre(_DEEPSEEK3_LLM),  # HY_V4
    "joyai-llm": Pre(_DEEPSEEK3_LLM),  # JOYAI_LLM
    "ufakzeka": Pre(_UFAKZEKA),
    "grok-2": Pre(_STABLELM2),  # GROK_2
    "afmoe": Pre(_AFMOE),
    "laguna": Pre(_LAGUNA),
    "minimax-m2": Pre(_GPT4O),  # MINIMAX_M2
    "solar-open": Pre(_STABLELM2),  # SOLAR_OPEN
    "mellum2": Pre(_STARCODER),  # MELLUM2
}

NOT_REBUILT = {
    "kimi-k2": "llama.cpp splits it with hand-written Han / non-Han letter rules",
    "whitespace": "llama.cpp's whitespace tokenizer has a session of its own",
}


# -- llama.cpp's regexes as Oniguruma patterns --------------------------------------------------

# unicode.cpp runs some regexes with hand-written code (unicode_regex_split_custom): for GPT-2's,
# LLaMA 3's, Qwen 2's, Qwen 3.5's and the newline split, code that matches the regex as written;
# for AFMoE's and tiny_aya's digit rules, code that cuts a run of \p{N} into groups of three from
# the right and joins the text before the run to its first group (which a later regex may cut
# differently than had it been a piece of its own: "a  1" keeps its two spaces apart).
_DIGIT_GROUPS = r"\P{N}*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
_CUSTOM = {r"\p{AFMoE_digits}": _DIGIT_GROUPS, r"\d{1,3}(?=(?:\d{3})*\b)": _DIGIT_GROUPS}
# The rest run in std::regex (ECMAScript). A regex that uses one of these categories runs on a
# "collapsed" text, each non-ASCII character replaced by one byte for its category, so \p{Lu} ..
# \p{Lo} all mean \p{L}; any other regex runs with each non-ASCII whitespace character replaced
# by \v, so that a bracket class never matches one. \d is ASCII, $ is the end of the piece.
_CATEGORIES = (r"\p{N}", r"\p{L}", r"\p{P}", r"\p{M}", r"\p{S}")
_NON_ASCII_SPACE = (0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F,
                    0x3000)  # unicode-data.cpp, unicode_set_whitespace
_SPACE_CLASS = "".join(f"\\x{{{c:X}}}" for c in _NON_ASCII_SPACE)


def oniguruma(regex: str) -> str:
    """The Oniguruma pattern that splits text as llama.cpp's `regex` does."""
    if regex in _CUSTOM:
        return _CUSTOM[regex]
    out = re.sub(r"\\p\{L[ultmo]\}", lambda m: r"\p{L}", regex)
    out = re.sub(r"(?<!\\)\\d", lambda m: "[0-9]", out)
    out = re.sub(r"(?<!\\)\$(?=\||\)|$)", lambda m: r"\z", out)
    if not any(c in regex for c in _CATEGORIES):
        out = re.sub(r"\[(?!\^)((?:\\x\{[0-9A-F]+\}|\\.|[^\]\\])+)\]", _without_spaces, out)
    return out


def _without_spaces(m: re.Match) -> str:
    """A bracket class less the non-ASCII whitespace it holds, if it holds any."""
    atoms = re.findall(r"\\x\{([0-9A-F]+)\}|\\(.)|(.)", m.group(1))
    cps = [int(h, 16) if h else None if e else ord(c) for h, e, c in atoms]  # None: \s, \-, ..
    spans = [(c, c) for c in cps if c is not None] + [
        (cps[i], cps[i + 2]) for i in range(len(atoms) - 2)
        if atoms[i + 1][2] == "-" and None not in (cps[i], cps[i + 2])]
    if not any(a <= s <= b for a, b in spans for s in _NON_ASCII_SPACE):
        return m.group(0)
    return f"[{m.group(1)}&&[^{_SPACE_CLASS}]]"


def split_patterns(pre: Pre) -> tuple[str, ...]:
    """The Oniguruma patterns of `pre`, in order: what a tokenizer.json's Split steps hold."""
    return tuple(oniguruma(r) for r in pre.splits)

