"""Vote codecs: how packed-bit collectives encode contributions and aggregate them.

A codec fixes three things for one packed collective:

* the **input field width** ``w_in`` and the encoder of a rank's contribution:
  1-bit signs (majority; ``x >= 0`` and ``-0.0`` vote +1), 2-bit ternary signs
  (``sign(x)`` in {-1, 0, 1}), or ``ceil(log2(2 L + 1))``-bit integers in ``[-L, L]``;
* the **owner's aggregation** of ``p`` packed rows into the result: the majority bit (with
  the tie rule) or the exact sum, packed in ``w_out`` bits (1 for majority,
  ``ceil(log2(2 L p + 1))`` for sums, biased by ``L p``);
* the **decoder** of the packed result into the caller's output (int8 +-1 for majority, the
  sums in the output's integer dtype).

Bit order everywhere: element ``i`` occupies stream bits ``[i w, (i + 1) w)``, little-endian
(``numpy.packbits(bits, bitorder="little")`` is the 1-bit layout). Segments of a block are
multiples of 8 elements, so the packing of a block is the concatenation of its segments'.

Packed input and output (``packed_in`` / ``packed_out``, the ``packed_*`` collectives): the
caller's input already is the ``w_in``-bit field stream of its contribution, and its output is
the ``w_out``-bit field stream of the result. These are the two ends of the same pipeline:
encoding elements ``[lo, hi)`` then only moves stream bits ``[lo w_in, hi w_in)`` to bit 0 of
the wire buffer, and decoding moves the result's bits into place in the output stream. The
algorithms address inputs and outputs by element range only (:meth:`VoteCodec.encode`,
:meth:`VoteCodec.decode`), so every algorithm serves both forms unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import kernels

__all__ = ["VoteCodec", "field_width", "TIES"]

Array = npt.NDArray[Any]

TIES = {"positive": kernels.TIE_POSITIVE, "negative": kernels.TIE_NEGATIVE,
        "alternate": kernels.TIE_ALTERNATE}


def field_width(max_abs: int) -> int:
    """Bits needed for integers in ``[-max_abs, max_abs]``: ``ceil(log2(2 max_abs + 1))``."""
    return max(1, int(2 * max_abs).bit_length())


@dataclass(frozen=True)
class VoteCodec:
    """Encoding and aggregation of one packed collective (see the module docstring).

    ``kind``: "majority" or "sum". ``source``: "sign" (float votes, 1-bit for majority,
    ternary for sum) or "int" (integers in ``[-levels, levels]``). ``size``: the world size.
    ``tie``: a kernels.TIE_* constant; ``tie_call``: the communicator's majority call counter.
    ``packed_in``: the input is the ``w_in``-bit field stream of the contribution (uint8)
    instead of values; ``packed_out``: the output is the ``w_out``-bit field stream of the
    result (uint8) instead of values. Element ranges are the same either way.
    """

    kind: str
    source: str
    levels: int
    size: int
    tie: int = kernels.TIE_ALTERNATE
    tie_call: int = 0
    packed_in: bool = False
    packed_out: bool = False

    @property
    def w_in(self) -> int:
        if self.kind == "majority":
            return 1
        return field_width(self.levels)

    @property
    def bias_in(self) -> int:
        return 0 if self.kind == "majority" else self.levels

    @property
    def w_out(self) -> int:
        return 1 if self.kind == "majority" else field_width(self.levels * self.size)

    @property
    def bias_out(self) -> int:
        return 0 if self.kind == "majority" else self.levels * self.size

    def encode(self, x: Array, lo: int, hi: int, out: Array) -> None:
        """Pack elements ``[lo, hi)`` of this rank's input ``x`` into ``out`` (uint8,
        ``ceil((hi - lo) w_in / 8)`` bytes, from bit 0; padding bits 0)."""
        if self.packed_in:
            kernels.extract_bits(x, lo * self.w_in, (hi - lo) * self.w_in, out=out)
        elif self.kind == "majority":
            kernels.pack_signs(x[lo:hi], out=out)
        elif self.source == "sign":
            kernels.pack_ternary(x[lo:hi], out=out)
        else:
            kernels.pack_fields(x[lo:hi], self.w_in, self.bias_in, out=out)

    def combine(self, rows: Array, n: int, first: int, out: Array) -> None:
        """Aggregate ``rows`` (uint8 ``(p, nbytes)``, one packed contribution per rank) for
        ``n`` elements whose first global index is ``first``; write the packed result."""
        if self.kind == "majority":
            kernels.majority(rows, n, self.tie, first + self.tie_call, out=out)
            return
        acc = np.zeros(n, dtype=np.int32)
        for row in rows:
            kernels.add_fields(row, n, self.w_in, self.bias_in, acc)
        kernels.pack_fields(acc, self.w_out, self.bias_out, out=out)

    def decode(self, packed: Array, out: Array, lo: int, hi: int) -> None:
        """Write the ``hi - lo`` results packed in ``packed`` (from bit 0, ``w_out`` bits each)
        to elements ``[lo, hi)`` of ``out``: int8 +-1 for majority, else the sums in ``out``'s
        integer dtype; with ``packed_out``, to stream bits ``[lo w_out, hi w_out)`` of ``out``
        (its other bits are left as they are)."""
        if self.packed_out:
            kernels.insert_bits(out, lo * self.w_out, packed, (hi - lo) * self.w_out)
            return
        dst = out[lo:hi]
        if self.kind == "majority":
            kernels.unpack_signs(packed, dst.size, out=dst, dtype=dst.dtype)
        elif (1 << self.w_out) - 1 - self.bias_out <= np.iinfo(dst.dtype).max:
            kernels.unpack_fields(packed, dst.size, self.w_out, self.bias_out, out=dst,
                                  dtype=dst.dtype)
        else:
            # The sums fit ``out`` (checked by the communicator) but the field's full range
            # does not: decode wider, then narrow.
            wide = kernels.unpack_fields(packed, dst.size, self.w_out, self.bias_out,
                                         dtype=np.int32)
            np.copyto(dst, wide, casting="unsafe")

    def local(self, x: Array, out: Array, n: int) -> None:
        """The result of a one-rank world (``n`` elements): each vote or value is its own
        aggregate."""
        if self.packed_in or self.packed_out:
            # Through the codec's own steps: encode, aggregate one row, decode.
            row = np.empty((1, kernels.packed_nbytes(n, self.w_in)), np.uint8)
            self.encode(x, 0, n, row[0])
            res = np.empty(kernels.packed_nbytes(n, self.w_out), np.uint8)
            self.combine(row, n, 0, res)
            self.decode(res, out, 0, n)
        elif self.kind == "majority":
            kernels.unpack_signs(kernels.pack_signs(x), x.size, out=out, dtype=out.dtype)
        elif self.source == "sign":
            kernels.unpack_fields(kernels.pack_ternary(x), x.size, 2, 1, out=out,
                                  dtype=out.dtype)
        else:
            np.copyto(out, x, casting="unsafe")
