"""`llama-bridge convert` and `inspect`: streaming, casting, sharding, and every refusal (exit 2,
one line, nothing written)."""

import json
import subprocess

import ml_dtypes
import numpy as np
import pytest

import jax_llama
from llama_twins.cli import bridge_main as cli
from bridge.convert import convert, parse_size
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from conftest import small_config


@pytest.fixture
def native(tmp_path):
    config = small_config(bos_id=1, eos_ids=(2,))
    _, params = jax_llama.init(config, seed=3)
    jax_llama.save(tmp_path / "native", config, params)
    return tmp_path / "native"


def run_cli(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_converts_with_progress_on_stderr(native, tmp_path):
    result = subprocess.run(["llama-bridge", "convert", native, tmp_path / "hf", "--to", "hf"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "hf")
    assert "native -> hf" in result.stderr and "100%" in result.stderr
    assert open_checkpoint(tmp_path / "hf").format == "hf"


@pytest.mark.parametrize("dtype, numpy_dtype", [("bfloat16", ml_dtypes.bfloat16),
                                                ("float16", np.float16)])
def test_dtype_cast_is_per_tensor_round_to_nearest(native, tmp_path, capsys, dtype, numpy_dtype):
    code, _, _ = run_cli(["convert", native, tmp_path / "out", "--dtype", dtype, "--quiet"], capsys)
    assert code == 0
    src, out = open_checkpoint(native), open_checkpoint(tmp_path / "out")
    assert out.stored_dtype() == dtype
    for (name, x), (_, y) in zip(src, out):
        np.testing.assert_array_equal(y, x.astype(numpy_dtype), err_msg=name)
    # and back up to float32 is exact
    code, _, _ = run_cli(["convert", tmp_path / "out", tmp_path / "f32", "--dtype", "float32",
                          "--quiet"], capsys)
    assert code == 0
    for (_, y), (_, z) in zip(out, open_checkpoint(tmp_path / "f32")):
        np.testing.assert_array_equal(z, y.astype(np.float32))


def test_max_shard_size(native, tmp_path, capsys):
    code, _, _ = run_cli(["convert", native, tmp_path / "out", "--to", "hf", "--max-shard-size",
                          "30KB", "--quiet"], capsys)
    assert code == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3
    for shard in shards:
        size = (tmp_path / "out" / shard).stat().st_size
        assert size <= 30_000 + 1024  # the limit counts tensor bytes; the header is extra


@pytest.mark.parametrize("text, expected", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8),
                                            ("2GiB", 2 * 2**30), ("1000", 1000), ("1.5kb", 1500)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1GB", "0"])
def test_parse_size_refuses(text):
    with pytest.raises(BridgeError, match="^max_shard_size: ") as caught:
        parse_size(text)
    assert caught.value.field == "max_shard_size"  # the CLI shows it as --max-shard-size


def test_inspect_reports_format_shards_and_notes(native, tmp_path, capsys):
    convert(native, tmp_path / "hf", to="hf", max_shard_size="30KB", progress=False)
    code, out, _ = run_cli(["inspect", tmp_path / "hf", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["format"] == "hf" and len(report["files"]) > 3
    assert report["files"][0] == f"model-00001-of-{len(report['files']):05d}.safetensors"
    assert report["config"]["eos_ids"] == [2] and report["notes"] == []


# -- refusals: exit 2, one line naming the problem, nothing at DST --------------------------------

def expect_refusal(argv, dst, message, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]  # no temp


def test_truncated_safetensors(native, tmp_path, capsys):
    path = native / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    expect_refusal(["convert", native, tmp_path / "out"], tmp_path / "out",
                   "model.safetensors: not a readable safetensors file", capsys)


def test_corrupt_safetensors_header(native, tmp_path, capsys):
    path = native / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(data))
    expect_refusal(["convert", native, tmp_path / "out"], tmp_path / "out",
                   "not a readable safetensors file", capsys)


@pytest.mark.parametrize("target", ["../outside.safetensors", "/tmp/absolute.safetensors"])
def test_index_naming_a_file_outside(native, tmp_path, capsys, target):
    names = list(open_checkpoint(native).specs)
    (native / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: target for n in names}}))
    expect_refusal(["convert", native, tmp_path / "out"], tmp_path / "out",
                   "points outside the directory", capsys)


