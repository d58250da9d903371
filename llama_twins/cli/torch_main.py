"""`torch-llama`: the PyTorch twin's jobs (generate, chat, eval)."""

from __future__ import annotations

import argparse
import sys

from . import models
from .chat import add_chat_command, run_chat
from .common import (add_command, add_eval_arguments, add_generate_arguments, command_main,
                     generation_inputs, int4_request, nearest_request, requested_quantization,
                     run_eval, run_generation)


def cmd_generate(args) -> int:
    from torch_llama import generate, load, resolve_device

    device = resolve_device(args.device)  # a bad --device is refused before anything is read

    def load_model(checkpoint):
        model = load_quantized(args, lambda **four: load(
            checkpoint, device=device, dtype=args.dtype, adapter=args.adapter,
            progress=args.progress, **four), checkpoint)
        return model, model.config

    model, tokenizer, texts, prompts, sampler, stops = generation_inputs(args, load_model)
    return run_generation(lambda prompts, stream: generate(
        model, prompts, args.max_new_tokens, sampler, stops, args.seed, on_token=stream),
        tokenizer, texts, prompts, args.max_new_tokens, args.progress)


def load_quantized(args, load, checkpoint=None):
    """load(**options) -> the model, quantised to int8 in place when --quantize asks for it, or
    read as 4-bit weights (load(int4=True)) for --quantize int4; `checkpoint`: args.checkpoint
    already opened, if it is."""
    from torch_llama import quantize

    # refused here, before any weight is read
    from bridge.formats import open_checkpoint

    checkpoint = open_checkpoint(args.checkpoint) if checkpoint is None else checkpoint
    if int4_request(args, checkpoint):  # read as 4-bit weights, as the JAX twin reads them
        return load(int4=True)
    if nearest_request(args, checkpoint):
        return load(nearest=True)
    quantization = requested_quantization(args, checkpoint)
    if (quantization is not None and quantization.group_size is None
            and getattr(args, "adapter", None) is None):  # quantised as each tensor is read
        return load(int8=True)
    model = load()
    if quantization is None:
        return model
    return quantize(model, quantization.group_size, quantization.method)


def cmd_eval(args) -> int:
    from torch_llama import load, resolve_device
    from torch_llama.eval import evaluate

    device = resolve_device(args.device)  # a bad --device is refused before anything is read

    def load_model(checkpoint):
        return load_quantized(args, lambda **four: load(
            checkpoint, device=device, dtype=args.dtype, progress=args.progress, **four),
            checkpoint)

    return run_eval(args, load_model, evaluate)


def cmd_chat(args) -> int:
    from torch_llama import load, resolve_device
    from torch_llama.generate import ChatSession

    device = resolve_device(args.device)  # a bad --device is refused before anything is read

    def open_session(checkpoint, sampler, stops):
        model = load_quantized(args, lambda **four: load(
            checkpoint, device=device, dtype=args.dtype, adapter=args.adapter,
            progress=args.progress, **four), checkpoint)
        return ChatSession(model, args.max_new_tokens, sampler, stops, args.seed), model.config

    return run_chat(args, open_session)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torch-llama", description="The PyTorch twin of jax-llama "
                                     "(CUDA, MPS, CPU).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = add_command(sub, "generate", cmd_generate,
                    help="continue prompts with a KV cache (greedy, temperature, top-k, top-p); "
                         "text streams as it is produced")
    add_generate_arguments(p)
    p.add_argument("--device", default="auto",
                   help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps... (default auto)")
    p = add_chat_command(sub, cmd_chat)
    p.add_argument("--device", default="auto",
                   help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps... (default auto)")
    p = add_command(sub, "eval", cmd_eval,
                    help="sliding-window perplexity, NLL per token and bits per byte of text "
                         "files, per file and overall")
    add_eval_arguments(p)
    p.add_argument("--device", default="auto",
                   help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps... (default auto)")
    models.add_commands(sub)
    return parser


main = command_main(build_parser)


if __name__ == "__main__":
    sys.exit(main())
