"""`jax-llama kernels [status]` and `jax-llama kernels build`: the decode kernels
(jax_llama.model.kernels) are compiled here, ahead of time, never when a model runs.

status lists the variants (one library per instruction set), which this CPU runs and which are
built; build compiles the ones this CPU runs (README's set-up runs it). Without a C++ compiler,
or with one that fails, build says so and succeeds (exit code 0; 1 only where a variant named by
--variant failed), so that the set-up goes on: models then run XLA's matmul."""

from __future__ import annotations

import sys
import time

from .common import EXIT_CHECK_FAILED, EXIT_OK, add_command


def cmd_kernels(args) -> int:
    from jax_llama.model.kernels import library

    if args.action == "build":
        return _build(library, args)
    return _status(library)


def _status(library) -> int:
    import jaxlib

    flags = library.cpu_flags()
    try:
        running, _ = library.choose(flags)
        runs = f"this CPU runs {running.name}"
    except library.NotBuilt as e:
        running, runs = None, f"none runs here: {e}"
    from jax_llama.model.kernels import enabled

    off = "" if enabled() else " (but JAX_LLAMA_KERNELS=0 turns them off here)"
    print(f"decode kernels in {library.cache_dir()} (jaxlib {jaxlib.__version__}): {runs}{off}")
    from bridge import native

    for v in library.VARIANTS:
        built = "built" if library.library_path(v).is_file() else "not built"
        fits = "fits this CPU" if v.needs <= flags else "not for this CPU"
        mark = "  <- runs" if v == running else ""
        print(f"  {v.name:<12} {built:<10} {fits:<16} {' '.join(v.flags) or '(default target)'}"
              f"{mark}")
    built = "built" if native.library_path().is_file() else "not built"
    print(f"  {'loading':<12} {built:<10} {'fits this CPU':<16} {' '.join(native.flags()) or '(default target)'}"
          f"  (a load's passes over a GGUF file's bytes; numpy's code where not built)")
    return EXIT_OK


def _build(library, args) -> int:
    from bridge.errors import BridgeError

    try:
        chosen = [library.variant_named(n) for n in args.variant] if args.variant else \
            list(library.VARIANTS) if args.all else None
    except ValueError as e:
        raise BridgeError(str(e), field="variant") from None
    if library.compiler() is None:
        print("jax-llama kernels: no C++ compiler (c++, g++ or clang++) on PATH, so the decode "
              "kernels are not built; models run XLA's matmul (install one and run "
              f"`{library.BUILD_COMMAND}`)", file=sys.stderr)
        return EXIT_OK
    from bridge import native

    start = time.perf_counter()
    before = {v.name for v in library.VARIANTS if library.library_path(v).is_file()}
    loading_before = native.library_path().is_file()
    results = library.build(chosen, force=args.force)
    for name, why in results.items():
        said = "failed: " + why if why else "built before" if name in before and not args.force \
            else "built"
        print(f"  {name:<12} {said}")
    why = native.build(force=args.force)  # the loads' compiled passes: numpy's code without them
    said = "failed: " + why if why else "built before" if loading_before and not args.force \
        else "built"
    print(f"  {'loading':<12} {said} (bridge/native/loading.cc: a GGUF file's quantised tensors "
          f"read in one pass each)")
    try:
        variant, _ = library.choose()
        print(f"decode kernels in {library.cache_dir()} ({time.perf_counter() - start:.0f} s): "
              f"this CPU runs {variant.name}")
    except library.NotBuilt as e:  # every one failed: the set-up goes on, models run XLA's
        print(f"jax-llama kernels: {e}; until then models run XLA's matmul", file=sys.stderr)
    # A variant that could not be built (an old compiler, one without its C++ headers) is said
    # above, and leaves this CPU a lesser one or XLA's matmul: a failure only where it was asked
    # for by name.
    return EXIT_CHECK_FAILED if args.variant and any(results.values()) else EXIT_OK


def add_commands(sub) -> None:
    """The subparser of kernels."""
    p = add_command(sub, "kernels", cmd_kernels,
                    help="the decode kernels for CPU: `kernels` (or `kernels status`) says which "
                         "are built and which this CPU runs; `kernels build` compiles them (a C++ "
                         "compiler; models never compile them)")
    p.add_argument("action", nargs="?", choices=("status", "build"), default="status",
                   help="status (the default) or build")
    p.add_argument("--variant", action="append", metavar="NAME",
                   help="build: only this variant (avx512-bf16, avx512-vnni, avx512, avx2, plain; "
                        "repeatable; default: every one this CPU runs)")
    p.add_argument("--all", action="store_true",
                   help="build: every variant, also those this CPU cannot run")
    p.add_argument("--force", action="store_true", help="build: rebuild those already built")
