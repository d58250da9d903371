"""Meta's release format: `params.json` + `consolidated.NN.pth`, one pickle per model-parallel rank.

Tensor names inside the .pth files are already the canonical ones, in (out, in) layout with the
interleaved RoPE layout, so nothing is permuted; the work is merging the ranks. Meta's model
parallel layers (fairscale) split each weight along one axis:

  ColumnParallelLinear   wq wk wv w1 w3 output   output features, axis 0
  RowParallelLinear      wo w2                   input features, axis 1
  replicated             the RMSNorm weights     every rank holds the same copy
  tok_embeddings         LLaMA 1/2 ParallelEmbedding splits the model dim (axis 1), LLaMA 3
                         VocabParallelEmbedding splits the vocab (axis 0); told apart by shape.

Shards are opened with torch.load(weights_only=True, mmap=True): no pickle code runs, and data is
paged in only when a tensor is read. torch is imported inside functions so that the bridge package
stays importable without it.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from ..atomic import atomic_directory, copy_files
from ..config import LlamaConfig, RopeScaling
from ..errors import BridgeError
from .base import (Checkpoint, Spec, check_inside, check_specs, find_extra_files,
                   payload_bytes)
from .native import read_json
from .torch_files import from_numpy, load_weights_only, same_bits, to_numpy

PARAMS_FILE = "params.json"
# torch dtype (by name, so that building the table needs no torch) -> numpy dtype
NUMPY_DTYPES = {f"torch.{t.__name__}": np.dtype(t)
                for t in (np.float32, np.float16, np.float64, ml_dtypes.bfloat16)}

# Canonical name suffix -> axis along which ranks are concatenated (None: replicated).
SPLIT_AXIS = {
    "attention.wq.weight": 0, "attention.wk.weight": 0, "attention.wv.weight": 0,
    "feed_forward.w1.weight": 0, "feed_forward.w3.weight": 0, "output.weight": 0,
    "attention.wo.weight": 1, "feed_forward.w2.weight": 1,
    "attention_norm.weight": None, "ffn_norm.weight": None, "norm.weight": None,
    "tok_embeddings.weight": 0,  # as written here (LLaMA 3 style); a reader decides per checkpoint
}
# params.json keys this reader understands; any other (moe_args, vision_chunk_size,
# quantization_args, lora_args, ...) describes a model we cannot represent and is refused.
PARAMS_KEYS = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
               "ffn_dim_multiplier", "norm_eps", "rope_theta", "use_scaled_rope",
               "rope_scaling_factor", "rope_high_freq_factor", "max_seq_len", "max_batch_size"}
REQUIRED_KEYS = ("dim", "n_layers", "n_heads", "multiple_of", "norm_eps")
# (multiple_of, ffn_dim_multiplier) of the releases, tried in this order: LLaMA 1/2, 3-8B, 3.2,
# 3-70B, 3.1-405B, other. The first that reproduces ffn_dim is written.
PUBLISHED_FFN_PARAMS = ((256, None), (1024, 1.3), (256, 1.5), (4096, 1.3), (4096, 1.2),
                        (4096, None))
# Meta's apply_scaling hard-codes these, so params.json cannot carry other values.
FIXED_SCALING = {"low_freq_factor": 1.0, "original_max_position_embeddings": 8192}


def meta_ffn_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None = None) -> int:
    """F as Meta's FeedForward derives it: 2/3 of 4*dim, scaled, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def ffn_params(dim: int, ffn_dim: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) for which meta_ffn_dim gives exactly `ffn_dim`."""
    for pair in PUBLISHED_FFN_PARAMS:
        if meta_ffn_dim(dim, *pair) == ffn_dim:
            return pair
    base = int(8 * dim / 3)
    # Rounding up to a multiple of ffn_dim itself lands on ffn_dim from anywhere in (0, ffn_dim],
    # which also absorbs the float error of multiplier * base falling just below ffn_dim.
    pair = (ffn_dim, None if base <= ffn_dim else ffn_dim / base)
    assert meta_ffn_dim(dim, *pair) == ffn_dim, (dim, ffn_dim, pair)
    return pair


def _suffix(name: str) -> str:
    return re.sub(r"^layers\.\d+\.", "", name)


def _load_shard(file: Path) -> dict:
    """name -> memory-mapped torch tensor from one .pth, or a one-line BridgeError naming `file`."""
    import torch
    state = load_weights_only(file)
    if not isinstance(state, dict):
        raise BridgeError(f"{file}: expected a dict of tensors, got {type(state).__name__}")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise BridgeError(f"{file}: entry {name!r} is not a tensor ({type(value).__name__})")
    return state


