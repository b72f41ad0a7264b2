"""Session set-up shared by every test run (single-process and under mpiexec)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

MPI_MARK_TEXT = "mark.mpi"
"""Every test file with MPI tests spells this (``@pytest.mark.mpi(...)``, ``pytestmark``)."""


def _only_mpi_tests(config: pytest.Config) -> bool:
    """An mpiexec run of the MPI tests alone (``--with-mpi -m mpi``, as dev.py runs them)."""
    return bool(config.getoption("--with-mpi", default=False)) \
        and str(config.getoption("markexpr", default="")).strip() == "mpi"


def _has_mpi_tests(path: Path) -> bool:
    return MPI_MARK_TEXT in path.read_text(encoding="utf-8")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under mpiexec with ``-m mpi``, every rank skips importing the test files without MPI
    tests (torch, hypothesis and the rest cost each rank seconds, on two cores shared by all
    ranks); whether a file has MPI tests is read from its text, a rule that
    :func:`pytest_collection_modifyitems` checks in every run that collects everything."""
    if (_only_mpi_tests(config) and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and not _has_mpi_tests(collection_path)):
        return True
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse an MPI test in a file whose text does not say ``mark.mpi``: the MPI runs would
    not collect it (see :func:`pytest_ignore_collect`)."""
    hidden = sorted({str(item.path) for item in items
                     if item.get_closest_marker("mpi") is not None
                     and not _has_mpi_tests(item.path)})
    if hidden:
        raise pytest.UsageError(f"MPI tests in files that do not spell {MPI_MARK_TEXT!r} "
                                f"(the MPI runs would skip them): {', '.join(hidden)}")


@pytest.fixture(scope="session", autouse=True)
def _warm_kernels(request: pytest.FixtureRequest) -> None:
    """Compile (or load from numba's disk cache) the packed-bit kernels once in this process,
    before tests start ranks that would otherwise all compile them at the same time.

    The single-process run warms every kernel the packed sweeps use at every world size
    1..5 (:func:`sweeps.warm_kernels`): a checkout without a cache compiles them here once
    (about a minute) instead of in every rank of every multi-process world; with a cache this
    takes about 3 s. (The fork server that starts those ranks then loads them once more,
    before it forks any: see ``rank_preload``.) Under mpiexec every rank is such a process
    already (and the single-process step has filled the cache): a light warm-up only."""
    from sweeps import packed_sweep, warm_kernels

    import bitcoll

    if request.config.getoption("--with-mpi", default=False):
        with bitcoll.init("local") as comm:
            packed_sweep(comm, lengths=(9,), algorithms=("direct", "ring"))
        return
    warm_kernels()
