"""Fused element-wise kernels of the Lion family (numba, ``nogil``, compiled once and cached).

Every kernel works on 1-D C-contiguous arrays and states the numpy expression it computes.
All arithmetic is float32 with every operation rounded as numpy rounds it (no fused
multiply-add, no reassociation: the kernels are compiled without fast-math), so a kernel and
its numpy expression give identical bits. Scalars must be passed as ``numpy.float32``; callers
get them from :func:`f32`.

Reductions (sums of absolute values, of logarithms) accumulate in float64 in a fixed order
(blocks of :data:`BLOCK` elements, added in order) and are therefore deterministic, whatever
the number of threads. Inputs of at least :data:`PARALLEL_MIN_ELEMENTS` elements run on numba's
thread pool when it has more than one thread and no other thread of the process is using it
(``bitcoll.kernels.parallel_slot``); the results are the same bits either way. A returned
sum is non-finite exactly when an input element was non-finite (NaN or +-inf), which is how
callers detect bad gradients without another pass.

The kernels release the GIL, so a bucket can be computed while a collective of the
communicator's worker thread moves another bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt

from bitcoll.kernels import parallel_slot

__all__ = [
    "f32",
    "lion_step",
    "direction",
    "copy_checked",
    "abs_sum",
    "abs_max",
    "log_abs_sum",
    "quantize_scaled",
    "quantize_sign",
    "apply_sign",
    "apply_mean",
    "sign_into",
]

F32 = npt.NDArray[np.float32]
Int = npt.NDArray[Any]

_F = TypeVar("_F", bound=Callable[..., Any])


def _jit(func: _F) -> _F:
    """Compile with numba: no GIL, cached on disk, no fast-math (IEEE rounding per op)."""
    return cast(_F, numba.njit(nogil=True, cache=True, fastmath=False)(func))


def _jit_par(func: _F) -> _F:
    """:func:`_jit` with ``prange`` loops on numba's thread pool."""
    return cast(_F, numba.njit(nogil=True, cache=True, fastmath=False, parallel=True)(func))


#: Elements per block of the blocked reductions: a sum is the in-order float64 sum of its
#: blocks' sums, each block summed in four fixed lanes, whether the blocks run serially or
#: on several threads, so results never depend on the thread count.
BLOCK = 1 << 16
#: Smallest input that runs on numba's thread pool (when it has more than one thread).
PARALLEL_MIN_ELEMENTS = 1 << 17


def f32(x: float) -> np.float32:
    """``x`` rounded to float32: the only way scalars enter the kernels."""
    out: np.float32 = np.float32(x)
    return out


@_jit
def _lion_step(param: F32, grad: F32, has_grad: bool, mom: F32, lr: np.float32,
               decay: np.float32, b1: np.float32, a1: np.float32, b2: np.float32,
               a2: np.float32) -> None:
    for i in range(param.size):
        m = mom[i]
        g = grad[i] if has_grad else np.float32(0.0)
        c = m * b1 + g * a1
        t = param[i] * decay
        if c > 0:
            t = t - lr
        elif c < 0:
            t = t + lr
        param[i] = t
        mom[i] = m * b2 + g * a2


@_jit_par
def _lion_step_par(param: F32, grad: F32, has_grad: bool, mom: F32, lr: np.float32,
                   decay: np.float32, b1: np.float32, a1: np.float32, b2: np.float32,
                   a2: np.float32) -> None:
    nb = (param.size + BLOCK - 1) // BLOCK
    for b in numba.prange(nb):
        lo = b * BLOCK
        hi = min(param.size, lo + BLOCK)
        _lion_step(param[lo:hi], grad[lo:hi] if has_grad else grad, has_grad, mom[lo:hi], lr,
                   decay, b1, a1, b2, a2)


