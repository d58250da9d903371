"""`llama-bridge`: convert and inspect checkpoints, check the twins' parity, and a round-trip demo.

stdout carries results, stderr errors; exit 0 success, 1 a check failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .config import DEFAULT_PRESET, PRESETS
from .errors import BridgeError
from .formats import FORMATS, open_checkpoint
from .tensors import count_params

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2
_SCAN_CHUNK = 1 << 24  # elements per NaN / Inf count: 16 MiB of booleans at a time


def exits_cleanly(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Turn BridgeError into one line on stderr and exit code 2 (no traceback)."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except BridgeError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    return wrapper


def cli_main(build_parser: Callable[[], argparse.ArgumentParser]) -> Callable[[list[str] | None], int]:
    """The console-script entry point for a parser whose subcommands set `run`."""

    @exits_cleanly
    def main(argv: list[str] | None = None) -> int:
        args = build_parser().parse_args(argv)
        return args.run(args)
    return main


def scan_non_finite(ckpt, progress: bool = True) -> dict[str, dict[str, int]]:
    """{tensor name: {"nan": n, "inf": m}} for every tensor holding a NaN or an infinity; empty
    when all are finite. Reads one tensor at a time, so memory is bounded by the largest one."""
    from tqdm import tqdm

    bad = {}
    with tqdm(total=ckpt.nbytes, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              desc="scanning", leave=False, disable=not progress) as bar:
        for name, (shape, dtype) in ckpt.specs.items():
            nan, inf = _count_non_finite(ckpt.tensor(name))  # the tensor is freed on return
            if nan or inf:
                bad[name] = {"nan": nan, "inf": inf}
            bar.update(math.prod(shape) * dtype.itemsize)
    return bad


def _count_non_finite(array) -> tuple[int, int]:
    """(NaN count, Inf count) of an array, in chunks so that the boolean temporaries stay small."""
    import numpy as np

    flat, nan, inf = array.reshape(-1), 0, 0
    for start in range(0, flat.size, _SCAN_CHUNK):
        chunk = flat[start:start + _SCAN_CHUNK]
        nan += int(np.count_nonzero(np.isnan(chunk)))
        inf += int(np.count_nonzero(np.isinf(chunk)))
    return nan, inf


def cmd_inspect(args) -> int:
    """Describe a checkpoint; unless --no-scan, also read every tensor and exit 1 if any holds a
    NaN or an infinity (a report's check failed)."""
    ckpt = open_checkpoint(args.path, format=args.format)
    report = {
        "path": str(ckpt.path),
        "format": ckpt.format,
        "config": ckpt.config.to_dict(),
        "parameters": count_params(ckpt.config),
        "tensors": len(ckpt.specs),
        "files": [str(f.relative_to(ckpt.path)) if f != ckpt.path else f.name for f in ckpt.files],
        "dtypes": sorted({dtype.name for _, dtype in ckpt.specs.values()}),
        "bytes": ckpt.nbytes,
        "notes": ckpt.notes,
    }
    if not args.no_scan:
        report["non_finite"] = scan_non_finite(ckpt, progress=not args.quiet)
    status = EXIT_CHECK_FAILED if report.get("non_finite") else EXIT_OK
    if args.json:
        print(json.dumps(report, indent=2))
        return status
    c = ckpt.config
    print(f"{report['path']}  ({report['format']})")
    print(f"  parameters  {report['parameters']:,} in {report['tensors']} tensors, "
          f"{report['bytes'] / 2**20:,.1f} MiB ({', '.join(report['dtypes'])})")
    print(f"  files       {', '.join(report['files'])}")
    print(f"  shape       dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads / {c.n_kv_heads} kv "
          f"heads of {c.head_dim}, ffn {c.ffn_dim}, vocab {c.vocab_size}")
    print(f"  positions   max_seq_len {c.max_seq_len}, rope_theta {c.rope_theta:g}, "
          f"rope_scaling {c.rope_scaling}, tie_embeddings {c.tie_embeddings}")
    for note in report["notes"]:
        print(f"  note        {note}")
    if "non_finite" not in report:
        print("  values      not scanned (--no-scan)")
    elif not report["non_finite"]:
        print("  values      all finite")
    for name, counts in report.get("non_finite", {}).items():
        print(f"  NON-FINITE  {name}: {counts['nan']:,} NaN, {counts['inf']:,} Inf")
    return status


def cmd_convert(args) -> int:
    from .convert import convert

    options = {}
    if args.llama2c_version is not None:
        if args.to != "llama2c":
            raise BridgeError("--llama2c-version: only with --to llama2c")
        options["version"] = args.llama2c_version
    if args.meta_shards is not None:
        if args.to != "meta":
            raise BridgeError("--meta-shards: only with --to meta")
        options["shards"] = args.meta_shards
    dst = convert(args.src, args.dst, args.to, from_format=args.from_format, dtype=args.dtype,
                  max_shard_size=args.max_shard_size, force=args.force,
                  progress=not args.quiet, **options)
    print(dst)
    return EXIT_OK


def cmd_demo(args) -> int:
    """Init in JAX, save, load in torch and compare logits; then back from torch to JAX."""
    from . import demo  # imports jax and torch: only this command pays for them

    if args.preset not in PRESETS:
        raise BridgeError(f"--preset: unknown preset {args.preset!r}; known: {', '.join(PRESETS)}")
    if args.out is not None:
        return demo.run(PRESETS[args.preset], Path(args.out), args.batch, args.seq_len, args.seed)
    with tempfile.TemporaryDirectory(prefix="llama-bridge-demo-") as tmp:
        return demo.run(PRESETS[args.preset], Path(tmp), args.batch, args.seq_len, args.seed)


def cmd_parity(args) -> int:
    """The parity report (bridge.parity): exit 0 when every figure is within tolerance, else 1."""
    from .parity import format_parity_report, parity_report  # imports jax and torch when run

    report = parity_report(args.path, dtype=args.dtype, batch=args.batch, seq_len=args.seq_len,
                           new_tokens=args.new_tokens, reference=args.reference, seed=args.seed,
                           progress=lambda message: print(message, file=sys.stderr))
    print(json.dumps(report, indent=2) if args.json else format_parity_report(report))
    return EXIT_OK if report["passed"] else EXIT_CHECK_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llama-bridge",
                                     description="Move LLaMA weights between JAX, PyTorch and the "
                                                 "formats the world ships them in.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="describe a checkpoint: config, tensors, sizes, and "
                                        "any NaN / Inf values")
    p.add_argument("path")
    p.add_argument("--from", dest="format", choices=FORMATS, help="the format (default: detect)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-scan", action="store_true",
                   help="do not read the tensors (by default every one is read once, streaming, "
                        "and NaN / Inf values are counted; exit 1 if there are any)")
    p.add_argument("--quiet", action="store_true", help="no progress bar for the scan")
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("convert", help="convert a checkpoint between formats, one tensor at a time")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", choices=FORMATS, default="native", help="output format (default native)")
    p.add_argument("--from", dest="from_format", choices=FORMATS,
                   help="input format (default: detect)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast every tensor (default: keep the stored dtype)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file for native / hf output (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--llama2c-version", type=int, choices=(0, 1),
                   help="llama2.c .bin header: 1 (default) or 0, the legacy one run.c reads")
    p.add_argument("--meta-shards", type=int, help="model-parallel files for --to meta (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_convert)

    p = sub.add_parser("demo", help="round-trip a fresh model JAX -> native -> torch -> JAX and "
                                    "print the largest logit difference")
    p.add_argument("--preset", default="tiny", help=f"a config preset (default tiny; the library "
                                                    f"default is {DEFAULT_PRESET})")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="keep the checkpoints in this directory (default: a temporary one)")
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("parity", help="run a checkpoint through the JAX and torch twins (and "
                                      "transformers) and check, layer by layer, that they agree")
    p.add_argument("path")
    # dtype and reference are checked by parity_report, so that a bad value is one line
    p.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    p.add_argument("--batch", type=int, default=2, help="rows of random tokens (default 2)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per row (default 16)")
    p.add_argument("--new-tokens", type=int, default=16,
                   help="greedy tokens each twin generates (default 16; 0 skips the check)")
    p.add_argument("--reference", help="also compare with an independent implementation: "
                                       "transformers (skipped, with the reason, if not installed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default 0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=cmd_parity)
    return parser


main = cli_main(build_parser)


if __name__ == "__main__":
    sys.exit(main())
