"""llama.cpp as a reference for the parity report (`llama-bridge parity --reference llama.cpp`):
the checkpoint exported to GGUF by the bridge, then run by llama-cpp-python, an implementation
that shares nothing with either twin (C++, ggml's kernels, its own GGUF reader and RoPE).

llama-cpp-python is never a dependency: it is imported inside the functions, and a report whose
reference cannot run says why instead of failing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from bridge.errors import BridgeError

# The GGUF each report dtype exports, so that llama.cpp multiplies the weights the twins hold:
# float32 as float32, bfloat16 as BF16 (ggml converts the activations to BF16 for it).
GGUF_DTYPE = {"float32": "float32", "bfloat16": "bfloat16"}


def unavailable() -> str | None:
    """Why llama-cpp-python cannot run here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: the shared library fails to load
        return f"llama-cpp-python is not importable: {e}"
    return None


def run(path, dtype: str, prompts: Sequence[Sequence[int]], new_tokens: int
        ) -> tuple[list[np.ndarray], list[list[int]]]:
    """(logits, greedy): llama.cpp's float32 logits (len(prompt), V) of each prompt, each prompt
    evaluated alone from position 0, and its `new_tokens` greedy continuation (the argmax of its
    logits, token by token through its KV cache). The checkpoint at `path` is exported to a
    temporary GGUF in GGUF_DTYPE[dtype] with the tokenizer it carries (llama.cpp loads no model
    without one): BridgeError when it carries none."""
    from bridge.convert import convert
    from bridge.formats import open_checkpoint
    from bridge.formats.hf import source_tokenizer

    ckpt = open_checkpoint(path)
    if source_tokenizer(list(ckpt.extra_files), ckpt.config) is None:
        raise BridgeError(f"{ckpt.path}: no tokenizer beside the weights, and llama.cpp loads no "
                          f"model without one")
    import llama_cpp
    longest = max(len(p) for p in prompts) + new_tokens
    with tempfile.TemporaryDirectory(prefix="llama-bridge-parity-") as tmp:
        gguf = convert(path, Path(tmp) / "model.gguf", to="gguf", dtype=GGUF_DTYPE[dtype],
                       progress=False)
        with plain_cpu_kernels(), _quiet():
            llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max(longest, 8),
                                  n_batch=max(longest, 8), logits_all=True, verbose=False,
                                  n_threads=os.cpu_count() or 1)
        try:
            logits, greedy = [], []
            for prompt in prompts:
                llm.reset()
                llm.eval(list(prompt))
                logits.append(np.array(llm.scores[:len(prompt)], np.float32))
                row = []
                for _ in range(new_tokens):
                    row.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                    llm.eval([row[-1]])
                greedy.append(row)
        finally:
            llm.close()
    return logits, greedy


def open_model(path, n_ctx: int, **options):
    """llama_cpp.Llama on the GGUF at `path` as the benchmarks run it: on every core, quiet while
    it loads, its weights repacked for this CPU where that is safe (repacks_safely) and not where
    it is not; `options` are Llama's own (n_batch, n_ubatch, ...)."""
    import llama_cpp

    cores = len(os.sched_getaffinity(0))
    kernels = contextlib.nullcontext() if repacks_safely() else plain_cpu_kernels()
    with kernels, _quiet():
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, verbose=False,
                               n_threads=cores, n_threads_batch=cores, **options)


def last_logits(llm) -> np.ndarray:
    """The logits of the last token llm.eval evaluated (vocab,), float32. Without logits_all,
    llama-cpp-python (0.3) no longer copies them into llm.scores, which then holds whatever the
    memory held: they are read from its context, as its own sampler reads them."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()


def build_features() -> str:
    """What the installed llama.cpp was built for, as it says itself (llama_print_system_info:
    'CPU : SSE3 = 1 | ... | AVX512_BF16 = 1 | AMX_INT8 = 1 | ... | REPACK = 1 |')."""
    import llama_cpp
    return llama_cpp.llama_print_system_info().decode().strip()


def repacks_safely() -> bool:
    """Whether llama.cpp may repack its weights for this CPU (its extra buffer types): not where
    it was built with AMX, whose repacked matmul (ggml_backend_amx_mul_mat) segfaults in
    llama-cpp-python 0.3.36 on a Sapphire Rapids VM in the first decode of LLaMA 3 8B's Q4_0
    layout. Built without AMX (CMAKE_ARGS with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 in its C
    and C++ flags: docs/explanation/performance.md), it repacks Q4_0 for AVX-512 as on any other
    CPU."""
    return "AMX_INT8 = 1" not in build_features()


@contextlib.contextmanager
def plain_cpu_kernels():
    """Load without llama.cpp's extra buffer types (weight repacking): in llama-cpp-python 0.3.36
    the AMX repack segfaults on Sapphire Rapids CPUs in the first decode (repacks_safely); the
    plain CPU kernels compute the same products."""
    low = sys.modules["llama_cpp.llama_cpp"]
    defaults = low.llama_model_default_params

    def no_repacking():
        params = defaults()
        params.use_extra_bufts = False
        return params
    low.llama_model_default_params = no_repacking
    try:
        yield
    finally:
        low.llama_model_default_params = defaults


@contextlib.contextmanager
def _quiet():
    """llama.cpp's loader logs to the C stderr even with verbose=False: silenced while loading."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stderr has no descriptor
        yield
        return
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
