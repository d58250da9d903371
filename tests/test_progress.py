"""Progress on stderr (bridge.progress): a bar with a rate and a time left, whole lines every
LOG_INTERVAL_S seconds when stderr is not a terminal, none with --no-progress (one spelling on
every command that draws one) or TQDM_DISABLE=1; the training bar's figures."""

import io
import os
import re
import subprocess
import sys

import pytest

from bridge import progress
from bridge.tokenizer import ByteTokenizer
from conftest import save_random_checkpoint, small_config
from jax_llama.training.grpo import GrpoRecipe
from jax_llama.training.recipe import Recipe
from llama_twins.cli import bridge_main, torch_main
from llama_twins.cli import main as jax_cli

# a tqdm line with a count out of its total, the time spent, the time left and a rate:
# "predict: 100%|##########| 7/7 [00:01<00:00,  4.37batch/s]" (a slow unit: "2.10s/batch")
WITH_RATE = (r"[\d.]+[kMG]?/[\d.]+[kMG]? \[\d\d:\d\d<\d\d:\d\d, +[\d.]+[kMG]?"
             r"(?:{unit}/s|s/{unit})\]")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def drawn(stream, monkeypatch, **kw) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    with progress.bar(range(1000), **kw) as bar:
        for _ in bar:
            pass
    return stream.getvalue()


def test_a_bar_in_a_log_is_whole_lines_the_first_and_the_last(monkeypatch):
    text = drawn(io.StringIO(), monkeypatch, desc="work", unit="item", leave=False)
    lines = text.splitlines()
    assert "\r" not in text
    # 1,000 updates well inside one interval: the opening line and the closing one, kept
    # although the bar asked to be cleared (a log keeps where it ended)
    assert len(lines) == 2, lines
    assert lines[0].startswith("work:   0%") and "0/1000" in lines[0]
    assert re.search(WITH_RATE.format(unit="item"), lines[1]), lines[1]
    assert "1000/1000" in lines[1]


def test_a_bar_on_a_terminal_redraws_in_place(monkeypatch):
    text = drawn(Terminal(), monkeypatch, desc="work", unit="item")
    assert text.startswith("\r") and text.count("\r") >= 2  # frames over each other
    assert re.search(WITH_RATE.format(unit="item"), text.rsplit("\r", 1)[-1])


def test_a_bar_that_is_off_draws_nothing(monkeypatch):
    assert drawn(io.StringIO(), monkeypatch, desc="work", unit="item", enabled=False) == ""
    assert drawn(Terminal(), monkeypatch, desc="work", unit="item", enabled=False) == ""


