"""Plain numpy versions of every kernel in :mod:`bitcoll.kernels`, for tests and benchmarks.

They follow the same contracts (layouts, tie rules, error messages for NaN and out-of-range
values) but are written for clarity, not speed, allocate freely and do not accept ``out=``.
Argument validation is limited to what the contracts need; the fast API is the one that
checks dtypes and shapes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError

__all__ = ["TIE_POSITIVE", "TIE_NEGATIVE", "TIE_ALTERNATE", "packed_nbytes", "pack_signs",
           "unpack_signs", "count_votes", "majority", "majority_of_sums", "pack_fields",
           "unpack_fields", "add_fields", "pack_ternary", "extract_bits", "insert_bits",
           "bf16_to_float32", "float32_to_bf16"]

TIE_POSITIVE = 0
TIE_NEGATIVE = 1
TIE_ALTERNATE = 2

U8 = npt.NDArray[np.uint8]


def packed_nbytes(n: int, width: int = 1) -> int:
    """``ceil(n * width / 8)``."""
    return (n * width + 7) // 8


def _check_nan(x: npt.NDArray[Any]) -> None:
    bad = np.flatnonzero(np.isnan(x))
    if bad.size:
        raise UsageError(f"NaN in vote input at index {int(bad[0])}",
                         argument="x", index=int(bad[0]))


def _bits_to_fields(fields: npt.NDArray[np.int64], width: int) -> U8:
    """Pack non-negative ``fields`` as ``width``-bit fields, least significant bit first."""
    bits = np.empty((fields.size, width), dtype=np.uint8)
    for k in range(width):
        bits[:, k] = (fields >> k) & 1
    return np.packbits(bits.ravel(), bitorder="little")


def _fields_of(packed: U8, n: int, width: int) -> npt.NDArray[np.int64]:
    """The first ``n`` ``width``-bit fields of ``packed``."""
    bits = np.unpackbits(packed, count=n * width, bitorder="little")
    fields = np.zeros(n, dtype=np.int64)
    for k in range(width):
        fields |= bits[k::width].astype(np.int64) << k
    return fields


def pack_signs(x: npt.NDArray[np.floating[Any]]) -> U8:
    """Bit i = 1 iff x[i] >= 0 (so +0.0 and -0.0 give 1); NaN raises UsageError."""
    _check_nan(x)
    return np.packbits(x >= 0, bitorder="little")


def unpack_signs(bits: U8, n: int, dtype: npt.DTypeLike = np.int8,
                 scale: float = 1.0) -> npt.NDArray[Any]:
    """Element i = +scale if bit i else -scale, as ``dtype``."""
    b = np.unpackbits(bits, count=n, bitorder="little").astype(bool)
    dt = np.dtype(dtype)
    s = np.array(scale).astype(dt)
    return np.where(b, s, -s).astype(dt)


def count_votes(packed: U8, n: int) -> npt.NDArray[np.int32]:
    """Number of rows of ``packed`` (uint8[p, nbytes]) whose bit i is 1, as int32[n]."""
    counts = np.zeros(n, dtype=np.int32)
    for row in packed:
        counts += np.unpackbits(row, count=n, bitorder="little")
    return counts


def majority(packed: U8, n: int, tie: int, tie_offset: int = 0) -> U8:
    """Bit i = 1 if more than half of the rows vote +1 at i; ties follow ``tie``."""
    p = packed.shape[0]
    c = count_votes(packed, n).astype(np.int64)
    res = 2 * c > p
    tied = 2 * c == p
    if tie == TIE_POSITIVE:
        res |= tied
    elif tie == TIE_ALTERNATE:
        res |= tied & ((np.arange(n) + tie_offset) % 2 == 0)
    return np.packbits(res, bitorder="little")


def majority_of_sums(sums: npt.NDArray[np.integer[Any]], tie: str,
                     tie_offset: int = 0) -> npt.NDArray[np.int8]:
    """The majority vote as int8 +1/-1 from per-element vote sums (the +1 votes minus the -1
    votes): the sign of the sum; a zero sum follows the tie rule named ``tie`` (the names of
    ``comm.sign_allreduce``'s ``tie``): "positive" +1, "negative" -1, "alternate" +1 where
    ``i + tie_offset`` is even, else -1 (``i`` counts from 0 in ``sums``)."""
    out: npt.NDArray[np.int8] = np.sign(sums).astype(np.int8)
    ties = out == 0
    if tie == "positive":
        out[ties] = 1
    elif tie == "negative":
        out[ties] = -1
    elif tie == "alternate":
        even = (np.arange(sums.size, dtype=np.int64) + tie_offset) % 2 == 0
        out[ties] = np.where(even[ties.reshape(-1)], 1, -1).astype(np.int8)
    else:
        raise UsageError(f"tie must be 'positive', 'negative' or 'alternate', got {tie!r}",
                         argument="tie")
    return out


def pack_fields(values: npt.NDArray[np.integer[Any]], width: int, bias: int) -> U8:
    """Field i = values[i] + bias as ``width`` bits; out of [0, 2**width) raises UsageError."""
    lo, hi = -bias, (1 << width) - 1 - bias
    bad = np.flatnonzero((values < lo) | (values > hi))
    if bad.size:
        i = int(bad[0])
        raise UsageError(f"value {int(values[i])} at index {i} does not fit in a {width}-bit "
                         f"field with bias {bias} (values must lie in [{lo}, {hi}])",
                         argument="values", index=i)
    return _bits_to_fields(values.astype(np.int64) + np.int64(bias), width)


def unpack_fields(packed: U8, n: int, width: int, bias: int,
                  dtype: npt.DTypeLike = np.int32) -> npt.NDArray[Any]:
    """Value i = field i - bias, as ``dtype``."""
    return (_fields_of(packed, n, width) - bias).astype(dtype)


def add_fields(packed: U8, n: int, width: int, bias: int,
               acc: npt.NDArray[np.signedinteger[Any]]) -> npt.NDArray[np.signedinteger[Any]]:
    """``acc += field - bias`` in place (wrapping in acc's dtype); returns acc."""
    acc += (_fields_of(packed, n, width) - bias).astype(acc.dtype)
    return acc


def sum_sign_fields(rows: U8, n: int, width: int, bias: int) -> U8:
    """Field i = sign(sum over the rows of (field i - bias)) + 1, as 2 bits."""
    total = np.zeros(n, np.int64)
    for row in rows:
        total += _fields_of(row, n, width) - bias
    return _bits_to_fields(np.sign(total) + 1, 2)


def pack_ternary(x: npt.NDArray[np.floating[Any]]) -> U8:
    """sign(x) + 1 (0 for x < 0, 1 for x == 0 or -0.0, 2 for x > 0) as 2-bit fields."""
    _check_nan(x)
    return _bits_to_fields(np.sign(x).astype(np.int64) + 1, 2)


def extract_bits(src: U8, start: int, nbits: int) -> U8:
    """Stream bits ``[start, start + nbits)`` of ``src`` moved to bit 0 (padding 0)."""
    return np.packbits(np.unpackbits(src, bitorder="little")[start:start + nbits],
                       bitorder="little")


def insert_bits(dst: U8, start: int, src: U8, nbits: int) -> U8:
    """``dst`` with stream bits ``[start, start + nbits)`` replaced by bits ``[0, nbits)`` of
    ``src`` (a new array)."""
    bits = np.unpackbits(dst, bitorder="little")
    bits[start:start + nbits] = np.unpackbits(src, count=nbits, bitorder="little")
    return np.packbits(bits, bitorder="little")


def bf16_to_float32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """float32 whose bits are the bfloat16 bits shifted up by 16."""
    out: npt.NDArray[np.float32] = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return out


def float32_to_bf16(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """bfloat16 bits of ``x`` rounded to nearest, ties to even; NaN -> 0x7FC0."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)
