"""`jax-llama`: the JAX jobs. Commands not built yet say so."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bridge.cli import EXIT_CHECK_FAILED, EXIT_OK, add_planned, cli_main
from bridge.config import PRESETS, LlamaConfig
from bridge.errors import BridgeError

PLANNED = [
    ("finetune", "fine-tune a classification head end to end", "the classification issue"),
    ("zero-shot", "classify by prompting, no training", "the classification issue"),
    ("predict", "write a fine-tuned classifier's predictions", "the classification issue"),
    ("bench", "benchmarks side by side with transformers", "the benchmark issue"),
]
# TrainConfig fields settable from the command line (None = default, or the resumed run's value)
TRAIN_OPTIONS = [("steps", int), ("batch_size", int), ("seq_len", int), ("lr", float),
                 ("warmup_steps", int), ("weight_decay", float), ("grad_clip", float),
                 ("grad_accum", int), ("dtype", str), ("eval_every", int),
                 ("checkpoint_every", int), ("keep_checkpoints", int), ("seed", int)]


def cmd_train(args) -> int:
    from .run import RunSpec, TrainingDiverged, train
    from .train import TrainConfig

    out = Path(args.out) if args.out else Path("runs") / time.strftime("train-%Y%m%d-%H%M%S")
    given = {name: getattr(args, name) for name, _ in TRAIN_OPTIONS if getattr(args, name) is not None}
    saved = {}
    if args.resume:
        if not (out / "run.json").is_file():
            raise BridgeError(f"--resume: {out} holds no run to resume (no run.json)")
        saved = json.loads((out / "run.json").read_text())
        train_config = TrainConfig(**{**saved["train"], **given})
        model = LlamaConfig.from_dict(saved["model"])
    else:
        if args.preset not in PRESETS:
            raise BridgeError(f"--preset: unknown preset {args.preset!r}; valid: {', '.join(PRESETS)}")
        train_config, model = TrainConfig(**given), PRESETS[args.preset]
    spec = RunSpec(out=out, model=model, train=train_config,
                   data=args.data if args.data is not None else saved.get("data", []),
                   tokenizer=args.tokenizer or saved.get("tokenizer"),
                   init=args.init or saved.get("init"), vocab_size=args.vocab_size, mesh=args.mesh,
                   scan_layers=args.scan_layers, remat=args.remat, resume=args.resume,
                   sample_tokens=args.sample_tokens)
    if args.multi_host:
        import jax
        jax.distributed.initialize()
    try:
        summary = train(spec)
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    print(f"validation loss {summary['val_loss']:.4f} nats/token (unigram baseline "
          f"{summary['unigram_loss']:.4f}); train loss {summary['train_loss']:.4f} after "
          f"{summary['steps']} steps")
    print(f"model: {summary['model']}  (llama-bridge convert {summary['model']} DST --to hf)")
    if summary["plot"]:
        print(f"loss curve: {summary['plot']}")
    if summary["sample"]:
        print(f"sample:\n{summary['sample']}")
    return EXIT_OK


def cmd_generate(args) -> int:
    import warnings

    from bridge import prompting
    from bridge.sampling import Sampler

    from .checkpoint import load
    from .generate import generate

    sampler = Sampler(args.temperature, args.top_k, args.top_p)  # refuse bad values before loading
    tokenizer = prompting.find_tokenizer(args.checkpoint, args.tokenizer)
    texts = prompting.read_prompts(args)
    model, params = load(args.checkpoint, dtype=args.dtype)
    prompts = prompting.encode_prompts(tokenizer, texts, model.config.max_seq_len, args.chat,
                                       args.truncate)
    stops = prompting.stop_ids(tokenizer, args.stop)
    if args.compare_torch:
        from bridge.parity import format_greedy_parity, greedy_parity
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = greedy_parity(args.checkpoint, prompts, args.max_new_tokens, stops, args.dtype)
        prompting.report_warnings(caught)
        print(format_greedy_parity(report, tokenizer.decode))
        return EXIT_OK if report["identical"] else EXIT_CHECK_FAILED
    stream = prompting.Streamer(tokenizer) if len(prompts) == 1 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        result = generate(model, params, prompts, args.max_new_tokens, sampler, stops, args.seed,
                          on_token=stream)
    prompting.report_warnings(w for w in caught if "donated buffers" not in str(w.message))
    prompting.print_results(tokenizer, texts, result.tokens, stream is not None)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jax-llama", description="LLaMA in JAX: train, generate, "
                                     "fine-tune, benchmark.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("train", help="train (or fine-tune from --init) a LLaMA with optax AdamW; "
                                     "with no --data, on the Python standard library's sources")
    p.add_argument("--preset", default="tiny", help="model config (default tiny)")
    p.add_argument("--data", nargs="+", help="text files or directories (default: the embedded corpus)")
    p.add_argument("--tokenizer", help="tokenizer.model / tokenizer.json (default: --init's, or a "
                                       "byte-level BPE trained on the corpus)")
    p.add_argument("--vocab-size", type=int, default=4096, help="of that BPE (default 4096)")
    p.add_argument("--init", help="start from the weights of any checkpoint the bridge reads")
    p.add_argument("--out", help="run directory (default runs/train-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out exactly")
    p.add_argument("--mesh", help="device mesh, e.g. data=2,fsdp=4,tensor=1 (default: all on data)")
    p.add_argument("--scan-layers", action="store_true", help="nn.scan over blocks (faster compiles)")
    p.add_argument("--remat", action="store_true", help="recompute activations in the backward pass")
    p.add_argument("--multi-host", action="store_true", help="call jax.distributed.initialize() first")
    p.add_argument("--sample-tokens", type=int, default=64, help="length of the sample printed at the end")
    for name, kind in TRAIN_OPTIONS:
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                       choices=("float32", "bfloat16", "float16") if name == "dtype" else None)
    p.set_defaults(run=cmd_train)

    from bridge.prompting import add_generate_arguments
    p = sub.add_parser("generate", help="continue prompts with a KV cache (greedy, temperature, "
                                        "top-k, top-p); text streams as it is produced")
    add_generate_arguments(p)
    p.add_argument("--compare-torch", action="store_true",
                   help="decode greedily with both twins and report where they first differ")
    p.set_defaults(run=cmd_generate)
    add_planned(parser, sub, PLANNED)
    return parser


main = cli_main(build_parser)


if __name__ == "__main__":
    sys.exit(main())
