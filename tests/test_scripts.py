"""scripts/README.md lists every script in scripts/, each in the first column of its table with
its command line and what it writes; and no script patches sys.path (they import the installed
packages)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def listed(readme: str) -> dict[str, list[str]]:
    """{script name: the row's other cells} of the README's table, by its first column."""
    rows = {}
    for line in readme.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        name = re.fullmatch(r"`([\w.-]+\.(?:py|sh))`", cells[0]) if cells else None
        if name:
            rows[name[1]] = cells[1:]
    return rows


def missing(readme: str, scripts: list[str]) -> list[str]:
    rows = listed(readme)
    return [s for s in scripts if s not in rows or len(rows[s]) < 3 or not all(rows[s][:3])]


def test_every_script_is_listed_with_its_command_and_what_it_writes():
    scripts = sorted(p.name for p in SCRIPTS.iterdir() if p.suffix in (".py", ".sh"))
    assert len(scripts) >= 22
    readme = (SCRIPTS / "README.md").read_text()
    assert missing(readme, scripts) == []
    for name, cells in listed(readme).items():
        assert (SCRIPTS / name).is_file(), f"scripts/README.md lists {name}, which is not there"
        assert name in cells[0], f"{name}: its command line does not name it"


def test_the_check_catches_a_script_left_out():
    readme = "| script | command line | what | writes |\n|---|---|---|---|\n" \
             "| `a.py` | `python scripts/a.py` | a thing | `OUT/a.json` |\n" \
             "| `b.py` | `python scripts/b.py` | b thing | |\n"
    assert missing(readme, ["a.py", "b.py", "c.sh"]) == ["b.py", "c.sh"]


def test_no_script_patches_sys_path():
    for script in SCRIPTS.glob("*.py"):
        assert "sys.path" not in script.read_text(), script.name
