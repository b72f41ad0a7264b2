"""Real ``mpiexec`` jobs that fail, or fail and recover: the exit rules of the MPI transport
(``bitcoll.transport.mpi``, "Failures at exit").

These are plain tests (no ``mpi`` marker): they run in the single-process step
(``pytest -m "not mpi"``) and start ``.venv/bin/mpiexec -n 3|4`` themselves on the scripts
``tests/scripts/mpi_*.py``. Each rank of a job appends its markers (``READY rank=.. pid=..``,
``CAUGHT ...``, ``DONE ...``) to a file in a temporary directory, because mpiexec's output
forwarding may drop the last lines of a rank that is being killed. Every job runs in its own
session with a hard limit; afterwards any rank it started that is still alive (a stopped one)
is continued and killed by its pid.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from bitcoll.transport.mpi import FINALIZE_GRACE_ENV, FINALIZE_GRACE_SECONDS, finalize_grace

SCRIPTS = Path(__file__).parent / "scripts"
MPIEXEC = Path(sys.executable).parent / "mpiexec"


@dataclass
class Job:
    returncode: int
    elapsed: float
    output: str
    marks: list[str]  # every marker line of every rank

    def pids(self) -> dict[int, int]:
        """rank -> pid, from the READY markers."""
        found = (re.fullmatch(r"READY rank=(\d+) pid=(\d+)", m) for m in self.marks)
        return {int(x[1]): int(x[2]) for x in found if x}

    def marked(self, prefix: str) -> dict[int, str]:
        """rank -> the rest of the line, for the markers ``<prefix> rank=<r> ...``."""
        found = (re.fullmatch(rf"{prefix} rank=(\d+) ?(.*)", m) for m in self.marks)
        return {int(x[1]): x[2] for x in found if x}

    def describe(self) -> str:
        return (f"exit status {self.returncode} after {self.elapsed:.1f} s\n--- markers:\n"
                + "\n".join(self.marks) + "\n--- output:\n" + self.output[-6000:])


def _env(marks: Path, extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
              FINALIZE_GRACE_ENV):
        env.pop(k, None)
    env["NUMBA_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["MPI_TEST_MARKS"] = str(marks)
    env.update(extra)
    return env


def _alive(pid: int, script: Path) -> bool:
    """True when ``pid`` is still a (non-zombie) process running ``script``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and str(script).encode() in cmdline


def _kill_leftovers(pids: list[int], script: Path) -> list[int]:
    """Continue and kill the ranks of this job that are still alive; return their pids."""
    killed = []
    for pid in pids:
        if _alive(pid, script):
            killed.append(pid)
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
    return killed


def run_job(tmp_path: Path, n: int, script: str, *args: str, limit: float,
            env: dict[str, str] | None = None) -> tuple[Job, list[int]]:
    """Run ``mpiexec -n n python scripts/<script> args``, killed after ``limit`` seconds.

    Returns the job and the pids of its ranks that were still alive when it ended (they have
    been killed since)."""
    assert MPIEXEC.exists(), "the mpi extra (mpi4py + mpich) must be installed"
    path = SCRIPTS / script
    marks = tmp_path / f"marks-{script}-{n}"
    marks.mkdir()
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable, str(path), *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(marks, env or {}), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec's own session: this job only
        output, _ = proc.communicate()
    elapsed = time.monotonic() - start
    lines = []
    for f in sorted(marks.iterdir()):
        lines.extend(f.read_text().splitlines())
    job = Job(proc.returncode, elapsed, output, lines)
    pids = list(job.pids().values())
    # mpiexec ends its ranks when it exits; give the kernel a moment to reap them.
    give_up = time.monotonic() + 5.0
    while any(_alive(p, path) for p in pids) and time.monotonic() < give_up:
        time.sleep(0.1)
    return job, _kill_leftovers(pids, path)


# --------------------------------------------------------------------------------------------
# (a) an uncaught exception on one rank ends the whole job
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("n", "mode"), [(4, "with"), (3, "plain")])
def test_uncaught_exception_ends_the_job(tmp_path: Path, n: int, mode: str) -> None:
    """Rank 2 raises after a first collective; the others wait in the next collective with a
    300 s deadline. MPI_Abort from the exception hook ends every rank within seconds."""
    job, leftovers = run_job(tmp_path, n, "mpi_uncaught.py", mode, limit=90)
    info = job.describe()
    print(f"uncaught exception, {n} ranks ({mode}): {info.splitlines()[0]}")
    assert job.returncode != 0, info
    assert job.elapsed < 90, info  # ended by the abort, not by the limit (nor the deadline)
    assert sorted(job.pids()) == list(range(n)), info  # every rank got past the first one
    assert "RuntimeError: deliberate failure on rank 2" in job.output, info  # the traceback
    assert "uncaught RuntimeError, aborting the MPI job" in job.output, info
    assert not job.marked("UNREACHABLE"), info
    assert not leftovers, info


