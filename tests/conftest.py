"""Session set-up shared by every test run (single-process and under mpiexec)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# --------------------------------------------------------------------------------------------
# Under mpiexec: the ranks stay in step, or the run stops
# --------------------------------------------------------------------------------------------

_FAILED = pytest.StashKey[bool]()
"""Set on a test item when its set-up or call failed on this rank."""

STEP_CHECK_SECONDS = 900.0
"""How long a rank waits after an MPI test for the other ranks to finish it (longer than any
test's own timeout)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    if outcome.get_result().failed:
        item.stash[_FAILED] = True


@pytest.fixture(scope="session")
def _step_comm(request: pytest.FixtureRequest) -> Any:
    """A private duplicate of MPI's world for :func:`_ranks_in_step` (made by every rank at
    its first MPI test, where all of them still are in step)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


@pytest.fixture(autouse=True)
def _ranks_in_step(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every MPI test under mpiexec, the ranks tell each other whether it failed. A
    test that failed on some ranks only can leave them out of step: the ones that stopped
    early skipped collectives on ``MPI.COMM_WORLD`` (a communicator's creation duplicates
    it) that the others made, so every later test would pair the wrong calls and fail or
    hang. The run then stops at once on every rank (``pytest.exit``, with the failures
    reported), naming the test and the ranks where it failed."""
    item = request.node
    if item.get_closest_marker("mpi") is None or \
            not request.config.getoption("--with-mpi", default=False):
        yield
        return
    comm = request.getfixturevalue("_step_comm")
    yield
    import time

    import numpy as np

    mine = np.array([1 if item.stash.get(_FAILED, False) else 0], dtype=np.int64)
    where = np.zeros(comm.Get_size(), dtype=np.int64)
    req = comm.Iallgather(mine, where)
    deadline = time.monotonic() + STEP_CHECK_SECONDS
    while not req.Test():
        if time.monotonic() > deadline:
            pytest.exit(f"rank {comm.Get_rank()}: the other ranks did not finish "
                        f"{item.nodeid} within {STEP_CHECK_SECONDS:.0f} s after this one; "
                        "stopping the MPI tests", returncode=1)
        time.sleep(0.001)
    failed = [int(r) for r in np.flatnonzero(where)]
    if 0 < len(failed) < comm.Get_size():
        pytest.exit(f"{item.nodeid} failed on rank(s) {failed} only (of "
                    f"{comm.Get_size()}): the ranks may be out of step, so the remaining MPI "
                    "tests would not be meaningful; stopping", returncode=1)


# --------------------------------------------------------------------------------------------
# Under mpiexec: quiet output
# --------------------------------------------------------------------------------------------

@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Drop pytest-mpi's "MPI Information" section (rank, size and the MPI library's
    configuration, printed by every rank of every run: 9 sections for dev.py's runs on 2, 3
    and 4 ranks); the summary line of each rank says what matters."""
    manager = config.pluginmanager
    for plugin in list(manager.get_plugins()):
        cls = type(plugin)
        if cls.__name__ != "MPIPlugin" or not hasattr(cls, "pytest_terminal_summary"):
            continue
        name = manager.get_name(plugin)
        manager.unregister(plugin)
        plugin.__class__ = type("QuietMPIPlugin", (cls,), {"pytest_terminal_summary": None})
        manager.register(plugin, name)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under mpiexec, once every rank has reached the end of the run (checked with a
    deadline), nothing can be stopped or hung any more: ``MPI_Finalize`` is left unbounded
    (``BITCOLL_MPI_FINALIZE_GRACE=inf``), so the tests that made an MPI transport time out on
    purpose do not end a passing run with "... killed (SIGALRM)" lines from every rank. If
    some rank does not arrive in time, the bound stays armed as usual."""
    if not session.config.getoption("--with-mpi", default=False):
        return
    import time

    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    comm = MPI.COMM_WORLD
    req = comm.Ibarrier()
    deadline = time.monotonic() + 30.0
    while not req.Test():
        if time.monotonic() > deadline:
            return
        time.sleep(0.001)
    from bitcoll.transport.mpi import FINALIZE_GRACE_ENV

    os.environ[FINALIZE_GRACE_ENV] = "inf"
