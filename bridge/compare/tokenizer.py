"""The tokenizer section: do two checkpoints turn the same text into the same ids?

Each side's tokenizer is the one the commands use (bridge.tokenizer.find_tokenizer: a GGUF file's
own vocabulary, else the tokenizer files beside the weights), and a text is encoded as they
encode it: BOS and EOS as the tokenizer's files decide (transformers' rules, or llama.cpp's for a
GGUF). Compared, in the order a difference is named: the vocabulary (its size, then each id's
token), the BOS and EOS tokens, whether BOS and EOS are added, the pre-tokenizer a GGUF names,
then the ids themselves: of the text, and of short probes that each start a text afresh (a
changed prefix space shows only on a text's first word) and exercise what pre-tokenizers split
differently (digit runs, contractions, runs of spaces and newlines, scripts without spaces).

A pre-tokenizer written differently but splitting every text alike is reported, not judged: a
conversion may rebuild it in another form (a GGUF's is rebuilt from its pattern names).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from weakref import WeakKeyDictionary

from ..tokenizer import Tokenizer, find_tokenizer
from .report import DIFFERENT, SAME, SKIPPED, Finding

PROBES = ("Hello world", " Hello world", "hello", "The year 2024 had 366 days; pi is 3.14159265.",
          "I'm sure they'll say we've done it, isn't it? DON'T", "a  b   c\n\nd\t\te \n",
          "x=foo(bar[1],  {'k': -2})  # comment", "naïve café, Straße, ÆØÅ",
          "日本語のテキストです。中文文本。", "Ünïcödé and emoji 🙂👍🏽!",
          "<|im_start|>user\nhi<|im_end|>", "<s>[INST] hi [/INST]", "1234567890 12 123 1234",
          "ﬁne ＡＢＣ x² ½ Ⅻ")  # changed only by a normalizer (NFKC)
_GGUF_PRE = "gguf_tokenizer_pre"  # bridge.gguf.tokenizer's key for the GGUF's tokenizer.ggml.pre
_PREFIX_MARKS = " \u2581\u0120"     # a space as SentencePiece and byte-level BPE write it
_FOUND: WeakKeyDictionary = WeakKeyDictionary()  # checkpoint -> checkpoint_tokenizer's answer


def checkpoint_tokenizer(checkpoint) -> tuple[Tokenizer | None, str]:
    """(the tokenizer the commands would use for an opened checkpoint, where it comes from), or
    (None, why there is none); read once per checkpoint (the template section asks again). A
    tokenizer file that is there but cannot be read raises BridgeError naming it."""
    if checkpoint not in _FOUND:
        _FOUND[checkpoint] = _find(checkpoint)
    return _FOUND[checkpoint]


def _find(checkpoint) -> tuple[Tokenizer | None, str]:
    own = checkpoint.own_tokenizer()
    if own is not None:
        return own, f"{checkpoint.path.name}'s own vocabulary"
    path = Path(checkpoint.path)
    directory = path if path.is_dir() else path.parent
    names = [n for n in ("tokenizer.json", "tokenizer.model") if (directory / n).is_file()]
    if not names:
        why = "; ".join(checkpoint.warnings) or \
            f"no tokenizer.json or tokenizer.model beside the weights in {directory}"
        return None, why
    return find_tokenizer(checkpoint), str(directory / names[0])


def _pieces(tok: Tokenizer) -> list[str] | None:
    """Each id's token as the tokenizer's files write it (None for a kind not read here)."""
    inner = getattr(tok, "_tok", None)  # a tokenizer.json's tokenizers.Tokenizer
    if inner is not None:
        by_id = {i: t for t, i in inner.get_vocab(with_added_tokens=True).items()}
        return [by_id.get(i, "") for i in range(tok.vocab_size)]
    sp = getattr(tok, "_sp", None)      # a tokenizer.model's SentencePieceProcessor
    if sp is not None:
        return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    ranks = getattr(tok, "_ranks", None)  # tiktoken's ranks (LLaMA 3)
    if ranks is not None:
        by_id = {i: repr(t) for t, i in ranks.items()}
        by_id.update({i: name for name, i in tok.special_tokens.items()})
        return [by_id.get(i, "") for i in range(tok.vocab_size)]
    return None


def _json_part(tok: Tokenizer, part: str) -> str | None:
    """A tokenizer.json part (pre_tokenizer, normalizer, decoder) as JSON text, or None."""
    inner = getattr(tok, "_tok", None)
    value = getattr(inner, part, None) if inner is not None else None
    return None if value is None else json.dumps(json.loads(value.__getstate__()), sort_keys=True)


def _token(tok: Tokenizer, i: int | None, pieces: list[str] | None) -> str:
    if i is None:
        return "none"
    name = pieces[i] if pieces and i < len(pieces) else tok.decode([i])
    return f"{i} {name!r}"


def _encode(tok: Tokenizer, text: str) -> list[int]:
    """text's ids as the commands encode a plain text (BOS and EOS as the files decide)."""
    return tok.encode(text, bos=tok.add_bos and tok.bos_id is not None,
                      eos=tok.add_eos and tok.eos_id is not None)


