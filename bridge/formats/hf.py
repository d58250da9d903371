"""Hugging Face `LlamaForCausalLM` checkpoints: config.json + safetensors (single file or shards),
and those of the families whose decoder is LLaMA's with a delta LlamaConfig holds: Mistral
without a sliding window, Qwen2 (q, k, v biases) and Qwen3 (q and k head norms).

Two things differ from the canonical layout. Names: a declarative table below. RoPE: HF rotates
half-split pairs (dims i and i + H/2) where Meta rotates interleaved pairs (2i, 2i+1), so HF
stores wq and wk with the rows of each head permuted; `to_half_split` / `from_half_split` undo
each other, per head, with n_heads for wq and n_kv_heads for wk; the q and k biases are rows
of the same heads and move with them, and a head norm's weight (H,) moves as one head's rows.
Getting this wrong gives a model that loads, runs and talks fluent nonsense, hence the tests
against transformers itself.

config.json is read as transformers 4.x wrote it (top-level rope_theta, rope_scaling,
torch_dtype: what the published LLaMA checkpoints carry) and as 5.x writes it (rope_parameters,
dtype); it is written in the 4.x form, which every transformers release loads.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..atomic import atomic_directory, copy_files
from ..config import LlamaConfig, RopeScaling
from ..errors import BridgeError
from ..tensors import layer_shapes
from .base import Checkpoint, Spec, check_specs, find_extra_files, payload_bytes
from .native import read_json
from .safetensors_dir import (DEFAULT_MAX_SHARD_SIZE, OpenFiles, read_tensor, read_tensor_infos,
                              read_tensor_slice, write_safetensors_dir)


# -- the q/k permutation ---------------------------------------------------------------------------

def to_half_split(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Canonical (interleaved) rows of wq/wk -> HF (half-split) rows; w is (n_heads * H, D), or
    (n_heads * H,) for a bias or a head norm's weight.

    Within each head, output row 2i + j (j = 0, 1) moves to j * H/2 + i."""
    rows, cols = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *cols).swapaxes(1, 2).reshape(w.shape)


def from_half_split(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF (half-split) rows of wq/wk -> canonical (interleaved) rows: the inverse of to_half_split."""
    rows, cols = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *cols).swapaxes(1, 2).reshape(w.shape)


# -- names: HF name <-> canonical name, and which heads count to (un)permute with ----------------

_GLOBAL = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {  # suffix after "model.layers.{i}." -> suffix after "layers.{i}."
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",         # qkv_bias (Qwen2)
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",  # qk_norm (Qwen3)
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
_PERMUTED = {"attention.wq.weight": lambda c: c.n_heads,
             "attention.wk.weight": lambda c: c.n_kv_heads,
             "attention.wq.bias": lambda c: c.n_heads, "attention.wk.bias": lambda c: c.n_kv_heads,
             "attention.q_norm.weight": lambda c: 1, "attention.k_norm.weight": lambda c: 1}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_DERIVABLE = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # old exports


def canonical_name(hf_name: str) -> str | None:
    """The canonical name of an HF tensor, or None when the table does not know it."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    m = _LAYER_NAME.fullmatch(hf_name)
    if m and m.group(2) in _LAYER:
        return f"layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def hf_name(name: str) -> str:
    """The HF name of a canonical tensor."""
    for hf, canonical in _GLOBAL.items():
        if canonical == name:
            return hf
    _, layer, suffix = name.split(".", 2)
    return f"model.layers.{layer}." + next(h for h, c in _LAYER.items() if c == suffix)


def _heads_to_permute(name: str, config: LlamaConfig) -> int | None:
    suffix = name.split(".", 2)[-1] if name.startswith("layers.") else None
    return _PERMUTED[suffix](config) if suffix in _PERMUTED else None


# -- config.json ------------------------------------------------------------------------------------

# Values transformers' LlamaForCausalLM supports and this project's model does not.
_UNSUPPORTED = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
                "use_sliding_window": False}
# Each family's class, and its deltas (LlamaConfig fields) as its config.json implies them.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_DELTAS = {"llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}}
# Keys that only matter with a sliding window, refused below when one is on.
_WINDOW_KEYS = {"sliding_window", "max_window_layers", "layer_types"}
_IGNORED = {  # known keys with no bearing on the weights or the forward pass
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "initializer_range",
    "use_cache", "pad_token_id", "attention_dropout", "pretraining_tp", "_name_or_path",
    "rope_theta", "rope_scaling", "rope_parameters", "head_dim", "bos_token_id", "eos_token_id",
}


