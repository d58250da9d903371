"""A section's Finding and the verdict over all of them.

The verdict is `same` (every section the same, within float rounding), `same within
quantisation` (some section differs by no more than its storage type explains) or `different`,
which names the first cause found, in the order the sections run: the config, the tokenizer, the
template, the weights, the outputs, the block where the models part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SAME, WITHIN, DIFFERENT, SKIPPED = "same", "same within quantisation", "different", "skipped"
VERDICTS = (SAME, WITHIN, DIFFERENT, SKIPPED)


@dataclass
class Finding:
    """What one section found. `cause` names what differs (a field, a token, a tensor, a block)
    in words a user can act on; `check_next` says where to look; `lines` are the section's
    report; `figures` its numbers for --json."""

    section: str                       # config, tokenizer, template, weights, outputs, blocks
    verdict: str                       # one of VERDICTS
    summary: str                       # one line
    lines: list[str] = field(default_factory=list)
    cause: str | None = None           # for DIFFERENT: what differs
    check_next: str | None = None      # for DIFFERENT: what to check next
    figures: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"section": self.section, "verdict": self.verdict, "summary": self.summary,
                "lines": self.lines, "cause": self.cause, "check_next": self.check_next,
                "figures": self.figures}


def verdict(findings: list[Finding]) -> tuple[str, Finding | None]:
    """(the verdict over `findings`, the first Finding that differs or None)."""
    first = next((f for f in findings if f.verdict == DIFFERENT), None)
    if first is not None:
        return DIFFERENT, first
    return (WITHIN if any(f.verdict == WITHIN for f in findings) else SAME), None
