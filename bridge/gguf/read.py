"""Reading a LLaMA-family GGUF file: its <arch>.* keys as a LlamaConfig, its tensors as canonical
arrays (float types as stored, every quantised type that gguf.quants dequantises as float32, one
tensor at a time), its vocabulary as tokenizer files (bridge.gguf.tokenizer) and its chat
template. The container is read by bridge.gguf.container; names and key conventions are
bridge.gguf.conventions'.

The architectures read are llama.cpp's llama, qwen2 (q, k and v biases) and qwen3 (q and k head
norms, head_dim as attention.key_length). A qwen file keeps q and k in Hugging Face's half-split
RoPE layout, which a read turns into the project's interleaved one per head (wq, wk, their biases,
the head norms; bridge.formats.hf's permutation). Mistral files are llama files (that is how
llama.cpp writes them), so they read back as family llama: a GGUF file does not name the family.
"""

from __future__ import annotations

import functools
import os
import tempfile
import weakref
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np

from ..chat import TEMPLATE_FILE, ChatTemplate
from ..config import LlamaConfig, RopeScaling
from ..errors import BridgeError
from ..formats.base import Checkpoint, check_specs
from ..formats.hf import _heads_to_permute, from_half_split
from ..parallel import by_chunks
from ..resources import aligned_empty
from ..tensors import LAYER_SUFFIXES, layer_shapes
from ..tokenizer import Tokenizer
from .container import GGUFFile, TensorInfo, read_gguf
from .conventions import (ARCHES, HALF_SPLIT_ARCHES, OUR_BOS, OUR_EOS, OUR_KEY, ROPE_FREQS,
                          canonical_name, gguf_name, llama3_rope_freqs)
from .tokenizer import gguf_tokenizer, tokenizer_files

# Read as stored: GGML float type -> numpy dtype. Every other type is read through
# gguf.quants.dequantize into float32 when gguf can dequantise it (Q4_0 ... Q8_0, the K-quants,
# the IQ and TQ types, MXFP4 in gguf 0.19); the rest (Q8_1, Q8_K, integer tensors) are refused.
STORED_FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                 "F64": np.float64}
# Elements dequantised at a time: the float32 result is the only full-size array, its
# temporaries stay a few MB whatever the tensor's size.
_DEQUANT_CHUNK = 1 << 20


