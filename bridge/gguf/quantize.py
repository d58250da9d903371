"""GGUF K-quants (q2_k ... q6_k) by llama.cpp's own quantiser, llama-cpp-python's
`llama_model_quantize`: gguf.quants has numpy quantisers for the 32-element block types only.

bridge.gguf.write writes the model losslessly first, into a file beside the destination's
temporary; llama.cpp reads it and writes the temporary, choosing each tensor's type by its own
rules (src/llama-quant.cpp, llama_tensor_get_type_impl: e.g. Q6_K for the output and for some
layers' attn_v / ffn_down under q4_k_m, a 32-block type where rows are not whole 256-blocks);
the input is removed whatever happens. llama_cpp is an optional import, inside functions only.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ..errors import BridgeError
from ..progress import note  # a line above an open progress bar

try:
    import fcntl
except ImportError:  # Windows: no flock, so no stale-input cleanup either
    fcntl = None

INSTALL = "pip install llama-cpp-python"
# llama.cpp's log levels (ggml/include/ggml.h, enum ggml_log_level, llama-cpp-python 0.3.36: the
# table in llama_cpp/_logger.py is an older one's); CONT continues the line before it
LOG_WARN, LOG_ERROR, LOG_CONT = 3, 4, 5


def require_llama_cpp(dtype: str):
    """The llama_cpp module; a BridgeError naming `dtype` and the install command without it."""
    try:
        import llama_cpp
    except ImportError:
        raise BridgeError(f"{dtype} needs llama.cpp's quantiser: {INSTALL}",
                          field="dtype") from None
    except (OSError, RuntimeError) as e:  # installed, but its shared library does not load
        first = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise BridgeError(f"{dtype} needs llama.cpp's quantiser, and llama_cpp does not load "
                          f"({first})", field="dtype") from None
    return llama_cpp


@contextmanager
def input_beside(tmp: Path) -> Iterator[Path]:
    """A fresh path for llama.cpp's input beside `tmp`, the destination's own temporary
    (`.DST.partial-XXXX`, bridge.atomic): `.DST.partial-XXXX.input`, so that a killed writer's is
    removed with its temporary by bridge.atomic's stale-temporary clean-up (it takes every
    unlocked `.DST.partial-*`); held locked meanwhile, as that clean-up expects of live writers'.
    Removed on exit."""
    path = tmp.with_name(tmp.name + ".input")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield path
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def quantize_with_llama_cpp(src: str | os.PathLike, dst: str | os.PathLike, dtype: str,
                            ftype_name: str, *,
                            allow_requantize: bool = False,
                            warn: Callable[[str], object] | None = None,
                            stage: Callable[[str], object] | None = None,
                            name: str | os.PathLike | None = None) -> None:
    """llama.cpp's quantiser: the GGUF file `src` into `dst` (written in place, not atomically:
    pass a temporary) as file type `dtype` (our name, a FILE_TYPES key of bridge.gguf.conventions),
    llama.cpp's LLAMA_FTYPE_<ftype_name>. `allow_requantize` lets it take
    quantised tensors (dequantised, then quantised again). Its log is silenced: its warnings
    (fallbacks for rows that are not whole blocks) go to `warn`, its error ends the BridgeError
    raised on failure, naming `name` (default `dst`); `stage(line)` hears one line as it starts
    (default: both to stderr, above any progress bar there)."""
    llama_cpp = require_llama_cpp(dtype)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype_name}")
    params.allow_requantize = allow_requantize
    label = ftype_name.removeprefix("MOSTLY_")
    (stage or note)(f"llama.cpp: quantising {name or dst} to {label}")
    with _llama_cpp_log(llama_cpp, warn or note) as errors:
        status = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst),
                                                ctypes.byref(params))
    if status != 0:
        reason = errors[-1] if errors else f"status {status}"
        raise BridgeError(f"{name or dst}: llama.cpp could not quantise it to {label} ({reason})")


@contextmanager
def _llama_cpp_log(llama_cpp, warn: Callable[[str], object]) -> Iterator[list[str]]:
    """llama.cpp's log for the block: its whole lines of level WARN to `warn`, of level ERROR
    into the yielded list, the rest (INFO, DEBUG: a line per tensor) dropped; the callback in
    place before (llama_cpp's own, which prints) is restored afterwards."""
    errors: list[str] = []
    line = {"level": 0, "text": ""}

    def log(level: int, text: bytes, _user_data) -> None:
        if not line["text"] and level != LOG_CONT:
            line["level"] = level  # a line's pieces take its first piece's level
        line["text"] += (text or b"").decode("utf-8", "replace")
        while "\n" in line["text"]:
            done, line["text"] = line["text"].split("\n", 1)
            done = done.strip(" =\t")
            if done and line["level"] == LOG_WARN:
                warn(f"llama.cpp: {done}")
            elif done and line["level"] == LOG_ERROR:
                errors.append(done)

    callback = llama_cpp.llama_log_callback(log)  # kept alive by this frame while it is set
    before, user_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(before), ctypes.byref(user_data))
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield errors
    finally:
        llama_cpp.llama_log_set(before, user_data)
