"""Whether an encoded text opens with BOS and closes with EOS: decided from a checkpoint's
tokenizer files as Hugging Face transformers decides it, so that a plain text (a training
document, an eval line, a completion prompt) gets the same ids here as through
`AutoTokenizer.from_pretrained(directory)(text).input_ids`.

The facts, read from transformers 5.25.0 (the version the `[test]` extra installs, and the one
tests/test_bos_eos.py checks them against on a matrix of layouts):

- tokenization_utils_base.py, `PreTrainedTokenizerBase._from_pretrained`: where a tokenizer.json
  is loaded, `add_bos_token` and `add_eos_token` are dropped from tokenizer_config.json's keys;
  tokenization_utils_tokenizers.py, `TokenizersBackend.__init__`: the tokenizer.json's
  post-processor is then kept as it is, and a missing one (null) becomes a template that adds
  nothing (`update_post_processor` with both flags false). So the post-processor decides.
- Three classes pass flags of their own to that `__init__`, which rebuilds the post-processor
  from them whatever the file holds: CodeLlamaTokenizer (`add_bos_token: bool = True`),
  GPTNeoXTokenizer (calls `update_post_processor()` with both false), ErgoTokenizer (both false
  by default). `_CLASS_FLAGS` below.
- Without a tokenizer.json (a tokenizer.model beside a tokenizer_config.json) the keys are read:
  `add_bos_token` / `add_eos_token` decide where they are booleans, and where only one of them
  is given the other counts as false (`kwargs.get("add_bos_token", False)`).

One departure, on purpose: a tokenizer.model whose tokenizer_config.json (if any) has no
`add_bos_token` gets BOS whenever its vocabulary has one, as Meta's reference code encodes for
LLaMA 2 and 3 and as transformers 4.x's LlamaTokenizer did (its `add_bos_token=True` default);
transformers 5.25 converts such a file with a template that adds nothing. A `.gguf` file's
tokenizer follows llama.cpp instead (bridge.gguf.tokenizer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import BridgeError

TRANSFORMERS_VERSION = "5.25.0"  # the facts above were read from this version's source

# tokenizer_class (less a "Fast" suffix) -> (add_bos, add_eos) its __init__ imposes whatever
# tokenizer.json and tokenizer_config.json say (transformers 5.25.0, models/<name>/tokenization_*.py).
_CLASS_FLAGS = {"CodeLlamaTokenizer": (True, False), "GPTNeoXTokenizer": (False, False),
                "ErgoTokenizer": (False, False)}


@dataclass(frozen=True)
class BosEos:
    """What `Tokenizer.encode(text, bos=tok.add_bos, eos=tok.add_eos)` adds, and why."""

    bos: bool
    eos: bool
    decided_by: str  # where the decision comes from, in words (`llama-bridge inspect` shows it)


def added_tokens(post_processor: dict | None, where: str) -> tuple[list[int], list[int]]:
    """(ids a tokenizer.json post-processor puts before a single text, ids it puts after), from
    its JSON form (TemplateProcessing, Bert/RobertaProcessing, ByteLevel, or a Sequence of them);
    BridgeError naming `where` for a kind that adds tokens in a way not read here."""
    if post_processor is None:
        return [], []
    kind = post_processor.get("type")
    if kind == "ByteLevel":
        return [], []
    if kind in ("BertProcessing", "RobertaProcessing"):
        return [post_processor["cls"][1]], [post_processor["sep"][1]]
    if kind == "Sequence":
        found = [added_tokens(p, where) for p in post_processor.get("processors", [])]
        adding = [f for f in found if f != ([], [])]
        if len(adding) > 1:
            raise BridgeError(f"{where}: the post-processor is a Sequence of {len(adding)} "
                              f"processors that each add tokens; not one this project reads")
        return adding[0] if adding else ([], [])
    if kind == "TemplateProcessing":
        specials = post_processor.get("special_tokens", {})
        before, after, seen_text = [], [], False
        for piece in post_processor.get("single", []):
            if "Sequence" in piece:
                seen_text = True
            elif "SpecialToken" in piece:
                name = piece["SpecialToken"]["id"]
                if name not in specials:
                    raise BridgeError(f"{where}: the post-processor's template names {name!r}, "
                                      f"which its special_tokens do not define")
                (after if seen_text else before).extend(specials[name]["ids"])
        return before, after
    raise BridgeError(f"{where}: a {kind} post-processor, not one this project reads "
                      f"(TemplateProcessing, ByteLevel, Bert/RobertaProcessing, Sequence)")


def post_processor_json(tok) -> dict | None:
    """A `tokenizers.Tokenizer`'s post-processor in its JSON form (None where it has none)."""
    return None if tok.post_processor is None else json.loads(tok.post_processor.__getstate__())


