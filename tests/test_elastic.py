"""Membership epochs with real processes (bitcoll.elastic): ranks are killed (SIGKILL) or
stopped (SIGSTOP) inside collectives, at every rank position, two at once, during a recovery
and during a joiner's state transfer; the survivors go on, a replacement joins, and every
rank that finishes holds bitwise the state of the committed steps, each applied once.

The test process plays the launcher: it serves the store (so any rank, rank 0 included, may
die), starts a replacement whenever a rank dies, and sends SIGCONT to a stopped rank once
the others went on without it. The faults are injected by the ranks themselves at a given
step and epoch rank (each fires once: a file created with O_EXCL), so nothing depends on
timing. The liveness verdicts do not either: a killed process is seen dead in ``/proc``, the
stopped one by its heartbeat standing still for ``dead_after`` (3 s here: no live process's
heartbeat thread starves that long), and a live member is waited for while its heartbeat
moves, whichever survivor reports first. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pickle
import signal
import tempfile
import threading
import time
import traceback
from typing import Any

import numpy as np
import pytest
from multiproc import free_port, start

from bitcoll import elastic
from bitcoll.errors import BitcollError, CommError
from bitcoll.transport.rendezvous.store import StoreClient, StoreServer
from bitcoll.transport.rendezvous.tcp_bootstrap import RendezvousStore, _Rendezvous, build_mesh

SECRET = b"elastic-test-secret"
N = 1 << 15  # elements of the exchanged vector: several frames per collective


def _grad(step: int) -> np.ndarray:
    return np.random.default_rng(1000 + step).standard_normal(N).astype(np.float32)


def reference(steps: int) -> np.ndarray:
    w = np.zeros(N, np.float32)
    for k in range(steps):
        w += _grad(k)
    return w


def _fire(faults_dir: str, name: str) -> bool:
    """True the first time a fault is reached in the whole job (O_EXCL file)."""
    try:
        os.close(os.open(os.path.join(faults_dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class _Reports:
    """What a process reports, appended to a file of its own (a queue shared by processes
    that are killed or stopped at any moment could be left locked)."""

    def __init__(self, folder: str, name: str) -> None:
        self.name = name
        self.path = os.path.join(folder, f"{name}.pkl")

    def put(self, item: tuple[str, str, Any]) -> None:
        with open(self.path, "ab") as f:
            f.write(pickle.dumps(item[1:]))


def _read_reports(folder: str) -> dict[str, list[tuple[str, Any]]]:
    out: dict[str, list[tuple[str, Any]]] = {}
    for fn in sorted(os.listdir(folder)):
        items = out.setdefault(fn[:-4], [])
        with open(os.path.join(folder, fn), "rb") as f:
            while True:
                try:
                    items.append(pickle.load(f))
                except EOFError:
                    break
                except pickle.UnpicklingError:  # a record cut short by a kill
                    break
    return out


def _worker(rank: int, size: int, port: int, steps: int, faults: dict[Any, Any],
            faults_dir: str, reports_dir: str, timeout: float) -> None:
    """One process of the job: ``rank`` < 0 for a replacement (a joiner)."""
    name = f"rank{rank}" if rank >= 0 else f"joiner{os.getpid()}"
    q = _Reports(reports_dir, name)
    if os.environ.get("ELASTIC_TEST_LOG"):
        import logging

        logging.basicConfig(filename=os.path.join(os.environ["ELASTIC_TEST_LOG"], name),
                            level=logging.DEBUG, format="%(relativeCreated)d %(message)s")
    try:
        _work(name, rank, size, port, steps, faults, faults_dir, q, timeout)
    except BaseException:
        q.put((name, "error", traceback.format_exc()))
        raise


def _work(name: str, rank: int, size: int, port: int, steps: int, faults: dict[Any, Any],
          faults_dir: str, q: Any, timeout: float) -> None:

    def connect() -> RendezvousStore:
        return StoreClient.connect("127.0.0.1", port, time.monotonic() + timeout,
                                   secret=SECRET)

    hook_fault = faults.get("recovery")

    def hook(point: str, epoch: elastic.Epoch) -> None:
        if hook_fault is not None and point == hook_fault[1] and \
                epoch.rank == hook_fault[0] and _fire(faults_dir, "recovery"):
            q.put((name, "victim", (os.getpid(), signal.SIGKILL, epoch.rank, -1)))
            os.kill(os.getpid(), signal.SIGKILL)

    elastic._FAULT_HOOK = hook
    group = elastic.ElasticGroup(connect, SECRET, max(rank, 0), size, timeout=timeout,
                                 dead_after=3.0, join_check=0.02, join_timeout=60.0)
    w = np.zeros(N, np.float32)
    committed = -1
    has_state = rank >= 0
    epochs: list[tuple[int, int, tuple[int, ...]]] = []

    def fault(step: int, phase: str) -> None:
        # a fault (first step, phase) fires at its first step >= first where the world is
        # whole again, on the ranks it names
        # (in order: one at a time)
        todo = sorted((at, spec) for at, spec in faults.items() if isinstance(at, tuple)
                      and not os.path.exists(os.path.join(faults_dir, f"{at[0]}-{at[1]}-done")))
        if not todo:
            return
        (first, where), spec = todo[0]
        done = [int(pathlib.Path(faults_dir, f).read_text() or 0)
                for f in os.listdir(faults_dir) if f.endswith("-done")]
        if not (where == phase and step >= first and group.epoch.size == size
                and group.epoch.rank in spec[1] and group.epoch.number > max(done, default=-1)):
            return
        key = f"{first}-{phase}-{group.epoch.rank}"
        if _fire(faults_dir, key):
            if len([f for f in os.listdir(faults_dir) if f.startswith(f"{first}-{phase}-")]) \
                    >= len(spec[1]):
                with open(os.path.join(faults_dir, f"{first}-{phase}-done"), "w") as f:
                    f.write(str(group.epoch.number))  # the next fault waits for a later epoch
            q.put((name, "victim", (os.getpid(), spec[0], group.epoch.rank, step)))
            x = _grad(step) if phase != "commit" else np.array([step, -step, 0], np.int64)
            work = group.comm.allreduce(x, op="max", async_op=True)
            os.kill(os.getpid(), spec[0])
            with contextlib.suppress(BitcollError):  # SIGSTOP: resumed by the test
                work.wait()

    def settle(epoch: elastic.Epoch, pending: np.ndarray | None) -> None:
        nonlocal committed, w, has_state
        while True:
            epochs.append((epoch.number, epoch.size, epoch.left))
            q.put((name, "epoch", (epoch.number, epoch.rank, epoch.size, epoch.left)))
            if epoch.action == "apply":
                assert pending is not None
                w += pending
                committed += 1
            pending = None
            try:
                if epoch.joined:
                    if rank < 0 and "transfer" in faults and epoch.rank in epoch.joined \
                            and _fire(faults_dir, "transfer"):
                        # the real exchange of share_state, cut short by the kill
                        block = -(-(N * 4 + 8) // len(epoch.holders))
                        group.comm.alltoall(np.zeros(epoch.size * block, np.uint8),
                                            async_op=True)
                        os.kill(os.getpid(), signal.SIGKILL)
                    state = np.concatenate([w.view(np.uint8),
                                            np.array([committed], np.int64).view(np.uint8)])
                    elastic.share_state(group.comm, state, epoch.holders)
                    w = state[:N * 4].view(np.float32).copy()
                    committed = int(state[N * 4:].view(np.int64)[0])
                    has_state = True
                return
            except CommError as exc:
                elastic._log.debug("state transfer failed: %r", exc)
                epoch = group.recover(committed, False, has_state=has_state)

    while True:
        try:
            epoch = group.start() if group._store is None else group.rejoin()
            settle(epoch, None)
            while True:
                k = committed + 1
                pending = None
                try:
                    # the ranks stop together: after the steps asked for, once every fault
                    # has fired and the world is whole again
                    fired = len([f for f in os.listdir(faults_dir) if f.endswith("-done") or
                                 f in ("recovery", "transfer")])
                    want = 1 if committed + 1 >= steps and fired >= len(faults) and \
                        group.epoch.size == size else 0
                    if group.comm.allreduce(np.array([want], np.int64), op="min")[0]:
                        break
                    fault(k, "exchange")
                    pending = group.comm.allreduce(_grad(k), op="max")
                    fault(k, "commit")
                    grow = group.commit(k)
                    w += pending
                    committed = k
                    pending = None
                    if grow:
                        settle(group.recover(committed), None)
                except CommError as exc:
                    if isinstance(exc, (elastic.EvictedError, elastic.NoQuorumError)):
                        raise
                    elastic._log.debug("step %d failed: %r", k, exc)
                    settle(group.recover(committed, pending is not None), pending)
            break
        except elastic.JobFinished:
            q.put((name, "finished before joining", None))
            group.close()
            return
        except elastic.EvictedError:
            q.put((name, "evicted", None))
            w[:] = 0
            committed = -1
            has_state = False
            continue
    group.finish()
    q.put((name, "done", (committed, w.tobytes(), epochs, group.transitions)))
    group.close()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def run_job(size: int, steps: int, faults: dict[Any, Any], restarts: int, timeout: float = 3.0,
            deadline_s: float = 100.0, worker: Any = None) -> dict[str, Any]:
    """Serve the store, start ``size`` ranks, restart dead ones (at most ``restarts``), send
    SIGCONT to stopped ones once the others formed a newer epoch; return what every process
    reported."""
    port = free_port()
    server = StoreServer("127.0.0.1", port, secret=SECRET, generation=0)
    client = StoreClient.connect("127.0.0.1", port, time.monotonic() + 10, secret=SECRET)
    faults_dir = tempfile.mkdtemp(prefix="elastic-faults-")
    reports_dir = tempfile.mkdtemp(prefix="elastic-reports-")
    args = (size, port, steps, faults, faults_dir, reports_dir, timeout)
    worker = _worker if worker is None else worker
    procs = [start(worker, r, *args) for r in range(size)]
    stopped: dict[int, int] = {}  # pid -> the newest epoch when it was seen stopped
    restarted = 0
    replaced: set[int] = set()
    deadline = time.monotonic() + deadline_s
    try:
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(f"job did not finish: {_read_reports(reports_dir)}")
            time.sleep(0.02)  # polls the processes' states; sets up no interleaving
            current = client.try_get("elastic/current")
            newest = int(current) if current is not None else 0
            for p in procs:  # a stopped rank is resumed once the others went on
                if p.exitcode is None and p.pid not in stopped and _state(p.pid) == "T":
                    stopped[p.pid] = newest
            for pid, at in list(stopped.items()):
                if newest > at:
                    os.kill(pid, signal.SIGCONT)
                    del stopped[pid]
            for i, p in enumerate(procs):
                if p.exitcode is not None and p.exitcode < 0 and restarted < restarts \
                        and i not in replaced:
                    replaced.add(i)
                    restarted += 1
                    procs.append(start(worker, -1, *args))
            if all(p.exitcode is not None for p in procs) and not stopped:
                break
    finally:
        for p in procs:
            if p.exitcode is None:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.join(5)
        client.close()
        server.close()
    return _read_reports(reports_dir)


def check(reports: dict[str, Any], steps: int, min_done: int) -> list[tuple[str, Any]]:
    """Every process that finished holds the state of the same committed steps (at least
    ``steps``), each applied once: the reference state."""
    errors = [v for r in reports.values() for k, v in r if k == "error"]
    assert not errors, "\n".join(errors)
    done = [(who, r[-1][1]) for who, r in reports.items() if r and r[-1][0] == "done"]
    assert len(done) >= min_done, reports.keys()
    last = {committed for _, (committed, _, _, _) in done}
    assert len(last) == 1 and min(last) >= steps - 1, last
    ref = reference(last.pop() + 1).tobytes()
    for who, (_, w, _, _) in done:
        assert w == ref, f"{who} holds a wrong state"
    return done


@pytest.mark.timeout(150)
def test_sigkill_every_position_then_rejoin() -> None:
    """4 ranks; SIGKILL at epoch rank 0 (in the exchange), 3 (between exchange and commit),
    then 1 and 2 (in the exchange); a replacement joins after each, so every position,
    rank 0 included, dies inside a collective while the world stays at 4."""
    steps = 40
    faults = {(4, "exchange"): (signal.SIGKILL, (0,)), (9, "commit"): (signal.SIGKILL, (3,)),
              (14, "exchange"): (signal.SIGKILL, (1,)), (19, "exchange"): (signal.SIGKILL, (2,))}
    reports = run_job(4, steps, faults, restarts=4)
    done = check(reports, steps, min_done=4)
    victims = [v for r in reports.values() for k, v in r if k == "victim"]
    assert sorted(v[2] for v in victims) == [0, 1, 2, 3], victims
    # the world grew back: every finisher ends in a 4-rank epoch
    for _, (_, _, epochs, _) in done:
        assert epochs[-1][1] == 4, epochs
    lefts = {e[2] for _, (_, _, epochs, _) in done for e in epochs if e[2]}
    assert lefts, "no epoch reported a rank that left"


@pytest.mark.timeout(150)
def test_two_at_once_stop_past_deadline_and_failure_in_recovery() -> None:
    """5 ranks: positions 1 and 3 die in the same exchange (3 of 5 is a quorum); a rank is
    stopped past the deadline (the others go on; resumed, it is refused as a stale member
    and comes back as a joiner); a rank dies while the survivors form a new epoch; a joiner
    dies in its state transfer."""
    steps = 20
    faults = {(3, "exchange"): (signal.SIGKILL, (1, 3)),
              (8, "exchange"): (signal.SIGSTOP, (2,)),
              "recovery": (0, "formed"),
              "transfer": True}
    reports = run_job(5, steps, faults, restarts=4)
    check(reports, steps, min_done=3)
    kinds = [k for r in reports.values() for k, _ in r]
    assert "evicted" in kinds, "the stopped rank was not refused as a stale member"


def _stranger(port: int) -> str:
    try:
        StoreClient.connect("127.0.0.1", port, time.monotonic() + 1.0, secret=b"wrong")
    except BitcollError as exc:
        return type(exc).__name__
    return "admitted"


@pytest.mark.timeout(60)
def test_stranger_and_stale_epoch_key_are_refused() -> None:
    """A process without the job's secret cannot reach the elastic store, and a hello
    proving the key of another epoch (or attempt, or member list) is refused."""
    port = free_port()
    server = StoreServer("127.0.0.1", port, secret=SECRET, generation=0)
    try:
        assert _stranger(port) == "CommTimeoutError"
    finally:
        server.close()
    # a member of epoch 2 dials a member of epoch 3 (same store namespace, same job secret)
    port = free_port()
    server = StoreServer("127.0.0.1", port, secret=SECRET, generation=0)
    results: dict[int, str] = {}

    def member(rank: int, epoch: int) -> None:
        store = StoreClient.connect("127.0.0.1", port, time.monotonic() + 5, secret=SECRET)
        key = elastic.epoch_secret(SECRET, epoch, 0, ["x", "y"])
        rdv = _Rendezvous(store, "elastic/e/2/t/0/mesh/", key, "test")
        try:
            build_mesh(rank, 2, rdv, time.monotonic() + 3.0, 3.0, None, False, 0)
            results[rank] = "connected"
        except BitcollError as exc:
            results[rank] = type(exc).__name__
        finally:
            store.close()

    threads = [threading.Thread(target=member, args=(0, 2)),
               threading.Thread(target=member, args=(1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    server.close()
    assert results == {0: "ProtocolError", 1: "CommTimeoutError"}, results
    a = elastic.epoch_secret(SECRET, 3, 0, ["x", "y"])
    assert a != elastic.epoch_secret(SECRET, 2, 0, ["x", "y"])
    assert a != elastic.epoch_secret(SECRET, 3, 1, ["x", "y"])
    assert a != elastic.epoch_secret(SECRET, 3, 0, ["x", "z"])
    assert a != elastic.epoch_secret(b"other", 3, 0, ["x", "y"])
