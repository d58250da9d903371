"""The compiled decode kernels: matvec.cc built ahead of its use, one library per instruction set
(a variant), and the variant this CPU runs chosen when a model first asks for the kernels.

    built = build()              # every variant this CPU runs, into cache_dir() (a C++ compiler)
    variant, path = choose()     # the library to load here, or NotBuilt saying why

`jax-llama kernels build` calls build(); a model never compiles anything. The variants, best
first: avx512-bf16 (x86-64-v4 with Ice Lake's VNNI, VBMI, VBMI2, BITALG, VPOPCNTDQ, IFMA and
GFNI, and BF16: Zen 4, Zen 5, Sapphire Rapids), avx512-vnni (Ice Lake, Cascade Lake, Cooper Lake), avx512 (Skylake-X), avx2 (x86-64-v3: AVX2, FMA, F16C) and
plain (C++ without vector extensions: any CPU). matvec.cc picks its paths by the compiler's macros
(__AVX512F__, __AVX512BF16__, ...), so a variant is the set of flags it is compiled with and the
/proc/cpuinfo flags a CPU must show to run it. choose() takes the best variant the CPU runs, or,
where that one is not built, the best built one it runs; `JAX_LLAMA_KERNEL_MARCH` names one
instead (a variant, or its -march: x86-64-v3 is avx2, x86-64 plain), as the AVX2 test switches
do on an AVX-512 machine (llama_twins.bench.common.AVX2_ENV).

A library is keyed by the source, jaxlib's version (the FFI headers it was compiled against) and
the variant's flags, in `$JAX_LLAMA_KERNEL_CACHE` (default ~/.cache/jax_llama/kernels): a new
jaxlib or an edited matvec.cc needs a new build, and until then the model runs XLA's matmul.
"""

from __future__ import annotations

import hashlib
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from bridge.native import SOURCE as native_source
from bridge.native import cache_dir, compile_shared, compiler, cpu_flags, locked  # noqa: F401

SOURCE = Path(__file__).with_name("matvec.cc")
NATIVE = Path(native_source).parent  # bridge/native: half.h, which matvec.cc includes
BUILD_COMMAND = "jax-llama kernels build"


@dataclass(frozen=True)
class Variant:
    """A build of matvec.cc: its name, the compiler's target flags, the /proc/cpuinfo flags a CPU
    needs to run it, and the float32 lanes of its vectors."""
    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]
    lanes: int


