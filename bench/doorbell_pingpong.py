"""Doorbell micro-benchmark for bitcoll's shared-memory transport.

Two processes ping-pong a counter N times; each side blocks until the other has rung.
Doorbells compared: a futex on a word of a MAP_SHARED mapping (ctypes syscall), a pipe
(1 byte each way), a TCP loopback socket (1 byte each way, TCP_NODELAY), an eventfd-like
FIFO is a pipe for this purpose. Also a pure busy-poll of the shared word (no syscall,
burns a core: the floor).

Run: ``python bench/doorbell_pingpong.py [N]``. The figures of ``results/shm/doorbell.txt``
were measured with it at commit bb4e5a4 (then ``results/shm/doorbell_pingpong.py``).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import socket
import sys
import time

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
libc = ctypes.CDLL(None, use_errno=True)
SYS_FUTEX = 202
FUTEX_WAIT, FUTEX_WAKE = 0, 1
libc.syscall.restype = ctypes.c_long


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_pp() -> float:
    mm = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
    buf = (ctypes.c_uint32 * 2).from_buffer(mm)
    addr = ctypes.addressof(buf)
    ts = Timespec(1, 0)

    def wait_for(i: int, v: int) -> None:
        while True:
            cur = buf[i]
            if cur == v:
                return
            libc.syscall(SYS_FUTEX, ctypes.c_void_p(addr + 4 * i), FUTEX_WAIT, cur,
                         ctypes.byref(ts), None, 0)

    def ring(i: int, v: int) -> None:
        buf[i] = v
        libc.syscall(SYS_FUTEX, ctypes.c_void_p(addr + 4 * i), FUTEX_WAKE, 1, None, None, 0)

    pid = os.fork()
    if pid == 0:
        for k in range(1, N + 1):
            wait_for(0, k & 0xFFFFFFFF)
            ring(1, k)
        os._exit(0)
    t0 = time.perf_counter()
    for k in range(1, N + 1):
        ring(0, k)
        wait_for(1, k)
    dt = time.perf_counter() - t0
    os.waitpid(pid, 0)
    return dt


def spin_pp() -> float:
    mm = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
    buf = (ctypes.c_uint32 * 2).from_buffer(mm)
    n = N // 10
    pid = os.fork()
    if pid == 0:
        for k in range(1, n + 1):
            while buf[0] != k:
                pass
            buf[1] = k
        os._exit(0)
    t0 = time.perf_counter()
    for k in range(1, n + 1):
        buf[0] = k
        while buf[1] != k:
            pass
    dt = time.perf_counter() - t0
    os.waitpid(pid, 0)
    return dt * 10


def pipe_pp() -> float:
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for _ in range(N):
            os.read(a_r, 1)
            os.write(b_w, b"x")
        os._exit(0)
    t0 = time.perf_counter()
    for _ in range(N):
        os.write(a_w, b"x")
        os.read(b_r, 1)
    dt = time.perf_counter() - t0
    os.waitpid(pid, 0)
    return dt


def tcp_pp() -> float:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    port = lst.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(N):
            c.recv(1)
            c.send(b"x")
        os._exit(0)
    s, _ = lst.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.perf_counter()
    for _ in range(N):
        s.send(b"x")
        s.recv(1)
    dt = time.perf_counter() - t0
    os.waitpid(pid, 0)
    return dt


def wake_cost() -> float:
    """FUTEX_WAKE with nobody waiting: what a sender pays per published chunk."""
    mm = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
    buf = (ctypes.c_uint32 * 2).from_buffer(mm)
    addr = ctypes.c_void_p(ctypes.addressof(buf))
    t0 = time.perf_counter()
    for _ in range(N):
        libc.syscall(SYS_FUTEX, addr, FUTEX_WAKE, 1, None, None, 0)
    dt = time.perf_counter() - t0
    return dt


def main() -> None:
    print(f"# ping-pong round trips between two processes, N={N}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print("# doorbell              round trip (us)")
    for rnd in range(3):
        for name, fn in (("futex", futex_pp), ("pipe", pipe_pp), ("tcp-loopback", tcp_pp),
                         ("busy-poll", spin_pp)):
            dt = fn()
            print(f"{name:22s} {1e6 * dt / N:8.2f}   (round {rnd + 1})", flush=True)
    dt = wake_cost()
    print(f"# FUTEX_WAKE with no waiter: {1e6 * dt / N:.2f} us per call (ctypes included)")


if __name__ == "__main__":
    main()
