"""Generation's compiled programs kept on disk whole, so that a new process loads them instead of
tracing them again.

JAX's persistent compilation cache (jax_llama.perf.use_compile_cache, on in every `jax-llama`
command) saves the compiling, but its key is a hash of the lowered program: every process still
traces the model and lowers it before it can look. For SmolLM2's prefill that was 0.66 s of
tracing and 0.26 s of lowering before the 0.57 s load, on the way to the first token of every
`jax-llama generate` (AMD EPYC Zen 4, 2 cores). Here a program is found by what it is compiled
for instead: the function, its static arguments (the model's repr: its config, dtypes and
implementation choices; the sampler; the cache length), the tree, shapes and dtypes of its
arguments, and everything else that could change what tracing would give - the source of
jax_llama and bridge (hashed once a process), the jax and jaxlib versions, the device and CPU,
XLA_FLAGS, the JAX_* and JAX_LLAMA_* environment and jax's config. A program not found is traced
and compiled (afresh: see _load_or_compile), then serialised (jax.experimental.serialize_executable)
into `programs/` inside that cache's folder, which keeps at most $JAX_LLAMA_PROGRAMS_MAX_MB (1024)
megabytes of them, the least recently used removed first (evict).

    step = program(_prefill, "prefill", (params, tokens, mask, stops, key), dict(model=..., ...))
    d = step(params, tokens, mask, stops, key)

Off, `program` is jax.jit as it was (the function with its static arguments bound): unless
jax_llama.perf.use_compile_cache put a persistent cache in place (every `jax-llama` command does;
a library user, or the test suite, who configured jax's cache alone is left as before); on
several devices (a mesh's shardings are not in the key); and with JAX_LLAMA_PROGRAMS=0. A file
that cannot be read back (another jaxlib wrote it, it was cut short) is compiled again and
overwritten.

Like jax's own cache, the folder holds compiled code, and its files are pickles
(jax.experimental.serialize_executable's format): loading one runs what it holds. So this is the
one place the packages unpickle (tests/test_security.py names it), and only what this user wrote
and no one else can change: the folder is made private (0700), and a file, or a folder, that
another user owns or that group or others may write is neither read nor written (the program is
compiled, as with no store; JAX_LLAMA_PROGRAMS=0 turns the store off altogether). No checkpoint
or other input ever comes through here.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax

from ..perf import COMPILE_CACHE_OFF, keep_programs

log = logging.getLogger(__name__)

SOURCES = ("jax_llama", "bridge")  # the packages whose code a traced program depends on

# compiler options that change nothing on the platform (True: CPU) but the program's cache key
_ANOTHER_KEY = {True: {"xla_gpu_enable_cublaslt": True},
                False: {"xla_cpu_enable_fast_min_max": True}}
_held: dict[tuple, Callable] = {}  # this process's programs, by their key
counts = {"compiled": 0, "loaded": 0}  # programs this process compiled or read from disk


def directory() -> Path | None:
    """The folder programs are kept in, or None where they are not (the module's docstring)."""
    cache = jax.config.jax_compilation_cache_dir
    if not (cache and keep_programs()):
        return None
    if os.environ.get("JAX_LLAMA_PROGRAMS", "").lower() in COMPILE_CACHE_OFF:
        return None
    if jax.device_count() > 1 or not hasattr(os, "getuid"):
        return None
    return Path(cache) / "programs"


def _private(path: Path) -> bool:
    """Whether `path` is this user's and no one else may write it."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def program(jitted, name: str, args: tuple, static: dict[str, Any]) -> Callable:
    """`jitted` (a jax.jit function) compiled for `args` and `static`, as a callable of the
    positional args alone: held in this process, read from disk, or compiled and saved."""
    folder = directory()
    if folder is None:
        return functools.partial(jitted, **static)
    leaves, tree = jax.tree.flatten(args)
    avals = tuple((a.shape, str(a.dtype), a.weak_type)
                  for a in map(jax.api_util.shaped_abstractify, leaves))
    key = (name, tuple(sorted(static.items())), tree, avals)
    if key not in _held:
        _held[key] = _load_or_compile(jitted, name, args, static, folder, _digest(key))
    return _held[key]


def held(name: str) -> int:
    """How many programs named `name` this process holds."""
    return sum(k[0] == name for k in _held)


def _load_or_compile(jitted, name, args, static, folder: Path, digest: str) -> Callable:
    from jax.experimental import serialize_executable

    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:  # a read-only cache: compile, keep nothing
        log.info("%s: not made (%s)", folder, e)
    if not _private(folder):
        log.warning("%s: not private to this user (its owner or mode), so no program is kept "
                    "there", folder)
        return jitted.lower(*args, **static).compile()
    path = folder / f"{name}-{digest}.bin"
    if path.is_file() and not _private(path):
        log.warning("%s: not private to this user, so not loaded; compiling it again", path)
    elif path.is_file():
        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
            counts["loaded"] += 1
            os.utime(path)  # used now: the last to be evicted
            return compiled
        except Exception as e:  # another jaxlib's file, a file cut short: compile it again
            log.info("%s: not loaded (%s: %s); compiling it again", path, type(e).__name__, e)
    # Compiled afresh: an executable that jax read from its persistent cache serialises without
    # the code of some of its functions ("Function wrapped_broadcast not found" when run), and
    # whether jax looks there is settled once a process. An option without effect on this
    # platform gives the program another key there, and the minimum compile time keeps that key
    # out of it.
    minimum = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        compiled = jitted.lower(*args, **static).compile(compiler_options=_ANOTHER_KEY[
            jax.devices()[0].platform == "cpu"])
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", minimum)
    counts["compiled"] += 1
    try:
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{name}-", delete=False) as f:
            pickle.dump((blob, in_tree, out_tree), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(f.name, path)
    except Exception as e:  # a read-only cache, a program that cannot be serialised: run it
        log.info("%s: not saved (%s: %s)", path, type(e).__name__, e)
    evict(folder)
    return compiled


def limit() -> int:
    """The most bytes of programs kept: $JAX_LLAMA_PROGRAMS_MAX_MB megabytes (default 1024)."""
    value = os.environ.get("JAX_LLAMA_PROGRAMS_MAX_MB", "1024")
    try:
        return int(float(value) * 2**20)
    except ValueError:
        from bridge.errors import BridgeError
        raise BridgeError(f"expected a number of megabytes, got {value!r}",
                          field="JAX_LLAMA_PROGRAMS_MAX_MB") from None


def evict(folder: Path) -> list[Path]:
    """Remove the least recently used programs (by modification time: written or loaded) until
    the folder holds at most limit() bytes; the newest is always kept. Returns what was removed.
    SmolLM2's generation programs are 1.5-3 MB each; a new model, sampler, cache length, batch
    shape or jax_llama version makes new ones, so without this the folder only grows."""
    cap, files = limit(), []
    for path in folder.glob("*.bin"):
        try:
            st = path.stat()
        except OSError:  # removed by another process meanwhile
            continue
        files.append((st.st_mtime, st.st_size, path))
    files.sort(reverse=True)  # newest first
    total, removed = 0, []
    for i, (_, size, path) in enumerate(files):
        total += size
        if i > 0 and total > cap:
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def _digest(key: tuple) -> str:
    name, static, tree, avals = key
    parts = [name, repr(static), str(tree), repr(avals), _environment()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


@functools.cache
def _environment() -> str:
    """What, besides a program's own key, decides what tracing and compiling it would give."""
    import jaxlib

    device = jax.devices()[0]
    env = sorted((k, v) for k, v in os.environ.items()
                 if k == "XLA_FLAGS" or k.startswith(("JAX_", "JAX_LLAMA_")))
    config = sorted((k, repr(v)) for k, v in jax.config.values.items())
    return "\n".join(map(str, [
        jax.__version__, jaxlib.__version__, sys.version, platform.machine(), device.platform,
        device.device_kind, _cpu(), env, config, _sources()]))


def _cpu() -> str:
    """The CPU's model and feature flags (XLA:CPU compiles for the CPU it runs on)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f.read(1 << 16).splitlines()
                     if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor()


def _sources() -> str:
    """A hash of the source files of SOURCES (their paths and contents)."""
    h = hashlib.sha256()
    for package in SOURCES:
        root = Path(sys.modules[package].__file__).parent if package in sys.modules else \
            Path(__import__(package).__file__).parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".cc", ".h") and path.is_file():
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()
