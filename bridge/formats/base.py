"""What every format reader gives: a LlamaConfig and canonical tensors, one at a time.

A reader validates on open everything that can be checked without reading tensor data (config
against LlamaConfig's rules, each tensor's presence, shape and dtype against the config), so a
conversion that starts does not fail half-way for a reason that was visible up front.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from ..chat import TEMPLATE_FILE, ChatTemplate
from ..config import LlamaConfig
from ..errors import BridgeError
from ..locate import is_hub_blob
from ..quantize import (MIN_SUFFIX, OLD_INT4_SCALES, SCALE_SUFFIX, Quantization, checkpoint_shapes,
                        stored_dtype_of)
from ..tensors import LAYER_SUFFIXES, canonical_shapes
from ..tokenizer import Tokenizer


def check_inside(file: Path, directory: Path) -> Path:
    """`file`, refused when it is a link that resolves outside `directory` (a checkpoint must not
    make the reader open files elsewhere on the machine), unless it is a Hugging Face hub cache
    snapshot's link to its own repo's blob (bridge.locate.is_hub_blob)."""
    if not file.resolve().is_relative_to(directory.resolve()) and not is_hub_blob(file, directory):
        raise BridgeError(f"{file}: a link to {file.resolve()}, outside the checkpoint "
                          f"directory; refused")
    return file

FLOAT_DTYPES = {np.dtype(t) for t in (np.float32, np.float16, np.float64, ml_dtypes.bfloat16)}
# Files that travel with the weights between directory formats (tokenizers, generation defaults).
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json", TEMPLATE_FILE)

Spec = tuple[tuple[int, ...], np.dtype]  # (canonical shape, numpy dtype)


class Checkpoint:
    """A checkpoint opened for reading. Subclasses set the attributes and implement `tensor`."""

    format: str = "?"
    path: Path
    config: LlamaConfig
    specs: dict[str, Spec]   # canonical name -> (canonical shape, stored dtype), canonical order
    files: list[Path]        # the files holding the weights
    notes: list[str]         # things worth telling a user (inspect prints them)
    extra_files: list[Path]  # tokenizer files and the like, copied by conversions
    # int8 weight-only quantisation (bridge.quantize): the projections are int8 in `specs`, each
    # with its float32 `<name>_scale`; None for a float checkpoint (every format but native)
    quantization: Quantization | None = None
    # What a conversion must say about the source before it starts (a GGUF vocabulary that could
    # not be rebuilt, so that no tokenizer travels): read after `extra_files`
    warnings: tuple[str, ...] = ()
    # The tensor types as the file names them, with counts, most common first (GGUF: {"Q4_1":
    # 210, "F32": 61, "Q8_0": 1}); None where the stored dtypes say it all
    tensor_types: dict[str, int] | None = None

    def tensor(self, name: str) -> np.ndarray:
        """One tensor by canonical name, in canonical layout, as a fresh numpy array."""
        raise NotImplementedError

    # What a single-file checkpoint carries besides its weights, from what opening it read (so a
    # command that opened it hands it on rather than reading the file again): bridge.tokenizer's
    # find_tokenizer and bridge.chat's find_template take an opened checkpoint. None: the format
    # carries none, and they look beside the weights (a directory's tokenizer and template files).

    def stored_type(self, name: str) -> str | None:
        """The quantisation type the file holds the tensor in, as the format names it (a GGUF's
        "Q4_K", "Q8_0", ...); None for a float tensor (int8 checkpoints say so in
        `quantization`)."""
        return None

    def int4_tensor(self, name: str
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """The tensor in bridge.int4's layout (packed, scale, min; min None where it is -8 scale,
        a GGUF's Q4_0), where the file holds it in a 4-bit type that layout holds exactly (a
        GGUF's Q4_0 and Q4_1); None otherwise."""
        return None

    def int4_rounded(self, name: str):
        """The tensor in bridge.int4's layout with its 4-bit q as the file holds them and its
        scales and minima rounded to float16 (a GGUF's Q4_K): (packed, scale, min, the squared
        sums of the change and of the weights); None otherwise."""
        return None

    def int8_rows(self, name: str):
        """The tensor as int8 rows with one scale a row, made straight from the blocks the file
        holds (bridge.quantize.quantize_weight's numbers on the dequantised rows) where a
        compiled helper reads its type (a GGUF's Q8_0, Q4_0, Q6_K or Q4_K: bridge.gguf.native):
        (q, scale, the squared sums of the change and of the weights); None otherwise (the rows
        are then dequantised and quantised by numpy)."""
        return None

    def own_tokenizer(self) -> Tokenizer | None:
        """The vocabulary the checkpoint file itself holds (a GGUF file's), or None."""
        return None

    def own_template(self) -> ChatTemplate | None:
        """The chat template the checkpoint file itself holds (a GGUF file's), or None."""
        return None

    def tensor_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """tensor(name)[index] as a fresh array. This reads the whole tensor; the safetensors
        formats (native, HF) override it to read only the part asked for."""
        return np.ascontiguousarray(self.tensor(name)[index])

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        """(canonical name, array) pairs in canonical order, one tensor in memory at a time."""
        for name in self.specs:
            yield name, self.tensor(name)

    @property
    def nbytes(self) -> int:
        return payload_bytes(self.specs)

    def stored_dtype(self) -> str:
        """The dtype the tensors are stored in ('float32', 'bfloat16', 'float16'); 'float32' when
        they are mixed or wider, so that no tensor loses precision by default."""
        dtypes = {dtype.name for name, (_, dtype) in self.specs.items()
                  if dtype not in (np.int8, np.uint8) and not name.endswith(SCALE_SUFFIX)
                  and not name.endswith(MIN_SUFFIX)}
        return dtypes.pop() if len(dtypes) == 1 and dtypes <= {"bfloat16", "float16"} else "float32"


