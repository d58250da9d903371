"""What the three commands (`llama-bridge`, `jax-llama`, `torch-llama`) share: exit codes, one
line per error with the flag that set the field at fault, and the generate commands' options.

Library code names fields in its errors (`BridgeError(..., field="steps")`); here, where the
arguments are parsed, a field becomes its flag (`--steps: must be a positive integer`) from the
subcommand's own argparse definitions, so the mapping is written once and cannot drift.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

from bridge.dtypes import DTYPE_NAMES
from bridge.errors import BridgeError, python_setting
from bridge.layout import REQUESTS
from bridge.progress import LOG_INTERVAL_S

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def add_command(sub, name: str, run: Callable[[argparse.Namespace], int],
                **kwargs) -> argparse.ArgumentParser:
    """A subcommand whose run(args) returns the exit code; its parser travels with the args so
    that an error can name the subcommand's flags."""
    p = sub.add_parser(name, **kwargs)
    p.set_defaults(run=run, command_parser=p)
    return p


def flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> the option that sets it (its long form), for every option of `parser`."""
    return {action.dest: max(action.option_strings, key=len)
            for action in parser._actions if action.option_strings}


def error_line(error: BridgeError, parser: argparse.ArgumentParser | None) -> str:
    """The one line a BridgeError becomes: its field, and the parameter of its hint, shown as the
    flags that set them where the subcommand has such flags."""
    known = flags(parser) if parser is not None else {}

    def setting(parameter, value) -> str:
        if parameter not in known:
            return python_setting(parameter, value)
        # a switch (store_true, or store_false as --no-...) is set by its flag alone
        return known[parameter] if isinstance(value, bool) else f"{known[parameter]} {value}"
    return "error: " + error.render(name=lambda field: known.get(field, field), setting=setting)


def command_main(build_parser: Callable[[], argparse.ArgumentParser]
                 ) -> Callable[[list[str] | None], int]:
    """The console-script entry point of a parser whose subcommands were made by add_command:
    bad input (BridgeError) is one line on stderr and exit code 2, never a traceback. Run as a
    program (argv None), the process's malloc keeps what it frees for reuse
    (bridge.resources.keep_freed_memory): a caller's own process is left as it is."""

    def main(argv: list[str] | None = None) -> int:
        if argv is None:
            from bridge.resources import keep_freed_memory
            keep_freed_memory()
        args = build_parser().parse_args(argv)
        try:
            with training_voice():
                return args.run(args)
        except BridgeError as e:
            print(error_line(e, getattr(args, "command_parser", None)), file=sys.stderr)
            return EXIT_BAD_INPUT
    return main


class _Stderr(logging.StreamHandler):
    """Each record's message as a line on whatever sys.stderr is when it is written."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


@contextlib.contextmanager
def training_voice():
    """While a command runs: the library's lines - the training loop's
    (jax_llama.training.state.say) and where the decode kernels are compiled
    (jax_llama.model.kernels), logged at INFO - printed on stderr as they are, and not passed on
    to the root logger's handlers."""
    logs = [logging.getLogger(name) for name in VOICES]
    handler, before = _Stderr(), [(log.level, log.propagate) for log in logs]
    handler.setFormatter(logging.Formatter("%(message)s"))
    for log in logs:
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    try:
        yield
    finally:
        for log, (level, propagate) in zip(logs, before):
            log.removeHandler(handler)
            log.setLevel(level)
            log.propagate = propagate


VOICES = ("jax_llama.training", "jax_llama.model.kernels")  # the loggers training_voice prints


def add_progress_argument(p: argparse.ArgumentParser, *aliases: str,
                          lines: str | None = None) -> None:
    """--no-progress (and `aliases`, older spellings): the one flag of every command that shows
    its progress on stderr - progress bars (bridge.progress), or the `lines` it prints instead -
    its library parameter is `progress`."""
    p.add_argument("--no-progress", *aliases, dest="progress", action="store_false",
                   help=f"print no {lines} on stderr" if lines else
                        f"draw no progress bars on stderr (by default they redraw in place on a "
                        f"terminal and print a line every {LOG_INTERVAL_S:.0f} s to a file or "
                        f"pipe; TQDM_DISABLE=1 in the environment also turns them off)")


# -- what `jax-llama generate` and `torch-llama generate` share -----------------------------------

