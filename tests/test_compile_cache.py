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
