"""GGUF, llama.cpp's single-file format: read (F32, F16, BF16, Q8_0 tensors) and write (f32, f16,
bf16, q8_0) LLaMA models, through llama.cpp's own `gguf` package (the container, and Q8_0 / BF16
rounding from gguf.quants).

What llama.cpp reads, and so what is written (facts from llama.cpp's converter and loader):
  - architecture "llama" and its keys: llama.context_length, embedding_length, block_count,
    feed_forward_length, attention.head_count / head_count_kv / key_length / value_length /
    layer_norm_rms_epsilon, rope.dimension_count, rope.freq_base, vocab_size; general.file_type.
  - q/k rows in Meta's interleaved-pair order: llama.cpp's converter applies `permute` to Hugging
    Face's q_proj / k_proj, which undoes HF's half-split permutation (conversion/llama.py,
    LlamaModel.permute and modify_tensors), and runs the llama graph with adjacent-pair RoPE. Our
    canonical tensors are already in that order, so they are written as they are.
  - LLaMA 3.1 rope scaling as a `rope_freqs.weight` tensor of per-frequency divisors (float32,
    (H/2,)), computed by llama.cpp's formula (LlamaModel.generate_extra_tensors). llama.cpp's own
    rope.scaling.* keys must not carry it: rope.scaling.type "llama3" fails its loader's
    assertion and rope.scaling.factor would scale every frequency once more. The four parameters
    travel under our own keys (llama_bridge.rope_scaling.*) so that an import rebuilds RopeScaling.
  - 1-D tensors (norms, rope_freqs) in F32 whatever the file type; under q8_0 a matrix whose row
    length is not a multiple of 32 falls back to F16, as llama.cpp's converter does.
The tokenizer keys come from bridge.gguf_tokenizer.
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from ..atomic import atomic_file
from ..config import LlamaConfig, RopeScaling
from ..errors import BridgeError
from .base import Checkpoint, Spec, check_specs

ARCH = "llama"
# --dtype for a GGUF target -> (gguf.GGMLQuantizationType name, gguf.LlamaFileType name)
FILE_TYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"),
              "bf16": ("BF16", "MOSTLY_BF16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0")}
DTYPE_ALIASES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
GGUF_DTYPES = tuple(FILE_TYPES) + tuple(DTYPE_ALIASES)
READ_TYPES = ("F32", "F16", "BF16", "Q8_0")
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
_LAYER = re.compile(r"(layers|blk)\.(\d+)\.")


def _translate(name: str, table: dict[str, str]) -> str | None:
    m = _LAYER.match(name)
    pattern = name if m is None else name.replace(m.group(0), f"{m.group(1)}.{{i}}.", 1)
    out = table.get(pattern)
    return None if out is None else out.format(i=m.group(2) if m else "")


def gguf_name(name: str) -> str:
    """llama.cpp's name for a canonical tensor name."""
    out = _translate(name, NAMES)
    if out is None:
        raise BridgeError(f"tensor {name!r}: no GGUF name for it")
    return out


def canonical_name(name: str) -> str | None:
    """The canonical name of a llama.cpp tensor name; None for a name we do not map."""
    return _translate(name, {v: k for k, v in NAMES.items()})


def gguf_dtype(dtype: str) -> str:
    """f32 / f16 / bf16 / q8_0 from any spelling --dtype accepts for a GGUF target."""
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


# -- writing ---------------------------------------------------------------------------------------

