"""Writing a LLaMA-family model as a GGUF file (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1; the
K-quants q2_k ... q6_k by llama.cpp's own quantiser, bridge.gguf.quantize), through llama.cpp's own
`gguf` package (the container, and the rounding of every type it quantises from gguf.quants).

What llama.cpp reads, and so what is written (facts from llama.cpp's converter and loader):
  - architecture "llama" (Mistral's too, as llama.cpp's converter writes it; a window is refused),
    "qwen2" or "qwen3" (bridge.gguf.conventions.gguf_arch), and its keys: <arch>.context_length,
    embedding_length, block_count, feed_forward_length, attention.head_count / head_count_kv /
    key_length / value_length / layer_norm_rms_epsilon, rope.dimension_count, rope.freq_base,
    vocab_size; general.file_type.
  - q/k rows in Meta's interleaved-pair order: llama.cpp's converter applies `permute` to Hugging
    Face's q_proj / k_proj, which undoes HF's half-split permutation (conversion/llama.py,
    LlamaModel.permute and modify_tensors), and runs the llama graph with adjacent-pair RoPE. Our
    canonical tensors are already in that order, so they are written as they are. For qwen2 and
    qwen3 the converter keeps Hugging Face's rows (llama.cpp runs them with NEOX RoPE), so wq, wk,
    their biases and the head norms are written in half-split order, per head, as
    bridge.formats.hf writes them; the biases and head norms are 1-D, hence F32.
  - LLaMA 3.1 rope scaling as a `rope_freqs.weight` tensor of per-frequency divisors (float32,
    (H/2,)), computed by llama.cpp's formula (LlamaModel.generate_extra_tensors). llama.cpp's own
    rope.scaling.* keys must not carry it: rope.scaling.type "llama3" fails its loader's
    assertion and rope.scaling.factor would scale every frequency once more. The four parameters
    travel under our own keys (llama_bridge.rope_scaling.*) so that an import rebuilds RopeScaling.
  - 1-D tensors (norms, rope_freqs) in F32 whatever the file type; the output projection in Q8_0
    under a quantised type (OUTPUT_QTYPE); a matrix whose row length is not whole blocks of its
    type falls back to F16, as llama.cpp's converter and quantiser do (_tensor_type).
The names, file types and keys are bridge.gguf.conventions'; the tokenizer keys come from
bridge.gguf.vocab.
"""

from __future__ import annotations

import dataclasses
import math
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from ..atomic import atomic_file
from ..config import LlamaConfig
from ..errors import BridgeError
from ..formats.base import Spec, check_specs
from ..formats.hf import _heads_to_permute, to_half_split
from ..progress import note
from .conventions import (FILE_TYPES, HALF_SPLIT_ARCHES, LLAMA_CPP, OUR_BOS, OUR_EOS, OUR_KEY,
                          OUTPUT_QTYPE, ROPE_FREQS, gguf_arch, gguf_dtype, gguf_name,
                          llama3_rope_freqs)


