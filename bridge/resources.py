"""What this machine has to spare: memory (for work that sizes itself before it starts), and
time not spent collecting garbage where none is made."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@contextlib.contextmanager
def gc_paused():
    """Python's cycle collector off for the block (as it was after it). Opening a checkpoint and
    loading a model make hundreds of thousands of long-lived objects (a vocabulary's strings, the
    params) and no cycles to free, and the collector walked them all again and again: 0.2 s of
    SmolLM2's 3 s to its first token (AMD EPYC Zen 4)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