def lion_step(param: F32, grad: F32 | None, mom: F32, lr: np.float32, decay: np.float32,
              b1: np.float32, a1: np.float32, b2: np.float32, a2: np.float32) -> None:
    """One Lion update of ``param`` and ``mom`` in place (``grad=None``: a zero gradient).

    numpy equivalent (``a1 = 1 - b1``, ``a2 = 1 - b2``, ``decay = 1 - lr * weight_decay``)::

        c = mom * b1 + grad * a1
        param *= decay
        param -= lr * sign(c)
        mom[:] = mom * b2 + grad * a2
    """
    with parallel_slot(param.size, PARALLEL_MIN_ELEMENTS) as par:
        (_lion_step_par if par else _lion_step)(param, _ONE if grad is None else grad,
                                                grad is not None, mom, lr, decay, b1, a1, b2,
                                                a2)


@_jit
def _lanes_total(x: F32, n4: int, l0: float, l1: float, l2: float, l3: float) -> float:
    """Add ``|x[n4:]|`` (at most 3 elements, lanes 0, 1, 2) and combine the four lanes."""
    for i in range(n4, x.size):
        v = abs(x[i])
        if i == n4:
            l0 += v
        elif i == n4 + 1:
            l1 += v
        else:
            l2 += v
    return (l0 + l1) + (l2 + l3)


@_jit
def _direction(mom: F32, grad: F32, has_grad: bool, out: F32, b1: np.float32, a1: np.float32,
               b2: np.float32, a2: np.float32) -> tuple[float, np.float32]:
    # sum|c| in four float64 lanes (element i goes to lane i % 4), combined as
    # (l0 + l1) + (l2 + l3): a fixed order that the compiler can vectorize; max|c| alongside.
    n = mom.size
    l0 = 0.0
    l1 = 0.0
    l2 = 0.0
    l3 = 0.0
    x0 = np.float32(0.0)
    x1 = np.float32(0.0)
    n4 = n - n % 4
    for i in range(0, n4, 4):
        g0 = grad[i] if has_grad else np.float32(0.0)
        g1 = grad[i + 1] if has_grad else np.float32(0.0)
        g2 = grad[i + 2] if has_grad else np.float32(0.0)
        g3 = grad[i + 3] if has_grad else np.float32(0.0)
        m0 = mom[i]
        m1 = mom[i + 1]
        m2 = mom[i + 2]
        m3 = mom[i + 3]
        c0 = m0 * b1 + g0 * a1
        c1 = m1 * b1 + g1 * a1
        c2 = m2 * b1 + g2 * a1
        c3 = m3 * b1 + g3 * a1
        out[i] = c0
        out[i + 1] = c1
        out[i + 2] = c2
        out[i + 3] = c3
        l0 += abs(c0)
        l1 += abs(c1)
        l2 += abs(c2)
        l3 += abs(c3)
        x0 = max(x0, max(abs(c0), abs(c1)))
        x1 = max(x1, max(abs(c2), abs(c3)))
        mom[i] = m0 * b2 + g0 * a2
        mom[i + 1] = m1 * b2 + g1 * a2
        mom[i + 2] = m2 * b2 + g2 * a2
        mom[i + 3] = m3 * b2 + g3 * a2
    for i in range(n4, n):
        m = mom[i]
        g = grad[i] if has_grad else np.float32(0.0)
        out[i] = m * b1 + g * a1
        mom[i] = m * b2 + g * a2
        x0 = max(x0, abs(out[i]))
    return _lanes_total(out, n4, l0, l1, l2, l3), max(x0, x1)


@_jit
def _direction_blocks(mom: F32, grad: F32, has_grad: bool, out: F32, b1: np.float32,
                      a1: np.float32, b2: np.float32,
                      a2: np.float32) -> tuple[float, np.float32]:
    nb = (mom.size + BLOCK - 1) // BLOCK
    total = 0.0
    amax = np.float32(0.0)
    for b in range(nb):
        lo = b * BLOCK
        hi = min(mom.size, lo + BLOCK)
        t, m = _direction(mom[lo:hi], grad[lo:hi] if has_grad else grad, has_grad,
                          out[lo:hi], b1, a1, b2, a2)
        total += t
        amax = max(amax, m)
    return total, amax


