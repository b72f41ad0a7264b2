"""``python -m launch --max-restarts N``: the launcher serves the store, so the job survives
the SIGKILL of rank 0 (which would take a rank-hosted store with it); the restarted rank
joins and the world grows back."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from launch.store_host import pop_max_restarts

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "elastic_job.py"


def test_pop_max_restarts() -> None:
    assert pop_max_restarts(["-n", "2", "--max-restarts", "3", "x.py", "--max-restarts", "9"]) \
        == (3, ["-n", "2", "x.py", "--max-restarts", "9"])
    assert pop_max_restarts(["--max-restarts=0", "-n", "2", "x.py"]) == (0, ["-n", "2", "x.py"])
    assert pop_max_restarts(["-n", "2", "x.py", "--max-restarts", "1"]) == \
        (None, ["-n", "2", "x.py", "--max-restarts", "1"])


@pytest.mark.timeout(120)
def test_rank_0_dies_and_comes_back() -> None:
    env = dict(os.environ, ELASTIC_VICTIM="0", NUMBA_NUM_THREADS="1")
    env.pop("BITCOLL_SECRET", None)
    proc = subprocess.run([sys.executable, "-m", "launch", "-n", "3", "--max-restarts", "1",
                           str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0" in proc.stderr and "restart 1 of 1" in proc.stderr, proc.stderr
    w = np.zeros(1024, np.float32)
    done = [line for line in proc.stdout.splitlines() if "done steps=" in line]
    assert len(done) == 1, proc.stdout
    steps = int(done[0].split("steps=")[1].split()[0])
    for k in range(steps):
        w += np.float32(k)
    assert f"size=3 crc={zlib.crc32(w.tobytes())}" in done[0], done[0]


@pytest.mark.timeout(120)
def test_every_rank_dies_while_the_first_epoch_forms() -> None:
    """All first incarnations die once epoch 0 is decided (before any connection of it is
    built): the restarted processes find every member of the dead epoch gone, start a new
    generation, form epoch 0 among themselves and run the job to the end."""
    env = dict(os.environ, ELASTIC_DIE_FORMING="1", NUMBA_NUM_THREADS="1")
    env.pop("BITCOLL_SECRET", None)
    env.pop("ELASTIC_VICTIM", None)
    proc = subprocess.run([sys.executable, "-m", "launch", "-n", "3", "--max-restarts", "3",
                           str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    restarts = [line for line in proc.stderr.splitlines() if "killed by SIGKILL; restart" in line]
    assert len(restarts) == 3, proc.stderr
    w = np.zeros(1024, np.float32)
    for k in range(12):
        w += np.float32(k)
    done = [line for line in proc.stdout.splitlines() if "done steps=" in line]
    assert done == [f"[rank 0] done steps=12 size=3 crc={zlib.crc32(w.tobytes())}"], proc.stdout
