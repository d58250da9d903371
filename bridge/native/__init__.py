"""Compiled code, built ahead of its use and loaded where it is built: the pieces every build here
shares (the CPU's flags, the compiler, the cache, an atomic compile), and the bridge's own
library, loading.cc - the passes a load makes over every byte of a GGUF file's quantised tensors
(bridge.gguf.native calls them), with no framework in it, so that both twins' loads and the
converter run them.

    built = build()          # None, or why not (a C++ compiler; `jax-llama kernels build`)
    lib = library()          # the ctypes library, or None where it is not built (numpy then)

A library is keyed by its source and its flags, in $JAX_LLAMA_KERNEL_CACHE (default
~/.cache/jax_llama/kernels, beside the decode kernels, which jax_llama.model.kernels.library builds
with these same pieces). JAX_LLAMA_KERNELS=0 turns it off as it turns the kernels off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("loading.cc")
BUILD_COMMAND = "jax-llama kernels build"
# x86-64-v4 (AVX-512) or v3 (AVX2, F16C) where the CPU runs it, else SSSE3's byte shuffles and
# F16C's conversions where it has them; never a fused multiply-add, which would round once where
# numpy rounds twice. (The int8 rows of LLaMA 3 8B's Q4_0 embedding: 1.8x as fast built for v4 as
# for v3 on the AMD EPYC Zen 4, its divisions 16 wide.)
_X86_V3 = frozenset({"cx16", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "bmi1",
                     "bmi2", "f16c", "fma", "abm", "movbe"})
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_X86_FLAGS = (("ssse3", "-mssse3"), ("f16c", "-mf16c"))
EXACT = ("-ffp-contract=off",)


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags as /proc/cpuinfo lists them; empty where there is none
    (then only plain builds fit)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    return cpu_flags()


def cache_dir() -> Path:
    """Where built libraries live: $JAX_LLAMA_KERNEL_CACHE, default ~/.cache/jax_llama/kernels."""
    return Path(os.environ.get("JAX_LLAMA_KERNEL_CACHE")
                or Path.home() / ".cache" / "jax_llama" / "kernels")


def enabled() -> bool:
    """False when JAX_LLAMA_KERNELS is 0 / false / off (on by default)."""
    return os.environ.get("JAX_LLAMA_KERNELS", "1").strip().lower() not in ("0", "false", "off")


def compiler() -> str | None:
    """The C++ compiler builds use: $CXX, else c++, g++ or clang++ on PATH; None if none."""
    return (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
            or shutil.which("clang++"))


def compile_shared(source: Path, out: Path, flags: tuple[str, ...] = (),
                   includes: tuple[str, ...] = ()) -> None:
    """Compile `source` (C++17) into the shared library `out` with `flags` (written under a
    temporary name, then renamed, so a half-written library is never loaded); raises RuntimeError
    with the compiler's first error."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, "-O3", *flags, "-std=c++17", "-shared", "-fPIC",
           *(f"-I{i}" for i in includes), str(source), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            said = done.stderr.strip().splitlines()
            errors = [line for line in said if "error" in line]  # the first says why
            raise RuntimeError(f"{Path(cxx).name} failed: "
                               f"{(errors or said or [f'exit code {done.returncode}'])[0]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def locked(directory: Path):
    """Held by one build at a time in `directory` (two test workers, or a test and the command,
    do not compile the same library twice)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".build.lock", "w") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, a duplicate build is only slower
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def flags(cap: str | None = None) -> tuple[str, ...]:
    """The flags loading.cc is built with on this CPU; no higher than what `cap` (default
    JAX_LLAMA_KERNEL_MARCH) names where it names x86-64-v3 / avx2 or x86-64 / plain (the AVX2
    switches, llama_twins.bench.common.AVX2_ENV, run the loads' AVX2 code too)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return EXACT
    cap = os.environ.get("JAX_LLAMA_KERNEL_MARCH", "").strip() if cap is None else cap
    if cap in ("x86-64", "plain"):
        return EXACT
    have = _cpu_flags()
    levels = (("x86-64-v4", _X86_V4), ("x86-64-v3", _X86_V3))
    for level, needs in levels[1:] if cap in ("x86-64-v3", "avx2") else levels:
        if needs <= have:
            return (f"-march={level}", *EXACT)
    return (*(flag for need, flag in _X86_FLAGS if need in have), *EXACT)


def library_path(cap: str | None = None) -> Path:
    """Where loading.cc's library for this source and this CPU's flags (under `cap`, flags')
    lives (built or not)."""
    return cache_dir() / f"loading-{_key(flags(cap))}.so"


@functools.cache
def _key(flags: tuple[str, ...]) -> str:
    source = SOURCE.read_bytes() + SOURCE.with_name("half.h").read_bytes()
    return hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]


def build(force: bool = False) -> str | None:
    """Build loading.cc's libraries for this CPU - its best, and those the AVX2 and plain
    switches choose (JAX_LLAMA_KERNEL_MARCH), as the kernels' build makes every variant the CPU
    runs - unless built (or with `force`): None when they are there, else why not."""
    try:
        with locked(cache_dir()):
            for level in dict.fromkeys(flags(cap) for cap in ("native", "x86-64-v3", "x86-64")):
                out = cache_dir() / f"loading-{_key(level)}.so"
                if force or not out.is_file():
                    compile_shared(SOURCE, out, level)
    except Exception as e:  # noqa: BLE001 - said to the caller; loads then run numpy's code
        return str(e)
    return None


def library() -> ctypes.CDLL | None:
    """loading.cc's library where it is built for this CPU and not turned off, else None."""
    if not enabled():
        return None
    path = library_path()
    return _loaded(str(path)) if path.is_file() else None


@functools.cache
def _loaded(path: str) -> ctypes.CDLL:
    return ctypes.cdll.LoadLibrary(path)
