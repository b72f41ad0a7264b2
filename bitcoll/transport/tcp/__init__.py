"""The TCP transport: bitcoll frames over one TCP connection per pair of ranks
(:mod:`.transport`; its mesh is built by :mod:`bitcoll.transport.rendezvous`).
"""

from __future__ import annotations

from .transport import (
    RECEIVE_BUFFER_BYTES,
    SEND_BUFFER_BYTES,
    PeerState,
    RxPhase,
    TCPTransport,
)

__all__ = [
    "TCPTransport",
    "SEND_BUFFER_BYTES",
    "RECEIVE_BUFFER_BYTES",
    "PeerState",
    "RxPhase",
]
