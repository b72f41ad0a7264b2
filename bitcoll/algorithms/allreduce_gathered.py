"""All-reduce of vectors already gathered from every rank: the local half of an all-reduce
whose data travelled in one all-gather (over MPI, inside the argument check's records).

Every rank holds the same ``(p, n)`` rows (row ``r`` is rank ``r``'s vector) and reduces them
itself in rank order, ``op(...op(op(row 0, row 1), row 2)..., row p-1)``, so every rank gets
the same bits (for floating sums: the sum in rank order, rounded after each addition); avg
divides that sum by ``p`` once. Cheap only for small vectors: every rank receives all ``p``
of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..ops import ReduceOp

__all__ = ["GatheredReduce"]

_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}


class GatheredReduce:
    """``out = op over the rows of rows`` for one fixed ``rows`` array, called many times.

    ``rows``: a ``(p, n)`` array (p >= 1) whose rows are C-contiguous; it is read at each
    call, so it may be a view of a buffer that is refilled between calls. The views of the
    rows and the avg divisor are made once here, so a call costs one or two ufunc calls (one
    per row when the rows hold one element each: see ``_each``).
    """

    __slots__ = ("_divisor", "_each", "_first", "_rows", "_second", "_ufunc", "run")

    def __init__(self, rows: npt.NDArray[Any], op: ReduceOp) -> None:
        if rows.ndim != 2 or rows.shape[0] < 1:
            raise ValueError(f"rows must be a (p >= 1, n) array, got shape {rows.shape}")
        self._rows = rows
        self._first = rows[0]
        self._second = rows[1] if rows.shape[0] == 2 else None
        # One element per row: numpy would reduce the rows as one strided vector, summing
        # float16 in float32 and float32 pairwise, not in rank order; so row by row.
        self._each = tuple(rows[1:]) if rows.shape[0] > 2 and rows.shape[1] == 1 else None
        self._ufunc = _UFUNCS[op]
        self._divisor = np.asarray(rows.shape[0], dtype=rows.dtype) \
            if op is ReduceOp.AVG and rows.shape[0] > 1 else None
        self.run: Callable[[npt.NDArray[Any]], object] = self.__call__
        """The same as calling the object, at the least cost per call: for a sum of two rows
        (not avg) ``np.add`` itself with the rows bound (``out`` positional, which numpy
        allows for ``add``, not for ``maximum`` and ``minimum``), else the bound method."""
        if self._second is not None and self._divisor is None and self._ufunc is np.add:
            self.run = functools.partial(np.add, self._first, self._second)

    def __call__(self, out: npt.NDArray[Any]) -> None:
        """Write the reduction into ``out`` (1-D, ``n`` elements, the rows' dtype; it must not
        overlap the rows)."""
        if self._second is not None:
            self._ufunc(self._first, self._second, out=out)
        elif self._rows.shape[0] == 1:
            np.copyto(out, self._first)
        elif self._each is not None:
            np.copyto(out, self._first)
            for row in self._each:
                self._ufunc(out, row, out=out)
        else:
            self._ufunc.reduce(self._rows, axis=0, out=out)
        if self._divisor is not None:
            np.divide(out, self._divisor, out=out)
