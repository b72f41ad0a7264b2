"""A NaN in one rank's vote input fails the collective on every rank, whatever the algorithm.

The NaN is found while packing, which overlaps the sends: the rank with it may already have
sent some of its messages when it raises UsageError. No peer may then return a result (a
peer that did would apply a step the others did not): each raises PeerLostError. Ranks are
threads over the in-process transport; small packed segments give every vector several
pipeline segments, and the NaN sits at the first or last element of the rank's own block,
of a peer's block, or in the middle. "default" is the call without ``algorithm=`` (the
communicator's lean path for small vectors, else the cost model's pick).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from inproc import InprocTransport, _World

from bitcoll import partition
from bitcoll.communicator import Communicator
from bitcoll.errors import PeerLostError, UsageError
from bitcoll.topology import Topology

#: Elements per call: several 64-byte packed segments per block at every world size below.
N = 5003
WHERE = ("own-first", "own-last", "peer-first", "peer-last", "middle")


def _nan_index(where: str, p: int) -> int:
    bounds = partition(N, p)
    own, peer = bounds[0], bounds[-1]
    return {"own-first": own[0], "own-last": own[1] - 1, "peer-first": peer[0],
            "peer-last": peer[1] - 1, "middle": N // 2}[where]


def _outcomes(hosts: tuple[int, ...], call: str, op: str, algorithm: str,
              nan_at: int) -> list[Any]:
    """Every rank (host ``hosts[r]``) calls ``call``; rank 0's input has a NaN at ``nan_at``.
    Returns per rank the exception's type, or the result when it returned one."""
    p = len(hosts)
    world = _World(p)
    comms = [Communicator(InprocTransport(world, r), timeout=60.0, packed_segment_bytes=64,
                          topology=Topology(hosts, r)) for r in range(p)]
    got: list[Any] = [None] * p

    def rank(r: int) -> None:
        x = np.random.default_rng(r).standard_normal(N).astype(np.float32)
        if r == 0:
            x[nan_at] = np.nan
        try:
            chosen = None if algorithm == "default" else algorithm
            got[r] = getattr(comms[r], call)(x, op=op, algorithm=chosen)
        except (UsageError, PeerLostError) as exc:
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return got


#: (algorithm, host of every rank): flat worlds of 2-5 ranks, and two-level ones.
WORLDS: list[tuple[str, tuple[int, ...]]] = [
    *((algo, tuple(range(p))) for algo in ("default", "direct", "ring", "allgather")
      for p in (2, 3, 4, 5)),
    *(("hierarchical", hosts) for hosts in ((0, 0, 1), (0, 1, 1), (0, 0, 1, 1),
                                            (0, 0, 0, 1, 1))),
]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("op", ["majority", "sum"])
@pytest.mark.parametrize("call", ["sign_allreduce", "sign_reduce_scatter"])
@pytest.mark.parametrize(("algorithm", "hosts"), WORLDS,
                         ids=[f"{a}-{''.join(map(str, h))}" for a, h in WORLDS])
def test_a_nan_fails_every_rank(algorithm: str, hosts: tuple[int, ...], call: str, op: str,
                                where: str) -> None:
    nan_at = _nan_index(where, len(hosts))
    got = _outcomes(hosts, call, op, algorithm, nan_at)
    assert isinstance(got[0], UsageError), got[0]
    assert got[0].argument == "x" and f"index {nan_at}" in str(got[0])
    for r, outcome in enumerate(got[1:], 1):
        assert isinstance(outcome, PeerLostError), (r, outcome)
        assert outcome.peer == 0 or "rank 0" in str(outcome), (r, outcome)
