"""`jax-llama bench` end to end on the tiny config: the figures are this machine's and not
asserted, their form is (every benchmark, every implementation, well-formed markdown tables); and
the same command where transformers does not import."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_XLA_FLAGS, XLA_CACHE_ENV

import llama_twins
from llama_twins.cli import main as jax_cli

IMPLEMENTATIONS = ("jax-llama", "torch_llama", "transformers")


def bench(out, *options, env=None, cwd=None):
    out_option = [] if out is None else ["--out", str(out)]
    return subprocess.run([sys.executable, "-m", "llama_twins.cli.main", "bench", "--quick",
                           *out_option, *options], capture_output=True, text=True, timeout=600,
                          env={**without_xla_cache(os.environ), **(env or {})}, cwd=cwd)


def without_xla_cache(environ) -> dict:
    """The environment without the tests' XLA cache and flags: the benchmarks time compilation
    and the compiled code."""
    env = {k: v for k, v in environ.items() if k not in XLA_CACHE_ENV}
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").strip()
    return env


def files_under(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*")
            if "__pycache__" not in p.parts}


def tables(markdown: str) -> list[list[str]]:
    """The markdown's tables, each a list of its lines."""
    found, current = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            found, current = found + [current], []
    return found


def assert_well_formed(markdown: str) -> None:
    for table in tables(markdown):
        assert len(table) >= 3 and set(table[1].replace("|", "")) == {"-"}, table
        columns = table[0].count("|")
        assert all(line.count("|") == columns and line.endswith("|") for line in table), table


def assert_throughput(rows: dict, implementations) -> None:
    for impl in implementations:
        row = rows[impl]
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] and len(row["runs_s"]) == 2, impl
        assert row["median_s"] == pytest.approx(statistics.median(row["runs_s"]))


