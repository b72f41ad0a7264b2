"""The view of one collective call that algorithms work with.

An :class:`OpContext` wraps the transport for one collective: it stamps every frame with the
call's sequence number and signature, numbers the frames between each ordered pair of ranks
(the header's ``step``), and applies the call's deadline to every wait. Algorithms only ever
call ``isend``, ``irecv``, ``wait`` (and ``stream``, a ring pass's frames in one call) here:
they never see sockets or MPI.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..arguments import split
from ..ops import ReduceOp
from ..transport.base import Consumer, FrameHeader, Request, StreamPlan, Transport

__all__ = ["GroupContext", "OpContext", "Slot", "as_bytes"]


def as_bytes(arr: npt.NDArray[Any]) -> memoryview:
    """A byte view of a 1-D C-contiguous array (no copy)."""
    return arr.reshape(-1).view(np.uint8).data


class Slot(enum.IntEnum):
    """The communicator's reusable work buffers, one owner each (:meth:`OpContext.scratch`).

    A slot is leased to exactly one algorithm (module) below; an algorithm that runs inside
    another one (the two-level collectives call the ring passes) uses other slots than its
    caller, so no two algorithms alive at once in one call can write the same buffer."""

    RING_LAND_0 = 0
    """:mod:`~bitcoll.algorithms.ring`: landing buffer of even steps of a reducing pass."""
    RING_LAND_1 = 1
    """:mod:`~bitcoll.algorithms.ring`: landing buffer of odd steps of a reducing pass."""
    RS_PARTIAL = 2
    """The communicator's dense reduce-scatter: partial sums of the whole vector."""
    PACKED_CONTRIB = 3
    """:mod:`~bitcoll.algorithms.sign_allreduce_direct`: packed contributions, all blocks."""
    PACKED_RESULT = 4
    """:mod:`~bitcoll.algorithms.sign_allreduce_direct`: packed results, all blocks."""
    PACKED_ROWS_0 = 5
    """:mod:`~bitcoll.algorithms.sign_allreduce_direct`: rows of even segments."""
    PACKED_ROWS_1 = 6
    """:mod:`~bitcoll.algorithms.sign_allreduce_direct`: rows of odd segments."""
    BF16_WIDE = 7
    """The communicator: the float32 copy of a bfloat16 vector."""
    HIER_WORK = 8
    """:mod:`~bitcoll.algorithms.hierarchical` (dense): a segment's host reduction."""
    HIER_LAND = 9
    """:mod:`~bitcoll.algorithms.hierarchical` (dense): the other local ranks' rows of a
    segment."""
    HIER_COUNTS = 10
    """:mod:`~bitcoll.algorithms.hierarchical` (packed): the host's counts of two segments of
    this rank's slices."""
    GATHER_WORK = 11
    """:mod:`~bitcoll.algorithms.sign_allreduce_allgather`: every rank's packed row, then the
    packed result."""
    PACKED_TOTALS = 12
    """:mod:`~bitcoll.algorithms.sign_allreduce_direct`: the owner's int32 totals of one
    segment (:meth:`~bitcoll.algorithms.votes.VoteCodec.combine`'s work)."""


