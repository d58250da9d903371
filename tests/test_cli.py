"""The console scripts: exit codes, one-line errors, and the round-trip demo."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

import jax_llama
from bridge.convert import convert
from bridge.errors import BridgeError
from conftest import small_config
from jax_llama.training.step import TrainConfig
from llama_twins.cli import bridge_main as bridge_cli, main as jax_cli, torch_main as torch_cli


def test_demo_runs_as_installed_console_script(tmp_path):
    result = subprocess.run(["llama-bridge", "demo", "--out", str(tmp_path / "demo")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "max abs difference" in line]
    assert len(lines) == 2 and all(line.rstrip().endswith("ok") for line in lines)
    assert (tmp_path / "demo" / "from_jax" / "model.safetensors").is_file()


def test_inspect(tmp_path, capsys):
    config = small_config()
    _, params = jax_llama.init(config)
    jax_llama.save(tmp_path / "ckpt", config, params)
    assert bridge_cli.main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] == sum(v.size for v in jax.tree_util.tree_leaves(params))
    assert report["config"]["n_kv_heads"] == 2 and report["dtypes"] == ["float32"]
    assert report["non_finite"] == {}
    assert bridge_cli.main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "dim 48, 2 layers, 6 heads / 2 kv heads of 8" in out and "values      all finite" in out


def test_inspect_counts_nan_and_inf_per_tensor_and_exits_1(tmp_path, capsys):
    config = small_config()
    _, params = jax_llama.init(config)
    params = jax.tree_util.tree_map(np.array, params)  # writable host copies
    params["norm"]["weight"][[3, 5]] = np.nan
    params["layers_1"]["feed_forward"]["w2"]["kernel"][0, 1] = -np.inf
    jax_llama.save(tmp_path / "bad", config, params)
    assert bridge_cli.main(["inspect", str(tmp_path / "bad"), "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["non_finite"] == {
        "norm.weight": {"nan": 2, "inf": 0}, "layers.1.feed_forward.w2.weight": {"nan": 0, "inf": 1}}
    assert "scanning" in captured.err  # the progress bar
    assert bridge_cli.main(["inspect", str(tmp_path / "bad"), "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "NON-FINITE  norm.weight: 2 NaN, 0 Inf" in captured.out
    assert "NON-FINITE  layers.1.feed_forward.w2.weight: 0 NaN, 1 Inf" in captured.out
    assert captured.err == ""
    # --no-scan reads no tensor data: nothing to find, nothing to fail
    assert bridge_cli.main(["inspect", str(tmp_path / "bad"), "--no-scan", "--json"]) == 0
    assert "non_finite" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv, message", [
    (["inspect", "/nonexistent/ckpt"], "error: /nonexistent/ckpt: no such file or directory"),
    (["demo", "--preset", "llama9"], "error: --preset: unknown preset 'llama9'"),
    (["demo", "--seq-len", "0"], "error: --seq-len: must be positive (got 0)"),
    (["parity", "/nonexistent/ckpt"], "error: /nonexistent/ckpt: no such file or directory"),
])
def test_bad_input_gives_one_line_and_exit_2(argv, message, capsys):
    assert bridge_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == err.strip().splitlines()[0] and err.startswith(message)


def test_bad_input_from_a_subprocess_has_no_traceback(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dim": 48, "n_layers": 2, "n_heads": 5, "n_kv_heads": 5}))
    result = subprocess.run([sys.executable, "-m", "llama_twins.cli.bridge_main", "inspect", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: {tmp_path}/config.json: LlamaConfig.dim: must be "
                                      f"divisible by n_heads=5 when head_dim is not given (got 48)")


def test_every_command_is_built(capsys):
    for main, command in [(jax_cli.main, "bench"), (jax_cli.main, "generate"), (torch_cli.main, "generate")]:
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and command in out and "not available yet" not in out
    with pytest.raises(SystemExit) as e:
        jax_cli.main(["bench", "--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out


def test_library_errors_name_fields_and_the_command_line_names_flags(tmp_path, capsys):
    """A Python caller reads the field it passed; the command line maps it to its flag once,
    from the subcommand's own argparse definitions."""
    with pytest.raises(BridgeError) as caught:
        TrainConfig(steps=0)
    assert str(caught.value) == "steps: must be a positive integer (got 0)"
    assert caught.value.field == "steps" and "--" not in str(caught.value)
    assert jax_cli.main(["train", "--steps", "0"]) == 2
    assert capsys.readouterr().err == "error: --steps: must be a positive integer (got 0)\n"

    with pytest.raises(BridgeError, match=r"^warmup_steps: must be within"):
        TrainConfig(steps=10, warmup_steps=11)
    assert jax_cli.main(["train", "--steps", "10", "--warmup-steps", "11"]) == 2
    assert capsys.readouterr().err.startswith("error: --warmup-steps: must be within")

    # A remedy names a parameter too: force=True in Python, --force on the command line.
    config = small_config()
    jax_llama.save(tmp_path / "a", config, jax_llama.init(config)[1])
    (tmp_path / "b").mkdir()
    with pytest.raises(BridgeError) as caught:
        convert(tmp_path / "a", tmp_path / "b", progress=False)
    assert str(caught.value) == f"{tmp_path / 'b'}: already exists (use force=True to replace it)"
    assert bridge_cli.main(["convert", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'b'}: already exists "
                                       f"(use --force to replace it)\n")
