"""The transport of a one-rank world: there is no peer, so nothing is ever sent."""

from __future__ import annotations

from ..errors import CommError, UsageError
from .base import FrameHeader, Request, TrafficStats, Transport

__all__ = ["LocalTransport"]


class LocalTransport(Transport):
    """``size == 1``. Every collective completes locally; ``isend``/``irecv`` are errors."""

    name = "local"

    def __init__(self) -> None:
        self.rank = 0
        self.size = 1
        self.stats = TrafficStats()
        self._failure: CommError | None = None

    def isend(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        raise UsageError(f"rank {peer} does not exist in a world of size 1")

    def irecv(self, peer: int, payload: memoryview, header: FrameHeader) -> Request:
        raise UsageError(f"rank {peer} does not exist in a world of size 1")

    def subgroup(self, members: list[int], tag: str, timeout: float) -> Transport:
        if members != [0]:
            raise UsageError(f"a world of size 1 has no ranks {members}")
        return LocalTransport()

    def abort(self, reason: str) -> None:
        self._failure = CommError(f"communicator aborted: {reason}")

    def close(self) -> None:
        pass

    @property
    def failure(self) -> CommError | None:
        return self._failure