# What the compiler may emit for -march=x86-64-v3 (lzcnt is /proc/cpuinfo's "abm"), and for v4.
_V3 = frozenset({"cx16", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "bmi1",
                 "bmi2", "f16c", "fma", "abm", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_X86 = (
    # Ice Lake's byte and bit instructions with Cooper Lake's BF16: Zen 4, Zen 5, Sapphire Rapids
    # (what -march=native gave those CPUs' builds before: VBMI's byte shuffles among them)
    Variant("avx512-bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mavx512vbmi",
                            "-mavx512vbmi2", "-mavx512bitalg", "-mavx512vpopcntdq",
                            "-mavx512ifma", "-mgfni"),
            _V4 | {"avx512_vnni", "avx512_bf16", "avx512vbmi", "avx512_vbmi2", "avx512_bitalg",
                   "avx512_vpopcntdq", "avx512ifma", "gfni"}, 16),
    Variant("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 | {"avx512_vnni"}, 16),
    Variant("avx512", ("-march=x86-64-v4",), _V4, 16),
    Variant("avx2", ("-march=x86-64-v3",), _V3, 8),
    Variant("plain", ("-march=x86-64",), frozenset(), 1))
# Elsewhere (aarch64, ...) matvec.cc has its plain C++ path only, compiled for the default target.
VARIANTS = _X86 if platform.machine().lower() in ("x86_64", "amd64") else (
    Variant("plain", (), frozenset(), 1),)
# Scheduling for the CPU that builds them (the machine that runs them): only the order and choice
# of instructions within the variant's set, never the numbers (the measured builds were
# -march=native, which tunes the same way).
TUNE = ("-mtune=native",) if VARIANTS is _X86 else ()
# JAX_LLAMA_KERNEL_MARCH's other spellings: the -march a variant is built for.
ALIASES = {"x86-64-v4": "avx512", "x86-64-v3": "avx2", "x86-64": "plain"}


class NotBuilt(RuntimeError):
    """No built library this process can run; the message says why and what to run."""


def variant_for(flags: Iterable[str]) -> Variant:
    """The best variant a CPU with these flags runs (plain where no other fits)."""
    have = set(flags)
    return next(v for v in VARIANTS if v.needs <= have)


def variant_named(name: str) -> Variant:
    """The variant called `name` (or its -march, ALIASES); ValueError naming the choices."""
    name = ALIASES.get(name, name)
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"{name!r}: expected one of {', '.join(v.name for v in VARIANTS)} "
                     f"(or {', '.join(ALIASES)})")


def requested() -> str | None:
    """The variant JAX_LLAMA_KERNEL_MARCH names, None when it is unset or "native" (this CPU's)."""
    name = os.environ.get("JAX_LLAMA_KERNEL_MARCH", "native").strip()
    return None if name in ("", "native") else name


def library_path(variant: Variant) -> Path:
    """Where the library of `variant` for this source and jaxlib lives (built or not)."""
    import jaxlib

    key = hashlib.sha256(SOURCE.read_bytes() + (NATIVE / "half.h").read_bytes()
                         + jaxlib.__version__.encode()
                         + " ".join(variant.flags).encode()).hexdigest()[:16]
    return cache_dir() / f"matvec-{variant.name}-{key}.so"


def choose(flags: Iterable[str] | None = None) -> tuple[Variant, Path]:
    """The variant this process runs and its built library: JAX_LLAMA_KERNEL_MARCH's where it
    names one, else the best built variant the CPU (`flags`, default cpu_flags()) runs. Raises
    NotBuilt with one line saying why, and the command that builds them, where there is none."""
    flags = cpu_flags() if flags is None else frozenset(flags)
    name = requested()
    if name is not None:
        try:
            variant = variant_named(name)
        except ValueError as e:
            raise NotBuilt(f"JAX_LLAMA_KERNEL_MARCH={e}") from None
        missing = sorted(variant.needs - flags)
        if missing:
            raise NotBuilt(f"JAX_LLAMA_KERNEL_MARCH={name}: this CPU lacks "
                           f"{', '.join(missing)}")
        candidates = [variant]
    else:
        candidates = [v for v in VARIANTS if v.needs <= flags]
    for variant in candidates:
        if library_path(variant).is_file():
            return variant, library_path(variant)
    raise NotBuilt(f"not built for this CPU ({candidates[0].name}) in {cache_dir()}: "
                   f"`{BUILD_COMMAND}` builds them")


def compile_library(variant: Variant, out: Path) -> None:
    """Compile matvec.cc for `variant` into `out` against jaxlib's XLA FFI headers
    (bridge.native.compile_shared: atomic, RuntimeError with the compiler's first error)."""
    import jax

    compile_shared(SOURCE, out, (*variant.flags, *TUNE), (jax.ffi.include_dir(), str(NATIVE)))


def build(variants: Iterable[Variant] | None = None, force: bool = False
          ) -> dict[str, str | None]:
    """Build the libraries of `variants` (default: every variant this CPU runs) that are not
    built yet (all of them with `force`), several compilers at once. Returns name -> None (built
    now or before) or why it could not be built."""
    variants = [v for v in VARIANTS if v.needs <= cpu_flags()] if variants is None \
        else list(variants)

    def one(variant: Variant) -> str | None:
        try:
            compile_library(variant, library_path(variant))
        except Exception as e:  # noqa: BLE001 - said in the result, the other variants go on
            return str(e)
        return None

    with locked(cache_dir()):
        todo = [v for v in variants if force or not library_path(v).is_file()]
        with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
            done = dict(zip((v.name for v in todo), pool.map(one, todo)))
    return {v.name: done.get(v.name) for v in variants}
