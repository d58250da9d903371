"""Chat templates, a checkpoint's own file, rendered as Hugging Face transformers renders them.

    template = find_template("ckpt/", tokenizer)             # the checkpoint's own, else a built-in
    ids = template.encode(messages, tokenizer, add_generation_prompt=True)   # a prompt to answer
    text, spans = template.render(messages, tokenizer)       # spans: the {% generation %} blocks

What is trained on a chat (the SFT examples and their loss mask) is tasks.chats'.

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
from pathlib import Path
from typing import Callable

import jinja2
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

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks its replies with {% generation %} blocks."""
        return bool(_HAS_GENERATION.search(self.source))

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
