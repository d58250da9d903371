"""Chat templates rendered as Hugging Face transformers renders them, and the exact per-token loss
mask for supervised fine-tuning (SFT).

    template = find_template("ckpt/", tokenizer)             # the checkpoint's own, else a built-in
    ids = template.encode(messages, tokenizer, add_generation_prompt=True)   # a prompt to answer
    example = encode_example(template, tokenizer, messages, "chats.jsonl:3")
    example.ids, example.trained                             # int32 (T,), bool (T,)

Rendering follows transformers' apply_chat_template: a sandboxed jinja2 environment (templates come
with checkpoints, so they are untrusted code) with trim_blocks, lstrip_blocks, loop controls,
raise_exception, strftime_now, a tojson that does not escape HTML, and the {% generation %} tag,
which marks the text the model is trained to produce.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from itertools import groupby, pairwise
from pathlib import Path
from typing import Callable

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .atomic import write_text
from .errors import BridgeError
from .locate import resolve_model

TEMPLATE_FILE = "chat_template.jinja"  # the file name transformers saves a template under
# Model files that carry their own template, as (holds(path), template(path) -> ChatTemplate or
# None). GGUF's enters when `bridge` is imported (bridge.gguf): the GGUF wing builds on this
# module, so this module knows it only through this list.
MODEL_FILE_TEMPLATES: list[tuple[Callable[[Path], bool],
                                 Callable[[Path], ChatTemplate | None]]] = []
ROLES = ("system", "user", "assistant")

# Meta's Llama-3-Instruct format. The generation block is the reply and its <|eot_id|>: what the
# model must learn to write after the assistant header.
LLAMA3 = r"""{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Meta's Llama-2-chat format (llama/generation.py chat_completion): the system prompt folds into
# the first user turn, and that combined text is stripped as a whole. The generation block is
# " {reply} </s>": Meta encodes "[INST] {user} [/INST] {reply} " and then appends EOS.
LLAMA2 = r"""{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] != ('user' if loop.index0 % 2 == 0 else 'assistant') %}
        {{- raise_exception('roles must alternate user/assistant after an optional system') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- set content = message['content'] %}
        {%- if loop.first and system is not none %}
            {%- set content = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' + content %}
        {%- endif %}
        {{- bos_token + '[INST] ' + content | trim + ' [/INST]' }}
    {%- else %}
        {%- generation %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endgeneration %}
    {%- endif %}
{%- endfor %}
"""

BUILTIN = {"llama3": LLAMA3, "llama2": LLAMA2}

_HAS_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_RECORDER = "_generation_recorder"  # the render variable through which the tag reports its spans
# Errors a template's own code raises while rendering: jinja's, and Python's from its expressions.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError)


# -- rendering -------------------------------------------------------------------------------------

class _GenerationTag(Extension):
    """{% generation %}...{% endgeneration %}: renders its body unchanged and records the body's
    [start, end) in the output. As in transformers, start is the length of the output streamed so
    far, so a block inside a macro or a {% set %} block is placed wrongly (there as here)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_record", [nodes.ContextReference()])
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _record(self, context, caller):
        text = caller()
        chunks, spans = context.get(_RECORDER) or ([], [])
        start = sum(map(len, chunks))
        spans.append((start, start + len(text)))
        return text


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _token_text(tokenizer, token_id: int | None) -> str:
    """A special token's text as a template sees it: its name (SentencePiece decodes control
    tokens to ''), else its decoding; '' for a tokenizer without that token."""
    if token_id is None:
        return ""
    names = {i: name for name, i in tokenizer.special_tokens.items()}
    return names.get(token_id) or tokenizer.decode([token_id])


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja chat template and where it came from; compiled (and its syntax checked) when made."""

    source: str = field(repr=False)  # the jinja text
    name: str                        # "llama3", "llama2", or the file it was read from

    def __post_init__(self):
        self._compiled  # noqa: B018 - a syntax error is reported now, naming the template

    def __reduce__(self):  # pickle and copy the fields only: the compiled template does not pickle
        return ChatTemplate, (self.source, self.name)

    @cached_property
    def _compiled(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            return env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise BridgeError(f"{self.name}:{e.lineno}: chat template: {_one_line(e)}") from None

    def render(self, messages: list[dict], tokenizer, add_generation_prompt: bool = False
               ) -> tuple[str, list[tuple[int, int]]]:
        """(text, spans): the rendered conversation and the [start, end) character spans of its
        {% generation %} blocks (none if the template has none). The template sees messages
        (keys whose value is None dropped), add_generation_prompt, tools=None, documents=None, and
        the tokenizer's bos_token / eos_token text ('' where it has none), as in transformers."""
        chunks, spans = [], []
        variables = {"messages": [{k: v for k, v in m.items() if v is not None} for m in messages],
                     "add_generation_prompt": add_generation_prompt, "tools": None,
                     "documents": None, "bos_token": _token_text(tokenizer, tokenizer.bos_id),
                     "eos_token": _token_text(tokenizer, tokenizer.eos_id),
                     _RECORDER: (chunks, spans)}
        try:
            for chunk in self._compiled.generate(**variables):  # streamed: the tag reads chunks
                chunks.append(chunk)
        except _RENDER_ERRORS as e:
            raise BridgeError(f"{self.name}: the chat template does not render "
                              f"({_one_line(e)})") from None
        return "".join(chunks), spans

    def encode(self, messages: list[dict], tokenizer, add_generation_prompt: bool = False
               ) -> list[int]:
        """The rendered text's ids, special-token text read as special tokens and no BOS added (the
        template writes its own): transformers' apply_chat_template(..., tokenize=True)."""
        text, _ = self.render(messages, tokenizer, add_generation_prompt)
        return tokenizer.encode(text, allow_special=True)

    def save(self, directory: str | Path) -> Path:
        """Write directory/chat_template.jinja (the directory made if needed); return its path."""
        return write_text(Path(directory) / TEMPLATE_FILE, self.source)


# -- finding a template ----------------------------------------------------------------------------

def _read_template(path: Path) -> ChatTemplate:
    try:
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise BridgeError(f"{path}: cannot read the chat template "
                          f"({getattr(e, 'strerror', None) or e})") from None


def _config_template(path: Path) -> ChatTemplate | None:
    """The "chat_template" of a tokenizer_config.json: a string, or a list of {"name", "template"}
    from which the one named "default" is taken; None when the file has no chat_template."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise BridgeError(f"{path}: cannot read it as JSON ({e})") from None
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise BridgeError(f"{path}: chat_template: a list of templates without one named "
                              f"'default' (names: {', '.join(map(str, named)) or 'none'})")
        source = named["default"]
    if source is not None and not isinstance(source, str):
        raise BridgeError(f"{path}: chat_template: expected a string or a list of named "
                          f"templates (got {type(source).__name__})")
    return None if source is None else ChatTemplate(source, str(path))


def find_template(checkpoint, tokenizer, choice: str | None = None) -> ChatTemplate:
    """The chat template to use. choice "llama3" / "llama2": that built-in; another choice: the
    jinja file it names. No choice: the checkpoint's own (a directory's chat_template.jinja, else
    the chat_template of its tokenizer_config.json; a .gguf file's tokenizer.chat_template), else
    the built-in for the tokenizer: llama3 when
    it has <|start_header_id|>, llama2 otherwise. `checkpoint`: a path, a checkpoint already
    opened (own_template says how it is read) or None."""
    if choice in BUILTIN:
        return ChatTemplate(BUILTIN[choice], choice)
    if choice is not None:
        if not Path(choice).is_file():
            raise BridgeError(f"{choice}: neither a built-in template ({', '.join(BUILTIN)}) nor "
                              f"a file", field="chat_template")
        return _read_template(Path(choice))
    found = own_template(checkpoint)
    if found is not None:
        return found
    kind = "llama3" if "<|start_header_id|>" in tokenizer.special_tokens else "llama2"
    return ChatTemplate(BUILTIN[kind], kind)


def own_template(checkpoint) -> ChatTemplate | None:
    """The checkpoint's own chat template (a directory's chat_template.jinja, else the
    chat_template of its tokenizer_config.json; a .gguf file's tokenizer.chat_template), or
    None when it carries none. `checkpoint`: a path (or a model's name:
    bridge.locate.resolve_model), or a checkpoint already opened
    (bridge.formats.open_checkpoint), whose file's own template then comes from what opening it
    read: the file is not read again."""
    if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
        found = checkpoint.own_template()
        if found is not None or not checkpoint.path.is_dir():
            return found
        checkpoint = checkpoint.path
    elif checkpoint is not None:
        checkpoint = resolve_model(checkpoint)
    for holds, template in MODEL_FILE_TEMPLATES if checkpoint is not None else ():
        if holds(Path(checkpoint)):
            return template(Path(checkpoint))
    if checkpoint is not None and Path(checkpoint).is_dir():
        directory = Path(checkpoint)
        if (directory / TEMPLATE_FILE).is_file():
            return _read_template(directory / TEMPLATE_FILE)
        if (directory / "tokenizer_config.json").is_file():
            return _config_template(directory / "tokenizer_config.json")
    return None


# -- examples: ids and the assistant-only mask -----------------------------------------------------

@dataclass
class Example:
    """One tokenized conversation: ids int32 (T,), trained bool (T,) - the loss counts token t
    when trained[t] - and where it came from ("FILE:LINE" or any label)."""

    ids: np.ndarray
    trained: np.ndarray
    where: str


def _turn_spans(template: ChatTemplate, tokenizer, messages: list[dict], text: str, where: str
                ) -> list[tuple[int, int]]:
    """For a template without generation blocks: assistant turn i is the text that
    render(messages[:i+1]) adds to render(messages[:i], add_generation_prompt=True), provided each
    rendering is a prefix of the next and of the whole."""
    spans = []
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    for k, i in enumerate(turns, 1):
        try:
            before, _ = template.render(messages[:i], tokenizer, add_generation_prompt=True)
            after, _ = template.render(messages[:i + 1], tokenizer)
        except BridgeError:
            before = after = None
        if before is None or not (after.startswith(before) and text.startswith(after)):
            raise BridgeError(f"{where}: assistant turn {k} cannot be found in the rendered "
                              f"template ({template.name})")
        spans.append((len(before), len(after)))
    return spans


def _tokens_before(tokenizer, text: str, ids: list[int], cuts: list[int], where: str,
                   name: str) -> dict[int, int]:
    """{cut: n} such that ids[:n] are exactly the tokens of text[:cut], for sorted character cuts.

    First the pieces between cuts are tokenized on their own: when their ids, concatenated, are
    the whole text's ids, every cut falls between tokens. Otherwise (SentencePiece, say, which
    starts each piece with a space of its own) each prefix text[:cut] is tokenized: its ids must
    begin the whole text's ids, and then those tokens cover text[:cut] exactly. A cut inside a
    token is refused, naming `where`: its token would be half reply, half not."""
    edges = [0, *cuts, len(text)]
    pieces = [tokenizer.encode(text[a:b], allow_special=True) for a, b in pairwise(edges)]
    if [i for piece in pieces for i in piece] == ids:
        return dict(zip(cuts, np.cumsum([len(p) for p in pieces[:-1]]).tolist()))
    found = {}
    for cut in cuts:
        prefix = tokenizer.encode(text[:cut], allow_special=True)
        if ids[:len(prefix)] != prefix:
            raise BridgeError(f"{where}: a token of the rendered template ({name}) straddles "
                              f"character {cut}, an edge of an assistant reply, so the reply's "
                              f"tokens cannot be marked exactly")
        found[cut] = len(prefix)
    return found


def encode_example(template: ChatTemplate, tokenizer, messages: list[dict], where: str) -> Example:
    """A conversation's ids (template.encode's: the whole rendering tokenized at once) and its
    mask: True on the tokens inside an assistant span. The spans are the template's
    {% generation %} blocks, or for a template without them each assistant turn's text found by
    rendering prefixes of the conversation (_turn_spans). Tokens never straddle a span's edge
    (refused otherwise, see _tokens_before), so "starts inside a span" and transformers'
    "overlaps a span" (return_assistant_tokens_mask) mark the same tokens."""
    text, spans = template.render(messages, tokenizer)
    if not _HAS_GENERATION.search(template.source):
        spans = _turn_spans(template, tokenizer, messages, text, where)
    ids = tokenizer.encode(text, allow_special=True)
    cuts = sorted({edge for span in spans for edge in span} - {0, len(text)})
    before = {0: 0, len(text): len(ids), **_tokens_before(tokenizer, text, ids, cuts, where,
                                                           template.name)}
    trained = np.zeros(len(ids), bool)
    for start, end in spans:
        trained[before[start]:before[end]] = True
    return Example(np.asarray(ids, np.int32), trained, where)


def truncate(example: Example, max_len: int) -> Example | None:
    """The example's first max_len tokens; None when none of them is trained."""
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
        raise BridgeError(f"must be a positive integer (got {max_len!r})", field="max_len")
    cut = Example(example.ids[:max_len], example.trained[:max_len], example.where)
    return cut if cut.trained.any() else None