def config_from_hf(d: dict, where: Path | str) -> tuple[LlamaConfig, list[str]]:
    """LlamaConfig and notes from an HF config.json dict; unsupported settings refused by name."""
    notes = []
    family = d.get("model_type", "llama")
    if not isinstance(family, str) or family not in _ARCHITECTURES:  # [] is unhashable
        raise BridgeError(f"{where}: model_type {family!r} is not supported (only "
                          f"{', '.join(map(repr, _ARCHITECTURES))})")
    for key, supported in _UNSUPPORTED.items():
        if key in d and d[key] != supported:
            raise BridgeError(f"{where}: {key}={d[key]!r} is not supported (only {supported!r})")
    # Qwen's window is off unless use_sliding_window (refused above): its size is then unused,
    # and Qwen2.5 publishes one. Mistral's window is on wherever it has a size.
    window = d.get("sliding_window") if family == "mistral" else None
    if family == "llama" and d.get("sliding_window") is not None:
        raise BridgeError(f"{where}: sliding_window={d['sliding_window']!r} is not supported on "
                          f"a llama checkpoint (model_type mistral has one)")
    sliding = [t for t in d.get("layer_types") or () if t != "full_attention"]
    if sliding:
        raise BridgeError(f"{where}: layer_types has {sliding[0]!r} layers, not supported (only "
                          f"'full_attention')")
    experts = sorted(k for k in d if "expert" in k and d[k])
    if experts:
        raise BridgeError(f"{where}: {experts[0]}={d[experts[0]]!r} is not supported (mixture of "
                          f"experts)")
    if d.get("quantization_config"):
        raise BridgeError(f"{where}: quantization_config is not supported (quantised weights)")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size"):
        if key not in d:
            raise BridgeError(f"{where}: missing required field {key!r}")

    rope = {}
    for key in ("rope_parameters", "rope_scaling"):      # transformers 5.x, 4.x
        if d.get(key) and not isinstance(d[key], dict):
            raise BridgeError(f"{where}: {key} must be an object or null (got {d[key]!r})")
        rope.update(d.get(key) or {})
    theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 1 < theta < 1e300:
        raise BridgeError(f"{where}: rope_theta must be a number > 1 (got {theta!r})")
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    scaling = None
    if rope_type == "llama3":
        try:
            scaling = RopeScaling.from_dict({k: v for k, v in rope.items() if k in
                                             ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings")})
        except BridgeError as e:
            raise BridgeError(f"{where}: {e}") from None
    elif rope_type != "default":
        raise BridgeError(f"{where}: rope type {rope_type!r} is not supported (only 'default' "
                          f"and 'llama3')")
    eos = d.get("eos_token_id")
    fields = dict(
        dim=d["hidden_size"], n_layers=d["num_hidden_layers"], n_heads=d["num_attention_heads"],
        n_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim"), ffn_dim=d["intermediate_size"], vocab_size=d["vocab_size"],
        max_seq_len=d.get("max_position_embeddings", 2048), norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta), rope_scaling=scaling,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_id=d.get("bos_token_id"), eos_ids=() if eos is None else eos, family=family,
        sliding_window=window, **_DELTAS[family])
    try:
        config = LlamaConfig(**fields)
    except BridgeError as e:
        raise BridgeError(f"{where}: {e}") from None
    known = set(_UNSUPPORTED) | _IGNORED | {"quantization_config", "hidden_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads",
                                             "intermediate_size", "vocab_size",
                                             "max_position_embeddings", "rms_norm_eps",
                                             "tie_word_embeddings"} | _WINDOW_KEYS
    unknown = sorted(set(d) - known)
    if unknown:
        notes.append(f"config.json keys not used by the model: {', '.join(unknown)}")
    return config, notes


def config_to_hf(config: LlamaConfig, dtype: str) -> dict:
    """An HF config.json dict (transformers 4.x form, which 4.x and 5.x both load)."""
    c = config
    implied = {"qkv_bias": False, "qk_norm": False, **_DELTAS[c.family]}
    if c.family != "mistral":
        implied["sliding_window"] = None
    for delta, value in implied.items():
        if getattr(c, delta) != value:
            raise BridgeError(f"LlamaConfig.{delta}={getattr(c, delta)!r}: a {c.family} checkpoint "
                              f"cannot hold it (transformers' {_ARCHITECTURES[c.family]} has "
                              f"{delta}={value!r})")
    d = {
        "architectures": [_ARCHITECTURES[c.family]], "model_type": c.family,
        "hidden_size": c.dim, "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": None if c.rope_scaling is None else {
            "rope_type": "llama3", "factor": c.rope_scaling.factor,
            "low_freq_factor": c.rope_scaling.low_freq_factor,
            "high_freq_factor": c.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": c.rope_scaling.original_max_position_embeddings},
        "tie_word_embeddings": c.tie_embeddings, "torch_dtype": dtype,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
    }
    if c.family != "llama":  # no bias on o_proj nor the MLP; Mistral's window or none
        for key in ("mlp_bias", "pretraining_tp", "attention_bias"):
            if key != "attention_bias" or c.family != "qwen3":
                del d[key]
        d["sliding_window"] = c.sliding_window
        if c.family != "mistral":
            d["use_sliding_window"] = False
    if c.bos_id is not None:
        d["bos_token_id"] = c.bos_id
    if c.eos_ids:
        d["eos_token_id"] = c.eos_ids[0] if len(c.eos_ids) == 1 else list(c.eos_ids)
    return d


# -- reading and writing -----------------------------------------------------------------------------

def is_hf(fields: dict) -> bool:
    """True when a config.json's `fields` are a Hugging Face model's."""
    return "hidden_size" in fields or "model_type" in fields


class HFCheckpoint(Checkpoint):
    """A Hugging Face directory. `fields`: its config.json's, when the caller has read them
    already (format detection does), so that the file is read once."""

    format = "hf"

    def __init__(self, path: str | os.PathLike, fields: dict | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise BridgeError(f"{self.path}: not a checkpoint directory")
        config_path = self.path / "config.json"
        self.config, self.notes = config_from_hf(
            read_json(config_path) if fields is None else fields, config_path)
        self.infos: dict = {}  # canonical name -> TensorInfo
        self._open_files = OpenFiles()
        derivable, held = [], layer_shapes(self.config)  # a delta's tensors: only with the delta
        for name, info in read_tensor_infos(self.path).items():
            canonical = canonical_name(name)
            if canonical is not None and (not canonical.startswith("layers.")
                                          or canonical.split(".", 2)[2] in held):
                self.infos[canonical] = info
            elif _DERIVABLE.fullmatch(name):
                derivable.append(name)
            else:
                raise BridgeError(f"{info.file}: unexpected tensor {name!r} (not part of a "
                                  f"{_ARCHITECTURES[self.config.family]} this project supports)")
        if derivable:
            self.notes.append(f"skipped {len(derivable)} derivable rotary_emb.inv_freq tensors")
        if self.config.tie_embeddings and "output.weight" in self.infos:
            self._drop_tied_head()
        self.specs = check_specs(self.config, {n: (i.shape, i.dtype) for n, i in self.infos.items()},
                                 self.path, source="config.json")
        self.files = sorted({info.file for info in self.infos.values()})
        self.extra_files = find_extra_files(self.path)
        self.notes += _generated_note(self.path)

    def _drop_tied_head(self) -> None:
        """tie_word_embeddings with lm_head.weight stored too: fine when it is the embedding."""
        head, embed = read_tensor(self.infos["output.weight"]), read_tensor(self.infos["tok_embeddings.weight"])
        if head.shape != embed.shape or not np.array_equal(head.view(np.uint8), embed.view(np.uint8)):
            raise BridgeError(f"{self.path}: tie_word_embeddings is true but lm_head.weight differs "
                              f"from model.embed_tokens.weight")
        del self.infos["output.weight"]
        self.notes.append("lm_head.weight equals the tied embedding; not stored twice")

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.specs:
            raise BridgeError(f"{self.path}: no tensor {name!r}")
        array = read_tensor(self.infos[name], self._open_files)
        heads = _heads_to_permute(name, self.config)
        return array if heads is None else from_half_split(array, heads)

    def tensor_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Only tensor(name)[index] is read. wq and wk rows are permuted within each head, so
        the rows of the heads the slice touches are read and un-permuted, then cut."""
        if name not in self.specs:
            raise BridgeError(f"{self.path}: no tensor {name!r}")
        info = self.infos[name]
        heads = _heads_to_permute(name, self.config)
        if heads is None:
            return read_tensor_slice(info, index)
        index = tuple(index)
        start, stop, step = (index[0] if index else slice(None)).indices(info.shape[0])
        per_head = info.shape[0] // heads
        first, last = start // per_head, max(-(-stop // per_head), start // per_head + 1)
        block = read_tensor_slice(info, (slice(first * per_head, last * per_head), *index[1:]))
        block = from_half_split(block, last - first)
        offset = first * per_head
        return np.ascontiguousarray(block[start - offset:stop - offset:step])


_FROM_FILES = object()  # write_hf's default: read the tokenizer from the files it carries


def write_hf(path: str | os.PathLike, config: LlamaConfig, specs: dict[str, Spec],
             fetch: Callable[[str], np.ndarray], *, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
             overwrite: bool = False, progress: Callable[[int], object] | None = None,
             extra_files: Iterable[Path] = (), tokenizer=_FROM_FILES) -> Path:
    """Write canonical tensors as an HF checkpoint that `LlamaForCausalLM.from_pretrained` loads,
    with a tokenizer transformers reads as the source's reads (complete_tokenizer). `tokenizer`:
    the one among `extra_files`, when the caller has read it already (source_tokenizer)."""
    ordered = check_specs(config, specs, "tensors to write")
    extra_files = list(extra_files)
    if tokenizer is _FROM_FILES:  # refused before anything is written
        tokenizer = source_tokenizer(extra_files, config)
    dtypes = {dtype.name for _, dtype in ordered.values()}
    hf_specs = {hf_name(name): spec for name, spec in ordered.items()}
    canonical = {hf_name(name): name for name in ordered}

    def hf_fetch(name: str) -> np.ndarray:
        array = fetch(canonical[name])
        heads = _heads_to_permute(canonical[name], config)
        return array if heads is None else to_half_split(array, heads)

    with atomic_directory(path, overwrite=overwrite,
                          needed_bytes=payload_bytes(ordered, extra_files)) as tmp:
        hf_config = config_to_hf(config, dtypes.pop() if len(dtypes) == 1 else "float32")
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        write_safetensors_dir(tmp, hf_specs, hf_fetch, max_shard_size=max_shard_size,
                              progress=progress)
        copy_files(extra_files, tmp)
        if tokenizer is not None:
            complete_tokenizer(tmp, tokenizer, config)
    return Path(path)


GENERATED_KEY = "llama_bridge_generated"  # in tokenizer_config.json: which files an export made


def source_tokenizer(extra_files: list[Path], config: LlamaConfig):
    """The tokenizer among the files a conversion carries (None without one), refused when its
    ids do not fit the model's vocabulary."""
    from ..tokenizer import load_tokenizer

    by_name = {Path(f).name: Path(f) for f in extra_files}
    file = by_name.get("tokenizer.json") or by_name.get("tokenizer.model")
    if file is None:
        return None
    try:
        tokenizer = load_tokenizer(file)
    except BridgeError:  # a tokenizer kind this project does not read travels as it is
        return None
    ids = {"largest id": tokenizer.vocab_size - 1, "BOS id": tokenizer.bos_id,
           "EOS id": tokenizer.eos_id, "pad id": tokenizer.pad_id}
    for what, top in ids.items():
        if top is not None and top >= config.vocab_size:
            raise BridgeError(f"{file}: the tokenizer's {what} {top} does not fit the model's "
                              f"vocab_size {config.vocab_size}")
    return tokenizer


def _generated_note(directory: Path) -> list[str]:
    """The note an export's tokenizer_config.json carries about the files llama-bridge made."""
    try:
        made = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        made = made.get(GENERATED_KEY) if isinstance(made, dict) else None
        if made:
            return [f"tokenizer files generated by llama-bridge from {made['from']}: "
                    f"{', '.join(made['files'])}"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return []


def complete_tokenizer(directory: Path, tokenizer, config: LlamaConfig) -> list[str]:
    """Add what transformers needs to read `tokenizer` as it is meant: tokenizer.json,
    tokenizer_config.json and special_tokens_map.json when there is no tokenizer.json yet (a
    tokenizer.model alone makes transformers guess, and drop BOS; a tokenizer.json there is
    what `tokenizer` was read from, and so already says what it adds), with the chat template the
    checkpoint carries (chat_template.jinja) or, for a LLaMA 3 vocabulary, LLaMA 3's; and
    generation_config.json when missing. Returns the names of the files written."""
    from ..chat import BUILTIN, TEMPLATE_FILE
    from ..hf_tokenizer import generation_config, hf_tokenizer_files

    written = []
    if not (directory / "tokenizer.json").is_file():
        template = directory / TEMPLATE_FILE
        chat = (template.read_text(encoding="utf-8") if template.is_file()
                else BUILTIN["llama3"] if tokenizer.kind == "llama3" else None)
        files = hf_tokenizer_files(tokenizer, directory, model_max_length=config.max_seq_len,
                                   chat_template=chat)
        written += [f.name for f in files]
    if not (directory / "generation_config.json").is_file():
        (directory / "generation_config.json").write_text(
            json.dumps(generation_config(tokenizer), indent=2) + "\n")
        written.append("generation_config.json")
    if "tokenizer_config.json" in written:  # say so where inspect (and anyone) can read it
        path = directory / "tokenizer_config.json"
        fields = json.loads(path.read_text(encoding="utf-8"))
        fields[GENERATED_KEY] = {"files": written, "from": f"a {tokenizer.kind} tokenizer"}
        path.write_text(json.dumps(fields, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return written
