"""bitcoll.elastic under torchrun ``--max-restarts 1`` (tests/scripts/elastic_torchrun_job.py):
a worker SIGKILLs itself at step 3 and torchrun's agent starts a replacement.

* One node (``--standalone``, the c10d rendezvous): the agent stops *every* worker of the
  node and starts them all again. The new processes find the job's last epoch with nobody
  left, start the next generation of the job on the agent store, resume from the job's
  checkpoint and finish with the world of 3.
* Three nodes of one worker each (the static rendezvous): only the failed node's agent
  restarts its worker; the two others keep running, go on without it, and take the
  replacement back in as a joiner (it receives the state from them).

Both check the world size at the end and that every rank holds bitwise the state of the
committed steps, each step counted once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from tcp_world import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "elastic_torchrun_job.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"

pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "BITCOLL_MASTER_PORT", "BITCOLL_ELASTIC_STORE",
                "BITCOLL_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_RESTART_COUNT")
_END = re.compile(r"rank (\d) restart=(\d) generation=(\d+) epoch=(\d+) resumed=(-?\d+) "
                  r"size=(\d) steps=(\d+) crc=(\d+)")


def _env(checkpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               BITCOLL_SECRET="elastic-torchrun-test", ELASTIC_VICTIM="1",
               ELASTIC_CHECKPOINT=checkpoint, PYTHONPATH=str(ROOT))
    return env


def _reference_crc(steps: int) -> int:
    w = np.zeros(1024, np.float32)
    for k in range(steps):
        w += np.float32(k)
    return zlib.crc32(w.tobytes())


def _ends(text: str) -> list[tuple[str, ...]]:
    return [m.groups() for m in map(_END.search, text.splitlines()) if m]


def _check_state(ends: list[tuple[str, ...]], text: str) -> None:
    assert len(ends) == 3, text[-6000:]
    assert sorted(e[0] for e in ends) == ["0", "1", "2"], ends
    assert {e[5] for e in ends} == {"3"}, ends  # the world grew back
    assert len({(e[2], e[3], e[6], e[7]) for e in ends}) == 1, ends  # one state everywhere
    steps = int(ends[0][6])
    assert steps >= 12 and int(ends[0][7]) == _reference_crc(steps), ends


@pytest.mark.timeout(200)
def test_torchrun_one_node_restarts_every_worker() -> None:
    with tempfile.TemporaryDirectory(prefix="elastic-torchrun-") as folder:
        proc = subprocess.run(
            [str(TORCHRUN), "--standalone", "--nnodes", "1", "--nproc-per-node", "3",
             "--max-restarts", "1", "--monitor-interval", "0.1", str(SCRIPT)],
            cwd=ROOT, env=_env(os.path.join(folder, "state")), capture_output=True,
            text=True, timeout=180)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert "exitcode: -9" in proc.stderr and "local_rank: 1" in proc.stderr, text[-6000:]
    ends = _ends(proc.stdout)
    _check_state(ends, text)
    # every worker is a replacement (restart 1) in generation 1's first epoch, resumed from
    # the checkpoint of a step at or after the last one before the kill (step 2)
    assert all(e[1] == "1" and e[2] == "1" and e[3] == "0" for e in ends), ends
    assert len({e[4] for e in ends}) == 1 and int(ends[0][4]) >= 2, ends


@pytest.mark.timeout(200)
def test_torchrun_static_nodes_replacement_rejoins() -> None:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="elastic-torchrun-") as folder:
        env = _env(os.path.join(folder, "state"))
        procs = [subprocess.Popen(
            [str(TORCHRUN), "--nnodes", "3", "--node-rank", str(k), "--nproc-per-node", "1",
             "--max-restarts", "1", "--monitor-interval", "0.1", "--master-addr",
             "127.0.0.1", "--master-port", str(port), str(SCRIPT)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for k in range(3)]
        outs = [p.communicate(timeout=180) for p in procs]
    text = "".join(o + e for o, e in outs)
    assert all(p.returncode == 0 for p in procs), text[-6000:]
    assert "exitcode: -9" in outs[1][1], text[-6000:]  # node 1's worker was killed
    ends = _ends("".join(o for o, _ in outs))
    _check_state(ends, text)
    # one generation: the survivors went on, the replacement (restart 1) joined as the last
    # rank; one transition at least (the shrink and the grow are one when the replacement
    # registers before the survivors' transition starts, two otherwise)
    assert {e[2] for e in ends} == {"0"} and int(ends[0][3]) >= 1, ends
    assert [e[1] for e in ends if e[0] == "2"] == ["1"], ends
    assert all(e[4] == "-1" for e in ends), ends  # nobody needed the checkpoint
