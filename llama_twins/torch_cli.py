"""`torch-llama`: the PyTorch twin's jobs (generate)."""

from __future__ import annotations

import argparse
import sys

from .commands import (add_command, add_generate_arguments, command_main, generation_inputs,
                       run_generation)


def cmd_generate(args) -> int:
    from torch_llama import generate, load, resolve_device

    device = resolve_device(args.device)  # a bad --device is refused before anything is read

    def load_model():
        model = load(args.checkpoint, device=device, dtype=args.dtype, adapter=args.adapter)
        return model, model.config

    model, tokenizer, texts, prompts, sampler, stops = generation_inputs(args, load_model)
    return run_generation(lambda prompts, stream: generate(
        model, prompts, args.max_new_tokens, sampler, stops, args.seed, on_token=stream),
        tokenizer, texts, prompts)


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
