"""Per-frame integrity (``integrity=True``, TCP): frames altered on the way are caught."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable

import numpy as np
import pytest
from multiproc import run_world
from sweeps import dense_sweep, packed_sweep

from bitcoll.communicator import Communicator
from bitcoll.errors import CommError, PeerLostError, ProtocolError, UsageError
from bitcoll.transport.base import HEADER_SIZE, FrameHeader
from bitcoll.transport.tcp.transport import FRAME_TAG_BYTES, TCPTransport, _Rendezvous


class _DictStore:
    """Just enough of a store for transports built by hand."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes, deadline: float | None = None) -> None:
        self.data[key] = value

    def get(self, key: str, deadline: float | None = None) -> bytes:
        return self.data[key]

    def try_get(self, key: str, deadline: float | None = None) -> bytes | None:
        return self.data.get(key)

    def add(self, key: str, delta: int, deadline: float | None = None) -> int:
        value = int(self.data.get(key, b"0")) + delta
        self.data[key] = str(value).encode()
        return value

    def wait(self, keys: Iterable[str], deadline: float | None = None) -> None:
        pass

    def missing(self, keys: Iterable[str], deadline: float | None = None) -> list[str]:
        return [k for k in keys if k not in self.data]

    def close(self) -> None:
        pass

    @property
    def local_address(self) -> str:
        return "127.0.0.1"


def _tampering_pair(flip_at: int | None) -> tuple[TCPTransport, TCPTransport, threading.Event]:
    """Ranks 0 and 1 joined through a forwarder that flips the byte at stream offset
    ``flip_at`` of 0 -> 1 traffic (None: forwards faithfully)."""
    a0, f0 = socket.socketpair()
    f1, b1 = socket.socketpair()
    done = threading.Event()

    def forward(src: socket.socket, dst: socket.socket, flip: int | None) -> None:
        pos = 0
        while True:
            try:
                data = bytearray(src.recv(1 << 16))
            except OSError:
                break
            if not data:
                break
            if flip is not None and pos <= flip < pos + len(data):
                data[flip - pos] ^= 0x01
            pos += len(data)
            try:
                dst.sendall(data)
            except OSError:
                break
        done.set()
        for s in (src, dst):
            s.close()

    threading.Thread(target=forward, args=(f0, f1, flip_at), daemon=True).start()
    threading.Thread(target=forward, args=(f1, f0, None), daemon=True).start()
    store = _DictStore()
    secret = b"k" * 32
    t0 = TCPTransport(0, 2, {1: a0}, _Rendezvous(store, "t/", secret, "test"), 7,
                      close_timeout=2.0, integrity=True)
    t1 = TCPTransport(1, 2, {0: b1}, _Rendezvous(store, "t/", secret, "test"), 7,
                      close_timeout=2.0, integrity=True)
    return t0, t1, done


@pytest.mark.parametrize("consume", [False, True])
@pytest.mark.parametrize("flip", [None, 3, HEADER_SIZE + 5, HEADER_SIZE + 4000 + 2])
def test_a_flipped_bit_is_caught(flip: int | None, consume: bool) -> None:
    t0, t1, _ = _tampering_pair(flip)
    payload = np.arange(1000, dtype=np.float32)
    header = FrameHeader(seq=1, step=0, signature=9, length=payload.nbytes)
    got = np.zeros_like(payload)
    view = got.view(np.uint8)
    try:
        if consume:
            def sink(offset: int, chunk: memoryview) -> None:
                view[offset:offset + len(chunk)] = np.frombuffer(chunk, np.uint8)

            recv = t1.irecv_consume(0, payload.nbytes, header, sink)
        else:
            recv = t1.irecv(0, view.data, header)
        send = t0.isend(1, payload.view(np.uint8).data, header)
        deadline = time.monotonic() + 20
        if flip is None:
            recv.wait(deadline)
            send.wait(deadline)
            np.testing.assert_array_equal(got, payload)
            stats = t1.stats.snapshot()
            assert stats["bytes_received"] == HEADER_SIZE + payload.nbytes + FRAME_TAG_BYTES
        else:
            with pytest.raises((ProtocolError, CommError)) as info:
                recv.wait(deadline)
            assert "integrity" in str(info.value) or "frame magic" in str(info.value) or \
                "expected" in str(info.value), info.value
    finally:
        t0.close()
        t1.close()


def _sweeps(comm: Communicator) -> int:
    dense_sweep(comm, lengths=(0, 1, 7, 8, 9, 100_003))
    packed_sweep(comm, lengths=(9, 4099))
    return int(comm.stats.snapshot()["messages_sent"])


@pytest.mark.timeout(200)
def test_collectives_with_integrity_tcp() -> None:
    assert all(n > 0 for n in run_world(3, _sweeps, timeout=180, integrity=True))


def test_integrity_must_match_across_ranks() -> None:
    """Rank 0 with integrity, rank 1 without (two threads here): rank 1 refuses at set-up and
    says so in the store, so rank 0 fails at once with its reason (PeerLostError naming rank 1),
    not at its deadline (a timeout would be a CommTimeoutError)."""
    from tcp_world import set_up_two

    out = set_up_two(lambda r, port: TCPTransport.create(
        r, 2, "127.0.0.1", port, timeout=5.0, integrity=r == 0, close_timeout=1.0), join=30)
    assert isinstance(out[1], UsageError) and "integrity" in str(out[1]), out
    assert isinstance(out[0], PeerLostError) and "refused" in str(out[0]), out
    assert out[0].peer == 1 and "integrity" in str(out[0])
