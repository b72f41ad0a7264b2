"""``CommLike``: the part of a communicator that lioncub uses (a typing seam).

lioncub drives its collectives through a :class:`bitcoll.Communicator`, but needs only the
members below; any object that has them (a wrapper that logs or injects faults, a test
double, another library's adapter) can stand in. The protocol is checked statically: mypy
verifies at the bottom of this module that :class:`bitcoll.Communicator` satisfies it. It is
not checked at run time.

Contract of the collectives, as lioncub relies on it: every rank calls them in the same order
with matching arguments; the results are identical on every rank; with ``async_op=True`` they
return a handle whose ``wait()`` blocks until the result is in ``out``; failures raise
:class:`bitcoll.errors.BitcollError` subclasses (``UsageError`` for bad arguments, the
``CommError`` family for communication).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

import numpy.typing as npt

__all__ = ["CommLike", "TrafficStatsLike", "WorkLike"]

Array = npt.NDArray[Any]


class TrafficStatsLike(Protocol):
    """Traffic counters of a communicator (``comm.stats``)."""

    def snapshot(self) -> dict[str, int]:
        """``{"bytes_sent", "bytes_received", "messages_sent", "messages_received"}`` since
        the communicator was created (or last reset)."""
        ...


class WorkLike(Protocol):
    """The handle of an asynchronous collective (:class:`bitcoll.Work`)."""

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective completed; return its result (the output array)."""
        ...


class CommLike(Protocol):
    """The communicator members lioncub calls (signatures of :class:`bitcoll.Communicator`).

    Return values: the output array, or with ``async_op=True`` a handle with ``wait()``
    (:class:`bitcoll.Work`); a :class:`WorkLike` for ``async_op=True`` (bitcoll's overloads).
    """

    @property
    def rank(self) -> int:
        """This process's rank, ``0 <= rank < size``."""
        ...

    @property
    def size(self) -> int:
        """The number of ranks."""
        ...

    @property
    def stats(self) -> TrafficStatsLike:
        """Bytes and messages this rank sent and received."""
        ...

    @overload
    def allreduce(self, x: Array, op: str = "sum", out: Array | None = None, *,
                  async_op: Literal[False] = False) -> Any: ...
    @overload
    def allreduce(self, x: Array, op: str = "sum", out: Array | None = None, *,
                  async_op: Literal[True]) -> WorkLike: ...
    def allreduce(self, x: Array, op: str = "sum", out: Array | None = None, *,
                  async_op: bool = False) -> Any:
        """Element-wise ``op`` ("sum", "avg", "max", "min") of ``x`` over the ranks."""
        ...

    def allgather(self, x: Array, out: Array | None = None) -> Any:
        """Every rank's ``x`` (same length and dtype everywhere), concatenated in rank
        order, on every rank."""
        ...

    def broadcast(self, x: Array, root: int = 0) -> Any:
        """Rank ``root``'s ``x`` copied into ``x`` on every rank (in place)."""
        ...

    @overload
    def sign_allreduce(self, x: Array, op: str = "majority", tie: str = "alternate",
                       out: Array | None = None, *, async_op: Literal[False] = False,
                       algorithm: str | None = None) -> Any: ...
    @overload
    def sign_allreduce(self, x: Array, op: str = "majority", tie: str = "alternate",
                       out: Array | None = None, *, async_op: Literal[True],
                       algorithm: str | None = None) -> WorkLike: ...
    def sign_allreduce(self, x: Array, op: str = "majority", tie: str = "alternate",
                       out: Array | None = None, *, async_op: bool = False,
                       algorithm: str | None = None) -> Any:
        """Majority (int8 +-1), exact sum, or the exact sum's sign (``op="sign"``) of the
        signs of ``x`` over the ranks."""
        ...

    @overload
    def quantized_allreduce(self, q: Array, levels: int, out: Array | None = None, *,
                            op: str = "sum", async_op: Literal[False] = False,
                            algorithm: str | None = None) -> Any: ...
    @overload
    def quantized_allreduce(self, q: Array, levels: int, out: Array | None = None, *,
                            op: str = "sum", async_op: Literal[True],
                            algorithm: str | None = None) -> WorkLike: ...
    def quantized_allreduce(self, q: Array, levels: int, out: Array | None = None, *,
                            op: str = "sum", async_op: bool = False,
                            algorithm: str | None = None) -> Any:
        """Exact sum over the ranks of integers ``q`` in ``[-levels, levels]``, or its sign
        (``op="sign"``)."""
        ...


if TYPE_CHECKING:
    from bitcoll.communicator import Communicator

    def _bitcoll_communicator_is_comm_like(comm: Communicator) -> CommLike:
        # mypy fails here if bitcoll.Communicator stops satisfying CommLike
        return comm

    def _stats_are_traffic_stats_like(comm: Communicator) -> TrafficStatsLike:
        return comm.stats

