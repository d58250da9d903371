"""No code runs from a file: the package never calls an unpickler or evaluator that could, and a
checkpoint whose pickle would run code is refused with a one-line BridgeError before it does."""

from __future__ import annotations

import ast
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import jax_llama
import torch_llama
from bridge.errors import BridgeError
from bridge.formats.meta import params_json
from conftest import small_config

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bridge", "jax_llama", "torch_llama", "llama_twins")


# -- a static check of the sources -----------------------------------------------------------------

UNPICKLERS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads",
              "dill.load", "dill.loads", "marshal.load", "marshal.loads", "shelve.open"}
EVALUATORS = {"eval", "exec", "builtins.eval", "builtins.exec"}
SHELLS = {"os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput"}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> what it was imported as: `import pickle as pk` gives pk -> pickle, `from
    torch import load` gives load -> torch.load, so that an alias cannot hide a call."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update({a.asname or a.name: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str:
    """'pickle.load' for the call target `pickle.load` (imports resolved), 'eval' for `eval`;
    '' for anything else (a subscript, a call result), which names none of the functions."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _argument(call: ast.Call, name: str, position: int | None = None) -> ast.AST | None:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return call.args[position] if position is not None and len(call.args) > position else None


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _why_unsafe(name: str, call: ast.Call, aliases: dict[str, str]) -> str | None:
    if name in UNPICKLERS:
        return "unpickles"
    if name in EVALUATORS:
        return "evaluates code"
    if name == "torch.load" and not _is_true(_argument(call, "weights_only")):
        return "torch.load without weights_only=True"
    if name in ("numpy.load", "np.load") and _is_true(_argument(call, "allow_pickle", 2)):
        return "numpy.load with allow_pickle=True"
    if name in ("yaml.load", "yaml.load_all"):
        loader = _argument(call, "Loader", 1)
        if loader is None or "Safe" not in _dotted(loader, aliases):
            return "yaml.load without SafeLoader"
    if name in ("yaml.unsafe_load", "yaml.full_load"):
        return "unsafe yaml loader"
    if name in SHELLS or _is_true(_argument(call, "shell")):
        return "runs a shell"
    return None


def unsafe_calls(source: str, filename: str = "<snippet>") -> list[str]:
    """'file:line: name(...) why' for each call that can run code from data: the pickle
    loaders, the builtins eval / exec, torch.load without weights_only=True, numpy.load with
    allow_pickle=True, yaml.load without a safe loader, and a shell (shell=True, os.system).
    Only calls count, found with `ast`: docstrings, comments and methods like `model.eval()` do
    not, and neither formatting nor an import alias hides one."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func, aliases)
            why = _why_unsafe(name, node, aliases)
            if why:
                found.append((node.lineno, f"{filename}:{node.lineno}: {name}(...) {why}"))
    return [hit for _, hit in sorted(found)]


# The one unpickling the packages do, and why: generation's compiled programs, kept by this
# user in a private folder beside jax's own compilation cache (compiled code either way), read
# only when no one else owns or may write them (tests/test_compile_cache.py), never a checkpoint
# or other input.
ALLOWED = {"jax_llama/inference/programs.py": "pickle.load(...) unpickles"}


def test_the_packages_never_call_code_that_runs_data():
    files = sorted(f for package in PACKAGES for f in (ROOT / package).rglob("*.py"))
    assert len(files) > 30  # the packages were found
    found = [hit for f in files for hit in unsafe_calls(f.read_text(), str(f.relative_to(ROOT)))]
    allowed = [hit for hit in found if ALLOWED.get(hit.split(":")[0], "~") in hit]
    assert [hit for hit in found if hit not in allowed] == []
    assert len(allowed) == len(ALLOWED)  # each allowance still used, once


BAD = '''
import pickle, subprocess, torch, yaml
import numpy as np
pickle.loads(blob)
eval(text)
torch.load(path)
torch.load(path, weights_only=False)
yaml.load(stream)
subprocess.run(command, shell=True)
np.load(path, allow_pickle=True)
from pickle import loads as undo
undo(blob)
'''
GOOD = '''
"""pickle.load(f), eval(x) and torch.load(p) in a docstring are not calls."""
import subprocess, torch, yaml
# eval(this) is a comment
model.eval()
torch.load(path, map_location="cpu", weights_only=True)
yaml.load(stream, Loader=yaml.SafeLoader)
yaml.safe_load(stream)
subprocess.run(["ls", "-l"], check=True)
np.load(path)
'''


