"""LoRA adapters, framework-neutral: the settings, the canonical adapter tensors, merging, and
Hugging Face PEFT's on-disk format both ways.

A LoRA adapter on a projection W (out, in) adds scale * B @ A, with A (rank, in), B (out, rank) and
scale = alpha / rank (Hu et al. 2021, as PEFT computes it). A starts Kaiming-uniform as PEFT
initialises it, B at zero, so a fresh adapter changes nothing.

Canonical adapter names extend the canonical weight names, in the torch layout:
`layers.{i}.attention.wq.lora_A.weight` (rank, in) and `layers.{i}.attention.wq.lora_B.weight`
(out, rank); the torch twin's state_dict() holds exactly these, the JAX model the same tensors
transposed under `wq/lora_A/kernel` and `wq/lora_B/kernel`.

PEFT writes `adapter_config.json` and `adapter_model.safetensors` with names such as
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. Hugging Face stores wq and wk
with the rows of each head permuted (bridge.formats.hf); the update B @ A must be permuted the same
way, which is a permutation of B's rows (A is unchanged).

With `train_embeddings` the embedding table trains whole beside the adapters (PEFT's
`modules_to_save=["embed_tokens"]`): the adapter then carries `tok_embeddings.weight`, which
replaces the base's on merging, stored by PEFT as `base_model.model.model.embed_tokens.weight`. A
model whose LM head is the embedding (tie_embeddings) trains the head with it; its adapter also
carries the table as `base_model.model.lm_head.weight` with `ensure_weight_tying`, so that PEFT
keeps the two tied as we do.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .atomic import atomic_directory
from .config import LlamaConfig
from .errors import BridgeError
from .formats.hf import from_half_split, hf_name, to_half_split

TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
MODULES = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention",
           "w1": "feed_forward", "w2": "feed_forward", "w3": "feed_forward"}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
EMBEDDING = "tok_embeddings.weight"  # the canonical name of the table train_embeddings trains
# What both twins' add_lora say when train_embeddings meets an int8 table (bridge.quantize).
INT8_TABLE = ("the embedding table is int8 (the tied LM head of a quantised model), which "
              "cannot train: add the adapters to the float model")
_ADAPTER_NAME = re.compile(r"layers\.(\d+)\.(attention|feed_forward)\.(w[qkvo123])\.lora_([AB])\.weight")


@dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (scale = alpha / r), dropout on the adapter's input while training, the
    projections that carry an adapter (any of wq, wk, wv, wo, w1, w2, w3; default all seven), and
    whether the embedding table trains too (whole, in float32; PEFT's modules_to_save)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    train_embeddings: bool = False

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise BridgeError(f"must be a positive integer (got {self.rank!r})", field="lora_rank")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise BridgeError(f"must be positive (got {self.alpha!r})", field="lora_alpha")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise BridgeError(f"must be in [0, 1) (got {self.dropout!r})", field="lora_dropout")
        targets = (self.targets.split(",") if isinstance(self.targets, str) else list(self.targets))
        targets = [t.strip() for t in targets if t.strip()]
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets:
            raise BridgeError(f"unknown target {unknown[0]!r}; known: {', '.join(TARGETS)}"
                              if unknown else "no target given", field="lora_targets")
        if not isinstance(self.train_embeddings, bool):
            raise BridgeError(f"must be true or false (got {self.train_embeddings!r})",
                              field="lora_train_embeddings")
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: dict) -> "LoraConfig":
        return cls(**{**d, "targets": tuple(d["targets"])})


def projection_shape(config: LlamaConfig, target: str) -> tuple[int, int]:
    """(out, in) of the projection `target` in `config`."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return {"wq": (q, config.dim), "wk": (kv, config.dim), "wv": (kv, config.dim),
            "wo": (config.dim, q), "w1": (config.ffn_dim, config.dim),
            "w2": (config.dim, config.ffn_dim), "w3": (config.ffn_dim, config.dim)}[target]


def adapter_name(layer: int, target: str, which: str) -> str:
    """The canonical name of A ('A') or B ('B') of `target` in `layer`."""
    return f"layers.{layer}.{MODULES[target]}.{target}.lora_{which}.weight"


