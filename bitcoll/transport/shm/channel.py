"""Shared-memory channels between two ranks of one host (the TCP backend's fast path).

:class:`~bitcoll.transport.hybrid.HybridTransport` gives every pair of ranks that share a
host one :class:`ShmChannel`: a shared segment with one ring per direction, and four named
pipes (FIFOs) as doorbells. This module holds the segment, the rings, the doorbells and the
pair's set-up; the transport (threads, requests, ordering, failure) is in
:mod:`bitcoll.transport.hybrid`.

Segment layout
--------------
One file per pair, created by the lower rank (*side 0*), mapped by both::

    [0, 64 KiB)              pair header: magic "BITCSHM1", version, ring size, a 16-byte
                             nonce (it travels in the authenticated offer, so the other side
                             knows the file is the one offered), and per side: its state
                             (open / aborted), the length and UTF-8 text of its abort reason
    then per direction d     (d = 0: side 0 -> side 1, d = 1: side 1 -> side 0)
      4 KiB control page     three u64 counters, each on its own cache lines: ``written``
                             (the sender's), ``read`` and ``acked`` (the receiver's)
      ring_bytes             the ring (default :data:`DEFAULT_RING_BYTES`)

A ring is a single-producer single-consumer byte stream of *records*, each starting on an
8-byte boundary: a record word (mode, 8 bytes), the frame's 40-byte header, then either the
payload itself (*inline*) or, for a *single-copy* record, the payload's address in the
sender (8 bytes), then padding to a multiple of 8. The sender copies at ``written %
ring_bytes`` and advances ``written``; the receiver reads at ``read % ring_bytes`` and
advances ``read``. Counters only grow, only their owner writes them, and each is published
after every chunk of at most :data:`CHUNK_BYTES`, so a large inline frame streams through a
ring smaller than itself and the receiver reads the bytes while they are still in the shared
cache. Ordering relies on x86-64's total store order (data stores are seen before the counter
store that publishes them, loads are not reordered with older loads); other architectures do
not use shared memory (:func:`supported`).

Single copy
-----------
An inline frame is copied twice (into the ring, out of it). When the kernel lets each side
read the other's memory (``process_vm_readv``: same user, ptrace access allowed, one PID
namespace; probed at set-up by reading 16 random bytes the other side published, see
:class:`Probe`), a frame of at least :data:`SINGLE_COPY_MIN_BYTES` goes as a single-copy
record instead: the receiver copies the payload straight from the sender's buffer into its
own (or, for a consumer, through a small bounce buffer), in pieces of
:data:`SINGLE_COPY_PIECE_BYTES`, then advances ``acked``; the sender's request completes when
``acked`` covers its record (the buffer must stay unchanged until then, which the transport
contract already asks). Pairs where the probe fails use inline records only.

Doorbells
---------
Four FIFOs per pair, each with one writing and one reading process: "data" (the sender rings
after publishing bytes; the receiver waits on it) and "space" (the receiver rings after
consuming bytes or acknowledging a record; a sender with a full ring, or waiting for its
acknowledgement, waits on it), for each direction. A bell is one byte written without
blocking (a full pipe already guarantees a wake-up); a waiter drains its FIFO, then re-checks
the counters, so no wake-up is lost (the bell is always rung: deciding to skip it would need
a store-load fence Python cannot issue). Waiting is ``poll`` on the FIFO and the transport's
own wake-up pipe, with a timeout (:data:`WATCH_SECONDS`) after which the waiter checks the TCP
side's health. Measured against a futex on a shared word (ctypes syscall) and a byte over the
pair's TCP connection, a FIFO round trip between two processes was the fastest here (8-16 us
against 23-82 us and 23-42 us, ``results/shm/doorbell.txt``), needs nothing outside the
standard library, and gives death detection for free: when a peer exits or is killed the
kernel closes its write ends and the reader sees end of file at once.

Set-up (:func:`offer`, :func:`accept`, :func:`finish_offer`, :func:`confirm`)
------------------------------------------------------------------------------
Side 0 creates the segment (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600, space reserved with
``posix_fallocate`` so that a full ``/dev/shm`` is an error now rather than a SIGBUS later)
and the four FIFOs (mode 0600) under one unguessable name (128 random bits,
``bitcoll-shm-<job id>-<random>-<kind>`` in ``/dev/shm``), maps the segment, opens its ends of
the FIFOs, and sends the name, the nonce and its probe to side 1 over their authenticated TCP
connection (the *offer*). Side 1 opens each file with ``O_NOFOLLOW | O_NONBLOCK``, refuses it
unless it is a regular file (FIFO) of this user with no permission for anybody else and
(segment) of the expected size and header, maps it, opens its FIFO ends, **unlinks all five
names**, probes side 0 and sends its own probe and result (the *answer*). Side 0 unlinks the
names too (harmless when gone; also on every failure path), probes side 1 and sends its
result (the *confirmation*). From the answer on nothing of the pair is left in ``/dev/shm``
whatever happens to either process; names can be left only if side 0 is killed between
creating the files and sending the offer, or both sides die during the set-up. A pair that
cannot use shared memory (no ``/dev/shm``, full, another mount namespace, a refused file)
falls back to TCP for that pair only; the answer makes both sides agree.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import re
import secrets
import select
import stat
import struct
import weakref
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "SHM_DIR",
    "DEFAULT_RING_BYTES",
    "CHUNK_BYTES",
    "WATCH_SECONDS",
    "ShmChannel",
    "ShmSetupError",
    "Offer",
    "supported",
    "offer",
    "accept",
    "finish_offer",
    "confirm",
    "discard_offer",
    "vm_read",
    "Probe",
    "segment_names",
]

#: Where segments and doorbells are created (tmpfs).
SHM_DIR: Final = "/dev/shm"
#: Bytes of each direction's ring. Four rings of 2 MiB per host stay in a 32 MiB L3 cache.
DEFAULT_RING_BYTES: Final = 2 << 20
#: Most bytes copied into or out of a ring before its counter is published (and the bell
#: rung); also the largest piece handed to a consumer.
CHUNK_BYTES: Final = 256 << 10
#: How long a waiter sleeps before it looks at the TCP side's health again.
WATCH_SECONDS: Final = 0.05
#: Frames of at least this many payload bytes go by single copy when the kernel lets the
#: receiver read the sender's memory (``process_vm_readv``; probed at set-up). Smaller ones
#: fit the default ring whole and go inline: the sender's request completes as soon as the
#: record is in the ring, where a single-copy send waits for the receiver's acknowledgement
#: (two thread wake-ups per frame), which costs more than the second copy below this size
#: (``results/shm_small``).
SINGLE_COPY_MIN_BYTES: Final = 2 << 20
#: Bytes a single-copy receive reads per call into the receive buffer (the transport checks
#: for failures between calls), and per call into the bounce buffer of a consumer.
SINGLE_COPY_PIECE_BYTES: Final = 4 << 20
SINGLE_COPY_CONSUME_BYTES: Final = 1 << 20
#: Longest abort reason kept in the pair header (per side).
MAX_REASON_BYTES: Final = 16 << 10

MAGIC: Final = b"BITCSHM1"
VERSION: Final = 1
HEADER_BYTES: Final = 64 << 10
CTL_BYTES: Final = 4096
_HEAD = struct.Struct("<8sIIQ16s")  # magic, version, flags, ring bytes, nonce
_SIDE_OFF: Final = 64  # per side: state u32, reason length u32, at 64 + 64 * side
_REASON_OFF: Final = 4096  # per side: reason text at 4096 + side * MAX_REASON_BYTES
_WRITTEN: Final = 0  # u64 index of ``written`` in a control page
_READ: Final = 16  # u64 index of ``read`` (128 bytes further: another cache line pair)
_ACKED: Final = 32  # u64 index of ``acked``: single-copy frames the receiver has copied
STATE_OPEN: Final = 0
STATE_ABORTED: Final = 2

#: The suffixes of a pair's files: the segment, then the doorbells "<direction>-<kind>"
#: (direction 0 = side 0 -> side 1).
KINDS: Final = ("seg", "0d", "0s", "1d", "1s")
_NAME = re.compile(r"^bitcoll-shm-[0-9a-f]{16}-[0-9a-f]{32}$")

Bytes = npt.NDArray[np.uint8]


class ShmSetupError(Exception):
    """This pair cannot use shared memory (the reason is the message); it uses TCP."""


def supported() -> bool:
    """Whether this machine's memory ordering suits the rings: x86-64 (total store order).
    (Whether ``/dev/shm`` can be used is found out per pair at set-up.)"""
    return platform.machine().lower() in ("x86_64", "amd64")


def segment_names(base: str) -> list[str]:
    """The paths of the five files of the pair named ``base``."""
    return [os.path.join(SHM_DIR, f"{base}-{k}") for k in KINDS]


def _unlink_all(base: str) -> None:
    for path in segment_names(base):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _align8(n: int) -> int:
    return (n + 7) & ~7


def _check_private(fd: int, path: str, regular: bool, size: int | None = None) -> None:
    """Refuse a file that is not this user's private regular file (FIFO), like
    :func:`bitcoll.transport.auth.read_secret_file` does."""
    st = os.fstat(fd)
    kind_ok = stat.S_ISREG(st.st_mode) if regular else stat.S_ISFIFO(st.st_mode)
    if not kind_ok or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ShmSetupError(f"{path} is not a private {'file' if regular else 'FIFO'} of "
                            f"this user (uid {st.st_uid}, mode {st.st_mode & 0o7777:o})")
    if size is not None and st.st_size != size:
        raise ShmSetupError(f"{path} has {st.st_size} bytes, expected {size}")


def segment_bytes(ring_bytes: int) -> int:
    """Size of a pair's segment file."""
    return HEADER_BYTES + 2 * (CTL_BYTES + ring_bytes)


