"""Quantizers of Lion's interpolation ``c`` into small integers (Lion Cub's "p-bit" votes).

``quantize(c, method, levels)`` maps a float tensor to int8 values in ``[-levels, levels]``;
the workers' integer vectors are then summed exactly (``comm.quantized_allreduce``) and the
update is the sign of the sum. Every method works on the whole tensor it is given (Lion Cub
quantizes each parameter tensor with its own scale). Formulas (``round`` is round half to
even, the multiplier is computed in float64 and rounded to float32 once, ``c * multiplier`` is
a float32 product):

``"sign"``
    ternary sign: ``q = sign(c)`` in {-1, 0, 1}; ``levels`` is validated but not used.
``"l1"``
    scale by the mean absolute value ``s = mean(|c|)``:
    ``q = clip(round(c * (levels / 2) / s), -levels, levels)``. An element of average
    magnitude maps to ``levels / 2``, so larger ones keep some resolution before clipping.
``"l0"``
    as ``"l1"`` with the geometric mean of the nonzero magnitudes,
    ``s = exp(mean(log|c_i|) over c_i != 0)``, which is less sensitive to outliers.
``"linf"``
    scale by the maximum magnitude ``s = max(|c|)``: ``q = round(c * levels / s)``; the
    largest element maps to ``+-levels`` and nothing is clipped.

A zero tensor (``s == 0``) gives zeros. A non-finite element in ``c`` raises ``UsageError``.

Default number of levels for ``p`` workers (:func:`default_levels`): ``floor(127 / p)`` so that
the exact sum of ``p`` votes fits int8 (the sum buffers stay one byte per element), capped at
:data:`MAX_DEFAULT_LEVELS` = 31 (more levels widen the votes on the wire, ``ceil(log2(2s+1))``
bits each, for little gain; 31 was the quality default in our simulations) and at least 1.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from bitcoll.errors import UsageError

from . import kernels

__all__ = ["METHODS", "MAX_LEVELS", "MAX_DEFAULT_LEVELS", "quantize", "default_levels",
           "check_levels", "check_method", "multiplier", "tensor_scale"]

METHODS = ("sign", "l1", "l0", "linf")
#: Votes are int8 on input: at most 127 levels.
MAX_LEVELS = 127
#: Cap of :func:`default_levels`.
MAX_DEFAULT_LEVELS = 31


def default_levels(world_size: int) -> int:
    """``clamp(floor(127 / world_size), 1, 31)``: see the module docstring."""
    if world_size < 1:
        raise UsageError(f"world size must be >= 1, got {world_size}", argument="world_size")
    return max(1, min(MAX_DEFAULT_LEVELS, MAX_LEVELS // world_size))


def check_levels(levels: object) -> int:
    """Return ``levels`` as an int in ``[1, 127]``; raise UsageError otherwise."""
    if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)):
        raise UsageError(f"levels must be an integer in [1, {MAX_LEVELS}], got {levels!r}",
                         argument="levels")
    if not 1 <= int(levels) <= MAX_LEVELS:
        raise UsageError(f"levels must be in [1, {MAX_LEVELS}], got {levels}", argument="levels")
    return int(levels)


def check_method(method: object) -> str:
    """Return ``method`` if it is one of :data:`METHODS`; raise UsageError otherwise."""
    if method not in METHODS:
        raise UsageError(f"unknown quantization method {method!r}; expected one of "
                         f"{', '.join(METHODS)}", argument="method")
    return str(method)


def multiplier(method: str, levels: int, scale: float) -> np.float32 | None:
    """The float32 factor ``q = round(c * factor)`` for a tensor of the given ``scale``, or
    None when the scale is 0 (the tensor quantizes to zeros)."""
    if scale == 0.0:
        return None
    num = float(levels) if method == "linf" else levels / 2.0
    mult = num / scale
    if not math.isfinite(mult):  # a denormal scale: every element is tiny, c/s is ~ +-1
        mult = float(np.finfo(np.float32).max)
    return kernels.f32(mult)


def tensor_scale(method: str, c: npt.NDArray[np.float32], abs_sum: float,
                 abs_max: float | None = None) -> float:
    """The scale ``s`` of one tensor (see the module docstring). ``abs_sum`` is ``sum|c|``
    as :func:`lioncub.kernels.abs_sum` computes it and ``abs_max`` is ``max|c|`` when known
    (the optimizer gets both for free from :func:`lioncub.kernels.direction_with_max`);
    "l0", and "linf" without ``abs_max``, read ``c`` once more."""
    if c.size == 0:
        return 0.0
    if method == "l1":
        return abs_sum / c.size
    if method == "linf":
        return kernels.abs_max(c) if abs_max is None else abs_max
    total, count = kernels.log_abs_sum(c)
    return 0.0 if count == 0 else math.exp(total / count)


def quantize(c: npt.NDArray[Any], method: str, levels: int,
             out: npt.NDArray[np.int8] | None = None) -> npt.NDArray[np.int8]:
    """Quantize the float array ``c`` into int8 votes in ``[-levels, levels]``.

    ``c``: a floating array of any shape (float32 is used as is; other float dtypes are
    converted). ``method``: "sign", "l1", "l0" or "linf" (formulas in the module docstring).
    ``levels``: int in [1, 127]. ``out``: optional int8 array of ``c``'s size (C-contiguous,
    writable); returned, shaped like ``c`` when allocated here.

    Raises UsageError for an unknown method, bad levels, a non-floating ``c``, a bad ``out``
    or a non-finite element of ``c``.

    >>> quantize(np.array([0.5, -1.0, 0.0, 2.5], np.float32), "l1", 4)
    array([ 1, -2,  0,  4], dtype=int8)
    """
    method = check_method(method)
    levels = check_levels(levels)
    if not isinstance(c, np.ndarray) or c.dtype.kind != "f":
        raise UsageError(f"c must be a floating numpy array, got "
                         f"{getattr(c, 'dtype', type(c).__name__)}", argument="c")
    flat = np.ascontiguousarray(c, dtype=np.float32).reshape(-1)
    if out is None:
        result = np.empty(c.shape, dtype=np.int8)
    else:
        if not isinstance(out, np.ndarray) or out.dtype != np.int8:
            raise UsageError("out must be an int8 numpy array", argument="out")
        if out.size != flat.size or not out.flags.c_contiguous or not out.flags.writeable:
            raise UsageError(f"out must be a writable C-contiguous int8 array of {flat.size} "
                             "elements", argument="out")
        result = out
    q = result.reshape(-1)
    if method == "sign":
        if not (kernels.quantize_sign(flat, q) and np.isfinite(kernels.abs_max(flat))):
            raise UsageError("c holds a non-finite value", argument="c")
        return result
    abs_sum = kernels.abs_sum(flat)
    if not math.isfinite(abs_sum):
        raise UsageError("c holds a non-finite value", argument="c")
    mult = multiplier(method, levels, tensor_scale(method, flat, abs_sum))
    if mult is None:
        q[:] = 0
    else:
        kernels.quantize_scaled(flat, mult, levels, q)
    return result
