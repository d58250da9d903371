"""llama2.c checkpoints: the `.bin` export that run.c reads (v0 and v1 headers) and the `.pt`
training checkpoint that its train.py saves.

Both use Meta's names and layout: (out, in) matrices and interleaved-pair RoPE, so tensors need no
permutation. The `.bin` export is a header followed by float32 arrays, little-endian, with all
layers of one kind stacked together; the two versions differ only in header and array order,
given below as one table per version and shared by the reader and the writer:

  v0  7 int32: dim, hidden_dim, n_layers, n_heads, n_kv_heads, +-vocab_size, max_seq_len
      (a negative vocab_size means an unshared classifier follows the RoPE tables)
  v1  uint32 magic "ak42", int32 version = 1, the same 7 int32 (vocab positive), uint8
      shared_classifier, zeros up to 256 bytes

run.c hard-codes norm_eps 1e-5 and rope_theta 10000, so a file stores neither. A single file has
no room for tokenizer files: the writer ignores `extra_files`.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from ..atomic import atomic_file
from ..config import LlamaConfig
from ..errors import BridgeError
from ..rope import rope_inv_freq
from ..tensors import canonical_shapes
from .base import Checkpoint, Spec, check_specs
from .torch_files import load_weights_only, same_bits, to_numpy

MAGIC = 0x616B3432  # "ak42" read as a little-endian uint32; as a v0 dim it would be absurd
HEADER_BYTES = {0: 28, 1: 256}
PARAMS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len")
_FIELD = {"hidden_dim": "ffn_dim"}  # header name -> LlamaConfig field, where they differ
NORM_EPS, ROPE_THETA = 1e-5, 10000.0  # what run.c and llama2.c's model.py hard-code
_L = "layers.{i}."
_ATTENTION = [(_L + f"attention.{w}.weight", True) for w in ("wq", "wk", "wv", "wo")]
_FFN = [(_L + f"feed_forward.{w}.weight", True) for w in ("w1", "w2", "w3")]
# Array order in the file: (canonical-name pattern, one array per layer?). output.weight is there
# only for an unshared classifier; freq_cis_* are v0's precomputed RoPE tables, not weights.
ORDERS = {
    0: [("tok_embeddings.weight", False), (_L + "attention_norm.weight", True), *_ATTENTION,
        (_L + "ffn_norm.weight", True), *_FFN, ("norm.weight", False),
        ("freq_cis_real", False), ("freq_cis_imag", False), ("output.weight", False)],
    1: [(_L + "attention_norm.weight", True), (_L + "ffn_norm.weight", True),
        ("norm.weight", False), ("tok_embeddings.weight", False), *_ATTENTION, *_FFN,
        ("output.weight", False)],
}
_ROPE_TABLES = {"freq_cis_real": np.cos, "freq_cis_imag": np.sin}  # (max_seq_len, H/2) each


def _entries(version: int, config: LlamaConfig) -> Iterator[tuple[str, bool, tuple[int, ...]]]:
    """(pattern, per_layer, shape) in file order, without enumerating layers (n_layers may be a
    corrupt header's 10^9); the classifier only when unshared."""
    one_layer = canonical_shapes(config.replace(n_layers=1))
    for pattern, per_layer in ORDERS[version]:
        if pattern in _ROPE_TABLES:
            shape = (config.max_seq_len, config.head_dim // 2)
        else:
            shape = one_layer.get(pattern.format(i=0))
        if shape is not None:
            yield pattern, per_layer, shape


def file_size(version: int, config: LlamaConfig) -> int:
    """Exact size in bytes of a `.bin` export of `config` (header plus float32 arrays)."""
    floats = sum(math.prod(shape) * (config.n_layers if per_layer else 1)
                 for _, per_layer, shape in _entries(version, config))
    return HEADER_BYTES[version] + 4 * floats


def layout(version: int, config: LlamaConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Array name -> (byte offset, shape) in file order, RoPE tables included."""
    table, offset = {}, HEADER_BYTES[version]
    for pattern, per_layer, shape in _entries(version, config):
        for i in range(config.n_layers if per_layer else 1):
            table[pattern.format(i=i)] = (offset, shape)
            offset += 4 * math.prod(shape)
    return table


# -- reading ---------------------------------------------------------------------------------------

class Llama2cCheckpoint(Checkpoint):
    """A llama2.c `.bin` export (float32) or `.pt` training checkpoint (its own dtype)."""

    format = "llama2c"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise BridgeError(f"{self.path}: not a file")
        self.files, self.extra_files = [self.path], []
        opener = _open_export if self.path.suffix == ".bin" else _open_training_checkpoint
        self.config, specs, self._read, self.notes, source = opener(self.path)
        self.specs = check_specs(self.config, specs, self.path, source=source)

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.specs:
            raise BridgeError(f"{self.path}: no tensor {name!r}")
        return self._read(name)


def _open_export(path: Path):
    """(config, specs, read, notes, source) for a `.bin` export, checking its size up front."""
    version, values, shared = _read_header(path)
    fields = ", ".join(f"{k}={v}" for k, v in values.items())
    for name, value in values.items():
        if value <= 0:
            raise BridgeError(f"{path}: header field {name} must be positive (got {value})")
    for name, of in (("n_heads", "dim"), ("n_kv_heads", "n_heads")):
        if values[of] % values[name]:
            raise BridgeError(f"{path}: header field {name}={values[name]} does not divide "
                              f"{of}={values[of]}")
    try:
        config = LlamaConfig(**{_FIELD.get(k, k): v for k, v in values.items()},
                             norm_eps=NORM_EPS, rope_theta=ROPE_THETA, tie_embeddings=shared)
    except BridgeError as e:
        raise BridgeError(f"{path}: header: {e}") from None
    expected, found = file_size(version, config), path.stat().st_size
    if found < expected:  # also how an absurd header shows: checked before anything is allocated
        raise BridgeError(f"{path}: truncated (expected {expected} bytes, found {found}) for a "
                          f"v{version} header with {fields}")
    if found > expected:
        raise BridgeError(f"{path}: has {found - expected} trailing bytes after the {expected} "
                          f"its v{version} header ({fields}) describes")
    table = layout(version, config)

    def read(name: str) -> np.ndarray:
        offset, shape = table[name]
        array = np.fromfile(path, dtype="<f4", count=math.prod(shape), offset=offset)
        if array.size != math.prod(shape):
            raise BridgeError(f"{path}: truncated while reading tensor {name!r}")
        return array.reshape(shape)

    specs = {n: (shape, np.dtype(np.float32)) for n, (_, shape) in table.items()
             if n not in _ROPE_TABLES}
    notes = [f"llama2.c export v{version}, float32, "
             f"{'shared' if shared else 'unshared'} classifier",
             "norm_eps 1e-5 and rope_theta 10000 are not stored in the file: run.c hard-codes them"]
    if version == 0:
        notes.append("the v0 freq_cis tables are skipped: RoPE is derived from rope_theta")
    return config, specs, read, notes, "its header"


def _read_header(path: Path) -> tuple[int, dict[str, int], bool]:
    """(version, the 7 header fields with vocab_size made positive, shared classifier)."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES[1])
    if head[:4] == b"PK\x03\x04":
        raise BridgeError(f"{path}: a zip archive (a torch checkpoint?), not a llama2.c export")
    version = 1 if len(head) >= 4 and struct.unpack_from("<I", head)[0] == MAGIC else 0
    if len(head) < HEADER_BYTES[version]:
        raise BridgeError(f"{path}: truncated (expected a {HEADER_BYTES[version]}-byte v{version} "
                          f"header, found {len(head)} bytes)")
    if version == 0:
        values = dict(zip(PARAMS, struct.unpack_from("<7i", head)))
        shared = values["vocab_size"] > 0
        values["vocab_size"] = abs(values["vocab_size"])
        return 0, values, shared
    (stored_version,) = struct.unpack_from("<i", head, 4)
    if stored_version != 1:
        raise BridgeError(f"{path}: llama2.c export version {stored_version} is not supported "
                          f"(only float32 v0 and v1; v2 is int8-quantized)")
    flag = head[36]
    if flag not in (0, 1):
        raise BridgeError(f"{path}: header field shared_classifier must be 0 or 1 (got {flag})")
    return 1, dict(zip(PARAMS, struct.unpack_from("<7i", head, 8))), bool(flag)


# llama2.c's ModelArgs defaults for the optional model_args keys (train.py saves no hidden_dim
# and no norm_eps); dropout only matters in training.
_REQUIRED_ARGS = ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len")
_OPTIONAL_ARGS = dict(n_kv_heads=None, hidden_dim=None, multiple_of=256, norm_eps=1e-5, dropout=0.0)


def _open_training_checkpoint(path: Path):
    """(config, specs, read, notes, source) for a train.py checkpoint, never running a pickle."""
    import torch  # only here: the bridge package must import without torch

    ckpt = load_weights_only(path)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model_args"), dict):
        keys = sorted(map(str, ckpt)) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise BridgeError(f"{path}: no 'model_args' dict, so not a llama2.c training checkpoint "
                          f"(found {keys})")
    if not isinstance(ckpt.get("model"), dict):
        raise BridgeError(f"{path}: no 'model' state dict")
    config = _config_from_model_args(path, ckpt["model_args"])
    notes = []
    training_state = sorted(str(k) for k in ckpt if k not in ("model", "model_args"))
    if training_state:
        notes.append(f"training state ignored: {', '.join(training_state)}")

    state = {}
    for key, value in ckpt["model"].items():
        name = str(key).removeprefix("_orig_mod.")  # torch.compile's wrapper prefix
        if not isinstance(value, torch.Tensor):
            raise BridgeError(f"{path}: state dict entry {key!r} is not a tensor")
        state[name] = value
    skipped = [n for n in ("freqs_cos", "freqs_sin") if state.pop(n, None) is not None]
    if skipped:
        notes.append(f"{' and '.join(skipped)} skipped: RoPE is derived from rope_theta")
    output, embedding = state.pop("output.weight", None), state.get("tok_embeddings.weight")
    tied = output is None or (embedding is not None and same_bits(to_numpy(output), to_numpy(embedding)))
    if not tied:
        state["output.weight"] = output
    config = config.replace(tie_embeddings=tied)
    notes.append("output.weight is tok_embeddings.weight: tied" if tied else
                 "output.weight differs from tok_embeddings.weight: untied")
    notes.append("rope_theta 10000: llama2.c hard-codes it")
    specs = {n: (tuple(t.shape), _numpy_view(path, n, t).dtype) for n, t in state.items()}

    def read(name: str) -> np.ndarray:  # a copy, so that nothing keeps pointing into the map
        return np.array(_numpy_view(path, name, state[name]), copy=True)
    return config, specs, read, notes, "model_args"


def _config_from_model_args(path: Path, args: dict) -> LlamaConfig:
    unknown = sorted(str(k) for k in args if k not in _REQUIRED_ARGS and k not in _OPTIONAL_ARGS)
    if unknown:
        raise BridgeError(f"{path}: model_args: unknown key(s) {unknown}")
    missing = [k for k in _REQUIRED_ARGS if k not in args]
    if missing:
        raise BridgeError(f"{path}: model_args: missing key {missing[0]!r}")
    a = {**_OPTIONAL_ARGS, **args}
    for key in ("dim", "multiple_of"):
        if not isinstance(a[key], int) or a[key] <= 0:
            raise BridgeError(f"{path}: model_args.{key} must be a positive integer "
                              f"(got {a[key]!r})")
    hidden = a["hidden_dim"]
    if hidden is None:  # llama2.c's FeedForward: 2/3 of 4*dim, rounded up to multiple_of
        hidden = int(2 * (4 * a["dim"]) / 3)
        hidden = a["multiple_of"] * ((hidden + a["multiple_of"] - 1) // a["multiple_of"])
    try:
        return LlamaConfig(dim=a["dim"], n_layers=a["n_layers"], n_heads=a["n_heads"],
                           n_kv_heads=a["n_heads"] if a["n_kv_heads"] is None else a["n_kv_heads"],
                           ffn_dim=hidden, vocab_size=a["vocab_size"], max_seq_len=a["max_seq_len"],
                           norm_eps=a["norm_eps"], rope_theta=ROPE_THETA)
    except BridgeError as e:
        raise BridgeError(f"{path}: model_args: {e}") from None


def _numpy_view(path: Path, name: str, t) -> np.ndarray:
    try:
        return to_numpy(t)
    except BridgeError as e:
        raise BridgeError(f"{path}: tensor {name!r}: {e}") from None


# -- writing ---------------------------------------------------------------------------------------

def write_llama2c(path: str | os.PathLike, config: LlamaConfig, specs: dict[str, Spec],
                  fetch: Callable[[str], np.ndarray], *, overwrite: bool = False,
                  progress: Callable[[int], object] | None = None,
                  extra_files: Iterable[Path] = (), version: int = 1) -> Path:
    """Write a float32 `.bin` export (v1 by default, v0 for older run.c builds) atomically.

    `specs` maps every canonical name to (shape, dtype) and `fetch(name)` returns that tensor when
    its turn comes, so one tensor is in memory at a time; each is cast to float32 (exact from
    bfloat16 / float16). Configs run.c cannot run are refused. `progress(nbytes)` is called after
    each tensor with its size as fetched. `extra_files` are ignored: a single file has no room.
    """
    config.refuse_deltas("a llama2.c export")
    check_specs(config, specs, "tensors to write")
    if version not in ORDERS:
        raise BridgeError(f"version: llama2c writes versions {sorted(ORDERS)}, got {version!r}")
    _refuse_what_run_c_cannot_run(config)
    header, table = _header(version, config), layout(version, config)
    offset, shape = next(reversed(table.values()))  # the last array's: where the file ends
    size = offset + 4 * math.prod(shape)
    with atomic_file(path, overwrite=overwrite, needed_bytes=size) as tmp, open(tmp, "wb") as f:
        f.write(header)
        for name, (_, shape) in table.items():
            if name in _ROPE_TABLES:
                _write_rope_table(f, _ROPE_TABLES[name], config)
                continue
            array = fetch(name)
            if tuple(array.shape) != shape:
                raise BridgeError(f"tensor {name!r}: got shape {tuple(array.shape)}, "
                                  f"expected {shape}")
            np.asarray(array, dtype=np.float32).astype("<f4", copy=False).tofile(f)
            if progress is not None:
                progress(array.nbytes)
            del array
    return Path(path)


def _refuse_what_run_c_cannot_run(config: LlamaConfig) -> None:
    derived = config.dim / config.n_heads  # a float, so that an inexact division never matches
    rules = [("head_dim", config.head_dim, derived, f"dim / n_heads = {derived:g}",
              "run.c derives it"),
             ("rope_scaling", config.rope_scaling, None, "None", "run.c has no rope scaling"),
             ("rope_theta", config.rope_theta, ROPE_THETA, "10000", "run.c hard-codes it"),
             ("norm_eps", config.norm_eps, NORM_EPS, "1e-05", "run.c hard-codes it")]
    for field, got, want, shown, why in rules:
        if got != want:
            raise BridgeError(f"llama2c: LlamaConfig.{field} must be {shown} ({why}), got {got!r}")


def _header(version: int, config: LlamaConfig) -> bytes:
    values = {name: getattr(config, _FIELD.get(name, name)) for name in PARAMS}
    for name, value in values.items():
        if value >= 2**31:
            raise BridgeError(f"llama2c: {name}={value} does not fit the header's int32")
    if version == 0:  # the sign of vocab_size is v0's shared-classifier flag
        values["vocab_size"] *= 1 if config.tie_embeddings else -1
        return struct.pack("<7i", *values.values())
    header = struct.pack("<Ii7iB", MAGIC, 1, *values.values(), config.tie_embeddings)
    return header.ljust(HEADER_BYTES[1], b"\0")


def _write_rope_table(f, fn, config: LlamaConfig, rows: int = 1 << 16) -> None:
    """fn(t * freq_i) for t < max_seq_len, float32 (max_seq_len, H/2), a block of rows at a time
    so that a long context never builds the whole table."""
    inv_freq = rope_inv_freq(config.head_dim, ROPE_THETA)
    for start in range(0, config.max_seq_len, rows):
        t = np.arange(start, min(start + rows, config.max_seq_len), dtype=np.float32)
        fn(np.outer(t, inv_freq)).astype("<f4").tofile(f)
