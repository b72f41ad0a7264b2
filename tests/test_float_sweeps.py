"""Random-float dense sweeps on in-process worlds of 1 to 5 ranks: every rank gets bitwise
identical results, within the rounding bound of a float64 reference (the TCP and MPI
collective tests run the same sweep on real processes)."""

from __future__ import annotations

import numpy as np
import pytest
from inproc import run_threads
from sweeps import float_input, float_sweep

from bitcoll.communicator import Communicator


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_float_sweep_threads(size: int) -> None:
    def body(comm: Communicator) -> int:
        n = float_sweep(comm, lengths=(1, 7, 9, 1000, 30_001))
        comm.segment_bytes = 40  # many segments: each element's additions in pipeline order
        return n + float_sweep(comm, seed=2, lengths=(9, 305))

    results = run_threads(size, body, timeout=120)
    assert len(set(results)) == 1 and results[0] > 0


def test_float_inputs_do_round_differently_by_order() -> None:
    """The sweep's inputs are the kind that order-dependent rounding shows up on: summing
    five ranks' float32 inputs forwards and backwards gives different bits somewhere."""
    xs = [float_input(0, j, 1000, "float32") for j in range(5)]
    forwards, backwards = np.zeros(1000, np.float32), np.zeros(1000, np.float32)
    for x in xs:
        forwards += x
    for x in reversed(xs):
        backwards += x
    assert not np.array_equal(forwards, backwards)
