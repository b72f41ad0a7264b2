"""Sub-communicators: comm.split on every backend (TCP here and on threads; MPI in
test_split_mpi.py)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from errcheck import raises_usage
from multiproc import context, free_port, run_world, start, tcp_env
from sweeps import siblings_from_threads

import bitcoll
from bitcoll.communicator import Communicator
from bitcoll.errors import PeerLostError, UsageError


def _checks(comm: Communicator) -> float:
    p, r = comm.size, comm.rank
    # Parity groups: ranks ordered by parent rank.
    sub = comm.split(r % 2)
    assert sub is not None
    members = list(range(r % 2, p, 2))
    assert (sub.size, sub.rank) == (len(members), members.index(r))
    np.testing.assert_array_equal(sub.allreduce(np.full(5, r, np.int64)),
                                  np.full(5, sum(members)))
    assert sub.stats.snapshot()["bytes_sent"] > 0 or sub.size == 1
    sub.close()
    # A key reverses the order; color None stays out.
    rev = comm.split(0, key=-r)
    assert rev is not None and rev.rank == p - 1 - r
    out = comm.split(None if r == 0 else 7)
    assert (out is None) == (r == 0)
    if out is not None:
        assert out.size == p - 1 and out.rank == r - 1
        assert out.allgather(np.array([r]))[0] == 1
        out.close()
    # Two sub-communicators over all ranks used from two threads while the parent runs in the
    # main thread: no frame of one ever lands in another.
    a = comm.split(0)
    b = comm.split(0, key=-r)
    assert a is not None and b is not None
    siblings_from_threads(comm, a, b, 200)
    assert a.majority_calls == 0
    a.sign_allreduce(np.ones(3))
    assert (a.majority_calls, b.majority_calls) == (1, 0)
    a.close()
    b.close()
    # The parent still works after its children closed.
    return float(comm.allreduce(np.ones(1))[0])


def _bad_color(rank: int, size: int, port: int, q: Any) -> None:
    """A color that is not an integer: UsageError on the rank that sees it first; the others
    fail fast with that reason (PeerLostError), possibly while still inside ``init``'s own
    collective, or raise UsageError themselves."""
    os.environ.update(tcp_env(rank, size, port))
    try:
        comm = bitcoll.init("tcp", timeout=60)
        comm.split(1.5)  # type: ignore[arg-type]
        q.put((rank, "no error"))
    except (UsageError, PeerLostError) as exc:
        q.put((rank, f"{type(exc).__name__}: {exc}"))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("size", [3, 4])
def test_split_tcp(size: int) -> None:
    assert run_world(size, _checks, timeout=180) == [float(size)] * size
    q = context(__name__).Queue()
    port = free_port()
    procs = [start(_bad_color, r, size, port, q) for r in range(size)]
    msgs = [q.get(timeout=60) for _ in range(size)]
    for p in procs:
        p.join(10)
    for _, msg in msgs:
        assert "color must be an integer" in msg, msgs


def test_split_local() -> None:
    with bitcoll.init("local") as comm:
        sub = comm.split(3)
        assert sub is not None and sub.size == 1
        assert sub.allreduce(np.ones(2)).tolist() == [1.0, 1.0]
        sub.close()
        assert comm.split(None) is None
        with raises_usage("color"):
            comm.split(-1)
        with raises_usage("key"):
            comm.split(0, key="a")  # type: ignore[arg-type]
        with raises_usage("color"):
            comm.split(True)
