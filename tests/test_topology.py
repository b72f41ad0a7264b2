"""Which ranks share a host: host keys, local ranks, host and cross-host communicators."""

from __future__ import annotations

import numpy as np
import pytest
from multiproc import run_world

import bitcoll
from bitcoll.communicator import Communicator
from bitcoll.topology import Topology, host_key


def test_host_key_precedence() -> None:
    assert host_key({"GROUP_RANK": "3", "SLURM_NODEID": "1"}) == "group:3"
    assert host_key({"SLURM_NODEID": "1"}) == "slurm:1"
    key = host_key({})
    assert key.startswith("host:") and "/netns:" in key
    assert host_key({"GROUP_RANK": "x"}) == key  # not a node index: ignored


def test_topology_numbering() -> None:
    # Hosts named by arbitrary digests, numbered by their lowest rank; uneven hosts.
    t = Topology.from_digests([70, 10, 70, 10, 10, 99], rank=3)
    assert t.hosts == (0, 1, 0, 1, 1, 2)
    assert (t.host_index, t.local_rank, t.local_size, t.num_hosts) == (1, 1, 3, 3)
    assert t.local_ranks == [1, 3, 4]
    assert [t.local_rank_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 0]
    sub = t.subset([5, 3, 1], new_rank=1)
    assert sub.hosts == (0, 1, 1) and (sub.local_rank, sub.local_size) == (0, 2)


def test_one_rank() -> None:
    with bitcoll.init("local") as comm:
        assert (comm.local_rank, comm.local_size, comm.host_index, comm.num_hosts) == (
            0, 1, 0, 1)
        assert comm.host_comm().size == 1 and comm.cross_host_comm().size == 1


HOSTS = [0, 1, 0, 1, 1]  # 5 ranks on 2 hosts of 2 and 3 ranks, interleaved


def _topo(comm: Communicator) -> tuple[int, int, int, int, int, int, float, float, int]:
    host = comm.host_comm()
    cross = comm.cross_host_comm()
    assert comm.host_comm() is host  # cached
    h = float(host.allreduce(np.array([comm.rank], np.float64))[0])
    c = float(cross.allreduce(np.array([comm.rank], np.float64))[0])
    assert host.local_size == host.size and host.num_hosts == 1
    assert cross.num_hosts == cross.size
    return (comm.host_index, comm.local_rank, comm.local_size, comm.num_hosts, host.rank,
            cross.rank, h, c, comm.segment_bytes)


@pytest.mark.timeout(200)
def test_uneven_hosts_tcp() -> None:
    env = {r: {"GROUP_RANK": str(h)} for r, h in enumerate(HOSTS)}
    res = run_world(5, _topo, timeout=180, rank_env=env)
    # Host 0: ranks 0, 2; host 1: ranks 1, 3, 4.
    assert [r[:4] for r in res] == [(0, 0, 2, 2), (1, 0, 3, 2), (0, 1, 2, 2), (1, 1, 3, 2),
                                    (1, 2, 3, 2)]
    assert [r[6] for r in res] == [2.0, 8.0, 2.0, 8.0, 8.0]  # sums over each host
    # Cross-host groups by local rank: {0, 1}, {2, 3}, {4}.
    assert [r[7] for r in res] == [1.0, 1.0, 5.0, 5.0, 4.0]
    assert [r[5] for r in res] == [0, 1, 0, 1, 0]
    # Several hosts: the dense rings stream in the smaller segments by default.
    assert [r[8] for r in res] == [bitcoll.communicator.REMOTE_SEGMENT_BYTES] * 5


def _segment(comm: Communicator) -> int:
    return comm.segment_bytes


@pytest.mark.timeout(200)
def test_a_chosen_segment_size_stays_across_hosts() -> None:
    env = {r: {"GROUP_RANK": str(r)} for r in range(2)}
    assert run_world(2, _segment, timeout=180, rank_env=env, segment_bytes=1 << 20) == \
        [1 << 20] * 2


@pytest.mark.timeout(200)
def test_launcher_node_rank_is_the_host() -> None:
    """Without GROUP_RANK every rank of one machine shares the host (same name, same
    network namespace)."""
    res = run_world(3, _topo, timeout=180)
    assert [r[:4] for r in res] == [(0, 0, 3, 1), (0, 1, 3, 1), (0, 2, 3, 1)]
    assert [r[8] for r in res] == [bitcoll.DEFAULT_SEGMENT_BYTES] * 3  # one host
