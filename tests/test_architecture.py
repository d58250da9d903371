"""The architecture as a contract: imports only point down (bridge <- the twins <- llama_twins,
and inside bridge from layer to layer), the twins never import each other, nothing imports in a
circle, and the twins export the same names wherever a concept exists in both.

The layering contracts live in pyproject.toml ([tool.importlinter]); `lint-imports` checks them
from the code's own import statements (function-level imports included), and the planted
back-arrow below shows that a violation fails, naming the import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import jax_llama
import torch_llama

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bridge", "tasks", "jax_llama", "torch_llama", "llama_twins")
LINT_IMPORTS = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports with the contracts of root/pyproject.toml, on the packages under root."""
    env = dict(os.environ, PYTHONPATH=str(root))  # the packages under root, before any install
    return subprocess.run([LINT_IMPORTS, str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 5 kept, 0 broken." in result.stdout


def test_a_planted_back_arrow_fails_and_names_the_import(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    config = tmp_path / "bridge" / "config.py"
    config.write_text(config.read_text() + "\n\ndef _planted():\n    import llama_twins.parity\n")
    twin = tmp_path / "torch_llama" / "generate.py"
    twin.write_text(twin.read_text()
                    + "\nfrom jax_llama.inference.generate import sample  # noqa\n")
    # inside bridge: the tokenizer kinds reaching up into the GGUF wing that builds on them
    kinds = tmp_path / "bridge" / "tokenizer" / "kinds.py"
    kinds.write_text(kinds.read_text()
                     + "\n\ndef _planted():\n    from ..gguf.container import is_gguf\n")
    # inside tasks: the chats reaching up into the preference pairs that build on them
    chats = tmp_path / "tasks" / "chats.py"
    chats.write_text(chats.read_text() + "\n\ndef _planted():\n    from .preference import read_pairs\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Contracts: 0 kept, 5 broken." in result.stdout, result.stdout
    assert "tasks.chats -> tasks.preference" in result.stdout
    assert "bridge.config -> llama_twins.parity" in result.stdout
    assert "torch_llama.generate -> jax_llama.inference.generate" in result.stdout
    assert "bridge.tokenizer.kinds -> bridge.gguf.container" in result.stdout


def test_no_module_imports_itself_through_a_circle():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph(*PACKAGES)
    imports = {m: graph.find_modules_directly_imported_by(m) & graph.modules for m in graph.modules}
    # A package's __init__ importing its own submodules is how it re-exports; a cycle is a
    # circle between two modules that are not package and child.
    cycles, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for other in sorted(imports[module]):
            if other.startswith(module + ".") or module.startswith(other + "."):
                continue
            if state.get(other) == "open":
                cycles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = "done"

    for module in sorted(graph.modules):
        if module not in state:
            visit(module, [module])
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


# What only one twin has, and why; everything else each exports, the other exports too.
JAX_ONLY = {
    "TrainConfig",       # the JAX training recipe's hyperparameters (training runs in JAX)
    "make_optimizer",    # optax.chain(clip, adamw): torch spells it AdamW + clip_by_global_norm
    "make_train_step",   # the jitted, pure train step; torch trains with an imperative loop
}
TORCH_ONLY = {
    "AdamW", "clip_by_global_norm", "cosine_decay_schedule", "linear_schedule",
    "warmup_cosine_decay_schedule",  # optax's pieces, re-implemented bit for bit in torch
    "resolve_device",                # JAX places arrays itself; torch picks CUDA / MPS / CPU
}


def test_the_twins_export_the_same_names():
    jax_names, torch_names = set(jax_llama.__all__), set(torch_llama.__all__)
    assert jax_names - torch_names == JAX_ONLY
    assert torch_names - jax_names == TORCH_ONLY
    for module in (jax_llama, torch_llama):
        assert all(hasattr(module, name) for name in module.__all__), module.__name__
    # The shared helpers have one signature: the same parameter names in the same order.
    import inspect
    for name in ("apply_rope", "rope_cos_sin", "check_inputs", "last_real_index"):
        jax_params = list(inspect.signature(getattr(jax_llama, name)).parameters)
        torch_params = list(inspect.signature(getattr(torch_llama, name)).parameters)
        assert jax_params == torch_params, name
    for name in ("create", "reserve"):
        jax_params = list(inspect.signature(getattr(jax_llama.KVCache, name)).parameters)
        torch_params = list(inspect.signature(getattr(torch_llama.KVCache, name)).parameters)
        assert [p for p in torch_params if p != "device"] == jax_params, name  # torch adds `device`
    assert ([f.name for f in jax_llama.LlamaOutput.__dataclass_fields__.values()]
            == [f.name for f in torch_llama.LlamaOutput.__dataclass_fields__.values()])
