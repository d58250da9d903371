"""The four kinds of tokenizer this project meets, behind one Tokenizer interface: LLaMA 3
(tiktoken ranks), LLaMA 2 (SentencePiece), Hugging Face tokenizer.json, and raw UTF-8 bytes.
Finding and loading them is bridge.tokenizer's; a GGUF vocabulary becomes one of them in
bridge.gguf.tokenizer.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import BridgeError
from .stops import fim_ids, llama_cpp_stop_ids
from .bos_eos import (BosEos, added_tokens, bos_eos_as_transformers, bos_eos_post_processor,
                      post_processor_json)

EXPECTED = "expected a tiktoken ranks file, a SentencePiece model or a tokenizer.json"


class Tokenizer:
    """text <-> token ids. Subclasses set the attributes and implement _encode/_decode/save."""

    kind: str                        # "llama3" | "llama2" | "hf" | "bytes"
    vocab_size: int                  # every id a model may see, special tokens included
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    unk_id: int | None = None
    special_tokens: dict[str, int]   # name -> id
    stop_ids: tuple[int, ...] = ()   # ids that end a generation
    # Whether an encoded document / prompt opens with BOS and ends with EOS, as the tokenizer's
    # files decide (bridge.tokenizer.bos_eos; a GGUF file's as llama.cpp does), and where that
    # decision comes from, in words. Every plain-text path encodes with bos=add_bos.
    add_bos: bool = False
    add_eos: bool = False
    decided_by: str = ""

    def decide(self, decision: BosEos) -> None:
        """Take `decision` as add_bos / add_eos (and say where it came from)."""
        self.add_bos, self.add_eos, self.decided_by = decision.bos, decision.eos, \
            decision.decided_by

    def encode(self, text: str, bos: bool = False, eos: bool = False,
               allow_special: bool = False) -> list[int]:
        """text -> ids, with bos / eos added on request. Special-token text in `text` (e.g.
        "<|eot_id|>") is plain text unless `allow_special`, so user input cannot forge them."""
        if not isinstance(text, str):
            raise BridgeError(f"encode: text must be a str (got {type(text).__name__})")
        for wanted, name, tid in ((bos, "bos", self.bos_id), (eos, "eos", self.eos_id)):
            if wanted and tid is None:
                raise BridgeError(f"encode: {name}=True, but this {self.kind} tokenizer has no "
                                  f"{name} token")
        return [self.bos_id] * bos + self._encode(text, allow_special) + [self.eos_id] * eos

    def decode(self, ids: Iterable[int]) -> str:
        """ids (any flat iterable of ints: list, numpy array) -> text. Special tokens are kept
        as their text where the kind has one; bytes that are not UTF-8 become U+FFFD."""
        try:
            ids = [int(i) for i in ids]
        except (TypeError, ValueError):
            raise BridgeError("decode: ids must be a flat sequence of integers") from None
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise BridgeError(f"decode: token id {i} is out of range for a vocabulary of "
                                  f"{self.vocab_size} ids")
        return self._decode(ids)

    def save(self, directory: str | Path) -> list[Path]:
        """Write the tokenizer file(s) into `directory` (created if needed); return their paths."""
        raise NotImplementedError

    def _save_flags(self, directory: str | Path) -> Path:
        """tokenizer_config.json beside a tokenizer.model: the BOS / EOS tokens and whether
        they are added, as keys that transformers (and load_tokenizer) read where there is no
        tokenizer.json; return its path."""
        path = Path(directory) / "tokenizer_config.json"
        names = {i: name for name, i in self.special_tokens.items()}
        config = {f"{key}_token": names[i] for key, i in (("bos", self.bos_id),
                                                          ("eos", self.eos_id)) if i in names}
        config.update(add_bos_token=self.add_bos, add_eos_token=self.add_eos)
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return path

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id})")


def _split_on_specials(text: str, specials: dict[str, int]) -> list[str | int]:
    """text -> plain-text pieces interleaved with the ids of the special tokens found in it."""
    if not specials:
        return [text]
    pattern = "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    return [specials[p] if i % 2 else p for i, p in enumerate(re.split(pattern, text)) if p]


# -- LLaMA 3: tiktoken ---------------------------------------------------------------------------

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_NAMED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                 "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
# LLaMA 3.1 names; 3.0 called more of them reserved, with the same ids for the ones used here.
LLAMA3_SPECIALS = _LLAMA3_NAMED + [f"<|reserved_special_token_{3 + i}|>"
                                   for i in range(256 - len(_LLAMA3_NAMED))]
# tiktoken slows down sharply on very long inputs and long runs of (non-)whitespace; Meta cuts
# the text into pieces of these sizes before encoding, and so do we.
_MAX_CHUNK_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


def _split_long_runs(text: str, limit: int) -> Iterable[str]:
    """Cut `text` so that no piece holds more than `limit` consecutive whitespace or
    non-whitespace characters (the same cuts as Meta's _split_whitespaces_or_nonwhitespaces)."""
    start = 0
    for run in re.finditer(r"\s+|\S+", text):
        for cut in range(run.start() + limit, run.end(), limit):
            yield text[start:cut]
            start = cut
    yield text[start:]


class Llama3Tokenizer(Tokenizer):
    """Meta's LLaMA 3 tokenizer: 128,000 BPE ranks from the file + 256 special tokens."""

    kind = "llama3"

    def __init__(self, ranks: dict[bytes, int]):
        import tiktoken

        self._ranks = ranks
        n = len(ranks)
        self.special_tokens = {name: n + i for i, name in enumerate(LLAMA3_SPECIALS)}
        self._enc = tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.vocab_size = n + len(LLAMA3_SPECIALS)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.stop_ids = (self.eos_id, self.special_tokens["<|eom_id|>"],
                         self.special_tokens["<|eot_id|>"])
        self.decide(bos_eos_as_transformers(None, self.bos_id, self.eos_id, tokenizer_json=False))

    @classmethod
    def from_bytes(cls, data: bytes, where: str | Path) -> "Llama3Tokenizer":
        """Parse `base64-token rank` lines (the format tiktoken's load_tiktoken_bpe reads; parsed
        here because that function caches files by path under /tmp, so a rewritten file would
        load stale)."""
        ranks = {}
        for lineno, line in enumerate(data.splitlines(), 1):
            if not line:
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise BridgeError(f"{where}: line {lineno} is not '<base64 token> <rank>' "
                                  f"({line[:60]!r})") from None
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise BridgeError(f"{where}: the ranks are not 0..{len(ranks) - 1}, each once")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise BridgeError(f"{where}: no rank for byte {missing[0]} ({len(missing)} of the 256 "
                              f"single bytes missing)")
        return cls(ranks)

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        allowed = "all" if allow_special else set()
        ids: list[int] = []
        for i in range(0, len(text), _MAX_CHUNK_CHARS):
            for piece in _split_long_runs(text[i:i + _MAX_CHUNK_CHARS], _MAX_RUN_CHARS):
                ids += self._enc.encode(piece, allowed_special=allowed, disallowed_special=())
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def save(self, directory: str | Path) -> list[Path]:
        path = Path(directory) / "tokenizer.model"
        path.parent.mkdir(parents=True, exist_ok=True)
        by_rank = sorted(self._ranks.items(), key=lambda kv: kv[1])
        path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in by_rank))
        return [path, self._save_flags(directory)]