def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT",
                   help="any checkpoint the bridge reads, by path or by name (`models` lists them)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the text to continue ('' starts from BOS)")
    source.add_argument("--prompt-file", help="a batch of prompts, one per line")
    add_sampling_arguments(p, max_new_tokens=128)
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the chat template as a user turn: the checkpoint's own "
                        "(an SFT run saves it with the model), else the one its tokenizer implies")
    p.add_argument("--chat-template", help="llama3, llama2 or a jinja file (implies --chat)")
    p.add_argument("--system", help="a system message before each prompt (with --chat)")
    p.add_argument("--truncate", choices=("left",), help="cut over-long prompts from the left "
                                                         "instead of refusing them")
    add_model_arguments(p)


def add_sampling_arguments(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """How new tokens are chosen, and how many: what generate and chat share."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"tokens generated per reply at most (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens only; 0 = off (default 0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the fewest tokens whose probabilities reach p; 1.0 = off "
                        "(default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--stop", nargs="*", default=[], help="more stop strings (each one token)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model as it is read: its tokenizer, dtype, adapter and quantisation (generate, chat)."""
    p.add_argument("--tokenizer", help="tokenizer.model / tokenizer.json (default: the checkpoint's)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="weights and compute (default: as stored)")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter (PEFT format) merged into the "
                                                    "weights as they load")
    add_quantize_arguments(p)
    add_progress_argument(p)  # the load's, and a --prompt-file batch's decoding (one prompt streams)


def add_quantize_arguments(p: argparse.ArgumentParser,
                           what: str = "int8 weight-only: the projections held as int8 with "
                                       "float32 scales, dequantised in the matmul (embeddings "
                                       "and norms keep --dtype)", loads: bool = True) -> None:
    """--quantize and --group-size: how a load holds the weights (`loads`; checked by the library,
    bridge.layout.decide_layout, whose errors name these fields), or how a convert writes them."""
    p.add_argument("--quantize", choices=REQUESTS if loads else ("int8", "int4"),
                   help=what + "; int4: 4-bit weights in groups of 32 inputs with a scale and a "
                               "minimum (a GGUF's Q4_0 / Q4_1 read as they are, exactly; other "
                               "weights quantised as they load), expanded in the decode kernels' "
                               "registers" + ("; stored: a quantised GGUF in its nearest layout "
                                              "(Q4 types as int4, Q5 to Q8_0 as int8 rows); "
                                              "auto (default): stored without --dtype or "
                                              "--adapter, else float" if loads else ""))
    p.add_argument("--group-size", type=int,
                   help="with --quantize: one scale per this many input columns of each row "
                        "(default: one per output channel)")


def weights(args) -> dict:
    """The load's keywords for how it holds the weights (bridge.layout.decide_layout): --dtype,
    --quantize (auto where not given) and --group-size."""
    return {"dtype": args.dtype, "quantize": args.quantize or "auto",
            "group_size": args.group_size}


def generation_inputs(args, load: Callable[..., object], **options) -> tuple:
    """What both generate commands check and prepare, in an order that refuses bad input before
    the weights are read: (sampler, texts, checkpoint, model, tokenizer, prompt ids, stop ids),
    the model being load(checkpoint, progress=, **options), the twin's own load (options: how
    it holds the weights, weights(args), and the twin's own). The flags are read first; then the checkpoint is opened once: its tokenizer, chat
    template, config and weights all come from that one opening (with Python's cycle collector
    paused: bridge.resources.gc_paused)."""
    from bridge.resources import gc_paused
    from bridge.sampling import Sampler

    if args.system and not (args.chat or args.chat_template):
        raise BridgeError("a system message needs --chat", field="system")
    texts = read_prompts(args)
    sampler = Sampler(args.temperature, args.top_k, args.top_p)
    options = {"progress": args.progress, **options}
    with gc_paused():
        return (sampler, texts, *_generation_inputs(args, texts, load, options))


def _generation_inputs(args, texts, load, options) -> tuple:
    from bridge.formats import open_checkpoint
    from bridge.tokenizer import find_tokenizer
    from tasks.prompts import encode_prompts, stop_ids

    checkpoint = open_checkpoint(args.checkpoint)
    tokenizer = find_tokenizer(checkpoint, args.tokenizer)
    template = None
    if args.chat or args.chat_template:
        from bridge.chat import find_template
        template = find_template(checkpoint, tokenizer, args.chat_template)
    stops = stop_ids(tokenizer, args.stop)
    prompts = encode_prompts(tokenizer, texts, checkpoint.config.max_seq_len, template,
                             args.truncate, system=args.system)
    return checkpoint, load(checkpoint, **options), tokenizer, prompts, stops


def print_generation(tokenizer, texts: Sequence[str], result, display, caught: Iterable) -> int:
    """The end of both generate commands: the warnings recorded while generating (a clipped
    max_new_tokens) as clean lines, then the results (display: the tasks.prompts.Display it
    ran in; after one streamed prompt only a final newline)."""
    report_warnings(w for w in caught if "donated buffers" not in str(w.message))
    print_results(tokenizer, texts, result.tokens, display.stream is not None)
    return EXIT_OK


def read_prompts(args) -> list[str]:
    """--prompt, or the lines of --prompt-file."""
    if args.prompt is not None:
        return [args.prompt]
    try:
        lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BridgeError(f"{args.prompt_file}: {e}", field="prompt_file") from None
    if not lines:
        raise BridgeError(f"{args.prompt_file} holds no prompts", field="prompt_file")
    return lines


def print_results(tokenizer, texts: Sequence[str], outputs: list[list[int]], streamed: bool,
                  out=None) -> None:
    """After streaming one prompt: a final newline. For a batch: each continuation in turn."""
    out = out or sys.stdout
    if streamed:
        out.write("\n")
        return
    stops = set(tokenizer.stop_ids)
    for text, ids in zip(texts, outputs):
        out.write(f"--- {text}\n{tokenizer.decode([t for t in ids if t not in stops])}\n")


def report_warnings(caught: Iterable) -> None:
    """Warnings recorded with warnings.catch_warnings(record=True), one clean line each."""
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)


