"""The one partition of ``n`` elements over ``p`` ranks that every bitcoll collective uses.

Rank ``r`` owns elements ``[start_r, stop_r)`` in ``numpy.array_split`` order: the first
``n mod p`` ranks own ``n // p + 1`` elements, the others ``n // p``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["partition", "block", "block_bounds"]


def _check(n: int, p: int) -> None:
    from .errors import UsageError

    if n < 0:
        raise UsageError(f"length must be >= 0, got {n}")
    if p < 1:
        raise UsageError(f"number of parts must be >= 1, got {p}")


def partition(n: int, p: int) -> list[tuple[int, int]]:
    """Return the ``p`` half-open ranges ``(start, stop)`` that split ``range(n)``.

    >>> partition(10, 4)
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    _check(n, p)
    q, rem = divmod(n, p)
    out = []
    start = 0
    for r in range(p):
        stop = start + q + (1 if r < rem else 0)
        out.append((start, stop))
        start = stop
    return out


def block(n: int, p: int, r: int) -> tuple[int, int]:
    """Return ``partition(n, p)[r]`` without building the whole list."""
    _check(n, p)
    q, rem = divmod(n, p)
    start = r * q + min(r, rem)
    return start, start + q + (1 if r < rem else 0)


def block_bounds(n: int, p: int) -> npt.NDArray[np.int64]:
    """Return the ``p + 1`` boundaries of ``partition(n, p)`` as an int64 array."""
    _check(n, p)
    q, rem = divmod(n, p)
    sizes = np.full(p, q, dtype=np.int64)
    sizes[:rem] += 1
    bounds = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(sizes, out=bounds[1:])
    return bounds
