"""examples/elastic_numpy.py, the documented fault-tolerant loop, under ``python -m launch
--max-restarts 1``: rank 1 dies inside a step, the survivors go on, the replacement joins,
and every rank ends with the same weights and loss, below the starting loss."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "elastic_numpy.py"


@pytest.mark.timeout(200)
def test_elastic_example_survives_a_kill_and_grows_back() -> None:
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    env.pop("BITCOLL_SECRET", None)
    proc = subprocess.run([sys.executable, "-m", "launch", "-n", "3", "--max-restarts", "1",
                           str(EXAMPLE), "--steps", "30", "--kill-at", "10",
                           "--dead-after", "3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 1" in proc.stderr and "killed by SIGKILL; restart 1 of 1" in proc.stderr, \
        proc.stderr
    pat = re.compile(r"rank (\d) of (\d): (\d+) steps, epoch (\d+), lost (\d+), loss ([\d.]+), "
                     r"crc (\d+)")
    ends = [m.groups() for m in map(pat.search, proc.stdout.splitlines()) if m]
    assert len(ends) == 3, proc.stdout  # the replacement joined: three ranks finish
    assert sorted(int(e[0]) for e in ends) == [0, 1, 2] and {e[1] for e in ends} == {"3"}
    # one state everywhere: steps, epoch, loss and weights' checksum agree
    assert len({(e[2], e[3], e[5], e[6]) for e in ends}) == 1, ends
    # a shrink and a grow: two transitions, or one when the replacement registers before the
    # survivors' transition starts
    assert int(ends[0][2]) >= 30 and int(ends[0][3]) >= 1
    # the two survivors (epoch ranks 0 and 1; the replacement comes after them) lost the
    # step in flight
    assert all(int(e[4]) >= 1 for e in ends if e[0] != "2"), ends
    # below the loss at zero weights, 893.2 (seed 0); how far below depends on how many steps
    # the survivors made while the replacement started (200-240 on a quiet machine: 39-77)
    assert float(ends[0][5]) < 893.0
