"""comm.split over MPI (run under mpiexec with --with-mpi; 3 and 4 ranks)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from sweeps import siblings_from_threads

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
    a = comm.split(0)
    b = comm.split(0, key=-comm.rank)
    assert a is not None and b is not None
    siblings_from_threads(comm, a, b, 50)
    a.close()
    b.close()


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
