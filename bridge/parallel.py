"""Numpy work over a big tensor, a chunk of rows at a time, on the CPU's cores.

numpy's array operations let go of Python's lock while they run, so threads that each take their
own chunks of rows work side by side. The readers that turn a checkpoint's tensors into another
layout as they are read use it (bridge.gguf.int4's repacking, bridge.gguf.read's dequantisation,
bridge.int4's int8 rows). Each chunk writes its own rows of an output made beforehand, or returns a
value the caller combines in chunk order: the results are the same whatever the number of threads.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

_pools: dict[int, ThreadPoolExecutor] = {}
_lock = threading.Lock()
_in_chunk = threading.local()  # set while a pool thread runs a chunk: no chunks within chunks


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def by_chunks(fn: Callable[[int, int], T], total: int, step: int,
              workers: int | None = None) -> list[T]:
    """[fn(start, stop) for each chunk [start, stop) of `step` rows of range(total)], in chunk
    order. The chunks run on `workers` threads (default: the cores), or in this thread where there
    is one chunk, one worker, or where this is called from within a chunk (a chunk's own reads do
    not wait on the threads running it)."""
    step = max(1, step)
    starts = range(0, total, step)
    n = cores() if workers is None else workers
    if n <= 1 or len(starts) <= 1 or getattr(_in_chunk, "active", False):
        return [fn(s, min(s + step, total)) for s in starts]

    def chunk(start: int) -> T:
        _in_chunk.active = True
        try:
            return fn(start, min(start + step, total))
        finally:
            _in_chunk.active = False

    return list(_pool(n).map(chunk, starts))


def _pool(n: int) -> ThreadPoolExecutor:
    with _lock:
        if n not in _pools:
            _pools[n] = ThreadPoolExecutor(n, thread_name_prefix="bridge-chunks")
        return _pools[n]


def _forget_pools() -> None:
    """A forked child has none of its parent's threads: it starts its own pools (and lock) when it
    needs them."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)
