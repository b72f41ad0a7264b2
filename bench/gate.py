"""The performance regression gate: the headline figures, measured now, against the figures
stored in the repository (``bench/gate_figures.json``).

::

    python3 dev.py bench                 # the same as: python bench/gate.py
    python bench/gate.py --only loopback,mpi
    python bench/gate.py --update        # store this run's figures (after a deliberate change)
    python bench/gate.py --against /tmp/base   # also measure another checkout, side by side
    python bench/gate.py --calibrate 5   # 5 runs: store each figure's median and its noise

Every figure is a ratio, lower is better, measured side by side in one job so that the load of
the machine falls on both sides alike (``bench/gate_worker.py``: best round of 5 interleaved
rounds per side):

* ``allreduce_vs_gloo_{8B,1M,16M}``: bitcoll's float32 all-reduce over 2 local ranks (launcher,
  TCP with shared memory) against torch gloo's, in place;
* ``allgather_vs_allreduce_8B``: bitcoll's all-gather of 8 bytes a rank against its
  all-reduce of the same 8 bytes (2 local ranks: one exchange each way in both);
* ``majority_vs_float32_{16K,1M}``: bitcoll's majority sign all-reduce of n float32 elements
  against its own float32 all-reduce of the same elements (the packed collective moves 32x
  fewer bytes, so it should never be slower);
* ``mpi_allreduce_vs_mpi4py_{8B,64K}``: bitcoll over MPI against mpi4py's ``Allreduce``;
* ``torch_allreduce_vs_direct_8B``: ``dist.all_reduce`` on a group of the "bitcoll" torch
  backend against the Communicator behind it on the same memory (what the torch layer adds);
* ``majority_64M_p2_vs_wire``: the default majority all-reduce of 64M elements on the emulated
  testbed (2 hosts, 1 Gbit links, one core each) against the wire bound, the bytes each rank
  sends over the probed link rate (needs root and network namespaces; skipped otherwise). The
  ranks' cost model is told the probed rate (``netbed.py --model-link``), as a user of a 1 Gbit
  cluster configures it or ``python -m bitcoll.probe`` measures it: the planner chooses the
  pipeline's segment by the link.

A figure fails when it is worse than the stored one by more than its tolerance (the noise seen
between runs on the reference machine); a failed suite is measured once more and the better
of the two runs counts, so one disturbed run does not fail the gate. With ``--against TREE``
the verdict that decides is the paired one: a figure fails when it is worse than TREE's, measured
in the same run, by more than its tolerance (both sides measured once more first, the better
run of each counting). A machine slower than the one the stored figures came from makes
both trees worse than stored alike: figures worse than stored but not than TREE's are named,
and do not fail the gate.
``--calibrate N`` runs every suite N times and stores, per figure, the median of the runs as
the reference and ``max(MIN_TOLERANCE, NOISE_FACTOR * (worst - median) / median)`` as its
tolerance, with the runs themselves (``"runs"``), so the tolerance is the noise measured, not
a guess.

Exit status: 0 when no figure got worse, 1 naming every figure that did, 2 for bad options.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIGURES = Path(__file__).resolve().parent / "gate_figures.json"
SUITES = ("loopback", "mpi", "wire")
#: The smallest tolerance a calibration stores (5%: below it, a machine's drift fails the gate).
MIN_TOLERANCE = 0.05
#: A calibrated tolerance is this many times the worst run's distance above the median.
NOISE_FACTOR = 2.0
PROBE = re.compile(r"probe host 1 -> host 0: ([0-9.]+) Gbit/s")


def _command(suite: str) -> list[str]:
    py = sys.executable
    worker = str(Path(__file__).resolve().parent / "gate_worker.py")
    if suite == "loopback":
        return [py, "-m", "launch", "-n", "2", worker, "loopback"]
    if suite == "mpi":
        mpiexec = Path(py).parent / "mpiexec"
        return [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", "2", py, worker, "mpi"]
    return [py, str(ROOT / "bench" / "netbed.py"), "--hosts", "2", "--rate", "1gbit",
            "--probe", "--model-link", worker, "wire"]


def run_suite(suite: str, tree: Path = ROOT, timeout: float = 600.0) -> dict[str, float]:
    """Run one suite on the code of the checkout ``tree`` (default: this one; the worker and
    the testbed are this checkout's); return its figures (name -> ratio). RuntimeError when
    it fails."""
    env = dict(os.environ)
    env.setdefault("NUMBA_NUM_THREADS", "1")
    if tree != ROOT:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
    cmd = _command(suite)
    print(f"+ {' '.join(cmd)}" + (f"  (code of {tree})" if tree != ROOT else ""), flush=True)
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{suite} exited with {proc.returncode}:\n{proc.stdout[-3000:]}"
                           f"{proc.stderr[-3000:]}")
    figures: dict[str, float] = {}
    rate = None
    for line in proc.stdout.splitlines():
        if (m := PROBE.search(line)) is not None:
            rate = float(m.group(1)) * 1e9 / 8  # bytes per second
        if "{" not in line:
            continue
        rec: dict[str, Any] = json.loads(line[line.index("{"):])
        if "ratio" in rec:
            figures[rec["figure"]] = float(rec["ratio"])
        elif "bytes" in rec:
            if rate is None:
                raise RuntimeError(f"{suite}: no probed link rate in the testbed's output")
            figures[rec["figure"]] = float(rec["ours"]) * 1e-6 / (float(rec["bytes"]) / rate)
    if not figures:
        raise RuntimeError(f"{suite} printed no figure:\n{proc.stdout[-3000:]}")
    return figures


def _netns_allowed() -> bool:
    if os.geteuid() != 0:
        return False
    name = f"bitcollgate{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


def calibrated(runs: list[float]) -> dict[str, Any]:
    """A figure's stored entry from its ``runs`` (ratios of repeated gate runs): the median as
    the reference, the tolerance from the worst run's distance above it (see the module's
    docstring), and the runs."""
    ordered = sorted(runs)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    tol = max(MIN_TOLERANCE, NOISE_FACTOR * (ordered[-1] - median) / median)
    return {"ratio": round(median, 4), "tolerance": round(tol, 3),
            "runs": [round(r, 4) for r in runs]}


def _calibrate(suites: list[str], n: int, stored: dict[str, Any],
               known: dict[str, dict[str, Any]]) -> int:
    runs: dict[str, list[float]] = {}
    for i in range(n):
        for suite in suites:
            if suite == "wire" and not _netns_allowed():
                print("# wire: skipped (needs root and network namespaces)", flush=True)
                continue
            for name, value in run_suite(suite).items():
                runs.setdefault(name, []).append(value)
        print(f"# calibration run {i + 1} of {n} done", flush=True)
    print(f"# {'figure':<32}{'min':>10}{'median':>10}{'max':>10}{'tolerance':>10}")
    for name, values in runs.items():
        entry = calibrated(values)
        known[name] = entry
        print(f"{name:<34}{min(values):>10.3f}{entry['ratio']:>10.3f}{max(values):>10.3f}"
              f"{entry['tolerance']:>10.3f}")
    stored["figures"] = dict(sorted(known.items()))
    FIGURES.write_text(json.dumps(stored, indent=1) + "\n")
    print(f"# stored {len(runs)} calibrated figures in {FIGURES.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SUITES),
                        help=f"comma-separated suites (default: {','.join(SUITES)})")
    parser.add_argument("--update", action="store_true",
                        help="store this run's figures as the new reference")
    parser.add_argument("--against", type=Path, default=None, metavar="TREE",
                        help="also measure the checkout TREE (e.g. a git worktree of the "
                             "commit before a change), each suite alternating between the "
                             "two, and show both")
    parser.add_argument("--calibrate", type=int, default=0, metavar="N",
                        help="run every suite N times (N >= 3) and store each figure's "
                             "median as the reference and its noise as the tolerance")
    args = parser.parse_args(argv)
    suites = [s for s in args.only.split(",") if s]
    if any(s not in SUITES for s in suites):
        parser.error(f"--only takes {', '.join(SUITES)}")
    if args.calibrate and args.calibrate < 3:
        parser.error("--calibrate needs at least 3 runs (a median and a spread)")
    if args.calibrate and (args.update or args.against is not None):
        parser.error("--calibrate stores figures itself: not with --update or --against")
    stored: dict[str, Any] = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    known: dict[str, dict[str, Any]] = stored.get("figures", {})
    if args.calibrate:
        return _calibrate(suites, args.calibrate, stored, known)
    reference = "the other tree's" if args.against is not None else "stored"  # what decides
    now: dict[str, float] = {}
    base: dict[str, float] = {}
    worse: list[str] = []
    for suite in suites:
        if suite == "wire" and not _netns_allowed():
            print("# wire: skipped (needs root and network namespaces)", flush=True)
            continue
        other: dict[str, float] = {}
        if args.against is not None:
            other = run_suite(suite, args.against.resolve())
        got = run_suite(suite)
        if args.against is None:
            bad = [k for k, v in got.items() if k in known and v > _stored_limit(known[k])]
        else:
            bad = [k for k, v in got.items() if k in other and v > other[k] * (1 + _tol(known, k))]
        if bad and not args.update:
            print(f"# {suite}: {', '.join(bad)} worse than {reference}; measuring again",
                  flush=True)
            if args.against is not None:
                again_other = run_suite(suite, args.against.resolve())
                other = {k: min(v, again_other.get(k, v)) for k, v in other.items()}
            again = run_suite(suite)
            got = {k: min(v, again.get(k, v)) for k, v in got.items()}
        base.update(other)
        now.update(got)
    slow: list[str] = []  # worse than stored, not than the other tree
    if args.against is None:
        print(f"# {'figure':<32}{'stored':>10}{'now':>10}{'limit':>10}  verdict")
    else:
        print(f"# {'figure':<32}{'stored':>10}{'against':>10}{'now':>10}{'limit':>10}  "
              "verdict (limit: against + tolerance)")
    for name, value in now.items():
        ref = known.get(name)
        if args.against is None:
            if ref is None:
                print(f"{name:<34}{'-':>10}{value:>10.3f}{'-':>10}  new")
                continue
            limit = _stored_limit(ref)
            verdict = "WORSE" if value > limit else "ok"
            print(f"{name:<34}{ref['ratio']:>10.3f}{value:>10.3f}{limit:>10.3f}  {verdict}")
        else:
            stored_txt = f"{ref['ratio']:>10.3f}" if ref is not None else f"{'-':>10}"
            if name not in base:
                print(f"{name:<34}{stored_txt}{'-':>10}{value:>10.3f}{'-':>10}  new")
                continue
            limit = base[name] * (1 + _tol(known, name))
            verdict = "WORSE" if value > limit else "ok"
            if ref is not None and verdict == "ok" and value > _stored_limit(ref):
                slow.append(name)
                verdict = "ok (both trees worse than stored)" \
                    if base[name] > _stored_limit(ref) else \
                    "ok (worse than stored, within the noise of against)"
            print(f"{name:<34}{stored_txt}{base[name]:>10.3f}{value:>10.3f}{limit:>10.3f}  "
                  f"{verdict}")
        if verdict == "WORSE":
            worse.append(name)
    if args.update:
        for name, value in now.items():
            tol = known.get(name, {}).get("tolerance", 0.25)  # the calibrated noise stays
            known[name] = {"ratio": round(value, 4), "tolerance": tol}
        stored["figures"] = dict(sorted(known.items()))
        FIGURES.write_text(json.dumps(stored, indent=1) + "\n")
        print(f"# stored {len(now)} figures in {FIGURES.relative_to(ROOT)}")
        return 0
    if slow:
        print("# worse than stored but not than the other tree (a slower machine than the "
              "stored figures', or a regression older than the other tree): " + ", ".join(slow))
    if worse:
        print(f"FAILED: worse than {reference} beyond noise: " + ", ".join(worse))
        return 1
    print(f"gate passed: no figure worse than {reference}")
    return 0


def _stored_limit(ref: dict[str, Any]) -> float:
    """The worst ratio a stored figure ``ref`` allows: its ratio plus its tolerance."""
    return float(ref["ratio"]) * (1 + float(ref["tolerance"]))


def _tol(known: dict[str, dict[str, Any]], name: str) -> float:
    """The tolerance of figure ``name`` (its calibrated noise; 25% for a figure not stored)."""
    return float(known.get(name, {}).get("tolerance", 0.25))


if __name__ == "__main__":
    sys.exit(main())
