"""Persistent MPI all-reduces (``MPI_Allreduce_init``) of one transport, for the checked
all-reduce of :meth:`~bitcoll.transport.mpi.MPITransport.prepared_checked_allreduce`.

A persistent collective is made once and started at every call: on MPICH, 2 ranks, it takes
about 1.5-2 us less per call than a fresh ``MPI_Iallreduce`` from 8 B to 256 KiB (the schedule
is built once). It is bound to its two buffers, and MPI matches a started request with the
request made at the same point on every other rank (requests are made in the same order
everywhere). So a request is only ever started when every rank has said, in the argument check
just before, that it holds the request with this very number for the arrays of this call
(:attr:`Persistent.bid`). Otherwise, when every rank would use one (it holds one, or its arrays
are the very objects of the plan's previous call), every rank makes a new one, at the same
point of the call sequence, with the same number; else the call is a plain
``MPI_Iallreduce`` (arrays new at each call, as ``out=None`` gives, never pay for making one).

Each :class:`Persistent` keeps references to its two arrays: they stay alive as long as it does
(so their memory cannot be freed or reused under MPI) and numpy refuses to resize them in place
(``ndarray.resize`` checks references). :class:`PersistentAllreduces` bounds how many a
transport keeps (:data:`PERSISTENT_ALLREDUCES`; the oldest is freed) and frees them all at
close. Everything here runs under the transport's lock.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import numpy.typing as npt

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["BID", "NO_BID", "NUMBER", "PERSISTENT_ALLREDUCES", "REPEAT_BID", "Persistent",
           "PersistentAllreduces"]

PERSISTENT_ALLREDUCES: Final = 64
"""Most persistent all-reduces one transport keeps (one per all-reduce plan in use: dtype,
count and op); making another frees the oldest."""

BID: Final = struct.Struct("<qB")
"""A rank's bid in the argument check's record: the number of the persistent request it holds
for the call's arrays (-1 for none), then 1 when this rank would use one for them (it holds
one, or the arrays are the very objects of the plan's previous call), else 0."""

NUMBER: Final = struct.Struct("<q")
"""The number part of a bid."""

NO_BID: Final = BID.pack(-1, 0)
"""No persistent request for these arrays, and none wanted (they are new)."""

REPEAT_BID: Final = BID.pack(-1, 1)
"""No persistent request for these arrays, but the plan's previous call had them too."""


class Persistent:
    """One persistent all-reduce: its number, its request (None once freed), its arrays
    (``send is recv`` in place), its bid and the records of a call where every rank bid it."""

    __slots__ = ("agreed", "bid", "number", "recv", "req", "send")

    def __init__(self, req: MPI.Prequest, send: npt.NDArray[Any], recv: npt.NDArray[Any],
                 number: int, size: int) -> None:
        self.number = number
        self.req: MPI.Prequest | None = req
        self.send: npt.NDArray[Any] | None = send
        self.recv: npt.NDArray[Any] | None = recv
        self.bid = BID.pack(number, 1)
        self.agreed = NUMBER.pack(number) * size


class PersistentAllreduces:
    """The persistent all-reduces of one transport of ``size`` ranks, numbered in the order
    they were made (the same order on every rank)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._made = 0
        self._live: dict[int, Persistent] = {}  # by number, oldest first
        self.available = True
        """False once MPI said it has no persistent collectives (then never again)."""

    def make(self, init: Callable[[], MPI.Prequest], send: npt.NDArray[Any],
             recv: npt.NDArray[Any], replaces: Persistent | None) -> Persistent | None:
        """A new persistent all-reduce made by ``init`` (``MPI_Allreduce_init`` on ``send``
        and ``recv``), or None (and :attr:`available` False from now on) where MPI has none.
        ``replaces`` (the plan's previous one) and, past :data:`PERSISTENT_ALLREDUCES`, the
        oldest are freed. Errors of ``init`` other than a missing function propagate."""
        if not self.available:
            return None
        try:
            req = init()
        except (NotImplementedError, AttributeError):
            self.available = False
            return None
        number = self._made
        self._made = number + 1
        made = Persistent(req, send, recv, number, self._size)
        if replaces is not None:
            self._free(replaces)
        live = self._live
        live[number] = made
        while len(live) > PERSISTENT_ALLREDUCES:
            self._free(live[next(iter(live))])
        return made

    def _free(self, old: Persistent) -> None:
        """Free ``old``'s request (it is inactive: every start was waited for) and forget it."""
        req = old.req
        self._live.pop(old.number, None)
        old.req = old.send = old.recv = None
        if req is not None:
            req.Free()

    def release(self) -> list[tuple[MPI.Prequest, tuple[object, ...]]]:
        """Forget every request and return them with their arrays (at close: the transport
        frees those that are inactive, and leaks with their arrays any a failure left
        started)."""
        out: list[tuple[MPI.Prequest, tuple[object, ...]]] = []
        for held in self._live.values():
            if held.req is not None:
                out.append((held.req, (held.send, held.recv)))
            held.req = held.send = held.recv = None
        self._live.clear()
        self.available = False
        return out
