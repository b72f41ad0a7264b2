"""Every collective on real processes over the TCP transport, world sizes 1 to 5."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from multiproc import context, free_port, run_world, start, tcp_env
from sweeps import (
    dense_sweep,
    float_sweep,
    inplace_and_async,
    mixed_paths_sweep,
    packed_bandwidth,
    packed_sweep,
)

import bitcoll
from bitcoll.communicator import Communicator
from bitcoll.transport.tcp import TCPTransport

pytestmark = pytest.mark.tcp


def _dense(comm: Communicator) -> int:
    assert comm.backend == "tcp"
    n = dense_sweep(comm)
    n += float_sweep(comm)
    comm.segment_bytes = 40  # many tiny segments (3 or more per block) through the pipelines
    n += dense_sweep(comm, lengths=(9, 305), dtypes=("float32", "int16"))
    n += float_sweep(comm, seed=1, lengths=(9, 305))
    n += inplace_and_async(comm)
    return n


@pytest.mark.timeout(600)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_dense_collectives_tcp(size: int) -> None:
    results = run_world(size, _dense, timeout=500)
    assert len(set(results)) == 1 and results[0] > 100


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3, 5])
def test_streaming_and_frame_by_frame_ranks_interoperate(size: int) -> None:
    """Every ring collective over plain TCP connections (no shared memory) with one rank on
    the frame-by-frame path and the others streaming (with 5 ranks, also streaming ranks next
    to each other): results as expected everywhere, and the streaming ranks did stream."""
    results = run_world(size, mixed_paths_sweep, timeout=250, shm=False)
    assert len({n for n, _ in results}) == 1
    assert results[1][1] == 0
    assert all(streamed > 10 for r, (_, streamed) in enumerate(results) if r != 1)


def _oversubscription(comm: Communicator) -> tuple[bool, bool]:
    """(this rank's TCP transport marked oversubscribed, whether its host runs more ranks
    than this process has cores)."""
    from bitcoll.topology import usable_cores

    t = comm.transport
    tcp = getattr(t, "_tcp", t)  # under shared memory's
    assert isinstance(tcp, TCPTransport)
    return tcp.oversubscribed, comm.local_size > usable_cores()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts, shm", [((0, 0, 0), False), ((0, 0, 0), True),
                                        ((0, 1, 2), False)])
def test_tcp_knows_whether_its_host_is_oversubscribed(hosts: tuple[int, ...],
                                                      shm: bool) -> None:
    """bitcoll.init tells each rank's TCP transport whether its host runs more ranks than
    the rank has cores (its streams then look for small frames only briefly)."""
    env = {r: {"GROUP_RANK": str(h)} for r, h in enumerate(hosts)}
    for marked, expected in run_world(len(hosts), _oversubscription, timeout=100,
                                      rank_env=env, shm=shm):
        assert marked == expected


def _packed(comm: Communicator) -> dict[str, Any]:
    packed_sweep(comm)
    comm.packed_segment_bytes = 8  # 64-element segments: multi-segment pipeline on every block
    packed_sweep(comm, lengths=(65, 1031))
    comm.packed_segment_bytes = None
    return packed_bandwidth(comm)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_packed_collectives_tcp(size: int) -> None:
    run_world(size, _packed, timeout=500)


def _victim(rank: int, size: int, port: int, q: Any) -> None:
    os.environ.update(tcp_env(rank, size, port))
    comm = bitcoll.init("tcp", timeout=60)
    x = np.ones(8 << 20, np.float32)
    comm.allreduce(x)
    if rank == 1:
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            comm.allreduce(x)
        q.put((rank, "no error", 0.0))
    except Exception as exc:
        q.put((rank, type(exc).__name__, time.monotonic() - t0))


@pytest.mark.timeout(120)
def test_killed_rank_makes_survivors_fail_fast() -> None:
    q = context(__name__).Queue()
    port = free_port()
    procs = [start(_victim, r, 3, port, q, daemon=False) for r in range(3)]
    got = sorted(q.get(timeout=90) for _ in range(2))
    for p in procs:
        p.join(timeout=10)
    assert procs[1].exitcode == -signal.SIGKILL
    assert [g[0] for g in got] == [0, 2]
    for _, kind, elapsed in got:
        assert kind in ("PeerLostError", "CommTimeoutError"), got
        assert elapsed < 60, got  # before the 60 s deadline: nobody waited it out


MISMATCHES = {  # case -> what differs (ProtocolError.fields)
    "length": ("element count",),
    "op": ("op",),
    "collective": ("collective",),
}


def _mismatch(comm: Communicator, case: str) -> tuple[Any, ...]:
    """The program's first collective, called differently by the last rank: what this rank
    raises (kind, fields, sequence, collective, message)."""
    last = comm.rank == comm.size - 1
    try:
        if case == "length":
            comm.allreduce(np.ones(10 + last, np.float32))
        elif case == "op":
            comm.sign_allreduce(np.ones(10, np.float32), op="sum" if last else "majority")
        elif last:
            comm.allgather(np.ones(4, np.float32))
        else:
            comm.allreduce(np.ones(4, np.float32))
    except bitcoll.CommError as exc:
        return (type(exc).__name__, getattr(exc, "fields", None), exc.sequence,
                exc.collective, str(exc))
    return ("no error",)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatch_names_the_field_and_the_collective_number(case: str, shm: bool) -> None:
    """Over TCP and shared memory, as over MPI (test_collectives_mpi): the ranks that receive
    a frame of the other call raise ProtocolError with ``fields`` naming what differs, the
    collective number counted from #0 at the program's first call (init's own collectives
    not counted) and the message "<collective> #0: the ranks called ..."; the others fail at
    once with PeerLostError quoting the finding in the same words."""
    got = run_world(3, _mismatch, case, timeout=150, comm_timeout=60, shm=shm)
    protocol = [g for g in got if g[0] == "ProtocolError"]
    assert protocol, got
    assert all(g[0] in ("ProtocolError", "PeerLostError") for g in got), got
    for _, fields, sequence, collective, text in protocol:
        assert fields == MISMATCHES[case], got
        assert sequence == 0, got
        assert text.startswith(f"{collective} #0: the ranks called "), got
    quoted = {f"aborted: {g[3]} #0: the ranks called " for g in protocol}
    for kind, _, _, _, text in got:
        if kind == "PeerLostError":
            assert any(q in text for q in quoted), got
