"""llama_twins.results, the one writer of measurements: the JSON carries command, commit, CPU
(vendor, family, model, vector extensions) and date; the markdown is made from the JSON, and
made again from it alone."""

import json
import subprocess

from llama_twins import results

# The first processor of /proc/cpuinfo on a Zen 4 (AVX-512 and its bfloat16 dot products, no AMX);
# a second processor follows, with flags the first lacks, which must not count.
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
flags\t\t: fpu amx_tile amx_bf16
"""
# A Zen 1: the same model name's family, AVX2 only.
ZEN1 = ("vendor_id : AuthenticAMD\ncpu family : 23\nmodel : 1\n"
        "model name : AMD EPYC 7601 32-Core Processor\nflags : fpu avx avx2 fma\n")
SAPPHIRE_RAPIDS = ("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
                   "model name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                   "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")


def test_cpu_flags_are_parsed_from_cpuinfo():
    assert results.cpu(ZEN4) == {"vendor": "AuthenticAMD", "family": 25, "model": 17,
                                 "model_name": "AMD EPYC 9654 96-Core Processor",
                                 "flags": ["avx2", "avx512f", "avx512_bf16"]}
    assert results.cpu(ZEN1)["flags"] == ["avx2"] and results.cpu(ZEN1)["family"] == 23
    assert results.cpu(SAPPHIRE_RAPIDS)["flags"] == ["avx2", "avx512f", "avx512_bf16", "amx"]


def test_without_cpuinfo_platform_names_the_cpu_and_the_rest_is_unknown():
    c = results.cpu("")
    assert c["vendor"] is None and c["family"] is None and c["flags"] is None
    assert isinstance(c["model_name"], str) and c["model_name"]


def test_the_command_line_names_the_script_or_the_command():
    assert results.command_line(["scripts/gemm.py", "--out", "results/bench"]) == \
        "python scripts/gemm.py --out results/bench"
    assert results.command_line(["/venv/bin/jax-llama", "bench", "--out", "a b"]) == \
        "jax-llama bench --out 'a b'"


def test_write_stamps_the_json_and_makes_the_markdown_from_it(tmp_path, monkeypatch):
    parse = results.cpu
    monkeypatch.setattr(results, "cpu", lambda: parse(ZEN4))  # this machine, as a Zen 4
    monkeypatch.setattr("sys.argv", ["scripts/x.py", "--fast"])

    def render(data):
        return ["# x", "", f"rate {data['rate']} tok/s"]
    markdown = results.write("x", {"rate": 12.5}, render, tmp_path)
    data = json.loads((tmp_path / "x.json").read_text())
    assert set(data) == {"rate", "command", "commit", "cpu", "date"}
    assert data["command"] == "python scripts/x.py --fast"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=results.__file__.rsplit("/", 1)[0],
                          capture_output=True, text=True)
    assert data["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert data["cpu"]["flags"] == ["avx2", "avx512f", "avx512_bf16"]
    assert data["date"].endswith("+00:00")
    assert (tmp_path / "x.md").read_text() == markdown
    assert markdown.startswith("# x\n\nrate 12.5 tok/s\n\n"
                               "Measured by `python scripts/x.py --fast` ")
    assert "on AMD EPYC 9654 96-Core Processor (AuthenticAMD family 25 model 17; avx2, " \
           "avx512f, avx512_bf16)" in markdown

    # the markdown is made from the JSON: an edit there shows in the markdown made again
    data["rate"] = 99.0
    (tmp_path / "x.json").write_text(json.dumps(data))
    assert "rate 99.0 tok/s" in results.regenerate(tmp_path / "x.json", render)
    assert "rate 99.0 tok/s" in (tmp_path / "x.md").read_text()


def test_lines_are_kept_in_the_json_and_a_given_command_wins(tmp_path):
    results.write("y", {"command": "jax-llama bench --quick"}, ["# y", "a table"], tmp_path)
    data = json.loads((tmp_path / "y.json").read_text())
    assert data["markdown"] == ["# y", "a table"] and data["command"] == "jax-llama bench --quick"
    (tmp_path / "y.md").unlink()
    assert results.regenerate(tmp_path / "y.json").startswith("# y\na table\n\nMeasured by "
                                                              "`jax-llama bench --quick` at ")


def test_a_result_without_stamps_says_so():
    assert results.provenance_line({"rate": 1, "provenance": results.UNRECORDED}) == \
        "Provenance: measured before provenance was kept."
    assert results.provenance_line({"cpu": "AMD EPYC", "provenance": results.UNRECORDED}) == \
        "Provenance: measured before provenance was kept (recorded: cpu AMD EPYC)."
    assert results.provenance_line({"command": "x", "date": "2026-01-01"}) == \
        "Measured by `x` at an unrecorded commit on an unrecorded CPU, 2026-01-01."
