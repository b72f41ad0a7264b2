"""comm.split over MPI (run under mpiexec with --with-mpi; 3 and 4 ranks)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

import bitcoll
from bitcoll.communicator import Communicator


@pytest.fixture(scope="module")
def comm() -> Iterator[Communicator]:
    c = bitcoll.init("mpi", timeout=60)
    yield c
    c.close()


@pytest.mark.mpi(min_size=3)
def test_split_parity_and_order(comm: Communicator) -> None:
    p, r = comm.size, comm.rank
    sub = comm.split(r % 2)
    assert sub is not None and sub.backend == "mpi"
    members = list(range(r % 2, p, 2))
    assert (sub.size, sub.rank) == (len(members), members.index(r))
    np.testing.assert_array_equal(sub.allreduce(np.full(4, r, np.int64)),
                                  np.full(4, sum(members)))
    sub.close()
    rev = comm.split(0, key=-r)
    assert rev is not None and rev.rank == p - 1 - r
    rev.close()
    out = comm.split(None if r == 0 else 5)
    assert (out is None) == (r == 0)
    if out is not None:
        assert out.size == p - 1
        out.close()


@pytest.mark.mpi(min_size=3)
def test_split_siblings_from_threads(comm: Communicator) -> None:
    r, p = comm.rank, comm.size
    a = comm.split(0)
    b = comm.split(0, key=-r)
    assert a is not None and b is not None
    errors: list[BaseException] = []

    def loop(c: Communicator, scale: float) -> None:
        try:
            for i in range(50):
                y = c.allreduce(np.full(5, scale * (r + 1) + i))
                assert (y == scale * p * (p + 1) / 2 + p * i).all()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(a, 1.0)),
               threading.Thread(target=loop, args=(b, 1000.0))]
    for t in threads:
        t.start()
    loop(comm, 1e6)
    for t in threads:
        t.join()
    a.close()
    b.close()
    assert not errors, errors


@pytest.mark.mpi(min_size=2)
def test_topology_one_host(comm: Communicator) -> None:
    assert (comm.host_index, comm.num_hosts, comm.local_size) == (0, 1, comm.size)
    assert comm.local_rank == comm.rank
    host = comm.host_comm()
    assert host.size == comm.size and comm.cross_host_comm().size == 1


@pytest.mark.mpi(min_size=3)
def test_init_on_a_users_sub_communicator() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    mine = world.Split(world.rank % 2, world.rank)
    with bitcoll.init(comm=mine, timeout=60) as sub:
        members = list(range(world.rank % 2, world.size, 2))
        assert (sub.backend, sub.size, sub.rank) == ("mpi", len(members),
                                                     members.index(world.rank))
        total = sub.allreduce(np.full(3, world.rank, np.int64))
        assert (total == sum(members)).all()
    mine.Free()
