"""Building the decode kernels ahead of time (jax_llama.model.kernels.library, `jax-llama
kernels`): the variant a CPU runs is chosen from its flags, a model never compiles anything (where
none is built it runs XLA's matmul and says so in one line), and kernels="kernels" without them is
refused in one line naming the command that builds them."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from bridge import native
from jax_llama.model.kernels import library

x86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 variants")

V3 = {"cx16", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "bmi1", "bmi2",
      "f16c", "fma", "abm", "movbe", "sse", "sse2", "mmx"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ICELAKE = V4 | {"avx512_vnni", "avx512vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq",
                "avx512ifma", "gfni"}
CPUS = {  # /proc/cpuinfo flag sets (the ones that matter) -> the variant that CPU runs
    "zen4": (ICELAKE | {"avx512_bf16", "clzero"}, "avx512-bf16"),
    "sapphire rapids": (ICELAKE | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
                        "avx512-bf16"),
    "ice lake": (ICELAKE, "avx512-vnni"),
    "cooper lake": (V4 | {"avx512_vnni", "avx512_bf16"}, "avx512-vnni"),  # BF16, no VBMI
    "cascade lake": (V4 | {"avx512_vnni"}, "avx512-vnni"),
    "skylake-x": (V4, "avx512"),
    "haswell": (V3, "avx2"),
    "zen2": (V3 | {"sha_ni", "clzero"}, "avx2"),
    "avx without fma": (V3 - {"fma"}, "plain"),
    "sandy bridge": ({"sse", "sse2", "pni", "ssse3", "sse4_1", "sse4_2", "avx", "popcnt"}, "plain"),
    "none listed": (set(), "plain"),
}


@x86
@pytest.mark.parametrize("cpu", CPUS)
def test_the_variant_a_cpu_runs_is_chosen_from_its_flags(cpu):
    flags, want = CPUS[cpu]
    assert library.variant_for(flags).name == want
    # BF16 without VNNI (no such CPU is known) is not mistaken for the avx512-bf16 build
    assert library.variant_for(V4 | {"avx512_bf16"}).name == "avx512"


def fake_built(cache, *names):
    """Empty files where the libraries of `names` would be (choose() only looks for them)."""
    for name in names:
        path = library.library_path(library.variant_named(name))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")


@x86
def test_choose_takes_the_best_built_variant_or_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_LLAMA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("JAX_LLAMA_KERNEL_MARCH", raising=False)
    zen4 = CPUS["zen4"][0]
    with pytest.raises(library.NotBuilt) as e:
        library.choose(zen4)
    assert str(e.value) == (f"not built for this CPU (avx512-bf16) in {tmp_path}: "
                            "`jax-llama kernels build` builds them")
    fake_built(tmp_path, "avx2", "plain")
    assert library.choose(zen4)[0].name == "avx2"  # the best one built that this CPU runs
    assert library.choose(V3)[0].name == "avx2"
    assert library.choose(set())[0].name == "plain"
    fake_built(tmp_path, "avx512-bf16")
    chosen, path = library.choose(zen4)
    assert chosen.name == "avx512-bf16" and path.parent == tmp_path
    assert library.choose(CPUS["skylake-x"][0])[0].name == "avx2"  # it cannot run avx512-bf16


@x86
def test_the_avx2_switch_runs_the_avx2_variant_on_an_avx512_cpu(tmp_path, monkeypatch):
    """llama_twins.bench.common.AVX2_ENV's JAX_LLAMA_KERNEL_MARCH=x86-64-v3 names the avx2
    variant, and only it: never a better one built beside it, nor a lesser one."""
    from llama_twins.bench.common import AVX2_ENV

    monkeypatch.setenv("JAX_LLAMA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("JAX_LLAMA_KERNEL_MARCH", AVX2_ENV["JAX_LLAMA_KERNEL_MARCH"])
    zen4 = CPUS["zen4"][0]
    fake_built(tmp_path, "avx512-bf16", "plain")
    with pytest.raises(library.NotBuilt, match=r"not built for this CPU \(avx2\)"):
        library.choose(zen4)
    fake_built(tmp_path, "avx2")
    assert library.choose(zen4)[0].name == "avx2"
    monkeypatch.setenv("JAX_LLAMA_KERNEL_MARCH", "avx512")
    with pytest.raises(library.NotBuilt, match="avx512: this CPU lacks avx512bw, avx512cd"):
        library.choose(V3)
    monkeypatch.setenv("JAX_LLAMA_KERNEL_MARCH", "sse9")
    with pytest.raises(library.NotBuilt, match="JAX_LLAMA_KERNEL_MARCH='sse9': expected one of "
                                               "avx512-bf16, avx512-vnni, avx512, avx2, plain"):
        library.choose(zen4)


# A model's first use in a fresh process whose kernel cache is empty, with a "compiler" that
# leaves a mark wherever it is found (as $CXX and as c++, g++ and clang++ on PATH): XLA runs,
# one line says why, and kernels="kernels" is refused in one line.
FIRST_USE = """
import json, jax_llama
from bridge.config import PRESETS
from bridge.errors import BridgeError
from jax_llama.inference.generate import generate
from jax_llama.model.projections import implementation
model, params = jax_llama.init(PRESETS['tiny'], seed=0)
tokens = [generate(model, params, [[5, 9, 2]], 4).tokens for _ in range(2)]
xla, _ = jax_llama.init(PRESETS['tiny'], seed=0, kernels='xla')
out = {'auto': implementation('auto'), 'tokens': tokens,
       'xla': generate(xla, params, [[5, 9, 2]], 4).tokens}
try:
    jax_llama.init(PRESETS['tiny'], seed=0, kernels='kernels')
