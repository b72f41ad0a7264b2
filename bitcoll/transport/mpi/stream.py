"""One streamed ring pass over MPI (:meth:`~bitcoll.transport.mpi.MPITransport.stream`;
"Streams" in :mod:`bitcoll.transport.mpi.transport`).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from ...errors import CommError, CommTimeoutError, ProtocolError
from ...kernels.stream import MODE_FOLD_DIVIDE, MODE_LAND
from ...ops import ReduceOp, reduce_into
from ..base import HEADER_SIZE, StreamPlan
from .requests import (
    DATA_TAG,
    INLINE_MAX,
    _frame_problem,
    _payload_problem,
    _Poller,
    _receive_failed,
)

if TYPE_CHECKING:
    from mpi4py import MPI

    from .transport import MPITransport

_STREAM_OPS: Final = frozenset(("sum", "max", "min"))
"""A stream plan's ops (an avg folds as a sum, then divides at the owner)."""

STREAM_WINDOW: Final = 2
"""Receives a stream keeps posted ahead (each folded one lands in its own reused buffer)."""

STREAM_IDLE_TESTS: Final = 16
"""Unsuccessful tests a stream makes between looks at the clock, the abort channel and the
back-off (:class:`_Poller`); one on an oversubscribed node, where spinning only keeps the
rank being waited for off the core."""


