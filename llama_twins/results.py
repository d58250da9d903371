"""One writer for measurements: NAME.json stamped with where it came from, and NAME.md beside it,
generated from that JSON.

A figure without its provenance cannot be compared with the next: the same script on a Zen 1 with
AVX2 and on a Zen 5 with AVX-512 differs 3x, and a model name ("AMD EPYC") tells them apart no more
than a date does. So every result records

    command  the command line that made it (sys.argv joined, unless the caller names it)
    commit   `git rev-parse HEAD` of the checkout the code ran from (None outside git)
    cpu      {"vendor", "family", "model", "model_name", "flags"} from /proc/cpuinfo, flags being
             which of FLAGS the CPU has; elsewhere what `platform` knows
    date     UTC, ISO 8601 to the second

and the markdown is made from the JSON as written (render(data) -> lines, or the lines the caller
gives, kept in the JSON under "markdown"), ending with a line that says the same. `regenerate`
makes it again from the JSON alone.
"""

from __future__ import annotations

import datetime
import json
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

# The vector extensions that decide how fast a CPU runs these models: AVX2 (Zen 1-3, Haswell on),
# AVX-512 (Zen 4-5, Skylake-SP on), its bfloat16 dot products, and Intel's AMX tiles (any amx_*
# flag). Names as Linux's /proc/cpuinfo spells them.
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx")
STAMPS = ("command", "commit", "cpu", "date")
# What a result written before this writer existed says instead of the stamps.
UNRECORDED = "measured before provenance was kept"

Render = Callable[[dict], Sequence[str]]


def cpu(cpuinfo: str | None = None) -> dict:
    """{"vendor", "family", "model", "model_name", "flags"} of this machine's CPU, parsed from
    `cpuinfo` (the text of /proc/cpuinfo; read when None). family and model are ints, flags the
    FLAGS present, in FLAGS' order. Without /proc/cpuinfo: platform's processor name, the rest
    None and no flags (not known, rather than absent)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor stands for all
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if not fields:
        return {"vendor": None, "family": None, "model": None,
                "model_name": platform.processor() or platform.machine(), "flags": None}
    present = set(fields.get("flags", "").split())

    def has(flag: str) -> bool:
        return any(f.startswith("amx") for f in present) if flag == "amx" else flag in present

    def number(key: str) -> int | None:
        value = fields.get(key)
        return int(value) if value is not None and value.isdigit() else None
    return {"vendor": fields.get("vendor_id"), "family": number("cpu family"),
            "model": number("model"), "model_name": fields.get("model name"),
            "flags": [flag for flag in FLAGS if has(flag)]}


def commit(directory: str | Path | None = None) -> str | None:
    """The commit checked out where `directory` (default: this code) lives, or None outside a git
    checkout (an installed package) or without git."""
    where = Path(directory) if directory is not None else Path(__file__).resolve().parent
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def command_line(argv: Sequence[str] | None = None) -> str:
    """argv (default sys.argv) as one shell line: `python scripts/x.py ...` for a script, the
    command's name for an installed command (`jax-llama bench ...`, not its path in a venv)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    first = argv[0]
    head = ["python", first] if first.endswith(".py") else [Path(first).name]
    return shlex.join(head + argv[1:])


def provenance(command: str | None = None) -> dict:
    """The stamps: {"command", "commit", "cpu", "date"} of this run."""
    return {"command": command if command is not None else command_line(), "commit": commit(),
            "cpu": cpu(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write(name: str, data: dict, render: Render | Sequence[str], directory: str | Path = ".",
          command: str | None = None) -> str:
    """DIRECTORY/NAME.json: `data` with the stamps (provenance(command); a "command" already in
    `data` is kept, as the caller knows it better) and DIRECTORY/NAME.md made from that JSON,
    each written atomically. render: a function of the JSON's data giving the markdown's lines,
    or the lines themselves (kept in the JSON under "markdown", so the file is made from the JSON
    either way). Returns the markdown."""
    from bridge.atomic import write_text

    stamps = provenance(command if command is not None else data.get("command"))
    stamped = {**data, **stamps}
    if not callable(render):
        stamped["markdown"] = list(render)
    directory = Path(directory)
    text = json.dumps(stamped, indent=2) + "\n"
    write_text(directory / f"{name}.json", text)
    markdown = to_markdown(json.loads(text), render if callable(render) else None)
    write_text(directory / f"{name}.md", markdown)
    return markdown


def to_markdown(data: dict, render: Render | None = None) -> str:
    """The markdown of a result's JSON: render(data), or its "markdown" lines, then the line that
    says where the figures come from."""
    lines = list(render(data) if render is not None else data["markdown"])
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines + ["", provenance_line(data)]) + "\n"


def regenerate(path: str | Path, render: Render | None = None) -> str:
    """Rewrite the markdown beside the result `path` (NAME.json) from the JSON alone; returns it."""
    from bridge.atomic import write_text

    path = Path(path)
    markdown = to_markdown(json.loads(path.read_text()), render)
    write_text(path.with_suffix(".md"), markdown)
    return markdown


def provenance_line(data: dict) -> str:
    """One line: the command, commit, CPU and date the JSON records (each stamp it lacks said to
    be unrecorded); for a result written before the stamps, its "provenance" note and the CPU
    model name and date it recorded, if any."""
    if "provenance" in data or not any(key in data for key in STAMPS):
        known = [f"{key} {data[key]}" for key in ("cpu", "date") if isinstance(data.get(key), str)]
        return (f"Provenance: {data.get('provenance', UNRECORDED)}"
                + (f" (recorded: {'; '.join(known)})" if known else "") + ".")
    command = f"`{data['command']}`" if data.get("command") else "an unrecorded command"
    at = (f"commit {data['commit'][:12]}" if data.get("commit") else
          "no git commit" if "commit" in data else "an unrecorded commit")
    where = cpu_words(data.get("cpu"))
    return f"Measured by {command} at {at} on {where}, {data.get('date') or 'date unrecorded'}."


def cpu_words(c: dict | str | None) -> str:
    """A CPU as cpu() records it, in words: 'AMD EPYC (AuthenticAMD family 25 model 17; avx2,
    avx512f, avx512_bf16)'; a model name alone for a result that recorded only that."""
    if c is None:
        return "an unrecorded CPU"
    c = c if isinstance(c, dict) else {"model_name": c}
    where = c.get("model_name") or "an unknown CPU"
    if c.get("vendor") is not None:
        flags = c.get("flags")
        where += (f" ({c['vendor']} family {c['family']} model {c['model']}; "
                  f"{', '.join(flags) if flags else 'none of ' + '/'.join(FLAGS)})")
    return where
