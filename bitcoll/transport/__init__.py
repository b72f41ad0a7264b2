"""Transports: the byte-moving layer under the algorithms (see :mod:`bitcoll.transport.base`).

Shared by every transport: ``base`` (the contract), ``wire`` (the frame header), ``peer``
(per-peer links and the failure record), ``netio`` (socket helpers), ``local`` (one rank).
One package per concern: ``rendezvous`` (store, authentication, the TCP mesh set-up),
``tcp``, ``shm`` (shared memory inside a host, over TCP between hosts) and ``mpi``. No
transport module imports the communicator.
"""

from .base import (
    HEADER_SIZE,
    FrameHeader,
    FrameKind,
    Request,
    TrafficStats,
    Transport,
)

__all__ = [
    "HEADER_SIZE",
    "FrameHeader",
    "FrameKind",
    "Request",
    "TrafficStats",
    "Transport",
]
