"""llama.cpp's conventions for a LLaMA-family model in GGUF, the ones a write makes and a read
takes back: the architecture of each family and the deltas it holds, which architectures keep q
and k in Hugging Face's half-split RoPE layout, the file types `--dtype` names and who quantises
each, the tensor name table, our own keys (LLaMA 3.1 rope scaling, the config's token ids), and
llama.cpp's formula for the rope_freqs.weight tensor that carries LLaMA 3.1's rope scaling.
"""

from __future__ import annotations

import math
import re

import numpy as np

from ..config import LlamaConfig, RopeScaling
from ..errors import BridgeError

ARCH = "llama"
# general.architecture -> (the family it is read as, the deltas its tensors hold). Each is the
# decoder llama.cpp runs under that name (src/models/qwen2.cpp: biases on q, k and v; qwen3.cpp:
# attn_q_norm / attn_k_norm, head_dim as attention.key_length).
ARCHES = {"llama": ("llama", ()), "qwen2": ("qwen2", ("qkv_bias",)),
          "qwen3": ("qwen3", ("qk_norm",))}
# The architecture a family is written as. llama.cpp's converter writes Mistral as "llama"
# (conversion/mistral.py subclasses LlamaModel), so a Mistral file reads back as family llama.
FAMILY_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Architectures whose q and k rows stay in Hugging Face's half-split order: llama.cpp's converter
# permutes q_proj / k_proj for "llama" alone (conversion/llama.py, LlamaModel.permute) and runs
# these with NEOX RoPE, pairs H/2 apart (src/llama-model.cpp, llama_model_rope_type). A read
# undoes the permutation per head (wq, wk, their biases, the head norms), a write redoes it.
HALF_SPLIT_ARCHES = ("qwen2", "qwen3")
# --dtype for a GGUF target -> (gguf.GGMLQuantizationType name: the matrices' type before the
# per-tensor rules of _tensor_type; gguf.LlamaFileType name: general.file_type, and the name of
# llama_cpp.LLAMA_FTYPE_<it>; who quantises: GGUF_PY = gguf.quants' numpy quantisers, here, one
# tensor at a time; LLAMA_CPP = llama.cpp's own quantiser, on a lossless file written first, since
# gguf.quants has no K-quant quantisers). The type of each file type is llama.cpp's
# llama_ftype_get_default_type (src/llama-quant.cpp, llama-cpp-python 0.3.36). Left out: Q2_K_S
# and the IQ types (llama.cpp wants an importance matrix for most), TQ and MXFP4 (other models).
GGUF_PY, LLAMA_CPP = "gguf", "llama.cpp"
FILE_TYPES = {
    "f32": ("F32", "ALL_F32", GGUF_PY), "f16": ("F16", "MOSTLY_F16", GGUF_PY),
    "bf16": ("BF16", "MOSTLY_BF16", GGUF_PY), "q8_0": ("Q8_0", "MOSTLY_Q8_0", GGUF_PY),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0", GGUF_PY), "q4_1": ("Q4_1", "MOSTLY_Q4_1", GGUF_PY),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0", GGUF_PY), "q5_1": ("Q5_1", "MOSTLY_Q5_1", GGUF_PY),
    "q2_k": ("Q2_K", "MOSTLY_Q2_K", LLAMA_CPP), "q3_k_s": ("Q3_K", "MOSTLY_Q3_K_S", LLAMA_CPP),
    "q3_k_m": ("Q3_K", "MOSTLY_Q3_K_M", LLAMA_CPP), "q3_k_l": ("Q3_K", "MOSTLY_Q3_K_L", LLAMA_CPP),
    "q4_k_s": ("Q4_K", "MOSTLY_Q4_K_S", LLAMA_CPP), "q4_k_m": ("Q4_K", "MOSTLY_Q4_K_M", LLAMA_CPP),
    "q5_k_s": ("Q5_K", "MOSTLY_Q5_K_S", LLAMA_CPP), "q5_k_m": ("Q5_K", "MOSTLY_Q5_K_M", LLAMA_CPP),
    "q6_k": ("Q6_K", "MOSTLY_Q6_K", LLAMA_CPP)}
