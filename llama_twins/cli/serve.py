"""`jax-llama serve`: load a checkpoint, start the batching engine and serve the
OpenAI-compatible app (llama_twins.server) until interrupted."""

from __future__ import annotations

import sys
from pathlib import Path

from bridge.dtypes import DTYPE_NAMES
from bridge.errors import BridgeError

from .common import EXIT_OK, add_command, add_progress_argument, add_quantize_arguments, weights
from .options import add_attention_argument, say_kernels, with_kernels


def cmd_serve(args) -> int:
    """Load the model, start the batching engine, serve until interrupted."""
    from bridge.chat import find_template
    from bridge.formats import open_checkpoint
    from bridge.tokenizer import find_tokenizer
    from jax_llama.checkpoint import load
    from jax_llama.inference.serving import Engine

    from ..server import Server, app

    try:
        import uvicorn
    except ImportError:
        raise BridgeError("needs the [serve] extra: pip install 'jax-llama[serve]'",
                          field="serve") from None
    if not 0 < args.port < 65536:
        raise BridgeError(f"must be in 1..65535 (got {args.port})", field="port")
    checkpoint = open_checkpoint(args.checkpoint)  # opened once: tokenizer, template, weights
    tokenizer = find_tokenizer(checkpoint, args.tokenizer)
    template = find_template(checkpoint, tokenizer, args.chat_template)
    model, params = with_kernels(args, lambda: load(
        checkpoint, attention=args.attention, adapter=args.adapter, kernels=args.kernels,
        progress=args.progress, **weights(args)), say=False)
    engine = Engine(model, params, max_batch=args.max_batch, max_len=args.max_context)
    given = Path(args.checkpoint.rstrip("/"))
    # a path: its file or directory name; a model's name (hub id, installed model): as typed
    name = args.model_name or (given.name if given.exists() else args.checkpoint)
    server = Server(engine, model, params, tokenizer, template, name, args.api_key)
    say_kernels(args)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (batches of up to "
          f"{args.max_batch}, context {engine.max_len}{', API key required' if args.api_key else ''})",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(app(server), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return EXIT_OK


def add_commands(sub) -> None:
    """The subparser of serve."""
    p = add_command(sub, "serve", cmd_serve,
                    help="an OpenAI-compatible HTTP server (/v1/chat/completions, "
                         "/v1/completions, /v1/models, /health); requests arriving together "
                         "are decoded together")
    p.add_argument("checkpoint", metavar="CKPT",
                   help="any checkpoint the bridge reads, by path or by name (`models` lists them)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to bind (default 127.0.0.1: this machine only; anything "
                        "else exposes the model to the network)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--max-batch", type=int, default=8,
                   help="rows decoded together (default 8); more requests wait for a free row")
    p.add_argument("--max-context", type=int,
                   help="tokens a request may hold, prompt and reply (default: the model's "
                        "max_seq_len)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint")
    p.add_argument("--model-name", help="the name clients ask for (default: the checkpoint's "
                                        "file or directory name, or the model's name as given: "
                                        "SmolLM2-135M-Instruct, ORG/NAME)")
    p.add_argument("--tokenizer", help="tokenizer file (default: the checkpoint's)")
    p.add_argument("--chat-template", help="llama3, llama2 or a jinja file (default: the "
                                           "checkpoint's own)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="weights and compute (default: as stored)")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter (PEFT format) merged into "
                                                    "the weights as they load")
    add_quantize_arguments(p)
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning",
                                                               "info", "debug"),
                   help="uvicorn's (default warning)")
    add_attention_argument(p)
    add_progress_argument(p)  # the model's load
