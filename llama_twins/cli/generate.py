"""`jax-llama generate`: continue prompts with the JAX twin (or, with --compare-torch, greedily
with both twins side by side)."""

from __future__ import annotations

import sys

from bridge.errors import BridgeError

from .common import (EXIT_CHECK_FAILED, EXIT_OK, add_command, add_generate_arguments,
                     generation_inputs, print_generation, report_warnings, weights)
from .options import add_attention_argument, kernels_line


def cmd_generate(args) -> int:
    """The flags read and the inputs checked (weights, kernels_line, generation_inputs), the
    checkpoint loaded and continued by the library, the text printed (print_generation)."""
    import warnings

    from jax_llama.checkpoint import load
    from jax_llama.inference.generate import generate
    from tasks.prompts import Display

    if args.compare_torch and args.quantize:
        raise BridgeError("not with --quantize (it compares the float twins)", field="compare_torch")
    held = weights(args)  # how the weights are held: the same in both twins (bridge.layout)
    note = kernels_line(args)  # said once the model is loaded, as its decoding starts
    sampler, texts, checkpoint, (model, params), tokenizer, prompts, stops = generation_inputs(
        args, load, attention=args.attention, adapter=args.adapter, kernels=args.kernels, **held)
    if args.compare_torch:
        import torch_llama

        from ..parity import compare_greedy, format_greedy_parity
        print(note, file=sys.stderr, flush=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # the torch twin from the checkpoint the JAX twin was read from: not opened again
            tmodel = torch_llama.load(checkpoint, device="cpu", adapter=args.adapter, **held)
            report = compare_greedy(model, params, tmodel, prompts, args.max_new_tokens, stops)
        report_warnings(caught)
        print(format_greedy_parity(report, tokenizer.decode))
        return EXIT_OK if report["identical"] else EXIT_CHECK_FAILED
    with Display(tokenizer, len(prompts), args.max_new_tokens, args.progress, note) as shown, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        result = generate(model, params, prompts, args.max_new_tokens, sampler, stops, args.seed,
                          on_token=shown.on_token)
    return print_generation(tokenizer, texts, result, shown, caught)


def add_commands(sub) -> None:
    """The subparser of generate."""
    p = add_command(sub, "generate", cmd_generate,
                    help="continue prompts with a KV cache (greedy, temperature, top-k, top-p); "
                         "text streams as it is produced")
    add_generate_arguments(p)
    add_attention_argument(p)
    p.add_argument("--compare-torch", action="store_true",
                   help="decode greedily with both twins and report where they first differ")
