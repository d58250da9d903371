"""What the parity report needs in memory: the estimate it states (and refuses by) before
anything is loaded, and the malloc tuning that keeps its stages from holding freed models side by
side."""

from __future__ import annotations

import contextlib
import math

from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from bridge.resources import available_memory as _available_memory

# What the report holds at its peak, per parameter, measured as peak RSS on SmolLM2-135M (134.5M
# parameters; scripts/parity_memory.py, results/parity/parity_memory.md): with the float64 run, its
# first gradients and weights after the AdamW steps (16 bytes) and the checkpoint as the twins hold
# it (4) stay while each twin trains in turn (its weights, gradients, two moments and a copy of the
# start, 20 in float32), next to both twins (8); the float64 run itself peaks lower (40). Without
# it, the twins' training alone. Plus what the runtimes (JAX, torch, XLA's compiled programs) take
# whatever the model: RUNTIME_BYTES.
FLOAT64_BYTES_PER_PARAMETER = 64
BYTES_PER_PARAMETER = 48
RUNTIME_BYTES = 1 << 30


def parity_memory(path, reference_f64: bool = True) -> int:
    """The peak memory, in bytes, the report on the checkpoint at `path` needs (an estimate from
    its parameter count: RUNTIME_BYTES plus (FLOAT64_)BYTES_PER_PARAMETER each)."""
    return _memory_needed(open_checkpoint(path), reference_f64)[0]


def _memory_needed(ckpt, reference_f64: bool) -> tuple[int, int, int]:
    """(bytes, parameters, bytes per parameter) of the report on `ckpt`."""
    parameters = sum(math.prod(shape) for shape, _ in ckpt.specs.values())
    per = FLOAT64_BYTES_PER_PARAMETER if reference_f64 else BYTES_PER_PARAMETER
    return RUNTIME_BYTES + parameters * per, parameters, per


def _check_memory(ckpt, reference_f64: bool, say) -> None:
    """Say what the report needs, and refuse, before anything is loaded, a report that would not
    fit in the memory available."""
    need, parameters, per = _memory_needed(ckpt, reference_f64)
    have = _available_memory()
    what = (f"about {need / 2**30:.1f} GiB ({parameters:,} parameters x {per} bytes"
            f"{' with the float64 reference' if reference_f64 else ''}, and "
            f"{RUNTIME_BYTES / 2**30:.0f} GiB for the runtimes)")
    if have is not None and need > have:
        raise BridgeError(
            f"{ckpt.path}: the parity report needs {what} and {have / 2**30:.1f} GiB are "
            f"available", hint=(("reference_f64", False,
                                 "use {} to judge by fixed tolerances and need less")
                                if reference_f64 else None))
    say(f"the report needs {what}"
        + (f"; {have / 2**30:.1f} GiB are available" if have is not None else ""))


@contextlib.contextmanager
def _freed_memory_returned():
    """Within the `with`, glibc's malloc gives a freed buffer of 1 MiB or more back to the
    system at once (M_MMAP_THRESHOLD), and each stage of the report starts by giving back what
    it holds free (_give_back): by default it keeps what it served from its heap for reuse, and
    the report's stages free and allocate whole models in different dtypes, which it would
    otherwise hold side by side (11.8 GB of peak RSS on SmolLM2 instead of 9.4). Afterwards the
    threshold is 32 MiB, the most glibc's own adjustment reaches. A no-op where the C library is
    not glibc."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)


_M_MMAP_THRESHOLD = -3


def _glibc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018  (glibc has both)
    except (OSError, AttributeError):
        return None
    return libc


def _give_back() -> None:
    """malloc_trim(0): what glibc's heap holds free goes back to the system."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