# The output projection (output.weight, or token_embd.weight when the embeddings are tied) under a
# quantised file type: llama.cpp's quantiser gives it Q6_K when its rows are whole 256-blocks,
# else Q8_0, and keeps Q8_0 as Q8_0 (src/llama-quant.cpp, llama_tensor_get_type_impl, the OUTPUT /
# TOKEN_EMBD branch). gguf.quants cannot write Q6_K, so the types it quantises take Q8_0 there:
# llama.cpp's own fallback for it, more bits than Q6_K rather than fewer.
OUTPUT_QTYPE = "Q8_0"
DTYPE_ALIASES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
GGUF_DTYPES = tuple(FILE_TYPES) + tuple(DTYPE_ALIASES)
ROPE_FREQS = "rope_freqs.weight"
OUR_KEY = "llama_bridge.rope_scaling."  # + RopeScaling field name
# The config's own token ids (LlamaConfig.bos_id / eos_ids: what the checkpoint declares, e.g. a
# base LLaMA 3's single EOS where its tokenizer also knows EOT and EOM), kept for the round trip;
# a file without them takes BOS and EOS from the tokenizer.ggml.* keys.
OUR_BOS, OUR_EOS = "llama_bridge.bos_id", "llama_bridge.eos_ids"
# Canonical name -> GGUF name ({i} the layer); w1 is the gate, w3 the up, w2 the down projection.
NAMES = {
    "tok_embeddings.weight": "token_embd.weight",
    "layers.{i}.attention_norm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.attention.wq.weight": "blk.{i}.attn_q.weight",
    "layers.{i}.attention.wk.weight": "blk.{i}.attn_k.weight",
    "layers.{i}.attention.wv.weight": "blk.{i}.attn_v.weight",
    "layers.{i}.attention.wo.weight": "blk.{i}.attn_output.weight",
    "layers.{i}.ffn_norm.weight": "blk.{i}.ffn_norm.weight",
    "layers.{i}.feed_forward.w1.weight": "blk.{i}.ffn_gate.weight",
    "layers.{i}.feed_forward.w3.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.feed_forward.w2.weight": "blk.{i}.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "output.weight": "output.weight",
}
# The deltas' tensors, by the names of llama.cpp's qwen2 (biases) and qwen3 (head norms).
DELTA_NAMES = {
    "layers.{i}.attention.wq.bias": "blk.{i}.attn_q.bias",
    "layers.{i}.attention.wk.bias": "blk.{i}.attn_k.bias",
    "layers.{i}.attention.wv.bias": "blk.{i}.attn_v.bias",
    "layers.{i}.attention.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.attention.k_norm.weight": "blk.{i}.attn_k_norm.weight",
}
_ALL_NAMES = {**NAMES, **DELTA_NAMES}
_CANONICAL = {v: k for k, v in _ALL_NAMES.items()}
_LAYER = re.compile(r"(layers|blk)\.(\d+)\.")


def _translate(name: str, table: dict[str, str]) -> str | None:
    m = _LAYER.match(name)
    pattern = name if m is None else name.replace(m.group(0), f"{m.group(1)}.{{i}}.", 1)
    out = table.get(pattern)
    return None if out is None else out.format(i=m.group(2) if m else "")


def gguf_name(name: str) -> str:
    """llama.cpp's name for a canonical tensor name."""
    out = _translate(name, _ALL_NAMES)
    if out is None:
        raise BridgeError(f"tensor {name!r}: no GGUF name for it")
    return out


def canonical_name(name: str) -> str | None:
    """The canonical name of a llama.cpp tensor name; None for a name we do not map."""
    return _translate(name, _CANONICAL)


def gguf_arch(config: LlamaConfig) -> str:
    """The general.architecture a model of `config` is written as; refused, naming the delta,
    where that architecture cannot hold the model's deltas exactly (a sliding window anywhere;
    a qwen2 without its biases, whose file llama.cpp would read as one with them)."""
    arch = FAMILY_ARCH[config.family]
    if arch == ARCH:
        config.refuse_deltas("a LLaMA GGUF file")
        return arch
    holds = ARCHES[arch][1]
    extra = [d for d in config.deltas if d not in holds]
    if extra:
        raise BridgeError(f"a {arch} GGUF file holds {arch}'s decoder ({', '.join(holds)}), not "
                          f"{config.family}'s {extra[0]} (write hf or native)", field="to")
    missing = [d for d in holds if d not in config.deltas]
    if missing:
        raise BridgeError(f"a {arch} GGUF file holds {missing[0]}, which this {config.family} "
                          f"model lacks (LlamaConfig.{missing[0]} is off; write hf or native)",
                          field="to")
    return arch


def gguf_dtype(dtype: str) -> str:
    """Our name of a GGUF file type (a FILE_TYPES key: f32 ... q6_k) from any spelling --dtype
    accepts for a GGUF target."""
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in FILE_TYPES:
        raise BridgeError(f"GGUF holds {', '.join(FILE_TYPES)} (or float32 / float16 / bfloat16), "
                          f"got {dtype!r}", field="dtype")
    return name


def llama3_rope_freqs(head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """rope_freqs.weight, float32 (H/2,): the divisor of each RoPE frequency, by llama.cpp's
    formula (float32 throughout, as its converter computes it in torch): 1 above the band, factor
    below it, 1 / ((1 - smooth) / factor + smooth) inside."""
    f32 = np.float32
    freqs = f32(1) / (f32(theta) ** (np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)))
    wavelen = (f32(1) / freqs) * f32(2 * math.pi)  # torch's scalar / tensor is reciprocal * scalar
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    old = f32(s.original_max_position_embeddings)
    smooth = ((f32(1) / wavelen) * old - f32(s.low_freq_factor)) \
        / f32(s.high_freq_factor - s.low_freq_factor)
    inside = f32(1) / ((f32(1) - smooth) / f32(s.factor) + smooth)
    return np.where(wavelen < f32(high_wavelen), f32(1),
                    np.where(wavelen > f32(low_wavelen), f32(s.factor), inside)).astype(f32)
