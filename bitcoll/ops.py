"""Reduction operations and the dtypes bitcoll accepts.

``ReduceOp`` names the element-wise reductions of the dense collectives. ``sum`` of integers
wraps around like numpy's; ``avg`` is defined for floating dtypes only (it is the sum divided
by the world size, computed once at each block's owner, so every rank gets identical bits).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import UsageError

__all__ = ["ReduceOp", "SUPPORTED_DTYPES", "FLOAT_DTYPES", "parse_op", "check_dtype",
           "reduce_into"]

FLOAT_DTYPES: frozenset[np.dtype[Any]] = frozenset(
    np.dtype(t) for t in (np.float16, np.float32, np.float64))
INT_DTYPES: frozenset[np.dtype[Any]] = frozenset(
    np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64,
                          np.uint8, np.uint16, np.uint32, np.uint64))
SUPPORTED_DTYPES: frozenset[np.dtype[Any]] = FLOAT_DTYPES | INT_DTYPES


class ReduceOp(str, enum.Enum):
    """Element-wise reduction of the dense collectives; plain strings are accepted too."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


_BY_NAME: dict[str, ReduceOp] = {o.value: o for o in ReduceOp}


def parse_op(op: ReduceOp | str) -> ReduceOp:
    """Return ``op`` as a ReduceOp; raise UsageError for an unknown name."""
    if isinstance(op, ReduceOp):
        return op
    if type(op) is str:
        hit = _BY_NAME.get(op)
        if hit is not None:
            return hit
    try:
        return ReduceOp(op.value if isinstance(op, ReduceOp) else str(op).lower())
    except ValueError:
        names = ", ".join(o.value for o in ReduceOp)
        raise UsageError(f"unknown reduction op {op!r}; expected one of {names}",
                         argument="op") from None


def check_dtype(dtype: np.dtype[Any], op: ReduceOp | None = None, name: str = "x") -> None:
    """Raise UsageError unless ``dtype`` (and the pair ``(op, dtype)``) is supported; ``name``:
    the argument whose dtype it is (the error's ``argument``; ``"op"`` for the pair)."""
    if dtype not in SUPPORTED_DTYPES:
        if dtype.byteorder not in ("=", "|") and dtype.newbyteorder("=") in SUPPORTED_DTYPES:
            raise UsageError(f"dtype {dtype.str} is not in this machine's byte order; convert "
                             f"it first, e.g. x.astype(x.dtype.newbyteorder('='))",
                             argument=name)
        names = ", ".join(sorted(d.name for d in SUPPORTED_DTYPES))
        raise UsageError(f"unsupported dtype {dtype}; bitcoll supports {names}", argument=name)
    if op is ReduceOp.AVG and dtype not in FLOAT_DTYPES:
        raise UsageError(f"op 'avg' is not defined for integer dtype {dtype}: use 'sum' and "
                         "divide, or convert to a floating dtype", argument="op")


_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}


def reduce_into(out: npt.NDArray[Any], a: npt.NDArray[Any], b: npt.NDArray[Any],
                op: ReduceOp) -> None:
    """``out = op(a, b)`` element-wise (avg accumulates a sum); ``out`` may be ``a`` or ``b``."""
    _UFUNCS[op](a, b, out=out)
