"""`llama-bridge`: convert and inspect checkpoints and merge LoRA adapters into them (bridge
alone), and the two commands that load both twins: the parity report and the round-trip demo.

stdout carries results, stderr progress and errors; exit 0 success, 1 a check failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bridge.config import DEFAULT_PRESET, preset
from bridge.dtypes import DTYPE_NAMES
from bridge.errors import BridgeError
from bridge.formats import FORMATS, open_checkpoint
from bridge.gguf.conventions import FILE_TYPES as GGUF_FILE_TYPES, LLAMA_CPP

from . import models
from .common import (EXIT_CHECK_FAILED, EXIT_OK, add_command, add_progress_argument,
                     add_quantize_arguments, command_main)


def cmd_inspect(args) -> int:
    """Describe a checkpoint; unless --no-scan, also read every tensor and exit 1 if any holds a
    NaN or an infinity (a report's check failed)."""
    from bridge.inspect import describe, scan_non_finite
    from bridge.lora import is_adapter

    if is_adapter(args.path):
        return inspect_adapter(args)
    ckpt = open_checkpoint(args.path, format=args.format)
    report = describe(ckpt)
    if not args.no_scan:
        report["non_finite"] = scan_non_finite(ckpt, progress=args.progress)
    status = EXIT_CHECK_FAILED if report.get("non_finite") else EXIT_OK
    if args.json:
        print(json.dumps(report, indent=2))
        return status
    c = ckpt.config
    print(f"{report['path']}  ({report['format']})")
    print(f"  parameters  {report['parameters']:,} in {report['tensors']} tensors, "
          f"{report['bytes'] / 2**20:,.1f} MiB ({', '.join(report['dtypes'])})")
    print(f"  files       {', '.join(report['files'])}")
    if report["tensor_types"]:
        print("  stored      " + ", ".join(f"{kind} x{n}"
                                           for kind, n in report["tensor_types"].items()))
    if report["loads_as"]:
        print("  loads as    " + ", ".join(f"{n} {layout}" for layout, n in report["loads_as"].items())
              + " (generate, chat, serve, eval; --dtype float32 dequantises)")
    print(f"  family      {c.family}" + (f" (LLaMA's decoder with {', '.join(c.deltas)})"
                                        if c.deltas else ""))
    print(f"  shape       dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads / {c.n_kv_heads} kv "
          f"heads of {c.head_dim}, ffn {c.ffn_dim}, vocab {c.vocab_size}")
    print(f"  positions   max_seq_len {c.max_seq_len}, rope_theta {c.rope_theta:g}, "
          f"rope_scaling {c.rope_scaling}, tie_embeddings {c.tie_embeddings}")
    tok = report["tokenizer"]
    if tok is None:
        print("  tokenizer   none beside the weights")
    elif "error" in tok:
        print(f"  tokenizer   does not load: {tok['error']}")
    else:
        added = [f"{what} {tok[what]} {'added' if tok[f'add_{what}'] else 'not added'}"
                 for what in ("bos", "eos") if tok[what] is not None]
        print(f"  tokenizer   {tok['kind']}, {tok['vocab_size']:,} ids; "
              f"{', '.join(added) or 'no BOS or EOS token'}: {tok['decided_by']}")
    for note in report["notes"]:
        print(f"  note        {note}")
    if "non_finite" not in report:
        print("  values      not scanned (--no-scan)")
    elif not report["non_finite"]:
        print("  values      all finite")
    for name, counts in report.get("non_finite", {}).items():
        print(f"  NON-FINITE  {name}: {counts['nan']:,} NaN, {counts['inf']:,} Inf")
    return status


def inspect_adapter(args) -> int:
    """Describe a PEFT LoRA adapter directory (its fit to a base is checked by merge-lora)."""
    from bridge.merge import describe_adapter

    report = describe_adapter(args.path)
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    print(f"{report['path']}  (PEFT LoRA adapter)")
    targets = ", ".join(map(str, report["target_modules"] or []))
    print(f"  lora        rank {report['rank']}, alpha {report['alpha']} "
          f"(scale {report['scale']}), targets {targets}")
    if report["modules_to_save"]:
        print(f"  trained     {', '.join(map(str, report['modules_to_save']))} (whole)")
    print(f"  parameters  {report['parameters']:,} in {report['tensors']} tensors over "
          f"{report['layers']} layers ({', '.join(report['dtypes'])})")
    print(f"  base model  {report['base_model'] or 'not named'}")
    return EXIT_OK


def writer_options(args) -> dict:
    """The format-specific writer options set by --llama2c-version and --meta-shards."""
    options = {}
    if args.llama2c_version is not None:
        if args.to != "llama2c":
            raise BridgeError("only with --to llama2c", field="llama2c_version")
        options["version"] = args.llama2c_version
    if args.meta_shards is not None:
        if args.to != "meta":
            raise BridgeError("only with --to meta", field="meta_shards")
        options["shards"] = args.meta_shards
    return options


def cmd_convert(args) -> int:
    from bridge.convert import convert

    print(convert(args.src, args.dst, args.to, from_format=args.from_format, dtype=args.dtype,
                  max_shard_size=args.max_shard_size, force=args.force, progress=args.progress,
                  tokenizer=args.tokenizer, quantize=args.quantize, group_size=args.group_size,
                  **writer_options(args)))
    return EXIT_OK


def cmd_merge_lora(args) -> int:
    from bridge.merge import merge_lora

    print(merge_lora(args.base, args.adapter, args.dst, args.to, from_format=args.from_format,
                     dtype=args.dtype, max_shard_size=args.max_shard_size, force=args.force,
                     progress=args.progress, tokenizer=args.tokenizer, **writer_options(args)))
    return EXIT_OK


def cmd_demo(args) -> int:
    """Init in JAX, save, load in torch and compare logits; then back from torch to JAX."""
    from .. import demo  # imports jax and torch: only this command pays for them

    config = preset(args.preset)
    if args.out is not None:
        return demo.run(config, Path(args.out), args.batch, args.seq_len, args.seed)
    with tempfile.TemporaryDirectory(prefix="llama-bridge-demo-") as tmp:
        return demo.run(config, Path(tmp), args.batch, args.seq_len, args.seed)


def cmd_parity(args) -> int:
    """The parity report (llama_twins.parity): exit 0 when every figure is within its bound, else 1."""
    from ..parity import format_parity_report, parity_report  # imports jax and torch when run

    report = parity_report(args.path, dtype=args.dtype, batch=args.batch, seq_len=args.seq_len,
                           new_tokens=args.new_tokens, reference=args.reference, seed=args.seed,
                           reference_f64=args.reference_f64,
                           training=args.training, training_lr=args.training_lr,
                           progress=(lambda message: print(message, file=sys.stderr))
                           if args.progress else None)
    print(json.dumps(report, indent=2) if args.json else format_parity_report(report))
    return EXIT_OK if report["passed"] else EXIT_CHECK_FAILED


def cmd_compare(args) -> int:
    """Is B still A? (llama_twins.compare): exit 0 same or same within quantisation, 1
    different."""
    from ..compare import DIFFERENT, compare, end_line, format_report  # runs the models

    text = None
    if args.text is not None:
        try:
            text = Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BridgeError(f"{args.text}: cannot read the text ({e.__class__.__name__})",
                              field="text") from None
    result, findings = compare(args.a, args.b, adapter=args.adapter, text=text,
                               progress=(lambda message: print(message, file=sys.stderr))
                               if args.progress else None)
    if args.json:
        print(json.dumps({"verdict": result, "end": end_line(result, findings),
                          "sections": [f.to_dict() for f in findings]}, indent=2))
    else:
        print(format_report(result, findings))
    return EXIT_CHECK_FAILED if result == DIFFERENT else EXIT_OK


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the commands that write a checkpoint, streaming (convert, merge-lora)."""
    p.add_argument("--to", choices=FORMATS, default="native", help="output format (default native)")
    p.add_argument("--from", dest="from_format", choices=FORMATS,
                   help="input format (default: detect)")
    by_us, by_llama_cpp = ([n for n, (_, _, by) in GGUF_FILE_TYPES.items()
                            if (by == LLAMA_CPP) == k] for k in (False, True))
    p.add_argument("--dtype", choices=DTYPE_NAMES + tuple(GGUF_FILE_TYPES), metavar="DTYPE",
                   help=f"cast every tensor: {' / '.join(DTYPE_NAMES)} (default: keep the stored "
                        f"dtype); for --to gguf a llama.cpp file type: {' / '.join(by_us)}, or, "
                        f"by llama.cpp's own quantiser (pip install llama-cpp-python), "
                        f"{' / '.join(by_llama_cpp)}; each tensor's type by llama.cpp's rules "
                        f"(norms f32, the output projection with more bits)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file for native / hf output (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--llama2c-version", type=int, choices=(0, 1),
                   help="llama2.c .bin header: 1 (default) or 0, the legacy one run.c reads")
    p.add_argument("--meta-shards", type=int, help="model-parallel files for --to meta (default 1)")
    p.add_argument("--tokenizer", help="a tokenizer file (tokenizer.model / tokenizer.json) to carry "
                                       "instead of the source's, e.g. for a llama2.c checkpoint")
    add_progress_argument(p, "--quiet")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llama-bridge",
                                     description="Move LLaMA weights between JAX, PyTorch and the "
                                                 "formats the world ships them in, and check that "
                                                 "the two twins agree.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = add_command(sub, "inspect", cmd_inspect, help="describe a checkpoint: config, tensors, "
                                                      "sizes, and any NaN / Inf values")
    p.add_argument("path", help="a checkpoint file or directory, any format the bridge reads, "
                                   "or a model's name (`models` lists them)")
    p.add_argument("--from", dest="format", choices=FORMATS, help="the format (default: detect)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-scan", action="store_true",
                   help="do not read the tensors (by default every one is read once, streaming, "
                        "and NaN / Inf values are counted; exit 1 if there are any)")
    add_progress_argument(p, "--quiet")  # the scan's

    p = add_command(sub, "convert", cmd_convert,
                    help="convert a checkpoint between formats, one tensor at a time")
    p.add_argument("src", help="the checkpoint to convert, any format the bridge reads, or "
                                  "a model's name (`models` lists them)")
    p.add_argument("dst", help="where to write it (refused if it exists, unless --force)")
    add_output_arguments(p)
    add_quantize_arguments(p, "--to native only: the projections as int8 with float32 scales "
                              "(the rest in --dtype); jax-llama / torch-llama load it as it is",
                           loads=False)

    p = add_command(sub, "merge-lora", cmd_merge_lora,
                    help="merge a PEFT LoRA adapter into its base checkpoint, one tensor at a time")
    p.add_argument("base", help="the base checkpoint, in any format the bridge reads, or a "
                                   "model's name (`models` lists them)")
    p.add_argument("adapter", help="a PEFT LoRA adapter directory (adapter_config.json + "
                                   "adapter_model.safetensors)")
    p.add_argument("dst", help="where to write the merged checkpoint (refused if it exists, "
                               "unless --force)")
    add_output_arguments(p)

    p = add_command(sub, "demo", cmd_demo, help="round-trip a fresh model JAX -> native -> torch "
                                                "-> JAX and print the largest logit difference")
    p.add_argument("--preset", default="tiny", help=f"a config preset (default tiny; the library "
                                                    f"default is {DEFAULT_PRESET})")
    p.add_argument("--batch", type=int, default=2, help="rows of random tokens (default 2)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per row (default 16)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights and tokens (default 0)")
    p.add_argument("--out", help="keep the checkpoints in this directory (default: a temporary one)")

    p = add_command(sub, "parity", cmd_parity,
                    help="run a checkpoint through the JAX and torch twins (and transformers) and "
                         "check, layer by layer, that they agree")
    p.add_argument("path", help="the checkpoint to check, any format the bridge reads, or "
                                   "a model's name (`models` lists them)")
    # dtype and reference are checked by parity_report, so that a bad value is one line
    p.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    p.add_argument("--batch", type=int, default=2, help="rows of random tokens (default 2)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per row (default 16)")
    p.add_argument("--new-tokens", type=int, default=16,
                   help="greedy tokens each twin generates (default 16; 0 skips the check)")
    p.add_argument("--reference", help="also compare with an independent implementation: "
                                       "transformers, or llama.cpp (the checkpoint exported to "
                                       "GGUF; its logits and greedy tokens) - skipped, with the "
                                       "reason, if not installed")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (default 0)")
    p.add_argument("--no-reference-f64", dest="reference_f64", action="store_false",
                   help="skip the float64 run: the twins' difference is judged against the sum "
                        "of their rounding budgets, and a FAIL cannot name the twin")
    p.add_argument("--no-training", dest="training", action="store_false", default=None,
                   help="skip the training figures (64 bytes a parameter with the float64 run, "
                        "48 without) and load the twins one at a time: what a model too large "
                        "for them gets by default")
    p.add_argument("--training-lr", type=float,
                   help="peak learning rate of the training figures' AdamW steps (default "
                        "3e-3, the training recipe's): a smaller step shows whether a departure "
                        "of the trajectory shrinks with it, as rounding's growth does")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_progress_argument(p, lines="stage lines (what each stage does, as it starts)")

    p = add_command(sub, "compare", cmd_compare,
                    help="is B still A? compare two checkpoints section by section: config, "
                         "tokenizer, chat template, weights, outputs on real text, and where "
                         "they part")
    for name, what in (("a", "the checkpoint B came from, any format the bridge reads, or a "
                              "model's name (`models` lists them)"),
                       ("b", "the converted, quantised or merged checkpoint")):
        p.add_argument(name, help=what)
    p.add_argument("--adapter", help="a PEFT LoRA adapter directory applied to A (compare an "
                                     "adapter with its merge)")
    p.add_argument("--text", help="a UTF-8 text file to run both models on (default: an essay "
                                  "of about 3,000 tokens shipped with the package)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_progress_argument(p, lines="stage lines (what each section does, as it starts)")
    models.add_commands(sub)
    return parser


main = command_main(build_parser)


if __name__ == "__main__":
    sys.exit(main())
