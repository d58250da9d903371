"""`jax-llama bench`: the benchmark suite (llama_twins.bench) from the command line."""

from __future__ import annotations

from .common import add_command, add_progress_argument


def cmd_bench(args) -> int:
    from ..bench import common, suite

    common.SHOW_PROGRESS = args.progress
    if args.llama_bench:
        return _llama_bench(args)
    return suite.run_command(args)


def _llama_bench(args) -> int:
    """--llama-bench FILE: pp and tg for ours and llama.cpp on FILE (llama_twins.bench.llama_bench)."""
    import sys
    from pathlib import Path

    from bridge.errors import BridgeError
    from ..bench import llama_bench

    path = Path(args.llama_bench)
    for value, flag in ((args.n_prompt, "--n-prompt"), (args.n_gen, "--n-gen"),
                        (args.rounds, "--rounds"), (args.repeats, "--repeats")):
        if value is not None and value < 1:
            print(f"error: {flag}: must be at least 1 (got {value})", file=sys.stderr)
            return 2
    if not path.is_file():
        print(f"error: {path}: no such file", file=sys.stderr)
        return 2
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            print(f"error: {path}: not a GGUF file (llama-bench compares on a GGUF llama.cpp "
                  f"reads)", file=sys.stderr)
            return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"error: --out: {out} exists and is not a directory", file=sys.stderr)
        return 2
    prompt_len, new_tokens = args.n_prompt or llama_bench.PP, args.n_gen or llama_bench.TG
    try:
        from bridge.formats import open_checkpoint
        longest = open_checkpoint(path).config.max_seq_len
    except BridgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # pp: the prompt and the token picked after it; tg: a 1-token prompt, then n_gen + 1 tokens
    for flag, tokens in (("--n-prompt", prompt_len + 1), ("--n-gen", new_tokens + 2)):
        if tokens > longest:
            print(f"error: {flag}: its test needs {tokens} positions, more than the model's "
                  f"max_seq_len {longest}", file=sys.stderr)
            return 2
    try:
        result = llama_bench.run(str(path), rounds=args.rounds or 2, repeats=args.repeats or 3,
                                 prompt_len=prompt_len, new_tokens=new_tokens,
                                 quantize=args.quantize)
    except BridgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(llama_bench.write(result, args.out), end="")
    print(f"written: {out / 'llama_bench.md'}, {out / 'llama_bench.json'}", file=sys.stderr)
    return 0


def add_commands(sub) -> None:
    """The subparser of bench."""
    p = add_command(sub, "bench", cmd_bench,
                    help="benchmarks side by side with transformers on the same config: forward, "
                         "train step, decode, conversion, compile time",
                    description="Measure this machine's matmul peak and read bandwidth, then "
                    "forward (prefill) and train-step tokens/s with MFU, decode tokens/s at batch "
                    "1 and 8, conversion throughput and peak RSS against cp -r, and compile time "
                    "against depth, for jax-llama, the torch twin and transformers on the same "
                    "config, each in its own worker process. The table goes to stdout and to "
                    "OUT/bench.md (OUT: the current directory unless --out), every figure to "
                    "OUT/bench.json, progress to stderr.")
    p.add_argument("--preset", help="model config (default: dim 512, 8 layers, 56M parameters; "
                                    "with --quick, tiny)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="params and compute of forward and decode; train computes in it with "
                        "float32 params (default float32)")
    p.add_argument("--only", help="comma-separated subset of forward,train,decode,convert,compile "
                                  "(default: all of those), long, lora (a LoRA train step of "
                                  "llama3.2-1b: peak RSS against full fine-tuning; minutes)")
    p.add_argument("--repeats", type=int, help="timed runs per worker process and round "
                                               "(default 3; --quick 2)")
    p.add_argument("--rounds", type=int, help="rounds of one worker process per implementation, "
                                              "in alternating order (default 2; --quick 1)")
    p.add_argument("--batch", type=int, help="rows of a forward pass and a train step (default 8; "
                                             "--quick 2)")
    p.add_argument("--seq-len", type=int, help="tokens per row (default 256; --quick 32)")
    p.add_argument("--convert-preset", help="model of the conversion benchmark (default "
                                            "llama3.2-1b; with --quick, the --preset)")
    p.add_argument("--out", default=".",
                   help="directory for bench.md and bench.json (default: the current directory)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, short runs, smaller depths: a smoke run in well under a minute")
    p.add_argument("--llama-bench", metavar="FILE",
                   help="instead: llama-bench's pp512 and tg128 on a GGUF FILE, jax-llama (loaded "
                        "as the commands load it) and llama.cpp (llama-cpp-python, where it "
                        "imports) side by side, with the CPU; OUT/llama_bench.{md,json}")
    for flag, tokens in (("--n-prompt", "prompt tokens of the pp test (default 512)"),
                         ("--n-gen", "generated tokens of the tg test (default 128)")):
        p.add_argument(flag, type=int, help=f"with --llama-bench: {tokens}")
    p.add_argument("--quantize", choices=("auto", "stored", "int8", "int4", "float"),
                   help="with --llama-bench: how ours holds the weights (default auto: as the "
                        "commands load the file; float: float32)")
    add_progress_argument(p, lines="stage lines (each worker as it starts)")
