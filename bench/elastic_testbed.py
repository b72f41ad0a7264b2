"""A lost host on the emulated testbed: kill, stop and cut off one host of four (1 Gbit links)
in the middle of a fault-tolerant training run, and compare with an undisturbed run.

Usage (as root, like ``bench/netbed.py``)::

    python bench/elastic_testbed.py --faults none,kill,stop,partition --seed 1 \\
        --out results/elastic/testbed.md

For every fault the driver runs ``BITCOLL_MAX_RESTARTS=1 python bench/netbed.py --hosts 4
--rate 1gbit bench/elastic_testbed.py --rank ...``: each host's launcher serves/uses the
elastic store (host 0's) and restarts a rank that dies. The ranks train a linear least-squares
model (``--weights`` float32 weights, 32 rows per rank and step) with lioncub-l1 through
:class:`lioncub.elastic.ElasticLion`; the data of a step depends only on the seeds, the step
and the epoch's rank and size. At step ``--fault-at`` the rank of host 2 (its first
incarnation) injects the fault on itself:

* ``kill``: SIGKILL. Its launcher starts it again; the replacement joins.
* ``stop``: SIGSTOP, with a helper process that sends SIGCONT ``--pause`` seconds later. The
  survivors find its heartbeat silent, go on without it; resumed, it is refused as a stale
  member (``EvictedError``) and joins again (``rejoin``).
* ``partition``: its host's link goes down (``ip link set eth0 down`` in its namespace) and
  comes back ``--pause`` seconds later; the same path as a stop follows, and the cut-off rank
  rejoins once its link is back (or, when its store connection broke, its launcher restarts
  it).
* ``none``: no fault (the reference curve).

Every rank logs its commits (``time.monotonic()``, one clock for the whole machine) and the
victim the moment of its fault; rank 0 of each epoch logs the validation loss after every
committed step. The driver reports per fault: the time from the fault to the survivors' next
committed step, the steps each survivor lost (``ElasticLion.lost_steps``: only the step in
flight is lost when this is 1), the world size at the end, and the final validation loss
at the last step of ``--steps`` beside the undisturbed run's with the same data order and
with another data order (the noise; the problem is the same).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROWS = 32  # rows per rank and step
VICTIM = 2  # the global rank (host) that is hit


def truth(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, 0]).standard_normal(n).astype(np.float32)


def rows(seed: int, data: int, n: int, step: int, rank: int, size: int
         ) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s rows at ``step`` in a world of ``size``; ``data`` picks the data
    order (the problem, ``truth(seed)``, stays)."""
    rng = np.random.default_rng([seed, 1, data, step, size, rank])
    x = rng.standard_normal((ROWS, n)).astype(np.float32)
    y = x @ truth(seed, n) + np.float32(0.1) * rng.standard_normal(ROWS).astype(np.float32)
    return x, y


