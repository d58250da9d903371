"""The floating-point dtypes this project stores and computes in: one table, by name.

numpy dtypes (bfloat16 through ml_dtypes); each twin turns a name into its own dtype object from
here (`jnp.dtype(numpy_dtype(x))`, `getattr(torch, dtype_name(x))`), so a name is accepted or
refused in the same words everywhere.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import BridgeError

DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32),
                               "bfloat16": np.dtype(ml_dtypes.bfloat16),
                               "float16": np.dtype(np.float16)}
DTYPE_NAMES = tuple(DTYPES)


def dtype_name(dtype, field: str = "dtype") -> str:
    """The table's name for a dtype given as a name ('bfloat16'), a numpy, JAX or torch dtype,
    or anything whose str() is 'torch.bfloat16'-like; BridgeError naming `field` otherwise."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
    if name not in DTYPES:
        raise BridgeError(f"expected one of {', '.join(DTYPE_NAMES)}, got {dtype!r}", field=field)
    return name


def numpy_dtype(dtype, field: str = "dtype") -> np.dtype:
    """The numpy dtype of `dtype` (see dtype_name)."""
    return DTYPES[dtype_name(dtype, field)]
