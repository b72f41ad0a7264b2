"""An elastic job for torchrun ``--max-restarts N`` (tests/test_elastic_torchrun.py).

Every rank sums seeded vectors step by step through bitcoll.elastic on torchrun's agent
store; the first incarnation (``TORCHELASTIC_RESTART_COUNT`` 0) of the rank named by
``ELASTIC_VICTIM`` SIGKILLs itself at step 3. Rank 0 of each epoch writes the state and its
step to ``ELASTIC_CHECKPOINT`` (a file, replaced atomically) after every committed step; a
rank of a new generation's epoch 0 (every process of the job was restarted: nobody holds the
state any more) resumes from it, a joiner of a running job receives the state from the
holders. The job ends once ``STEPS`` steps are committed with the full world; every rank
prints its generation, world size, committed steps and the state's checksum."""

from __future__ import annotations

import os
import signal
import zlib

import numpy as np

from bitcoll.elastic import ElasticGroup, JobFinished, share_state
from bitcoll.errors import CommError

STEPS = 12
N = 1024


def main() -> None:
    try:
        group = ElasticGroup.from_env(timeout=10.0, dead_after=2.0, join_check=0.02)
    except JobFinished:
        return
    checkpoint = os.environ["ELASTIC_CHECKPOINT"]
    w = np.zeros(N, np.float32)
    committed = -1
    victim = os.environ["RANK"] == os.environ.get("ELASTIC_VICTIM") and \
        os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    full = int(os.environ["WORLD_SIZE"])
    resumed = -1
    if group.epoch.number == 0 and os.path.exists(checkpoint):  # a fresh generation
        saved = np.fromfile(checkpoint, np.uint8)
        w[:] = saved[:4 * N].view(np.float32)
        committed = resumed = int(saved[4 * N:].view(np.int64)[0])

    def state() -> np.ndarray:
        return np.concatenate([w.view(np.uint8), np.array([committed], np.int64).view(np.uint8)])

    def settle() -> None:
        nonlocal committed
        while True:
            try:
                if group.epoch.joined:
                    s = state()
                    share_state(group.comm, s, group.epoch.holders)
                    w[:] = s[:4 * N].view(np.float32)
                    committed = int(s[4 * N:].view(np.int64)[0])
                return
            except CommError:
                group.recover(committed, False, has_state=False)

    def save() -> None:
        if group.epoch.rank == 0:
            tmp = f"{checkpoint}.{os.getpid()}"
            state().tofile(tmp)
            os.replace(tmp, checkpoint)

    settle()
    while True:
        k = committed + 1
        pending = None
        try:
            want = 1 if k >= STEPS and group.epoch.size == full else 0
            if group.comm.allreduce(np.array([want], np.int64), op="min")[0]:
                break
            if victim and k == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            pending = group.comm.allreduce(np.full(N, k, np.float32), op="max")
            grow = group.commit(k)
            w += pending
            committed = k
            pending = None
            save()
            if grow:
                group.recover(committed)
                settle()
        except CommError:
            epoch = group.recover(committed, pending is not None)
            if epoch.action == "apply" and pending is not None:
                w += pending
                committed += 1
                save()
            settle()
    group.finish()
    line = (f"rank {group.epoch.rank} restart={os.environ.get('TORCHELASTIC_RESTART_COUNT')} "
            f"generation={group.generation} epoch={group.epoch.number} resumed={resumed} "
            f"size={group.epoch.size} steps={committed + 1} crc={zlib.crc32(w.tobytes())}\n")
    os.write(1, line.encode())  # one write: the workers share torchrun's stdout
    group.close()


if __name__ == "__main__":
    main()
