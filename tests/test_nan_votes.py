"""A NaN in one rank's vote input fails the collective on every rank, whatever the algorithm.

The NaN is found while packing, which overlaps the sends: the rank with it may already have
sent some of its messages when it raises UsageError. No peer may then return a result (a
peer that did would apply a step the others did not): each raises PeerLostError. Ranks are
threads over the in-process transport; small packed segments give every vector several
pipeline segments, and the NaN sits at the first or last element of the rank's own block,
of a peer's block, or in the middle. "default" is the call without ``algorithm=`` (the
communicator's lean path for small vectors, else the cost model's pick).

The quantized all-reduce's range check works the same way: a value outside
``[-levels, levels]`` (one its field could still hold, or not) is found while packing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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


def _outcomes(hosts: tuple[int, ...], call: str, algorithm: str,
              inputs: Callable[[int], np.ndarray[Any, Any]], **kwargs: Any) -> list[Any]:
    """Every rank ``r`` (host ``hosts[r]``) calls ``call`` on ``inputs(r)``. Returns per rank
    the exception's type, or the result when it returned one."""
    p = len(hosts)
    world = _World(p)
    comms = [Communicator(InprocTransport(world, r), timeout=60.0, packed_segment_bytes=64,
                          topology=Topology(hosts, r)) for r in range(p)]
    got: list[Any] = [None] * p

    def rank(r: int) -> None:
        x = inputs(r)
        try:
            chosen = None if algorithm == "default" else algorithm
            got[r] = getattr(comms[r], call)(x, algorithm=chosen, **kwargs)
        except (UsageError, PeerLostError) as exc:
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return got


def _rank0_failed(got: list[Any], argument: str, index: int) -> None:
    """Rank 0 raised UsageError naming ``argument`` and ``index``; every peer PeerLostError
    naming rank 0."""
    assert isinstance(got[0], UsageError), got[0]
    assert got[0].argument == argument and got[0].index == index, got[0]
    assert f"index {index}" in str(got[0]), got[0]
    for r, outcome in enumerate(got[1:], 1):
        assert isinstance(outcome, PeerLostError), (r, outcome)
        assert outcome.peer == 0 or "rank 0" in str(outcome), (r, outcome)


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

    def inputs(r: int) -> np.ndarray[Any, Any]:
        x = np.random.default_rng(r).standard_normal(N).astype(np.float32)
        if r == 0:
            x[nan_at] = np.nan
        return x

    _rank0_failed(_outcomes(hosts, call, algorithm, inputs, op=op), "x", nan_at)


@pytest.mark.parametrize(("levels", "dtype", "bad"), [
    (1, np.int8, 2),  # fits the 2-bit field (values -1..2), outside [-1, 1]
    (1, np.int16, 300),  # fits no field
    (2, np.int32, -3),  # the 3-bit field holds -2..5
])
@pytest.mark.parametrize("where", ["own-first", "peer-last"])
@pytest.mark.parametrize("call", ["quantized_allreduce", "quantized_reduce_scatter"])
@pytest.mark.parametrize(("algorithm", "hosts"), WORLDS,
                         ids=[f"{a}-{''.join(map(str, h))}" for a, h in WORLDS])
def test_a_value_outside_the_levels_fails_every_rank(algorithm: str, hosts: tuple[int, ...],
                                                     call: str, where: str, levels: int,
                                                     dtype: type, bad: int) -> None:
    at = _nan_index(where, len(hosts))

    def inputs(r: int) -> np.ndarray[Any, Any]:
        q: np.ndarray[Any, Any] = np.random.default_rng(r).integers(-levels, levels + 1,
                                                                     N).astype(dtype)
        if r == 0:
            q[at] = bad
        return q

    got = _outcomes(hosts, call, algorithm, inputs, levels=levels)
    _rank0_failed(got, "q", at)
    assert f"value {bad} at index {at} of q is outside [-{levels}, {levels}]" in str(got[0])


@pytest.mark.parametrize("levels", [1, 3])
def test_the_edges_of_the_levels_pass(levels: int) -> None:
    """Values at -levels and +levels are inside: the packing pass's range is exact."""
    def inputs(r: int) -> np.ndarray[Any, Any]:
        q = np.full(N, levels if r % 2 else -levels, np.int8)
        q[::7] = -q[::7]
        return q

    for algorithm, hosts in WORLDS[:8]:
        got = _outcomes(hosts, "quantized_allreduce", algorithm, inputs, levels=levels)
        want = sum(inputs(r).astype(np.int64) for r in range(len(hosts)))
        for r, res in enumerate(got):
            assert isinstance(res, np.ndarray), (algorithm, hosts, r, res)
            np.testing.assert_array_equal(res, want)
