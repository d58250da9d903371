"""`python -m jax_llama.harness ARGS`: lm-eval's own command line (`lm-eval run ARGS`) with the
model `jax-llama` registered and chosen unless `--model` says otherwise, and `--batch_size 8`
unless given (lm-eval's default is 1). lm-eval 0.4 discovers models only in its registry, so its
`lm-eval` command cannot see `jax-llama` by itself; this module imports the model first.

    python -m jax_llama.harness --model_args pretrained=runs/main/model --tasks hellaswag,arc_easy

Bad input is one line on stderr and exit 2: a task lm-eval does not know (named), a bad model
argument (named).
"""

from __future__ import annotations

import sys

from bridge.errors import BridgeError

from .lm import DEFAULT_BATCH_SIZE

PROG = "python -m jax_llama.harness"


def _given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] not in ("run", "ls", "validate") and not args[0].startswith("-h"):
        args.insert(0, "run")  # as lm-eval itself does for its legacy form
    if args[:1] == ["run"]:
        if not _given(args, "--model"):
            args += ["--model", "jax-llama"]
        if not _given(args, "--batch_size"):
            args += ["--batch_size", str(DEFAULT_BATCH_SIZE)]
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [PROG, *args]
    try:
        cli_evaluate()
    except BridgeError as e:
        print(f"{PROG}: --model_args {e.render()}", file=sys.stderr)
        return 2
    except ValueError as e:
        message = str(e)
        if not message.startswith("Tasks not found:"):
            raise
        print(f"{PROG}: --tasks: lm-eval {_version()} knows no task "
              f"{message.split(':', 1)[1].strip()} (`lm-eval ls tasks` lists them; "
              f"--include_path DIR adds local YAML tasks)", file=sys.stderr)
        return 2
    return 0


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


if __name__ == "__main__":
    sys.exit(main())
