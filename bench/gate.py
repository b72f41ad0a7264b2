"""The performance regression gate: the headline figures, measured now, against the figures
stored in the repository (``bench/gate_figures.json``).

::

    python3 dev.py bench                 # the same as: python bench/gate.py
    python bench/gate.py --only loopback,mpi
    python bench/gate.py --update        # store this run's figures (after a deliberate change)
    python bench/gate.py --against /tmp/base   # also measure another checkout, side by side

Every figure is a ratio, lower is better, measured side by side in one job so that the load of
the machine falls on both sides alike (``bench/gate_worker.py``: best round of 5 interleaved
rounds per side):

* ``allreduce_vs_gloo_{8B,1M,16M}``: bitcoll's float32 all-reduce over 2 local ranks (launcher,
  TCP with shared memory) against torch gloo's, in place;
* ``majority_vs_float32_{16K,1M}``: bitcoll's majority sign all-reduce of n float32 elements
  against its own float32 all-reduce of the same elements (the packed collective moves 32x
  fewer bytes, so it should never be slower);
* ``mpi_allreduce_vs_mpi4py_{8B,64K}``: bitcoll over MPI against mpi4py's ``Allreduce``;
* ``majority_64M_p2_vs_wire``: the default majority all-reduce of 64M elements on the emulated
  testbed (2 hosts, 1 Gbit links, one core each) against the wire bound, the bytes each rank
  sends over the probed link rate (needs root and network namespaces; skipped otherwise).

A figure fails when it is worse than the stored one by more than its tolerance (the noise seen
between runs on the reference machine); a failed suite is measured once more and the better
of the two runs counts, so one disturbed run does not fail the gate. Exit status: 0 when no
figure got worse, 1 naming every figure that did, 2 for bad options.
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
            "--probe", worker, "wire"]


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
    args = parser.parse_args(argv)
    suites = [s for s in args.only.split(",") if s]
    if any(s not in SUITES for s in suites):
        parser.error(f"--only takes {', '.join(SUITES)}")
    stored: dict[str, Any] = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    known: dict[str, dict[str, float]] = stored.get("figures", {})
    now: dict[str, float] = {}
    base: dict[str, float] = {}
    worse: list[str] = []
    for suite in suites:
        if suite == "wire" and not _netns_allowed():
            print("# wire: skipped (needs root and network namespaces)", flush=True)
            continue
        if args.against is not None:
            base.update(run_suite(suite, args.against.resolve()))
        got = run_suite(suite)
        bad = [k for k, v in got.items()
               if k in known and v > known[k]["ratio"] * (1 + known[k]["tolerance"])]
        if bad and not args.update:
            print(f"# {suite}: {', '.join(bad)} worse than stored; measuring again", flush=True)
            again = run_suite(suite)
            got = {k: min(v, again.get(k, v)) for k, v in got.items()}
        now.update(got)
    against = f"{'against':>10}" if args.against is not None else ""
    print(f"# {'figure':<32}{'stored':>10}{against}{'now':>10}{'limit':>10}  verdict")
    for name, value in now.items():
        ref = known.get(name)
        other = "" if args.against is None else \
            f"{base[name]:>10.3f}" if name in base else f"{'-':>10}"
        if ref is None:
            print(f"{name:<34}{'-':>10}{other}{value:>10.3f}{'-':>10}  new")
            continue
        limit = ref["ratio"] * (1 + ref["tolerance"])
        verdict = "WORSE" if value > limit else "ok"
        if verdict == "WORSE":
            worse.append(name)
        print(f"{name:<34}{ref['ratio']:>10.3f}{other}{value:>10.3f}{limit:>10.3f}  {verdict}")
    if args.update:
        for name, value in now.items():
            tol = known.get(name, {}).get("tolerance", 0.25)
            known[name] = {"ratio": round(value, 4), "tolerance": tol}
        stored["figures"] = dict(sorted(known.items()))
        FIGURES.write_text(json.dumps(stored, indent=1) + "\n")
        print(f"# stored {len(now)} figures in {FIGURES.relative_to(ROOT)}")
        return 0
    if worse:
        print("FAILED: worse than stored beyond noise: " + ", ".join(worse))
        return 1
    print("gate passed: no figure worse than stored")
    return 0


if __name__ == "__main__":
    sys.exit(main())
