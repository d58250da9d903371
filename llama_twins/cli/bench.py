"""`jax-llama bench`: the benchmark suite (llama_twins.bench) from the command line."""

from __future__ import annotations

from .common import add_command, add_progress_argument


def cmd_bench(args) -> int:
    from ..bench import common, suite

    common.SHOW_PROGRESS = args.progress
    return suite.run_command(args)


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
    add_progress_argument(p, lines="stage lines (each worker as it starts)")