def adapter_shapes(config: LlamaConfig, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """Every adapter tensor of `lora` on `config`, canonical name -> shape: the embedding table
    first when it trains, then A and B in layer order."""
    shapes = {EMBEDDING: (config.vocab_size, config.dim)} if lora.train_embeddings else {}
    for i in range(config.n_layers):
        for t in lora.targets:
            out, inp = projection_shape(config, t)
            shapes[adapter_name(i, t, "A")] = (lora.rank, inp)
            shapes[adapter_name(i, t, "B")] = (out, lora.rank)
    return shapes


def count_adapter_params(config: LlamaConfig, lora: LoraConfig) -> int:
    return sum(math.prod(s) for s in adapter_shapes(config, lora).values())


def base_name(name: str) -> str:
    """layers.0.attention.wq.lora_A.weight -> layers.0.attention.wq.weight"""
    return re.sub(r"\.lora_[AB]\.weight$", ".weight", name)


def merge_weight(weight: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """W + scale * B @ A, computed in float32 (float64 for float64 weights), in W's dtype."""
    wide = np.float64 if weight.dtype == np.float64 else np.float32
    merged = weight.astype(wide) + np.float32(scale) * (b.astype(wide) @ a.astype(wide))
    return merged.astype(weight.dtype)


class Adapter:
    """A LoRA adapter in memory: its settings and its canonical tensors (numpy)."""

    def __init__(self, lora: LoraConfig, tensors: dict[str, np.ndarray],
                 base_model: str | None = None):
        self.lora, self.tensors, self.base_model = lora, tensors, base_model

    def check(self, config: LlamaConfig, where: str | os.PathLike = "adapter") -> None:
        """Refuse, naming the tensor, an adapter whose shapes do not fit `config`."""
        expected = adapter_shapes(config, self.lora)
        for name, array in self.tensors.items():
            m = _ADAPTER_NAME.fullmatch(name)
            if m and int(m.group(1)) >= config.n_layers:
                raise BridgeError(f"{where}: tensor '{name}' is for layer {m.group(1)}; the base "
                                  f"model has {config.n_layers} layers")
            if name not in expected:
                raise BridgeError(f"{where}: tensor '{name}' is not an adapter of "
                                  f"{', '.join(self.lora.targets)} in this model")
            if tuple(array.shape) != expected[name]:
                raise BridgeError(f"{where}: tensor '{name}' has shape {tuple(array.shape)}; the "
                                  f"base model and rank {self.lora.rank} imply {expected[name]}")
        missing = [n for n in expected if n not in self.tensors]
        if missing:
            raise BridgeError(f"{where}: tensor '{missing[0]}' is missing ({len(missing)} of "
                              f"{len(expected)} adapter tensors)")

    def merged(self, name: str, weight: np.ndarray) -> np.ndarray:
        """`weight` (canonical `name`) with this adapter's update added, when it has one; the
        adapter's embedding table, in `weight`'s dtype, when it trains one."""
        if name == EMBEDDING and name in self.tensors:
            return self.tensors[name].astype(weight.dtype)
        a = self.tensors.get(name.replace(".weight", ".lora_A.weight"))
        if a is None or not name.startswith("layers."):
            return weight
        b = self.tensors[name.replace(".weight", ".lora_B.weight")]
        return merge_weight(weight, a, b, self.lora.scale)


# -- Hugging Face PEFT format ---------------------------------------------------------------------

def _hf_module(target: str) -> str:
    """wq -> self_attn.q_proj (the HF module path in a layer, from the HF tensor-name table)."""
    return hf_name(f"layers.0.{MODULES[target]}.{target}.weight").split(".", 3)[3][:-len(".weight")]


def _peft_module(target: str) -> str:
    """wq -> q_proj: the name PEFT's target_modules lists."""
    return _hf_module(target).split(".")[-1]


def _target_of(module) -> str | None:
    """The projection a name in PEFT's target_modules adapts (q_proj -> wq), or None. PEFT also
    writes the modules' full names there ("all-linear" resolved: model.layers.0.self_attn.q_proj,
    one per layer); each of those names its projection by its end."""
    if not isinstance(module, str):
        return None
    for target in TARGETS:
        path = _hf_module(target)  # self_attn.q_proj
        if module in (_peft_module(target), path) or module.endswith(f".{path}"):
            return target
    return None


def _heads(config: LlamaConfig, target: str) -> int | None:
    return {"wq": config.n_heads, "wk": config.n_kv_heads}.get(target)


def write_peft(path: str | os.PathLike, config: LlamaConfig, adapter: Adapter, *,
               overwrite: bool = False) -> Path:
    """Write `adapter` as PEFT writes a LoRA adapter of LlamaForCausalLM, atomically."""
    from safetensors.numpy import save_file

    adapter.check(config)
    lora = adapter.lora
    tensors = {}
    for name, array in adapter.tensors.items():
        if name == EMBEDDING:
            array = np.ascontiguousarray(array, dtype=np.float32)
            tensors[_PEFT_PREFIX + hf_name(EMBEDDING)] = array
            if config.tie_embeddings:  # PEFT unties a wrapped module unless told to keep the tie
                tensors[_PEFT_PREFIX + hf_name("output.weight")] = array
            continue
        layer, target, which = _ADAPTER_NAME.fullmatch(name).group(1, 3, 4)
        heads = _heads(config, target)
        if which == "B" and heads is not None:
            array = to_half_split(array, heads)
        hf = hf_name(base_name(name)).replace(".weight", f".lora_{which}.weight")
        tensors[_PEFT_PREFIX + hf] = np.ascontiguousarray(array, dtype=np.float32)
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout, "target_modules": [_peft_module(t) for t in lora.targets],
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": [_EMBED_MODULE] if lora.train_embeddings else None,
        "ensure_weight_tying": bool(lora.train_embeddings and config.tie_embeddings),
        "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
        "base_model_name_or_path": adapter.base_model,
    }
    with atomic_directory(path, overwrite=overwrite) as tmp:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return Path(path)


# PEFT settings this reader does not implement: refused when set (true, non-empty).
_UNSUPPORTED = ("use_dora", "use_rslora", "fan_in_fan_out", "layers_to_transform", "rank_pattern",
                "alpha_pattern", "layer_replication", "lora_bias", "trainable_token_indices")
_EMBED_MODULE = "embed_tokens"  # the one module modules_to_save may list


def _float_matrix(array: np.ndarray, weights_file: Path, key: str) -> np.ndarray:
    if array.ndim != 2 or array.dtype.kind not in "fV" and array.dtype.name != "bfloat16":
        raise BridgeError(f"{weights_file}: tensor '{key}' is not a 2-D float tensor")
    return array.astype(np.float32)


def is_adapter(path: str | os.PathLike) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_peft(path: str | os.PathLike, config: LlamaConfig) -> Adapter:
    """Read a PEFT LoRA adapter directory (ours or PEFT's) into canonical tensors, refusing one
    that does not fit the base model `config`. Every refusal names the file and the field or
    tensor."""
    from safetensors.numpy import load_file

    path = Path(path)
    config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file():
        raise BridgeError(f"{path}: not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    try:
        d = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BridgeError(f"{config_file}: cannot read it as JSON ({e})") from None
    if not isinstance(d, dict):
        raise BridgeError(f"{config_file}: expected a JSON object")
    if d.get("peft_type") != "LORA":
        raise BridgeError(f"{config_file}: peft_type {d.get('peft_type')!r}; only LORA adapters "
                          f"are supported")
    for key in _UNSUPPORTED:
        if d.get(key):
            raise BridgeError(f"{config_file}: {key} {d[key]!r} is not supported")
    if d.get("bias", "none") != "none":
        raise BridgeError(f"{config_file}: bias {d['bias']!r} is not supported (only 'none')")
    modules = d.get("target_modules")
    if isinstance(modules, str) or not isinstance(modules, list):
        raise BridgeError(f"{config_file}: target_modules must be a list of module names "
                          f"(got {modules!r})")
    unknown = [m for m in modules if _target_of(m) is None]
    if unknown:
        raise BridgeError(f"{config_file}: target module {unknown[0]!r} is not a LLaMA projection "
                          f"({', '.join(_peft_module(t) for t in TARGETS)})")
    saved = d.get("modules_to_save") or []
    if isinstance(saved, str) or not isinstance(saved, list):
        raise BridgeError(f"{config_file}: modules_to_save must be a list of module names "
                          f"(got {saved!r})")
    others = [m for m in saved if str(m).split(".")[-1] != _EMBED_MODULE]
    if others:
        raise BridgeError(f"{config_file}: modules_to_save {others[0]!r} is not supported (only "
                          f"{_EMBED_MODULE}, the embedding table)")
    try:
        lora = LoraConfig(rank=d.get("r"), alpha=d.get("lora_alpha"),
                          dropout=d.get("lora_dropout", 0.0) or 0.0,
                          targets=tuple(dict.fromkeys(_target_of(m) for m in modules)),
                          train_embeddings=bool(saved))
    except BridgeError as e:
        peft_key = {"lora_rank": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
                    "lora_targets": "target_modules"}[e.field]
        raise BridgeError(f"{config_file}: {peft_key} {e.message}") from None
    if not weights_file.is_file():
        raise BridgeError(f"{path}: no {ADAPTER_WEIGHTS} (adapter_model.bin is not read: "
                          f"safetensors only)")
    try:
        stored = load_file(str(weights_file))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise BridgeError(f"{weights_file}: cannot read it as safetensors ({e})") from None
    tensors, head = {}, None
    pattern = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+\.\w+)"
                         r"\.lora_([AB])(?:\.default)?\.weight")
    by_hf = {_hf_module(t): t for t in TARGETS}  # "self_attn.q_proj" -> "wq"
    embedding_keys = {_PEFT_PREFIX + hf_name(EMBEDDING), hf_name(EMBEDDING)}
    head_keys = {_PEFT_PREFIX + hf_name("output.weight"), hf_name("output.weight")}
    for key in [k for k in stored if k in embedding_keys | head_keys]:
        if not lora.train_embeddings:
            raise BridgeError(f"{weights_file}: tensor '{key}' is a whole module, which "
                              f"modules_to_save does not list")
        array = _float_matrix(stored.pop(key), weights_file, key)
        if key in embedding_keys:
            tensors[EMBEDDING] = array
        elif not config.tie_embeddings:
            raise BridgeError(f"{weights_file}: tensor '{key}' trains the LM head, which is not "
                              f"supported (only the embedding table)")
        else:
            head = array
    for key, array in stored.items():
        m = pattern.fullmatch(key)
        target = by_hf.get(m.group(2)) if m else None
        if target is None:
            raise BridgeError(f"{weights_file}: tensor '{key}' is not a LoRA tensor of a LLaMA "
                              f"projection")
        layer, which = int(m.group(1)), m.group(3)
        if target not in lora.targets:
            raise BridgeError(f"{weights_file}: tensor '{key}' adapts {_peft_module(target)}, "
                              f"which target_modules does not list")
        array = _float_matrix(array, weights_file, key)
        heads = _heads(config, target)
        if which == "B" and heads is not None:
            if array.shape[0] % (2 * heads):
                raise BridgeError(f"{weights_file}: tensor '{key}' has {array.shape[0]} rows, not "
                                  f"a whole number of heads of the base model ({heads})")
            array = from_half_split(array, heads)
        tensors[adapter_name(layer, target, which)] = array
    if lora.train_embeddings and config.tie_embeddings and head is None \
            and not d.get("ensure_weight_tying"):
        raise BridgeError(f"{config_file}: modules_to_save {_EMBED_MODULE} without "
                          f"ensure_weight_tying or an lm_head tensor, on a base whose LM head is "
                          f"its embedding: PEFT would leave the head untrained, which this model "
                          f"cannot hold")
    adapter = Adapter(lora, tensors, d.get("base_model_name_or_path"))
    adapter.check(config, weights_file)
    if head is not None and not np.array_equal(head, tensors[EMBEDDING]):
        raise BridgeError(f"{weights_file}: tensor '{_PEFT_PREFIX + hf_name('output.weight')}' "
                          f"differs from the embedding table, which the base model ties it to")
    return adapter