def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def write_gguf(path: str | os.PathLike, config: LlamaConfig, specs: dict[str, Spec],
               fetch: Callable[[str], np.ndarray], *, overwrite: bool = False,
               progress: Callable[[int], object] | None = None, extra_files: Iterable[Path] = (),
               dtype: str | None = None, tokenizer=None,
               warn: Callable[[str], object] | None = None) -> Path:
    """Write a LLaMA GGUF file atomically, one tensor in memory at a time.

    `dtype` f32 / f16 / bf16 / q8_0 (default: the specs' dtype, f32 when mixed) applies to the
    matrices; 1-D tensors stay F32. `tokenizer` (a bridge Tokenizer, or None) becomes the
    tokenizer.ggml.* keys; a `chat_template.jinja` among `extra_files` becomes
    tokenizer.chat_template. `warn(message)` hears the Q8_0 fallbacks and a missing tokenizer
    (default: stderr). `progress(nbytes)` is called after each tensor with its size as fetched.
    """
    import gguf

    from ..gguf_tokenizer import vocab_keys

    ordered = check_specs(config, specs, "tensors to write")
    warn = warn or _stderr
    if dtype is None:
        stored = {d.name for _, d in ordered.values()}
        dtype = {"float16": "f16", "bfloat16": "bf16"}.get(stored.pop(), "f32") \
            if len(stored) == 1 else "f32"
    qtype_name, ftype_name = FILE_TYPES[gguf_dtype(dtype)]
    qtype = gguf.GGMLQuantizationType[qtype_name]

    writer = gguf.GGUFWriter(None, ARCH)
    _add_config(writer, config, gguf.LlamaFileType[ftype_name])
    chat_template = next((Path(f).read_text(encoding="utf-8") for f in extra_files
                          if Path(f).name == "chat_template.jinja"), None)
    if tokenizer is None:
        # Written anyway: the weights are whole, and this bridge (or gguf's tools, which can add
        # a vocabulary later) reads them; refusing would leave a tokenizer-less checkpoint (a
        # fresh jax_llama.save, llama2.c) no way into GGUF. llama.cpp itself needs the keys.
        warn(f"{path}: written without a tokenizer: llama.cpp will not load it without one "
             f"(pass --tokenizer FILE / tokenizer=...)")
    else:
        for method, value in vocab_keys(tokenizer, config.vocab_size, chat_template):
            getattr(writer, method)(value)  # the writer's own add_token_list etc.: its key names

    # Every tensor's info goes into the header first (names, shapes, types, offsets), so that the
    # data can follow one tensor at a time: the writer never holds more than one.
    plan = []  # (canonical name or None for rope_freqs, GGUF name, quantisation type)
    if config.rope_scaling is not None:
        plan.append((None, ROPE_FREQS, gguf.GGMLQuantizationType.F32))
    for name, (shape, _) in ordered.items():
        plan.append((name, gguf_name(name), _tensor_type(gguf, name, shape, qtype, warn)))
    for name, out_name, t in plan:
        shape = (config.head_dim // 2,) if name is None else ordered[name][0]
        block, size = gguf.GGML_QUANT_SIZES[t]
        writer.add_tensor_info(out_name, shape, np.dtype(np.float32),
                               math.prod(shape) // block * size, raw_dtype=t)

    with atomic_file(path, overwrite=overwrite) as tmp:
        try:
            writer.write_header_to_file(Path(tmp))
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for name, out_name, t in plan:
                if name is None:
                    writer.write_tensor_data(llama3_rope_freqs(
                        config.head_dim, config.rope_theta, config.rope_scaling))
                    continue
                array = fetch(name)
                if tuple(array.shape) != ordered[name][0]:
                    raise BridgeError(f"tensor {name!r}: got shape {tuple(array.shape)}, "
                                      f"expected {ordered[name][0]}")
                writer.write_tensor_data(_encode(gguf, array, t))
                if progress is not None:
                    progress(array.nbytes)
                del array
        finally:
            writer.close()
    return Path(path)


def _tensor_type(gguf, name: str, shape: tuple[int, ...], qtype, warn):
    """llama.cpp's rule: 1-D tensors in F32; a row that is not whole Q8_0 blocks in F16."""
    if len(shape) == 1:
        return gguf.GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        warn(f"tensor {name!r}: rows of {shape[-1]} are not whole {qtype.name} blocks of {block}; "
             f"written as F16, as llama.cpp's converter does")
        return gguf.GGMLQuantizationType.F16
    return qtype


def _encode(gguf, array: np.ndarray, t) -> np.ndarray:
    """The bytes of `array` as GGML type `t`, by gguf.quants (F16 / BF16 / Q8_0 rounding
    exactly as llama.cpp's converter does); F32 and F16 keep their numpy dtype."""
    array = np.ascontiguousarray(array)
    if t == gguf.GGMLQuantizationType.F32:
        return array.astype("<f4", copy=False)
    if t == gguf.GGMLQuantizationType.F16:
        return array.astype("<f2", copy=False)
    if t == gguf.GGMLQuantizationType.BF16 and array.dtype == ml_dtypes.bfloat16:
        return array.view(np.uint8)  # already bfloat16: its bits as they are
    return gguf.quants.quantize(array.astype(np.float32, copy=False), t)


def _add_config(writer, config: LlamaConfig, file_type) -> None:
    import gguf

    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.dim)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if config.bos_id is not None:
        writer.add_uint32(OUR_BOS, config.bos_id)
    if config.eos_ids:
        writer.add_array(OUR_EOS, [int(i) for i in config.eos_ids])
    s = config.rope_scaling
    if s is not None:
        writer.add_string(OUR_KEY + "type", s.type)
        for field in ("factor", "low_freq_factor", "high_freq_factor"):
            writer.add_float64(OUR_KEY + field, float(getattr(s, field)))
        writer.add_uint32(OUR_KEY + "original_max_position_embeddings",
                          s.original_max_position_embeddings)


# -- reading ---------------------------------------------------------------------------------------

def is_gguf(path: Path) -> bool:
    """True for a file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


class GGUFCheckpoint(Checkpoint):
    """A LLaMA GGUF file: F32 / F16 / BF16 tensors as stored, Q8_0 dequantised to float32. Its
    vocabulary, where we can rebuild it, becomes a tokenizer file in `extra_files`, in a
    temporary directory that lives as long as this object."""

    format = "gguf"

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise BridgeError(f"{self.path}: not a file")
        if not is_gguf(self.path):
            raise BridgeError(f"{self.path}: not a GGUF file (no GGUF magic)")
        try:
            reader = gguf.GGUFReader(self.path)
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
            raise BridgeError(f"{self.path}: truncated or corrupt GGUF file "
                              f"({(str(e).splitlines() or [type(e).__name__])[0][:120]})") from None
        self._reader = reader
        self.files, self.notes = [self.path], []
        fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")
                  and not k.startswith("tokenizer.ggml.")}
        arch = fields.get("general.architecture")
        if arch != ARCH:
            raise BridgeError(f"{self.path}: general.architecture is {arch!r}; only {ARCH!r} "
                              f"GGUF files are read")
        if reader.endianess != gguf.GGUFEndian.LITTLE:
            raise BridgeError(f"{self.path}: a big-endian GGUF file; only little-endian is read")

        self._tensors, specs, rope_freqs = {}, {}, None
        size = self.path.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise BridgeError(f"{self.path}: truncated: tensor {t.name!r} ends at byte "
                                  f"{t.data_offset + t.n_bytes}, the file has {size}")
            if t.tensor_type.name not in READ_TYPES:
                raise BridgeError(f"{self.path}: tensor {t.name!r} is {t.tensor_type.name}; this "
                                  f"reader takes {', '.join(READ_TYPES)} (dequantise it with "
                                  f"llama.cpp first)")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if t.name == ROPE_FREQS:
                rope_freqs = _as_array(t, shape)
                continue
            name = canonical_name(t.name)
            if name is None:
                raise BridgeError(f"{self.path}: unexpected tensor {t.name!r} for a LLaMA model")
            self._tensors[name] = (t, shape)
            stored = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                      "Q8_0": np.float32}[t.tensor_type.name]
            specs[name] = (shape, np.dtype(stored))
        self.config = _config(self.path, fields, specs, rope_freqs)
        self.specs = check_specs(self.config, specs, self.path, source="its llama.* keys")
        types = sorted({t.tensor_type.name for t, _ in self._tensors.values()})
        self.notes.append(f"GGUF v{reader.fields['GGUF.version'].contents()}, tensors "
                          f"{', '.join(types)}" + (" (Q8_0 dequantised to float32)"
                                                   if "Q8_0" in types else ""))
        if rope_freqs is not None:
            self.notes.append("rope_freqs.weight matches the llama3 rope scaling")
        self.extra_files = self._tokenizer_files(reader)

    def tensor(self, name: str) -> np.ndarray:
        if name not in self._tensors:
            raise BridgeError(f"{self.path}: no tensor {name!r}")
        return _as_array(*self._tensors[name])

    def _tokenizer_files(self, reader) -> list[Path]:
        """The GGUF vocabulary as tokenizer files in a directory of our own (removed with this
        object), or none, with a note saying why."""
        from ..gguf_tokenizer import tokenizer_files

        directory = Path(tempfile.mkdtemp(prefix="llama-bridge-gguf-tokenizer-"))
        weakref.finalize(self, _remove_tree, directory)
        files, note = tokenizer_files(reader, directory, self.path)
        if note:
            self.notes.append(note)
        return files


def _remove_tree(directory: Path) -> None:
    import shutil
    shutil.rmtree(directory, ignore_errors=True)


def _as_array(t, shape: tuple[int, ...]) -> np.ndarray:
    """A fresh array in canonical (numpy) layout: F32 / F16 / BF16 as stored, Q8_0 as float32."""
    import gguf

    kind = t.tensor_type.name
    if kind == "Q8_0":
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    if kind == "BF16":
        return np.array(t.data.view(ml_dtypes.bfloat16).reshape(shape))
    return np.array(t.data.reshape(shape))


def _f32_value(value: float) -> float:
    """A float32 key as the shortest decimal that rounds to it (1e-05, not 9.99999974738e-06)."""
    return float(str(np.float32(value)))


def _config(path: Path, fields: dict, specs: dict, rope_freqs: np.ndarray | None) -> LlamaConfig:
    def key(name: str, default=None):
        value = fields.get(f"{ARCH}.{name}", default)
        if value is None:
            raise BridgeError(f"{path}: key {ARCH}.{name} is missing")
        return value

    if fields.get(f"{ARCH}.expert_count", 0):
        raise BridgeError(f"{path}: {ARCH}.expert_count is {fields[f'{ARCH}.expert_count']}: a "
                          f"mixture-of-experts model, which LlamaConfig does not describe")
    scaling_type = fields.get(f"{ARCH}.rope.scaling.type", "none")
    if scaling_type != "none" or fields.get(f"{ARCH}.rope.scaling.factor", 0.0) not in (0.0, 1.0):
        raise BridgeError(f"{path}: {ARCH}.rope.scaling.type {scaling_type!r} (factor "
                          f"{fields.get(f'{ARCH}.rope.scaling.factor')}) is not supported; only "
                          f"unscaled RoPE and LLaMA 3's rope_freqs are read")
    n_heads = key("attention.head_count")
    dim = key("embedding_length")
    head_dim = key("attention.key_length", key("rope.dimension_count", dim // max(n_heads, 1)))
    for name in ("attention.value_length", "rope.dimension_count"):
        if fields.get(f"{ARCH}.{name}", head_dim) != head_dim:
            raise BridgeError(f"{path}: {ARCH}.{name} is {fields[f'{ARCH}.{name}']}, but the head "
                              f"dim is {head_dim}; partial RoPE and unequal k/v heads are not "
                              f"supported")
    embedding = specs.get("tok_embeddings.weight")
    vocab = fields.get(f"{ARCH}.vocab_size") or (embedding[0][0] if embedding else None)
    theta = _f32_value(key("rope.freq_base", 10000.0))
    try:
        config = LlamaConfig(
            dim=dim, n_layers=key("block_count"), n_heads=n_heads,
            n_kv_heads=key("attention.head_count_kv", n_heads), ffn_dim=key("feed_forward_length"),
            vocab_size=vocab if vocab is not None else key("vocab_size"),
            max_seq_len=key("context_length"),
            norm_eps=_f32_value(key("attention.layer_norm_rms_epsilon")), rope_theta=theta,
            rope_scaling=_rope_scaling(path, fields, theta, head_dim, rope_freqs),
            tie_embeddings="output.weight" not in specs, head_dim=head_dim,
            **_token_ids(fields))
    except BridgeError as e:
        raise BridgeError(f"{path}: {e}") from None
    except TypeError as e:  # a key of the wrong type (a string where a number belongs)
        raise BridgeError(f"{path}: a {ARCH}.* key has the wrong type ({e})") from None
    if config.head_dim == config.dim // config.n_heads:
        config = config.replace(head_dim=None)
    return config


def _token_ids(fields: dict) -> dict:
    """bos_id and eos_ids: ours where we wrote them, else the tokenizer's BOS and EOS."""
    if OUR_BOS in fields or OUR_EOS in fields:
        return {"bos_id": fields.get(OUR_BOS), "eos_ids": tuple(fields.get(OUR_EOS, ()))}
    bos, eos = (fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
    return {"bos_id": bos, "eos_ids": () if eos is None else (eos,)}


def _rope_scaling(path: Path, fields: dict, theta: float, head_dim: int,
                  rope_freqs: np.ndarray | None) -> RopeScaling | None:
    """RopeScaling from our keys; else, for a file llama.cpp made (rope_freqs.weight only), the
    LLaMA 3.1 / 3.2 parameters (low 1, high 4, original context 8192, factor = the largest
    divisor) when they reproduce rope_freqs; refused otherwise. rope_freqs, when present, must
    match the scaling within float32 rounding, since llama.cpp runs on it."""
    ours = {k[len(OUR_KEY):]: v for k, v in fields.items() if k.startswith(OUR_KEY)}
    if ours:
        try:
            scaling = RopeScaling.from_dict(ours)
        except BridgeError as e:
            raise BridgeError(f"{path}: {OUR_KEY}*: {e}") from None
    elif rope_freqs is None or np.all(rope_freqs == 1):
        return None
    else:
        scaling = RopeScaling(factor=float(rope_freqs.max()), low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=8192)
    if rope_freqs is None:
        return scaling
    expected = llama3_rope_freqs(head_dim, theta, scaling)
    # rtol: a few float32 ulps (the formula runs in float32; pow may round differently by a ulp)
    if rope_freqs.shape != expected.shape or \
            not np.allclose(rope_freqs, expected, rtol=1e-6, atol=0):
        which = (f"its {OUR_KEY}* keys describe" if ours else
                 "of LLaMA 3.1 / 3.2 (low 1, high 4, original context 8192)")
        raise BridgeError(f"{path}: tensor {ROPE_FREQS!r} is not the llama3 rope scaling "
                          f"{which}; its rope scaling cannot be recovered")
    return scaling
