"""Every loader fed malformed input (hypothesis): each case ends in a one-line BridgeError or a
checkpoint whose every tensor reads - never another exception type, a hang, a huge allocation or
a file written. Valid tiny checkpoints of each format are built once with the project's own
writers and then truncated, bit-flipped, type-confused and pointed outside their directory.

The number of cases that ran per loader is printed by the last test (`pytest -rA` or `-s`)."""

from __future__ import annotations

import base64
import collections
import json
import os
import pickle
import signal
import struct
import tempfile
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_twins.cli import bridge_main as cli
from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint, write_checkpoint
from bridge.tensors import canonical_shapes
from bridge.tokenizer import load_tokenizer, train_tokenizer

CASES: collections.Counter = collections.Counter()  # loader -> fuzz cases run
SCALE = float(os.environ.get("FUZZ_SCALE", "1"))  # more cases: FUZZ_SCALE=10
FUZZ = settings(max_examples=int(100 * SCALE), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(FUZZ, max_examples=int(40 * SCALE))
TIME_LIMIT_S = 20            # a case slower than this is a hang
ALLOC_LIMIT = 32 * 2**20     # bytes; the tiny checkpoints hold ~20 KB of weights

# llama2.c-compatible (norm_eps 1e-5, rope_theta 10000, head_dim = dim / n_heads) and small.
CONFIG = LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24, vocab_size=40,
                     max_seq_len=16, norm_eps=1e-5, rope_theta=10000.0, bos_id=1, eos_ids=(2,))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.sampled_from([0, -1, 2**31, 2**40, 10**9, 10**30]) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5)


# -- building valid checkpoints once, as {relative path: bytes} --------------------------------------

def _specs_and_fetch(config: LlamaConfig):
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in canonical_shapes(config).items()}
    return {n: (a.shape, a.dtype) for n, a in arrays.items()}, arrays.__getitem__


def _snapshot(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _llama2c_pt(path: Path, config: LlamaConfig) -> None:
    import torch
    _, fetch = _specs_and_fetch(config)
    model = {n: torch.from_numpy(fetch(n)) for n in canonical_shapes(config)}
    args = dict(dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
                n_kv_heads=config.n_kv_heads, vocab_size=config.vocab_size, hidden_dim=config.ffn_dim,
                multiple_of=32, max_seq_len=config.max_seq_len, dropout=0.0)
    torch.save({"model": model, "model_args": args, "iter_num": 3}, path)


class _Pristine(dict):
    def __repr__(self):  # hypothesis prints the arguments of a failing case
        return "pristine"


@pytest.fixture(scope="module")
def pristine():
    """format name -> {relative path: bytes} of a valid checkpoint."""
    out = _Pristine()
    specs, fetch = _specs_and_fetch(CONFIG)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        write_checkpoint("native", d / "native", CONFIG, specs, fetch)
        write_checkpoint("native", d / "sharded", CONFIG, specs, fetch, max_shard_size=3000)
        write_checkpoint("hf", d / "hf", CONFIG, specs, fetch)
        write_checkpoint("meta", d / "meta", CONFIG, specs, fetch)
        write_checkpoint("llama2c", d / "v1.bin", CONFIG, specs, fetch, version=1)
        write_checkpoint("llama2c", d / "v0.bin", CONFIG, specs, fetch, version=0)
        _llama2c_pt(d / "ckpt.pt", CONFIG.replace(tie_embeddings=True))
        train_tokenizer(["the cat sat on the mat. " * 4, "a dog ran far away"], vocab_size=280).save(d / "tokhf")
        for name in ("native", "sharded", "hf", "meta", "v1.bin", "v0.bin", "ckpt.pt"):
            out[name] = _snapshot(d / name)
            open_checkpoint(d / name)  # each is valid before it is mutated
        out["tokhf"] = _snapshot(d / "tokhf")
    assert "model.safetensors.index.json" in out["sharded"]
    return out


# -- running one case --------------------------------------------------------------------------------

@contextmanager
def _time_limit(seconds: int):
    def fail(*_):
        raise TimeoutError(f"no answer within {seconds} s (a hang)")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@contextmanager
def _materialised(files: dict[str, bytes], single: str | None = None):
    """A fresh temporary directory holding `files`; yields the checkpoint path (the directory
    `ckpt`, or the file `single`) and the parent, where nothing else may appear."""
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        ckpt = root / "ckpt"
        ckpt.mkdir()
        for rel, data in files.items():
            (ckpt / rel).write_bytes(data)
        yield (ckpt / single if single else ckpt), root


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _expect_bridge_error_or_valid(loader: str, path: Path, root: Path, read=None) -> None:
    """Open `path` and read everything; BridgeError (one line) is the only failure allowed,
    within TIME_LIMIT_S, allocating at most ALLOC_LIMIT bytes, creating no file."""
    CASES[loader] += 1
    before = _listing(root)
    tracemalloc.start()
    try:
        with _time_limit(TIME_LIMIT_S):
            if read is not None:
                read(path)
            else:
                ckpt = open_checkpoint(path)
                for name in ckpt.specs:
                    ckpt.tensor(name)
    except BridgeError as e:
        assert "\n" not in str(e), repr(str(e))
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < ALLOC_LIMIT, f"allocated {peak} bytes"
    assert _listing(root) == before, "the loader wrote to disk"


# -- mutations ------------------------------------------------------------------------------------

@st.composite
def byte_damage(draw, data: bytes, region: int | None = None):
    """`data` truncated, bit-flipped (within the first `region` bytes, if given) or extended."""
    kind = draw(st.sampled_from(["truncate", "flip", "flip", "append"]))
    if kind == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=64))
    out = bytearray(data)
    end = min(len(data), region or len(data))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, end - 1))
        out[i] ^= 1 << draw(st.integers(0, 7))
    return bytes(out)


