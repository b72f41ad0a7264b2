"""bitcoll.elastic.share_state: the joiners receive the holders' state bitwise and every rank
ends with the holders' average of the float32 state (summed in holder order), for world
sizes 1-5, every kind of holder set, lengths 0, 1, 7, 8, 9 and a large odd one, single arrays
and lists of arrays of mixed dtypes; bad arguments are refused on every rank. Ranks are
threads of this process (tests/inproc.py): the algorithm, not the sockets."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from inproc import run_threads

from bitcoll.elastic import share_state
from bitcoll.errors import UsageError

LENGTHS = (0, 1, 7, 8, 9, 100_003)


def _holder_sets(size: int) -> list[list[int]]:
    sets = [list(range(size)), [0], [size - 1], list(range(0, size, 2))]
    if size > 2:
        sets.append(list(range(1, size)))
    out: list[list[int]] = []
    for s in sets:
        if s not in out:
            out.append(s)
    return out


def _case(size: int, holders: list[int], lengths: tuple[int, ...], seed: int,
          separate: bool = False) -> None:
    """``separate``: the mean goes to ``out`` arrays; ``average`` must come back unchanged."""
    rng = np.random.default_rng([seed, size, len(holders), *lengths])
    # the state: arrays of mixed dtypes; the average: float32 arrays of other lengths
    truth = [rng.standard_normal(n).astype(np.float32) if i % 2 == 0 else
             rng.integers(0, 255, n).astype(np.uint8) for i, n in enumerate(lengths)]
    moms = [[rng.standard_normal(n + 3).astype(np.float32) for n in lengths]
            for _ in range(size)]
    hs = sorted(holders)
    expected = []
    for i in range(len(lengths)):
        acc = moms[hs[0]][i].copy()
        for h in hs[1:]:
            acc += moms[h][i]
        acc /= np.float32(len(hs))
        expected.append(acc)

    def rank(comm: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        r = comm.rank
        state = [t.copy() if r in holders else np.full_like(t, 7) for t in truth]
        avg = [m.copy() for m in moms[r]]
        if not separate:
            share_state(comm, state, holders, average=avg)
            return state, avg
        out = [np.full_like(m, np.nan) for m in avg]
        share_state(comm, state, holders, average=avg, out=out)
        for i, (a, b) in enumerate(zip(avg, moms[r], strict=True)):
            assert a.tobytes() == b.tobytes(), (size, holders, lengths, r, i, "input changed")
        return state, out

    for r, (state, avg) in enumerate(run_threads(size, rank)):
        for i, (a, b) in enumerate(zip(state, truth, strict=True)):
            assert a.tobytes() == b.tobytes(), (size, holders, lengths, r, i)
        for i, (a, b) in enumerate(zip(avg, expected, strict=True)):
            assert a.tobytes() == b.tobytes(), (size, holders, lengths, r, i, "average")


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_state_and_average_reach_every_rank(size: int) -> None:
    for holders in _holder_sets(size):
        for n in LENGTHS:
            _case(size, holders, (n,), seed=1)
        _case(size, holders, (7, 0, 9, 8, 1), seed=2)  # pieces cut across arrays
        for n in (0, 9, 100_003):  # the mean into separate arrays, the input kept
            _case(size, holders, (n,), seed=3, separate=True)
        _case(size, holders, (7, 0, 9, 8, 1), seed=4, separate=True)


def test_single_array_and_no_average() -> None:
    truth = np.arange(1001, dtype=np.float64)

    def rank(comm: Any) -> np.ndarray:
        state = truth.copy() if comm.rank in (1, 2) else np.zeros_like(truth)
        share_state(comm, state, [2, 1])
        return state

    for state in run_threads(4, rank):
        assert state.tobytes() == truth.tobytes()


def test_bad_arguments_are_refused() -> None:
    def rank(comm: Any) -> list[str]:
        errors = []
        for holders, state, avg in (([], np.zeros(4, np.float32), None),
                                    ([3], np.zeros(4, np.float32), None),
                                    ([0], np.zeros((2, 2), np.float32), None),
                                    ([0], np.zeros(4, np.float32)[::2], None),
                                    ([0], np.zeros(4, np.float32), [np.zeros(4, np.float64)])):
            try:
                share_state(comm, state, holders, average=avg)
            except UsageError as exc:
                errors.append(str(exc))
        for out in ([np.zeros(5, np.float32)], [np.zeros(4, np.float64)]):
            try:
                share_state(comm, np.zeros(4, np.float32), [0],
                            average=[np.zeros(4, np.float32)], out=out)
            except UsageError as exc:
                errors.append(exc.argument or "")
        return errors

    for errors in run_threads(3, rank):
        assert len(errors) == 7, errors
        assert errors[5:] == ["out", "out"], errors
