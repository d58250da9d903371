"""`jax-llama` turns JAX's persistent compilation cache on (jax_llama.perf.use_compile_cache):
a directory of its own by default, JAX_LLAMA_COMPILE_CACHE to move it or turn it off, and a cache
the user configured for JAX is left as it is. Each case in a fresh interpreter: the setting is
process-wide, and this process has the test suite's own cache."""

import os
import subprocess
import sys

import pytest

SHOW = ("import jax; from jax_llama.perf import use_compile_cache; "
        "print(use_compile_cache(), jax.config.jax_compilation_cache_dir)")


def configured(tmp_path, **env) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_LLAMA_COMPILE_CACHE", "XDG_CACHE_HOME")}
    done = subprocess.run([sys.executable, "-c", SHOW], capture_output=True, text=True,
                          env={**base, "XDG_CACHE_HOME": str(tmp_path / "xdg"), **env}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_default_directory_is_under_the_users_cache(tmp_path):
    expected = str(tmp_path / "xdg" / "jax-llama" / "xla")
    assert configured(tmp_path) == [expected, expected]


@pytest.mark.parametrize("setting", ["off", "0", "OFF"])
def test_turned_off(tmp_path, setting):
    assert configured(tmp_path, JAX_LLAMA_COMPILE_CACHE=setting) == ["None", "None"]


def test_a_directory_of_the_users_choice(tmp_path):
    chosen = str(tmp_path / "mine")
    assert configured(tmp_path, JAX_LLAMA_COMPILE_CACHE=chosen) == [chosen, chosen]


def test_jaxs_own_setting_wins(tmp_path):
    theirs = str(tmp_path / "theirs")
    assert configured(tmp_path, JAX_COMPILATION_CACHE_DIR=theirs,
                      JAX_LLAMA_COMPILE_CACHE="off") == [theirs, theirs]


# -- generation's programs kept whole (jax_llama.inference.programs) -------------------------------

PROGRAMS = """
import json, sys
import numpy as np
import jax_llama
from jax_llama.perf import use_compile_cache
from jax_llama.inference import programs
from jax_llama.inference.generate import ChatSession, generate
from bridge.config import LlamaConfig
use_compile_cache(sys.argv[1])
config = LlamaConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=80, vocab_size=259,
                     max_seq_len=96, norm_eps=1e-5, rope_theta=10000.0)
model, params = jax_llama.init(config, seed=3)
out = generate(model, params, [[1, 5, 9, 2], [7, 3]], 6).tokens
streamed = []
generate(model, params, [[1, 5, 9, 2]], 6, on_token=lambda r, t: streamed.append(t))
chat = ChatSession(model, params, 5)
turns = [chat.reply([1, 4, 4, 2]), chat.reply([1, 4, 4, 2, 8, 8, 9])]
print(json.dumps({"tokens": out, "streamed": streamed, "turns": turns, **programs.counts}))
"""


def run_programs(tmp_path, **env) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_LLAMA_COMPILE_CACHE")}
    done = subprocess.run([sys.executable, "-c", PROGRAMS, str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=300, env={**base, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return __import__("json").loads(done.stdout.strip().splitlines()[-1])


def test_a_new_process_loads_generations_programs_instead_of_tracing_them(tmp_path):
    """The first process compiles generate's and a chat's programs (prefill, decode, extend)
    and keeps them in programs/; the next loads every one and gives the same tokens, streamed
    and in chat turns too. A file cut short is compiled again and replaced; a file others may
    write is not read (compiled again, replaced by a private one), and a folder others may write
    is not used at all; a changed setting that tracing reads (JAX_LLAMA_KERNELS) is another
    program, not the old one. JAX_LLAMA_PROGRAMS=0 keeps none."""
    first = run_programs(tmp_path)
    saved = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "programs").iterdir())
    assert first["compiled"] == len(saved) >= 4 and first["loaded"] == 0
    assert {"prefill", "decode", "extend"} == set(saved)
    second = run_programs(tmp_path)
    assert second["compiled"] == 0 and second["loaded"] == first["compiled"]
    assert [second[k] for k in ("tokens", "streamed", "turns")] == \
        [first[k] for k in ("tokens", "streamed", "turns")]

    for path in (tmp_path / "cache" / "programs").iterdir():
        path.write_bytes(path.read_bytes()[:1000])
    cut = run_programs(tmp_path)
    assert cut["loaded"] == 0 and cut["compiled"] == first["compiled"]
    assert cut["tokens"] == first["tokens"]
    assert run_programs(tmp_path)["loaded"] == first["compiled"]  # replaced whole

    program = next((tmp_path / "cache" / "programs").iterdir())
    program.chmod(0o666)  # others may write it: not read, compiled again and replaced
    shared = run_programs(tmp_path)
    assert shared["loaded"] == first["compiled"] - 1 and shared["compiled"] == 1
    assert program.stat().st_mode & 0o777 == 0o600
    (tmp_path / "cache" / "programs").chmod(0o777)  # the folder too: nothing kept or read
    open_folder = run_programs(tmp_path)
    assert open_folder["loaded"] == 0 and open_folder["tokens"] == first["tokens"]
    (tmp_path / "cache" / "programs").chmod(0o700)

    other = run_programs(tmp_path, JAX_LLAMA_KERNELS="0")
    assert other["loaded"] == 0 and other["compiled"] == first["compiled"]
    off = run_programs(tmp_path, JAX_LLAMA_PROGRAMS="0")
    assert off["loaded"] == off["compiled"] == 0 and off["tokens"] == first["tokens"]


def test_programs_are_kept_only_where_use_compile_cache_asked_for_them(tmp_path):
    """A library user (or this suite) who configured jax's cache alone gets jax.jit as before;
    `jax-llama` commands call use_compile_cache, which turns the programs on."""
    script = ("import jax, sys; from jax_llama.inference import programs; "
              "jax.config.update('jax_compilation_cache_dir', sys.argv[1]); "
              "print(programs.directory()); "
              "from jax_llama.perf import use_compile_cache; use_compile_cache(); "
              "print(programs.directory())")
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_LLAMA_COMPILE_CACHE")}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=base)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", str(tmp_path / "programs")]


def test_the_least_recently_used_programs_are_evicted_past_the_limit(tmp_path, monkeypatch):
    """Past JAX_LLAMA_PROGRAMS_MAX_MB the oldest programs (by modification time: a load touches
    its file) are removed until the rest fit; the newest stays even alone over the limit; a bad
    limit is refused naming the variable."""
    from bridge.errors import BridgeError
    from jax_llama.inference import programs

    sizes = {"a": 400_000, "b": 300_000, "c": 500_000, "d": 200_000}  # written in this order
    for age, (name, size) in enumerate(sizes.items()):
        path = tmp_path / f"prefill-{name}.bin"
        path.write_bytes(b"\0" * size)
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    os.utime(tmp_path / "prefill-a.bin")  # "a" loaded just now: the most recently used
    (tmp_path / "notes.txt").write_text("not a program")
    monkeypatch.setenv("JAX_LLAMA_PROGRAMS_MAX_MB", str(1_000_000 / 2**20))  # 1,000,000 bytes
    removed = programs.evict(tmp_path)
    # newest first: a (400k), d (200k), c (500k: over) -> c and b go
    assert sorted(p.name for p in removed) == ["prefill-b.bin", "prefill-c.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "prefill-a.bin",
                                                          "prefill-d.bin"]
    monkeypatch.setenv("JAX_LLAMA_PROGRAMS_MAX_MB", "0")
    assert [p.name for p in programs.evict(tmp_path)] == ["prefill-d.bin"]
    assert (tmp_path / "prefill-a.bin").exists()  # the newest stays
    monkeypatch.setenv("JAX_LLAMA_PROGRAMS_MAX_MB", "lots")
    with pytest.raises(BridgeError, match="JAX_LLAMA_PROGRAMS_MAX_MB.*number of megabytes"):
        programs.evict(tmp_path)
