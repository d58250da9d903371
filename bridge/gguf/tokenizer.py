"""A GGUF file's tokenizer.ggml.* keys as the tokenizer llama.cpp runs (import; the export is
bridge.gguf.vocab's).

The tokenizer encodes text as llama.cpp's llama_tokenize(add_special=false,
parse_special=allow_special) does (llama-cpp-python 0.3.36's llama-vocab.cpp), checked against
llama.cpp's own tokenizer suite (tests/test_gguf_vocab.py):
    "gpt2" / "gemma4"  a `tokenizers` BPE (kind "hf", saved as tokenizer.json +
            tokenizer_config.json): the pre-tokenizer's splits from bridge.gguf.pretokenizers,
            GGUF's merges in rank order, control tokens as special added tokens and user-defined
            ones as plain added tokens; LLaMA 3's own vocabulary as tiktoken's ranks instead.
    "llama" a SentencePiece BPE model (kind "llama2", saved as tokenizer.model).
Token classes, BOS / EOS / stop ids and add_bos follow llama.cpp, its defaults and its fix-ups by
token name included. Other models (bert, t5, rwkv, ...) and pre-tokenizers llama.cpp implements
in code come back as None with a one-line note saying so.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import BridgeError
from ..tokenizer.bos_eos import BosEos
from ..tokenizer.kinds import (LLAMA3_SPECIALS, HFTokenizer, Llama2Tokenizer, Llama3Tokenizer,
                               Tokenizer, _byte_level_chars)
from ..tokenizer.stops import EOG_NAMES, fim_ids, llama_cpp_stop_ids
from .container import read_gguf
from .pretokenizers import NOT_REBUILT, PRE_TOKENIZERS, Pre, split_patterns

# llama.cpp's token types (gguf.TokenType), the same numbers as SentencePiece's piece types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# tokenizer_config.json key where a tokenizer rebuilt from GGUF keeps its tokenizer.ggml.pre name,
# so that an export writes the same one back (several names share one set of splits).
GGUF_PRE_KEY = "gguf_tokenizer_pre"


def _pad(i: int) -> str:
    """llama.cpp's name for an id the model has and its tokenizer does not use."""
    return f"[PAD{i}]"


# What llama.cpp takes where a file names no special token (llama_vocab::impl::load, by
# tokenizer.ggml.model): "gpt2"'s 11 is the BOS and EOS it assumes for any BPE vocabulary.
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11},
                "gemma4": {}}
_ID_KEYS = {"bos": ["bos_token_id"], "eos": ["eos_token_id"], "unk": ["unknown_token_id"],
            "pad": ["padding_token_id"], "eot": ["eot_token_id"], "eom": ["eom_token_id"],
            **{f"fim_{k}": [f"fim_{k}_token_id"] + old for k, old in (
                ("pre", ["prefix_token_id"]), ("suf", ["suffix_token_id"]),
                ("mid", ["middle_token_id"]), ("pad", []), ("rep", []), ("sep", []))}}
# gpt-oss's tokens llama.cpp always treats as user-defined (its "quick hack").
_USER_DEFINED_NAMES = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
_HOW_TO = "pass --tokenizer FILE / tokenizer=..."