# -- LLaMA 2: SentencePiece ----------------------------------------------------------------------

class Llama2Tokenizer(Tokenizer):
    """A SentencePiece model (LLaMA 1/2, llama2.c): bos <s> 1, eos </s> 2, no pad."""

    kind = "llama2"
    # Set where the vocabulary comes from a GGUF file, to tokenize as llama.cpp does: it cuts the
    # text at these user-defined tokens before SentencePiece runs (which then puts its "\u2581"
    # before each piece), and drops the ASCII whitespace after a token of `_rstrip` and before
    # one of `_lstrip` (bridge.gguf.tokenizer). A saved tokenizer.model does not keep them.
    _user_defined: dict[str, int] = {}
    _lstrip: frozenset[int] = frozenset()
    _rstrip: frozenset[int] = frozenset()

    def __init__(self, proto: bytes, where: str | Path = "tokenizer.model"):
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        except RuntimeError:
            raise BridgeError(f"{where}: not a SentencePiece model that loads "
                              f"({EXPECTED})") from None
        sp = self._sp
        self.vocab_size = sp.vocab_size()
        self.bos_id, self.eos_id, self.pad_id = (i if i >= 0 else None
                                                 for i in (sp.bos_id(), sp.eos_id(), sp.pad_id()))
        self.unk_id = sp.unk_id() if sp.unk_id() >= 0 and sp.is_unknown(sp.unk_id()) else None
        pieces = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        self.special_tokens = {p: i for p, i in pieces.items()
                               if sp.is_control(i) or sp.is_unknown(i)}
        self.stop_ids = llama_cpp_stop_ids(pieces, [self.eos_id])
        self.decide(bos_eos_as_transformers(None, self.bos_id, self.eos_id, tokenizer_json=False))

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        # SentencePiece never reads "<s>" in text as the control token
        tokens = {**self._user_defined, **(self.special_tokens if allow_special else {})}
        if not tokens:
            return self._sp.encode(text)
        pieces = _split_on_specials(text, tokens)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if isinstance(piece, int):
                ids.append(piece)
                continue
            if i > 0 and pieces[i - 1] in self._rstrip:
                piece = piece.lstrip(" \t\n\v\f\r")
            if i + 1 < len(pieces) and pieces[i + 1] in self._lstrip:
                piece = piece.rstrip(" \t\n\v\f\r")
            ids += self._sp.encode(piece) if piece else []
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def save(self, directory: str | Path) -> list[Path]:
        path = Path(directory) / "tokenizer.model"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self._sp.serialized_model_proto())
        return [path, self._save_flags(directory)]


