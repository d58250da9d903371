"""`torch-llama`: the PyTorch twin's jobs (generate)."""

from __future__ import annotations

import argparse
import sys
import warnings

from .commands import (EXIT_OK, add_command, add_generate_arguments, command_main, print_results,
                       read_prompts, report_warnings)


def cmd_generate(args) -> int:
    from bridge.prompts import Streamer, encode_prompts, stop_ids
    from bridge.sampling import Sampler
    from bridge.tokenizer import find_tokenizer
    from torch_llama import load, resolve_device
    from torch_llama.generate import generate

    sampler = Sampler(args.temperature, args.top_k, args.top_p)  # refuse bad values before loading
    device = resolve_device(args.device)
    tokenizer = find_tokenizer(args.checkpoint, args.tokenizer)
    texts = read_prompts(args)
    model = load(args.checkpoint, device=device, dtype=args.dtype)
    prompts = encode_prompts(tokenizer, texts, model.config.max_seq_len, args.chat, args.truncate)
    stream = Streamer(tokenizer) if len(prompts) == 1 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        result = generate(model, prompts, args.max_new_tokens, sampler,
                          stop_ids(tokenizer, args.stop), args.seed, on_token=stream)
    report_warnings(caught)
    print_results(tokenizer, texts, result.tokens, stream is not None)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torch-llama", description="The PyTorch twin of jax-llama "
                                     "(CUDA, MPS, CPU).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = add_command(sub, "generate", cmd_generate,
                    help="continue prompts with a KV cache (greedy, temperature, top-k, top-p); "
                         "text streams as it is produced")
    add_generate_arguments(p)
    p.add_argument("--device", default="auto",
                   help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps...")
    return parser


main = command_main(build_parser)


if __name__ == "__main__":
    sys.exit(main())
