"""Two processes joined by jax.distributed (a coordinator on 127.0.0.1, gloo collectives on CPU),
four simulated devices each, train the run one process trains on eight devices: the same losses
and model on three meshes, each process feeding its own rows, orbax checkpoints written by both
and resumed by both, the native model written once. And checkpoints loaded straight onto a mesh:
the parameters of a plain load, bit for bit, each device's part read alone."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import with_host_devices

from bridge.formats import open_checkpoint

HERE = Path(__file__).parent
CLI = [sys.executable, "-c", "import sys; from llama_twins.cli.main import main; sys.exit(main())"]
LIMIT = 240  # seconds any one process may take; the test kills every process past it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv, devices: int) -> subprocess.Popen:
    env = dict(with_host_devices(devices), JAX_PLATFORMS="cpu")
    return subprocess.Popen(CLI + argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(procs) -> list[tuple[int, str, str]]:
    """Wait for every process, at most LIMIT seconds; kill them all on the way out."""
    try:
        outputs = [p.communicate(timeout=LIMIT) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def two_processes(argv) -> list[tuple[int, str, str]]:
    port = free_port()
    procs = [launch(argv + ["--multi-host", "--coordinator", f"127.0.0.1:{port}",
                            "--num-processes", "2", "--process-id", str(i),
                            "--connect-timeout", "60"], devices=4) for i in range(2)]
    return finish(procs)


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and dog ran far away from home with big red ball".split()
    path = tmp_path_factory.mktemp("mp") / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)))
    return path


def run_args(corpus, out, mesh):
    return ["train", "--data", str(corpus), "--steps", "4", "--batch-size", "8", "--seq-len", "32",
            "--mesh", mesh, "--checkpoint-every", "2", "--eval-every", "2", "--sample-tokens", "0",
            "--vocab-size", "300", "--out", str(out)]


# About a minute each: fsdp=8 (the sharded case) runs by default, the other two with -m slow.
@pytest.mark.parametrize("mesh", [pytest.param("data=8", marks=pytest.mark.slow), "fsdp=8",
                                  pytest.param("data=2,fsdp=2,tensor=2", marks=pytest.mark.slow)])
def test_two_processes_train_as_one_process_with_all_the_devices(tmp_path, corpus, mesh):
    ((rc, _, err),) = finish([launch(run_args(corpus, tmp_path / "one", mesh), devices=8)])
    assert rc == 0, err[-2000:]
    results = two_processes(run_args(corpus, tmp_path / "two", mesh))
    for rc, _, err in results:
        assert rc == 0, err[-2000:]
    # float32 sums reduced across two processes instead of within one: measured 1e-7
    # relative on the losses; a process feeding the other's rows, or one missing from a
    # reduction, moves them by > 1e-2.
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5,
                               atol=0)
    one, two = open_checkpoint(tmp_path / "one" / "model"), open_checkpoint(tmp_path / "two" / "model")
    for name, tensor in one:  # after 4 AdamW steps at lr ~1e-3: ~1e-7 apart, atol 1e-5 of ~1e-3 moves
        np.testing.assert_allclose(two.tensor(name), tensor, rtol=0, atol=1e-5, err_msg=name)
    # written once, by process 0: one model, no temporary directory left beside it
    assert sorted(p.name for p in (tmp_path / "two").iterdir() if p.name.startswith(".")) == []

    # Resumed by both processes from the checkpoint both wrote at step 2: the same end.
    import shutil
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "4")
    straight = open_checkpoint(tmp_path / "two" / "model")
    straight = {name: t for name, t in straight}
    results = two_processes(run_args(corpus, tmp_path / "two", mesh) + ["--resume"])
    for rc, _, err in results:
        assert rc == 0, err[-2000:]
        assert "resumed" in err
    for name, tensor in open_checkpoint(tmp_path / "two" / "model"):
        np.testing.assert_array_equal(tensor, straight[name], err_msg=name)
    assert losses(tmp_path / "two")[-2:] == losses(tmp_path / "two")[2:4]


def test_an_unreachable_coordinator_is_one_line_and_no_hang(tmp_path, corpus):
    port = free_port()  # nobody listens there
    proc = launch(run_args(corpus, tmp_path / "run", "data=4") + [
        "--multi-host", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
        "--process-id", "1", "--connect-timeout", "5"], devices=4)
    ((rc, out, err),) = finish([proc])
    assert rc == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"cannot reach 127.0.0.1:{port} within 5 s" in lines[0]
    assert not (tmp_path / "run").exists()


def test_mesh_loading_reads_parts_and_equals_a_plain_load(tmp_path):
    result = subprocess.run([sys.executable, str(HERE / "mesh_load.py"), str(tmp_path)],
                            env=with_host_devices(8),
                            capture_output=True, text=True, timeout=LIMIT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2 * 3 * 2  # formats x meshes x layouts
    for row in rows:
        assert row["equal"], row
        # every sharded tensor was read in parts no larger than a device's share
        assert row["largest_read_fraction"] <= row["expected_fraction"] + 1e-9, row


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "127.0.0.1:1"], "--coordinator: needs --multi-host"),
    (["--multi-host", "--coordinator", "127.0.0.1:1"],
     "--coordinator: give --coordinator, --num-processes and --process-id together"),
    (["--multi-host", "--coordinator", "nowhere", "--num-processes", "2", "--process-id", "1"],
     "--coordinator: expected HOST:PORT (got 'nowhere')"),
])
def test_bad_process_flags_are_one_line(tmp_path, capsys, corpus, flags, message):
    from llama_twins.cli import main as jax_cli

    assert jax_cli.main(run_args(corpus, tmp_path / "run", "data=1") + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}")
    assert not (tmp_path / "run").exists()


def test_a_mesh_axis_that_divides_no_tensor_is_refused(tmp_path, corpus):
    # the tiny preset: dim 64, 4 heads / 2 kv heads of 16, ffn 176; 3 divides none of them
    args = run_args(corpus, tmp_path / "run", "fsdp=3")
    args[args.index("--batch-size") + 1] = "3"
    ((rc, _, err),) = finish([launch(args, devices=3)])
    assert rc == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: --mesh: fsdp=3 divides none of the model's")
    assert not (tmp_path / "run").exists()