# -- Hugging Face tokenizer.json -----------------------------------------------------------------

_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|bos|>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|eos|>", "<eos>", "<|endoftext|>")
_PAD_NAMES = ("<|pad|>", "<pad>")


class HFTokenizer(Tokenizer):
    """A `tokenizers` tokenizer (tokenizer.json). bos/eos/pad/unk come from `config` (the
    tokenizer_config.json fields bos_token / eos_token / pad_token / unk_token; null: none),
    else from the token the post-processor puts before (after) each text, else from well-known
    special-token names; add_bos / add_eos as transformers decides them (bos_eos_as_transformers:
    the post-processor, for most tokenizer classes); stop_ids by llama.cpp's rule
    (llama_cpp_stop_ids), so that a GGUF vocabulary and its tokenizer.json stop at the same ids.
    `where` names the file in errors."""

    kind = "hf"

    def __init__(self, tok, config: dict | None = None, where: str | Path = "tokenizer.json"):
        self._tok = tok
        self._config = dict(config or {})
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.special_tokens = {t.content: i for i, t in tok.get_added_tokens_decoder().items()
                               if t.special}
        processor = post_processor_json(tok)
        before, after = added_tokens(processor, str(where))
        by_id = {i: t for t, i in vocab.items()}

        def find(key: str, names: Sequence[str], added: list[int] = ()) -> int | None:
            if key in self._config and self._config[key] is None:
                return None  # the config says there is none
            name = self._config.get(key)
            name = name.get("content") if isinstance(name, dict) else name
            if not name and len(added) == 1 and added[0] in by_id:
                return added[0]  # no name in the config: the token the template adds
            for candidate in ([name] if name else []) + list(names):
                if candidate in vocab:
                    return vocab[candidate]
            return None

        self.bos_id = find("bos_token", _BOS_NAMES, before)
        self.eos_id = find("eos_token", _EOS_NAMES, after)
        self.pad_id = find("pad_token", _PAD_NAMES)
        model_unk = getattr(tok.model, "unk_token", None)
        self.unk_id = find("unk_token", [model_unk] if model_unk else [])
        self.decide(bos_eos_as_transformers(self._config, self.bos_id, self.eos_id,
                                            tokenizer_json=True, post_processor=processor,
                                            names=by_id, where=str(where)))
        fim = fim_ids(vocab)
        self.stop_ids = llama_cpp_stop_ids(vocab, [self.eos_id, fim.get("pad"), fim.get("rep"),
                                                   fim.get("sep")])

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        # Not thread-safe: the flag lives on the shared Rust tokenizer.
        self._tok.encode_special_tokens = not allow_special  # True: specials are plain text
        return self._tok.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def save(self, directory: str | Path) -> list[Path]:
        """tokenizer.json, and tokenizer_config.json: the config this tokenizer was loaded with
        (so a chat template etc. survives), with the bos/eos/pad/unk tokens it resolved to (null
        for none). add_bos / add_eos are written as transformers reads them: in the
        post-processor (rewritten only where it decides otherwise) and, for older readers, as
        add_bos_token / add_eos_token; so the files load back the same, here and there."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = dict(self._config)
        for key, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id),
                       ("pad_token", self.pad_id), ("unk_token", self.unk_id)):
            name = config.get(key)
            name = name.get("content") if isinstance(name, dict) else name
            if i is None or name != self._tok.id_to_token(i):
                config[key] = None if i is None else self._tok.id_to_token(i)
        config["add_bos_token"], config["add_eos_token"] = self.add_bos, self.add_eos
        old = self._tok.post_processor
        written = bos_eos_as_transformers(config, self.bos_id, self.eos_id, tokenizer_json=True,
                                          post_processor=post_processor_json(self._tok))
        try:
            if (written.bos, written.eos) != (self.add_bos, self.add_eos):
                self._tok.post_processor = bos_eos_post_processor(
                    old, *[(self._tok.id_to_token(i), i) if on else None
                           for on, i in ((self.add_bos, self.bos_id), (self.add_eos, self.eos_id))])
            self._tok.save(str(directory / "tokenizer.json"))
        finally:
            self._tok.post_processor = old
        (directory / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return [directory / "tokenizer.json", directory / "tokenizer_config.json"]


def _hf_from_file(path: Path, data: bytes) -> HFTokenizer:
    from tokenizers import Tokenizer as RustTokenizer

    try:
        tok = RustTokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        raise BridgeError(f"{path}: not a tokenizer.json that `tokenizers` can load "
                          f"({(str(e).splitlines() or [type(e).__name__])[0][:120]})") from None
    return HFTokenizer(tok, read_tokenizer_config(path.parent), where=path)


def read_tokenizer_config(directory: Path) -> dict | None:
    """The tokenizer_config.json in `directory` (None where there is none)."""
    config_path = directory / "tokenizer_config.json"
    config = None
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise BridgeError(f"{config_path}: invalid JSON ({e})") from None
        if not isinstance(config, dict):
            raise BridgeError(f"{config_path}: expected a JSON object")
    return config


# -- raw bytes -----------------------------------------------------------------------------------

def _byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable-char table used by byte-level BPE: index b is byte b's char."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, plus bos 256, eos 257, pad 258 (vocab 259). No file needed."""

    kind = "bytes"
    SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")

    def __init__(self):
        self.vocab_size = 256 + len(self.SPECIALS)
        self.special_tokens = {name: 256 + i for i, name in enumerate(self.SPECIALS)}
        self.bos_id, self.eos_id, self.pad_id = self.special_tokens.values()
        self.stop_ids = (self.eos_id,)
        self.decide(BosEos(True, False, "raw bytes: BOS opens every text"))

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        pieces = _split_on_specials(text, self.special_tokens) if allow_special else [text]
        return [i for p in pieces
                for i in ([p] if isinstance(p, int) else p.encode("utf-8", errors="replace"))]

    def _decode(self, ids: list[int]) -> str:
        names = {i: name for name, i in self.special_tokens.items()}
        out, run = [], bytearray()
        for i in ids + [None]:
            if i is None or i >= 256:  # flush the byte run before a special token (or the end)
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
                out.append(names.get(i, ""))
            else:
                run.append(i)
        return "".join(out)

    def save(self, directory: str | Path) -> list[Path]:
        """Write an equivalent tokenizer.json (byte-level BPE with no merges, so id b is byte b)
        so that a checkpoint trained on bytes still carries its tokenizer; it loads as "hf"."""
        from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers

        vocab = {c: b for b, c in enumerate(_byte_level_chars())}
        tok = RustTokenizer(models.BPE(vocab, []))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(self.SPECIALS))
        saved = HFTokenizer(tok, dict(zip(("bos_token", "eos_token", "pad_token"), self.SPECIALS)))
        saved.add_bos, saved.add_eos = self.add_bos, self.add_eos  # its save writes them
        return saved.save(directory)