def _said_flag(tok: Tokenizer, name: str, decided: bool) -> tuple[bool, str]:
    """(what a reader of tokenizer_config.json's add_<name>_token key takes, in words): the key
    where it is a boolean, else the tokenizer's own decision."""
    key = getattr(tok, "_config", {}).get(f"add_{name}_token")
    if isinstance(key, bool):
        return key, str(key).lower()
    return decided, f"not given ({name.upper()} {'added' if decided else 'not added'})"


def first_difference(x: Sequence, y: Sequence) -> int | None:
    """The first position where two sequences (ids, text) differ, the shorter one's length where
    one is the other's start; None where they are equal."""
    at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
    return at if at is not None or len(x) == len(y) else min(len(x), len(y))


def _around(tok: Tokenizer, ids: list[int], at: int) -> str:
    """The tokens around position `at`, each decoded to its text, the one at `at` in brackets."""
    shown = []
    for i in range(max(0, at - 3), min(len(ids), at + 4)):
        word = tok.decode([ids[i]])
        shown.append(f"[{word!r}]" if i == at else repr(word))
    return " ".join(shown) + ("" if at < len(ids) else " [end]")


def _prefix_space(pa: list[str] | None, pb: list[str] | None, x: list[int], y: list[int],
                  at: int) -> str | None:
    """'A' or 'B' where the tokens at `at` differ only by a leading space that side adds."""
    if not (pa and pb and at < min(len(x), len(y))):
        return None
    first_a, first_b = pa[x[at]], pb[y[at]]
    if first_b != first_a and first_b.lstrip(_PREFIX_MARKS) == first_a:
        return "B"
    if first_a != first_b and first_a.lstrip(_PREFIX_MARKS) == first_b:
        return "A"
    return None