# --------------------------------------------------------------------------------------------
# (b) a stopped rank: the survivors time out, then the job ends instead of hanging at exit
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("n", "grace"), [(4, 2.0), (3, 1.0)])
def test_stopped_rank_does_not_hang_the_job(tmp_path: Path, n: int,
                                             grace: float | None) -> None:
    """Rank 2 stops itself (SIGSTOP). The others get CommError at their 3 s deadline (the
    first ones CommTimeoutError, the rest PeerLostError naming it), catch it and exit
    normally; MPI_Finalize would wait for the stopped rank forever, so the grace timer ends
    the job (its grace set by the environment variable; the default's value is read by
    test_finalize_grace_from_the_environment, not waited out here)."""
    timeout = 3.0
    env = {} if grace is None else {FINALIZE_GRACE_ENV: str(grace)}
    bound = timeout + (FINALIZE_GRACE_SECONDS if grace is None else grace)
    limit = bound + 60
    job, leftovers = run_job(tmp_path, n, "mpi_sigstop.py", str(timeout), env=env,
                             limit=limit)
    info = job.describe()
    print(f"stopped rank, {n} ranks (grace {grace}): {info.splitlines()[0]}")
    survivors = [r for r in range(n) if r != 2]
    caught = job.marked("CAUGHT")
    assert sorted(caught) == survivors, info
    assert any(" CommTimeoutError: " in text for text in caught.values()), info
    for text in caught.values():
        assert "CommTimeoutError" in text, info  # its own, or the one a peer aborted with
        waited = float(text.split()[0].removeprefix("after="))
        assert waited > timeout - 0.5, info  # at the deadline, not before
    assert sorted(job.marked("EXITING")) == survivors, info
    assert "MPI_Finalize gets" in job.output, info
    assert job.returncode != 0, info
    assert job.elapsed < limit, info  # it ended by itself, not killed at the limit
    assert not leftovers, f"the stopped rank outlived the job (pids {leftovers})\n{info}"


# --------------------------------------------------------------------------------------------
# (c) failures the program handles: the job exits normally
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [3, 4])
def test_handled_failures_exit_normally(tmp_path: Path, n: int) -> None:
    """A mismatch (every rank fails at once) and a timeout (rank 0 skips a barrier), both
    caught, then more collectives and a normal exit: exit status 0, although the timeout
    armed the finalize timer on the ranks that timed out (every rank reaches MPI_Finalize)."""
    job, leftovers = run_job(tmp_path, n, "mpi_caught.py", limit=120)
    info = job.describe()
    print(f"handled failures, {n} ranks: {info.splitlines()[0]}")
    assert job.returncode == 0, info
    assert sorted(job.marked("MISMATCH")) == list(range(n)), info
    assert sorted(job.marked("TIMEOUT")) == list(range(1, n)), info
    assert sorted(job.marked("DONE")) == list(range(n)), info
    assert "MPI_Finalize gets" in job.output, info
    assert "BAD TERMINATION" not in job.output and "MPI_Abort" not in job.output, info
    assert not leftovers, info


# --------------------------------------------------------------------------------------------
# The grace setting (no MPI needed)
# --------------------------------------------------------------------------------------------


def test_finalize_grace_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FINALIZE_GRACE_ENV, raising=False)
    assert finalize_grace() == FINALIZE_GRACE_SECONDS == 10.0
    for text, want in [("2.5", 2.5), (" 30 ", 30.0), ("inf", float("inf")),
                       ("0", FINALIZE_GRACE_SECONDS), ("-1", FINALIZE_GRACE_SECONDS),
                       ("nan", FINALIZE_GRACE_SECONDS), ("soon", FINALIZE_GRACE_SECONDS),
                       ("", FINALIZE_GRACE_SECONDS)]:
        monkeypatch.setenv(FINALIZE_GRACE_ENV, text)
        assert finalize_grace() == want, text