@_jit_par
def _direction_blocks_par(mom: F32, grad: F32, has_grad: bool, out: F32, b1: np.float32,
                          a1: np.float32, b2: np.float32,
                          a2: np.float32) -> tuple[float, np.float32]:
    nb = (mom.size + BLOCK - 1) // BLOCK
    sums = np.empty(nb, np.float64)
    maxs = np.empty(nb, np.float32)
    for b in numba.prange(nb):
        lo = b * BLOCK
        hi = min(mom.size, lo + BLOCK)
        sums[b], maxs[b] = _direction(mom[lo:hi], grad[lo:hi] if has_grad else grad,
                                      has_grad, out[lo:hi], b1, a1, b2, a2)
    total = 0.0
    amax = np.float32(0.0)
    for b in range(nb):  # the serial kernel's order
        total += sums[b]
        amax = max(amax, maxs[b])
    return total, amax


def direction(mom: F32, grad: F32 | None, out: F32, b1: np.float32, a1: np.float32,
              b2: np.float32, a2: np.float32) -> float:
    """Write Lion's interpolation ``c`` into ``out``, advance ``mom``; return ``sum|c|``.

    numpy equivalent: ``out[:] = mom * b1 + grad * a1; mom[:] = mom * b2 + grad * a2;
    return float(np.abs(out).astype(np.float64).sum())`` (``grad=None``: zeros); the sum is
    accumulated in float64 in the fixed order of :func:`abs_sum`.
    """
    return direction_with_max(mom, grad, out, b1, a1, b2, a2)[0]


def direction_with_max(mom: F32, grad: F32 | None, out: F32, b1: np.float32,
                       a1: np.float32, b2: np.float32,
                       a2: np.float32) -> tuple[float, float]:
    """:func:`direction` that also returns ``max|c|`` (the same pass; 0 for an empty ``out``):
    ``(sum|c|, max|c|)``."""
    with parallel_slot(mom.size, PARALLEL_MIN_ELEMENTS) as par:
        total, amax = (_direction_blocks_par if par else _direction_blocks)(
            mom, _ONE if grad is None else grad, grad is not None, out, b1, a1, b2, a2)
    return float(total), float(amax)


@_jit
def _copy_checked(src: F32, dst: F32) -> float:
    total = 0.0
    for i in range(src.size):
        v = src[i]
        dst[i] = v
        total += v
    return total


def copy_checked(src: F32, dst: F32) -> bool:
    """``dst[:] = src``; return True when every element was finite."""
    return bool(np.isfinite(_copy_checked(src, dst)))


@_jit
def _abs_sum(x: F32) -> float:
    n = x.size
    l0 = 0.0
    l1 = 0.0
    l2 = 0.0
    l3 = 0.0
    n4 = n - n % 4
    for i in range(0, n4, 4):
        l0 += abs(x[i])
        l1 += abs(x[i + 1])
        l2 += abs(x[i + 2])
        l3 += abs(x[i + 3])
    return _lanes_total(x, n4, l0, l1, l2, l3)


@_jit
def _abs_sum_blocks(x: F32) -> float:
    total = 0.0
    for lo in range(0, x.size, BLOCK):
        total += _abs_sum(x[lo:lo + BLOCK])
    return total


def abs_sum(x: F32) -> float:
    """``sum(|x|)`` in float64, in the order :func:`direction` uses: per block of
    :data:`BLOCK` elements, element ``i`` goes to lane ``i % 4`` and the lanes combine as
    ``(l0 + l1) + (l2 + l3)``; the block sums are added in order."""
    return float(_abs_sum_blocks(x))


@_jit
def _abs_max(x: F32) -> np.float32:
    best = np.float32(0.0)
    for i in range(x.size):
        v = abs(x[i])
        if v > best:
            best = v
    out: np.float32 = best  # (numpy's stubs type ``abs`` as Any on Python 3.10)
    return out


def abs_max(x: F32) -> float:
    """``max(|x|)`` (0 for an empty or all-zero ``x``). The input must be finite."""
    return float(_abs_max(x))


_LOG_BLOCK = 256  # mantissas multiplied per logarithm: 4 chains of 64, product < 2**256