def rank_main(a: argparse.Namespace) -> None:
    from bitcoll.elastic import ElasticGroup, EvictedError, JobFinished
    from bitcoll.errors import CommError
    from lioncub.distributed import DistributedLion
    from lioncub.elastic import ElasticLion

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    first = os.environ.get("BITCOLL_RESTART_COUNT", "0") == "0"
    log = open(Path(a.folder, f"rank{rank}-{os.getpid()}.log"), "a", buffering=1)  # noqa: SIM115
    n = a.weights
    vx = np.concatenate([rows(a.seed, 0, n, 1 << 30, r, 8)[0] for r in range(8)])
    vy = np.concatenate([rows(a.seed, 0, n, 1 << 30, r, 8)[1] for r in range(8)])
    try:
        group = ElasticGroup.from_env(timeout=a.timeout, dead_after=a.dead_after,
                                      join_check=0.05)
    except JobFinished:
        return
    w = np.zeros(n, np.float32)

    def make(comm, **kw):  # type: ignore[no-untyped-def]
        return DistributedLion([w], comm, variant="lioncub-l1", lr=a.lr, **kw)

    opt = ElasticLion(group, [w], make)
    victim = rank == VICTIM and first and a.fault != "none"
    start = time.monotonic()

    def agree(done: bool) -> bool:
        nonlocal opt
        while True:
            flag = np.array([int(done)], np.int64)
            try:
                opt.group.comm.allreduce(flag, op="min", out=flag)
                return bool(flag[0])
            except EvictedError:
                group.rejoin()
                opt = ElasticLion(group, [w], make)
            except CommError:
                opt.recover()

    def inject() -> None:
        log.write(f"fault {a.fault} {time.monotonic():.6f}\n")
        if a.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif a.fault == "stop":
            subprocess.Popen(["sh", "-c", f"sleep {a.pause}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        elif a.fault == "partition":
            subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
            log.write(f"cut {time.monotonic():.6f}\n")
            subprocess.Popen(["sh", "-c", f"sleep {a.pause}; ip link set eth0 up"])

    while not agree(opt.step_count >= a.steps and (
            a.fault == "none" or opt.epoch.size == world or time.monotonic() - start > 120)):
        e = opt.epoch
        x, y = rows(a.seed, a.data_seed, n, opt.step_count, e.rank, e.size)
        grad = ((2.0 / ROWS) * (x.T @ (x @ w - y))).astype(np.float32)
        if victim and opt.step_count == a.fault_at:
            victim = False
            inject()
        try:
            done = opt.step([grad])
        except EvictedError:
            log.write(f"evicted {time.monotonic():.6f}\n")
            group.rejoin()
            opt = ElasticLion(group, [w], make)
            log.write(f"rejoined {time.monotonic():.6f} step {opt.step_count}\n")
            continue
        if done:
            line = f"commit {opt.step_count - 1} {time.monotonic():.6f} size {opt.epoch.size}"
            if opt.epoch.rank == 0:
                line += f" loss {float(np.mean((vx @ w - vy) ** 2)):.6f}"
            log.write(line + "\n")
    opt.finish()
    log.write(f"end steps {opt.step_count} lost {opt.lost_steps} size {opt.epoch.size} "
              f"epoch {opt.epoch.number} loss {float(np.mean((vx @ w - vy) ** 2)):.6f}\n")
    group.close()


def run_one(a: argparse.Namespace, fault: str, data: int) -> dict[str, object]:
    """One testbed run; returns its figures."""
    folder = tempfile.mkdtemp(prefix=f"elastic-testbed-{fault}-")
    cmd = [sys.executable, str(ROOT / "bench" / "netbed.py"), "--hosts", "4", "--rate", a.rate,
           str(Path(__file__).resolve()), "--rank", "--fault", fault, "--seed", str(a.seed),
           "--data-seed", str(data),
           "--folder", folder, "--steps", str(a.steps), "--fault-at", str(a.fault_at),
           "--weights", str(a.weights), "--timeout", str(a.timeout),
           "--dead-after", str(a.dead_after), "--pause", str(a.pause), "--lr", str(a.lr)]
    env = dict(os.environ, BITCOLL_MAX_RESTARTS="1", NUMBA_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    logs = {p.name: p.read_text().splitlines() for p in Path(folder).glob("*.log")}
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    fault_t = [float(x.split()[2]) for lines in logs.values() for x in lines
               if x.startswith("fault ")]
    t_fault = fault_t[0] if fault_t else None
    survivors = [name for name, lines in logs.items()
                 if not name.startswith(f"rank{VICTIM}-")]
    recovery = None
    if t_fault is not None:
        after = []
        for name in survivors:
            ts = [float(x.split()[2]) for x in logs[name] if x.startswith("commit ")
                  and float(x.split()[2]) > t_fault]
            if ts:
                after.append(min(ts))
        recovery = max(after) - t_fault if after else None
    ends = {name: x.split() for name, lines in logs.items() for x in lines
            if x.startswith("end ")}
    curve: dict[int, float] = {}
    for lines in logs.values():
        for x in lines:
            f = x.split()
            if f[0] == "commit" and "loss" in f:
                curve[int(f[1])] = float(f[f.index("loss") + 1])
    return {"fault": fault, "seed": data, "status": proc.returncode, "seconds": took,
            "recovery_s": recovery,
            "lost": {k: int(v[4]) for k, v in ends.items()},
            "size_at_end": sorted({int(v[6]) for v in ends.values()}),
            "steps": sorted({int(v[2]) for v in ends.values()}),
            "final_loss": sorted({float(v[10]) for v in ends.values()}),
            "curve": [curve[k] for k in sorted(curve)],
            "stdout_tail": proc.stdout[-600:]}


def render(a: argparse.Namespace, runs: list[dict[str, object]], cmd: str) -> str:
    ref = {r["seed"]: r for r in runs if r["fault"] == "none"}
    lines = [f"# A lost host on the testbed: 4 hosts, {a.rate} links", "",
             f"Command: `{cmd}`", "",
             f"lioncub-l1 through `lioncub.elastic.ElasticLion` on a linear least-squares model "
             f"(problem seed {a.seed}, {a.weights} float32 weights, {ROWS} rows per rank and "
             f"step, lr {a.lr}), "
             f"{a.steps} steps (more while a replacement is on its way); the fault hits "
             f"host {VICTIM}'s rank at step {a.fault_at}. Collective deadline {a.timeout} s, "
             f"dead_after {a.dead_after} s, heartbeat 0.1 s; stop and partition last "
             f"{a.pause} s. 'fault to next commit': from the fault to the last survivor's "
             "first committed step after it. 'lost': `ElasticLion.lost_steps` per process "
             "that finished (the survivors lose the step in flight: 1 each).", "",
             f"| fault | data order | fault to next commit (s) | lost (per finisher) | "
             f"world at end | steps done | loss at step {a.steps - 1} | undisturbed, same "
             "data order | undisturbed, other data order (noise) |",
             "|---|---|---|---|---|---|---|---|---|"]
    last = a.steps - 1

    def at(r: dict[str, object] | None) -> str:
        if r is None:
            return "-"
        c = r["curve"]
        assert isinstance(c, list)
        return f"{c[last]:.2f}" if last < len(c) else "-"

    for r in runs:
        same = ref.get(r["seed"])
        other = next((x for k, x in ref.items() if k != r["seed"]), None)
        rec = "-" if r["recovery_s"] is None else f"{float(str(r['recovery_s'])):.3f}"
        lost = r["lost"]
        assert isinstance(lost, dict)
        lines.append(
            f"| {r['fault']} | {r['seed']} | {rec} | {sorted(lost.values())} | "
            f"{r['size_at_end']} | {r['steps']} | {at(r)} | {at(same)} | {at(other)} |")
    lines += ["", "Validation loss every 10 committed steps (rank 0 of each epoch):", "",
              "| run | " + " | ".join(str(k) for k in range(0, a.steps, 10)) + " |",
              "|---|" + "---|" * len(range(0, a.steps, 10))]
    for r in runs:
        c = r["curve"]
        assert isinstance(c, list)
        lines.append(f"| {r['fault']}, data order {r['seed']} | " +
                     " | ".join(f"{c[k]:.2f}" if k < len(c) else "-"
                                for k in range(0, a.steps, 10)) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", default="none,kill,stop,partition")
    ap.add_argument("--fault", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--data-seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--noise-seed", action="store_true",
                    help="also run the undisturbed job with another data order (the noise)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--fault-at", type=int, default=50)
    ap.add_argument("--weights", type=int, default=16385)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--dead-after", type=float, default=0.5)
    ap.add_argument("--pause", type=float, default=5.0)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        rank_main(a)
        return
    cmd = " ".join(["python", "bench/elastic_testbed.py", *sys.argv[1:]])
    runs = []
    plan = [(f, 0) for f in a.faults.split(",")]
    if a.noise_seed:
        plan.append(("none", 1))
    for fault, seed in plan:
        r = run_one(a, fault, seed)
        print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
        runs.append(r)
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(render(a, runs, cmd))
            Path(a.out).with_suffix(".json").write_text(json.dumps(runs, indent=1))
    print(render(a, runs, cmd))


if __name__ == "__main__":
    main()
