"""All-reduce of vectors already gathered from every rank: the local half of an all-reduce
whose data travelled in one all-gather (over MPI, inside the argument check's records).

Every rank holds the same ``(p, n)`` rows (row ``r`` is rank ``r``'s vector) and reduces them
itself in rank order, ``op(...op(op(row 0, row 1), row 2)..., row p-1)``, so every rank gets
the same bits (for floating sums: the sum in rank order, rounded after each addition); avg
divides that sum by ``p`` once. Cheap only for small vectors: every rank receives all ``p``
of them.
"""

from __future__ import annotations

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
    rows and the avg divisor are made once here, so a call costs one or two ufunc calls.
    """

    __slots__ = ("_divisor", "_first", "_rows", "_second", "_ufunc")

    def __init__(self, rows: npt.NDArray[Any], op: ReduceOp) -> None:
        if rows.ndim != 2 or rows.shape[0] < 1:
            raise ValueError(f"rows must be a (p >= 1, n) array, got shape {rows.shape}")
        self._rows = rows
        self._first = rows[0]
        self._second = rows[1] if rows.shape[0] == 2 else None
        self._ufunc = _UFUNCS[op]
        self._divisor = np.asarray(rows.shape[0], dtype=rows.dtype) \
            if op is ReduceOp.AVG and rows.shape[0] > 1 else None

    def __call__(self, out: npt.NDArray[Any]) -> None:
        """Write the reduction into ``out`` (1-D, ``n`` elements, the rows' dtype; it must not
        overlap the rows)."""
        if self._second is not None:
            self._ufunc(self._first, self._second, out)  # out positional: cheaper per call
        elif self._rows.shape[0] == 1:
            np.copyto(out, self._first)
        else:
            self._ufunc.reduce(self._rows, axis=0, out=out)
        if self._divisor is not None:
            np.divide(out, self._divisor, out=out)