class OpContext:
    """One collective call on one rank: frame stamping, step numbering, the deadline.

    ``segment_bytes`` is the preferred size of one frame's payload for algorithms that cut
    large buffers into segments (pipelining).
    """

    __slots__ = ("__dict__", "_argmap", "_recv_step", "_scratch", "_send_step", "_sig",
                 "deadline", "rank", "segment_bytes", "seq", "signature", "size", "transport")

    def __init__(self, transport: Transport, seq: int, signature: int, deadline: float,
                 segment_bytes: int, scratch: dict[int, npt.NDArray[np.uint8]] | None = None
                 ) -> None:
        # Made once per collective, the fast all-reduce's included: kept lean.
        self.transport = transport
        self.rank = transport.rank
        self.size = size = transport.size
        self.seq = seq
        self.signature = signature
        self._sig, self._argmap = split(signature)  # the header's two words
        self.deadline = deadline
        self.segment_bytes = segment_bytes if segment_bytes > 1 else 1
        self._scratch = {} if scratch is None else scratch
        self._send_step = [0] * size
        self._recv_step = [0] * size

    def _header(self, step: int, length: int) -> FrameHeader:
        return FrameHeader(seq=self.seq, step=step, signature=self._sig, length=length,
                           argmap=self._argmap)

    def isend(self, peer: int, arr: npt.NDArray[Any]) -> Request:
        """Start sending the C-contiguous array ``arr`` to ``peer`` (keep it unchanged until
        the request completes)."""
        view = as_bytes(arr)
        step = self._send_step[peer]
        self._send_step[peer] = step + 1
        return self.transport.isend(peer, view, self._header(step, view.nbytes))

    def _next_receive(self, peer: int, nbytes: int) -> FrameHeader:
        """The expected header of the next frame from ``peer`` (advances its step)."""
        step = self._recv_step[peer]
        self._recv_step[peer] = step + 1
        return self._header(step, nbytes)

    def irecv(self, peer: int, arr: npt.NDArray[Any]) -> Request:
        """Post a receive of the next frame from ``peer`` into the C-contiguous ``arr``."""
        view = as_bytes(arr)
        return self.transport.irecv(peer, view, self._next_receive(peer, view.nbytes))

    @property
    def consumes_on_receive(self) -> bool:
        """Whether :meth:`irecv_consume` is available on this transport."""
        return self.transport.consumes_on_receive

    def irecv_consume(self, peer: int, nbytes: int, consume: Consumer) -> Request:
        """Post a receive of the next frame from ``peer`` (``nbytes`` of payload) handed to
        ``consume(offset, chunk)`` as it arrives (see ``Transport.irecv_consume``)."""
        return self.transport.irecv_consume(peer, nbytes, self._next_receive(peer, nbytes),
                                            consume)

    def wait(self, *requests: Request) -> None:
        """Wait for every request within this call's deadline."""
        for req in requests:
            req.wait(self.deadline)

    def streams(self, dtype: np.dtype[Any], op: ReduceOp) -> bool:
        """Whether :meth:`stream` may run frames of ``dtype`` folded with ``op`` here: the
        transport streams and folds them as the frame path does
        (:meth:`~bitcoll.transport.base.Transport.stream_folds`; avg folds as a sum)."""
        t = self.transport
        return t.streams and t.stream_folds(
            dtype, "sum" if op in (ReduceOp.SUM, ReduceOp.AVG) else op.value)

    def stream(self, out_peer: int, in_peer: int, work: npt.NDArray[Any],
               src: npt.NDArray[Any], op: ReduceOp,
               sends: list[tuple[int, int, bool, int]],
               recvs: list[tuple[int, int, int]]) -> bool:
        """Send frames of ``src``/``work`` to ``out_peer`` and receive frames from
        ``in_peer`` into ``work`` in one transport call (:class:`StreamPlan`, with this call's
        headers and steps; ``sends`` without, ``recvs`` without their headers; avg divides by
        this context's size). False when the transport declines: nothing was sent or
        received and the steps are unchanged, so the caller makes the same frames with
        ``isend``/``irecv``. Only where :meth:`streams` is True."""
        return self._stream_frames(out_peer, in_peer, work, src, op, self.size, sends, recvs)

    def _stream_frames(self, out_peer: int, in_peer: int, work: npt.NDArray[Any],
                       src: npt.NDArray[Any], op: ReduceOp, divisor: int,
                       sends: list[tuple[int, int, bool, int]],
                       recvs: list[tuple[int, int, int]]) -> bool:
        """:meth:`stream` between ranks of the transport, dividing avgs by ``divisor``."""
        size = work.itemsize
        s0, r0 = self._send_step[out_peer], self._recv_step[in_peer]
        plan = StreamPlan(
            work, src, "sum" if op is ReduceOp.AVG else op.value, divisor,
            [(self._header(s0 + i, (z - a) * size), a, z, f, after)
             for i, (a, z, f, after) in enumerate(sends)],
            [(self._header(r0 + j, (z - a) * size), a, z, mode)
             for j, (a, z, mode) in enumerate(recvs)])
        if not self.transport.stream(out_peer, in_peer, plan, self.deadline):
            return False
        self._send_step[out_peer] = s0 + len(sends)
        self._recv_step[in_peer] = r0 + len(recvs)
        return True

    def scratch(self, slot: Slot, count: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        """A reusable work buffer of ``count`` elements of ``dtype`` in ``slot``.

        Buffers live as long as the communicator, so large collectives do not fault in fresh
        pages on every call; a slot's contents are undefined on entry. Each :class:`Slot` has
        one owner (see there); TypeError for anything but a :class:`Slot` (a bare number
        would bypass that ownership)."""
        if not isinstance(slot, Slot):
            raise TypeError(f"scratch slots are Slot members, got {slot!r}")
        nbytes = count * dtype.itemsize
        buf = self._scratch.get(slot)
        if buf is None or buf.size < nbytes:
            buf = np.empty(nbytes, np.uint8)
            self._scratch[slot] = buf
        return buf[:nbytes].view(dtype)

    def segments(self, start: int, stop: int, itemsize: int) -> list[tuple[int, int]]:
        """Cut ``[start, stop)`` into segments of about ``segment_bytes`` (at least one,
        possibly empty, so that every block still moves a frame)."""
        per = max(1, self.segment_bytes // max(1, itemsize))
        if stop - start <= per:
            return [(start, stop)]
        return [(s, min(s + per, stop)) for s in range(start, stop, per)]


class GroupContext(OpContext):
    """A sub-group of one collective call: ranks ``members`` of the parent context (this rank
    among them) renumbered ``0 .. len(members) - 1``, so that the algorithms written for a
    whole world (a ring pass) run among them unchanged.

    Frames go through the parent: they carry the parent call's sequence number and signature,
    and the step numbering per real peer stays the parent's, so several groups of one call
    (and the parent itself) can exchange frames with the same peer in a fixed order. The
    deadline, segment size and work buffers are the parent's."""

    def __init__(self, parent: OpContext, members: Sequence[int]) -> None:
        if parent.rank not in members:
            raise ValueError(f"rank {parent.rank} is not among the group {list(members)}")
        self.parent = parent
        self.members = [int(m) for m in members]
        self.transport = parent.transport
        self.rank = self.members.index(parent.rank)
        self.size = len(self.members)
        self.seq = parent.seq
        self.signature = parent.signature
        self.deadline = parent.deadline
        self.segment_bytes = parent.segment_bytes
        self._scratch = parent._scratch

    def isend(self, peer: int, arr: npt.NDArray[Any]) -> Request:
        return self.parent.isend(self.members[peer], arr)

    def irecv(self, peer: int, arr: npt.NDArray[Any]) -> Request:
        return self.parent.irecv(self.members[peer], arr)

    def irecv_consume(self, peer: int, nbytes: int, consume: Consumer) -> Request:
        return self.parent.irecv_consume(self.members[peer], nbytes, consume)

    def streams(self, dtype: np.dtype[Any], op: ReduceOp) -> bool:
        return self.parent.streams(dtype, op)

    def _stream_frames(self, out_peer: int, in_peer: int, work: npt.NDArray[Any],
                       src: npt.NDArray[Any], op: ReduceOp, divisor: int,
                       sends: list[tuple[int, int, bool, int]],
                       recvs: list[tuple[int, int, int]]) -> bool:
        return self.parent._stream_frames(self.members[out_peer], self.members[in_peer], work,
                                          src, op, divisor, sends, recvs)