@st.composite
def json_damage(draw, d: dict) -> bytes:
    """A JSON object with fields replaced by anything, deleted or added; or not JSON at all."""
    kind = draw(st.sampled_from(["replace", "replace", "delete", "add", "not-json", "not-object"]))
    d = dict(d)
    if kind == "not-json":
        return draw(st.binary(max_size=40) | st.just(json.dumps(d).encode()[:-3]))
    if kind == "not-object":
        return json.dumps(draw(JSON_VALUES)).encode()
    keys = sorted(d)
    for _ in range(draw(st.integers(1, 3))):
        if kind == "add":
            d[draw(st.text(max_size=8))] = draw(JSON_VALUES)
        elif keys:
            key = draw(st.sampled_from(keys))
            if kind == "delete":
                d.pop(key, None)
            else:
                d[key] = draw(JSON_VALUES)
    return json.dumps(d).encode()  # NaN and Infinity as Python writes them


def _split_safetensors(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join_safetensors(header: dict, body: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + body


@st.composite
def safetensors_damage(draw, data: bytes) -> bytes:
    """A safetensors file with its bytes, its header length or its header entries corrupted."""
    header, body = _split_safetensors(data)
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    kind = draw(st.sampled_from(["bytes", "header-bytes", "length", "offsets", "shape", "dtype",
                                 "overlap", "body"]))
    if kind == "bytes":
        return draw(byte_damage(data))
    if kind == "header-bytes":
        return draw(byte_damage(data, region=header_end))
    if kind == "length":
        n = draw(st.integers(0, 2**64 - 1) | st.sampled_from([len(data), len(data) - 7, 2**63]))
        return struct.pack("<Q", n) + data[8:]
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    entry = header[name]
    ints = st.integers(-2**63, 2**64) | st.integers(-4, 4 * len(body) + 8)
    if kind == "offsets":
        entry["data_offsets"] = draw(st.lists(ints, min_size=0, max_size=3) | JSON_VALUES)
    elif kind == "shape":
        entry["shape"] = draw(st.lists(ints, max_size=3) | st.just([2**31, 2**31]) | JSON_VALUES)
    elif kind == "dtype":
        entry["dtype"] = draw(st.sampled_from(["F8_E4M3", "I64", "BF16", "F64", "U8", "f32", "",
                                               "BOOL", "C64"]) | JSON_VALUES)
    elif kind == "overlap":  # another tensor's bytes, or a range reaching past the end
        other = header[draw(st.sampled_from(names))]
        entry["data_offsets"] = draw(st.sampled_from(
            [other["data_offsets"], [entry["data_offsets"][0], len(body) + 8],
             [-8, entry["data_offsets"][1]]]))
    else:
        return _join_safetensors(header, body[:draw(st.integers(0, max(len(body) - 1, 0)))])
    return _join_safetensors(header, body)


# -- native / HF / sharded: config.json, safetensors, index ------------------------------------------

@FUZZ
@given(data=st.data(), fmt=st.sampled_from(["native", "hf"]))
def test_config_json(pristine, data, fmt):
    files = dict(pristine[fmt])
    files["config.json"] = data.draw(json_damage(json.loads(files["config.json"])))
    with _materialised(files) as (path, root):
        _expect_bridge_error_or_valid(f"{fmt} config.json", path, root)


@pytest.mark.parametrize("value", [10**9, 2**62, 10**30])
@pytest.mark.parametrize("field", ["n_layers", "dim", "vocab_size", "ffn_dim"])
def test_native_config_huge_numbers(pristine, field, value):
    files = dict(pristine["native"])
    files["config.json"] = json.dumps({**json.loads(files["config.json"]), field: value}).encode()
    with _materialised(files) as (path, root):
        _expect_bridge_error_or_valid("native config.json", path, root)
        with pytest.raises(BridgeError):
            open_checkpoint(path)


@pytest.mark.parametrize("value", [10**9, 2**62])
def test_hf_config_huge_layers(pristine, value):
    files = dict(pristine["hf"])
    files["config.json"] = json.dumps({**json.loads(files["config.json"]),
                                       "num_hidden_layers": value}).encode()
    with _materialised(files) as (path, root):
        _expect_bridge_error_or_valid("hf config.json", path, root)


@pytest.mark.parametrize("changes", [{"rope_theta": None}, {"rope_theta": [1]},
                                     {"rope_theta": 10**400}, {"rope_scaling": [1, 2]},
                                     {"rope_parameters": "x"}, {"\n": 1, "rope_theta": "1e4"}])
def test_hf_config_regressions(pristine, changes):
    """Found by test_config_json: a null rope_theta raised TypeError from float()."""
    files = dict(pristine["hf"])
    files["config.json"] = json.dumps({**json.loads(files["config.json"]), **changes}).encode()
    with _materialised(files) as (path, root):
        _expect_bridge_error_or_valid("hf config.json", path, root)
        with pytest.raises(BridgeError, match="rope"):
            open_checkpoint(path)


def test_names_with_newlines_stay_on_one_line(pristine):
    """Found by test_index_json / test_meta_params_json: a key "\\n" broke the one-line error."""
    files = dict(pristine["meta"])
    files["params.json"] = json.dumps({**json.loads(files["params.json"]), "a\nb": 1}).encode()
    with _materialised(files) as (path, root):
        with pytest.raises(BridgeError) as e:
            open_checkpoint(path)
        assert "\n" not in str(e.value) and "'a\\nb'" in str(e.value)


@settings(FUZZ, max_examples=int(200 * SCALE))
@given(data=st.data(), fmt=st.sampled_from(["native", "hf", "sharded"]))
def test_safetensors(pristine, data, fmt):
    files = dict(pristine[fmt])
    target = data.draw(st.sampled_from(sorted(f for f in files if f.endswith(".safetensors"))))
    files[target] = data.draw(safetensors_damage(files[target]))
    with _materialised(files) as (path, root):
        _expect_bridge_error_or_valid(f"{fmt} safetensors", path, root)


@FUZZ
@given(data=st.data())
def test_index_json(pristine, data):
    files = dict(pristine["sharded"])
    index = json.loads(files["model.safetensors.index.json"])
    weight_map = index["weight_map"]
    kind = data.draw(st.sampled_from(["value", "value", "weight_map", "raw"]))
    if kind == "raw":
        files["model.safetensors.index.json"] = data.draw(json_damage(index))
    else:
        if kind == "weight_map":
            index["weight_map"] = data.draw(JSON_VALUES)
        else:
            name = data.draw(st.sampled_from(sorted(weight_map)))
            weight_map[name] = data.draw(
                st.sampled_from(["../x.safetensors", "/etc/passwd", "/tmp/x.safetensors", "",
                                 ".", "..", "sub/model.safetensors", "missing.safetensors",
                                 "config.json", "model.safetensors.index.json"]) | JSON_VALUES)
        files["model.safetensors.index.json"] = json.dumps(index).encode()
    with _materialised(files) as (path, root):
        _expect_bridge_error_or_valid("index.json", path, root)


@pytest.mark.parametrize("fmt", ["native", "sharded", "hf"])
def test_weights_symlinked_outside_are_refused(pristine, fmt):
    files = dict(pristine[fmt])
    with _materialised(files) as (path, root):
        shard = sorted(p for p in path.iterdir() if p.suffix == ".safetensors")[0]
        outside = root / "elsewhere.safetensors"
        shard.rename(outside)
        shard.symlink_to(outside)  # a readable, valid file, but not inside the checkpoint
        _expect_bridge_error_or_valid("symlink", path, root)
        with pytest.raises(BridgeError, match="outside"):
            open_checkpoint(path)


@pytest.mark.parametrize("fmt, name", [("native", "config.json"), ("hf", "config.json"),
                                       ("meta", "params.json"), ("meta", "consolidated.00.pth")])
def test_config_and_pth_symlinked_outside_are_refused(pristine, fmt, name):
    with _materialised(dict(pristine[fmt])) as (path, root):
        outside = root / f"elsewhere-{name}"
        (path / name).rename(outside)
        (path / name).symlink_to(outside)
        with pytest.raises(BridgeError, match="outside the checkpoint directory"):
            ckpt = open_checkpoint(path)
            for tensor in ckpt.specs:
                ckpt.tensor(tensor)


def test_weights_symlinked_inside_are_read(pristine):
    with _materialised(dict(pristine["native"])) as (path, root):
        (path / "model.safetensors").rename(path / "real.safetensors")
        (path / "model.safetensors").symlink_to("real.safetensors")
        ckpt = open_checkpoint(path)
        assert all(ckpt.tensor(n).shape == s for n, (s, _) in ckpt.specs.items())


# -- Meta ------------------------------------------------------------------------------------------

@FUZZ
@given(data=st.data())
def test_meta_params_json(pristine, data):
    files = dict(pristine["meta"])
    files["params.json"] = data.draw(json_damage(json.loads(files["params.json"])))
    with _materialised(files) as (path, root):
        _expect_bridge_error_or_valid("meta params.json", path, root)


@pytest.mark.parametrize("field,value", [("n_layers", 10**9), ("n_layers", 2**62),
                                         ("dim", 10**12), ("vocab_size", 10**15)])
def test_meta_params_huge_numbers(pristine, field, value):
    files = dict(pristine["meta"])
    files["params.json"] = json.dumps({**json.loads(files["params.json"]), field: value}).encode()
    with _materialised(files) as (path, root):
        _expect_bridge_error_or_valid("meta params.json", path, root)


@FUZZ
@given(data=st.data())
def test_meta_pth(pristine, data):
    files = dict(pristine["meta"])
    files["consolidated.00.pth"] = data.draw(byte_damage(files["consolidated.00.pth"]))
    with _materialised(files) as (path, root):
        _expect_bridge_error_or_valid("meta .pth", path, root)


class _Evil:
    """Unpickling this would create the file `target`."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


def _malicious(path: Path, target: Path, wrap, legacy: bool) -> None:
    import torch
    if legacy:  # a bare pickle, as torch.save wrote before 1.6
        path.write_bytes(pickle.dumps(wrap(_Evil(str(target)))))
    else:
        torch.save(wrap(_Evil(str(target))), path)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("fmt", ["meta", "llama2c"])
def test_malicious_pickle_runs_nothing(pristine, tmp_path, fmt, legacy):
    target = tmp_path / "pwned"
    if fmt == "meta":
        files = dict(pristine["meta"])
        with _materialised(files) as (path, root):
            _malicious(path / "consolidated.00.pth", target,
                       lambda evil: {"tok_embeddings.weight": evil}, legacy)
            _expect_bridge_error_or_valid("malicious pickle", path, root)
            with pytest.raises(BridgeError, match="consolidated.00.pth"):
                open_checkpoint(path)
    else:
        with _materialised({}) as (path, root):
            pt = path / "ckpt.pt"
            _malicious(pt, target, lambda evil: {"model": {}, "model_args": evil}, legacy)
            _expect_bridge_error_or_valid("malicious pickle", pt, root)
            with pytest.raises(BridgeError, match="ckpt.pt"):
                open_checkpoint(pt)
    assert not target.exists()


# -- llama2.c ----------------------------------------------------------------------------------------

INT32 = st.integers(-2**31, 2**31 - 1)
FIELD = st.sampled_from([0, -1, 1, 2, 3, 7, 2**16, 2**31 - 1, -2**31]) | INT32


@settings(FUZZ, max_examples=int(150 * SCALE))
@given(data=st.data(), version=st.sampled_from([0, 1]))
def test_llama2c_bin(pristine, data, version):
    name = f"v{version}.bin"
    blob = pristine[name][name]
    kind = data.draw(st.sampled_from(["header", "header", "bytes"]))
    if kind == "bytes":
        blob = data.draw(byte_damage(blob, region=256))
    else:
        start = 8 if version == 1 else 0
        fields = list(struct.unpack_from("<7i", blob, start))
        for _ in range(data.draw(st.integers(1, 3))):
            fields[data.draw(st.integers(0, 6))] = data.draw(FIELD)
        blob = blob[:start] + struct.pack("<7i", *fields) + blob[start + 28:]
        if version == 1 and data.draw(st.booleans()):
            blob = blob[:36] + bytes([data.draw(st.integers(0, 255))]) + blob[37:]
    with _materialised({name: blob}, single=name) as (path, root):
        _expect_bridge_error_or_valid("llama2c .bin", path, root)


@FUZZ
@given(data=st.data())
def test_llama2c_pt(pristine, data):
    blob = data.draw(byte_damage(pristine["ckpt.pt"]["ckpt.pt"]))
    with _materialised({"ckpt.pt": blob}, single="ckpt.pt") as (path, root):
        _expect_bridge_error_or_valid("llama2c .pt", path, root)


@FEW
@given(args=st.dictionaries(st.sampled_from(["dim", "n_layers", "n_heads", "n_kv_heads",
                                             "vocab_size", "max_seq_len", "hidden_dim",
                                             "multiple_of", "norm_eps", "dropout"]),
                            JSON_VALUES, min_size=1, max_size=3))
def test_llama2c_pt_model_args(args):
    import torch
    base = dict(dim=16, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=40, max_seq_len=16,
                hidden_dim=24, multiple_of=32)
    with _materialised({}) as (path, root):
        pt = path / "ckpt.pt"
        torch.save({"model": {"norm.weight": torch.ones(16)}, "model_args": {**base, **args}}, pt)
        _expect_bridge_error_or_valid("llama2c .pt", pt, root)


# -- tokenizers ------------------------------------------------------------------------------------

def _load_tokenizer(path: Path) -> None:
    tok = load_tokenizer(path)
    tok.decode(tok.encode("hello the cat"))


@FUZZ
@given(data=st.data())
def test_tokenizer_json(pristine, data):
    files = dict(pristine["tokhf"])
    raw = files["tokenizer.json"]
    if data.draw(st.booleans()):
        files["tokenizer.json"] = data.draw(byte_damage(raw))
    else:
        files["tokenizer.json"] = data.draw(json_damage(json.loads(raw)))
    with _materialised(files) as (path, root):
        _expect_bridge_error_or_valid("tokenizer.json", path / "tokenizer.json", root,
                                      read=_load_tokenizer)


def _tiktoken_lines() -> list[bytes]:
    return [base64.b64encode(bytes([b])) + b" %d" % b for b in range(256)] + [
        base64.b64encode(b"th") + b" 256", base64.b64encode(b"the") + b" 257"]


@FUZZ
@given(data=st.data())
def test_tiktoken_ranks(data):
    lines = _tiktoken_lines()
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        token, rank = _tiktoken_lines()[i].split()
        lines[i] = data.draw(st.sampled_from([
            token + b" x", token + b" -1", token + b" 1e3", token + b" 99999999999999999999",
            b"!!!! 3", token[:-1] + b" 5", token, token + b" 1 2", b"", token + b" " + rank + b"\x00",
            token + b" 0"]) | st.binary(max_size=20))
    blob = b"\n".join(lines) + b"\n"
    with _materialised({"tokenizer.model": blob}) as (path, root):
        _expect_bridge_error_or_valid("tiktoken ranks", path / "tokenizer.model", root,
                                      read=_load_tokenizer)


@FEW
@given(blob=st.binary(min_size=1, max_size=300)
       | st.builds(lambda b: b"\n\x05<unk>" + b, st.binary(max_size=100)))
def test_sentencepiece_garbage(blob):
    with _materialised({"tokenizer.model": blob}) as (path, root):
        _expect_bridge_error_or_valid("sentencepiece", path / "tokenizer.model", root,
                                      read=_load_tokenizer)


# -- the command line ------------------------------------------------------------------------------

def _corrupt_native(files):
    files["model.safetensors"] = files["model.safetensors"][:-10]


def _corrupt_index(files):
    index = json.loads(files["model.safetensors.index.json"])
    index["weight_map"]["norm.weight"] = "../x.safetensors"
    files["model.safetensors.index.json"] = json.dumps(index).encode()


def _corrupt_meta(files):
    files["consolidated.00.pth"] = files["consolidated.00.pth"][:500]


def _corrupt_config(files):
    files["config.json"] = json.dumps({**json.loads(files["config.json"]), "n_layers": 10**9}).encode()


def _corrupt_bin(files):
    blob = files["v1.bin"]
    files["v1.bin"] = blob[:8] + struct.pack("<i", 2**31 - 1) + blob[12:]


@pytest.mark.parametrize("fmt,corrupt,single", [
    ("native", _corrupt_native, None), ("sharded", _corrupt_index, None),
    ("meta", _corrupt_meta, None), ("native", _corrupt_config, None),
    ("v1.bin", _corrupt_bin, "v1.bin")])
def test_cli_refuses_with_one_line_and_writes_nothing(pristine, capsys, fmt, corrupt, single):
    files = dict(pristine[fmt])
    corrupt(files)
    with _materialised(files, single=single) as (path, root):
        before = _listing(root)
        for argv in (["inspect", path], ["convert", path, root / "out", "--to", "hf"],
                     ["convert", path, root / "out.bin", "--to", "llama2c"]):
            code = cli.main([str(a) for a in argv])
            out, err = capsys.readouterr()
            assert code == 2, (argv, err)
            assert len(err.strip().splitlines()) == 1 and err.startswith("error:"), err
            assert _listing(root) == before, argv
        assert not (root / "out").exists() and not (root / "out.bin").exists()


def test_zz_report_cases():
    """Runs last: how many fuzz cases each loader saw."""
    total = sum(CASES.values())
    print(f"\nfuzz cases run: {total}")
    for loader, n in sorted(CASES.items()):
        print(f"  {loader}: {n}")
    if os.environ.get("FUZZ_REPORT"):
        Path(os.environ["FUZZ_REPORT"]).write_text(json.dumps(dict(CASES, total=total)) + "\n")
    assert total > 0 or not CASES
