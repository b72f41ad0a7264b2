"""lioncub.elastic with real processes: a rank is killed inside an optimizer step, a
replacement joins, and every replica ends with bitwise the same parameters; right after the
join every replica holds the same momenta (the holders' average)."""

from __future__ import annotations

import os
import signal
import time
import traceback
from typing import Any

import numpy as np
import pytest
from test_elastic import SECRET, _fire, _Reports, run_job

from bitcoll import elastic
from bitcoll.errors import CommError
from bitcoll.transport.rendezvous.store import StoreClient
from bitcoll.transport.rendezvous.tcp_bootstrap import RendezvousStore


def _grads(step: int, rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng([step, rank])
    return [rng.standard_normal(4099).astype(np.float32),
            rng.standard_normal(7).astype(np.float32)]


def _lion_worker(rank: int, size: int, port: int, steps: int, faults: dict[Any, Any],
                 faults_dir: str, reports_dir: str, timeout: float) -> None:
    name = f"rank{rank}" if rank >= 0 else f"joiner{os.getpid()}"
    q = _Reports(reports_dir, name)
    try:
        from lioncub.distributed import DistributedLion
        from lioncub.elastic import ElasticLion

        def connect() -> RendezvousStore:
            return StoreClient.connect("127.0.0.1", port, time.monotonic() + timeout,
                                       secret=SECRET)

        group = elastic.ElasticGroup.create(connect, SECRET, max(rank, 0), size,
                                            timeout=timeout, dead_after=3.0, join_check=0.02)
        params = [np.full(4099, 0.5, np.float32), np.zeros(7, np.float32)]
        if rank >= 0:
            params[0] += np.float32(rank)  # rank 0's weights win at the start

        def make(comm: Any, **kw: Any) -> DistributedLion:
            return DistributedLion(params, comm, variant="lioncub-l1", lr=1e-2,
                                   momentum_sync="exp:2", **kw)

        opt = ElasticLion(group, params, make)
        joined: list[tuple[int, bytes]] = []
        while True:
            ep = group.epoch
            if ep.joined and ep.number not in [j[0] for j in joined]:
                mom = np.concatenate([m.reshape(-1) for m in opt.opt.state_dict()["momentum"]])
                joined.append((ep.number, mom.tobytes()))
            want = 1 if opt.step_count >= steps and os.path.exists(
                os.path.join(faults_dir, "kill")) and ep.size == size else 0
            try:
                stop = group.comm.allreduce(np.array([want], np.int64), op="min")[0]
            except CommError:
                opt.recover()
                continue
            if stop:
                break
            if ep.rank == 0 and opt.step_count >= 3 and ep.number == 0 and \
                    _fire(faults_dir, "kill"):
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step(_grads(opt.step_count, ep.rank))
        opt.opt.check_replicas()
        group.finish()
        q.put((name, "done", (opt.committed, b"".join(p.tobytes() for p in params), joined,
                              opt.lost_steps)))
        group.close()
    except elastic.JobFinished:
        q.put((name, "finished before joining", None))
    except BaseException:
        q.put((name, "error", traceback.format_exc()))
        raise


@pytest.mark.timeout(120)
def test_lion_survives_a_kill_and_takes_a_replacement() -> None:
    reports = run_job(3, 8, {}, restarts=1, worker=_lion_worker)
    errors = [v for r in reports.values() for k, v in r if k == "error"]
    assert not errors, "\n".join(errors)
    done = [r[-1][1] for r in reports.values() if r and r[-1][0] == "done"]
    assert len(done) == 3, reports
    assert len({d[0] for d in done}) == 1 and done[0][0] >= 7
    assert len({d[1] for d in done}) == 1, "replicas differ"
    after_join: dict[int, set[bytes]] = {}
    for d in done:
        for number, mom in d[2]:
            after_join.setdefault(number, set()).add(mom)
    assert after_join, "no join was seen"
    for number, moms in after_join.items():
        assert len(moms) == 1, f"momenta differ right after the join of epoch {number}"