def write_gguf(path: str | os.PathLike, config: LlamaConfig, specs: dict[str, Spec],
               fetch: Callable[[str], np.ndarray], *, overwrite: bool = False,
               progress: Callable[[int], object] | None = None, extra_files: Iterable[Path] = (),
               dtype: str | None = None, tokenizer=None,
               warn: Callable[[str], object] | None = None,
               stage: Callable[[str], object] | None = None) -> Path:
    """Write a LLaMA-family GGUF file atomically, one tensor in memory at a time.

    `dtype` a FILE_TYPES name (default: the specs' dtype, f32 when mixed) applies to the matrices,
    by the rules of _tensor_type (1-D tensors F32, the output projection Q8_0 under a quantised
    type). The K-quants (q2_k ... q6_k) are llama.cpp's: the file is first written losslessly (the
    specs' dtype) beside `path`, then llama.cpp's quantiser writes `path`, choosing each tensor's
    type itself; without llama-cpp-python, or without a tokenizer (llama.cpp loads no model
    without one), they are refused before anything is written. `tokenizer` (a bridge Tokenizer,
    or None) becomes the tokenizer.ggml.* keys; a `chat_template.jinja` among `extra_files`
    becomes tokenizer.chat_template. `warn(message)` hears the F16 fallbacks (llama.cpp's too)
    and a missing tokenizer (default: stderr); `stage(line)` the line that says llama.cpp's
    quantiser is running (default: stderr). `progress(nbytes)` is called after each tensor
    with its size as fetched.
    """
    import gguf

    from .vocab import vocab_keys

    arch = gguf_arch(config)
    ordered = check_specs(config, specs, "tensors to write")
    warn = warn or note  # above an open progress bar
    stored = {d.name for _, d in ordered.values()}
    lossless = {"float16": "f16", "bfloat16": "bf16"}.get(stored.pop(), "f32") \
        if len(stored) == 1 else "f32"
    file_type, quantise = gguf_dtype(dtype or lossless), None
    if FILE_TYPES[file_type][2] == LLAMA_CPP:
        from .quantize import input_beside, quantize_with_llama_cpp, require_llama_cpp
        require_llama_cpp(file_type)
        if tokenizer is None:
            # llama.cpp's quantiser runs without one, but llama.cpp loads no model without it:
            # a K-quant file is for llama.cpp (the f32 ... q5_1 ones only warn, see below)
            raise BridgeError(f"{path}: {file_type} is a file for llama.cpp, which loads none "
                              f"without a tokenizer, and there is none",
                              hint=("tokenizer", "FILE", "pass {}"))

        def quantise(src: Path, dst: Path, target: str = file_type) -> None:
            quantize_with_llama_cpp(src, dst, target, FILE_TYPES[target][1], warn=warn,
                                    stage=stage, name=path)
        file_type = lossless  # what llama.cpp reads: every value as it came
    qtype_name, ftype_name, _ = FILE_TYPES[file_type]
    qtype = gguf.GGMLQuantizationType[qtype_name]

    writer = gguf.GGUFWriter(None, arch)
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
        for method, value in vocab_keys(tokenizer, config.vocab_size, chat_template,
                                        pre="qwen2" if arch in HALF_SPLIT_ARCHES else None):
            getattr(writer, method)(value)  # the writer's own add_token_list etc.: its key names

    # Every tensor's info goes into the header first (names, shapes, types, offsets), so that the
    # data can follow one tensor at a time: the writer never holds more than one.
    plan = []  # (canonical name or None for rope_freqs, GGUF name, quantisation type)
    if config.rope_scaling is not None:
        plan.append((None, ROPE_FREQS, gguf.GGMLQuantizationType.F32))
    # the output projection, as llama.cpp tells it: by name, the embedding when there is no output
    output = "output.weight" if "output.weight" in ordered else "tok_embeddings.weight"
    for name, (shape, _) in ordered.items():
        plan.append((name, gguf_name(name),
                     _tensor_type(gguf, name, shape, qtype, warn, output=name == output)))
    data_bytes = 0  # what the tensors take in the file (llama.cpp's quantised copy comes on top)
    for name, out_name, t in plan:
        shape = (config.head_dim // 2,) if name is None else ordered[name][0]
        block, size = gguf.GGML_QUANT_SIZES[t]
        nbytes = math.prod(shape) // block * size
        data_bytes += nbytes
        writer.add_tensor_info(out_name, shape, np.dtype(np.float32), nbytes, raw_dtype=t)

    with atomic_file(path, overwrite=overwrite, needed_bytes=data_bytes) as tmp, \
            ExitStack() as stack:
        out = tmp if quantise is None else stack.enter_context(input_beside(tmp))
        try:
            writer.write_header_to_file(Path(out))
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for name, out_name, t in plan:
                if name is None:
                    writer.write_tensor_data(llama3_rope_freqs(
                        config.head_dim, config.rope_theta, config.rope_scaling))
                    continue
                array = fetch(name)
                heads = _heads_to_permute(name, config) if arch in HALF_SPLIT_ARCHES else None
                if heads is not None:  # rows (or their blocks) in half-split order, per head
                    array = (Encoded(to_half_split(array.data, heads), array.qtype)
                             if isinstance(array, Encoded) else to_half_split(array, heads))
                if isinstance(array, Encoded):  # blocks already in the tensor's type
                    if array.qtype != t.name or array.data.nbytes != math.prod(
                            ordered[name][0]) // gguf.GGML_QUANT_SIZES[t][0] * \
                            gguf.GGML_QUANT_SIZES[t][1]:
                        raise BridgeError(f"tensor {name!r}: got {array.data.nbytes} bytes of "
                                          f"{array.qtype}, the file holds it as {t.name}")
                    writer.write_tensor_data(array.data)
                    continue
                if tuple(array.shape) != ordered[name][0]:
                    raise BridgeError(f"tensor {name!r}: got shape {tuple(array.shape)}, "
                                      f"expected {ordered[name][0]}")
                writer.write_tensor_data(_encode(gguf, array, t))
                if progress is not None:
                    progress(array.nbytes)
                del array
        finally:
            writer.close()
        if quantise is not None:
            quantise(out, tmp)
    return Path(path)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A tensor `fetch` hands write_gguf already in its GGML type: `data` the type's blocks as
    uint8, (out, blocks x bytes per block), `qtype` its name ("Q4_0"). It must be the type the
    file's rules give the tensor (_tensor_type); written as it is."""

    data: np.ndarray
    qtype: str


def _tensor_type(gguf, name: str, shape: tuple[int, ...], qtype, warn, output: bool = False):
    """llama.cpp's rules for a tensor of the file type `qtype`: 1-D tensors F32 (its converter,
    conversion/base.py, and its quantiser's tensor_allows_quantization, src/llama-quant.cpp);
    the output projection OUTPUT_QTYPE under a quantised type (see there); a row that is not
    whole blocks of the type F16 (the converter's QuantError fallback; the quantiser's
    tensor_type_fallback for 32-element blocks)."""
    if len(shape) == 1:
        return gguf.GGMLQuantizationType.F32
    if output and gguf.GGML_QUANT_SIZES[qtype][0] > 1:  # blocks of more than one: quantised
        qtype = gguf.GGMLQuantizationType[OUTPUT_QTYPE]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        warn(f"tensor {name!r}: rows of {shape[-1]} are not whole {qtype.name} blocks of {block}; "
             f"written as F16, as llama.cpp does")
        return gguf.GGMLQuantizationType.F16
    return qtype


def _encode(gguf, array: np.ndarray, t) -> np.ndarray:
    """The bytes of `array` as GGML type `t`, by gguf.quants (F16 / BF16 / Q4_0 ... Q8_0 rounding
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
