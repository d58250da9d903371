"""`torch-llama`: the PyTorch twin's jobs (generate, chat, eval)."""

from __future__ import annotations

import argparse
import sys

from . import models
from .chat import add_chat_command, run_chat
from .common import (add_command, add_eval_arguments, add_generate_arguments, command_main,
                     generation_inputs, print_generation, run_eval, weights)


def cmd_generate(args) -> int:
    """As jax-llama generate: the flags read and the inputs checked, the library's load and
    generate, the text printed."""
    import warnings

    from tasks.prompts import Display
    from torch_llama import generate, load, resolve_device

    device = resolve_device(args.device)  # a bad --device is refused before anything is read
    sampler, texts, _, model, tokenizer, prompts, stops = generation_inputs(
        args, load, device=device, adapter=args.adapter, **weights(args))
    with Display(tokenizer, len(prompts), args.max_new_tokens, args.progress) as shown, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        result = generate(model, prompts, args.max_new_tokens, sampler, stops, args.seed,
                          on_token=shown.on_token)
    return print_generation(tokenizer, texts, result, shown, caught)


def cmd_eval(args) -> int:
    from torch_llama import load, resolve_device
    from torch_llama.eval import evaluate

    device = resolve_device(args.device)  # a bad --device is refused before anything is read

    def load_model(checkpoint):
        return load(checkpoint, device=device, progress=args.progress, **weights(args))

    return run_eval(args, load_model, evaluate)


def cmd_chat(args) -> int:
    from torch_llama import load, resolve_device
    from torch_llama.generate import ChatSession

    device = resolve_device(args.device)  # a bad --device is refused before anything is read

    def open_session(checkpoint, sampler, stops):
        model = load(checkpoint, device=device, adapter=args.adapter, progress=args.progress,
                     **weights(args))
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
