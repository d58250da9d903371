"""What this machine has to spare: memory (for work that sizes itself before it starts), and
time not spent collecting garbage where none is made."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import numpy as np

# The alignment at which XLA's CPU client takes a host array as its buffer, not a copy of it.
ALIGNMENT = 64


def aligned_empty(shape, dtype) -> np.ndarray:
    """np.empty(shape, dtype), its first byte on an ALIGNMENT boundary. A load makes its weights
    so: jax.device_put then holds such an array as it is (XLA's CPU client aliases a host buffer
    aligned to 64 bytes, and copies any other), where numpy's own big arrays start 16 bytes past a
    page (glibc's header of a mapping) and were copied - LLaMA 3 8B's Q4_0 weights, 4.6 GiB, twice
    in memory and 0.9 s of its load (AMD EPYC Zen 4). The torch twin's torch.from_numpy shares any
    array."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(count * dtype.itemsize + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


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


@contextlib.contextmanager
def small_pages():
    """numpy's new arrays in the kernel's ordinary 4 KB pages for the block (as it was after it).

    numpy asks Linux for transparent huge pages for every array of 4 MB or more (madvise
    MADV_HUGEPAGE). Where the kernel's THP defrag setting is "madvise" (the usual default), each
    such page's first touch may wait while the kernel compacts memory to find 2 MB free, and a
    machine that has just read a model's file holds that file in its page cache: the memory is
    full and in pieces. A load fills gigabytes of fresh arrays: on the 2-core Intel Xeon VM
    (23 GB, the 8B Q4_0 file cached) fresh arrays took 0.66-1.64 s a GiB with huge pages asked
    for and 0.42-0.44 s without, and the torch twin's load of that file (whose arrays become its
    tensors) 1.11-1.35x as fast (docs/explanation/performance.md). Through numpy's own switch
    (numpy._core.multiarray._set_madvise_hugepage, as its release notes give it); a no-op where
    numpy has none."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray
    switch = getattr(multiarray, "_set_madvise_hugepage", None)
    if switch is None:
        yield
        return
    was = switch(False)
    try:
        yield
    finally:
        switch(was)


# glibc's malloc tunables (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """glibc's malloc told to keep what the process frees for its next allocations: blocks up to
    32 MiB from its heaps (never a mapping of their own) and up to 256 MiB free at a heap's top
    before it is given back. For an application, at its start: the command-line tools call it
    (llama_twins.cli.common.command_main); the library never does, since it would change its
    host's allocator for good (glibc's adaptive threshold goes off once set).

    A load's chunks of rows each make and free megabytes of numpy temporaries (bridge.int4's
    int8 rows, bridge.gguf.read's dequantisation); with glibc's defaults those pages were given
    back and faulted in again chunk after chunk. Making LLaMA 3 8B's embedding int8 rows from
    its Q4_0 blocks took 3.07 M page faults and 2.5-4.1 s, and 0.14 M and 1.9-2.3 s with this
    (2-core Intel Xeon VM; docs/explanation/performance.md). True where glibc took both
    settings; False elsewhere (another C library: nothing is changed)."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) & bool(mallopt(_M_TRIM_THRESHOLD, 256 << 20))
