"""The streamed frame exchange: a numba kernel that moves a schedule of frames over two
non-blocking socket descriptors and folds received payloads into an array, without the GIL.

A *stream* is what one rank does in a ring pass of a large collective: it sends an ordered list of
frames to one peer and receives an ordered list from another (the same peer when there are two
ranks), and a send may forward what a given receive brings (a ring forwards what it has just
reduced): its bytes leave piece by piece as the receive makes them final, while they are still in
the cache (cut through). :func:`run_stream` runs such a schedule to the end on the calling thread:
one ``poll`` loop over both descriptors, writing what the socket takes and reading what has arrived,
the way a C library's progress loop does, with no Python between the system calls and no thread
hand-off per frame.

It knows nothing of peers, failures or deadlines: it returns a status code whenever something
needs the transport's attention (a header that is not the expected one, end of file, a socket
error, the transport's wake pipe, another connection with data, or a poll that timed out) and
keeps its progress in ``state``, so the caller can look at its deadline and failure record and
call it again. The transport that calls it is :class:`bitcoll.transport.tcp.TCPTransport`.

Checksum
--------
With ``checksum`` on, every frame is followed by the little-endian CRC32C
(:mod:`bitcoll.kernels.checksum`, :data:`~bitcoll.kernels.checksum.CHECKSUM_BYTES` bytes) of
its header and payload, the layout of the transport's frame path. The kernel checksums the
bytes as they pass, while they are in the cache: a send checksums at most one piece (the bounce
buffer's size) ahead of what the socket has taken, a fold checksums each piece of the bounce
buffer just before folding it, and a landing receive what has landed once
:data:`LAND_CRC_BYTES` wait.
A receive whose checksum differs ends the call with CHECKSUM (the frame stays ``state[2]``).
There is no second pass over the memory.

System calls are bound as external C functions (``send``, ``recv``, ``poll`` of the C library
the interpreter runs on), so the kernel is cached on disk like every other kernel.
Descriptors must be non-blocking or the calls must be made with ``MSG_DONTWAIT`` (they are).
"""

from __future__ import annotations

import enum
import sys
from typing import Any, Final

import numpy as np
from numba import types

from .bits import _inline_ir, _kernel
from .checksum import CHECKSUM_BYTES, crc32c_update

__all__ = ["run_stream", "run_stream_checked", "STREAM_DTYPES", "Status", "MODE_LAND", "MODE_FOLD",
           "MODE_FOLD_DIVIDE", "OP_SUM", "OP_MAX", "OP_MIN", "STATE_SIZE", "TRAILER_SIZE",
           "S_CRC", "S_CRC_POS", "R_CRC", "R_CRC_POS", "LAND_CRC_BYTES"]

#: Element types :func:`run_stream` folds (float16 has no native arithmetic in numba).
STREAM_DTYPES: Final = frozenset(np.dtype(t) for t in (
    np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64))

# What a received frame's payload does (``r_mode``).
MODE_LAND: Final = 0  # lands in ``work`` as it is
MODE_FOLD: Final = 1  # ``work = src op payload``
MODE_FOLD_DIVIDE: Final = 2  # as MODE_FOLD, then ``work /= divisor`` (avg, at the owner)

# The fold (``op``).
OP_SUM: Final = 0
OP_MAX: Final = 1
OP_MIN: Final = 2

#: Length of the ``state`` array: sends done, bytes of the current send, receives done, bytes
#: of the current receive folded or landed (header and checksum included), bytes waiting in
#: the bounce buffer; with the checksum on, the current send's CRC32C so far (:data:`S_CRC`),
#: how many of its bytes it covers (:data:`S_CRC_POS`, header included; 0: none yet) and the
#: current receive's CRC32C so far (:data:`R_CRC`: of its header once the header is in) and
#: how many of its bytes it covers (:data:`R_CRC_POS`; 0: none yet, also when a caller hands
#: over a header it read ahead, ``state[3] = header size``).
STATE_SIZE: Final = 9
S_CRC: Final = 5
S_CRC_POS: Final = 6
R_CRC: Final = 7
R_CRC_POS: Final = 8
#: A landing receive checksums what has landed once this many bytes wait (or at the end of
#: the payload): ``recv`` returns a few kilobytes at a time on a busy link, and the CRC's
#: three-stream loop needs pieces of tens of kilobytes to run at full speed; these are still
#: in the cache.
LAND_CRC_BYTES: Final = 64 << 10
#: Length of the ``tbuf`` array: the checksum being sent, then the one being received.
TRAILER_SIZE: Final = 2 * CHECKSUM_BYTES


