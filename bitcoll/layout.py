"""The bit layouts of the packed-bit collectives, for code that packs and unpacks by itself.

:meth:`~bitcoll.Communicator.packed_sign_allreduce`, :meth:`~bitcoll.Communicator.
packed_quantized_allreduce` and their reduce-scatter forms take and return packed streams in
exactly these layouts; a GPU kernel that follows the definitions below interoperates with
them (and with these functions) bit for bit.

Definitions
-----------
* **Stream bits.** A packed stream is a ``uint8`` array; stream bit ``j`` is bit ``j % 8``
  (the bit of value ``1 << (j % 8)``) of byte ``j // 8``: little-endian within each byte.
* **Signs** (width 1). Element ``i`` is stream bit ``i``: 1 means +1, 0 means -1.
  ``count`` signs take ``ceil(count / 8)`` bytes; ``numpy.packbits(x >= 0,
  bitorder="little")`` is the reference packing.
* **Fields** (width ``w``, ``1 <= w <= 16``). Element ``i`` is the unsigned integer at stream
  bits ``[i w, (i + 1) w)``, least significant bit first:
  ``field_i = sum(bit(i*w + k) << k for k in range(w))``. ``count`` fields take
  ``ceil(count * w / 8)`` bytes. A signed value ``v`` is stored with a bias ``b`` as
  ``v + b``, which must lie in ``[0, 2**w - 1]``.
* **Quantized sums.** ``packed_quantized_allreduce`` takes values in ``[-L, L]`` as fields of
  ``w_in = field_width(L) = ceil(log2(2 L + 1))`` bits with bias ``L``, and returns the sums
  over ``p`` ranks as fields of ``w_out = field_width(L p)`` bits with bias ``L p``:
  ``pack_fields(q, field_width(L), L, valid=(-L, L))`` in (``valid`` refuses a value outside
  ``[-L, L]`` that the field could still hold), ``unpack_fields(s, n, field_width(L * p),
  L * p)`` out.
* **Padding.** The bits after the last element, up to the byte boundary, are written as 0 by
  every function here and by the collectives, and ignored when read.

Arrays: inputs are numpy arrays or host arrays bitcoll reads without a copy (torch CPU
tensors, DLPack, buffer protocol: :mod:`bitcoll.arrays`), of any shape, read flattened in C
order (a non-contiguous value array is copied first; a packed stream must be C-contiguous and
have exactly the documented number of bytes). Results are new 1-D numpy arrays, or ``out``
(1-D numpy, exactly the result's dtype and length, C-contiguous, writeable). Bad arguments
raise :class:`~bitcoll.errors.UsageError`. The work is done by bitcoll's numba kernels
(:mod:`bitcoll.kernels`, compiled on first use).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .arrays import HostArray, to_numpy, type_name
from .errors import UsageError

__all__ = ["packed_nbytes", "field_width", "pack_signs", "unpack_signs", "pack_fields",
           "unpack_fields"]

Array = npt.NDArray[Any]


def _values(x: HostArray, name: str) -> Array:
    arr, bf16 = to_numpy(x, name)
    if bf16:
        raise UsageError(f"{name} has dtype {type_name(arr, bf16)}, which bitcoll.layout "
                         f"does not pack; convert it to float32 first", argument=name)
    return np.ascontiguousarray(arr).reshape(-1)


def packed_stream(x: HostArray, name: str) -> Array:
    """``x`` as a 1-D uint8 view of a packed stream: UsageError unless it is C-contiguous
    uint8 (numpy, DLPack or buffer protocol, as :mod:`bitcoll.arrays` reads it)."""
    arr, bf16 = to_numpy(x, name)
    if bf16 or arr.dtype != np.uint8:
        raise UsageError(f"{name} must have dtype uint8 (a packed stream), got "
                         f"{type_name(arr, bf16)}", argument=name)
    if not arr.flags.c_contiguous:
        raise UsageError(f"{name} must be C-contiguous", argument=name)
    return arr.reshape(-1)


def packed_nbytes(count: int, width: int = 1) -> int:
    """Bytes taken by ``count`` packed elements of ``width`` bits: ``ceil(count * width / 8)``."""
    from . import kernels

    return kernels.packed_nbytes(count, width)


def field_width(max_abs: int) -> int:
    """Bits of a field that holds every integer of ``[-max_abs, max_abs]`` with bias
    ``max_abs``: ``ceil(log2(2 max_abs + 1))`` (at least 1). ``field_width(levels)`` is
    ``w_in`` of the quantized collectives, ``field_width(levels * size)`` their ``w_out``."""
    if isinstance(max_abs, bool) or not isinstance(max_abs, (int, np.integer)) or max_abs < 0:
        raise UsageError(f"max_abs must be an integer >= 0, got {max_abs!r}", argument="max_abs")
    return max(1, int(2 * max_abs).bit_length())


def pack_signs(x: HostArray, out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
    """Pack the sign votes of ``x`` (``count`` elements) into ``uint8[ceil(count / 8)]``.

    ``x`` float16/32/64: bit ``i`` is 1 iff ``x[i] >= 0`` (+0.0 and -0.0 vote +1, like
    :meth:`~bitcoll.Communicator.sign_allreduce`); a NaN raises UsageError naming its index.
    ``x`` bool: bit ``i`` is ``x[i]`` (True votes +1). Padding bits are 0.
    """
    from . import kernels

    v = _values(x, "x")
    if v.dtype == np.bool_:  # 1-bit fields of 0 and 1 are exactly the sign bits
        return kernels.pack_fields(v.view(np.uint8), 1, 0, out=out)
    return kernels.pack_signs(v, out=out)


def unpack_signs(bits: HostArray, count: int, out: Array | None = None,
                 dtype: npt.DTypeLike = np.int8) -> Array:
    """Expand ``count`` packed signs: element ``i`` is +1 if bit ``i`` is 1, else -1, as
    ``dtype`` (int8/16/32/64 or float16/32/64; ``out``, when given, exactly ``dtype[count]``).
    ``bits`` must hold exactly ``ceil(count / 8)`` bytes; padding bits are ignored."""
    from . import kernels

    return kernels.unpack_signs(packed_stream(bits, "bits"), count, out=out, dtype=dtype)


def pack_fields(values: HostArray, width: int, bias: int = 0,
                out: npt.NDArray[np.uint8] | None = None, *,
                valid: tuple[int, int] | None = None) -> npt.NDArray[np.uint8]:
    """Pack ``values[i] + bias`` as ``width``-bit fields (``1 <= width <= 16``) into
    ``uint8[ceil(count * width / 8)]``.

    ``values``: any integer dtype. Every ``values[i] + bias`` must lie in
    ``[0, 2**width - 1]``, and with ``valid=(lo, hi)`` every ``values[i]`` in ``[lo, hi]``
    too (checked in the same pass), else UsageError naming the first index that does not.
    For the quantized collectives: ``pack_fields(q, field_width(levels), levels,
    valid=(-levels, levels))``.
    """
    from . import kernels

    return kernels.pack_fields(_values(values, "values"), width, bias, out=out, valid=valid)


def unpack_fields(packed: HostArray, count: int, width: int, bias: int = 0,
                  out: Array | None = None, dtype: npt.DTypeLike = np.int32) -> Array:
    """Unpack ``count`` ``width``-bit fields: element ``i`` is ``field_i - bias`` as ``dtype``
    (an integer dtype that holds every value ``[-bias, 2**width - 1 - bias]``, or
    float32/float64; ``out``, when given, exactly ``dtype[count]``). ``packed`` must hold
    exactly ``ceil(count * width / 8)`` bytes; padding bits are ignored. For the sums of the
    quantized collectives: ``unpack_fields(s, count, field_width(levels * size),
    levels * size)``."""
    from . import kernels

    return kernels.unpack_fields(packed_stream(packed, "packed"), count, width, bias, out=out,
                                 dtype=dtype)
