"""SRC -> DST in any pair of formats: detect, stream one tensor at a time, cast, shard, write atomically.

Peak memory is about one tensor (plus its cast copy when --dtype changes it), whatever the model
size: readers hand out one tensor at a time, writers lay out headers from shapes first.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .dtypes import DTYPE_NAMES, numpy_dtype
from .errors import BridgeError
from .formats import FORMATS, Checkpoint, open_checkpoint, write_checkpoint
from .formats.base import payload_bytes
from .formats.safetensors_dir import DEFAULT_MAX_SHARD_SIZE
from .progress import bar as progress_bar
from .int4 import int4_reader, int4_specs
from .quantize import SCALE_SUFFIX, Quantization, check_quantizable, quantized_specs

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000, '2GiB' -> 2 * 2**30, '1000' -> 1000 (Hugging Face's convention)."""
    if isinstance(text, int):
        size = text
    else:
        m = _SIZE.fullmatch(str(text))
        if not m:
            raise BridgeError(f"cannot read {text!r} as a size (e.g. 5GB, 500MB, 2GiB)",
                              field="max_shard_size")
        base = 1024 if m.group(3) else 1000
        size = int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))
    if size <= 0:
        raise BridgeError(f"must be positive (got {text!r})", field="max_shard_size")
    return size


def _check_paths(src: Path, dst: Path) -> None:
    src, dst = src.resolve(), dst.resolve()
    if dst == src or src in dst.parents:
        raise BridgeError(f"{dst}: the output may not be the input or lie inside it ({src})")
    if dst in src.parents:
        raise BridgeError(f"{dst}: the output may not contain the input ({src}); replacing it "
                          f"would delete the source")


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str = "native", *,
            from_format: str | None = None, dtype: str | None = None,
            max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, force: bool = False,
            progress: bool = True, quantize: str | None = None, group_size: int | None = None,
            **options) -> Path:
    """Convert the checkpoint at `src` (format detected unless `from_format`) to `to` at `dst`.

    dtype None keeps each tensor's stored dtype; "float32" / "bfloat16" / "float16" casts each
    tensor as it streams through (bfloat16 by ml_dtypes' round-to-nearest-even, as torch does).
    quantize "int8" (native only) stores the projections as int8 with float32 scales, per output
    channel or per `group_size` input columns (bridge.quantize); the rest takes `dtype`.
    `options` go to the writer (llama2c: version; meta: shards). Returns `dst`.
    """
    return stream_checkpoint(src, dst, to, from_format=from_format, dtype=dtype,
                             max_shard_size=max_shard_size, force=force, progress=progress,
                             quantize=quantize, group_size=group_size, **options)


Transform = Callable[[str, np.ndarray], np.ndarray]  # (canonical name, array) -> array