class Status(enum.IntEnum):
    """Return codes of :func:`run_stream`."""

    DONE = 0  # every frame sent and received
    IDLE = 1  # a poll timed out without an event (the caller looks at its deadline)
    WAKE = 2  # the wake descriptor is readable (the transport failed or is closing)
    WATCH = 3  # one of the watched descriptors is readable (an idle connection has data)
    MISMATCH = 4  # the header in ``hbuf`` is not the expected one (it was read: consumed)
    EOF = 5  # the receiving connection reached end of file
    RECV_ERROR = 6  # the receiving connection reported an error
    SEND_ERROR = 7  # the sending connection reported an error or hung up
    CHECKSUM = 8  # receive ``state[2]`` arrived complete but its checksum differs


_DONTWAIT: Final = 0x40
_NOSIGNAL: Final = 0x4000
_MORE: Final = 0x8000
_POLLIN: Final = 0x001
_POLLOUT: Final = 0x004
_POLLERR: Final = 0x008
_POLLHUP: Final = 0x010

_ssize = types.intp
_ptr = types.uintp  # addresses are passed as integers (same registers as pointers)
_c_send: Any = types.ExternalFunction("send", _ssize(types.int32, _ptr, types.uintp,
                                                     types.int32))
_c_recv: Any = types.ExternalFunction("recv", _ssize(types.int32, _ptr, types.uintp,
                                                     types.int32))
_c_poll: Any = types.ExternalFunction("poll", types.int32(_ptr, types.uint64, types.int32))

#: Whether this platform can run the kernel (Linux flag values and ``struct pollfd`` layout
#: read as two little-endian int32 per descriptor).
AVAILABLE: Final = sys.platform.startswith("linux") and sys.byteorder == "little"


@_inline_ir()
def _combine(a: Any, b: Any, op: int) -> Any:
    """``a op b`` for one element (sum, max or min)."""
    if op == OP_SUM:
        return a + b
    if op == OP_MAX:
        return a if a >= b else b
    return a if a <= b else b


@_kernel()
def _fold(work: Any, src: Any, bounce: Any, start: int, count: int, op: int, mode: int,
          divisor: Any, inplace: bool) -> None:
    """``work[start:start+count] = src[...] op bounce[:count]`` (then ``/= divisor``).
    ``inplace``: ``src`` is ``work``; then the loop reads and writes one array only, which the
    compiler vectorizes (a loop over two overlapping views it runs element by element)."""
    ws = work[start:start + count]
    bb = bounce[:count]
    if inplace:
        for i in range(count):
            ws[i] = _combine(ws[i], bb[i], op)
    else:
        ss = src[start:start + count]
        for i in range(count):
            ws[i] = _combine(ss[i], bb[i], op)
    if mode == MODE_FOLD_DIVIDE:
        for i in range(count):
            ws[i] = ws[i] / divisor


@_kernel()
def _sendable(after: int, ri: int, rdone: int, hsz: int, pend: int, total: int) -> int:
    """How many bytes of a send frame (``total`` with its header and checksum, its payload
    ending at ``pend``) may be written: all once receive ``after`` is complete or its payload
    is in; while it is the one arriving (``rdone`` bytes of it, header included, folded or
    landed), as much of the forwarded segment as is final (cut through: a piece leaves while
    it is still in the cache); nothing before."""
    if after < ri:
        return total
    if after == ri and rdone > hsz:
        return total if rdone >= pend else rdone
    return 0


@_kernel()
def run_stream(work: Any, src: Any, op: int, divisor: Any, out_fd: int, in_fd: int,
               wake_fd: int, watch: Any, s_head: Any, s_off: Any, s_len: Any, s_src: Any,
               s_after: Any, r_head: Any, r_off: Any, r_len: Any, r_mode: Any, bounce: Any,
               hbuf: Any, pfd: Any, state: Any, timeout_ms: int) -> int:
    """:func:`run_stream_checked` without checksums (the same arguments, less the last two)."""
    return run_stream_checked(work, src, op, divisor, out_fd, in_fd, wake_fd, watch, s_head,
                              s_off, s_len, s_src, s_after, r_head, r_off, r_len, r_mode,
                              bounce, hbuf, pfd, state, timeout_ms, False,
                              np.zeros(TRAILER_SIZE, np.uint8))