def _shard_files(directory: Path) -> list[Path]:
    """consolidated.00.pth, .01, ... in rank order; a gap or an odd name is an error."""
    found = sorted(directory.glob("consolidated.*.pth"))
    if not found:
        raise BridgeError(f"{directory}: no consolidated.NN.pth files")
    expected = [directory / f"consolidated.{rank:02d}.pth" for rank in range(len(found))]
    for file in expected:
        if file not in found:
            raise BridgeError(f"{file}: missing (found {', '.join(f.name for f in found)})")
        check_inside(file, directory)
    return expected


def _check_ranks_agree(files: list[Path], shards: list[dict]) -> None:
    """Meta splits evenly, so every rank holds the same names, shapes and dtypes."""
    layouts = [{n: f"{t.dtype}{tuple(t.shape)}" for n, t in s.items()} for s in shards]
    ref = layouts[0]
    for file, layout in zip(files[1:], layouts[1:]):
        differ = sorted(n for n in ref.keys() | layout.keys() if ref.get(n) != layout.get(n))
        if differ:
            name = differ[0]
            raise BridgeError(f"{file}: tensor {name!r} is {layout.get(name, 'absent')}, but "
                              f"{ref.get(name, 'absent')} in {files[0].name}")


def _positive(value, types) -> bool:
    return (isinstance(value, types) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def config_from_params(params: dict, where: Path, shapes: dict[str, tuple[int, ...]],
                       notes: list[str]) -> LlamaConfig:
    """LlamaConfig from params.json, with the merged tensor `shapes` filling in what it leaves out
    (vocab_size -1) and cross-checking what it derives (the ffn dim). Appends to `notes`."""
    unknown = sorted(set(params) - PARAMS_KEYS)
    if unknown:
        raise BridgeError(f"{where}: unsupported key {unknown[0]!r}")
    missing = [k for k in REQUIRED_KEYS if k not in params]
    if missing:
        raise BridgeError(f"{where}: missing key {missing[0]!r}")
    if "max_batch_size" in params:
        notes.append(f"params.json: max_batch_size={params['max_batch_size']!r} is a setting of "
                     f"Meta's generator, not of the model; ignored")
    # The ffn formula runs before LlamaConfig's checks, so its inputs are checked here.
    for key, types in (("dim", int), ("multiple_of", int), ("ffn_dim_multiplier", (int, float))):
        value = params.get(key)
        if not (_positive(value, types) or (value is None and key == "ffn_dim_multiplier")):
            kind = "integer" if types is int else "number or null"
            raise BridgeError(f"{where}: '{key}' must be a positive {kind} (got {value!r})")
    dim, multiple_of = params["dim"], params["multiple_of"]
    multiplier = params.get("ffn_dim_multiplier")
    ffn_dim = meta_ffn_dim(dim, multiple_of, multiplier)
    w1 = shapes.get("layers.0.feed_forward.w1.weight")
    if w1 is not None and w1[0] != ffn_dim:
        raise BridgeError(f"{where}: multiple_of={multiple_of} and ffn_dim_multiplier={multiplier} "
                          f"give ffn dim {ffn_dim}, but 'layers.0.feed_forward.w1.weight' has "
                          f"{w1[0]}")
    vocab_size = params.get("vocab_size", -1)
    if vocab_size == -1:  # LLaMA 1/2 leave it to the tokenizer; the embedding has it
        vocab_size = shapes.get("tok_embeddings.weight", (0,))[0]
        notes.append(f"params.json: vocab_size -1; taken from tok_embeddings.weight ({vocab_size})")
    scaled = params.get("use_scaled_rope", False)
    if not isinstance(scaled, bool):
        raise BridgeError(f"{where}: 'use_scaled_rope' must be true or false (got {scaled!r})")
    if scaled and "rope_scaling_factor" not in params:
        notes.append("params.json: use_scaled_rope without rope_scaling_factor; factor 8.0 assumed "
                     "(Meta's reference default; Hugging Face's LLaMA 3.2 configs say 32)")
    if not scaled and {"rope_scaling_factor", "rope_high_freq_factor"} & set(params):
        notes.append("params.json: rope scaling factors ignored because use_scaled_rope is false")
    max_seq_len = params.get("max_seq_len")
    if max_seq_len is None:  # the release's context length: LLaMA 2 (32K vocab), 3.1+, 3
        max_seq_len = 4096 if vocab_size == 32000 else 131072 if scaled else 8192
        notes.append(f"params.json: no max_seq_len; {max_seq_len} assumed")
    try:
        scaling = RopeScaling(factor=params.get("rope_scaling_factor", 8.0), low_freq_factor=1.0,
                              high_freq_factor=params.get("rope_high_freq_factor", 4.0),
                              original_max_position_embeddings=8192) if scaled else None
        return LlamaConfig(dim=dim, n_layers=params["n_layers"], n_heads=params["n_heads"],
                           n_kv_heads=params.get("n_kv_heads", params["n_heads"]), ffn_dim=ffn_dim,
                           vocab_size=vocab_size, max_seq_len=max_seq_len,
                           norm_eps=params["norm_eps"], rope_scaling=scaling,
                           rope_theta=params.get("rope_theta", 10000.0))
    except BridgeError as e:
        raise BridgeError(f"{where}: {e}") from None


class MetaCheckpoint(Checkpoint):
    """A Meta release directory, its ranks merged into canonical full-size tensors."""

    format = "meta"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise BridgeError(f"{self.path}: not a checkpoint directory")
        params = read_json(self.path / PARAMS_FILE)
        self.files = _shard_files(self.path)
        self.shards = [_load_shard(f) for f in self.files]
        self.notes = []
        if [shard.pop("rope.freqs") for shard in self.shards if "rope.freqs" in shard]:
            self.notes.append("rope.freqs skipped (a buffer derived from rope_theta)")
        _check_ranks_agree(self.files, self.shards)
        first = self.shards[0]

        # Everything below needs shapes only: shard shape * rank count along the split axis.
        self.axes, shapes, dtypes = {}, {}, {}
        for name, t in first.items():
            axis = SPLIT_AXIS.get(_suffix(name))
            if name == "tok_embeddings.weight":
                axis = 0 if t.ndim == 2 and t.shape[1] == params.get("dim") else 1
            if axis is not None and axis >= t.ndim:
                raise BridgeError(f"{self.files[0]}: tensor {name!r} has shape {tuple(t.shape)}, "
                                  f"expected 2 dimensions")
            if str(t.dtype) not in NUMPY_DTYPES:
                raise BridgeError(f"{self.files[0]}: tensor {name!r} has dtype {t.dtype}, expected "
                                  f"a floating type")
            shape = list(t.shape)
            if axis is not None:
                shape[axis] *= len(self.shards)
            self.axes[name], shapes[name] = axis, tuple(shape)
            dtypes[name] = NUMPY_DTYPES[str(t.dtype)]
        config = config_from_params(params, self.path / PARAMS_FILE, shapes, self.notes)

        if self._output_is_embedding(shapes, dtypes):
            config = config.replace(tie_embeddings=True)
            self.notes.append("output.weight equals tok_embeddings.weight bit for bit: read as "
                              "tied embeddings")
            del shapes["output.weight"]
        self.config = config
        self.specs = check_specs(config, {n: (shapes[n], dtypes[n]) for n in shapes}, self.path,
                                 source="params.json")
        for name in (n for n in self.specs if self.axes[n] is None):
            for file, shard in zip(self.files[1:], self.shards[1:]):
                if not same_bits(to_numpy(first[name]), to_numpy(shard[name])):
                    raise BridgeError(f"{file}: replicated tensor {name!r} differs from "
                                      f"{self.files[0].name}")
        self.extra_files = find_extra_files(self.path)

    def _merged(self, name: str, rows: int | None = None) -> np.ndarray:
        """The full tensor as a fresh array, or only its first `rows` rows (fewer pages read)."""
        import torch
        axis, parts = self.axes[name], [shard[name] for shard in self.shards]
        if axis is None or (rows is not None and axis == 0):
            parts = parts[:1]
        if rows is not None:
            parts = [p[:rows] for p in parts]
        return to_numpy(torch.cat(parts, dim=axis or 0))  # cat copies even a single part

    def _output_is_embedding(self, shapes, dtypes) -> bool:
        pair = ("tok_embeddings.weight", "output.weight")
        if not all(n in shapes for n in pair) or len({(shapes[n], dtypes[n]) for n in pair}) != 1:
            return False
        # First rows differ in any untied model: skip reading both full matrices then.
        return (same_bits(*(self._merged(n, rows=1) for n in pair))
                and same_bits(*(self._merged(n) for n in pair)))

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.specs:
            raise BridgeError(f"{self.path}: no tensor {name!r}")
        return self._merged(name)


def params_json(config: LlamaConfig) -> dict:
    """The params.json fields for `config`; BridgeError for what params.json cannot express."""
    if config.head_dim != config.dim // config.n_heads:
        raise BridgeError(f"head_dim: params.json cannot express head_dim={config.head_dim} "
                          f"(Meta derives dim // n_heads = {config.dim // config.n_heads})")
    multiple_of, multiplier = ffn_params(config.dim, config.ffn_dim)
    params = dict(dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
                  n_kv_heads=config.n_kv_heads, vocab_size=config.vocab_size,
                  multiple_of=multiple_of, ffn_dim_multiplier=multiplier, norm_eps=config.norm_eps,
                  rope_theta=config.rope_theta, max_seq_len=config.max_seq_len)
    if config.rope_scaling is not None:
        for field, fixed in FIXED_SCALING.items():
            value = getattr(config.rope_scaling, field)
            if value != fixed:
                raise BridgeError(f"rope_scaling.{field}: params.json cannot express {value} "
                                  f"(Meta's code fixes it at {fixed})")
        params.update(use_scaled_rope=True, rope_scaling_factor=config.rope_scaling.factor,
                      rope_high_freq_factor=config.rope_scaling.high_freq_factor)
    return params


def write_meta(path: str | os.PathLike, config: LlamaConfig, specs: dict[str, Spec],
               fetch: Callable[[str], np.ndarray], *, overwrite: bool = False,
               progress: Callable[[int], object] | None = None, extra_files: Iterable[Path] = (),
               shards: int = 1) -> Path:
    """Write a Meta checkpoint atomically: params.json + consolidated.00.pth .. (shards - 1).

    `specs` maps every canonical name to (shape, numpy dtype); `fetch(name)` returns that tensor.
    Each tensor is split into `shards` equal parts along its SPLIT_AXIS (tok_embeddings by vocab,
    as LLaMA 3 does). A tied config gets an output.weight copied from tok_embeddings, since Meta's
    loaders always expect one. Memory: torch.save pickles a whole dict, so every rank's tensors
    (the whole model, in its own dtype) are held until the files are written; Meta's format is one
    pickle per rank and cannot be streamed. `progress(nbytes)` is called after each fetch.
    """
    import torch
    config.refuse_deltas("a Meta checkpoint")
    ordered = check_specs(config, specs, "tensors to write")
    params = params_json(config)
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise BridgeError(f"shards: must be a positive integer (got {shards!r})")
    for name, (shape, _) in ordered.items():
        axis = SPLIT_AXIS[_suffix(name)]
        if axis is not None and shape[axis] % shards:
            raise BridgeError(f"tensor {name!r}: size {shape[axis]} along axis {axis} does not "
                              f"split into {shards} equal shards")
    ranks: list[dict] = [{} for _ in range(shards)]
    extra_files = list(extra_files)
    tied = {"output.weight": ordered["tok_embeddings.weight"]} if config.tie_embeddings else {}
    with atomic_directory(path, overwrite=overwrite,
                          needed_bytes=payload_bytes({**ordered, **tied}, extra_files)) as tmp:
        (tmp / PARAMS_FILE).write_text(json.dumps(params, indent=2) + "\n")
        for name, (shape, dtype) in ordered.items():
            array = fetch(name)
            if tuple(array.shape) != shape or array.dtype != dtype:
                raise BridgeError(f"tensor {name!r}: got {array.dtype}{tuple(array.shape)}, "
                                  f"expected {dtype}{shape}")
            tensor = from_numpy(array)  # bfloat16 crosses bit for bit, never via float32
            axis = SPLIT_AXIS[_suffix(name)]
            parts = [tensor] * shards if axis is None else torch.chunk(tensor, shards, dim=axis)
            for rank, part in zip(ranks, parts):
                rank[name] = part.clone()  # own storage: torch.save would write a view's whole base
            if progress is not None:
                progress(array.nbytes)
            del array, tensor, parts
        if config.tie_embeddings:
            for rank in ranks:
                rank["output.weight"] = rank["tok_embeddings.weight"].clone()
        for r, rank in enumerate(ranks):
            torch.save(rank, tmp / f"consolidated.{r:02d}.pth")
            rank.clear()
        copy_files(extra_files, tmp)
    return Path(path)
