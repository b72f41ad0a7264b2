"""Socket helpers shared by the TCP transport, its set-up and the rendezvous store: exact
reads, frame writes, and the one retry back-off of the transports' connect and poll loops."""

from __future__ import annotations

import socket
import time
from typing import Final

__all__ = ["NOSIGNAL", "DONTWAIT", "WAITALL", "recv_exact", "recv_bytes", "send_some",
           "send_all_parts", "Backoff"]

NOSIGNAL: Final = getattr(socket, "MSG_NOSIGNAL", 0)
DONTWAIT: Final = getattr(socket, "MSG_DONTWAIT", 0)
WAITALL: Final = getattr(socket, "MSG_WAITALL", 0)


def recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill ``view`` from the blocking ``sock``; return the number of bytes read, short only
    when the peer closed the connection first. OSError (TimeoutError at the socket's timeout)
    as the socket raises it."""
    n = len(view)
    if n == 0:
        return 0
    got = sock.recv_into(view, n, WAITALL)
    while 0 < got < n:
        k = sock.recv_into(view[got:], n - got, WAITALL)
        if k == 0:
            break
        got += k
    return got


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from the blocking ``sock`` (:func:`recv_exact`); ConnectionError
    when the peer closes the connection first (the message says after how many bytes)."""
    buf = bytearray(n)
    got = recv_exact(sock, memoryview(buf))
    if got < n:
        raise ConnectionError(f"the peer closed the connection (after {got} of {n} bytes)")
    return bytes(buf)


def send_some(sock: socket.socket, parts: list[bytes | memoryview], flags: int) -> int:
    """One ``sendmsg`` of the non-empty ``parts``; the number of bytes the kernel took (0
    when, with ``MSG_DONTWAIT``, nothing fits right now)."""
    try:
        return sock.sendmsg(parts, (), flags) if len(parts) > 1 else sock.send(parts[0], flags)
    except BlockingIOError:
        return 0


def send_all_parts(sock: socket.socket, parts: list[bytes | memoryview], sent: int = 0) -> None:
    """Write ``parts`` completely (blocking), minus the ``sent`` bytes already written: one
    ``sendmsg`` in the common case."""
    if sent == 0:
        sent = send_some(sock, parts, NOSIGNAL)
    for part in parts:
        n = len(part)
        if sent >= n:
            sent -= n
            continue
        sock.sendall(part[sent:], NOSIGNAL)
        sent = 0


class Backoff:
    """Pauses between the attempts of a retry loop: ``first`` seconds, doubling up to
    ``cap``, never past the loop's deadline."""

    __slots__ = ("_cap", "_delay")

    def __init__(self, first: float = 0.01, cap: float = 0.25) -> None:
        self._delay = first
        self._cap = cap

    @property
    def delay(self) -> float:
        """The next pause in seconds."""
        return self._delay

    def next(self) -> float:
        """Return the next pause (seconds) and double the one after it, up to ``cap``."""
        d = self._delay
        self._delay = min(2 * d, self._cap)
        return d

    def sleep(self, deadline: float) -> None:
        """Sleep the next pause, or until ``deadline`` (``time.monotonic()``) if sooner."""
        time.sleep(max(0.0, min(self.next(), deadline - time.monotonic())))
