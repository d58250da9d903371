"""`torch-llama`: the PyTorch twin's jobs."""

from __future__ import annotations

import argparse
import sys
import warnings

from bridge import prompting
from bridge.cli import EXIT_OK, cli_main
from bridge.sampling import Sampler


def cmd_generate(args) -> int:
    from .checkpoint import load, resolve_device
    from .generate import generate

    sampler = Sampler(args.temperature, args.top_k, args.top_p)  # refuse bad values before loading
    device = resolve_device(args.device)
    tokenizer = prompting.find_tokenizer(args.checkpoint, args.tokenizer)
    texts = prompting.read_prompts(args)
    model = load(args.checkpoint, device=device, dtype=args.dtype)
    prompts = prompting.encode_prompts(tokenizer, texts, model.config.max_seq_len, args.chat,
                                       args.truncate)
    stream = prompting.Streamer(tokenizer) if len(prompts) == 1 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        result = generate(model, prompts, args.max_new_tokens, sampler,
                          prompting.stop_ids(tokenizer, args.stop), args.seed, on_token=stream)
    prompting.report_warnings(caught)
    prompting.print_results(tokenizer, texts, result.tokens, stream is not None)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torch-llama", description="The PyTorch twin of jax-llama "
                                     "(CUDA, MPS, CPU).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("generate", help="continue prompts with a KV cache (greedy, temperature, "
                                        "top-k, top-p); text streams as it is produced")
    prompting.add_generate_arguments(p)
    p.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps...")
    p.set_defaults(run=cmd_generate)
    return parser


main = cli_main(build_parser)


if __name__ == "__main__":
    sys.exit(main())
