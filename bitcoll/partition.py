"""The one partition of ``n`` elements over ``p`` ranks that every bitcoll collective uses.

Rank ``r`` owns elements ``[start_r, stop_r)`` in ``numpy.array_split`` order: the first
``n mod p`` ranks own ``n // p + 1`` elements, the others ``n // p``.
"""

from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=1024)
def block_bounds(n: int, p: int) -> tuple[int, ...]:
    """Return the ``p + 1`` boundaries of ``partition(n, p)`` (Python ints: block ``r`` is
    ``[bounds[r], bounds[r + 1])``). Cached: a collective's set-up looks them up in well under a
    microsecond."""
    return (*(start for start, _ in partition(int(n), int(p))), int(n))
