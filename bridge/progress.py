"""How a long job shows its progress: the one place every command's bar is made.

Each bar is tqdm's, on stderr (stdout carries results), with its unit and, where the total is
known, the rate and the time left. On a terminal it redraws in place. When stderr is a file or a
pipe - a log, a job started beside a training run - it still prints, but as whole lines, one
every LOG_INTERVAL_S seconds and one at the end: tqdm's own choice there is nothing at all
(disable=None) or a carriage-return frame at every update. A bar asked for with enabled=False
draws nothing (the commands' --no-progress); TQDM_DISABLE=1 in the environment does the same for
every bar (tqdm reads its TQDM_* variables as its defaults, so it is not overridden here).
"""

from __future__ import annotations

import sys
from typing import Callable, Iterable

# Between two lines of a bar that is not on a terminal: a log of a ten-hour run keeps ~1,200 of
# them, and a job that seems stuck says within half a minute that it is not.
LOG_INTERVAL_S = 30.0
# A model's load shows a bar once it has taken this long (a few seconds is not "long").
LOAD_DELAY_S = 2.0


def bar(iterable: Iterable | None = None, *, desc: str, unit: str, total: float | None = None,
        enabled: bool = True, leave: bool = True, **options):
    """A tqdm bar on stderr over `iterable` (or updated by hand: bar.update(n)), counting `unit`s
    ("B": bytes, shown as KiB/MiB/GiB) out of `total` (default len(iterable) where it has one).
    leave=False clears it when it closes - on a terminal; a log keeps its last line. `options`:
    more of tqdm's (initial, ...)."""
    from tqdm import tqdm

    settings = {"desc": desc, "unit": unit, "total": total, "leave": leave, "file": sys.stderr,
                **options}
    if unit == "B":
        settings.update(unit_scale=True, unit_divisor=1024)
    if not enabled:
        settings["disable"] = True
    elif not _is_terminal(sys.stderr):
        # miniters=1: every update checks the clock, so no update is skipped by a count that tqdm
        # would otherwise learn (and its monitor thread would then print between the lines)
        settings.update(file=_Lines(sys.stderr), mininterval=LOG_INTERVAL_S,
                        maxinterval=LOG_INTERVAL_S, miniters=1, leave=True)
    return tqdm(iterable, **settings)


def reading(get: Callable[[str], object], total: int, *, desc: str = "loading",
            enabled: bool = True):
    """get(name) -> a tensor, wrapped to count the tensors read on a bar of `total` (a
    checkpoint's len(specs)), and the bar: (counted get, bar); close the bar when done. A model's
    load, where the sizes read (a GGUF's dequantised arrays) are not the sizes stored. The bar
    shows only once the load has taken LOAD_DELAY_S: a small model's load says nothing."""
    progress = bar(desc=desc, unit="tensor", total=total, enabled=enabled, leave=False,
                   delay=LOAD_DELAY_S)

    def counted(name: str):
        value = get(name)
        progress.update(1)
        return value
    return counted, progress


def note(message: str) -> None:
    """A line on stderr above any open bar (which is redrawn below it)."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)


def _is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class _Lines:
    """The file tqdm draws on when stderr is not a terminal: each frame it writes ('\\r', the
    bar, spaces over the longer frame before) becomes one line; what only clears a line or moves
    the cursor between the lines of nested bars is dropped."""

    def __init__(self, stream):
        self.stream = stream
        self.last = None

    def write(self, text: str) -> None:
        line = text.replace("\r", "").replace("\x1b[A", "").strip()
        if line and line != self.last:
            self.stream.write(line + "\n")
            self.last = line

    def flush(self) -> None:
        self.stream.flush()