@_jit
def _log_abs_sum_exact(x: F32) -> tuple[float, int]:
    total = 0.0
    count = 0
    for i in range(x.size):
        v = x[i]
        if v != 0:
            total += np.log(np.float64(abs(v)))
            count += 1
    return total, count


@_jit
def _log_abs_sum(x: F32) -> tuple[float, int, int]:
    """``|x_i| = 2**e_i * m_i`` with ``m_i`` in [1, 2): the exponents are summed exactly as
    integers and the mantissas multiplied in float64 (4 independent chains; relative error
    ~1e-14), one logarithm per ``_LOG_BLOCK`` elements. Zeros contribute ``m = 1, e = 0``.
    Returns (total, count, subnormals seen); with subnormals use :func:`_log_abs_sum_exact`.
    """
    u = x.view(np.uint32)
    n = x.size
    nb = n - n % _LOG_BLOCK
    tmp = np.empty(_LOG_BLOCK, np.uint32)
    mant = tmp.view(np.float32)
    total = 0.0
    esum = 0
    count = 0
    sub = 0
    for b0 in range(0, nb, _LOG_BLOCK):
        for i in range(_LOG_BLOCK):
            bits = u[b0 + i] & np.uint32(0x7FFFFFFF)
            e = bits >> np.uint32(23)
            nz = np.uint32(bits != 0)
            sub += int(nz & np.uint32(e == 0))
            esum += int(e)
            count += int(nz)
            tmp[i] = (bits & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)
        a0 = 1.0
        a1 = 1.0
        a2 = 1.0
        a3 = 1.0
        for k in range(0, _LOG_BLOCK, 4):
            a0 *= np.float64(mant[k])
            a1 *= np.float64(mant[k + 1])
            a2 *= np.float64(mant[k + 2])
            a3 *= np.float64(mant[k + 3])
        total += np.log(a0 * a1 * a2 * a3)
    total += (esum - 127 * count) * np.log(2.0)
    for i in range(nb, n):
        v = x[i]
        if v != 0:
            total += np.log(np.float64(abs(v)))
            count += 1
    return total, count, sub


@_jit
def _log_abs_sum_blocks(x: F32) -> tuple[float, int, int]:
    total = 0.0
    count = 0
    sub = 0
    for lo in range(0, x.size, BLOCK):
        t, c, u = _log_abs_sum(x[lo:lo + BLOCK])
        total += t
        count += c
        sub += u
    return total, count, sub


@_jit_par
def _log_abs_sum_blocks_par(x: F32) -> tuple[float, int, int]:
    nb = (x.size + BLOCK - 1) // BLOCK
    totals = np.empty(nb, np.float64)
    counts = np.empty(nb, np.int64)
    subs = np.empty(nb, np.int64)
    for b in numba.prange(nb):
        totals[b], counts[b], subs[b] = _log_abs_sum(x[b * BLOCK:(b + 1) * BLOCK])
    total = 0.0
    for b in range(nb):  # the serial kernel's order
        total += totals[b]
    return total, int(counts.sum()), int(subs.sum())


def log_abs_sum(x: F32) -> tuple[float, int]:
    """``(sum(log|x_i|), count)`` over the nonzero entries of ``x`` (float64 logarithms;
    relative error ~1e-14 from the fast path, which covers every finite input without
    subnormals). ``x`` must be finite (the optimizer checks that before)."""
    with parallel_slot(x.size, PARALLEL_MIN_ELEMENTS) as par:
        total, count, subnormals = (_log_abs_sum_blocks_par if par else _log_abs_sum_blocks)(x)
    if subnormals:
        total, count = _log_abs_sum_exact(x)
    return float(total), int(count)


@_jit
def _quantize_scaled(c: F32, mult: np.float32, levels: np.int64, out: Int) -> None:
    hi = np.float32(levels)
    lo = -hi
    for i in range(c.size):
        out[i] = np.int8(np.rint(min(max(c[i] * mult, lo), hi)))