def compare_tokenizers(a, b, text: str) -> Finding:
    """The tokenizer section for two opened checkpoints and a text: SAME when both encode it (and
    the probes) to the same ids with the same vocabulary, special tokens and BOS/EOS decisions;
    DIFFERENT naming the first that differs, the first differing position shown as text; SKIPPED
    where a side has no tokenizer."""
    (ta, from_a), (tb, from_b) = checkpoint_tokenizer(a), checkpoint_tokenizer(b)
    if ta is None or tb is None:
        lines = [f"A: {'tokenizer from ' + from_a if ta else 'no tokenizer: ' + from_a}",
                 f"B: {'tokenizer from ' + from_b if tb else 'no tokenizer: ' + from_b}"]
        who = "A or B" if ta is None and tb is None else ("A" if ta is None else "B")
        return Finding("tokenizer", SKIPPED, f"no tokenizer in {who}: nothing to compare", lines)
    pa, pb = _pieces(ta), _pieces(tb)
    same_kind = ta.kind == tb.kind and pa is not None and pb is not None
    lines = [f"A: a {ta.kind} tokenizer from {from_a}", f"B: a {tb.kind} tokenizer from {from_b}"]
    causes: list[tuple[str, str]] = []  # (cause, check next), the first one named

    def differ(what: str, check_next: str, shown: bool = False) -> None:
        causes.append((f"tokenizer: {what}", check_next))
        if not shown:  # (the ids are shown where they part already)
            lines.append(f"{what}  <- differs")

    # The vocabulary.
    if ta.vocab_size != tb.vocab_size:
        differ(f"a vocabulary of {ta.vocab_size} ids in A, {tb.vocab_size} in B",
               "a token was added or removed (an added special token, a vocabulary cut to the "
               "embedding's rows?)")
    if same_kind:
        at = next((i for i, (p, q) in enumerate(zip(pa, pb)) if p != q), None)
        if at is not None:
            differ(f"token {at} is {pa[at]!r} in A, {pb[at]!r} in B",
                   "the vocabulary was rewritten: tokens renamed, or shifted by one added or "
                   "removed")
        elif len(pa) != len(pb):
            extra, longer = (pb, "B") if len(pb) > len(pa) else (pa, "A")
            lines.append(f"ids from {min(len(pa), len(pb))} on are only in {longer}: "
                         f"{extra[min(len(pa), len(pb))]!r} first")
    # The special tokens and whether they are added.
    for name, i, j in (("BOS", ta.bos_id, tb.bos_id), ("EOS", ta.eos_id, tb.eos_id)):
        said = f"{name} token {_token(ta, i, pa)} in A, {_token(tb, j, pb)} in B"
        if i != j:
            differ(said, f"the {name.lower()}_token was changed (tokenizer_config.json "
                   f"{name.lower()}_token, a GGUF's tokenizer.ggml.{name.lower()}_token_id)")
        else:
            lines.append(f"{name} token: {_token(ta, i, pa)}")
    if set(ta.special_tokens.items()) != set(tb.special_tokens.items()):
        only_a = sorted(set(ta.special_tokens.items()) - set(tb.special_tokens.items()))
        only_b = sorted(set(tb.special_tokens.items()) - set(ta.special_tokens.items()))
        lines.append(f"special tokens only in A: {only_a[:5]}, only in B: {only_b[:5]}")
    stops = [", ".join(_token(t, i, p) for i in t.stop_ids) or "none"
             for t, p in ((ta, pa), (tb, pb))]
    if set(ta.stop_ids) != set(tb.stop_ids):
        differ(f"a generation stops at {stops[0]} in A, at {stops[1]} in B",
               "the end-of-text or end-of-turn tokens changed (tokenizer_config.json eos_token, "
               "a GGUF's tokenizer.ggml.eos_token_id / eot_token_id): replies end early or run "
               "on")
    else:
        lines.append(f"a generation stops at {stops[0]}")
    for name, x, y in (("BOS", ta.add_bos, tb.add_bos), ("EOS", ta.add_eos, tb.add_eos)):
        if x != y:
            differ(f"{name} is {'added' if x else 'not added'} to a text in A "
                   f"({ta.decided_by}), {'added' if y else 'not added'} in B ({tb.decided_by})",
                   f"the add_{name.lower()} decision changed (llama.cpp PR #7332: a doubled or "
                   f"missing {name}): tokenizer.json's post_processor, tokenizer_config.json "
                   f"add_{name.lower()}_token, a GGUF's tokenizer.ggml.add_{name.lower()}_token")
    lines.append(f"BOS {'added' if ta.add_bos else 'not added'}, EOS "
                 f"{'added' if ta.add_eos else 'not added'} in A ({ta.decided_by})")
    for name, x, y in (("bos", ta.add_bos, tb.add_bos), ("eos", ta.add_eos, tb.add_eos)):
        said = _said_flag(ta, name, x), _said_flag(tb, name, y)
        if x == y and said[0][0] != said[1][0]:
            differ(f"tokenizer_config.json's add_{name}_token is {said[0][1]} in A, "
                   f"{said[1][1]} in B (the post-processors agree: {name.upper()} "
                   f"{'added' if x else 'not added'})",
                   f"the add_{name}_token key was changed: transformers 5 reads tokenizer.json's "
                   f"post-processor (which agrees), but llama.cpp's converter and transformers "
                   f"4's fast tokenizers read the key, so there the two differ on "
                   f"{name.upper()} (llama.cpp PR #7332)")
    # The pre-tokenizer: a GGUF's name for it, and tokenizer.json's form of it.
    pre_a, pre_b = (getattr(t, "_config", {}).get(_GGUF_PRE) for t in (ta, tb))
    if pre_a and pre_b and pre_a != pre_b:
        differ(f"the pre-tokenizer is {pre_a!r} in A, {pre_b!r} in B (a GGUF's "
               f"tokenizer.ggml.pre)", "the converter named another pre-tokenizer "
               "(llama.cpp #7724): the text splits into words differently")
    rewritten = []  # the tokenizer.json parts written differently
    for part in ("pre_tokenizer", "normalizer", "decoder"):
        ja, jb = _json_part(ta, part), _json_part(tb, part)
        if ja != jb:
            rewritten.append(part.replace("_", "-"))
            ja, jb = str(ja), str(jb)
            at = next((i for i, (p, q) in enumerate(zip(ja, jb)) if p != q), min(len(ja), len(jb)))
            lines.append(f"tokenizer.json's {part} is written differently in A and B, from "
                         f"...{ja[max(0, at - 20):at + 40]} in A, ...{jb[max(0, at - 20):at + 40]}"
                         f" in B")
    # The ids.
    figures = {"vocab_size": [ta.vocab_size, tb.vocab_size], "bos_id": [ta.bos_id, tb.bos_id],
               "eos_id": [ta.eos_id, tb.eos_id], "stop_ids": [list(ta.stop_ids),
                                                               list(tb.stop_ids)],
               "add_bos": [ta.add_bos, tb.add_bos],
               "add_eos": [ta.add_eos, tb.add_eos]}
    ids_a, ids_b = _encode(ta, text), _encode(tb, text)
    figures["text_tokens"] = [len(ids_a), len(ids_b)]
    at = first_difference(ids_a, ids_b)
    if at is not None:
        figures["text_first_difference"] = at
        lines += [f"the text's ids part at position {at} of {len(ids_a)} (A) / {len(ids_b)} (B):",
                  f"  A: {_around(ta, ids_a, at)}",
                  f"  B: {_around(tb, ids_b, at)}"]
    else:
        lines.append(f"the text: the same {len(ids_a)} ids")
    parted = []
    for probe in PROBES:
        x, y = _encode(ta, probe), _encode(tb, probe)
        where = first_difference(x, y)
        if where is not None:
            parted.append((probe, x, y, where))
    figures["probes_differing"] = len(parted)
    for probe, x, y, where in parted[:4]:
        lines.append(f"probe {probe!r} parts at token {where}: A "
                     f"{_around(ta, x, where)}; B "
                     f"{_around(tb, y, where)}")
    if not parted:
        lines.append(f"{len(PROBES)} probes: the same ids")
    if at is not None or parted:
        split_by = _prefix_space(pa, pb, *parted[0][1:4]) if parted and same_kind else None
        if split_by:
            what = f"a prefix space is added to a text's first word in {split_by} only"
        elif at is not None:
            what = (f"the text's ids part at position {at}: "
                    f"{_around(ta, ids_a, at)} in A, "
                    f"{_around(tb, ids_b, at)} in B")
        else:
            probe, x, y, where = parted[0]
            what = f"the probe {probe!r} splits differently from token {where}"
        if rewritten and not split_by:
            what = f"the {' and '.join(rewritten)} differ{'s' * (len(rewritten) == 1)}: {what}"
        differ(what, "the pre-tokenizer or its prefix space was changed (llama.cpp #7724, "
               "ollama #17698): compare tokenizer.json's pre_tokenizer and normalizer, a "
               "GGUF's tokenizer.ggml.pre and add_space_prefix", shown=not split_by)
    if not causes:
        return Finding("tokenizer", SAME, f"the same ids for the text ({len(ids_a)} tokens) and "
                       f"{len(PROBES)} probes; the same vocabulary, special tokens and BOS/EOS "
                       f"decisions", lines, figures=figures)
    cause, check_next = causes[0]
    return Finding("tokenizer", DIFFERENT, cause.removeprefix("tokenizer: "), lines, cause=cause,
                   check_next=check_next, figures=figures)

