"""An in-process transport for tests: ``p`` ranks as threads of one process.

Sends copy the payload into a per-pair queue and complete at once; receives are matched in
posting order when waited on. Header checks and byte counters follow the Transport contract,
so algorithms can be unit-tested without sockets or MPI.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from bitcoll.communicator import Communicator
from bitcoll.errors import CommError, CommTimeoutError, PeerLostError, ProtocolError
from bitcoll.transport.base import HEADER_SIZE, FrameHeader, Request, TrafficStats, Transport


class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.queues: dict[tuple[int, int], deque[tuple[FrameHeader, bytes]]] = {
            (a, b): deque() for a in range(size) for b in range(size)}
        self.aborted: str | None = None


class _Done(Request):
    def done(self) -> bool:
        return True

    def wait(self, deadline: float) -> None:
        return None


class _Recv(Request):
    def __init__(self, t: InprocTransport, peer: int, buf: memoryview, hdr: FrameHeader):
        self.t, self.peer, self.buf, self.hdr = t, peer, buf, hdr
        self.finished = False
        self.error: CommError | None = None

    def done(self) -> bool:
        return self.finished

    def wait(self, deadline: float) -> None:
        w = self.t.world
        with w.cond:
            while not self.finished:
                if w.aborted is not None:
                    raise PeerLostError(w.aborted)
                posted = self.t.posted[self.peer]
                q = w.queues[(self.peer, self.t.rank)]
                if q and posted:
                    req = posted.popleft()
                    hdr, data = q.popleft()
                    req._deliver(hdr, data)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"receive from rank {self.peer} timed out")
                w.cond.wait(min(left, 0.05))
        if self.error is not None:
            raise self.error

    def _deliver(self, hdr: FrameHeader, data: bytes) -> None:
        self.finished = True
        msg = hdr.mismatch(self.hdr, self.peer)
        if msg is not None:
            self.error = ProtocolError(msg)
            self.t.world.aborted = f"rank {self.t.rank} aborted: {msg}"
            return
        self.buf[:] = data
        self.t.stats.add_received(HEADER_SIZE + len(data))


class InprocTransport(Transport):
    name = "inproc"

    def __init__(self, world: _World, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size
        self.stats = TrafficStats()
        self.posted: list[deque[_Recv]] = [deque() for _ in range(world.size)]

    def isend(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        with self.world.cond:
            if self.world.aborted is not None:
                raise PeerLostError(self.world.aborted)
            self.world.queues[(self.rank, peer)].append((header, bytes(payload)))
            self.stats.add_sent(HEADER_SIZE + payload.nbytes)
            self.world.cond.notify_all()
        return _Done()

    def irecv(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        req = _Recv(self, peer, payload, header)
        with self.world.cond:
            self.posted[peer].append(req)
        return req

    def abort(self, reason: str) -> None:
        with self.world.cond:
            if self.world.aborted is None:
                self.world.aborted = f"rank {self.rank} aborted: {reason}"
            self.world.cond.notify_all()

    def close(self) -> None:
        pass

    @property
    def failure(self) -> CommError | None:
        a = self.world.aborted
        return PeerLostError(a) if a is not None else None


def run_threads(size: int, fn: Callable[[Communicator], Any], timeout: float = 30.0,
                **comm_kwargs: Any) -> list[Any]:
    """Run ``fn(comm)`` on ``size`` thread-ranks; return results in rank order, re-raising the
    first rank's exception (others' errors are attached as notes)."""
    world = _World(size)
    comms = [Communicator(InprocTransport(world, r), timeout=timeout, **comm_kwargs)
             for r in range(size)]
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def target(r: int) -> None:
        try:
            results[r] = fn(comms[r])
        except BaseException as exc:
            errors[r] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    errs = [(r, e) for r, e in enumerate(errors) if e is not None]
    if errs:
        first = errs[0][1]
        for r, e in errs[1:]:
            first.add_note(f"rank {r}: {type(e).__name__}: {e}")
        raise first
    return results
