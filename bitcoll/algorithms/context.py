"""The view of one collective call that algorithms work with.

An :class:`OpContext` wraps the transport for one collective: it stamps every frame with the
call's sequence number and signature, numbers the frames between each ordered pair of ranks
(the header's ``step``), and applies the call's deadline to every wait. Algorithms only ever
call ``isend``, ``irecv`` and ``wait`` here: they never see sockets or MPI.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..transport.base import Consumer, FrameHeader, Request, Transport

__all__ = ["OpContext", "as_bytes"]


def as_bytes(arr: npt.NDArray[Any]) -> memoryview:
    """A byte view of a 1-D C-contiguous array (no copy)."""
    return arr.reshape(-1).view(np.uint8).data


class OpContext:
    """One collective call on one rank: frame stamping, step numbering, the deadline.

    ``segment_bytes`` is the preferred size of one frame's payload for algorithms that cut
    large buffers into segments (pipelining).
    """

    def __init__(self, transport: Transport, seq: int, signature: int, deadline: float,
                 segment_bytes: int, scratch: dict[int, npt.NDArray[np.uint8]] | None = None
                 ) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.size = transport.size
        self.seq = seq
        self.signature = signature
        self.deadline = deadline
        self.segment_bytes = max(1, segment_bytes)
        self._scratch = {} if scratch is None else scratch
        self._send_step = [0] * transport.size
        self._recv_step = [0] * transport.size

    def _header(self, step: int, length: int) -> FrameHeader:
        return FrameHeader(seq=self.seq, step=step, signature=self.signature, length=length)

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

    def scratch(self, slot: int, count: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        """A reusable work buffer of ``count`` elements of ``dtype`` (slot ``slot``).

        Buffers live as long as the communicator, so large collectives do not fault in fresh
        pages on every call; a slot's contents are undefined on entry. Slots in use: 0-1 the
        ring's landing buffers, 2 the reduce-scatter's partial sums, 3-6 the packed direct
        pipeline (contributions, results, two segments' rows), 7 the widened (float32) copy
        of a bfloat16 vector."""
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
