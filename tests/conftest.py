"""Session set-up shared by every test run (single-process and under mpiexec)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("NUMBA_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _warm_kernels() -> None:
    """Compile (or load from numba's disk cache) the packed-bit kernels once in this process,
    before tests spawn ranks that would otherwise all compile them at the same time."""
    from sweeps import packed_sweep

    import bitcoll

    with bitcoll.init("local") as comm:
        packed_sweep(comm, lengths=(9,), algorithms=("direct", "ring"))