def _describe(before: list[int], after: list[int], names: dict[int, str]) -> str:
    text = " ".join([names.get(i, str(i)) for i in before] + ["$A"] +
                    [names.get(i, str(i)) for i in after])
    return "adds nothing" if not before + after else f"adds {text}"


def bos_eos_as_transformers(config: dict | None, bos_id: int | None, eos_id: int | None, *,
                            tokenizer_json: bool, post_processor: dict | None = None,
                            names: dict[int, str] | None = None,
                            where: str = "tokenizer.json") -> BosEos:
    """Whether BOS / EOS are added to an encoded text, as transformers decides for these files.

    config: tokenizer_config.json's fields (None without one); bos_id / eos_id: the tokens the
    checkpoint names (None: none); tokenizer_json: whether the vocabulary comes from a
    tokenizer.json, whose `post_processor` (JSON form, None for null) then decides; otherwise
    from a tokenizer.model. `names` (id -> token text) only words `decided_by`; `where` names the
    file in errors. A post-processor that adds a token other than `bos_id` before the text (or
    other than `eos_id` after it), or more than one, is refused: this project adds at most BOS
    and EOS."""
    config = config or {}
    names = names or {}
    keys = {flag: config.get(f"add_{flag}_token") for flag in ("bos", "eos")}
    keys = {flag: v for flag, v in keys.items() if isinstance(v, bool)}
    if not tokenizer_json:
        if keys:
            said = ", ".join(f"add_{flag}_token {str(v).lower()}" for flag, v in keys.items())
            return BosEos(keys.get("bos", False) and bos_id is not None,
                          keys.get("eos", False) and eos_id is not None,
                          f"tokenizer_config.json: {said}")
        return BosEos(bos_id is not None, False,
                      "the rule for a tokenizer.model: BOS whenever the vocabulary has one")
    cls = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    if cls in _CLASS_FLAGS:
        bos, eos = _CLASS_FLAGS[cls]
        return BosEos(bos and bos_id is not None, eos and eos_id is not None,
                      f"tokenizer_config.json's tokenizer_class {cls}, whose own flags "
                      f"transformers applies (BOS {'on' if bos else 'off'}, EOS "
                      f"{'on' if eos else 'off'})")
    before, after = added_tokens(post_processor, where)
    for side, ids, token, what in (("before", before, bos_id, "bos_token"),
                                   ("after", after, eos_id, "eos_token")):
        if ids and ids != [token]:
            raise BridgeError(f"{where}: the post-processor puts "
                              f"{[names.get(i, i) for i in ids]} {side} each text, but the "
                              f"{what} is {names.get(token, token)!r}; this project adds only "
                              f"the {what} there")
    said = ("tokenizer.json has no post-processor: nothing added" if post_processor is None
            else f"tokenizer.json's post-processor {_describe(before, after, names)}")
    ignored = [f"add_{flag}_token {str(v).lower()}" for flag, v in keys.items()
               if v != bool(before if flag == "bos" else after)]
    if ignored:
        said += (f" (tokenizer_config.json's {', '.join(ignored)} is not read where there is a "
                 f"tokenizer.json, by transformers {TRANSFORMERS_VERSION.split('.')[0]} nor here)")
    return BosEos(bool(before), bool(after), said)


def bos_eos_post_processor(old, bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    """A post-processor that puts `bos` (token, id) before each text and `eos` after it where
    given (a template that adds nothing where neither is), keeping a ByteLevel processor of
    `old` (it only trims offsets): what transformers' `update_post_processor` builds."""
    from tokenizers import processors

    def one(text: str, type_id: int) -> str:
        return " ".join(([f"{bos[0]}:{type_id}"] if bos else []) + [f"{text}:{type_id}"] +
                        ([f"{eos[0]}:{type_id}"] if eos else []))

    template = processors.TemplateProcessing(
        single=one("$A", 0), pair=f"{one('$A', 0)} {one('$B', 1)}",
        special_tokens=[t for t in (bos, eos) if t is not None])
    level = old if isinstance(old, processors.ByteLevel) else None
    if isinstance(old, processors.Sequence):
        state = json.loads(old.__getstate__())
        kept = [p for p in state["processors"] if p.get("type") == "ByteLevel"]
        if kept:
            level = processors.ByteLevel(add_prefix_space=kept[0].get("add_prefix_space", True),
                                         trim_offsets=kept[0].get("trim_offsets", True),
                                         use_regex=kept[0].get("use_regex", True))
    return template if level is None else processors.Sequence([level, template])
