"""GatheredReduce: the local half of the inline all-reduce (rows gathered from every rank,
reduced in rank order), through both of its entry points."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from bitcoll.algorithms.allreduce_gathered import GatheredReduce
from bitcoll.ops import ReduceOp


def _rank_order(rows: np.ndarray, op: ReduceOp) -> np.ndarray:
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MAX: np.maximum,
             ReduceOp.MIN: np.minimum}[op]
    want: np.ndarray = functools.reduce(lambda a, b: ufunc(a, b), rows[1:], rows[0].copy())
    if op is ReduceOp.AVG and len(rows) > 1:
        want = want / np.asarray(len(rows), rows.dtype)
    return want


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "int64"])
@pytest.mark.parametrize("op", list(ReduceOp))
def test_run_and_call_are_the_rank_order_reduction(p: int, dtype: str, op: ReduceOp) -> None:
    """``run(out)`` and ``obj(out)`` both write the rank-order reduction, bit for bit, for
    every length, and read the rows afresh at each call (the buffer is refilled between)."""
    if op is ReduceOp.AVG and np.dtype(dtype).kind != "f":
        pytest.skip("avg is for floating dtypes only")
    rng = np.random.default_rng(1000 * p + len(dtype))
    for n in (0, 1, 7, 8, 9, 61):
        buf = np.zeros((p, n + 3), dtype)  # rows: views into a wider buffer, as the records
        rows = buf[:, :n]
        red = GatheredReduce(rows, op)
        for call in (red.run, red, red.run):
            buf[:] = (rng.standard_normal(buf.shape) * 50).astype(dtype) \
                if np.dtype(dtype).kind == "f" else rng.integers(-60, 60, buf.shape)
            out = np.full(n, 7, dtype)
            call(out)
            np.testing.assert_array_equal(out, _rank_order(rows.copy(), op))


def test_bad_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="rows must be"):
        GatheredReduce(np.zeros(3, np.float32), ReduceOp.SUM)
    with pytest.raises(ValueError, match="rows must be"):
        GatheredReduce(np.zeros((0, 3), np.float32), ReduceOp.SUM)