class GGUFCheckpoint(Checkpoint):
    """A LLaMA-family GGUF file (architecture llama, qwen2 or qwen3): F32 / F16 / BF16 tensors as
    stored, every type gguf can dequantise (Q4_0 ... Q8_0, K-quants, IQ, TQ) as float32, one
    tensor at a time, q and k rows always in the interleaved RoPE order. Its vocabulary, where
    llama.cpp's tokenizer can be rebuilt, and its chat template become tokenizer files in
    `extra_files`, in a temporary directory that lives as long as this object."""

    format = "gguf"

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = Path(path)
        self._file = file = read_gguf(self.path)
        self.files, self._notes = [self.path], []
        fields = file.fields
        arch = fields.get("general.architecture")
        if arch not in ARCHES:
            raise BridgeError(f"{self.path}: general.architecture is {arch!r}; only "
                              f"{', '.join(map(repr, ARCHES))} GGUF files are read")

        self._tensors: dict[str, tuple[TensorInfo, object]] = {}
        specs, rope_freqs, readable = {}, None, {}
        for t in file.tensors:
            qtype = gguf.GGMLQuantizationType(t.type_id)
            if qtype not in readable:
                readable[qtype] = _readable(qtype)
            if not readable[qtype]:
                raise BridgeError(f"{self.path}: tensor {t.name!r} is {qtype.name}, which gguf "
                                  f"{_gguf_version()} cannot dequantise (readable: float types "
                                  f"and the types gguf.quants dequantises)")
            if t.name == ROPE_FREQS:
                rope_freqs = _as_array(file, t, qtype)
                continue
            name = canonical_name(t.name)
            if name is None:
                raise BridgeError(f"{self.path}: unexpected tensor {t.name!r} for a {arch} model")
            self._tensors[name] = (t, qtype)
            specs[name] = (t.shape, np.dtype(STORED_FLOATS.get(qtype.name, np.float32)))
        self.config = _config(self.path, fields, specs, rope_freqs, arch)
        _require_delta_tensors(self.path, self.config, specs, arch)
        self.specs = check_specs(self.config, specs, self.path, source=f"its {arch}.* keys")
        # rows per head to undo Hugging Face's half-split RoPE order in (qwen2, qwen3), by name
        self._heads = {} if arch not in HALF_SPLIT_ARCHES else {
            name: heads for name in self.specs
            if (heads := _heads_to_permute(name, self.config)) is not None}
        counts = Counter(gguf.GGMLQuantizationType(t.type_id).name for t in file.tensors)
        self.tensor_types = dict(counts.most_common())
        quantised = sorted(k for k in counts if k not in STORED_FLOATS)
        self._notes.append(f"GGUF v{file.version}" + (
            f"; {', '.join(quantised)} read as float32 where a command asks for floats (convert, "
            f"train, parity, --dtype), else in the nearest quantised layout" if quantised else ""))
        if rope_freqs is not None:
            self._notes.append("rope_freqs.weight matches the llama3 rope scaling")
        tokens = fields.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and len(tokens) > self.config.vocab_size:
            raise BridgeError(f"{self.path}: tokenizer.ggml.tokens holds {len(tokens)} tokens, "
                              f"but the model's embedding has {self.config.vocab_size} rows")

    def tensor(self, name: str) -> np.ndarray:
        if name not in self._tensors:
            raise BridgeError(f"{self.path}: no tensor {name!r}")
        return self._interleaved(name, _as_array(self._file, *self._tensors[name]))

    def _interleaved(self, name: str, rows):
        """`rows` (an array, or None) of tensor `name` in the project's interleaved RoPE order:
        a qwen file's q / k rows from their half-split order, per head; others as they are."""
        heads = self._heads.get(name)
        return rows if heads is None or rows is None else from_half_split(rows, heads)

    # tensor_slice of leading rows reads those rows' blocks alone (so jax_llama.load has
    # bridge.int4's QuantisedReader quantise int8 rows a chunk of rows at a time)
    reads_rows = True

    def tensor_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """tensor(name)[index] as a fresh array; a slice of leading rows (index[0] a slice of
        step 1, the rest whole) dequantises only those rows: the same numbers."""
        if name not in self._tensors:
            raise BridgeError(f"{self.path}: no tensor {name!r}")
        t, qtype = self._tensors[name]
        first, rest = (index[0], index[1:]) if index else (slice(None), ())
        if (len(t.shape) < 2 or not isinstance(first, slice) or first.step not in (None, 1)
                or any(r != slice(None) for r in rest) or name in self._heads):
            return super().tensor_slice(name, index)
        start, stop, _ = first.indices(t.shape[0])
        return _as_array(self._file, t, qtype, rows=(start, max(start, stop)))

    def stored_type(self, name: str) -> str | None:
        """The tensor's GGML type name where it is quantised ("Q4_1", "Q8_0", ...), else None."""
        if name not in self._tensors:
            raise BridgeError(f"{self.path}: no tensor {name!r}")
        qtype = self._tensors[name][1].name
        return None if qtype in STORED_FLOATS else qtype

    def int4_tensor(self, name: str):
        """A Q4_0 or Q4_1 tensor's blocks as bridge.int4's layout, exactly (bridge.gguf.int4);
        None for any other type."""
        from .int4 import BLOCK_BYTES, from_q4_blocks

        if name not in self._tensors:
            raise BridgeError(f"{self.path}: no tensor {name!r}")
        t, qtype = self._tensors[name]
        if qtype.name not in BLOCK_BYTES:
            return None
        blocks = from_q4_blocks(self._file.raw(t), qtype.name, tuple(t.shape), name)
        self._file.release(t)
        return tuple(self._interleaved(name, rows) for rows in blocks)

    def int4_rounded(self, name: str):
        """A Q4_K tensor in bridge.int4's layout, its q as the file holds them and its scales and
        minima rounded to float16 (bridge.gguf.int4.from_q4_k_blocks): (packed, scale, min, the
        squared sums of the change and of the weights); None for any other type."""
        from .int4 import from_q4_k_blocks

        if name not in self._tensors:
            raise BridgeError(f"{self.path}: no tensor {name!r}")
        t, qtype = self._tensors[name]
        if qtype.name != "Q4_K" or len(t.shape) != 2:
            return None
        packed, scale, low, *sums = from_q4_k_blocks(self._file.raw(t), tuple(t.shape), name)
        self._file.release(t)
        return (*(self._interleaved(name, rows) for rows in (packed, scale, low)), *sums)

    def int8_rows(self, name: str):
        """A Q8_0, Q4_0, Q6_K or Q4_K tensor as int8 rows with one scale a row, by the compiled
        pass bridge.gguf.native.helpers gives (bridge/native), a chunk of rows at a time on
        the CPU's cores: (q, scale, the squared sums of the change and of the weights); None for
        other types, without the helper, or for a qwen file's q / k rows (reordered as read)."""
        from .native import INT8_ROWS_KINDS, helpers

        if name not in self._tensors:
            raise BridgeError(f"{self.path}: no tensor {name!r}")
        t, qtype = self._tensors[name]
        compiled = helpers().int8_rows
        if (compiled is None or qtype.name not in INT8_ROWS_KINDS or len(t.shape) != 2
                or name in self._heads):
            return None
        O, I = t.shape
        blocks = self._file.raw(t).reshape(O, -1)
        q, scale = aligned_empty((O, I), np.int8), aligned_empty((O, 1), np.float32)

        def rows(start: int, stop: int) -> tuple[float, float]:
            return compiled(blocks[start:stop], qtype.name, q[start:stop], scale[start:stop])

        sums = by_chunks(rows, O, _DEQUANT_CHUNK // I)
        self._file.release(t)
        return q, scale, sum(c for c, _ in sums), sum(n for _, n in sums)

    def own_tokenizer(self) -> Tokenizer:
        """The file's vocabulary, rebuilt to tokenize as llama.cpp does, from the keys read on
        opening; BridgeError naming the file when there is none we rebuild."""
        return gguf_tokenizer(self._file.fields, self.path)

    def own_template(self) -> ChatTemplate | None:
        """The file's tokenizer.chat_template, from the keys read on opening; None without one."""
        return _template(self._file.fields, self.path)

    @property
    def notes(self) -> list[str]:
        self.extra_files  # the tokenizer's note comes with its files
        return self._notes

    @functools.cached_property
    def extra_files(self) -> list[Path]:
        """The GGUF vocabulary as tokenizer files (and its chat template as chat_template.jinja)
        in a directory of our own, removed with this object; or none, with a note saying why.
        Built when first asked for: reading the config or the weights does not need it."""
        directory = Path(tempfile.mkdtemp(prefix="llama-bridge-gguf-tokenizer-"))
        weakref.finalize(self, _remove_tree, directory)
        files, note = tokenizer_files(self._file.fields, directory, self.path)
        if note:
            self._notes.append(note)
        if note and not files and "tokenizer.ggml.model" in self._file.fields:
            self.warnings = (f"{self.path}: {note}",)  # a vocabulary is there, not for us
        template = gguf_chat_template(self._file.fields, self.path)
        if template is not None:  # the chat template travels as transformers saves one
            files.append(directory / TEMPLATE_FILE)
            files[-1].write_text(template, encoding="utf-8")
            self._notes.append("chat template: tokenizer.chat_template")
        return files


def gguf_file_template(path: Path) -> ChatTemplate | None:
    """A GGUF file's own chat template (its tokenizer.chat_template key), or None."""
    return _template(read_gguf(path).fields, path)


def _template(fields: dict, path: Path) -> ChatTemplate | None:
    source = gguf_chat_template(fields, path)
    return None if source is None else ChatTemplate(source, f"{path}: tokenizer.chat_template")


def gguf_chat_template(fields: dict, where: Path) -> str | None:
    """A GGUF file's tokenizer.chat_template (Jinja source), or None when it has none."""
    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise BridgeError(f"{where}: tokenizer.chat_template is not a string")
    return template


def _remove_tree(directory: Path) -> None:
    import shutil
    shutil.rmtree(directory, ignore_errors=True)


def _gguf_version() -> str:
    from importlib import metadata
    return metadata.version("gguf")


def _readable(qtype) -> bool:
    """Whether tensors of GGML type `qtype` can be read: a float type, or one that gguf.quants
    dequantises (asked of gguf itself, on one block of zeros)."""
    import gguf

    if qtype.name in STORED_FLOATS:
        return True
    if qtype not in gguf.GGML_QUANT_SIZES:
        return False
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), qtype)
    except (NotImplementedError, ValueError, KeyError, TypeError):
        return False
    return True


