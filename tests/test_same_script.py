"""The same script runs unchanged under the launcher (TCP) and under mpiexec (MPI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "hello_collectives.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    env["NUMBA_NUM_THREADS"] = "1"
    return env


@pytest.mark.timeout(120)
def test_script_under_launcher() -> None:
    out = subprocess.run([sys.executable, "-m", "launch", "-n", "3", str(SCRIPT)],
                         capture_output=True, text=True, timeout=100, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(3):
        assert f"rank {r}/3 backend=tcp ok" in out.stdout


@pytest.mark.timeout(120)
def test_script_under_mpiexec() -> None:
    assert MPIEXEC.exists(), "the mpi extra (mpi4py + mpich) must be installed"
    out = subprocess.run([str(MPIEXEC), "-n", "3", sys.executable, str(SCRIPT)],
                         capture_output=True, text=True, timeout=100, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(3):
        assert f"rank {r}/3 backend=mpi ok" in out.stdout


def test_script_alone_is_one_rank() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         timeout=100, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0/1 backend=local ok" in out.stdout