@_jit_par
def _quantize_scaled_par(c: F32, mult: np.float32, levels: np.int64, out: Int) -> None:
    for b in numba.prange((c.size + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        _quantize_scaled(c[lo:lo + BLOCK], mult, levels, out[lo:lo + BLOCK])


def quantize_scaled(c: F32, mult: np.float32, levels: int, out: Int) -> None:
    """``out[:] = rint(clip(c * mult, -levels, levels))`` as int8 (round half to even).

    Clipping before rounding equals clipping after it because ``levels`` is an integer.
    ``c`` must be finite; ``1 <= levels <= 127``.
    """
    with parallel_slot(c.size, PARALLEL_MIN_ELEMENTS) as par:
        (_quantize_scaled_par if par else _quantize_scaled)(c, mult, np.int64(levels), out)


@_jit
def _quantize_sign(c: F32, out: Int) -> int:
    bad = 0
    for i in range(c.size):
        v = c[i]
        if v > 0:
            out[i] = 1
        elif v < 0:
            out[i] = -1
        else:
            out[i] = 0
            if v != v:
                bad += 1
    return bad


def quantize_sign(c: F32, out: Int) -> bool:
    """``out[:] = sign(c)`` as int8 (sign(0) = 0); return False when ``c`` held a NaN."""
    return int(_quantize_sign(c, out)) == 0


@_jit
def _apply_sign(param: F32, s: Int, lr: np.float32, decay: np.float32) -> int:
    total = 0
    for i in range(param.size):
        v = np.int64(s[i])
        sgn = np.int64(v > 0) - np.int64(v < 0)
        # t - lr * 1, t - lr * (-1) and t - lr * 0 round exactly like t - lr, t + lr and t
        param[i] = param[i] * decay - lr * np.float32(sgn)
        total += int(abs(v))
    return total


@_jit_par
def _apply_sign_par(param: F32, s: Int, lr: np.float32, decay: np.float32) -> int:
    total = 0
    for b in numba.prange((param.size + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        total += _apply_sign(param[lo:lo + BLOCK], s[lo:lo + BLOCK], lr, decay)
    return total


def apply_sign(param: F32, s: Int, lr: np.float32, decay: np.float32) -> int:
    """``param[:] = param * decay - lr * sign(s)`` for an integer ``s``; return ``sum|s|``.

    ``x - lr * (-1)`` and ``x + lr`` round identically, so this equals the numpy expression.
    """
    with parallel_slot(param.size, PARALLEL_MIN_ELEMENTS) as par:
        return int((_apply_sign_par if par else _apply_sign)(param, s, lr, decay))


@_jit
def _sign_into(s: Int, out: F32) -> int:
    total = 0
    for i in range(s.size):
        v = np.int64(s[i])
        out[i] = np.float32(np.int64(v > 0) - np.int64(v < 0))
        total += int(abs(v))
    return total


@_jit_par
def _sign_into_par(s: Int, out: F32) -> int:
    total = 0
    for b in numba.prange((s.size + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        total += _sign_into(s[lo:lo + BLOCK], out[lo:lo + BLOCK])
    return total


def sign_into(s: Int, out: F32) -> int:
    """``out[:] = numpy.sign(s)`` (float32, ``+0.0`` where ``s`` is 0) for an integer ``s`` of
    the same length; return ``sum|s|``: one pass where numpy makes three."""
    with parallel_slot(s.size, PARALLEL_MIN_ELEMENTS) as par:
        return int((_sign_into_par if par else _sign_into)(s, out))


@_jit
def _apply_mean(param: F32, s: Int, lr: np.float32, decay: np.float32,
                p: np.float32) -> int:
    total = 0
    for i in range(param.size):
        v = s[i]
        u = np.float32(v) / p
        param[i] = param[i] * decay - lr * u
        total += abs(v)
    return total


def apply_mean(param: F32, s: Int, lr: np.float32, decay: np.float32, p: np.float32) -> int:
    """``param[:] = param * decay - lr * (s / p)`` in float32 for an integer ``s`` (the mean
    of ``p`` votes, not re-signed); return ``sum|s|``."""
    return int(_apply_mean(param, s, lr, decay, p))


_ONE = np.ones(1, dtype=np.float32)  # placeholder array for grad=None
