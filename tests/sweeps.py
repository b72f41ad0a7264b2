"""Collective sweeps shared by the TCP, MPI and in-process tests.

Every function takes a communicator, runs many collectives with inputs generated from seeds,
computes on every rank the expected result of every rank's input locally, and raises
AssertionError naming the first case that differs. The same functions run on every transport.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

import bitcoll
from bitcoll.communicator import Communicator

Array = npt.NDArray[Any]

LENGTHS = (0, 1, 7, 8, 9, 1000, 2**20 + 3)
DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64")
OPS = ("sum", "avg", "max", "min")
ALLREDUCE_ALGOS = ("ring", "recursive_doubling")


def rank_input(seed: int, rank: int, n: int, dtype: str) -> Array:
    """Rank ``rank``'s input: small integers (exact in every dtype, sums exact in float)."""
    rng = np.random.default_rng([seed, rank, n])
    lo = 0 if dtype.startswith("u") else -3
    return rng.integers(lo, 4, n).astype(dtype)


def all_inputs(seed: int, size: int, n: int, dtype: str) -> list[Array]:
    return [rank_input(seed, j, n, dtype) for j in range(size)]


def expected_reduce(xs: list[Array], op: str) -> Array:
    stack = np.stack(xs) if xs[0].size else np.zeros((len(xs), 0), xs[0].dtype)
    dt = xs[0].dtype
    if op == "sum":
        return np.sum(stack, axis=0, dtype=dt)
    if op == "avg":
        return np.divide(np.sum(stack, axis=0, dtype=dt), np.asarray(len(xs), dtype=dt))
    if op == "max":
        return np.max(stack, axis=0, initial=np.iinfo(dt).min if dt.kind in "iu" else -np.inf)
    return np.min(stack, axis=0, initial=np.iinfo(dt).max if dt.kind in "iu" else np.inf)


def _eq(got: Array, want: Array, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)[:5] if got.shape == want.shape else []
        raise AssertionError(f"{what}: got {got.dtype}{got.shape}, want {want.dtype}"
                             f"{want.shape}; first differences at {list(bad)}")


def dense_sweep(comm: Communicator, seed: int = 0, lengths: tuple[int, ...] = LENGTHS,
                dtypes: tuple[str, ...] = DTYPES, algorithms: tuple[str, ...] = ALLREDUCE_ALGOS,
                large_dtypes: tuple[str, ...] = ("float32", "int8", "float64")) -> int:
    """All dense collectives over lengths x dtypes x ops x algorithms. Returns #checks."""
    p, r = comm.size, comm.rank
    checks = 0
    for n in lengths:
        for dt in dtypes:
            if n > 10_000 and dt not in large_dtypes:
                continue
            xs = all_inputs(seed, p, n, dt)
            mine = xs[r]
            for op in OPS:
                if op == "avg" and dt[0] in "iu":
                    continue
                want = expected_reduce(xs, op)
                for algo in algorithms:
                    got = comm.allreduce(mine, op=op, algorithm=algo)
                    _eq(got, want, f"allreduce n={n} {dt} {op} {algo} p={p}")
                    checks += 1
                lo, hi = bitcoll.block(n, p, r)
                _eq(comm.reduce_scatter(mine, op=op), want[lo:hi],
                    f"reduce_scatter n={n} {dt} {op} p={p}")
                checks += 1
            _eq(comm.allgather(mine), np.concatenate(xs), f"allgather n={n} {dt} p={p}")
            root = (n + seed) % p
            buf = mine.copy()
            comm.broadcast(buf, root=root)
            _eq(buf, xs[root], f"broadcast n={n} {dt} root={root} p={p}")
            m = n - n % p
            got = comm.alltoall(mine[:m])
            blk = m // p
            want = np.concatenate([x[r * blk:(r + 1) * blk] for x in xs]) if m else mine[:0]
            _eq(got, want, f"alltoall n={m} {dt} p={p}")
            checks += 3
    comm.barrier()
    return checks


def inplace_and_async(comm: Communicator, seed: int = 1) -> int:
    """out=x in place, shaped inputs, non-contiguous inputs, async Work handles."""
    p, r = comm.size, comm.rank
    xs = [rank_input(seed, j, 24, "float32").reshape(4, 6) for j in range(p)]
    want = expected_reduce([x.reshape(-1) for x in xs], "sum").reshape(4, 6)
    x = xs[r].copy()
    got = comm.allreduce(x, out=x)
    assert got is x
    _eq(x, want, "in-place allreduce")
    strided = np.repeat(xs[r], 2, axis=1)[:, ::2]
    _eq(comm.allreduce(strided), want, "non-contiguous allreduce")
    works = [comm.allreduce(xs[r], async_op=True) for _ in range(3)]
    works.append(comm.allgather(xs[r][0], async_op=True))
    for w in works[:3]:
        _eq(w.wait(timeout=60), want, "async allreduce")
    _eq(works[3].wait(), np.concatenate([x[0] for x in xs]), "async allgather")
    assert all(w.is_completed() for w in works)
    assert comm.barrier(async_op=True).wait() is None
    return 6