class _StreamRun:
    """One :meth:`MPITransport.stream`: the plan's frames as the same MPI messages ``isend``
    and ``irecv`` would post, driven by one loop on the calling thread.

    Sends are posted in plan order as soon as they may leave (a forward once its receive is
    folded or landed); receives are posted in plan order, at most :data:`STREAM_WINDOW`
    ahead of the oldest unfinished one, a folded one into a reused landing buffer of the
    transport's, a landed one straight into ``work``. The loop tests the oldest receive
    (header message, then payload message), checks the header as ``irecv`` does, and folds
    (``work = src op payload``, numpy) outside the transport lock. Every
    :data:`STREAM_IDLE_TESTS` unsuccessful tests it polls the abort channel, checks the
    deadline and backs off like a wait loop."""

    __slots__ = ("_done", "_head", "_keep", "_land", "_plan", "_posted", "_sends", "_sent",
                 "_src", "_staging", "_t", "_work", "in_peer", "out_peer")

    def __init__(self, t: MPITransport, out_peer: int, in_peer: int, plan: StreamPlan) -> None:
        self._t = t
        self.out_peer = out_peer
        self.in_peer = in_peer
        self._plan = plan
        self._work = plan.work.view(np.uint8)
        self._src = plan.src.view(np.uint8)
        self._sent = 0  # sends posted
        self._done = 0  # receives finished (folded or landed), in order
        # Posted receives, oldest first: [index, header request, payload request or None,
        # staging row, payload destination (bytes), header checked].
        self._posted: list[list[Any]] = []
        self._head = 0  # next receive to post
        self._sends: list[MPI.Request] = []  # unfinished sends
        self._keep: list[object] = []  # their header and inline frame buffers
        self._staging = np.empty((STREAM_WINDOW, HEADER_SIZE + INLINE_MAX), np.uint8)
        self._land: list[npt.NDArray[np.uint8]] = []

    def run(self, deadline: float) -> None:
        t = self._t
        lock = t._lock
        recvs = self._plan.recvs
        with lock:
            t._check_usable()
            self._land = t._take_stream_buffers()
        try:
            with lock:
                self._post()
            idle = 0
            # Between looks: a few tests, or one where ranks share cores (back off at once).
            every = 1 if t.oversubscribed else STREAM_IDLE_TESTS
            poller: _Poller | None = None
            while self._done < len(recvs) or self._sends or self._sent < len(self._plan.sends):
                with lock:
                    if t._failure is not None:
                        raise t._failure.with_traceback(None)
                    finished = self._test_receive() if self._posted else self._test_sends()
                if finished is not None:
                    if finished >= 0:
                        self._finish(finished)
                        with lock:
                            self._post()
                    idle = 0
                    poller = None
                    continue
                idle += 1
                if idle % every:
                    continue
                now = time.monotonic()
                with lock:
                    failure = t._check_failure()
                if failure is not None:
                    raise failure.with_traceback(None)
                if now > deadline:
                    raise self._timeout()
                if poller is None:
                    poller = _Poller(t.oversubscribed)
                poller.pause(now)
        except BaseException as exc:
            self._abandon(exc)
            raise
        with lock:
            t._give_stream_buffers(self._land)
        plan = self._plan
        t.stats.add_sent(sum(h.length for h, *_ in plan.sends) + HEADER_SIZE * len(plan.sends),
                         len(plan.sends))
        t.stats.add_received(sum(h.length for h, *_ in recvs) + HEADER_SIZE * len(recvs),
                             len(recvs))

    def _post(self) -> None:
        """Post every send that may leave now and the receives the window allows (lock
        held)."""
        t, mpi = self._t, self._t._mpi
        comm, byte = t._comm, mpi.BYTE
        sends, itemsize = self._plan.sends, self._plan.work.itemsize
        while self._sent < len(sends):
            header, start, stop, from_src, after = sends[self._sent]
            if after >= self._done:
                break
            payload = (self._src if from_src else self._work)[start * itemsize:stop * itemsize]
            n = payload.nbytes
            if n <= INLINE_MAX:
                frame = np.empty(HEADER_SIZE + n, np.uint8)
                header.pack_into(frame.data)
                frame[HEADER_SIZE:] = payload
                self._sends.append(comm.Isend([frame, byte], self.out_peer, DATA_TAG))
                self._keep.append(frame)
            else:
                head = header.pack()
                self._sends.append(comm.Isend([head, byte], self.out_peer, DATA_TAG))
                self._sends.append(comm.Isend([payload, byte], self.out_peer, DATA_TAG))
                self._keep.append(head)
            self._sent += 1
        recvs = self._plan.recvs
        while self._head < len(recvs) and self._head < self._done + STREAM_WINDOW:
            j = self._head
            header, start, stop, mode = recvs[j]
            n = header.length
            staging = self._staging[j % STREAM_WINDOW]
            first = comm.Irecv([staging, byte], self.in_peer, DATA_TAG)
            dst: npt.NDArray[np.uint8] | None = None
            rest = None
            if n > INLINE_MAX:
                if mode == MODE_LAND:
                    dst = self._work[start * itemsize:stop * itemsize]
                else:
                    dst = self._landing(j % STREAM_WINDOW, n)
                rest = comm.Irecv([dst, byte], self.in_peer, DATA_TAG)
            self._posted.append([j, first, rest, staging, dst, False])
            self._head = j + 1

    def _landing(self, k: int, n: int) -> npt.NDArray[np.uint8]:
        """Landing buffer ``k`` (of :data:`STREAM_WINDOW`), at least ``n`` bytes."""
        land = self._land
        while len(land) <= k:
            land.append(np.empty(0, np.uint8))
        if land[k].nbytes < n:
            land[k] = np.empty(n, np.uint8)
        return land[k][:n]

    def _test_receive(self) -> int | None:
        """Test the oldest posted receive (lock held): its index once both of its messages
        arrived and were checked, else None. ProtocolError for a frame that is not the
        expected one."""
        entry = self._posted[0]
        j: int = entry[0]
        first, rest, staging, _, checked = entry[1:]
        header = self._plan.recvs[j][0]
        t, mpi = self._t, self._t._mpi
        status = t._stream_status
        if not checked:
            try:
                if not first.Test(status):
                    return None
            except mpi.Exception as exc:
                raise _receive_failed(t, exc, self.in_peer, staging.nbytes, header) from exc
            problem = _frame_problem(staging.data, status.Get_count(mpi.BYTE), header,
                                     header.pack(), self.in_peer)
            if problem is not None:
                raise ProtocolError(problem, peer=self.in_peer, sequence=header.seq)
            entry[5] = True
        if rest is not None:
            try:
                if not rest.Test(status):
                    return None
            except mpi.Exception as exc:
                raise _receive_failed(t, exc, self.in_peer, header.length, header) from exc
            count = status.Get_count(mpi.BYTE)
            if count != header.length:
                raise ProtocolError(_payload_problem(count, header.length, self.in_peer),
                                    peer=self.in_peer, sequence=header.seq)
        return j

    def _test_sends(self) -> int | None:
        """Test the unfinished sends (lock held): -1 when all have finished, else None."""
        try:
            if not self._t._mpi.Request.Testall(self._sends):
                return None
        except self._t._mpi.Exception as exc:
            self._t._note_risk(f"MPI failed to send to rank {self.out_peer}: {exc}")
            raise CommError(f"MPI failed to send to rank {self.out_peer}: {exc}",
                            peer=self.out_peer) from exc
        self._sends = []
        return -1

    def _finish(self, j: int) -> None:
        """Fold or land receive ``j``, whose messages have arrived (outside the lock)."""
        entry = self._posted.pop(0)
        plan = self._plan
        header, start, stop, mode = plan.recvs[j]
        n = header.length
        inline = n <= INLINE_MAX
        payload = entry[3][HEADER_SIZE:HEADER_SIZE + n] if inline else entry[4]
        if mode == MODE_LAND:
            if inline:  # else it landed in work
                itemsize = plan.work.itemsize
                self._work[start * itemsize:stop * itemsize] = payload
        else:
            out = plan.work[start:stop]
            reduce_into(out, plan.src[start:stop], payload.view(plan.work.dtype),
                        ReduceOp(plan.op))
            if mode == MODE_FOLD_DIVIDE:
                np.divide(out, np.asarray(plan.divisor, dtype=out.dtype), out=out)
        self._done = j + 1

    def _timeout(self) -> CommTimeoutError:
        """The error of a stream past its deadline: the oldest receive it waits for, else its
        sends (``peer`` is that neighbour; over MPI no rank can tell whether it waits in
        turn for another, so ``silent`` stays unknown)."""
        plan = self._plan
        if self._posted:
            header = plan.recvs[self._posted[0][0]][0]
            what = (f"receive of {header.length} bytes from rank {self.in_peer} (collective "
                    f"#{header.seq}, step {header.step})")
            peer = self.in_peer
        else:
            header = plan.sends[-1][0]
            what, peer = f"send to rank {self.out_peer}", self.out_peer
        err = CommTimeoutError(f"stream: {what} did not complete before the deadline",
                               peer=peer, sequence=header.seq)
        self._t._note_risk(f"a peer did not answer in time: {err}")
        return err

    def _abandon(self, exc: BaseException) -> None:
        """After ``exc`` ended the stream: cancel its receives, keep whatever MPI may still
        touch alive until the communicator is released, and fail the transport (a stream
        half done cannot be resumed; peers are told)."""
        t = self._t
        with t._lock:
            keep: list[object] = [self._staging, self._land, self._plan.work, self._plan.src,
                                  self._keep]
            for entry in self._posted:
                for req in entry[1:3]:
                    if req is not None:
                        with contextlib.suppress(t._mpi.Exception):
                            req.Cancel()
                        t._orphans.append(req)
            t._orphans.extend(self._sends)
            self._posted, self._sends = [], []
            t._keep.append(keep)
            if isinstance(exc, CommError):
                t._fail(exc, notify=True)
            else:
                t._fail(CommError(f"a stream was interrupted by {exc!r}"), notify=True)