def test_the_detector_finds_each_kind_of_unsafe_call_and_nothing_else():
    found = unsafe_calls(BAD)
    assert [hit.split(": ", 1)[1] for hit in found] == [
        "pickle.loads(...) unpickles", "eval(...) evaluates code",
        "torch.load(...) torch.load without weights_only=True",
        "torch.load(...) torch.load without weights_only=True",
        "yaml.load(...) yaml.load without SafeLoader", "subprocess.run(...) runs a shell",
        "numpy.load(...) numpy.load with allow_pickle=True", "pickle.loads(...) unpickles"]
    assert [int(hit.split(":")[1]) for hit in found] == [4, 5, 6, 7, 8, 9, 10, 12]
    assert unsafe_calls(GOOD) == []


# -- checkpoints whose pickle would run code -------------------------------------------------------

class _System:
    """Unpickles as os.system(command): what a hostile checkpoint does."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _Open:
    """Unpickles as open(path, 'w'): creates the file without any shell."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _payload(kind: str, marker: Path):
    return _System(f"touch {marker}") if kind == "system" else _Open(str(marker))


def _write(kind: str, obj, file: Path) -> None:
    """torch.save's zip archive, or a bare pickle (the pre-1.6 layout, still loadable by
    torch.load(weights_only=False))."""
    if kind == "bare":
        with open(file, "wb") as f:
            pickle.dump(obj, f)
    else:
        torch.save(obj, file)


@pytest.fixture(scope="module")
def real_tensors():
    """A genuine state dict, so that only the payload makes the file hostile."""
    config = small_config(ffn_dim=128)  # the FFN size llama2.c's model_args imply for dim 48
    return config, {k: v.clone() for k, v in torch_llama.Llama(config).state_dict().items()}


def _meta_dir(tmp_path: Path, config, state: dict, payload, layout: str) -> Path:
    directory = tmp_path / "meta"
    directory.mkdir()
    (directory / "params.json").write_text(json.dumps(params_json(config)))
    _write(layout, {**state, "rope.freqs": payload}, directory / "consolidated.00.pth")
    return directory


def _llama2c_pt(tmp_path: Path, config, state: dict, payload, layout: str) -> Path:
    file = tmp_path / "ckpt.pt"
    args = dict(dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
                n_kv_heads=config.n_kv_heads, vocab_size=config.vocab_size,
                multiple_of=32, max_seq_len=config.max_seq_len)
    _write(layout, {"model": state, "model_args": args, "iter_num": payload}, file)
    return file


LOADERS = {"jax": lambda path: jax_llama.load(path), "torch": lambda path: torch_llama.load(path, device="cpu")}


@pytest.mark.parametrize("make", [_meta_dir, _llama2c_pt], ids=["meta", "llama2c"])
@pytest.mark.parametrize("kind", ["system", "open"])
@pytest.mark.parametrize("layout", ["zip", "bare"])
@pytest.mark.parametrize("loader", LOADERS)
def test_a_checkpoint_whose_pickle_runs_code_is_refused_before_it_runs(
        tmp_path, real_tensors, make, kind, layout, loader):
    config, state = real_tensors
    marker = tmp_path / "pwned"
    path = make(tmp_path, config, state, _payload(kind, marker), layout)
    with pytest.raises(BridgeError, match=r"not a plain tensor checkpoint") as e:
        LOADERS[loader](path)
    assert not marker.exists()
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert "weights_only=False" not in str(e.value)  # never advise running the pickle


@pytest.mark.parametrize("make", [_meta_dir, _llama2c_pt], ids=["meta", "llama2c"])
def test_the_same_file_with_a_tensor_in_place_of_the_payload_loads(tmp_path, real_tensors, make):
    """The refusal above is the payload's doing, not a flaw elsewhere in the file."""
    config, state = real_tensors
    model = torch_llama.load(make(tmp_path, config, state, torch.zeros(4), "zip"), device="cpu")
    assert torch.equal(model.state_dict()["norm.weight"], state["norm.weight"])


def test_the_payload_does_run_when_unpickled_unsafely(tmp_path, real_tensors):
    """The negative case: the files above are really hostile, so their refusal means something."""
    config, state = real_tensors
    for kind in ("system", "open"):
        marker = tmp_path / f"pwned-{kind}"
        (tmp_path / kind).mkdir()
        path = _meta_dir(tmp_path / kind, config, state, _payload(kind, marker), "zip")
        torch.load(path / "consolidated.00.pth", weights_only=False)  # the unsafe call, on purpose
        assert marker.exists()
