"""`jax-llama bench --llama-bench FILE` (llama_twins.bench.llama_bench): llama-bench's pp and tg
tests for ours and llama.cpp on one GGUF file. The figures are this machine's and not asserted;
how they are computed, the table's form and the refusals are."""

import json

import pytest

from bridge.convert import convert
from conftest import small_config
from llama_twins.bench import llama_bench
from llama_twins.bench.common import JAX, LLAMA_CPP, Spec
from llama_twins.cli import main as jax_cli
from test_gguf import save


def test_rates_are_llama_benchs_tokens_per_second():
    """pp: prompt tokens over each prompt run; tg: new tokens over each generation run less the
    median 1-token run (its prompt and first token)."""
    spec = Spec(prompt_len=512, new_tokens=128)
    rates = llama_bench.rates({"pp": [2.0, 4.0], "tg1": [0.5, 0.1, 0.3],
                               "tg": [1.3, 2.3]}, spec)
    assert rates == {"pp512": [256.0, 128.0], "tg128": pytest.approx([128.0, 64.0])}


def result(with_llama_cpp: bool) -> dict:
    rows = {JAX: {"pp512": {"mean": 300.0, "std": 3.0, "runs": []},
                  "tg128": {"mean": 40.0, "std": 0.5, "runs": []}}}
    if with_llama_cpp:
        rows[LLAMA_CPP] = {"pp512": {"mean": 400.0, "std": 4.0, "runs": []},
                           "tg128": {"mean": 32.0, "std": 0.2, "runs": []}}
    cpu = {"vendor": "GenuineIntel", "family": 6, "model": 143, "model_name": "Some CPU",
           "flags": ["avx2", "avx512f"]}
    return {"file": "/x/model.Q4_0.gguf", "type": "Q4_0", "bytes": 3 * 2**30,
            "params": 8_030_261_248, "cpu": cpu, "cores": 2, "code_paths": {},
            "layout": "auto", "llama_cpp": "CPU : AVX2 = 1" if with_llama_cpp else "no module",
            "rounds": 2, "repeats": 3, "rows": rows,
            "ratios": {"pp512": 0.75, "tg128": 1.25} if with_llama_cpp else {}}


def test_the_table_is_llama_benchs_with_ours_over_llama_cpps():
    lines = llama_bench.markdown(result(True))
    assert lines[0] == "CPU: Some CPU (GenuineIntel family 6 model 143; avx2, avx512f), 2 cores."
    rows = [line for line in lines if line.startswith("| llama")]
    assert rows == [
        "| llama 8.03 B Q4_0 | 3.00 GiB | 8.03 B | jax-llama | 2 | pp512 | 300.00 ± 3.00 | 0.75x |",
        "| llama 8.03 B Q4_0 | 3.00 GiB | 8.03 B | jax-llama | 2 | tg128 | 40.00 ± 0.50 | 1.25x |",
        "| llama 8.03 B Q4_0 | 3.00 GiB | 8.03 B | llama.cpp | 2 | pp512 | 400.00 ± 4.00 |  |",
        "| llama 8.03 B Q4_0 | 3.00 GiB | 8.03 B | llama.cpp | 2 | tg128 | 32.00 ± 0.20 |  |"]
    alone = "\n".join(llama_bench.markdown(result(False)))
    assert "llama.cpp: not run (no module)" in alone and "| llama.cpp |" not in alone


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-bench")
    native = save(root / "native", small_config(max_seq_len=64))
    return convert(native, root / "tiny.Q8_0.gguf", to="gguf", dtype="q8_0", progress=False)


@pytest.mark.parametrize("argv, message", [
    (["--llama-bench", "/no/such.gguf"], "error: /no/such.gguf: no such file"),
    (["--llama-bench", "{text}"], "error: {text}: not a GGUF file"),
    (["--llama-bench", "{gguf}", "--n-prompt", "0"], "error: --n-prompt: must be at least 1"),
    (["--llama-bench", "{gguf}", "--repeats", "0"], "error: --repeats: must be at least 1"),
    (["--llama-bench", "{gguf}", "--n-prompt", "64"],
     "error: --n-prompt: its test needs 65 positions, more than the model's max_seq_len 64"),
    (["--llama-bench", "{gguf}", "--n-prompt", "8", "--n-gen", "63"],
     "error: --n-gen: its test needs 65 positions, more than the model's max_seq_len 64"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, tiny_gguf, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    argv = [a.format(text=text, gguf=tiny_gguf) for a in argv]
    assert jax_cli.main(["bench", *argv, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(text=text)) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_ours_alone_where_llama_cpp_does_not_import(tiny_gguf, tmp_path, capsys, monkeypatch):
    """Our worker runs on the file; llama.cpp's row is left out with the reason."""
    import llama_twins.llama_cpp_reference as reference
    monkeypatch.setattr(reference, "unavailable", lambda: "llama-cpp-python is not installed")
    assert jax_cli.main(["bench", "--llama-bench", str(tiny_gguf), "--n-prompt", "16",
                         "--n-gen", "4", "--rounds", "1", "--repeats", "1", "--out",
                         str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp: not run (llama-cpp-python is not installed)" in out
    assert "| jax-llama | " in out and "| pp16 |" in out and "| tg4 |" in out
    report = json.loads((tmp_path / "llama_bench.json").read_text())
    assert set(report["rows"]) == {JAX} and report["ratios"] == {}
    assert report["type"] == "Q8_0" and report["cores"] >= 1
    for test in ("pp16", "tg4"):
        assert report["rows"][JAX][test]["mean"] > 0 and len(report["rows"][JAX][test]["runs"]) == 1
    markdown = (tmp_path / "llama_bench.md").read_text()
    assert markdown.startswith("CPU: ") and "\nMeasured by `" in markdown  # the stamps


@pytest.mark.slow
def test_both_sides_on_smollm2(smollm2, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    assert jax_cli.main(["bench", "--llama-bench", str(smollm2), "--n-prompt", "64", "--n-gen",
                         "8", "--rounds", "1", "--repeats", "1", "--out", str(tmp_path),
                         "--no-progress"]) == 0
    report = json.loads((tmp_path / "llama_bench.json").read_text())
    assert set(report["rows"]) == {JAX, LLAMA_CPP} and set(report["ratios"]) == {"pp64", "tg8"}
    assert all(r > 0 for r in report["ratios"].values())
