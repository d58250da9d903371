"""The training library speaks through a logger (jax_llama.training, INFO); the command line
decides that its lines go to stderr. A program that configures nothing sees nothing on stderr."""

import logging

from jax_llama.training.state import say
from llama_twins.cli.common import training_voice


def test_the_library_logs_and_prints_nothing_itself(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="jax_llama.training"):
        say("resumed runs/x at step 3")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("jax_llama.training", logging.INFO, "resumed runs/x at step 3")]
    assert capsys.readouterr().err == ""


def test_a_command_prints_the_lines_on_stderr_and_restores_the_logger(capsys):
    log = logging.getLogger("jax_llama.training")
    before = (log.level, log.propagate, list(log.handlers))
    with training_voice():
        say("resumed runs/x at step 3")
    assert capsys.readouterr().err == "resumed runs/x at step 3\n"
    assert (log.level, log.propagate, list(log.handlers)) == before
    say("after the command")  # the negative case: outside a command nothing is printed
    assert capsys.readouterr().err == ""
