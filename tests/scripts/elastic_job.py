"""An elastic job for ``python -m launch --max-restarts N`` (tests/test_elastic_launch.py):
every rank sums seeded vectors step by step through bitcoll.elastic; the first incarnation of
the rank named by ``ELASTIC_VICTIM`` SIGKILLs itself at step 3; at the end rank 0 prints the
state's checksum and the world size."""

from __future__ import annotations

import os
import signal
import zlib

import numpy as np

from bitcoll.elastic import ElasticGroup, JobFinished, share_state
from bitcoll.errors import CommError

STEPS = 12


def main() -> None:
    try:
        group = ElasticGroup.from_env(timeout=10.0, dead_after=2.0, join_check=0.02)
    except JobFinished:
        return
    w = np.zeros(1024, np.float32)
    committed = -1
    victim = os.environ["RANK"] == os.environ.get("ELASTIC_VICTIM") and \
        os.environ.get("BITCOLL_RESTART_COUNT") == "0"
    full = int(os.environ["WORLD_SIZE"])

    def settle(epoch: object) -> None:
        nonlocal committed
        while True:
            try:
                if group.epoch.joined:
                    state = np.concatenate([w.view(np.uint8),
                                            np.array([committed], np.int64).view(np.uint8)])
                    share_state(group.comm, state, group.epoch.holders)
                    w[:] = state[:4096].view(np.float32)
                    committed = int(state[4096:].view(np.int64)[0])
                return
            except CommError:
                group.recover(committed, False, has_state=False)

    settle(group.epoch)
    while True:
        k = committed + 1
        pending = None
        try:
            want = 1 if k >= STEPS and group.epoch.size == full else 0
            if group.comm.allreduce(np.array([want], np.int64), op="min")[0]:
                break
            if victim and k == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            pending = group.comm.allreduce(np.full(1024, k, np.float32), op="max")
            grow = group.commit(k)
            w += pending
            committed = k
            pending = None
            if grow:
                group.recover(committed)
                settle(group.epoch)
        except CommError:
            epoch = group.recover(committed, pending is not None)
            if epoch.action == "apply" and pending is not None:
                w += pending
                committed += 1
            settle(epoch)
    group.finish()
    if group.epoch.rank == 0:
        print(f"done steps={committed + 1} size={group.epoch.size} "
              f"crc={zlib.crc32(w.tobytes())}", flush=True)
    group.close()


if __name__ == "__main__":
    main()