def payload_bytes(specs: dict[str, Spec], files: Iterable[Path] = ()) -> int:
    """The bytes of the tensors in `specs` as stored plus the sizes of `files`: the bulk of what
    a writer puts on disk. Headers and config files (a few kB) are left out, so that a free-space
    check against it (bridge.atomic.check_free_space) never refuses a write that fits."""
    return (sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in specs.values())
            + sum(Path(f).stat().st_size for f in files))


def check_specs(config: LlamaConfig, specs: dict[str, Spec], where: Path | str,
                source: str = "the config",
                quantization: Quantization | None = None) -> dict[str, Spec]:
    """Refuse a missing, extra, wrongly shaped or non-float tensor, naming the first one. With
    `quantization`, the projections must be int8, each followed by its float32 scale.

    Returns the specs in canonical order (a scale right after its weight)."""
    # n_layers comes from a file and may be a corrupt 10^9: find a missing tensor before the
    # full name table (one entry per tensor of every layer) is built.
    per_layer = canonical_shapes(config.replace(n_layers=1, tie_embeddings=True))
    if len(specs) < len(per_layer) + (config.n_layers - 1) * len(LAYER_SUFFIXES):
        for i in range(config.n_layers):
            for suffix in LAYER_SUFFIXES:
                if f"layers.{i}.{suffix}" not in specs:
                    raise BridgeError(f"{where}: tensor 'layers.{i}.{suffix}' is missing "
                                      f"({source} says n_layers={config.n_layers}, but "
                                      f"{len(specs)} tensors are stored)")
    expected = checkpoint_shapes(config, quantization)
    missing = [n for n in expected if n not in specs]
    if missing == ["tok_embeddings.weight" + SCALE_SUFFIX]:  # an int8 file before tied heads were
        raise BridgeError(f"{where}: tensor {missing[0]!r} is missing: the tied LM head (the "
                          f"embedding) is int8 too now; quantise the float checkpoint again")
    if missing:
        raise BridgeError(f"{where}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
    extra = sorted(n for n in specs if n not in expected)
    if extra:
        raise BridgeError(f"{where}: unexpected tensor {extra[0]!r} for {source} "
                          f"({len(extra)} unexpected in all)")
    for name, shape in expected.items():
        got, dtype = specs[name]
        if tuple(got) != shape:
            raise BridgeError(f"{where}: tensor '{name}' has shape {tuple(got)}, but {source} "
                              f"implies {shape}")
        held = None if quantization is None else stored_dtype_of(name, config, quantization)
        if held == np.float16 and np.dtype(dtype) == OLD_INT4_SCALES:
            held = OLD_INT4_SCALES  # a 4-bit checkpoint saved before float16 scales
        if held is not None:
            if np.dtype(dtype) != held and held == np.float32:
                raise BridgeError(f"{where}: tensor '{name}' has dtype {np.dtype(dtype)}, "
                                  f"expected float32 scales")
            if np.dtype(dtype) != held:
                raise BridgeError(f"{where}: tensor '{name}' has dtype {np.dtype(dtype)}, but "
                                  f"{source} declares {quantization.method} quantisation "
                                  f"({held})")
        elif np.dtype(dtype) not in FLOAT_DTYPES:
            raise BridgeError(f"{where}: tensor '{name}' has dtype {np.dtype(dtype)}, expected a "
                              f"floating type")
    return {name: (tuple(specs[name][0]), np.dtype(specs[name][1])) for name in expected}


def find_extra_files(directory: Path) -> list[Path]:
    return [directory / f for f in TOKENIZER_FILES if (directory / f).is_file()]
