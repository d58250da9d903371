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
# start, 20 in float32), next to both twins (8); the float64 run itself peaks lower (48, during
# its perturbed runs). Without
# it, the twins' training alone. Plus what the runtimes (JAX, torch, XLA's compiled programs) take
# whatever the model: RUNTIME_BYTES.
FLOAT64_BYTES_PER_PARAMETER = 64
BYTES_PER_PARAMETER = 48
RUNTIME_BYTES = 1 << 30


def parity_memory(path, reference_f64: bool = True, training: bool = True,
                  dtype: str = "float32") -> int:
    """The peak memory, in bytes, the report on the checkpoint at `path` needs: with the training
    figures, RUNTIME_BYTES plus (FLOAT64_)BYTES_PER_PARAMETER each; without them
    (_forward_bytes), one twin in `dtype` at a time and one block of the float64 run."""
    ckpt = open_checkpoint(path)
    return _memory_needed(ckpt, reference_f64)[0] if training else _forward_bytes(ckpt, dtype)


def _memory_needed(ckpt, reference_f64: bool) -> tuple[int, int, int]:
    """(bytes, parameters, bytes per parameter) of the report with its training figures."""
    parameters = sum(math.prod(shape) for shape, _ in ckpt.specs.values())
    per = FLOAT64_BYTES_PER_PARAMETER if reference_f64 else BYTES_PER_PARAMETER
    return RUNTIME_BYTES + parameters * per, parameters, per


def _forward_bytes(ckpt, dtype: str) -> int:
    """The report without its training figures: one twin in `dtype` at a time (with the
    capacity to read a tensor while it loads, the largest one twice more), one block of the
    float64 run with its gradient-free temporaries (3 copies), and the runtimes."""
    import numpy as np

    from bridge.dtypes import numpy_dtype

    size = np.dtype(numpy_dtype(dtype)).itemsize
    parameters = sum(math.prod(shape) for shape, _ in ckpt.specs.values())
    largest = max(math.prod(shape) for shape, _ in ckpt.specs.values())
    block = sum(math.prod(shape) for name, (shape, _) in ckpt.specs.items()
                if name.startswith("layers.0."))
    return RUNTIME_BYTES + parameters * size + 2 * largest * 4 + 3 * block * 8


def training_skipped(ckpt, reference_f64: bool) -> str:
    """Why the training figures did not run, with what they need."""
    need, parameters, per = _memory_needed(ckpt, reference_f64)
    have = _available_memory()
    return (f"they need about {need / 2**30:.1f} GiB ({parameters:,} parameters x {per} bytes)"
            + (f" and {have / 2**30:.1f} GiB are available" if have is not None and need > have
               else ", and --no-training was asked"))


def _plan_memory(ckpt, dtype: str, reference_f64: bool, training: bool | None, say) -> bool:
    """Whether the training figures run (training None: when they fit), said before anything is
    loaded; a report that would not fit even without them (or with them, when asked for) is
    refused, naming the memory it needs and the memory available."""
    need, parameters, per = _memory_needed(ckpt, reference_f64)
    have = _available_memory()
    if training is None:
        training = have is None or need <= have
    if not training:
        need = _forward_bytes(ckpt, dtype)
    what = (f"about {need / 2**30:.1f} GiB ("
            + (f"{parameters:,} parameters x {per} bytes"
               f"{' with the float64 reference' if reference_f64 else ''}" if training else
               f"{parameters:,} parameters, one twin in {dtype} at a time, no training figures")
            + f", and {RUNTIME_BYTES / 2**30:.0f} GiB for the runtimes)")
    if have is not None and need > have:
        raise BridgeError(
            f"{ckpt.path}: the parity report needs {what} and {have / 2**30:.1f} GiB are "
            f"available", hint=(("training", False, "use {} to skip the training figures and "
                                 "need less") if training else None))
    say(f"the report needs {what}"
        + (f"; {have / 2**30:.1f} GiB are available" if have is not None else ""))
    return training


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
