"""An elastic job for ``python -m launch --max-restarts N`` (tests/test_elastic_launch.py):
every rank sums seeded vectors step by step through bitcoll.elastic; the first incarnation of
the rank named by ``ELASTIC_VICTIM`` SIGKILLs itself at step 3; at the end rank 0 prints the
state's checksum and the world size. With ``ELASTIC_DIE_FORMING=1`` every rank's first
incarnation SIGKILLs itself once epoch 0 is decided, before its connections are built.
:func:`run_job` is the loop, which
``elastic_torchrun_job.py`` shares."""

from __future__ import annotations

import os
import signal
import zlib

import numpy as np

from bitcoll.elastic import ElasticGroup, JobFinished, share_state
from bitcoll.errors import CommError

STEPS = 12
N = 1024


def run_job(group: ElasticGroup, victim: bool, checkpoint: str | None = None
            ) -> tuple[np.ndarray, int, int]:
    """Sum ``np.full(N, k)`` at step ``k`` until ``STEPS`` steps are committed with the full
    world (``WORLD_SIZE``); ``victim``: SIGKILL this process at step 3. ``checkpoint``: a
    file that rank 0 of each epoch replaces with the state and its step after every
    committed step, and from which a process of a new generation's epoch 0 resumes (nobody
    holds the state any more); joiners of a running job receive it from the holders. Returns
    the state, the last committed step and the step resumed from (-1: none)."""
    w = np.zeros(N, np.float32)
    committed = resumed = -1
    full = int(os.environ["WORLD_SIZE"])
    if checkpoint is not None and group.epoch.number == 0 and os.path.exists(checkpoint):
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
        if checkpoint is not None and group.epoch.rank == 0:
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
    return w, committed, resumed


def join(restart_variable: str) -> tuple[ElasticGroup, bool] | None:
    """This process's group (None: the job has finished) and whether it is the victim: the
    rank named by ``ELASTIC_VICTIM`` in its first incarnation (``restart_variable`` 0)."""
    if os.environ.get("ELASTIC_DIE_FORMING") == "1" and os.environ.get(restart_variable) == "0":
        from bitcoll import elastic

        def die(point: str, epoch: elastic.Epoch) -> None:  # every first incarnation dies
            if point == "initial":  # once epoch 0 is decided
                os.kill(os.getpid(), signal.SIGKILL)

        elastic._FAULT_HOOK = die
    try:
        group = ElasticGroup.from_env(timeout=10.0, dead_after=2.0, join_check=0.02)
    except JobFinished:
        return None
    return group, os.environ["RANK"] == os.environ.get("ELASTIC_VICTIM") and \
        os.environ.get(restart_variable) == "0"


def main() -> None:
    joined = join("BITCOLL_RESTART_COUNT")
    if joined is None:
        return
    group, victim = joined
    w, committed, _ = run_job(group, victim)
    group.finish()
    if group.epoch.rank == 0:
        print(f"done steps={committed + 1} size={group.epoch.size} "
              f"crc={zlib.crc32(w.tobytes())}", flush=True)
    group.close()


if __name__ == "__main__":
    main()
