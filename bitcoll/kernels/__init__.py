"""Packed-bit kernels: signs, votes, majorities and fixed-width integer fields.

Everything here works on 1-D C-contiguous numpy arrays (``count_votes`` and ``majority`` take
one 2-D C-contiguous ``uint8[p, nbytes]`` array, one packed vote vector per row) and returns
numpy arrays. The work is done by numba kernels (:mod:`bitcoll.kernels.bits`) that are compiled
on first use, cached on disk and run without the GIL, so a caller thread can pack or count
while another thread moves bytes. Plain numpy twins live in :mod:`bitcoll.kernels.reference`.

Layout
------
* **Bits.** Bit ``i`` of a packed vector is element ``i``; bits are little-endian within each
  byte (bit ``i`` is ``(buf[i // 8] >> (i % 8)) & 1``), exactly
  ``numpy.packbits(bits, bitorder="little")``. ``n`` bits take ``ceil(n / 8)`` bytes.
* **Fields.** A ``w``-bit field stream puts element ``i`` at stream bits ``[i*w, (i+1)*w)``,
  stream bit ``j`` being bit ``j % 8`` of byte ``j // 8``, the field's least significant bit
  first. ``n`` fields take ``packed_nbytes(n, w) = ceil(n * w / 8)`` bytes.
* **Padding** bits after the last element are always written as 0, and padding bits of inputs
  are ignored.

Votes
-----
``x > 0``, ``x == +0.0`` and ``x == -0.0`` vote +1 (bit 1), ``x < 0`` votes -1 (bit 0). A NaN
raises :class:`~bitcoll.errors.UsageError` ``"NaN in vote input at index i"`` (``i`` the first
NaN), found in the packing pass itself; ``out`` may then be partly written.

Common rules
------------
* ``out=`` is an optional preallocated result: a writeable 1-D C-contiguous array with exactly
  the documented dtype and length, otherwise :class:`~bitcoll.errors.UsageError`. Every
  function returns its result array (``out`` when given).
* Inputs of the wrong type, dtype, dimension, length or layout raise
  :class:`~bitcoll.errors.UsageError`; inputs are never copied or converted silently.
* Inputs of at least :data:`PARALLEL_MIN_ELEMENTS` elements run on numba's thread pool when it
  has more than one thread (see :func:`set_num_threads`; ``NUMBA_NUM_THREADS`` sets the pool
  size) and no other thread is using it; the result is identical either way.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from numba import get_num_threads as _nb_get_num_threads
from numba import set_num_threads as _nb_set_num_threads

from ..errors import UsageError
from ..topology import usable_cores
from . import bits as _k

__all__ = [
    "TIE_POSITIVE",
    "TIE_NEGATIVE",
    "TIE_ALTERNATE",
    "PARALLEL_MIN_ELEMENTS",
    "parallel_slot",
    "MAX_FIELD_WIDTH",
    "int_range",
    "packed_nbytes",
    "pack_signs",
    "unpack_signs",
    "count_votes",
    "count_planes",
    "majority",
    "majority_of_counts",
    "SignVotes",
    "pack_fields",
    "unpack_fields",
    "add_fields",
    "sum_sign_fields",
    "SUM_SIGN_WORDS_LIMIT",
    "pack_ternary",
    "extract_bits",
    "insert_bits",
    "first_field_above",
    "bf16_to_float32",
    "float32_to_bf16",
    "get_num_threads",
    "set_num_threads",
    "fit_threads_to_host",
    "usable_cores",
]

TIE_POSITIVE = 0
"""Tie rule: a tied element (2c == p) becomes +1 (bit 1)."""
TIE_NEGATIVE = 1
"""Tie rule: a tied element becomes -1 (bit 0)."""
TIE_ALTERNATE = 2
"""Tie rule: a tied element ``i`` becomes +1 if ``i + tie_offset`` is even, else -1."""

PARALLEL_MIN_ELEMENTS = 1 << 20
"""Inputs with at least this many elements may use the parallel kernels."""

MAX_FIELD_WIDTH = 16
"""The widest field :func:`pack_fields` and friends support, in bits."""

SUM_SIGN_WORDS_LIMIT: int = _k.SUM_SIGN_LANES16_LIMIT
""":func:`sum_sign_fields` works in 64-bit words while ``rows * (2**width - 1)`` is below
this (2-bit fields of up to 42 rows in 8-bit lanes, 32 elements a word: about 4x the speed
of unpacking, adding and packing; others in 16-bit lanes, 8 elements per two words); beyond
it, element by element."""

_CHUNK_ELEMENTS = 1 << 18  # elements per parallel work item

_FLOAT_BITS: dict[np.dtype[Any], tuple[type[np.unsignedinteger[Any]], int, int, int]] = {
    # float dtype -> (unsigned view, sign bit, all bits but sign, bits of +inf)
    np.dtype(np.float16): (np.uint16, 0x8000, 0x7FFF, 0x7C00),
    np.dtype(np.float32): (np.uint32, 0x8000_0000, 0x7FFF_FFFF, 0x7F80_0000),
    np.dtype(np.float64): (np.uint64, 1 << 63, (1 << 63) - 1, 0x7FF0_0000_0000_0000),
}

_UNSIGNED_OF_SIZE: dict[int, type[np.unsignedinteger[Any]]] = {
    1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64,
}

_INT_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64,
                                          np.uint8, np.uint16, np.uint32, np.uint64))
_SIGN_OUT_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64,
                                               np.float16, np.float32, np.float64))
_FIELD_OUT_DTYPES: tuple[np.dtype[Any], ...] = (*_INT_DTYPES, np.dtype(np.float32),
                                                np.dtype(np.float64))
_ACC_DTYPES = tuple(np.dtype(t) for t in (np.int16, np.int32, np.int64))

_ALL64 = (1 << 64) - 1
_EVEN_BITS = 0x5555_5555_5555_5555

# The small-call fast paths of pack_signs, majority and unpack_signs (a sign all-reduce of a
# few thousand elements runs each once: their argument checks cost more than their work).
_U8 = np.dtype(np.uint8)
#: float dtype -> (unsigned view, its sign bit, all bits but sign, bits of +inf), typed.
_FLOAT_MASKS = {dt: (ut, ut(sign), ut(absm), ut(inf))
                for dt, (ut, sign, absm, inf) in _FLOAT_BITS.items()}
#: (odd p or tie, tie_offset parity) -> the majority kernel's tie mask, typed.
_TIE_MASKS = {(TIE_NEGATIVE, 0): np.uint64(0), (TIE_NEGATIVE, 1): np.uint64(0),
              (TIE_POSITIVE, 0): np.uint64(_ALL64), (TIE_POSITIVE, 1): np.uint64(_ALL64),
              (TIE_ALTERNATE, 0): np.uint64(_EVEN_BITS),
              (TIE_ALTERNATE, 1): np.uint64(_EVEN_BITS << 1)}
_NO_SHIFTS: dict[int, npt.NDArray[np.int64]] = {}  # p -> zeros(p): one vote per row


def _no_shifts(p: int) -> npt.NDArray[np.int64]:
    """``zeros(p)`` (int64), cached: the shifts of ``p`` rows of one vote each."""
    shifts = _NO_SHIFTS.get(p)
    if shifts is None:
        shifts = _NO_SHIFTS.setdefault(p, np.zeros(p, np.int64))
    return shifts


def _vote_counter(p: int) -> tuple[int, int]:
    """The majority kernels' vertical counter for ``p`` votes: ``(planes, init)``, with
    ``2**(planes - 1) > p`` and the counter started at ``init`` so that its top plane is set
    exactly where more than half of the votes are +1."""
    top = p.bit_length()
    return top + 1, (1 << top) - (p // 2 + 1)
#: output dtype -> (unsigned view, raw bits of +1, raw bits of -1), typed (scale 1).
_UNIT_SIGNS: dict[np.dtype[Any], tuple[Any, Any, Any]] = {}

_pool_lock = threading.Lock()


# --------------------------------------------------------------------------------------------
# Threads and dispatch
# --------------------------------------------------------------------------------------------


#: Threads of the parallel kernels in this process (every thread that runs them), once
#: :func:`set_num_threads` or :func:`fit_threads_to_host` chose it; None: numba's own count.
_process_threads: int | None = None
_explicit_threads = False


def get_num_threads() -> int:
    """The number of threads the parallel kernels use (process-wide once
    :func:`set_num_threads` or ``bitcoll.init`` chose it, else numba's count for the calling
    thread)."""
    return _process_threads if _process_threads is not None else int(_nb_get_num_threads())


def set_num_threads(n: int) -> None:
    """Use ``n`` threads for the parallel kernels (1 = always serial), from every thread of
    this process that runs them (the collectives' helper threads too). ``bitcoll.init`` then
    keeps it (see :func:`fit_threads_to_host`).

    ``n`` must lie in ``[1, NUMBA_NUM_THREADS]``, else :class:`UsageError`.
    """
    global _process_threads, _explicit_threads
    k = _as_int(n, "n")
    try:
        _nb_set_num_threads(k)
    except ValueError as exc:
        raise UsageError(str(exc), argument="n") from exc
    _process_threads, _explicit_threads = k, True


def fit_threads_to_host(local_size: int) -> int:
    """Share the host's cores among the ``local_size`` ranks that run on it: the parallel
    kernels of this process use ``max(1, usable_cores() // local_size)`` threads (at most
    numba's count for the calling thread: its pool unless changed), unless
    ``NUMBA_NUM_THREADS`` is set in the environment or :func:`set_num_threads` was called,
    which win. ``bitcoll.init`` calls it with the
    world's ranks per host: without it, every rank of a host would start as many kernel
    threads as the host has cores (4 ranks on 2 cores: a 64M-element majority took 5x as
    long). Returns the count in use."""
    global _process_threads
    if not _explicit_threads and "NUMBA_NUM_THREADS" not in os.environ:
        share = max(1, usable_cores() // max(1, int(local_size)))
        _process_threads = min(share, int(_nb_get_num_threads()))
    return get_num_threads()


@contextlib.contextmanager
def parallel_slot(n: int, min_elements: int | None = None) -> Iterator[bool]:
    """Yield whether a kernel over ``n`` elements should use numba's thread pool now: True
    when ``n >= min_elements`` (default :data:`PARALLEL_MIN_ELEMENTS`), more than one thread
    is configured (:func:`get_num_threads`; the calling thread then runs on that many) and
    no other thread of this process is using the pool (numba's pool must
    not be entered from two threads at once; the loser runs serially). The pool stays
    reserved until the ``with`` block ends. For other packages' numba kernels too (lioncub).
    """
    limit = PARALLEL_MIN_ELEMENTS if min_elements is None else min_elements
    if n < limit:  # (asking numba for its thread count costs more than a small kernel)
        yield False
        return
    threads = _process_threads if _process_threads is not None else _nb_get_num_threads()
    if threads > 1 and _pool_lock.acquire(blocking=False):
        try:
            if _process_threads is not None and _nb_get_num_threads() != _process_threads:
                _nb_set_num_threads(_process_threads)  # numba's count is per thread
            yield True
        finally:
            _pool_lock.release()
    else:
        yield False


def _dispatch(n: int, serial: Callable[..., int], parallel: Callable[..., int],
              args: tuple[Any, ...], chunk: int) -> int:
    """Run ``serial(*args)`` or, for large inputs with a free thread pool,
    ``parallel(*args, chunk)``."""
    if n < PARALLEL_MIN_ELEMENTS:
        return int(serial(*args))
    with parallel_slot(n) as par:
        return int(parallel(*args, max(1, chunk)) if par else serial(*args))


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def int_range(dt: np.dtype[Any]) -> tuple[int, int]:
    """``(min, max)`` of the integer dtype ``dt`` (``np.iinfo`` costs microseconds to build:
    once per dtype)."""
    info = np.iinfo(dt)
    return int(info.min), int(info.max)


def _as_int(v: object, name: str) -> int:
    if type(v) is int:
        return v
    if isinstance(v, (bool, np.bool_)):
        raise UsageError(f"{name} must be an integer, got {v!r}", argument=name)
    try:
        return operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        raise UsageError(f"{name} must be an integer, got {v!r}", argument=name) from None


def _length(n: object) -> int:
    k = _as_int(n, "n")
    if k < 0:
        raise UsageError(f"n must be >= 0, got {k}", argument="n")
    return k


def _width(width: object) -> int:
    w = _as_int(width, "width")
    if not 1 <= w <= MAX_FIELD_WIDTH:
        raise UsageError(f"width must be in [1, {MAX_FIELD_WIDTH}], got {w}", argument="width")
    return w


def _vector(a: object, name: str, dtypes: tuple[np.dtype[Any], ...],
            ndim: int = 1) -> npt.NDArray[Any]:
    if not isinstance(a, np.ndarray):
        raise UsageError(f"{name} must be a numpy array, got {type(a).__name__}", argument=name)
    if a.ndim != ndim:
        raise UsageError(f"{name} must be {ndim}-D, got shape {a.shape}", argument=name)
    if a.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise UsageError(f"{name} has dtype {a.dtype}; expected one of: {allowed}", argument=name)
    if not a.flags.c_contiguous:
        raise UsageError(f"{name} must be C-contiguous", argument=name)
    return a


def _out(out: object, dtype: np.dtype[Any], size: int, name: str = "out") -> npt.NDArray[Any]:
    """A fresh result array, or ``out`` checked to be exactly ``dtype[size]``."""
    if out is None:
        return np.empty(size, dtype=dtype)
    if not isinstance(out, np.ndarray):
        raise UsageError(f"{name} must be a numpy array, got {type(out).__name__}", argument=name)
    if out.dtype != dtype or out.shape != (size,):
        raise UsageError(f"{name} must be {dtype}[{size}], got {out.dtype}{list(out.shape)}",
                         argument=name)
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise UsageError(f"{name} must be writeable and C-contiguous", argument=name)
    return out


def _out_dtype(dtype: npt.DTypeLike, allowed: Sequence[np.dtype[Any]]) -> np.dtype[Any]:
    """``dtype`` as a numpy dtype, checked to be one of ``allowed``."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise UsageError(f"invalid dtype {dtype!r}", argument="dtype") from exc
    if dt not in allowed:
        raise UsageError(f"dtype {dt} not supported; expected one of: "
                         f"{', '.join(str(d) for d in allowed)}", argument="dtype")
    return dt


def _bits_input(bits: object, nbytes: int, name: str) -> npt.NDArray[np.uint8]:
    b = _vector(bits, name, (np.dtype(np.uint8),))
    if b.size != nbytes:
        raise UsageError(f"{name} must hold exactly {nbytes} bytes, got {b.size}", argument=name)
    return b


def _votes_input(packed: object, n: int) -> npt.NDArray[np.uint8]:
    a = _vector(packed, "packed", (np.dtype(np.uint8),), ndim=2)
    if a.shape[1] != packed_nbytes(n):
        raise UsageError(f"packed must have {packed_nbytes(n)} bytes per row for n={n}, "
                         f"got shape {a.shape}", argument="packed")
    return a


def _float_input(x: object) -> tuple[npt.NDArray[Any], tuple[Any, Any, Any]]:
    """The unsigned view of a float vote vector and its (sign, absm, inf) masks."""
    a = _vector(x, "x", tuple(_FLOAT_BITS))
    ut, sign, absm, inf = _FLOAT_BITS[a.dtype]
    return a.view(ut), (ut(sign), ut(absm), ut(inf))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def packed_nbytes(n: int, width: int = 1) -> int:
    """Bytes taken by ``n`` packed elements of ``width`` bits: ``ceil(n * width / 8)``.

    ``n >= 0`` and ``width >= 1`` (any width: this is also used to size wider fields),
    else :class:`UsageError`.
    """
    if type(n) is int and type(width) is int and n >= 0 and width >= 1:
        return (n * width + 7) // 8  # the common case, checked without calls
    k = _length(n)
    w = _as_int(width, "width")
    if w < 1:
        raise UsageError(f"width must be >= 1, got {w}", argument="width")
    return (k * w + 7) // 8


def pack_signs(x: npt.NDArray[np.floating[Any]],
               out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
    """Pack the sign votes of ``x`` (float16/32/64 of length n) into ``uint8[ceil(n/8)]``.

    Bit i is 1 iff ``x[i] >= 0`` (``+0.0`` and ``-0.0`` vote +1), 0 iff ``x[i] < 0``.
    Raises :class:`UsageError` on a NaN (naming the first NaN's index) or bad arguments.
    """
    if type(x) is np.ndarray and type(out) is np.ndarray:  # the common case, checked inline
        typed = _FLOAT_MASKS.get(x.dtype)
        n = x.size
        if typed is not None and n < PARALLEL_MIN_ELEMENTS and x.ndim == 1 and \
                out.ndim == 1 and out.dtype == _U8 and out.size == (n + 7) // 8 and \
                x.flags.c_contiguous and (flags := out.flags).c_contiguous and flags.writeable:
            ut, sign, absm, inf = typed
            err = _k.pack_votes_serial(x.view(ut), out, sign, absm, inf, False)
            if err >= 0:
                raise UsageError(f"NaN in vote input at index {err}", argument="x",
                                 index=int(err))
            return out
    u, masks = _float_input(x)
    n = u.size
    res = _out(out, np.dtype(np.uint8), packed_nbytes(n))
    err = _dispatch(n, _k.pack_votes_serial, _k.pack_votes_parallel, (u, res, *masks, False),
                    _CHUNK_ELEMENTS // _k.BLOCK)
    if err >= 0:
        raise UsageError(f"NaN in vote input at index {err}", argument="x", index=int(err))
    return res


def pack_ternary(x: npt.NDArray[np.floating[Any]],
                 out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
    """Pack ``sign(x) + 1`` as 2-bit fields (the field layout, width 2, bias 1).

    Field i is 0 for ``x[i] < 0``, 1 for ``x[i] == 0`` (either sign of zero), 2 for
    ``x[i] > 0``; the result is ``uint8[ceil(n/4)]``, readable with
    ``unpack_fields(..., width=2, bias=1)``. Raises :class:`UsageError` on a NaN (naming the
    first NaN's index) or bad arguments.
    """
    u, masks = _float_input(x)
    n = u.size
    res = _out(out, np.dtype(np.uint8), packed_nbytes(n, 2))
    err = _dispatch(n, _k.pack_votes_serial, _k.pack_votes_parallel, (u, res, *masks, True),
                    _CHUNK_ELEMENTS // _k.BLOCK)
    if err >= 0:
        raise UsageError(f"NaN in vote input at index {err}", argument="x", index=int(err))
    return res


def unpack_signs(bits: npt.NDArray[np.uint8], n: int, out: npt.NDArray[Any] | None = None,
                 dtype: npt.DTypeLike = np.int8, scale: float = 1.0) -> npt.NDArray[Any]:
    """Expand ``n`` packed sign bits: element i = ``+scale`` if bit i else ``-scale``.

    ``bits`` is ``uint8[ceil(n/8)]``. ``dtype`` is one of int8/16/32/64, float16/32/64 and
    ``out``, when given, must be exactly ``dtype[n]``. ``scale`` may be negative (e.g.
    ``-lr`` writes ``-lr * sign`` directly); for integer dtypes it must be an integer with
    ``+scale`` and ``-scale`` both representable, for float dtypes it must be finite in
    ``dtype``. Violations raise :class:`UsageError`.
    """
    if type(bits) is np.ndarray and type(out) is np.ndarray and type(n) is int and \
            0 <= n < PARALLEL_MIN_ELEMENTS and type(scale) in (int, float) and scale == 1:
        # the common case (an int8 +-1 result), checked inline
        dt = out.dtype
        unit = _UNIT_SIGNS.get(dt)
        if unit is not None and (dtype is dt or dtype is dt.type) and bits.ndim == 1 and \
                bits.dtype == _U8 and bits.size == (n + 7) // 8 and out.ndim == 1 and \
                out.size == n and bits.flags.c_contiguous and \
                (flags := out.flags).c_contiguous and flags.writeable:
            ut, pos1, neg1 = unit
            _k.unpack_signs_serial(bits, out.view(ut), pos1, neg1)
            return out
    n = _length(n)
    b = _bits_input(bits, packed_nbytes(n), "bits")
    dt = _out_dtype(dtype, _SIGN_OUT_DTYPES)
    pos, neg = _sign_values(dt, scale)
    if dt not in _UNIT_SIGNS and dt.isnative:
        ut1 = _UNSIGNED_OF_SIZE[dt.itemsize]
        p1, n1 = _sign_values(dt, 1)
        _UNIT_SIGNS[dt] = (ut1, ut1(p1), ut1(n1))
    res = _out(out, dt, n)
    ut = _UNSIGNED_OF_SIZE[dt.itemsize]
    _dispatch(n, _k.unpack_signs_serial, _k.unpack_signs_parallel,
              (b, res.view(ut), ut(pos), ut(neg)), _CHUNK_ELEMENTS // 8)
    return res


def _sign_values(dt: np.dtype[Any], scale: object) -> tuple[int, int]:
    """The raw bits of ``+scale`` and ``-scale`` in ``dt`` (cached for the common scales)."""
    if type(scale) in (int, float):  # (1 and 1.0 give the same bits)
        try:
            return _sign_values_cached(dt, scale)
        except TypeError:  # an unhashable dtype: never, but be safe
            pass
    return _sign_values_of(dt, scale)


@functools.lru_cache(maxsize=256)
def _sign_values_cached(dt: np.dtype[Any], scale: float) -> tuple[int, int]:
    return _sign_values_of(dt, scale)


def _sign_values_of(dt: np.dtype[Any], scale: object) -> tuple[int, int]:
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.number)):
        raise UsageError(f"scale must be a real number, got {scale!r}", argument="scale")
    ut = _UNSIGNED_OF_SIZE[dt.itemsize]
    if dt.kind == "i":
        if isinstance(scale, (float, np.floating)) and not float(scale).is_integer():
            raise UsageError(f"scale must be an integer for dtype {dt}, got {scale!r}",
                             argument="scale")
        s = int(scale)
        info = np.iinfo(dt)
        if abs(s) > info.max:
            raise UsageError(f"scale {s} and -scale are not both representable in {dt}",
                             argument="scale")
        vals = np.array([s, -s], dtype=dt)
    else:
        if isinstance(scale, (complex, np.complexfloating)):
            raise UsageError(f"scale must be a real number, got {scale!r}", argument="scale")
        with np.errstate(over="ignore"):
            vals = np.array([scale, -float(scale)], dtype=np.float64).astype(dt)
        if not np.isfinite(vals).all():
            raise UsageError(f"scale {scale!r} is not finite in {dt}", argument="scale")
    raw = vals.view(ut)
    return int(raw[0]), int(raw[1])


class SignVotes:
    """The sign-vote kernels prepared for one shape: ``n`` elements of the float ``in_dtype``
    (float16/32/64) packed as votes, ``p`` packed vote vectors decided into ``+1``/``-1`` of
    ``out_dtype`` (int8/16/32/64, float16/32/64), with ``n < PARALLEL_MIN_ELEMENTS`` (the
    serial kernels). Everything is checked here, once (UsageError); the methods then only run
    their kernel, which is what a small sign all-reduce needs: the per-call checks of
    :func:`pack_signs`, :func:`majority` and :func:`unpack_signs` cost more than their work
    at a few thousand elements.

    The methods do **not** check their arrays: each must be exactly as described (a wrong
    one gives wrong results or corrupts memory, as a numba kernel would). For callers that
    made the arrays themselves; everyone else calls the checked functions.
    """

    __slots__ = (
        "_counter",
        "_in_view",
        "_masks",
        "_neg",
        "_odd",
        "_out_view",
        "_pos",
        "_shifts",
        "n",
        "nbytes",
        "p",
    )

    def __init__(self, n: int, in_dtype: npt.DTypeLike, p: int, out_dtype: npt.DTypeLike
                 ) -> None:
        self.n = n = _length(n)
        if n >= PARALLEL_MIN_ELEMENTS:
            raise UsageError(f"SignVotes runs the serial kernels: n must be below "
                             f"{PARALLEL_MIN_ELEMENTS}, got {n}", argument="n")
        self.p = p = _as_int(p, "p")
        if p < 1:
            raise UsageError(f"p must be >= 1, got {p}", argument="p")
        try:
            dt_in, dt = np.dtype(in_dtype), np.dtype(out_dtype)
        except TypeError as exc:
            raise UsageError(f"invalid dtype: {exc}", argument="in_dtype/out_dtype") from exc
        typed = _FLOAT_MASKS.get(dt_in)
        if typed is None:
            raise UsageError(f"in_dtype must be float16, float32 or float64, got {dt_in}",
                             argument="in_dtype")
        self._in_view, *masks = typed
        self._masks = tuple(masks)
        if dt not in _SIGN_OUT_DTYPES:
            raise UsageError(f"out_dtype {dt} not supported; expected one of: "
                             f"{', '.join(str(d) for d in _SIGN_OUT_DTYPES)}",
                             argument="out_dtype")
        pos, neg = _sign_values(dt, 1)
        self._out_view = ut = _UNSIGNED_OF_SIZE[dt.itemsize]
        self._pos, self._neg = ut(pos), ut(neg)
        self.nbytes = (n + 7) // 8
        self._shifts = _no_shifts(p)
        self._counter = _vote_counter(p)
        self._odd = p % 2 == 1  # no ties

    def pack(self, x: npt.NDArray[np.floating[Any]], out: npt.NDArray[np.uint8]) -> None:
        """:func:`pack_signs` of ``x`` (``in_dtype[n]``, C-contiguous) into ``out``
        (``uint8[nbytes]``, C-contiguous, writeable). Raises UsageError on a NaN, naming
        the first NaN's index."""
        sign, absm, inf = self._masks
        err = _k.pack_votes_serial(x.view(self._in_view), out, sign, absm, inf, False)
        if err >= 0:
            raise UsageError(f"NaN in vote input at index {err}", argument="x",
                             index=int(err))

    def decide(self, packed: npt.NDArray[np.uint8], tie: int, tie_offset: int,
               bits: npt.NDArray[np.uint8], out: npt.NDArray[Any]) -> None:
        """:func:`majority` of ``packed`` (``uint8[p, nbytes]``, C-contiguous) with the tie
        rule ``tie`` (one of the ``TIE_*`` constants) at offset ``tie_offset``, written as
        packed bits to ``bits`` (``uint8[nbytes]``, writeable) and as ``+1``/``-1`` to
        ``out`` (``out_dtype[n]``, C-contiguous, writeable), in one kernel call."""
        planes, init = self._counter
        _k.majority_signs_serial(packed, self._shifts, bits, out.view(self._out_view), self.n,
                                 planes, init,
                                 _TIE_MASKS[TIE_NEGATIVE if self._odd else tie, tie_offset % 2],
                                 self._pos, self._neg)


def count_votes(packed: npt.NDArray[np.uint8], n: int,
                out: npt.NDArray[np.int32] | None = None) -> npt.NDArray[np.int32]:
    """Count the +1 votes per element: ``out[i]`` = number of rows with bit i set.

    ``packed`` is ``uint8[p, ceil(n/8)]`` (p >= 0 vote vectors, one per row); the result is
    ``int32[n]``. Bad arguments raise :class:`UsageError`.
    """
    n = _length(n)
    a = _votes_input(packed, n)
    res = _out(out, np.dtype(np.int32), n)
    _dispatch(n, _k.count_votes_serial, _k.count_votes_parallel, (a, res),
              _CHUNK_ELEMENTS // 8)
    return res


def majority(packed: npt.NDArray[np.uint8], n: int, tie: int, tie_offset: int = 0,
             out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
    """The majority vote of ``p`` packed sign vectors, as packed bits ``uint8[ceil(n/8)]``.

    ``packed`` is ``uint8[p, ceil(n/8)]`` with ``p >= 1``. With ``c`` the number of +1 votes
    at element ``i``: bit i is 1 if ``2c > p``, 0 if ``2c < p``; a tie (``2c == p``, even
    ``p`` only) follows ``tie``: :data:`TIE_POSITIVE` -> 1, :data:`TIE_NEGATIVE` -> 0,
    :data:`TIE_ALTERNATE` -> 1 if ``i + tie_offset`` is even else 0 (``i`` counts from 0 in
    this call). Bad arguments raise :class:`UsageError`.
    """
    if type(packed) is np.ndarray and type(out) is np.ndarray and type(n) is int and \
            type(tie) is int and type(tie_offset) is int and 0 <= n < PARALLEL_MIN_ELEMENTS \
            and packed.ndim == 2 and out.ndim == 1:  # the common case, checked inline
        p, nb = packed.shape
        if p >= 1 and nb == (n + 7) // 8 and packed.dtype == _U8 and out.dtype == _U8 and \
                out.size == nb and 0 <= tie <= TIE_ALTERNATE and \
                packed.flags.c_contiguous and (flags := out.flags).c_contiguous and \
                flags.writeable:
            planes, init = _vote_counter(p)
            _k.majority_serial(packed, _no_shifts(p), out, n, planes, init,
                               _TIE_MASKS[TIE_NEGATIVE if p % 2 else tie, tie_offset % 2])
            return out
    n = _length(n)
    a = _votes_input(packed, n)
    p = a.shape[0]
    if p < 1:
        raise UsageError("majority needs at least one vote vector (packed has 0 rows)",
                         argument="packed")
    return _majority(a, _no_shifts(p), p, n, tie, tie_offset, out)


def majority_of_counts(planes: npt.NDArray[np.uint8], shifts: Sequence[int], votes: int,
                       n: int, tie: int, tie_offset: int = 0,
                       out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
    """The majority of ``votes`` votes given as partial counts in bit planes.

    ``planes`` is ``uint8[k, ceil(n/8)]``; row ``r`` contributes ``2**shifts[r]`` +1 votes at
    element ``i`` where its bit ``i`` is set (the planes of :func:`count_planes`, one set per
    group of voters, with shifts ``0, 1, ..., width - 1``). The contributions must add up to
    at most ``votes`` at every element (the caller's invariant: each set of planes is a
    count of its own voters). The decision is :func:`majority`'s with ``p = votes``: bit i is
    1 if ``2c > votes``, 0 if ``2c < votes``, a tie follows ``tie`` at ``i + tie_offset``.
    Bad arguments raise :class:`UsageError`.
    """
    n = _length(n)
    a = _votes_input(planes, n)
    k = a.shape[0]
    sh = np.asarray(shifts, dtype=np.int64)
    if sh.shape != (k,):
        raise UsageError(f"shifts has {sh.size} entries for {k} planes", argument="shifts")
    v = _as_int(votes, "votes")
    if v < 1:
        raise UsageError(f"votes must be >= 1, got {v}", argument="votes")
    if k and (int(sh.min()) < 0 or int(sh.max()) >= v.bit_length()):
        raise UsageError(f"shifts must lie in [0, {v.bit_length()}) for {v} votes, got "
                         f"{sh.tolist()}", argument="shifts")
    return _majority(a, sh, v, n, tie, tie_offset, out)


def _majority(a: npt.NDArray[np.uint8], shifts: npt.NDArray[np.int64], p: int, n: int,
              tie: int, tie_offset: int, out: npt.NDArray[np.uint8] | None
              ) -> npt.NDArray[np.uint8]:
    tie = _as_int(tie, "tie")
    offset = _as_int(tie_offset, "tie_offset")
    if tie not in (TIE_POSITIVE, TIE_NEGATIVE, TIE_ALTERNATE):
        raise UsageError(f"tie must be TIE_POSITIVE (0), TIE_NEGATIVE (1) or TIE_ALTERNATE "
                         f"(2), got {tie}", argument="tie")
    if p % 2 == 1 or tie == TIE_NEGATIVE:
        tie_mask = 0
    elif tie == TIE_POSITIVE:
        tie_mask = _ALL64
    else:
        tie_mask = _EVEN_BITS if offset % 2 == 0 else _EVEN_BITS << 1
    planes, init = _vote_counter(p)
    res = _out(out, np.dtype(np.uint8), packed_nbytes(n))
    _dispatch(n, _k.majority_serial, _k.majority_parallel,
              (a, shifts, res, n, planes, init, np.uint64(tie_mask)),
              _CHUNK_ELEMENTS // 64)
    return res


def count_planes(packed: npt.NDArray[np.uint8], n: int, width: int,
                 out: npt.NDArray[np.uint8] | None = None, *,
                 start: int = 0) -> npt.NDArray[np.uint8]:
    """The +1 votes per element as ``width`` bit planes: ``uint8[width, ceil(n/8)]``.

    ``packed`` is ``uint8[p, k]`` (p >= 0 vote vectors) with ``k >= ceil((start + n)/8)``:
    the elements ``start .. start + n`` of each row are counted, element ``start`` at bit 0
    of the planes (``start``: a multiple of 8, default 0). Plane ``s`` holds bit ``s`` of
    every element's count (bit i of the plane, the sign vectors' layout; the padding bits
    after element ``n - 1`` are 0), so element i's count is ``sum_s plane_s[i] << s``; needs
    ``2**width > p`` (UsageError otherwise, and for bad arguments). ``out``, when given, is a
    C-contiguous ``uint8[width, ceil(n/8)]``.
    """
    n = _length(n)
    first = _as_int(start, "start")
    if first < 0 or first % 8:
        raise UsageError(f"start must be a multiple of 8 and >= 0, got {first}", argument="start")
    a = _vector(packed, "packed", (np.dtype(np.uint8),), ndim=2)
    if a.shape[1] < packed_nbytes(first + n):
        raise UsageError(f"packed must have at least {packed_nbytes(first + n)} bytes per row "
                         f"for start={first}, n={n}, got shape {a.shape}", argument="packed")
    w = _as_int(width, "width")
    if not 1 <= w <= 16 or (1 << w) <= a.shape[0]:
        raise UsageError(f"width must be in [1, 16] with 2**width > {a.shape[0]} rows, got {w}",
                         argument="width")
    shape = (w, packed_nbytes(n))
    if out is None:
        res = np.empty(shape, np.uint8)
    else:
        if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != shape or \
                not out.flags.c_contiguous or not out.flags.writeable:
            raise UsageError(f"out must be a writeable C-contiguous uint8{list(shape)} array",
                             argument="out")
        res = out
    _dispatch(n, _k.count_planes_serial, _k.count_planes_parallel, (a, res, n, first // 8),
              _CHUNK_ELEMENTS // 64)
    return res


def _field_range(width: int, bias: object) -> tuple[int, int, int]:
    """``(bias, lo, hi)``: values in ``[lo, hi]`` make fields in ``[0, 2**width)``."""
    b = _as_int(bias, "bias")
    if not -(1 << 63) <= b < (1 << 63):
        raise UsageError(f"bias must fit in int64, got {b}", argument="bias")
    return b, -b, (1 << width) - 1 - b


def pack_fields(values: npt.NDArray[np.integer[Any]], width: int, bias: int,
                out: npt.NDArray[np.uint8] | None = None, *,
                valid: tuple[int, int] | None = None) -> npt.NDArray[np.uint8]:
    """Pack ``values[i] + bias`` as ``width``-bit fields into ``uint8[ceil(n*width/8)]``.

    ``values`` is any 1-D integer array (int8..int64, uint8..uint64), ``1 <= width <= 16``.
    Every field must lie in ``[0, 2**width - 1]``, and with ``valid=(lo, hi)`` every value in
    ``[lo, hi]`` too (a range inside the field's, checked in the same pass: a quantized
    all-reduce's ``[-levels, levels]`` where ``2 levels + 1`` is not a power of two); the
    first element that does not raises :class:`UsageError` naming its index and value
    (found in the packing pass; ``out`` may then be partly written).
    """
    v = _vector(values, "values", _INT_DTYPES)
    w = _width(width)
    b, lo, hi = _field_range(w, bias)
    if valid is not None:
        vlo, vhi = (_as_int(e, "valid") for e in valid)
        lo, hi = max(lo, vlo), min(hi, vhi)
    n = v.size
    res = _out(out, np.dtype(np.uint8), packed_nbytes(n, w))
    dmin, dmax = int_range(v.dtype)
    lo_c, hi_c = max(lo, dmin), min(hi, dmax)
    if lo_c > hi_c:  # no value of this dtype is valid
        err = 0 if n else -1
    else:
        kern = _k.field_kernels(w)
        args = (v, res, np.uint64(lo_c & _ALL64), np.uint64(hi_c - lo_c), np.uint64(lo_c + b))
        err = _dispatch(n, kern.pack_serial, kern.pack_parallel, args,
                        _CHUNK_ELEMENTS // _k.GROUP)
    if err >= 0:
        what = (f"does not fit in a {w}-bit field with bias {b}" if valid is None else
                "is outside the valid range")
        raise UsageError(f"value {int(v[err])} at index {err} {what} (values must lie in "
                         f"[{lo}, {hi}])", argument="values", index=int(err))
    return res


def unpack_fields(packed: npt.NDArray[np.uint8], n: int, width: int, bias: int,
                  out: npt.NDArray[Any] | None = None,
                  dtype: npt.DTypeLike = np.int32) -> npt.NDArray[Any]:
    """Unpack ``n`` ``width``-bit fields: element i = ``field i - bias``, as ``dtype``.

    ``packed`` is ``uint8[ceil(n*width/8)]``; ``dtype`` is an integer dtype or
    float32/float64, and must hold every value ``[-bias, 2**width - 1 - bias]`` can take
    (else :class:`UsageError`); ``out``, when given, must be exactly ``dtype[n]``.
    """
    n = _length(n)
    w = _width(width)
    b, lo, hi = _field_range(w, bias)
    a = _bits_input(packed, packed_nbytes(n, w), "packed")
    dt = _out_dtype(dtype, _FIELD_OUT_DTYPES)
    if dt.kind in "iu":
        dmin, dmax = int_range(dt)
        if lo < dmin or hi > dmax:
            raise UsageError(f"{w}-bit fields with bias {b} give values in [{lo}, {hi}], "
                             f"which do not fit in {dt}", argument="dtype")
    res = _out(out, dt, n)
    kern = _k.field_kernels(w)
    _dispatch(n, kern.unpack_serial, kern.unpack_parallel, (a, res, np.int64(b), False),
              _CHUNK_ELEMENTS // _k.GROUP)
    return res


def add_fields(packed: npt.NDArray[np.uint8], n: int, width: int, bias: int,
               acc: npt.NDArray[np.signedinteger[Any]]) -> npt.NDArray[np.signedinteger[Any]]:
    """Accumulate ``n`` fields in place: ``acc[i] += field i - bias``; returns ``acc``.

    ``packed`` is ``uint8[ceil(n*width/8)]``; ``acc`` is a writeable C-contiguous
    int16/int32/int64 array of length ``n``. The sum wraps around on overflow of ``acc``'s
    dtype (size ``acc`` for the number of contributions). Bad arguments raise
    :class:`UsageError`.
    """
    n = _length(n)
    w = _width(width)
    b, _, _ = _field_range(w, bias)
    a = _bits_input(packed, packed_nbytes(n, w), "packed")
    target = _vector(acc, "acc", _ACC_DTYPES)
    _out(target, target.dtype, n, name="acc")
    kern = _k.field_kernels(w)
    _dispatch(n, kern.unpack_serial, kern.unpack_parallel, (a, target, np.int64(b), True),
              _CHUNK_ELEMENTS // _k.GROUP)
    return target


def sum_sign_fields(rows: npt.NDArray[np.uint8], n: int, width: int, bias: int,
                    out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
    """The sign of the exact sum over ``rows`` of ``n`` packed fields, packed at 2 bits.

    ``rows`` is ``uint8[r, ceil(n*width/8)]`` (r >= 0 packed contributions, C-contiguous);
    ``0 <= bias < 2**width``. With ``t`` the sum over the rows of ``field i - bias``
    (exact), field i of the result is ``sign(t) + 1`` (0, 1 or 2):
    ``uint8[ceil(n/4)]``, its padding bits 0. The same bytes as unpacking every row,
    adding, ``np.sign`` and :func:`pack_fields` at width 2 with bias 1, in one pass over the
    rows and without the int32 sums (in 64-bit words below :data:`SUM_SIGN_WORDS_LIMIT`).
    Bad arguments raise :class:`UsageError`.
    """
    n = _length(n)
    w = _width(width)
    b, _, _ = _field_range(w, bias)
    if not 0 <= b < 1 << w:
        raise UsageError(f"bias must lie in [0, {(1 << w) - 1}] for {w}-bit fields, got {b}",
                         argument="bias")
    a = _vector(rows, "rows", (np.dtype(np.uint8),), ndim=2)
    if a.shape[1] != packed_nbytes(n, w):
        raise UsageError(f"rows must have {packed_nbytes(n, w)} bytes each for {n} fields of "
                         f"{w} bits, got shape {a.shape}", argument="rows")
    res = _out(out, np.dtype(np.uint8), packed_nbytes(n, 2))
    kern = _k.field_kernels(w)
    _dispatch(n * max(1, a.shape[0]), kern.sum_sign_serial, kern.sum_sign_parallel,
              (a, n, np.int64(b), res), _CHUNK_ELEMENTS // _k.GROUP)
    return res


# --------------------------------------------------------------------------------------------
# Bit ranges of packed streams, and bfloat16
# --------------------------------------------------------------------------------------------


def _bit_range(start: object, nbits: object, stream_bytes: int, name: str) -> tuple[int, int]:
    s = _as_int(start, "start")
    k = _as_int(nbits, "nbits")
    if s < 0 or k < 0:
        raise UsageError(f"start and nbits must be >= 0, got {s} and {k}",
                         argument="start" if s < 0 else "nbits")
    if s + k > 8 * stream_bytes:
        raise UsageError(f"bits [{s}, {s + k}) lie beyond the {stream_bytes} bytes of {name}",
                         argument="nbits")
    return s, k


def extract_bits(src: npt.NDArray[np.uint8], start: int, nbits: int,
                 out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
    """Bits ``[start, start + nbits)`` of the packed stream ``src`` (``uint8``, 1-D), moved
    to bit 0: returns ``uint8[ceil(nbits/8)]`` whose bit ``j`` is stream bit ``start + j``
    (stream bit ``i`` is bit ``i % 8`` of byte ``i // 8``); the padding bits of the last byte
    are 0. ``start + nbits`` must not exceed ``8 * src.size``. Bad arguments raise
    :class:`UsageError`.
    """
    a = _vector(src, "src", (np.dtype(np.uint8),))
    s, k = _bit_range(start, nbits, a.size, "src")
    res = _out(out, np.dtype(np.uint8), packed_nbytes(k))
    _k.extract_bits(a, s, k, res)
    return res


def insert_bits(dst: npt.NDArray[np.uint8], start: int, src: npt.NDArray[np.uint8],
                nbits: int) -> npt.NDArray[np.uint8]:
    """Write bits ``[0, nbits)`` of ``src`` (exactly ``uint8[ceil(nbits/8)]``) to bits
    ``[start, start + nbits)`` of the packed stream ``dst`` (writeable ``uint8``, 1-D), in
    place; every other bit of ``dst`` keeps its value, and the padding bits of ``src`` are
    ignored. Returns ``dst``. Bad arguments raise :class:`UsageError`.
    """
    d = _vector(dst, "dst", (np.dtype(np.uint8),))
    if not d.flags.writeable:
        raise UsageError("dst must be writeable", argument="dst")
    s, k = _bit_range(start, nbits, d.size, "dst")
    a = _bits_input(src, packed_nbytes(k), "src")
    _k.insert_bits(d, s, a, k)
    return d


def first_field_above(packed: npt.NDArray[np.uint8], n: int, width: int, limit: int) -> int:
    """The index of the first of the ``n`` ``width``-bit fields of ``packed`` (exactly
    ``uint8[ceil(n*width/8)]``, the field layout) whose unsigned value exceeds ``limit``,
    or -1 when none does. Bad arguments raise :class:`UsageError`.
    """
    n = _length(n)
    w = _width(width)
    a = _bits_input(packed, packed_nbytes(n, w), "packed")
    lim = _as_int(limit, "limit")
    if lim >= (1 << w) - 1:
        return -1
    if lim < 0:
        return 0 if n else -1
    return int(_k.first_field_above(a, n, w, lim))


def bf16_to_float32(bits: npt.NDArray[np.uint16],
                    out: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float32]:
    """Widen bfloat16 values, given as their raw bits (``uint16`` or ``int16``, 1-D), to
    ``float32[n]``: float32 bits = bfloat16 bits << 16 (exact, NaN payloads included)."""
    b = _vector(bits, "bits", (np.dtype(np.uint16), np.dtype(np.int16)))
    res = _out(out, np.dtype(np.float32), b.size)
    _k.bf16_widen(b.view(np.uint16), res.view(np.uint32))
    return res


def float32_to_bf16(x: npt.NDArray[np.float32],
                    out: npt.NDArray[np.uint16] | None = None) -> npt.NDArray[np.uint16]:
    """Round ``float32`` values (1-D) to bfloat16, returned as raw bits ``uint16[n]``: to
    nearest, ties to even (overflow gives +-inf, subnormals are kept); every NaN becomes the
    quiet NaN ``0x7FC0``. For every other value this is bit for bit what
    ``torch.Tensor.to(torch.bfloat16)`` gives (torch's own NaN bits vary by code path)."""
    a = _vector(x, "x", (np.dtype(np.float32),))
    res = _out(out, np.dtype(np.uint16), a.size)
    _k.bf16_narrow(a.view(np.uint32), res)
    return res