def stream_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, to: str = "native", *,
                      from_format: str | None = None, dtype: str | None = None,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, force: bool = False,
                      progress: bool = True, inputs: Iterable[str | os.PathLike] = (),
                      prepare: Callable[[Checkpoint], Transform] | None = None,
                      tokenizer: str | os.PathLike | None = None, quantize: str | None = None,
                      group_size: int | None = None, **options) -> Path:
    """`convert`, with each tensor passed through a transform before the cast: once the source
    is open and the destination checked, `prepare(ckpt)` returns the transform (name, array) ->
    array (same shape). `inputs` are other paths the transform reads, which `dst` may not
    overlap either. `tokenizer`: a tokenizer file to carry instead of the source's own (e.g. for
    a llama2.c checkpoint, which holds none). Returns `dst`."""
    src, dst = Path(src), Path(dst)
    if to not in FORMATS:
        raise BridgeError(f"unknown format {to!r}; known: {', '.join(FORMATS)}", field="to")
    if to == "gguf" and dtype is not None:
        # The GGUF writer casts each tensor itself (norms stay float32 whatever the file type).
        from .gguf.conventions import FILE_TYPES, LLAMA_CPP, gguf_dtype
        options["dtype"], dtype = gguf_dtype(dtype), None
        if FILE_TYPES[options["dtype"]][2] == LLAMA_CPP:  # refused now, before the source is read
            from .gguf.quantize import require_llama_cpp
            require_llama_cpp(options["dtype"])
            if not progress:  # quiet: no line for llama.cpp's stage either
                options["stage"] = lambda line: None
    if dtype is not None and dtype not in DTYPE_NAMES:
        from .gguf.conventions import DTYPE_ALIASES, FILE_TYPES
        if dtype in FILE_TYPES and dtype not in DTYPE_ALIASES.values():  # q8_0 ... q6_k
            raise BridgeError(f"{dtype} is a GGUF quantisation; only the gguf format holds it "
                              f"(got to={to!r})", field="dtype")
        raise BridgeError(f"expected one of {', '.join(DTYPE_NAMES)}, got {dtype!r}", field="dtype")
    if to == "llama2c" and dtype not in (None, "float32"):
        raise BridgeError(f"llama2.c .bin files hold float32 only (got {dtype})", field="dtype")
    max_shard_size = parse_size(max_shard_size)
    quantization = None
    if quantize is not None:
        quantization = Quantization(quantize, group_size)
        if to != "native":
            raise BridgeError(f"{quantize} weights are stored in the native format only, not "
                              f"{to}", field="quantize")
    elif group_size is not None:
        raise BridgeError("sets the int8 quantisation's groups", field="group_size",
                          hint=("quantize", "int8", "add {}"))
    ckpt = open_checkpoint(src, format=from_format)
    if ckpt.quantization is not None:
        raise BridgeError(f"{ckpt.path}: holds {ckpt.quantization.method}-quantised weights "
                          f"(config.json 'quantization'), which no conversion carries: convert "
                          f"the float checkpoint it was made from instead")
    if quantization is not None:
        check_quantizable(ckpt.config, quantization)
    for source in (ckpt.path, *map(Path, inputs)):
        _check_paths(source, dst)
    if (dst.exists() or dst.is_symlink()) and not force:
        raise BridgeError(f"{dst}: already exists", hint=("force", True, "use {} to replace it"))
    transform = None if prepare is None else prepare(ckpt)
    extra_files = list(ckpt.extra_files)
    if tokenizer is None:
        for warning in ckpt.warnings:
            print(f"warning: {warning}", file=sys.stderr)
    if tokenizer is not None:
        if not Path(tokenizer).is_file():
            raise BridgeError(f"{tokenizer}: no such file", field="tokenizer")
        kinds = {"tokenizer.model", "tokenizer.json", "tokenizer_config.json"}
        extra_files = [f for f in extra_files if Path(f).name not in kinds] + [Path(tokenizer)]
    if to in ("hf", "gguf"):  # read (and refused when it does not fit) before the progress bar
        from .formats.hf import source_tokenizer
        options["tokenizer"] = source_tokenizer(extra_files, ckpt.config)
    if to == "gguf" and "dtype" not in options:  # the source's dtype: float32 -> f32, ...
        options["dtype"] = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[ckpt.stored_dtype()]

    target = None if dtype is None else numpy_dtype(dtype)
    specs = {name: (shape, target or stored) for name, (shape, stored) in ckpt.specs.items()}
    four = None
    if quantization is not None and quantization.method == "int4":
        four = int4_reader(ckpt, lambda name: read(name), ckpt.config)
        specs, quantized = int4_specs(ckpt.config, specs, four)
        options["quantization"] = quantization
    elif quantization is not None:
        specs, quantized = quantized_specs(ckpt.config, quantization, specs)
        options["quantization"] = quantization

    reading = False  # so an OS error reading the source is not blamed on the destination

    def read(name: str) -> np.ndarray:
        nonlocal reading
        reading = True
        array = ckpt.tensor(name)
        reading = False
        return array if transform is None else transform(name, array)

    def fetch(name: str) -> np.ndarray:
        if four is not None:
            held = quantized(name)
            if held is not None:
                return held
        elif quantization is not None:
            if name in specs and specs[name][1] == np.int8:
                return quantized(name, read)[0]
            if name.endswith(SCALE_SUFFIX):
                return quantized(name[:-len(SCALE_SUFFIX)], read)[1]
        array = read(name)
        return array if target is None or array.dtype == target else array.astype(target)

    total = payload_bytes(specs)
    try:
        with progress_bar(total=total, unit="B", desc=f"{ckpt.format} -> {to}",
                          enabled=progress) as bar:
            written = write_checkpoint(to, dst, ckpt.config, specs, fetch,
                                       max_shard_size=max_shard_size, overwrite=force,
                                       progress=bar.update, extra_files=extra_files, **options)
        if four is not None and four.summary():  # what was read exactly, what quantised
            print(f"{ckpt.path}: {four.summary()}", file=sys.stderr)
        return written
    except OSError as e:
        # bridge.atomic names the destination for what it can explain: an errno, or a write that
        # failed on a full disk or past a file-size limit. What is left is a short write it cannot
        # (numpy's tofile reports only "N requested and M written"). The temporary is gone by now.
        if reading or e.errno is not None:
            raise
        raise BridgeError(f"{dst}: cannot write the output (short write: {e}); "
                          f"nothing was written") from None