except BridgeError as e:
    out['refused'] = [e.field, str(e)]
print(json.dumps(out))
"""


def test_a_models_first_use_compiles_nothing_and_runs_xla_with_one_line(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mark = tmp_path / "compiler-called"
    for name in ("c++", "g++", "clang++"):
        (bin_dir / name).write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=str(bin_dir), CXX=str(bin_dir / "c++"), JAX_LLAMA_KERNELS="1",
               JAX_LLAMA_KERNEL_CACHE=str(tmp_path / "cache"))
    env.pop("JAX_LLAMA_KERNEL_MARCH", None)
    done = subprocess.run([sys.executable, "-c", FIRST_USE], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert not mark.exists()  # no compiler was run
    assert not (tmp_path / "cache").exists()
    assert out["auto"] == "xla" and out["tokens"][0] == out["tokens"][1] == out["xla"]
    said = [line for line in done.stderr.splitlines() if "decode kernels" in line]
    assert len(said) == 1, done.stderr[-2000:]
    assert "not built for this CPU" in said[0] and "`jax-llama kernels build`" in said[0]
    assert "using XLA's matmul" in said[0]
    field, message = out["refused"]
    assert field == "kernels" and "\n" not in message
    assert "the decode kernels cannot run here: not built for this CPU" in message
    assert "`jax-llama kernels build` builds them" in message


LOADING = "(bridge/native/loading.cc: a GGUF file's quantised tensors read in one pass each)"


def test_the_command_builds_and_reports_without_a_real_compile(tmp_path, monkeypatch, capsys):
    """`jax-llama kernels build` with a stand-in compiler that writes its -o file: each variant
    this CPU runs is built into the cache under its keyed name, status then names the one this
    CPU runs; a second build compiles nothing; a bad --variant is one line, exit code 2."""
    from llama_twins.cli.main import main

    fake = tmp_path / "fake-c++"
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho lib > "$2"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("JAX_LLAMA_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JAX_LLAMA_KERNEL_MARCH", raising=False)
    runs = [v.name for v in library.VARIANTS if v.needs <= library.cpu_flags()]
    assert main(["kernels"]) == 0
    first = capsys.readouterr().out.splitlines()
    assert first[0].endswith("none runs here: not built for this CPU "
                             f"({runs[0]}) in {tmp_path / 'cache'}: "
                             "`jax-llama kernels build` builds them")
    assert main(["kernels", "build"]) == 0
    built = capsys.readouterr().out.splitlines()
    assert built[:-1] == [f"  {name:<12} built" for name in runs] + [
        f"  {'loading':<12} built {LOADING}"]  # the loads' compiled passes (bridge/native)
    assert built[-1].endswith(f"this CPU runs {runs[0]}")
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.so")) == sorted(
        [library.library_path(library.variant_named(n)).name for n in runs]
        + sorted({native.library_path(cap).name for cap in ("native", "x86-64-v3", "x86-64")}))
    assert main(["kernels", "build"]) == 0
    assert capsys.readouterr().out.splitlines()[:-1] == [
        f"  {n:<12} built before" for n in runs] + [f"  {'loading':<12} built before {LOADING}"]
    assert main(["kernels", "status"]) == 0
    status = capsys.readouterr().out.splitlines()
    assert status[0].endswith(f"this CPU runs {runs[0]}")
    assert [line.split()[0] for line in status[1:] if line.endswith("<- runs")] == [runs[0]]
    monkeypatch.setenv("JAX_LLAMA_KERNELS", "0")
    assert main(["kernels"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(
        f"this CPU runs {runs[0]} (but JAX_LLAMA_KERNELS=0 turns them off here)")
    assert main(["kernels", "build", "--variant", "sse9"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --variant: 'sse9': expected one of "
        f"{', '.join(v.name for v in library.VARIANTS)} (or x86-64-v4, x86-64-v3, x86-64)"]


def test_the_command_without_a_compiler_says_so_and_succeeds(tmp_path, monkeypatch, capsys):
    """A machine without a C++ compiler: the set-up's build step succeeds (exit 0) with one line
    saying models run XLA's matmul, and builds nothing."""
    from llama_twins.cli.main import main

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("JAX_LLAMA_KERNEL_CACHE", str(tmp_path / "cache"))
    assert main(["kernels", "build"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "jax-llama kernels: no C++ compiler (c++, g++ or clang++) on PATH, so the decode kernels "
        "are not built; models run XLA's matmul (install one and run `jax-llama kernels build`)"]
    assert not (tmp_path / "cache").exists()


def test_the_command_with_a_failing_compiler_says_why_and_lets_the_set_up_go_on(
        tmp_path, monkeypatch, capsys):
    """A compiler that fails every variant (one without its C++ headers): each failure said, one
    line that models run XLA's matmul, exit code 0 (the README's set-up goes on); a variant named
    by --variant that fails is exit code 1."""
    from llama_twins.cli.main import main

    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("JAX_LLAMA_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JAX_LLAMA_KERNEL_MARCH", raising=False)
    runs = [v.name for v in library.VARIANTS if v.needs <= library.cpu_flags()]
    assert main(["kernels", "build"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        f"  {n:<12} failed: false failed: exit code 1" for n in runs] + [
        f"  {'loading':<12} failed: false failed: exit code 1 {LOADING}"]
    assert captured.err.splitlines() == [
        f"jax-llama kernels: not built for this CPU ({runs[0]}) in {tmp_path / 'cache'}: "
        "`jax-llama kernels build` builds them; until then models run XLA's matmul"]
    assert main(["kernels", "build", "--variant", "plain"]) == 1
    assert list((tmp_path / "cache").glob("*.so")) == []