# --------------------------------------------------------------------------------------------
# The channel
# --------------------------------------------------------------------------------------------


class ShmChannel:
    """One pair's mapped segment and doorbells, seen from ``side`` (0 or 1).

    The *out* ring is the one this side writes, the *in* ring the one it reads. Only one
    thread may write the out ring at a time and only one read the in ring (the transport's
    per-peer locks and threads guarantee it). Counters are read and written through 8-byte
    aligned memoryview elements (single loads and stores).
    """

    def __init__(self, peer: int, side: int, mm: mmap.mmap, ring_bytes: int,
                 fds: dict[str, int]) -> None:
        self.peer = peer
        self.side = side
        self.ring_bytes = ring_bytes
        self._mm = mm
        out_d, in_d = side, 1 - side
        base = [HEADER_BYTES + d * (CTL_BYTES + ring_bytes) for d in (0, 1)]
        self._mv = memoryview(mm)
        self._ctl_out = self._mv[base[out_d]:base[out_d] + CTL_BYTES].cast("Q")
        self._ctl_in = self._mv[base[in_d]:base[in_d] + CTL_BYTES].cast("Q")
        self.ring_out: Bytes = np.frombuffer(mm, np.uint8, ring_bytes, base[out_d] + CTL_BYTES)
        self.ring_in: Bytes = np.frombuffer(mm, np.uint8, ring_bytes, base[in_d] + CTL_BYTES)
        self.ring_in_mv = self._mv[base[in_d] + CTL_BYTES:base[in_d] + CTL_BYTES + ring_bytes]
        self.ring_out_mv = self._mv[base[out_d] + CTL_BYTES:base[out_d] + CTL_BYTES
                                    + ring_bytes]
        self._sides = self._mv[_SIDE_OFF:_SIDE_OFF + 128].cast("I")
        # Doorbells: ring the peer's "data" (it reads my out ring) and "space" (I consumed
        # its bytes); wait on my "data" (in ring) and "space" (out ring).
        self.data_out = fds[f"{out_d}d"]  # write end
        self.space_out = fds[f"{out_d}s"]  # read end: space in my out ring
        self.data_in = fds[f"{in_d}d"]  # read end: data in my in ring
        self.space_in = fds[f"{in_d}s"]  # write end
        self._fds = list(fds.values())
        _OPEN.add(self)
        self.written = int(self._ctl_out[_WRITTEN])  # my out counter (only I write it)
        self.read = int(self._ctl_in[_READ])  # my in counter (only I write it)
        self.eof = False  # the peer's doorbell ends were closed: it exited or closed
        self.closed = False
        #: The peer's pid when this side can read its memory (single-copy frames from it).
        self.peer_pid = 0
        #: Whether the peer can read this side's memory: large frames go by single copy.
        self.single_copy = False
        self.copies_sent = 0  # single-copy frames written (the peer acknowledges each)

    # ------------------------------------------------------------ counters and bells

    def out_free(self) -> int:
        """Bytes the out ring can take now."""
        return self.ring_bytes - (self.written - int(self._ctl_out[_READ]))

    def in_avail(self) -> int:
        """Bytes published in the in ring and not yet read."""
        return int(self._ctl_in[_WRITTEN]) - self.read

    def written_in(self) -> int:
        """The in ring's ``written`` counter (the peer's)."""
        return int(self._ctl_in[_WRITTEN])

    def publish_written(self, n: int) -> None:
        """Advance ``written`` by ``n`` bytes already copied, and ring the data bell."""
        self.written += n
        self._ctl_out[_WRITTEN] = self.written
        ring(self.data_out)

    def publish_read(self, n: int, acked: bool = False) -> None:
        """Advance ``read`` by ``n`` bytes consumed (and ``acked`` by one: a single-copy
        frame was copied), and ring the space bell."""
        self.read += n
        if acked:
            self._ctl_in[_ACKED] = int(self._ctl_in[_ACKED]) + 1
        self._ctl_in[_READ] = self.read
        ring(self.space_in)

    def acked_out(self) -> int:
        """Single-copy frames of this side that the peer has copied."""
        return int(self._ctl_out[_ACKED])

    # ------------------------------------------------------------ copies

    def read_in(self, pos: int, n: int) -> bytes:
        """``n`` bytes of the in ring from stream position ``pos`` (wrapping)."""
        off = pos % self.ring_bytes
        first = min(n, self.ring_bytes - off)
        data = bytes(self.ring_in_mv[off:off + first])
        if first < n:
            data += bytes(self.ring_in_mv[:n - first])
        return data

    # ------------------------------------------------------------ abort state

    def set_aborted(self, reason: bytes) -> None:
        """Record this side's abort and its reason, then ring both bells to the peer."""
        if self.closed:
            return
        text = reason[:MAX_REASON_BYTES]
        at = _REASON_OFF + self.side * MAX_REASON_BYTES
        self._mv[at:at + len(text)] = text
        self._sides[16 * self.side + 1] = len(text)
        self._sides[16 * self.side] = STATE_ABORTED
        ring(self.data_out)
        ring(self.space_in)

    def peer_abort_reason(self) -> str | None:
        """The peer's abort reason once it aborted, else None."""
        s = 1 - self.side
        if self._sides[16 * s] != STATE_ABORTED:
            return None
        n = min(int(self._sides[16 * s + 1]), MAX_REASON_BYTES)
        at = _REASON_OFF + s * MAX_REASON_BYTES
        return bytes(self._mv[at:at + n]).decode("utf-8", errors="replace")

    # ------------------------------------------------------------ waiting

    def drain(self, fd: int) -> None:
        """Empty a doorbell FIFO (it holds at most 64 KiB, so one read takes everything
        rung so far); sets :attr:`eof` when the peer's end is closed."""
        try:
            if not os.read(fd, 1 << 16):
                self.eof = True
        except BlockingIOError:
            pass
        except OSError:
            self.eof = True

    def close(self) -> None:
        """Close the doorbells and unmap the segment. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for mv in (self._ctl_out, self._ctl_in, self._sides, self.ring_in_mv, self.ring_out_mv,
                   self._mv):
            with contextlib.suppress(BufferError):
                mv.release()
        del self.ring_out, self.ring_in
        with contextlib.suppress(BufferError):  # a consumer kept a view: left to the GC
            self._mm.close()


#: Open channels of this process: a child forked from it closes their doorbells at once.
_OPEN: weakref.WeakSet[ShmChannel] = weakref.WeakSet()


def _forget_in_child() -> None:
    """After ``fork`` (a DataLoader worker, a subprocess): the child must not hold the
    doorbells, or the peers would not see end of file when this rank dies. Its copies of
    the channels are marked closed (their mappings stay until the child exits)."""
    for ch in list(_OPEN):
        for fd in ch._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        ch._fds = []
        ch.closed = True


os.register_at_fork(after_in_child=_forget_in_child)


def ring(fd: int) -> None:
    """Ring a doorbell: one byte, never blocking (a full pipe wakes its reader anyway; a
    closed reader means the peer is gone, which its own end reports)."""
    try:  # noqa: SIM105  (contextlib.suppress costs a microsecond per bell)
        os.write(fd, b"\0")
    except OSError:  # BlockingIOError, BrokenPipeError
        pass


def wait_bell(poller: select.poll, timeout: float) -> list[tuple[int, int]]:
    """``poll`` for ``timeout`` seconds; the ready (fd, events)."""
    try:
        return poller.poll(max(0, int(timeout * 1000)))
    except InterruptedError:  # pragma: no cover - retried by the caller's loop
        return []


# --------------------------------------------------------------------------------------------
# Single copy between processes (process_vm_readv)
# --------------------------------------------------------------------------------------------


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc: ctypes.CDLL | None = None


def _vm_readv() -> Any:
    """libc's ``process_vm_readv`` (ctypes releases the GIL during the call), or None."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, "process_vm_readv", None)
    if fn is not None:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                       ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