def test_index_with_a_missing_shard(native, tmp_path, capsys):
    convert(native, tmp_path / "sharded", max_shard_size="30KB", progress=False)
    second = sorted((tmp_path / "sharded").glob("model-00002-of-*.safetensors"))[0]
    second.unlink()
    expect_refusal(["convert", tmp_path / "sharded", tmp_path / "out"], tmp_path / "out",
                   f"lists shard {second.name}, which does not exist", capsys)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.0.attention.wq.weight"), "tensor 'layers.0.attention.wq.weight' is missing"),
    (lambda t: t.update(extra=np.zeros(3, np.float32)), "unexpected tensor 'extra'"),
    (lambda t: t.update({"norm.weight": np.zeros(47, np.float32)}),
     "tensor 'norm.weight' has shape (47,), but config.json implies (48,)"),
    (lambda t: t.update({"norm.weight": np.zeros(48, np.int64)}), "tensor 'norm.weight' has dtype int64"),
])
def test_bad_tensors(native, tmp_path, capsys, edit, message):
    from safetensors.numpy import load_file, save_file
    tensors = load_file(native / "model.safetensors")
    edit(tensors)
    save_file(tensors, native / "model.safetensors")
    expect_refusal(["convert", native, tmp_path / "out", "--to", "hf"], tmp_path / "out", message,
                   capsys)


def test_config_contradicting_tensors(native, tmp_path, capsys):
    config = json.loads((native / "config.json").read_text())
    (native / "config.json").write_text(json.dumps(dict(config, vocab_size=98)))
    expect_refusal(["convert", native, tmp_path / "out"], tmp_path / "out",
                   "tensor 'tok_embeddings.weight' has shape (97, 48), but config.json implies "
                   "(98, 48)", capsys)


def test_unknown_format(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "weights.npz").write_bytes(b"")
    expect_refusal(["convert", tmp_path / "src", tmp_path / "out"], tmp_path / "out",
                   "not a recognised checkpoint", capsys)


def test_destination_exists(native, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    code, _, err = run_cli(["convert", native, tmp_path / "out"], capsys)
    assert code == 2 and "already exists (use --force to replace it)" in err
    assert (tmp_path / "out" / "config.json").read_text() == "{}"
    code, _, _ = run_cli(["convert", native, tmp_path / "out", "--force", "--quiet"], capsys)
    assert code == 0 and open_checkpoint(tmp_path / "out").format == "native"


def test_output_inside_input_or_containing_it(native, tmp_path, capsys):
    code, _, err = run_cli(["convert", native, native / "sub"], capsys)
    assert code == 2 and "may not be the input or lie inside it" in err
    code, _, err = run_cli(["convert", native, tmp_path, "--force"], capsys)
    assert code == 2 and "may not contain the input" in err
    assert open_checkpoint(native).format == "native"


def test_llama2c_options_are_checked(native, tmp_path, capsys):
    expect_refusal(["convert", native, tmp_path / "m.bin", "--to", "llama2c", "--dtype", "bfloat16"],
                   tmp_path / "m.bin", "llama2.c .bin files hold float32 only", capsys)
    expect_refusal(["convert", native, tmp_path / "out", "--llama2c-version", "0"], tmp_path / "out",
                   "--llama2c-version: only with --to llama2c", capsys)


def test_failure_midway_leaves_nothing(native, tmp_path, monkeypatch):
    from bridge.formats import native as native_format
    calls = []

    def failing_read(info, *files):
        if len(calls) == 5:
            raise OSError("read error")
        calls.append(info)
        return real_read(info, *files)
    real_read = native_format.read_tensor
    monkeypatch.setattr(native_format, "read_tensor", failing_read)
    with pytest.raises(OSError):
        convert(native, tmp_path / "out", to="hf", max_shard_size="10KB", progress=False)
    assert len(calls) == 5 and sorted(p.name for p in tmp_path.iterdir()) == ["native"]