def test_bytes_are_counted_in_binary_units(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress.bar(total=3 * 2**20, desc="copy", unit="B") as bar:
        bar.update(3 * 2**20)
    assert "3.00M/3.00M" in sys.stderr.getvalue()


def test_a_note_goes_to_stderr_on_its_own_line(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress.bar(total=2, desc="work", unit="item") as bar:
        progress.note("llama.cpp: a warning")
        bar.update(2)
    assert "llama.cpp: a warning" in sys.stderr.getvalue().splitlines()


# -- the training bar's figures ---------------------------------------------------------------------

def test_the_training_bar_shows_no_held_out_figure_before_the_first_evaluation():
    step_figures = Recipe().bar  # the recipes' default: loss, held-out loss, tokens/s
    before = step_figures({"loss": 2.5}, 1234.0, None)
    assert before == {"loss": "2.500", "tok_s": "1,234"}
    after = step_figures({"loss": 2.5, "val_loss": 2.7}, 1234.0, {"val_loss": 2.7}, mfu=0.25)
    assert after == {"loss": "2.500", "val": "2.700", "tok_s": "1,234", "mfu": "25.0%"}
    # a held-out loss that is NaN after an evaluation is news, and shown
    assert step_figures({"loss": 1.0}, 1.0, {"val_loss": float("nan")})["val"] == "nan"


def test_the_grpo_bar_shows_the_held_out_reward_only_once_scored():
    step_figures = GrpoRecipe.__new__(GrpoRecipe).bar  # its own: the rewards, no tokens/s
    before = step_figures({"loss": 0.1, "reward": 0.5}, 10.0, None)
    assert before == {"loss": "0.1000", "reward": "0.500"}
    # a round's reward is in the record of its first step only: the bar keeps showing it
    after = step_figures({"loss": 0.1}, 10.0, {"eval/reward": 0.75})
    assert after == {"loss": "0.1000", "reward": "0.500", "held_out": "0.750"}
    fresh = GrpoRecipe.__new__(GrpoRecipe).bar
    assert "nan" not in " ".join(fresh({"loss": 0.1}, 10.0, {}).values())


# -- one flag on every command that draws a bar -----------------------------------------------------

COMMANDS = [
    (jax_cli, ["train"]), (jax_cli, ["sft"]), (jax_cli, ["dpo"]), (jax_cli, ["grpo"]),
    (jax_cli, ["finetune", "--train", "t", "--dev", "d", "--labels", "l", "--out", "o"]),
    (jax_cli, ["zero-shot", "ckpt", "--data", "d", "--labels", "l"]),
    (jax_cli, ["predict", "clf", "--data", "d"]),
    (jax_cli, ["eval", "ckpt", "--data", "d"]),
    (jax_cli, ["generate", "ckpt", "--prompt-file", "p"]),
    (jax_cli, ["chat", "ckpt"]),  # the model's load
    (jax_cli, ["serve", "ckpt"]),
    (torch_main, ["chat", "ckpt"]),
    (torch_main, ["eval", "ckpt", "--data", "d"]),
    (torch_main, ["generate", "ckpt", "--prompt-file", "p"]),
    (bridge_main, ["convert", "src", "dst"]),
    (bridge_main, ["merge-lora", "base", "adapter", "dst"]),
    (bridge_main, ["inspect", "path"]),
    (bridge_main, ["parity", "path"]),  # its stage lines
    (jax_cli, ["bench"]),  # its stage lines
]


@pytest.mark.parametrize("cli, argv", COMMANDS,
                         ids=[f"{cli.__name__.rsplit('.', 1)[1]}-{argv[0]}" for cli, argv in COMMANDS])
def test_every_command_with_a_bar_takes_no_progress(cli, argv):
    parser = cli.build_parser()
    assert parser.parse_args(argv).progress is True
    assert parser.parse_args([*argv, "--no-progress"]).progress is False
    sub = parser.parse_args(argv).command_parser
    assert "--no-progress" in sub.format_help()


@pytest.mark.parametrize("command", ["convert src dst", "merge-lora base adapter dst", "inspect p"])
def test_llama_bridge_keeps_quiet_as_the_old_spelling(command):
    assert bridge_main.build_parser().parse_args([*command.split(), "--quiet"]).progress is False


# -- through a pipe, as beside a training run --------------------------------------------------------

@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A tiny untrained classifier, 20 lines to predict, and a checkpoint to inspect."""
    from jax_llama import classify

    path = tmp_path_factory.mktemp("progress")
    config = small_config(vocab_size=259, tie_embeddings=False)
    classify.new_classifier(config, ["a", "b"], ByteTokenizer(), 32, 0.0, seed=0).save(path / "clf")
    (path / "data.txt").write_text("".join(f"{i % 2} ||| line {i}\n" for i in range(20)))
    save_random_checkpoint(path / "ckpt", small_config(vocab_size=259), tokenizer=True)
    (path / "prompts.txt").write_text("one\ntwo\nthree\n")
    return path


def piped(*argv, env=None) -> str:
    """stderr of a command run with stdout and stderr to pipes (not a terminal)."""
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_predict_through_a_pipe_shows_its_bar_unless_asked_not_to(task):
    argv = ["llama_twins.cli.main", "predict", str(task / "clf"), "--data",
            str(task / "data.txt"), "--batch-size", "4"]
    err = piped(*argv)
    lines = [line for line in err.splitlines() if line.startswith("predict:")]
    assert lines and "\r" not in err
    assert re.search(WITH_RATE.format(unit="batch"), lines[-1]) and "5/5" in lines[-1], err
    assert "predict:" not in piped(*argv, "--no-progress")


def test_inspect_through_a_pipe_and_the_ways_to_silence_it(task):
    argv = ["llama_twins.cli.bridge_main", "inspect", str(task / "ckpt")]
    assert re.search(WITH_RATE.format(unit="B"), piped(*argv))  # "scanning: 100%|...| 52.1k/..."
    for silent in (piped(*argv, "--no-progress"), piped(*argv, "--quiet"),
                   piped(*argv, env={"TQDM_DISABLE": "1"})):
        assert "scanning" not in silent


def test_a_batch_of_prompts_shows_its_decode_steps_and_decodes_the_same(task, capsys):
    argv = ["generate", str(task / "ckpt"), "--prompt-file", str(task / "prompts.txt"),
            "--max-new-tokens", "6"]
    assert jax_cli.main(argv) == 0
    shown = capsys.readouterr()
    assert re.search(r"decoding 3 prompts: .*" + WITH_RATE.format(unit="step"), shown.err)
    assert jax_cli.main([*argv, "--no-progress"]) == 0
    quiet = capsys.readouterr()
    assert "decoding" not in quiet.err
    assert quiet.out == shown.out  # a step per call, counted, or the batch in one call


@pytest.mark.parametrize("twin", ["jax", "torch"])
def test_a_model_load_counts_its_tensors(task, twin, capsys, monkeypatch):
    """A load (minutes for an 8B model) shows the tensors read, in both twins, once it has taken
    LOAD_DELAY_S, unless asked not to: generate with stderr captured (not a terminal)."""
    main = {"jax": jax_cli.main, "torch": torch_main.main}[twin]
    argv = ["generate", str(task / "ckpt"), "--prompt", "hi", "--max-new-tokens", "2"]
    assert main(argv) == 0
    assert "loading:" not in capsys.readouterr().err  # a tiny model's load is not long
    monkeypatch.setattr(progress, "LOAD_DELAY_S", 0.0)  # as if it were
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("loading:")]
    assert lines and re.search(WITH_RATE.format(unit="tensor"), lines[-1])
    from bridge.formats import open_checkpoint
    n = len(open_checkpoint(task / "ckpt").specs)  # 2 layers x 9, the embedding, norm and head
    assert n == 21 and f"{n}/{n}" in lines[-1]
    assert main([*argv, "--no-progress"]) == 0
    assert "loading:" not in capsys.readouterr().err


def test_bench_stage_lines_follow_no_progress(capsys, monkeypatch):
    """`jax-llama bench --no-progress` silences the stage lines (llama_twins.bench.common.say),
    not its warnings; the flag reaches them through cmd_bench."""
    from llama_twins.bench import common, suite

    seen = []
    monkeypatch.setattr(suite, "run_command", lambda args: seen.append(common.SHOW_PROGRESS) or 0)
    monkeypatch.setattr(common, "SHOW_PROGRESS", True)
    assert jax_cli.main(["bench", "--no-progress"]) == 0 and seen == [False]
    common.say("measuring this machine")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(common, "SHOW_PROGRESS", True)
    common.say("measuring this machine")
    assert "measuring this machine" in capsys.readouterr().err


def test_quantising_on_load_shows_its_weights(task, capsys, monkeypatch):
    """--quantize int8 --group-size G quantises once loaded: minutes for an 8B model, a bar of
    its weights (shown once it has taken LOAD_DELAY_S; here as if it had), none with
    --no-progress. Per channel (no --group-size) each tensor is quantised as it is read: the
    loading bar is the one."""
    monkeypatch.setattr(progress, "LOAD_DELAY_S", 0.0)
    import jax_llama.quantize  # noqa: F401 - the module (jax_llama.quantize is its function)
    monkeypatch.setattr(sys.modules["jax_llama.quantize"], "LOAD_DELAY_S", 0.0)
    argv = ["generate", str(task / "ckpt"), "--prompt", "hi", "--max-new-tokens", "2",
            "--quantize", "int8", "--group-size", "16"]
    assert jax_cli.main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("quantising:")]
    assert lines and "15/15" in lines[-1]  # 2 layers x 7 projections and the untied head
    assert jax_cli.main([*argv, "--no-progress"]) == 0
    assert "quantising:" not in capsys.readouterr().err
    assert jax_cli.main(argv[:-2]) == 0
    assert "quantising:" not in capsys.readouterr().err  # quantised as read, under the load's bar