# Every section end to end: about 3.5 minutes on 2 cores, so with -m slow; the default run keeps
# the forward section end to end (without transformers, below, also run without --out) and the
# LoRA section.
@pytest.mark.slow
def test_bench_quick_runs_everything_and_writes_json_and_markdown(tmp_path):
    """Run from another directory without --out: the results land in the current directory,
    and nothing is written into the installed package."""
    package = Path(llama_twins.__file__).parent
    before = files_under(package)
    result = bench(None, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert files_under(package) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md"]
    report = json.loads((tmp_path / "bench.json").read_text())
    markdown = (tmp_path / "bench.md").read_text()
    assert result.stdout == markdown  # the table on stdout, progress on stderr
    assert "round 1/1: jax-llama" in result.stderr

    assert report["machine"]["peak_flops"] > 0 and report["machine"]["read_bandwidth"] > 0
    assert report["transformers"]["available"]
    assert report["command"].startswith("jax-llama bench --quick")
    b = report["benchmarks"]
    assert set(b) == {"forward", "train", "decode", "convert", "compile"}
    for name in ("forward", "train"):
        assert_throughput(b[name]["rows"], IMPLEMENTATIONS)
        assert b[name]["rows"]["transformers"]["vs_transformers"] == pytest.approx(1.0)
    for impl in IMPLEMENTATIONS:  # decode rates may be None: too fast to time on the tiny model
        rows = b["decode"]["rows"][impl]
        assert set(rows) == {"1", "8"} and rows["1"]["ttft_s"] > 0, impl
        assert {"decode_tokens_per_s", "vs_transformers", "of_bandwidth_bound"} <= set(rows["1"])
    int8 = ["jax-llama int8", "torch_llama int8", "jax-llama int8 bf16", "torch_llama int8 bf16"]
    theirs = ["transformers int8", "transformers int8 bf16"]  # through torchao, where installed
    assert set(b["decode"]["rows"]) == {*IMPLEMENTATIONS, *int8, *theirs}
    if report["machine"]["torchao"]:
        int8 += theirs
    else:
        assert all(b["decode"]["rows"][label] is None for label in theirs)
        assert "| transformers int8 | | torchao not installed | | | |" in markdown
    assert set(b["decode"]["int8_bound_tokens_per_s"]) == set(int8)
    for label in int8:  # each against its own bound: fewer bytes than float32, a higher bound
        rows = b["decode"]["rows"][label]
        assert set(rows) == {"1", "8"} and rows["1"]["ttft_s"] > 0, label
        assert rows["1"]["bound_tokens_per_s"] > 2 * b["decode"]["bound_tokens_per_s"], label
    assert set(b["convert"]["rows"]) == {"cp", "hf -> native", "native -> hf"}
    assert all(r["peak_rss_bytes"] > 0 and r["median_s"] > 0 for r in b["convert"]["rows"].values())
    assert set(b["compile"]["rows"]) == {"scan_layers=True", "scan_layers=False"}
    assert all(set(r["layers"]) == {"2", "8"} for r in b["compile"]["rows"].values())

    assert_well_formed(markdown)
    lines = markdown.splitlines()
    assert any(line.startswith("Machine: ") and " cores" in line and "transformers " in line
               for line in lines)
    assert any(line.startswith("Measured first: matmul peak ") for line in lines)
    assert "| implementation | s/batch | tokens/s | vs transformers | MFU | all runs (s) |" in lines
    assert f"Reproduce: `{report['command']}`" in lines
    assert len(tables(markdown)) == 5


def test_bench_without_transformers_runs_our_side_and_says_so(tmp_path):
    # A `transformers` that fails to import, first on the path of every worker process.
    shadow = tmp_path / "shadow" / "transformers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'transformers'\", name='transformers')\n")
    path = os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])
    # Run from another directory without --out, as the test above: the results land in the
    # current directory, and nothing is written into the installed package.
    package = Path(llama_twins.__file__).parent
    before = files_under(package)
    (tmp_path / "out").mkdir()
    result = bench(None, "--only", "forward", env={"PYTHONPATH": path}, cwd=tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert files_under(package) == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench.json", "bench.md"]
    assert "warning: transformers is not installed (ModuleNotFoundError" in result.stderr
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["transformers"]["available"] is False and report["machine"]["transformers"] is None
    rows = report["benchmarks"]["forward"]["rows"]
    assert rows["transformers"] is None
    assert_throughput(rows, ("jax-llama", "torch_llama"))
    assert rows["jax-llama"]["vs_transformers"] is None
    markdown = (tmp_path / "out" / "bench.md").read_text()
    assert_well_formed(markdown)
    assert "transformers is not installed" in markdown and "| transformers | not installed |" in markdown
    assert "transformers not installed" in markdown  # on the machine line


@pytest.mark.parametrize("argv, message", [
    (["bench", "--only", "forward,fwd"], "error: --only: unknown benchmark 'fwd'"),
    (["bench", "--preset", "llama9"], "error: --preset: unknown preset 'llama9'"),
    (["bench", "--quick", "--repeats", "0"], "error: --repeats: must be a positive integer (got 0)"),
    (["bench", "--quick", "--seq-len", "4096"],
     "error: --seq-len: 4096 exceeds the model's max_seq_len 256"),
])
def test_bench_bad_input_gives_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert jax_cli.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_bench_refuses_an_out_that_is_a_file_before_measuring(capsys, tmp_path):
    (tmp_path / "results").write_text("not a directory")
    assert jax_cli.main(["bench", "--quick", "--out", str(tmp_path / "results")]) == 2
    assert capsys.readouterr().err == f"error: --out: {tmp_path / 'results'} exists and is not a directory\n"


def test_lora_is_named_not_default():
    """`--only lora` (minutes on llama3.2-1b) runs when named, never by default or with --quick."""
    from llama_twins.bench import suite
    parse = jax_cli.build_parser().parse_args
    assert "lora" not in suite.make_plan(parse(["bench"])).benches
    assert "lora" not in suite.make_plan(parse(["bench", "--quick"])).benches
    assert suite.make_plan(parse(["bench", "--only", "lora"])).benches == ("lora",)


def test_lora_random_weights_are_jax_llama_init_but_the_embedding_drawn_in_blocks():
    import jax
    import numpy as np

    import jax_llama
    from bridge.config import PRESETS
    from llama_twins.bench.lora import EMBEDDING, random_weights
    model, expected = jax_llama.init(PRESETS["tiny"], dtype="bfloat16", param_dtype="bfloat16",
                                     scan_layers=True)
    got = random_weights(model, block_rows=100)  # 512 rows: 6 blocks, the last one clamped
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    flat = lambda tree: dict(jax.tree_util.tree_flatten_with_path(tree)[0])  # noqa: E731
    got, expected = flat(got), flat(expected)
    for path, want in expected.items():
        assert got[path].dtype == want.dtype == "bfloat16" and got[path].shape == want.shape
        if tuple(k.key for k in path) != EMBEDDING:
            assert (got[path] == want).all(), path
    table = np.asarray(next(v for p, v in got.items() if tuple(k.key for k in p) == EMBEDDING),
                       np.float32)
    assert abs(table.mean()) < 1e-3 and abs(table.std() - 0.02) < 1e-3
    assert np.abs(table[:100] - table[100:200]).max() > 0  # each block its own draw


def test_lora_section_on_the_tiny_config(monkeypatch, tmp_path):
    """The lora section with its workers run in this process (one XLA setting): the figures are
    this machine's; their form and the invariants are asserted."""
    import math

    import jax.numpy as jnp

    from bridge.config import PRESETS
    from bridge.lora import adapter_shapes
    from bridge.tensors import count_params
    from llama_twins.bench import lora
    monkeypatch.setattr(lora, "spawn", lambda job, spec, extra=(): lora.JOBS[job](spec, *extra[1:]))
    config = PRESETS["tiny"]
    result = lora.run(config, "tiny", seq_len=32, repeats=2)

    assert list(result["steps"]) == ["jit_train_step", "XLA defaults"]
    assert result["steps"]["XLA defaults"]["compiler_options"] is None
    step = result["steps"]["jit_train_step"]
    from jax_llama.training.step import compiler_options
    assert step["compiler_options"] == compiler_options({"w": jnp.zeros(1, jnp.bfloat16)})
    p, n = step["parameters"], count_params(config)
    adapters = sum(math.prod(shape) for shape in adapter_shapes(config, lora.LORA).values())
    assert p == {"trainable": adapters, "total": n + adapters}
    assert step["base_bytes"] == 2 * n and step["base_dtypes"] == ["bfloat16"]
    # AdamW's mu and nu in float32 for the adapters alone, and a few step counters
    assert 0 <= step["optimizer_state_bytes"] - 2 * 4 * adapters < 64
    assert step["frozen_gradients_dropped"]
    assert set(step["phases"]) == {"build", "compile", "steps"}
    assert step["peak_rss_bytes"] >= max(ph["VmHWM"] for ph in step["phases"].values()) > 0
    assert 0 < step["step_peak_rss_bytes"] <= step["peak_rss_bytes"]
    assert len(step["runs_s"]) == 2 and step["median_s"] > 0 and step["compile_s"] > 0
    assert step["tokens_per_s"] == pytest.approx(32 / step["median_s"])
    # os.times() counts clock ticks (10 ms): a tiny step may take none
    assert len(step["cpu_runs_s"]) == 2 and step["median_cpu_s"] >= 0
    assert len(step["losses"]) == 3 and all(math.isfinite(x) for x in step["losses"])

    rows = {r["bytes_per_param"]: r for r in result["full_finetune"]["rows"]}
    assert rows[16]["need_bytes"] == 16 * n and rows[12]["need_bytes"] == 12 * n
    assert rows[None]["need_bytes"] > 16 * n  # the plan holds at least the state and gradients
    assert result["memory_total_bytes"] > 0 and result["cpu"]

    text = lora.write(result, "python -m llama_twins.bench.lora --quick", tmp_path)
    assert json.loads((tmp_path / "lora_bench.json").read_text())["steps"]["jit_train_step"] == step
    assert (tmp_path / "lora_bench.md").read_text() == text
    assert_well_formed(text)
    assert len(tables(text)) == 2 and "target 8 GB: met" in text


def test_decode_rows_of_batch_1_only_and_the_ratios_against_llama_cpp():
    """Rows measured at batch 1 only (llama.cpp, JAX streamed) sit beside rows at 1 and 8; the
    llama.cpp rows are held to their own files' bytes; each ratio is the median of the rounds'
    ratios (the two rows' rates in the same round), its spread beside it, judged against its
    target."""
    from llama_twins.bench.common import Spec
    from llama_twins.bench.decode import STREAMED, against_llama_cpp, summarize

    both = {"1/1": [0.05, 0.05], "1/128": [2.05, 2.05], "8/1": [0.1] * 2, "8/128": [5.1] * 2}
    rows = {"jax-llama": both, "torch_llama": both, "transformers": both, "jax-llama int8": both,
            STREAMED: {"1/1": [0.05] * 2, "1/128": [2.3] * 2},                # 0.89x the loop
            "llama.cpp F32": {"1/1": [0.04] * 2, "1/128": [1.64] * 2},        # 79.4 tokens/s
            "llama.cpp Q8_0": {"1/1": [0.02] * 2, "1/128": [1.02] * 2},       # 127 tokens/s
            # 4-bit: round 1 at 127 tokens/s, round 2 at 63.5, against Q4_0 at 127 in both:
            # ratios 1.0 and 0.5, median 0.75
            "jax-llama int4": {"1/1": [0.02, 0.05], "1/128": [1.02, 2.05]},
            "llama.cpp Q4_0": {"1/1": [0.02] * 2, "1/128": [1.02] * 2}}
    result = summarize(rows, Spec(), 40e9, {"llama.cpp F32": 540_000_000, "llama.cpp Q8_0": 1})
    assert set(result["rows"]["llama.cpp F32"]) == {"1"}
    assert result["rows"]["llama.cpp F32"]["1"]["bound_tokens_per_s"] == pytest.approx(40e9 / 540e6)
    lines = against_llama_cpp(result, rounds=2)
    assert lines[2].startswith("| jax-llama | 63.5 | llama.cpp F32 | 79.4 | 0.80x | 0.80-0.80x | "
                               "1.0x: not met")
    assert lines[3].startswith("| jax-llama int8 | 63.5 | llama.cpp Q8_0 | 127.0 | 0.50x | "
                               "0.50-0.50x | 1.2x: not met")
    assert lines[4].startswith("| jax-llama int4 | 84.7 | llama.cpp Q4_0 | 127.0 | 0.75x | "
                               "0.50-1.00x | 1.0x: not met")
    assert lines[5].startswith(f"| {STREAMED} | 56.4 | jax-llama | 63.5 | 0.89x | 0.89-0.89x | "
                               f"0.9x: not met")


def test_llama_cpp_repacks_its_weights_unless_built_with_amx(monkeypatch):
    """The llama.cpp rows repack their weights (llama.cpp's full speed) unless the build says
    AMX_INT8 = 1, whose repacked matmul crashes; the decode table says which ran, with the
    build's own features line."""
    from llama_twins import llama_cpp_reference as ref
    from llama_twins.bench.decode import llama_cpp_line

    plain = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_BF16 = 1 | OPENMP = 1 | REPACK = 1 |"
    amx = "CPU : SSE3 = 1 | AVX512 = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | REPACK = 1 |"
    for features, repacks in ((plain, True), (amx, False)):
        monkeypatch.setattr(ref, "build_features", lambda f=features: f)
        assert ref.repacks_safely() is repacks
        line = llama_cpp_line({"llama_cpp_build": features, "llama_cpp_repacks": repacks})
        assert f"`{features}`" in line
        assert ("its weights repacked" in line) is repacks
        assert ("without repacking" in line) is not repacks


def test_gguf_file_type_as_llama_cpp_names_it(smollm2):
    from llama_twins.bench.decode import gguf_file_type
    assert gguf_file_type(smollm2) == "Q4_1"


def test_the_lora_step_trains_the_same_adapters_in_every_implementation():
    """train-lora's three steps (jax_llama.lora, torch_llama.add_lora, peft) train the same
    number of parameters: rank 16 on all seven projections of every layer, nothing else."""
    pytest.importorskip("peft")
    from bridge.config import preset
    from llama_twins.bench import train
    from llama_twins.bench.common import IMPLEMENTATIONS, Spec

    config = preset("tiny")
    spec = Spec(config=config, batch=1, seq_len=16, warmup=0, repeats=1)
    per_layer = 16 * sum(a + b for a, b in [
        (config.dim, config.n_heads * config.head_dim), (config.dim, config.n_kv_heads * config.head_dim),
        (config.dim, config.n_kv_heads * config.head_dim), (config.n_heads * config.head_dim, config.dim),
        (config.dim, config.ffn_dim), (config.ffn_dim, config.dim), (config.dim, config.ffn_dim)])
    for impl in IMPLEMENTATIONS:
        result = train.measure_lora(impl, spec)
        assert result["trainable"] == [config.n_layers * per_layer], impl
        assert len(result["step"]) == 1 and result["step"][0] > 0


def test_variant_rounds_alternate_every_row_in_each_round(monkeypatch):
    """run_variant_rounds runs each labelled variant once a round, in reversed order every other
    round, and pools each variant's timings under its own label (two variants of one
    implementation stay apart)."""
    from llama_twins.bench import common

    calls = []

    def fake_spawn(impl, spec, benches):
        calls.append((impl, spec.repeats))
        return {"decode": {"1/1": [spec.repeats / 10]}}
    monkeypatch.setattr(common, "spawn", fake_spawn)
    monkeypatch.setattr(common, "say", lambda *a, **k: None)
    variants = {"a": ("jax-llama", common.Spec(repeats=1)),
                "b": ("jax-llama", common.Spec(repeats=2)),
                "c": ("llama.cpp", common.Spec(repeats=3))}
    times = common.run_variant_rounds(("decode",), variants, rounds=3)
    assert calls == [("jax-llama", 1), ("jax-llama", 2), ("llama.cpp", 3),
                     ("llama.cpp", 3), ("jax-llama", 2), ("jax-llama", 1),
                     ("jax-llama", 1), ("jax-llama", 2), ("llama.cpp", 3)]
    assert times["b"]["decode"]["1/1"] == [0.2, 0.2, 0.2]