# -- what `jax-llama eval` and `torch-llama eval` share -------------------------------------------

def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT",
                   help="any checkpoint the bridge reads, by path or by name (`models` lists them)")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE|DIR",
                   help="text files (a .jsonl file: one document per line, its \"text\" field), "
                        "or directories of .txt and .jsonl files; each document is tokenised on "
                        "its own (BOS first when the tokenizer has one) and scored on its own")
    p.add_argument("--seq-len", type=int,
                   help="tokens per window (default: the checkpoint's max_seq_len, at most 1024)")
    p.add_argument("--stride", type=int,
                   help="tokens between window starts (default seq-len // 2). A window scores only "
                        "the tokens no earlier window scored, so each token is scored once, with "
                        "up to seq-len - stride tokens of context (transformers' perplexity "
                        "guide); stride = seq-len: disjoint windows")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    p.add_argument("--tokenizer", help="tokenizer.model / tokenizer.json (default: the checkpoint's)")
    p.add_argument("--dtype", choices=DTYPE_NAMES,
                   help="weights and compute (default: as stored); the loss is float32 always")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout: nll_per_token, perplexity, tokens, "
                        "bits_per_byte, seconds overall and per file under \"files\"")
    add_quantize_arguments(p)
    add_progress_argument(p)


def run_eval(args, load: Callable[[object], object], evaluate: Callable[..., dict]) -> int:
    """What both eval commands do, refusing bad input before the weights are read: read the data,
    open the checkpoint (once) and find its tokenizer, check the windows against its config,
    tokenize, then load(checkpoint) -> model and evaluate(model, documents, seq_len=, stride=,
    batch_size=, progress=) -> the report, printed as a table or (--json) one JSON object."""
    import json

    from tasks.evaluation import format_report, read_texts, tokenize, window_settings
    from bridge.formats import open_checkpoint
    from bridge.tokenizer import find_tokenizer

    if args.batch_size < 1:
        raise BridgeError(f"must be a positive integer (got {args.batch_size})", field="batch_size")
    texts = read_texts(args.data)
    checkpoint = open_checkpoint(args.checkpoint)
    tokenizer = find_tokenizer(checkpoint, args.tokenizer)
    config = checkpoint.config
    if tokenizer.vocab_size > config.vocab_size:
        raise BridgeError(f"{tokenizer.vocab_size} ids do not fit the vocabulary of "
                          f"{args.checkpoint} ({config.vocab_size})", field="tokenizer")
    seq_len, stride = window_settings(config.max_seq_len, args.seq_len, args.stride)
    documents = tokenize(texts, tokenizer)
    model = load(checkpoint)
    report = evaluate(model, documents, seq_len=seq_len, stride=stride,
                      batch_size=args.batch_size, progress=args.progress)
    report = {"checkpoint": str(args.checkpoint), "dtype": args.dtype or "as stored",
              "quantize": args.quantize, "group_size": args.group_size,
              "bos": tokenizer.add_bos, **report}
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return EXIT_OK