def _as_array(file: GGUFFile, t: TensorInfo, qtype, rows: tuple[int, int] | None = None
              ) -> np.ndarray:
    """A fresh array in canonical (numpy) layout: float types as stored, every quantised type
    dequantised by gguf.quants into float32, a few rows at a time on the CPU's cores
    (bridge.parallel); `rows` (start, stop): those leading rows of a 2-D tensor alone."""
    import gguf

    raw = file.raw(t)
    if qtype.name in STORED_FLOATS:
        whole = raw.view(STORED_FLOATS[qtype.name]).reshape(t.shape)
        return np.array(whole if rows is None else whole[rows[0]:rows[1]])
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    row = t.shape[-1] if t.shape else 1
    blocks = raw.reshape(-1, row // block * size)  # (rows, bytes per row) of whole blocks
    shape = t.shape
    if rows is not None:
        blocks, shape = blocks[rows[0]:rows[1]], (rows[1] - rows[0], *t.shape[1:])
    out = np.empty((blocks.shape[0], row), np.float32)

    def dequantize(start: int, stop: int) -> None:
        chunk = blocks[start:stop]
        out[start:stop] = (_dequantize_plain(chunk, qtype.name) if qtype.name in _PLAIN
                           else _DEQUANTIZE_K[qtype.name](chunk) if qtype.name in _DEQUANTIZE_K
                           else gguf.quants.dequantize(chunk, qtype))

    by_chunks(dequantize, blocks.shape[0], _DEQUANT_CHUNK // row)
    first = 0 if rows is None else rows[0] * blocks.shape[1]  # blocks' bytes, dequantised
    file.release(t, first, first + blocks.size)
    return out.reshape(shape)


# bytes per block of 32 weights: the float16 fields (d; d and m), then the quantised weights
_PLAIN = {"Q8_0": (2, 34), "Q4_0": (2, 18), "Q4_1": (4, 20)}


def _dequantize_plain(rows: np.ndarray, kind: str) -> np.ndarray:
    """Rows of Q8_0, Q4_0 or Q4_1 blocks (uint8) -> float32 rows, gguf.quants.dequantize's numbers
    bit for bit (x d; d (q - 8); d q + m, each product and sum rounded to float32 as there), in
    whole-array passes: gguf's own goes a group of blocks at a time, 3-4x slower (2-core AMD
    EPYC Zen 4; tests/test_gguf.py holds them equal)."""
    head, size = _PLAIN[kind]
    blocks = rows.reshape(-1, size)
    fields = blocks[:, :head].copy().view(np.float16).astype(np.float32)  # (n, 1) or (n, 2)
    if kind == "Q8_0":
        w = blocks[:, head:].view(np.int8).astype(np.float32) * fields
    else:
        qs = blocks[:, head:]
        q = np.empty((blocks.shape[0], 32), np.uint8)
        q[:, :16], q[:, 16:] = qs & 0xF, qs >> 4  # byte j: weights j and j + 16
        if kind == "Q4_0":
            w = fields * (q.view(np.int8) - np.int8(8)).astype(np.float32)
        else:
            w = fields[:, :1] * q.astype(np.float32) + fields[:, 1:]
    return w.reshape(rows.shape[0], -1)


def _dequantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Rows of Q4_K super-blocks (ggml-common.h block_q4_K: float16 d and dmin, 12 bytes of 6-bit
    scales and minima, 128 of nibbles) -> float32 rows, gguf.quants.dequantize's numbers bit for
    bit (d sc_j q - dmin m_j, the product and the difference each rounded to float32), each pass
    written in place: 2.2x as fast as gguf's own (Intel Xeon, 2 cores; LLaMA 3 8B's Q4_K
    embedding is read so when it is made int8 rows)."""
    from .int4 import Q4_K_BYTES, q4_k_groups

    blocks = rows.reshape(-1, Q4_K_BYTES)
    n = blocks.shape[0]
    scale, minimum = q4_k_groups(blocks)  # (n, 8)
    qs = blocks[:, 16:].reshape(n, 4, 32)  # each 64 weights: the first 32's q in the low nibbles
    w = np.empty((n, 4, 2, 32), np.float32)
    np.bitwise_and(qs, np.uint8(0xF), out=w[:, :, 0], casting="unsafe")
    np.right_shift(qs, np.uint8(4), out=w[:, :, 1], casting="unsafe")
    w = w.reshape(n, 8, 32)
    w *= scale[..., None]
    w -= minimum[..., None]
    return w.reshape(rows.shape[0], -1)


def _dequantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Rows of Q6_K super-blocks (block_q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16
    int8 scales, float16 d) -> float32 rows, gguf.quants.dequantize's numbers bit for bit (d
    sc_j (q - 32), d sc_j rounded to float32 first): 1.5x as fast as gguf's own (Intel Xeon; the
    LM head of most Q4_K_M files)."""
    blocks = rows.reshape(-1, 210)
    n = blocks.shape[0]
    scale = (blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
             * blocks[:, 192:208].view(np.int8).astype(np.float32))  # (n, 16), 16 weights each
    # each half of 128 weights: 64 bytes of low nibbles (weights j, j + 64) and 32 of four 2-bit
    # highs (weights j, j + 32, j + 64, j + 96), in ggml's order
    low = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    high = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 4, 1)
    q = (low & np.uint8(0xF)).reshape(n, 16, 16) | ((high & np.uint8(3)) << np.uint8(4)).reshape(
        n, 16, 16)
    w = np.empty((n, 16, 16), np.float32)
    np.subtract(q.view(np.int8), np.int8(32), out=w, casting="unsafe")  # -32..31
    w *= scale[..., None]
    return w.reshape(rows.shape[0], -1)


