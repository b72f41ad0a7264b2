"""Chaos campaign for bitcoll.elastic: kill (SIGKILL) or stop (SIGSTOP) a rank at a random
moment of a running job, many times, and measure the recovery.

Usage::

    python bench/chaos.py --size 4 --trials 20 --signal KILL --out results/elastic/chaos_kill.md
    python bench/chaos.py --size 4 --trials 5 --signal STOP --timeout 3
    BITCOLL_MAX_RESTARTS=1 python bench/netbed.py --hosts 4 --rate 1gbit \
        bench/chaos.py --join-bench --elements 10750000

The last form measures a joiner's state transfer (:func:`join_bench`): every host's launcher
runs an elastic job (``BITCOLL_MAX_RESTARTS``, see :mod:`launch.store_host`), rank 1 dies at
step 2, its host's launcher starts it again and the replacement prints how long it took to
receive the state.

Each trial starts a store (this process: the launcher's role) and ``--size`` ranks (separate
processes) that run a loop of steps: a float32 all-reduce of ``--elements`` (max of a seeded
vector, the same on every rank), the commit point, the update. After a random delay
(seeded: ``--seed`` + trial, printed) this process sends the signal to the rank at epoch
position ``trial % size`` (so every position, rank 0 included, is hit ``trials / size``
times or more). The survivors recover without it; the trial checks that every survivor ends
with bitwise the reference state of the committed steps, and measures from the signal to the
first step committed after the survivors' collectives failed (every rank stamps each commit
and each failure with ``time.monotonic()``, one clock for all processes of the host). A
stopped rank is killed at the end.

The table written to ``--out`` has one row per trial (seed, position, recovery in seconds,
steps lost, committed steps) and the median and maximum per position. Single host: the ranks
talk over loopback and shared memory; for the emulated testbed run it under
``bench/netbed.py`` (not done here).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SECRET = b"chaos-secret"


def _grad(step: int, n: int) -> np.ndarray:
    return np.random.default_rng(step).standard_normal(n).astype(np.float32)


def rank_main(rank: int, size: int, port: int, folder: str, n: int, timeout: float,
              steps: int, dead_after: float = 0.5) -> None:
    """One rank: steps until ``steps`` are committed, stamping every commit."""
    from bitcoll.elastic import ElasticGroup, EvictedError
    from bitcoll.errors import CommError
    from bitcoll.transport.rendezvous.store import StoreClient

    def connect():  # type: ignore[no-untyped-def]
        return StoreClient.connect("127.0.0.1", port, time.monotonic() + timeout,
                                   secret=SECRET)

    group = ElasticGroup.create(connect, SECRET, rank, size, timeout=timeout,
                                dead_after=dead_after)
    log = open(os.path.join(folder, f"rank{rank}.log"), "a", buffering=1)  # noqa: SIM115
    log.write(f"pid {os.getpid()}\n")
    w = np.zeros(n, np.float32)
    committed = -1
    try:
        while committed + 1 < steps:
            k = committed + 1
            log.write(f"pos {group.epoch.rank} {group.epoch.number}\n")
            pending = None
            try:
                pending = group.comm.allreduce(_grad(k, n), op="max")
                group.commit(k)
                w += pending
                committed = k
                log.write(f"commit {k} {time.monotonic():.6f}\n")
            except EvictedError:
                log.write("evicted\n")
                return
            except CommError:
                log.write(f"fail {time.monotonic():.6f}\n")
                epoch = group.recover(committed, pending is not None)
                if epoch.action == "apply" and pending is not None:
                    w += pending
                    committed += 1
                    log.write(f"commit {committed} {time.monotonic():.6f}\n")
                log.write(f"epoch {epoch.number} size {epoch.size} left {list(epoch.left)} "
                          f"{time.monotonic():.6f}\n")
        ref = np.zeros(n, np.float32)
        for k in range(steps):
            ref += _grad(k, n)
        log.write(f"final {committed} {'ok' if ref.tobytes() == w.tobytes() else 'WRONG'}\n")
    finally:
        group.close()


def join_bench(elements: int, steps: int) -> None:
    """A rank of ``python -m launch --max-restarts 1 bench/chaos.py --join-bench``: a
    DistributedLion (lioncub-l1) over ``elements`` float32 parameters in ElasticLion; the
    first incarnation of rank 1 dies at step 2; its replacement times its state transfer
    (parameters spread over the holders, averaged momenta, counters) and prints it."""
    import lioncub.elastic
    from bitcoll.elastic import ElasticGroup, JobFinished
    from lioncub.distributed import DistributedLion
    from lioncub.elastic import ElasticLion

    try:
        group = ElasticGroup.from_env(timeout=60.0, join_check=0.05)
    except JobFinished:
        return
    sizes = [elements // 4] * 3 + [elements - 3 * (elements // 4)]
    params = [np.full(n, 0.01, np.float32) for n in sizes]

    built: list[float] = []
    loaded: list[float] = []
    checked: list[float] = []

    class Timed(DistributedLion):
        def load_state_dict(self, state):  # type: ignore[no-untyped-def]
            t = time.monotonic()
            super().load_state_dict(state)
            loaded.append(time.monotonic() - t)

        def check_replicas(self) -> None:
            t = time.monotonic()
            super().check_replicas()
            checked.append(time.monotonic() - t)

    def make(comm, **kw):  # type: ignore[no-untyped-def]
        t = time.monotonic()
        opt = Timed(params, comm, variant="lioncub-l1", lr=1e-3, **kw)
        built.append(time.monotonic() - t)
        return opt

    joiner = group.epoch.action == "receive"
    before = group.comm.stats.snapshot()
    spans: list[float] = []
    share = lioncub.elastic.share_state  # type: ignore[attr-defined]

    def timed_share(*args, **kw):  # type: ignore[no-untyped-def]
        t = time.monotonic()
        share(*args, **kw)
        spans.append(time.monotonic() - t)

    lioncub.elastic.share_state = timed_share  # type: ignore[attr-defined]
    t0 = time.monotonic()
    opt = ElasticLion(group, params, make)
    if joiner:
        took = time.monotonic() - t0
        got = group.comm.stats.snapshot()["bytes_received"] - before["bytes_received"]
        state = 2 * 4 * elements
        print(f"join: {elements} parameters, state (parameters + momenta) {state / 1e6:.1f} MB,"
              f" received {got / 1e6:.1f} MB in {took:.3f} s ({took * 125e6 / state:.2f}x the "
              f"state over 1 Gbit; share_state {sum(spans):.3f} s, the optimizer's construction "
              f"{built[-1]:.3f} s, the replica check {sum(checked):.3f} s, loading the state "
              f"{sum(loaded):.3f} s), world "
              f"{group.epoch.size}", flush=True)
    full = int(os.environ["WORLD_SIZE"])
    victim = os.environ.get("RANK") == "1" and os.environ.get("BITCOLL_RESTART_COUNT") == "0"
    rng = np.random.default_rng(int(os.environ.get("RANK", "0")))
    grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    while True:
        want = np.array([1 if opt.step_count >= steps and group.epoch.size == full else 0],
                        np.int64)
        try:
            group.comm.allreduce(want, op="min", out=want)
        except Exception:
            opt.recover()
            continue
        if want[0]:
            break
        if victim and opt.step_count == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step(grads)
    opt.opt.check_replicas()
    group.finish()
    if group.epoch.rank == 0:
        print(f"done: {opt.step_count} steps, world {group.epoch.size}, replicas identical",
              flush=True)
    group.close()


def trial(seed: int, size: int, position: int, sig: int, n: int, timeout: float,
          steps: int, dead_after: float = 0.5) -> dict[str, object]:
    from bitcoll.transport.rendezvous.store import StoreServer
    from launch.__main__ import free_ports

    rng = random.Random(seed)
    port = free_ports("127.0.0.1")[0]
    server = StoreServer("127.0.0.1", port, secret=SECRET)
    folder = tempfile.mkdtemp(prefix="chaos-")
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--size", str(size),
                               "--port", str(port), "--folder", folder, "--elements", str(n),
                               "--timeout", str(timeout), "--steps", str(steps),
                               "--dead-after", str(dead_after)], env=env)
             for r in range(size)]
    try:
        # wait until every rank committed a few steps, then a random delay
        def commits(r: int) -> list[tuple[int, float]]:
            try:
                lines = Path(folder, f"rank{r}.log").read_text().splitlines()
            except OSError:
                return []
            return [(int(x.split()[1]), float(x.split()[2])) for x in lines
                    if x.startswith("commit ")]
        start = time.monotonic()
        while min(len(commits(r)) for r in range(size)) < 5:
            if time.monotonic() - start > 120 or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"trial {seed}: the job did not start (logs in {folder})")
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.2))
        # the process at epoch position ``position``
        victim = None
        for r in range(size):
            lines = Path(folder, f"rank{r}.log").read_text().splitlines()
            pos = [x for x in lines if x.startswith("pos ")]
            if pos and int(pos[-1].split()[1]) == position:
                victim = r
        assert victim is not None
        t_sig = time.monotonic()
        os.kill(procs[victim].pid, sig)
        last_before = {r: max((k for k, t in commits(r) if t <= t_sig), default=-1)
                       for r in range(size) if r != victim}
        for r, p in enumerate(procs):
            if r != victim:
                p.wait(timeout=60 + 4 * timeout)
        survivors = [r for r in range(size) if r != victim]
        def failed(r: int) -> float:  # when the survivor's first collective failed
            lines = Path(folder, f"rank{r}.log").read_text().splitlines()
            return min((float(x.split()[1]) for x in lines if x.startswith("fail ")
                        and float(x.split()[1]) > t_sig), default=float("nan"))

        # the first step committed after the failure (a step whose commit the stopped rank
        # joined just before the signal is not a recovery)
        after = [min((t for k, t in commits(r) if t > failed(r)), default=float("nan"))
                 for r in survivors]
        finals = []
        for r in survivors:
            lines = Path(folder, f"rank{r}.log").read_text().splitlines()
            finals += [x for x in lines if x.startswith("final ")]
        ok = len(finals) == len(survivors) and all(x.endswith(" ok") for x in finals)
        first_after = {r: min((k for k, t in commits(r) if t > t_sig), default=-1)
                       for r in survivors}
        lost = max(first_after[r] - last_before[r] - 1 for r in survivors)
        return {"seed": seed, "position": position, "recovery_s": max(after) - t_sig,
                "ok": ok, "lost_steps": max(lost, 0), "victim_pid": procs[victim].pid}
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                except OSError:
                    pass
                p.wait()
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=4)
    ap.add_argument("--trials", type=int, default=20, help="trials per rank position")
    ap.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--elements", type=int, default=1 << 16)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dead-after", type=float, default=0.5,
                    help="seconds of heartbeat silence after which a member is gone")
    ap.add_argument("--out", default=None)
    ap.add_argument("--join-bench", action="store_true",
                    help="run as the ranks' script of a join measurement (see join_bench)")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.join_bench:
        join_bench(a.elements, a.steps)
        return
    if a.rank is not None:
        rank_main(a.rank, a.size, a.port, a.folder, a.elements, a.timeout, a.steps,
                  a.dead_after)
        return
    sig = signal.SIGKILL if a.signal == "KILL" else signal.SIGSTOP
    rows = []
    cmd = " ".join(["python", "bench/chaos.py", *sys.argv[1:]])
    for i in range(a.trials * a.size):
        seed = a.seed + i
        row = trial(seed, a.size, i % a.size, sig, a.elements, a.timeout, a.steps,
                    a.dead_after)
        print(f"seed {seed} position {row['position']} recovery {row['recovery_s']:.3f} s "
              f"lost {row['lost_steps']} {'ok' if row['ok'] else 'WRONG STATE'}", flush=True)
        rows.append(row)
        if a.out:  # after every trial: a cut-short campaign keeps what it measured
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(render(rows, a, cmd))
    print(render(rows, a, cmd))


def render(rows: list[dict[str, object]], a: argparse.Namespace, cmd: str) -> str:
    """The markdown table of the trials so far."""
    lines = [f"# chaos: SIG{a.signal} of one rank of {a.size}, {a.trials} trials per position",
             "", f"Command: `{cmd}`", "",
             f"Elements per step: {a.elements} float32; collective timeout {a.timeout} s; "
             f"dead_after {a.dead_after} s; one host (loopback + shared memory). Trials done: "
             f"{len(rows)}. 'steps lost': committed step numbers skipped (the step in "
             "flight is redone under the same number, so 0 means only it was lost).", "",
             "| seed | position | signal to next committed step (s) | steps lost | state |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['position']} | {r['recovery_s']:.3f} | "
                     f"{r['lost_steps']} | {'ok' if r['ok'] else 'WRONG'} |")
    lines += ["", "| position | trials | median (s) | max (s) | max steps lost | all ok |",
              "|---|---|---|---|---|---|"]
    for p in range(a.size):
        rs = [r for r in rows if r["position"] == p]
        if not rs:
            continue
        ts = [float(str(r["recovery_s"])) for r in rs]
        lines.append(f"| {p} | {len(rs)} | {statistics.median(ts):.3f} | {max(ts):.3f} | "
                     f"{max(int(str(r['lost_steps'])) for r in rs)} | "
                     f"{all(r['ok'] for r in rs)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
