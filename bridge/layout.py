"""How a load holds a checkpoint's weights, decided once, before any weight is read.

A checkpoint's projections (the layers' wq ... w3 and the LM head) can be held four ways:

    float    in the load's dtype (a GGUF's quantised tensors dequantised)
    int8     int8 with float32 scales, one per output channel or per group of inputs
             (bridge.quantize)
    int4     4-bit weights in groups of 32 inputs, a tied head as int8 rows (bridge.int4)
    stored   each tensor in the layout nearest the one its file stores (bridge.int4.nearest_reader:
             a GGUF's Q4_0 / Q4_1 as 4-bit weights exactly, Q5 ... Q8_0 as int8 rows)

decide_layout reads what the checkpoint stores (its declared quantisation, a GGUF's tensor types,
its config's shapes: nothing of the weights) and what the caller asks (`quantize`, `group_size`,
`dtype`, an adapter), and returns a Layout. Both twins' `load` act on it - `reader` says how each
weight is read, `after` whether the float model is quantised once whole - so a library caller and
every command get the same model from the same request. The commands pass their flags:
`--quantize int8|int4|stored|auto`, `--group-size`, `--dtype`, `--adapter`.

    quantize    a float or GGUF checkpoint                a native int8 / 4-bit checkpoint
    None        float                                     as stored
    "auto"      stored where a GGUF holds quantised       as stored
                tensors and neither dtype nor an adapter
                is given, else float
    "stored"    stored (a float file: float)              as stored
    "int8"      int8 (read so, or, with a group size or   int8: as stored; 4-bit: refused
                an adapter, quantised after)
    "int4"      int4                                      4-bit: as stored; int8: refused
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .dtypes import dtype_name
from .errors import BridgeError
from .quantize import INT4_GROUP, Quantization, check_quantizable

REQUESTS = ("int8", "int4", "stored", "auto")  # quantize=; None holds the weights as float
WEIGHTS = ("float", "int8", "int4", "stored")  # what a Layout holds


@dataclass(frozen=True)
class Layout:
    """How a load holds a checkpoint's weights (module docstring).

    weights: "float", "int8", "int4" or "stored". group_size: int8's (None: one scale per output
    channel), int4's 32, else None. after: quantised once the float model is whole (int8 in
    groups of inputs, or with an adapter merged in) rather than as each weight is read.
    dtype: the float tensors' dtype name, None as stored. native: the checkpoint holds these
    weights already (a native int8 or 4-bit checkpoint), read as they are. stored: for
    "stored", what becomes of the file's quantised tensors, (what, how many) pairs:
    (("Q4_1 -> int4 (exact)", 210), ("Q8_0 -> int8 rows", 1)).
    """

    weights: str = "float"
    group_size: int | None = None
    after: bool = False
    dtype: str | None = None
    native: bool = False
    stored: tuple[tuple[str, int], ...] = ()

    @property
    def quantization(self) -> Quantization | None:
        """What the loaded model's projections hold, where it is one Quantization (int8 or
        int4); None for float weights and for "stored" ones (a mixture, maybe)."""
        if self.weights in ("int8", "int4"):
            return Quantization(self.weights, self.group_size)
        return None

    def reader(self, checkpoint) -> Callable | None:
        """make(get) -> the bridge.int4 reader that hands each quantised weight to the load
        (QuantisedReader: quantised or read exactly as it is read; StoredReader: a native
        4-bit checkpoint's own), or None: every tensor read as the checkpoint gives it (the
        float model, or a native int8 checkpoint, whose scales are tensors of their own)."""
        from . import int4

        if self.native:
            return (lambda get: int4.StoredReader(checkpoint)) if self.weights == "int4" else None
        if self.after or self.weights == "float":
            return None
        make = {"int4": int4.int4_reader, "int8": int4.int8_reader,
                "stored": int4.nearest_reader}[self.weights]
        return lambda get: make(checkpoint, get, checkpoint.config)

    def describe(self, path) -> str | None:
        """One line for "stored": what each quantised type becomes, and how to dequantise."""
        if self.weights != "stored":
            return None
        return (f"{path}: read in its nearest quantised layout ("
                f"{', '.join(f'{n} {what}' for what, n in self.stored)}); --dtype float32 "
                f"dequantises")


def decide_layout(checkpoint, quantize: str | None = None, group_size: int | None = None,
                  dtype=None, adapter: bool = False, whole: str | None = None) -> Layout:
    """The Layout a load of `checkpoint` (bridge.formats: opened, nothing read) holds for the
    request: quantize (None, or one of REQUESTS), group_size (int8's; int4's can only be 32),
    dtype (a name or dtype of bridge.dtypes; None as stored), adapter (a LoRA adapter is merged
    in as the weights are read). whole: what the caller cannot combine with a reader that
    quantises as it reads (e.g. "scan_layers"), refused naming it. Refuses an unknown request,
    a group size without int8, a request the checkpoint's stored weights or shapes cannot
    satisfy, naming the field."""
    if quantize is not None and quantize not in REQUESTS:
        raise BridgeError(f"expected one of {', '.join(REQUESTS)} or None, got {quantize!r}",
                          field="quantize")
    dtype = None if dtype is None else dtype_name(dtype)
    if group_size is not None and quantize not in ("int8", "int4"):
        raise BridgeError("one scale per this many inputs of int8 weights",
                          field="group_size", hint=("quantize", "int8", "with {}"))
    if quantize == "int4" and group_size not in (None, INT4_GROUP):
        raise BridgeError(f"4-bit weights come in groups of {INT4_GROUP} inputs (got "
                          f"{group_size})", field="group_size")
    held = checkpoint.quantization
    if held is not None:
        return _as_stored(checkpoint, held, quantize, group_size, dtype, adapter, whole)
    if quantize == "auto":
        quantize = "stored" if dtype is None and not adapter else None
    if quantize is None:
        return Layout(dtype=dtype)
    if quantize == "int8":
        quantization = Quantization("int8", group_size)
        check_quantizable(checkpoint.config, quantization)
        after = group_size is not None or adapter
        if not after:
            _refuse(whole, quantize)
        return Layout("int8", group_size, after=after, dtype=dtype)
    _refuse("an adapter" if adapter else whole, quantize)
    if quantize == "int4":
        check_quantizable(checkpoint.config, Quantization("int4"))
        return Layout("int4", INT4_GROUP, dtype=dtype)
    from .int4 import quantised_layouts

    stored = tuple(quantised_layouts(checkpoint).items())
    return Layout("stored", dtype=dtype, stored=stored) if stored else Layout(dtype=dtype)


def _as_stored(checkpoint, held: Quantization, quantize, group_size, dtype, adapter,
               whole) -> Layout:
    """A native int8 or 4-bit checkpoint: read as it is stored, or refused."""
    method = held.method
    if quantize in ("int8", "int4") and quantize != method:
        raise BridgeError(f"{checkpoint.path} holds {method} weights", field="quantize",
                          hint=("quantize", quantize, "{} reads a float or GGUF checkpoint"))
    if group_size not in (None, held.group_size):
        raise BridgeError(f"{checkpoint.path} holds {method} weights quantised with group size "
                          f"{held.group_size}", field="group_size")
    if adapter:
        raise BridgeError(f"{checkpoint.path} holds {method} weights, which an adapter cannot be "
                          f"merged into: merge it into the float model, then quantise",
                          field="adapter")
    if method == "int4":
        _refuse(whole, quantize, checkpoint)
    return Layout(method, held.group_size, dtype=dtype, native=True)


def _refuse(unsupported: str | None, quantize: str | None, checkpoint=None) -> None:
    """Refuse a reader that quantises (or hands 4-bit weights) as it reads beside what the
    caller cannot combine with it, naming quantize where it was asked for."""
    field = "quantize" if quantize is not None else None
    if unsupported is None:
        return
    if checkpoint is not None:
        raise BridgeError(f"{checkpoint.path} holds 4-bit weights, which cannot be read with "
                          f"{unsupported}: use the float checkpoint it was made from",
                          field=field)
    raise BridgeError(f"{quantize} weights are read from a float or GGUF checkpoint without "
                      f"{unsupported}, for now", field=field)


def held_as(dtype) -> str:
    """What a weight held in `dtype` is: "int4" (uint8: two 4-bit weights a byte), "int8", or
    its float dtype's name - how a test or a report says what each twin's load made."""
    name = str(dtype).removeprefix("torch.")
    if name not in ("uint8", "int8"):
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    return {"uint8": "int4", "int8": "int8"}.get(name) or dtype_name(dtype)