# -- conversations from JSON lines -----------------------------------------------------------------

def _messages(obj, where: str) -> list[dict]:
    """One JSON line's conversation as [{"role", "content"}, ...] (other keys dropped)."""
    if not isinstance(obj, dict):
        raise BridgeError(f"{where}: expected a JSON object (got {type(obj).__name__})")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list):
            raise BridgeError(f"{where}: messages: expected a list (got {type(messages).__name__})")
    elif "prompt" in obj and "completion" in obj:
        messages = [{"role": "user", "content": obj["prompt"]},
                    {"role": "assistant", "content": obj["completion"]}]
    else:
        raise BridgeError(f"{where}: expected \"messages\", or \"prompt\" and \"completion\" "
                          f"(got keys {', '.join(map(repr, obj)) or 'none'})")
    if not messages:
        raise BridgeError(f"{where}: messages: empty list")
    for j, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BridgeError(f"{where}: message {j}: expected an object with \"role\" and "
                              f"\"content\"")
        if m["role"] not in ROLES:
            raise BridgeError(f"{where}: message {j}: unknown role {m['role']!r} (expected "
                              f"{', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise BridgeError(f"{where}: message {j}: content must be a string (got "
                              f"{type(m['content']).__name__})")
    if messages[-1]["role"] != "assistant":
        raise BridgeError(f"{where}: the conversation ends with a {messages[-1]['role']} turn; "
                          f"it must end with an assistant turn to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_json_lines(path: str | Path, what: str) -> list[tuple[str, object]]:
    """[(where "FILE:LINE", the line's JSON value)] of a JSON-lines file of `what` (named in the
    error when it cannot be read); blank lines skipped, malformed JSON refused naming FILE:LINE."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise BridgeError(f"{path}: cannot read the {what} "
                          f"({getattr(e, 'strerror', None) or e})") from None
    values = []
    # split("\n"), not splitlines(): U+2028 and friends may stand unescaped inside JSON strings
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            values.append((where, json.loads(line)))
        except ValueError as e:
            raise BridgeError(f"{where}: malformed JSON ({getattr(e, 'msg', e)} at column "
                              f"{getattr(e, 'colno', '?')})") from None
    return values


def read_chats(path: str | Path) -> list[tuple[str, list[dict]]]:
    """[(where "FILE:LINE", messages)] from a JSON-lines file, one conversation a line: either
    {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]} ending with an
    assistant turn, or {"prompt": str, "completion": str} (a user turn and an assistant turn).
    Blank lines are skipped; anything else is refused in one line naming FILE:LINE."""
    return [(where, _messages(obj, where))
            for where, obj in read_json_lines(path, "conversations")]


# -- showing a mask --------------------------------------------------------------------------------

def show_mask(example: Example, tokenizer) -> str:
    """The example for a reader: a first line "WHERE: N of T tokens trained", then its text with
    each run of trained tokens between « and ». Special tokens show as their names; other tokens
    are decoded together with the tokens before them, so a space or a character that spans
    tokens comes out as in the rendered text."""
    names = {i: name for name, i in tokenizer.special_tokens.items()}
    ids = [int(i) for i in example.ids]
    parts: list[tuple[bool, str]] = []
    start, done = 0, ""  # the current stretch of ordinary tokens, and its text so far
    for (trained, special), run in groupby(range(len(ids)), lambda t: (bool(example.trained[t]),
                                                                       ids[t] in names)):
        run = list(run)
        if special:
            text, start, done = "".join(names[ids[t]] for t in run), run[-1] + 1, ""
        else:
            whole = tokenizer.decode(ids[start:run[-1] + 1])
            text, done = whole[len(done):], whole
        parts.append((trained, text))
    body = "".join(("«" + "".join(t for _, t in group) + "»") if trained
                   else "".join(t for _, t in group)
                   for trained, group in groupby(parts, lambda p: p[0]))
    return f"{example.where}: {int(example.trained.sum())} of {len(ids)} tokens trained\n{body}"
