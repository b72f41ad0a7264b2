"""The small packed collectives' lean path: a synchronous ``sign_allreduce`` /
``sign_reduce_scatter`` with the default algorithm runs from a cached plan (no per-call
validation closures) and the all-gather algorithm gathers the packed rows in ``ceil(log2 p)``
rounds (Bruck). Same results, frames and tie counter as the general path: a rank on the lean
path pairs with ranks on the general one, and every result matches the numpy reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from inproc import run_threads
from sweeps import expected_majority, expected_sign_sum, vote_input

import bitcoll
from bitcoll.communicator import Communicator
from bitcoll.plan import Call, choose
from bitcoll.transport.base import HEADER_SIZE

LENGTHS = (0, 1, 7, 8, 9, 1000, 10_001)


def _lean_and_general(comm: Communicator) -> list[tuple[str, bytes]]:
    """Every length, tie rule and op: the lean path (default algorithm), the general path
    (forced all-gather, a 2-D input, an output of another dtype) and again the lean path, so
    that the tie counter is shared between them; each result against the reference."""
    p, r = comm.size, comm.rank
    got: list[tuple[str, bytes]] = []
    for n in LENGTHS:
        lo, hi = bitcoll.block(n, p, r)
        for dt in ("float32", "float16", "float64"):
            xs = [vote_input(5, j, n, dt) for j in range(p)]
            for tie in ("positive", "negative", "alternate"):
                for form in ("lean", "forced", "lean-out"):
                    want = expected_majority(xs, tie, comm.majority_calls)
                    what = f"majority n={n} {dt} tie={tie} {form} p={p}"
                    if form == "lean":
                        y = comm.sign_allreduce(xs[r], tie=tie)
                    elif form == "forced":
                        y = comm.sign_allreduce(xs[r], tie=tie, algorithm="allgather")
                    else:
                        y = comm.sign_allreduce(xs[r], tie=tie, out=np.empty(n, np.int8))
                    np.testing.assert_array_equal(y, want, err_msg=what)
                    got.append((what, y.tobytes()))
                want = expected_majority(xs, tie, comm.majority_calls)[lo:hi]
                y = comm.sign_reduce_scatter(xs[r], tie=tie)
                np.testing.assert_array_equal(y, want, err_msg=f"reduce_scatter n={n} {tie}")
            ssum = expected_sign_sum(xs)
            np.testing.assert_array_equal(comm.sign_allreduce(xs[r], op="sum"), ssum)
            np.testing.assert_array_equal(  # the general path: an int16 output
                comm.sign_allreduce(xs[r], op="sum", out=np.empty(n, np.int16)), ssum)
            np.testing.assert_array_equal(comm.sign_reduce_scatter(xs[r], op="sum"),
                                          ssum[lo:hi])
        shaped = vote_input(6, r, 6 * 7, "float32").reshape(6, 7)
        y = comm.sign_allreduce(shaped)
        assert y.shape == (6, 7) and y.dtype == np.int8
    return got


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_lean_path_matches_the_reference_and_the_general_path(p: int) -> None:
    results = run_threads(p, _lean_and_general, timeout=120.0)
    assert all(res == results[0] for res in results)  # every rank the same bits


def test_small_majority_takes_the_all_gather_in_log_rounds() -> None:
    """The default algorithm of a small vote on 2-4 ranks of one host is the all-gather,
    whose Bruck rounds send ``ceil(log2 p)`` frames per rank (not ``p - 1``), every rank's row
    reaching every other once: ``(p - 1) * ceil(n / 8)`` bytes."""
    n = 1000

    def body(comm: Communicator) -> tuple[str, list[dict[str, int]]]:
        x = vote_input(7, comm.rank, n, "float32")
        snaps = []
        for algo in (None, "allgather"):
            comm.stats.reset()
            comm.sign_allreduce(x, algorithm=algo)
            snaps.append(comm.stats.snapshot())
        return choose("packed", comm.cost_model, comm.plan_group, Call(count=n)), snaps

    for p in (2, 3, 4, 5):
        rounds = (p - 1).bit_length()
        for algo, (default, forced) in run_threads(p, body):
            assert algo == "allgather" or p == 5
            if algo == "allgather":
                assert default == forced
            assert forced["messages_sent"] == rounds
            assert forced["bytes_sent"] - HEADER_SIZE * rounds == (p - 1) * -(-n // 8)


def _nan_on_rank_1(comm: Communicator) -> Any:
    x = np.ones(100, np.float32)
    if comm.rank == 1:
        x[42] = np.nan
    return comm.sign_allreduce(x)


def test_nan_on_the_lean_path_fails_every_rank() -> None:
    with pytest.raises((bitcoll.UsageError, bitcoll.PeerLostError)) as info:
        run_threads(3, _nan_on_rank_1, timeout=20.0)
    # the rank with the NaN names its index; the others are released, not left waiting
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "index 42" in text or "rank 1" in text