def gguf_file_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a GGUF file (a model, or a vocabulary-only file such as llama.cpp's
    ggml-vocab-*.gguf); BridgeError naming the file when it has none we rebuild."""
    path = Path(path)
    return gguf_tokenizer(read_gguf(path).fields, path)


def gguf_tokenizer(fields: dict, where: str | Path) -> Tokenizer:
    """gguf_file_tokenizer from the file's keys already read (bridge.gguf.container), `where`
    naming the file in the error."""
    tokenizer, note = tokenizer_from_gguf(fields, where)
    if tokenizer is None:
        raise BridgeError(f"{where}: {note}")
    return tokenizer


def tokenizer_from_gguf(fields: dict, where: str | Path) -> tuple[Tokenizer | None, str | None]:
    """The tokenizer that llama.cpp runs for the tokenizer.ggml.* keys among `fields` (a GGUF
    file's metadata, bridge.gguf.container), and a one-line note for inspect; (None, why)
    where it is not rebuilt."""
    return _rebuild(fields, Path(where))


def tokenizer_files(fields: dict, directory: Path, where: Path) -> tuple[list[Path], str | None]:
    """The GGUF vocabulary among `fields` saved as tokenizer file(s) into `directory`; returns
    (paths, a note for inspect or None)."""
    tokenizer, note = tokenizer_from_gguf(fields, where)
    return ([] if tokenizer is None else tokenizer.save(directory)), note


def _rebuild(fields: dict, where: Path) -> tuple[Tokenizer | None, str | None]:
    model = fields.get("tokenizer.ggml.model")
    if model is None:
        return None, "no tokenizer in the file (no tokenizer.ggml.* keys)"
    if model in ("none", "no_vocab"):
        return None, f"no vocabulary in the file (tokenizer.ggml.model {model!r})"
    pre = "gemma4" if model == "gemma4" else fields.get("tokenizer.ggml.pre") or "default"
    if model not in _DEFAULT_IDS or (model != "llama" and pre not in PRE_TOKENIZERS):
        why = (NOT_REBUILT.get(pre) or "a pre-tokenizer llama-cpp-python 0.3.36 does not know"
               if model in _DEFAULT_IDS else "a tokenizer model other than BPE or SentencePiece")
        return None, (f"tokenizer not rebuilt: tokenizer.ggml.model {model!r}, pre {pre!r} "
                      f"({why}); {_HOW_TO}")
    vocab = _Vocab(fields, model, pre, where)
    if model == "llama":
        tokenizer = vocab.sentencepiece()
        return tokenizer, "tokenizer: SentencePiece model rebuilt from the GGUF vocabulary" + (
            f"; a saved tokenizer.model puts no space after its {len(vocab.user)} user-defined "
            f"tokens, where llama.cpp does" if vocab.user and vocab.space_prefix else "")
    if PRE_TOKENIZERS[pre] == PRE_TOKENIZERS["llama-bpe"] and _is_llama3(vocab.tokens):
        return vocab.tiktoken(), "tokenizer: LLaMA 3 ranks rebuilt from the GGUF vocabulary"
    return vocab.byte_pair(PRE_TOKENIZERS[pre]), (
        f"tokenizer: tokenizer.json rebuilt from the GGUF vocabulary ({model}, pre {pre})"
        + (f"; {vocab.dropped} merges dropped (their result is no token)" if vocab.dropped else ""))


class _Vocab:
    """The tokenizer.ggml.* keys, checked, with the token classes llama.cpp gives them."""

    def __init__(self, fields: dict, model: str, pre: str, where: Path):
        self.fields, self.model, self.pre, self.where = fields, model, pre, where
        tokens = self._list("tokenizer.ggml.tokens", str)
        types = self._list("tokenizer.ggml.token_type", int, [NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise BridgeError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for "
                              f"{len(tokens)} tokens")
        while tokens and types[-1] == UNUSED and tokens[-1] == _pad(len(tokens) - 1):
            tokens, types = tokens[:-1], types[:-1]  # the model's spare ids, not the tokenizer's
        self.tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp names them
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        if len(self.vocab) != len(self.tokens):
            dup = next(t for i, t in enumerate(self.tokens) if self.vocab[t] != i)
            raise BridgeError(f"{where}: tokenizer.ggml.tokens holds {dup!r} twice (ids "
                              f"{self.tokens.index(dup)} and {self.vocab[dup]})")
        defaults = dict(_DEFAULT_IDS[model])
        if model == "gpt2" and not PRE_TOKENIZERS[pre].bos:
            defaults.pop("bos")
        self.ids = {name: self._id(keys, defaults.get(name)) for name, keys in _ID_KEYS.items()}
        self.add_bos = self._flag("add_bos_token", model == "llama" or
                                  PRE_TOKENIZERS.get(pre, PRE_TOKENIZERS["default"]).add_bos)
        self.add_eos = self._flag("add_eos_token", False)
        self.decided_by = "; ".join(
            f"the GGUF file's tokenizer.ggml.{key}" if f"tokenizer.ggml.{key}" in fields else
            f"{key}: llama.cpp's default for a {model!r} vocabulary (pre {pre!r})"
            for key in ("add_bos_token", "add_eos_token"))
        self.special, self.user = self._classes(types)
        self.types = types

    def _list(self, key: str, kind, default: list | None = None) -> list:
        value = self.fields.get(key, default)
        if value is None:
            raise BridgeError(f"{self.where}: {key} is missing")
        exact = set(kind) if isinstance(kind, tuple) else {kind}
        if not isinstance(value, list) or not (  # the types themselves first: 10x faster
                set(map(type, value)) <= exact
                or all(isinstance(v, kind) and not isinstance(v, bool) for v in value)):
            what = "strings" if kind is str else "numbers"
            raise BridgeError(f"{self.where}: {key} is not a list of {what}")
        return value

    def _id(self, keys: list[str], default: int | None) -> int | None:
        for key in keys:
            value = self.fields.get(f"tokenizer.ggml.{key}")
            if value is None:
                continue
            if not isinstance(value, int) or not 0 <= value < len(self.tokens):
                raise BridgeError(f"{self.where}: tokenizer.ggml.{key} is {value!r}, not an id of "
                                  f"the {len(self.tokens)} tokens")
            return value
        return default if default is not None and default < len(self.tokens) else None

    def _flag(self, key: str, default: bool) -> bool:
        value = self.fields.get(f"tokenizer.ggml.{key}", default)
        if not isinstance(value, bool):
            raise BridgeError(f"{self.where}: tokenizer.ggml.{key} is {value!r}, not a boolean")
        forced = PRE_TOKENIZERS.get(self.pre, Pre(())).force_bos
        return value or (key == "add_bos_token" and forced)

    def _classes(self, types: list[int]) -> tuple[set[int], set[int]]:
        """(ids matched in text only with parse_special: llama.cpp's CONTROL / UNKNOWN tokens,
        ids always matched in text: its USER_DEFINED ones), after llama.cpp's overrides by name:
        end-of-generation and FIM tokens become control, gpt-oss's user-defined."""
        special = {i for i, k in enumerate(types) if k in (CONTROL, UNKNOWN)}
        user = {i for i, k in enumerate(types) if k == USER_DEFINED}
        fim = fim_ids(self.vocab)
        named = {self.vocab[n] for n in EOG_NAMES if n in self.vocab}
        named |= {i for kind, i in fim.items() if self.ids[f"fim_{kind}"] is None}
        special |= named
        stops = set(self.stop_ids())
        for i in named - stops:  # llama.cpp's exceptions to its stop names become plain again
            if self.tokens[i] == "</s>":
                special.discard(i)
        for name in _USER_DEFINED_NAMES + tuple(self.tokens[i] for i in named - stops
                                                 if self.tokens[i] == "<|end|>"):
            if name in self.vocab:
                special.discard(self.vocab[name])
                user.add(self.vocab[name])
        return special, user - special

    def _strips(self) -> tuple[set[int], set[int]]:
        """(ids llama.cpp strips the whitespace before, ids it strips the whitespace after),
        llama.cpp's attributes by model name (llama_vocab::impl::load, "set attributes by
        model/tokenizer/architecture name")."""
        name = str(self.fields.get("general.name", "")).lower()
        arch = str(self.fields.get("general.architecture", ""))
        if any(p in self.pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
                any(a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
            return {self.vocab[t] for t in ("<mask>",) if t in self.vocab}, set()
        if "phi-3" in name or "phi3" in name:
            keep = {self.vocab.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")}
            return set(), (self.special | self.user | {self.vocab.get("</s>")}) - keep - {None}
        if "modern-bert" in name:
            return {self.vocab[t] for t in ("[MASK]",) if t in self.vocab}, set()
        return set(), set()

    def stop_ids(self) -> tuple[int, ...]:
        fim = fim_ids(self.vocab)
        ids = self.ids
        return llama_cpp_stop_ids(self.vocab, [ids["eos"], ids["eot"], ids["eom"]] + [
            ids[f"fim_{k}"] if ids[f"fim_{k}"] is not None else fim.get(k)
            for k in ("pad", "rep", "sep")])

    def _finish(self, tokenizer: Tokenizer) -> Tokenizer:
        tokenizer.decide(BosEos(self.add_bos, self.add_eos, self.decided_by))
        tokenizer.stop_ids = self.stop_ids()
        return tokenizer

    # -- the three rebuilds

    def tiktoken(self) -> Tokenizer:
        to_byte = {c: b for b, c in enumerate(_byte_level_chars())}
        n = len(self.tokens) - len(LLAMA3_SPECIALS)
        return self._finish(Llama3Tokenizer({bytes(to_byte[c] for c in t): rank
                                             for rank, t in enumerate(self.tokens[:n])}))

    def sentencepiece(self) -> Tokenizer:
        """A SentencePiece BPE model with llama.cpp's settings: a "▁" before the text where
        tokenizer.ggml.add_space_prefix (default true), spaces as "▁", no whitespace clean-up,
        byte fallback where there are byte pieces; and llama.cpp's cuts at user-defined tokens
        (Llama2Tokenizer._user_defined), which a saved tokenizer.model does not keep."""
        from sentencepiece import sentencepiece_model_pb2 as pb

        scores = self._list("tokenizer.ggml.scores", (int, float), [0.0] * len(self.tokens))
        if len(scores) < len(self.tokens):
            raise BridgeError(f"{self.where}: tokenizer.ggml.scores has {len(scores)} entries "
                              f"for {len(self.tokens)} tokens")
        ids = self.ids
        unk = ids["unk"] if ids["unk"] is not None else 0
        proto = pb.ModelProto()
        for i, (token, score, kind) in enumerate(zip(self.tokens, scores, self.types)):
            piece = proto.pieces.add()
            piece.piece, piece.score = token, float(score)
            piece.type = (UNKNOWN if i == unk else CONTROL if i in self.special or
                          i in (ids["bos"], ids["eos"], ids["pad"]) else
                          USER_DEFINED if i in self.user else kind if kind in (UNUSED, BYTE)
                          else NORMAL)
        spec = proto.trainer_spec
        spec.model_type, spec.vocab_size = pb.TrainerSpec.BPE, len(self.tokens)
        spec.byte_fallback = BYTE in self.types
        spec.unk_id, spec.unk_piece = unk, self.tokens[unk]
        for name in ("bos", "eos", "pad"):
            i = ids[name]
            setattr(spec, f"{name}_id", -1 if i is None else i)
            if i is not None:
                setattr(spec, f"{name}_piece", self.tokens[i])
        norm = proto.normalizer_spec
        norm.name, norm.escape_whitespaces, norm.remove_extra_whitespaces = "identity", True, False
        norm.add_dummy_prefix = self.space_prefix = self._flag("add_space_prefix", True)
        tokenizer = Llama2Tokenizer(proto.SerializeToString(), self.where)
        tokenizer._user_defined = {self.tokens[i]: i for i in self.user}
        tokenizer._lstrip, tokenizer._rstrip = map(frozenset, self._strips())
        return self._finish(tokenizer)

    def byte_pair(self, pre) -> Tokenizer:
        """A `tokenizers` BPE that runs llama.cpp's: the pre-tokenizer's splits, then GPT-2's
        bytes-as-characters (or, for an SPM-style vocabulary, "▁" for spaces and <0xXX> byte
        fallback), merges by rank, the file's control tokens as special added tokens and its
        user-defined ones as plain added tokens (matched in any text, as llama.cpp does)."""
        from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as RustTokenizer

        merges = self._merges()
        tok = RustTokenizer(models.BPE(self.vocab, merges, ignore_merges=pre.ignore_merges,
                                       byte_fallback=not pre.byte_level))
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
                  for r in split_patterns(pre)]
        if pre.byte_level:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            tok.decoder = decoders.ByteLevel()
        else:
            tok.normalizer = normalizers.Replace(" ", "\u2581")
            tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                             decoders.ByteFallback(), decoders.Fuse()])
        lstrip, rstrip = self._strips()
        for ids, special in ((self.special, True), (self.user, False)):
            tok.add_tokens([AddedToken(self.tokens[i], special=special, normalized=False,
                                       lstrip=i in lstrip, rstrip=i in rstrip)
                            for i in sorted(ids)])
        names = {f"{name}_token": None if self.ids[name] is None else self.tokens[self.ids[name]]
                 for name in ("bos", "eos", "pad", "unk")}
        config = {**names, "add_bos_token": self.add_bos, "add_eos_token": self.add_eos,
                  GGUF_PRE_KEY: self.pre}
        template = self.fields.get("tokenizer.chat_template")
        if isinstance(template, str):
            config["chat_template"] = template
        return self._finish(HFTokenizer(tok, config))

    def _merges(self) -> list[tuple[str, str]]:
        """The merges in rank order: the first of a repeated pair counts (as in llama.cpp's
        map); one whose result is no token is dropped (`tokenizers` cannot hold it)."""
        merges, vocab = self._list("tokenizer.ggml.merges", str, []), self.vocab
        cuts = [merge.find(" ", 1) for merge in merges]  # a token may be " " itself
        if -1 in cuts:
            rank = cuts.index(-1)
            raise BridgeError(f"{self.where}: tokenizer.ggml.merges[{rank}] is {merges[rank]!r}, "
                              f"not two tokens separated by a space")
        pairs, seen = [], set()
        for merge, cut in zip(merges, cuts):
            a, b = pair = merge[:cut], merge[cut + 1:]
            if pair not in seen:
                seen.add(pair)
                if a in vocab and b in vocab and a + b in vocab:
                    pairs.append(pair)
        self.dropped = len(seen) - len(pairs)
        return pairs


def _is_llama3(tokens: list[str]) -> bool:
    n = len(tokens) - len(LLAMA3_SPECIALS)
    return n > 256 and tokens[n:] == LLAMA3_SPECIALS
