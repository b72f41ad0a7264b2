"""Transports: the byte-moving layer under the algorithms (see :mod:`bitcoll.transport.base`)."""

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