_DEQUANTIZE_K = {"Q4_K": _dequantize_q4_k, "Q6_K": _dequantize_q6_k}


def _f32_value(value: float) -> float:
    """A float32 key as the shortest decimal that rounds to it (1e-05, not 9.99999974738e-06)."""
    return float(str(np.float32(value)))


def _config(path: Path, fields: dict, specs: dict, rope_freqs: np.ndarray | None,
            arch: str) -> LlamaConfig:
    """The LlamaConfig of the <arch>.* keys: the family the architecture is read as, with the
    deltas it holds (bridge.gguf.conventions.ARCHES)."""
    family, deltas = ARCHES[arch]

    def key(name: str, default=None):
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise BridgeError(f"{path}: key {arch}.{name} is missing")
        return value

    if fields.get(f"{arch}.expert_count", 0):
        raise BridgeError(f"{path}: {arch}.expert_count is {fields[f'{arch}.expert_count']}: a "
                          f"mixture-of-experts model, which LlamaConfig does not describe")
    scaling_type = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none" or fields.get(f"{arch}.rope.scaling.factor", 0.0) not in (0.0, 1.0):
        raise BridgeError(f"{path}: {arch}.rope.scaling.type {scaling_type!r} (factor "
                          f"{fields.get(f'{arch}.rope.scaling.factor')}) is not supported; only "
                          f"unscaled RoPE and LLaMA 3's rope_freqs are read")
    n_heads = key("attention.head_count")
    dim = key("embedding_length")
    head_dim = key("attention.key_length", key("rope.dimension_count", dim // max(n_heads, 1)))
    for name in ("attention.value_length", "rope.dimension_count"):
        if fields.get(f"{arch}.{name}", head_dim) != head_dim:
            raise BridgeError(f"{path}: {arch}.{name} is {fields[f'{arch}.{name}']}, but the head "
                              f"dim is {head_dim}; partial RoPE and unequal k/v heads are not "
                              f"supported")
    embedding = specs.get("tok_embeddings.weight")
    vocab = fields.get(f"{arch}.vocab_size") or (embedding[0][0] if embedding else None)
    theta = _f32_value(key("rope.freq_base", 10000.0))
    try:
        config = LlamaConfig(
            dim=dim, n_layers=key("block_count"), n_heads=n_heads,
            n_kv_heads=key("attention.head_count_kv", n_heads), ffn_dim=key("feed_forward_length"),
            vocab_size=vocab if vocab is not None else key("vocab_size"),
            max_seq_len=key("context_length"),
            norm_eps=_f32_value(key("attention.layer_norm_rms_epsilon")), rope_theta=theta,
            rope_scaling=_rope_scaling(path, fields, theta, head_dim, rope_freqs),
            tie_embeddings="output.weight" not in specs, head_dim=head_dim, family=family,
            **dict.fromkeys(deltas, True), **_token_ids(fields))
    except BridgeError as e:
        raise BridgeError(f"{path}: {e}") from None
    except TypeError as e:  # a key of the wrong type (a string where a number belongs)
        raise BridgeError(f"{path}: a {arch}.* key has the wrong type ({e})") from None
    if config.head_dim == config.dim // config.n_heads:
        config = config.replace(head_dim=None)
    return config


def _require_delta_tensors(path: Path, config: LlamaConfig, specs: dict, arch: str) -> None:
    """Refuse a file of an architecture with deltas (qwen2's biases, qwen3's head norms) that lacks
    one of their tensors, naming it as the file does."""
    suffixes = [s for s in layer_shapes(config) if s not in LAYER_SUFFIXES]
    for i in range(config.n_layers if suffixes else 0):
        for suffix in suffixes:
            if f"layers.{i}.{suffix}" not in specs:
                raise BridgeError(f"{path}: tensor {gguf_name(f'layers.{i}.{suffix}')!r} is "
                                  f"missing (a {arch} file holds {', '.join(ARCHES[arch][1])} "
                                  f"in every layer)")


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