def vm_read(pid: int, dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` of process ``pid`` to address ``dst`` here.
    OSError (errno ESRCH: the process is gone) on failure."""
    fn = _vm_readv()
    if fn is None:  # pragma: no cover - every Linux libc since 2.15 has it
        raise OSError(errno.ENOSYS, "process_vm_readv is not available")
    done = 0
    while done < n:
        local = _IoVec(dst + done, n - done)
        remote = _IoVec(src + done, n - done)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(err, os.strerror(err))
        done += got


class Probe:
    """16 random bytes at a known address: the peer proves it can read this process's
    memory by reading them (:func:`probe_peer`)."""

    def __init__(self) -> None:
        self.data = secrets.token_bytes(16)
        self.buf = ctypes.create_string_buffer(self.data, 16)
        self.address = ctypes.addressof(self.buf)


def probe_peer(pid: int, address: int, expect: bytes) -> bool:
    """Whether this process can read ``expect`` at ``address`` of process ``pid`` (same
    user, ptrace access allowed, same PID namespace)."""
    if pid <= 0 or address == 0:
        return False
    got = ctypes.create_string_buffer(16)
    try:
        vm_read(pid, ctypes.addressof(got), address, 16)
    except OSError:
        return False
    return got.raw == expect


# --------------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------------

#: Bytes of the offer (side 0 -> side 1), the answer (side 1 -> side 0) and the confirmation
#: (side 0 -> side 1).
OFFER_BYTES: Final = 256
ANSWER_BYTES: Final = 256
CONFIRM_BYTES: Final = 8
# status, version, ring bytes, nonce, base name, pid, probe address, probe bytes
_OFFER = struct.Struct("<IIQ16s96sIQ16s")
# status, why (UTF-8), pid, probe address, probe bytes, whether side 1 can read side 0
_ANSWER = struct.Struct("<I160sIQ16sI")
_CONFIRM = struct.Struct("<II")  # whether side 0 can read side 1, 0


@dataclass
class Offer:
    """Side 0's half-built pair: its mapping and FIFO ends, the base name, the offer."""

    base: str
    mm: mmap.mmap | None
    fds: dict[str, int]
    message: bytes
    ring_bytes: int
    probe: Probe | None = None

    def release(self) -> None:
        """Close everything and unlink the names (failure paths)."""
        _unlink_all(self.base)
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = {}
        if self.mm is not None:
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.mm = None


def _refusal(base: str, ring_bytes: int, why: str) -> Offer:
    msg = _OFFER.pack(0, VERSION, ring_bytes, b"", why.encode()[:96], 0, 0,
                      b"").ljust(OFFER_BYTES, b"\0")
    return Offer(base, None, {}, msg, ring_bytes)


def offer(job_id: int, ring_bytes: int) -> Offer:
    """Side 0: create, map and open a pair's files; the offer to send (an offer of status 0,
    saying why, when shared memory is unavailable here)."""
    base = f"bitcoll-shm-{job_id & (2**64 - 1):016x}-{secrets.token_hex(16)}"
    nonce = secrets.token_bytes(16)
    size = segment_bytes(ring_bytes)
    made = Offer(base, None, {}, b"", ring_bytes, Probe())
    paths = dict(zip(KINDS, segment_names(base), strict=True))
    try:
        fd = os.open(paths["seg"], os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, size)
            made.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _HEAD.pack_into(made.mm, 0, MAGIC, VERSION, 0, ring_bytes, nonce)
        for kind in KINDS[1:]:
            os.mkfifo(paths[kind], 0o600)
            # Side 0 writes "0d" and "1s" (O_RDWR: opening never blocks nor fails for lack
            # of a reader, and it does not keep side 1 from seeing end of file when side 0
            # exits) and reads "0s" and "1d".
            writes = kind in ("0d", "1s")
            flags = (os.O_RDWR if writes else os.O_RDONLY) | os.O_NONBLOCK | os.O_NOFOLLOW \
                | os.O_CLOEXEC
            made.fds[kind] = os.open(paths[kind], flags)
            _check_private(made.fds[kind], paths[kind], regular=False)
    except (OSError, ShmSetupError) as exc:
        made.release()
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return _refusal(base, ring_bytes, f"cannot create a segment in {SHM_DIR}: {why}")
    assert made.probe is not None
    made.message = _OFFER.pack(1, VERSION, ring_bytes, nonce, base.encode(), os.getpid(),
                               made.probe.address, made.probe.data).ljust(OFFER_BYTES, b"\0")
    return made


def _answer(ok: bool, why: str = "", probe: Probe | None = None, can: bool = False) -> bytes:
    return _ANSWER.pack(1 if ok else 0, why.encode()[:160], os.getpid() if probe else 0,
                        probe.address if probe else 0, probe.data if probe else b"",
                        int(can)).ljust(ANSWER_BYTES, b"\0")


def accept(peer: int, message: bytes, probe: Probe | None = None,
           single_copy: bool = True) -> tuple[ShmChannel | None, bytes, str]:
    """Side 1: open the pair offered in ``message`` (checked as the module docstring says),
    unlink its names, and find out whether it can read side 0's memory (never when
    ``single_copy`` is False: this side then neither reads side 0's buffers nor offers its
    own). Returns the channel (None when the pair uses TCP), the answer to send (it carries
    ``probe``, which must stay alive until :func:`confirm` is called) and why (empty on
    success)."""
    status, version, ring_bytes, nonce, raw, pid, paddr, pdata = _OFFER.unpack_from(message)
    if status != 1:
        why = raw.rstrip(b"\0").decode("utf-8", errors="replace")
        return None, _answer(False, why), why
    base = raw.rstrip(b"\0").decode("ascii", errors="replace")
    if version != VERSION or not _NAME.match(base) or not 0 < ring_bytes <= 1 << 40 or \
            ring_bytes % 8:
        why = f"rank {peer} offered a segment this version cannot use ({base!r})"
        return None, _answer(False, why), why
    paths = dict(zip(KINDS, segment_names(base), strict=True))
    fds: dict[str, int] = {}
    mm: mmap.mmap | None = None
    size = segment_bytes(ring_bytes)
    try:
        fd = os.open(paths["seg"], os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            _check_private(fd, paths["seg"], regular=True, size=size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, ver, _, ring2, nonce2 = _HEAD.unpack_from(mm, 0)
        if magic != MAGIC or ver != VERSION or ring2 != ring_bytes or nonce2 != nonce:
            raise ShmSetupError(f"{paths['seg']} is not the segment rank {peer} offered")
        # Read ends first ("0d", "1s" are side 0's to write), then write ends (side 0
        # already holds their read ends, so opening them neither blocks nor fails).
        for kind in ("0d", "1s", "0s", "1d"):
            writes = kind in ("0s", "1d")
            flags = (os.O_WRONLY if writes else os.O_RDONLY) | os.O_NONBLOCK | os.O_NOFOLLOW \
                | os.O_CLOEXEC
            fds[kind] = os.open(paths[kind], flags)
            _check_private(fds[kind], paths[kind], regular=False)
    except (OSError, ShmSetupError) as exc:
        for f in fds.values():
            os.close(f)
        if mm is not None:
            mm.close()
        if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
            why = f"rank {peer}'s segment is not visible here (another /dev/shm)"
        else:
            why = f"refused rank {peer}'s segment: {exc}"
        _unlink_all(base)
        return None, _answer(False, why), why
    _unlink_all(base)
    ch = ShmChannel(peer, 1, mm, ring_bytes, fds)
    can_read = single_copy and probe_peer(pid, paddr, pdata)
    ch.peer_pid = pid if can_read else 0
    return ch, _answer(True, "", probe if single_copy else None, can_read), ""


def finish_offer(made: Offer, peer: int, answer: bytes,
                 single_copy: bool = True) -> tuple[ShmChannel | None, bytes, str]:
    """Side 0: the answer arrived; unlink the names (side 1 did already) and return the
    channel (or None and why when side 1 refused) and the confirmation to send. With
    ``single_copy`` False this side neither reads side 1's buffers nor lets it read its own."""
    _unlink_all(made.base)
    status, raw, pid, paddr, pdata, can1 = _ANSWER.unpack_from(answer)
    if status != 1 or made.mm is None:
        made.release()
        return None, _CONFIRM.pack(0, 0), raw.rstrip(b"\0").decode("utf-8", errors="replace")
    ch = ShmChannel(peer, 0, made.mm, made.ring_bytes, made.fds)
    made.mm, made.fds = None, {}
    can_read = single_copy and probe_peer(pid, paddr, pdata)
    ch.peer_pid = pid if can_read else 0
    ch.single_copy = single_copy and bool(can1)  # side 1 reads this side's buffers
    return ch, _CONFIRM.pack(int(can_read), 0), ""


def confirm(ch: ShmChannel | None, message: bytes) -> None:
    """Side 1: side 0's confirmation arrived (whether it can read this side's buffers)."""
    can0, _ = _CONFIRM.unpack_from(message)
    if ch is not None:
        ch.single_copy = bool(can0)


def discard_offer(made: Offer) -> None:
    """Side 0's set-up failed: close and unlink everything of the offer."""
    made.release()
