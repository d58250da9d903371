"""`jax-llama eval`: sliding-window perplexity, NLL per token and bits per byte of text files
(the report and its flags are shared with `torch-llama eval`, in common.py)."""

from __future__ import annotations

from .common import add_command, add_eval_arguments, run_eval, weights
from .options import add_attention_argument, with_kernels


def cmd_eval(args) -> int:
    from jax_llama.checkpoint import load
    from jax_llama.eval import evaluate

    def load_model(checkpoint):
        return with_kernels(args, lambda: load(checkpoint, attention=args.attention,
                                               kernels=args.kernels, progress=args.progress,
                                               **weights(args)))

    return run_eval(args, load_model, lambda loaded, documents, **kw: evaluate(*loaded, documents,
                                                                               **kw))


def add_commands(sub) -> None:
    """The subparser of eval."""
    p = add_command(sub, "eval", cmd_eval,
                    help="sliding-window perplexity, NLL per token and bits per byte of text "
                         "files, per file and overall")
    add_eval_arguments(p)
    add_attention_argument(p)