@_kernel()
def run_stream_checked(work: Any, src: Any, op: int, divisor: Any, out_fd: int, in_fd: int,
                       wake_fd: int, watch: Any, s_head: Any, s_off: Any, s_len: Any,
                       s_src: Any, s_after: Any, r_head: Any, r_off: Any, r_len: Any,
                       r_mode: Any, bounce: Any, hbuf: Any, pfd: Any, state: Any,
                       timeout_ms: int, checksum: bool, tbuf: Any) -> int:
    """Advance the stream; return a :class:`Status` code (progress is kept in ``state``).

    Arrays: ``work`` and ``src`` (1-D, one dtype of :data:`STREAM_DTYPES`; the same array when in
    place): sends read from ``src`` where ``s_src`` is 1, else from ``work``; receives land or fold
    into ``work``. Send ``i`` writes header ``s_head[i]`` (uint8, one header a row) and elements
    ``[s_off[i], s_off[i] + s_len[i])`` to ``out_fd``: at once where ``s_after[i]`` is -1, else it
    forwards receive ``s_after[i]`` (the same elements) and its bytes leave as that receive makes
    them final (cut through). Receive ``j`` reads a header from ``in_fd``, which must equal
    ``r_head[j]`` (else MISMATCH, the header in ``hbuf``), and ``r_len[j]`` elements, landed or
    folded at ``r_off[j]`` by ``r_mode[j]``; folds go through ``bounce`` (same dtype, its size sets
    the piece). ``watch``: int32 descriptors whose readability ends the call (WATCH); ``pfd``: int32
    scratch of ``2 * (3 + len(watch))``. ``timeout_ms``: how long one poll may block (IDLE when it
    passes without an event). ``checksum``: every frame sent and received carries its CRC32C
    after the payload (see the module docstring; ``tbuf``: uint8 scratch of
    :data:`TRAILER_SIZE`), a received one that differs ends the call with CHECKSUM.
    """
    isz = work.itemsize
    hsz = s_head.shape[1] if s_head.shape[0] > 0 else r_head.shape[1]
    ns = s_off.shape[0]
    nr = r_off.shape[0]
    wbase = work.ctypes.data
    sbase = src.ctypes.data
    bbase = bounce.ctypes.data
    hbase = hbuf.ctypes.data
    shead = s_head.ctypes.data
    rhead = r_head.ctypes.data
    piece = bounce.shape[0] * isz
    inplace = sbase == wbase
    si = state[0]
    sdone = state[1]
    ri = state[2]
    rdone = state[3]
    fill = state[4]
    tsz = CHECKSUM_BYTES if checksum else 0
    tbase = tbuf.ctypes.data
    scrc = np.uint64(state[S_CRC])
    spos = state[S_CRC_POS]
    rcrc = np.uint64(state[R_CRC])
    rpos = state[R_CRC_POS]
    status = -1
    # Whether a call may move bytes now: cleared when one moves fewer than asked (the socket
    # buffer is full, or empty), set again when poll says the socket is ready: no call is
    # made that would only say "try again".
    send_ready = True
    recv_ready = True
    while status < 0:
        moved = True
        while moved:
            moved = False
            # The send side: the current frame, header then payload.
            if send_ready and si < ns:
                pend = hsz + s_len[si] * isz
                total = pend + tsz
                limit = _sendable(s_after[si], ri, rdone, hsz, pend, total)
                if sdone < limit:
                    if checksum and spos == 0:
                        scrc = crc32c_update(0, shead + si * hsz, hsz)
                        spos = hsz
                    if sdone < hsz:
                        want = hsz - sdone
                        k = _c_send(out_fd, shead + si * hsz + sdone, want,
                                    _DONTWAIT | _NOSIGNAL | (_MORE if total > hsz else 0))
                    elif sdone < pend:
                        base = sbase + s_off[si] * isz - hsz if s_src[si] else \
                            wbase + s_off[si] * isz - hsz  # frame offset -> address
                        want = min(limit, pend) - sdone
                        if checksum:
                            # At most a piece ahead of the socket, still in the cache when
                            # the kernel copies it.
                            want = min(want, piece)
                            if spos < sdone + want:
                                scrc = crc32c_update(scrc, base + spos, sdone + want - spos)
                                spos = sdone + want
                        k = _c_send(out_fd, base + sdone, want, _DONTWAIT | _NOSIGNAL)
                    else:  # the checksum
                        for b in range(CHECKSUM_BYTES):
                            tbuf[b] = (scrc >> np.uint64(8 * b)) & np.uint64(0xFF)
                        want = total - sdone
                        k = _c_send(out_fd, tbase + (sdone - pend), want,
                                    _DONTWAIT | _NOSIGNAL)
                    if k < want:
                        send_ready = False
                    if k > 0:
                        moved = True
                        sdone += k
                        if sdone == total:
                            si += 1
                            sdone = 0
                            spos = 0
            # The receive side: the current frame's header, then its payload.
            if recv_ready and ri < nr:
                pend = hsz + r_len[ri] * isz
                total = pend + tsz
                if checksum and rpos == 0 and rdone >= hsz:  # a header the caller read
                    rcrc = crc32c_update(0, rhead + ri * hsz, hsz)
                    rpos = hsz
                want = min(piece, pend - rdone)  # a fold's piece
                if rdone < hsz:  # where the next bytes go, and how many are wanted
                    addr, n = hbase + rdone, hsz - rdone
                elif rdone >= pend:
                    addr, n = tbase + CHECKSUM_BYTES + (rdone - pend), total - rdone
                elif r_mode[ri] == MODE_LAND:
                    addr, n = wbase + r_off[ri] * isz + (rdone - hsz), pend - rdone
                else:
                    addr, n = bbase + fill, want - fill
                if rdone < total:
                    k = _c_recv(in_fd, addr, n, _DONTWAIT)
                    if k == 0:
                        status = Status.EOF
                        break
                    if k < n:
                        recv_ready = False
                    if k > 0:
                        moved = True
                        if rdone < hsz:
                            rdone += k
                            if rdone == hsz:
                                for b in range(hsz):
                                    if hbuf[b] != r_head[ri, b]:
                                        status = Status.MISMATCH
                                if status >= 0:
                                    break
                                if checksum:
                                    rcrc = crc32c_update(0, hbase, hsz)
                                    rpos = hsz
                        elif rdone >= pend:
                            rdone += k
                        elif r_mode[ri] == MODE_LAND:
                            rdone += k
                            if checksum and (rdone - rpos >= LAND_CRC_BYTES or rdone == pend):
                                rcrc = crc32c_update(rcrc, wbase + r_off[ri] * isz
                                                     + (rpos - hsz), rdone - rpos)
                                rpos = rdone
                        else:
                            fill += k
                            if fill == want:
                                if checksum:
                                    rcrc = crc32c_update(rcrc, bbase, want)
                                _fold(work, src, bounce, r_off[ri] + (rdone - hsz) // isz,
                                      want // isz, op, r_mode[ri], divisor, inplace)
                                rdone += want
                                fill = 0
                if rdone == total:
                    if checksum:
                        got = np.uint64(0)
                        for b in range(CHECKSUM_BYTES):
                            got |= np.uint64(tbuf[CHECKSUM_BYTES + b]) << np.uint64(8 * b)
                        if got != rcrc:
                            status = Status.CHECKSUM
                            break
                    moved = True
                    ri += 1
                    rdone = 0
                    rpos = 0
        if status >= 0:
            break
        if si >= ns and ri >= nr:
            status = Status.DONE
            break
        # Nothing moved: wait for the sockets (and the wake pipe, and the watched ones).
        n = 0
        pfd[0] = wake_fd
        pfd[1] = _POLLIN
        n += 1
        send_slot = -1
        recv_slot = -1
        if si < ns and sdone < _sendable(s_after[si], ri, rdone, hsz, hsz + s_len[si] * isz,
                                         hsz + s_len[si] * isz + tsz):
            send_slot = n
            pfd[2 * n] = out_fd
            pfd[2 * n + 1] = _POLLOUT
            n += 1
        if ri < nr:
            recv_slot = n
            pfd[2 * n] = in_fd
            pfd[2 * n + 1] = _POLLIN
            n += 1
        first_watch = n
        for w in range(watch.shape[0]):
            pfd[2 * n] = watch[w]
            pfd[2 * n + 1] = _POLLIN
            n += 1
        got = _c_poll(pfd.ctypes.data, n, timeout_ms)
        if got == 0:
            status = Status.IDLE
            break
        if got < 0:
            status = Status.IDLE  # interrupted by a signal: the caller looks again
            break
        if (pfd[1] >> 16) & 0xFFFF:
            status = Status.WAKE
            break
        for w in range(first_watch, n):
            if (pfd[2 * w + 1] >> 16) & 0xFFFF:
                status = Status.WATCH
        if status >= 0:
            break
        recv_ev = (pfd[2 * recv_slot + 1] >> 16) & 0xFFFF if recv_slot >= 0 else 0
        send_ev = (pfd[2 * send_slot + 1] >> 16) & 0xFFFF if send_slot >= 0 else 0
        if recv_ev:
            recv_ready = True
        if send_ev:
            send_ready = True
        if recv_ev & _POLLERR:
            status = Status.RECV_ERROR
            break
        # A broken sending side is reported once what has arrived is read (it may hold the
        # peer's abort notice).
        if send_ev & (_POLLERR | _POLLHUP) and not recv_ev & _POLLIN:
            status = Status.SEND_ERROR
            break
    state[0] = si
    state[1] = sdone
    state[2] = ri
    state[3] = rdone
    state[4] = fill
    state[S_CRC] = np.int64(scrc)
    state[S_CRC_POS] = spos
    state[R_CRC] = np.int64(rcrc)
    state[R_CRC_POS] = rpos
    return status
