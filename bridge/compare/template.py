"""The chat template section: does each checkpoint's own template render a conversation alike?

A fixed conversation (system, user, assistant, user, assistant) is rendered with each checkpoint's
own template (bridge.chat.own_template: a directory's chat_template.jinja or tokenizer_config.json,
a GGUF's tokenizer.chat_template), as the SFT data sees it (the whole conversation) and as a
prompt to answer (the last reply left out, add_generation_prompt on), with its system turn and
without it (where a template writes its own default), each side with its own tokenizer's BOS and
EOS text. The first character where the renderings part is shown with the text around it;
templates written differently that render all four alike are reported, not judged. A template on
one side only is a difference: the commands would fall back to a built-in template for the other,
and a chat would read differently to the model.
"""

from __future__ import annotations

from types import SimpleNamespace

from ..chat import ChatTemplate, own_template
from ..errors import BridgeError
from .report import DIFFERENT, SAME, SKIPPED, Finding
from .tokenizer import checkpoint_tokenizer, first_difference

CONVERSATION = (
    {"role": "system", "content": "You are a careful assistant. Answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?  Say it twice:\nonce per line."},
    {"role": "assistant", "content": "Rome.\nRome."},
)
# Stands in for a tokenizer where a checkpoint has none: the template sees '' as BOS and EOS.
_NO_TOKENIZER = SimpleNamespace(special_tokens={}, bos_id=None, eos_id=None)
_CONTEXT = 30  # characters shown either side of the first difference


# The renderings compared: (label, figures key, with the system turn, as a prompt). A template
# often writes a default system prompt where the conversation has none: the second pair reaches it.
RENDERINGS = (("the whole conversation", "conversation", True, False),
              ("the conversation as a prompt", "prompt", True, True),
              ("the conversation without its system turn", "no_system", False, False),
              ("the prompt without its system turn", "no_system_prompt", False, True))


def _render(template: ChatTemplate, tokenizer, system: bool, prompt: bool) -> str:
    """The conversation rendered, from its first user turn unless `system`, and for a `prompt`
    without its last reply and with add_generation_prompt; a template that refuses to render it
    gives its error, compared like a rendering."""
    messages = list(CONVERSATION if system else CONVERSATION[1:])
    try:
        return template.render(messages[:-1] if prompt else messages, tokenizer,
                               add_generation_prompt=prompt)[0]
    except BridgeError as e:
        return f"<does not render: {str(e).split(': ', 1)[-1]}>"


def _around(text: str, at: int) -> str:
    """The text around character `at`, the character there in brackets, as a repr."""
    before, here, after = text[max(0, at - _CONTEXT):at], text[at:at + 1], \
        text[at + 1:at + 1 + _CONTEXT]
    return f"{before!r} [{here!r}] {after!r}" if here else f"{before!r} [end]"


def compare_templates(a, b) -> Finding:
    """The template section for two opened checkpoints: SAME when both render the conversation
    (whole, and as a prompt) to the same text, DIFFERENT at the first character that is not or
    where one side has no template, SKIPPED where neither has one."""
    ta, tb = own_template(a), own_template(b)
    if ta is None and tb is None:
        return Finding("template", SKIPPED, "no chat template in A or B: nothing to compare",
                       [("neither checkpoint carries a chat template (the commands use a "
                         "built-in one for both)"), f"A: {a.path}", f"B: {b.path}"])
    if ta is None or tb is None:
        missing, has = ("A", "B") if ta is None else ("B", "A")
        return Finding("template", DIFFERENT, f"a chat template in {has} only",
                       [f"{has}: {(ta or tb).name}", f"{missing}: none"],
                       cause=f"template: chat template missing in {missing}",
                       check_next=f"the conversion dropped the chat template: write it to "
                       f"{missing} (chat_template.jinja, tokenizer_config.json's chat_template, "
                       f"a GGUF's tokenizer.chat_template)",
                       figures={"a": ta is not None, "b": tb is not None})
    toks = [checkpoint_tokenizer(c)[0] or _NO_TOKENIZER for c in (a, b)]
    lines = [f"A: {ta.name}", f"B: {tb.name}"]
    if ta.source == tb.source:
        lines.append(f"the same template text ({len(ta.source)} characters)")
    for side, template, tok in (("A", ta, toks[0]), ("B", tb, toks[1])):
        bos = {i: name for name, i in tok.special_tokens.items()}.get(tok.bos_id)
        if getattr(tok, "add_bos", False) and bos and \
                _render(template, tok, True, True).startswith(bos):
            lines.append(f"{side}'s template writes BOS itself and its tokenizer adds BOS to a "
                         f"text: a caller that encodes the rendering as a text gets BOS twice "
                         f"(llama.cpp PR #7332); the commands here encode it as the template "
                         f"wrote it")
    figures, parted = {"same_source": ta.source == tb.source}, None
    for label, key, system, prompt in RENDERINGS:
        x, y = _render(ta, toks[0], system, prompt), _render(tb, toks[1], system, prompt)
        at = first_difference(x, y)
        figures[key] = {"chars": [len(x), len(y)], "first_difference": at}
        if at is None:
            lines.append(f"{label}: the same {len(x)} characters")
            continue
        lines += [(f"{label}: the renderings part at character {at} of {len(x)} (A) / "
                   f"{len(y)} (B):"), f"  A: {_around(x, at)}", f"  B: {_around(y, at)}"]
        parted = parted or (label, at, x, y)
    if parted is None:
        if ta.source != tb.source:
            at = first_difference(ta.source, tb.source)
            lines.append(f"the template texts differ from character {at} (A: "
                         f"{_around(ta.source, at)}; B: {_around(tb.source, at)}), but render "
                         f"these conversations alike: not judged")
        return Finding("template", SAME, f"the same rendering of a {len(CONVERSATION)}-turn "
                       f"conversation, with and without its system turn, whole and as a prompt",
                       lines, figures=figures)
    label, at, x, y = parted
    cause = (f"template: {label} renders differently from character {at}: "
             f"{_around(x, at)} in A, {_around(y, at)} in B")
    check_next = ("the chat template was re-typed or replaced in the conversion: diff the "
                  "templates' text" if ta.source != tb.source else
                  "the templates are the same text: their BOS/EOS token text differs (the "
                  "tokenizer section)")
    return Finding("template", DIFFERENT, f"{label} renders differently from character {at}",
                   lines, cause=cause, check_next=check_next, figures=figures)
