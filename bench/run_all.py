"""Run the comparison matrix of the OSU-style tools (on loopback, or on the emulated Ethernet
testbed) and write ``results/*.txt``.

Usage::

    python bench/run_all.py                     # 2 and 4 ranks, 1K:256M, every impl, sign run
    python bench/run_all.py --quick             # every 4th size, sign run at 64M only
    python bench/run_all.py --ranks 4 --impls bitcoll-tcp,gloo --sizes 64M:256M --repeat 3
    python bench/run_all.py --dry-run           # print the commands only
    python bench/run_all.py --netbed 1gbit --ranks 4 --out results/netbed_1gbit

The matrix (run with the interpreter running this script and the ``mpiexec`` next to it; every
rank gets ``NUMBA_NUM_THREADS=1``, ``OMP_NUM_THREADS=1``, ``MKL_NUM_THREADS=1``; with
``--netbed RATE`` every ``python -m launch -n P`` below becomes ``python bench/netbed.py
--hosts P --rate RATE`` and every ``mpiexec -n P python`` becomes ``python bench/netbed.py
--mpi --hosts P --rate RATE``, one emulated host per rank):

======================= ======================================================================
``bitcoll-tcp``         ``python -m launch -n P bench/osu_allreduce.py --impl bitcoll``
``bitcoll-tcp-inplace`` the same with ``--inplace`` (``out=x``, as gloo always reduces)
``bitcoll-mpi``         ``mpiexec -n P python bench/osu_allreduce.py --impl bitcoll``
``mpi4py``              ``mpiexec -n P python bench/osu_allreduce.py --impl mpi4py``
                        (MPI's own out-of-place Allreduce)
``gloo``                ``python -m launch -n P bench/osu_allreduce.py --impl gloo``
                        (torch.distributed all_reduce, in place)
``sign``                ``python -m launch -n P bench/osu_sign_allreduce.py --compare-float32
                        --floor --algorithm default,allgather`` (for each P of
                        ``--sign-ranks``)
======================= ======================================================================

With ``--repeat R`` the whole matrix runs R times (rounds alternate the implementations so
that background load spreads over all of them). Files written to ``--out`` (default
``results``): ``allreduce_<impl>_np<P>.txt`` (one table per round, each preceded by its
command line), ``sign_np<P>.txt`` and ``summary.txt``: per rank count the best (lowest over
rounds) average latency of each implementation at each size, the CPU time per call and the
BusBW of those rounds
with the speed ratios bitcoll-tcp / mpi4py, bitcoll-tcp-inplace / gloo and bitcoll-tcp / gloo,
then the sign run's speedups (majority with the default algorithm vs the float32 all-reduce and
vs the all-gather algorithm). The summary reads each run's tables from the ``--json`` file the
tool writes (into a temporary directory; the text tables go to the files above). ``--nice N``
runs every job under ``nice -n N``. Exit status 0, or 1 if any run failed (its output is still
written; the summary skips it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import netbed as netbed_tool
import osu

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
IMPLS = ("bitcoll-tcp", "bitcoll-tcp-inplace", "bitcoll-mpi", "mpi4py", "gloo")
#: Speed ratios shown in the summary: out of place vs MPI's out-of-place Allreduce, in place
#: vs gloo's (always in-place) all_reduce, and the default (out of place) vs gloo.
RATIOS = (("bitcoll-tcp", "mpi4py"), ("bitcoll-tcp-inplace", "gloo"), ("bitcoll-tcp", "gloo"))


def rank_env() -> dict[str, str]:
    """The environment of every rank: one thread per process for numba, OpenMP and MKL."""
    env = dict(os.environ)
    env.update({"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1"})
    return env


def mpiexec() -> str:
    """The ``mpiexec`` installed next to this interpreter (else the one on PATH)."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def _tcp(p: int, netbed: str | None) -> list[str]:
    """How ``p`` TCP ranks are started: the launcher, or one testbed host each."""
    if netbed is None:
        return [sys.executable, "-m", "launch", "-n", str(p)]
    return netbed_tool.invocation(p, netbed)


def _mpi(p: int, netbed: str | None) -> list[str]:
    """How ``p`` MPI ranks are started: mpiexec, or mpiexec across testbed hosts."""
    if netbed is None:
        return [mpiexec(), "-n", str(p), sys.executable]
    return netbed_tool.invocation(p, netbed, mpi=True)


def allreduce_command(impl: str, p: int, tool_args: Sequence[str],
                      netbed: str | None = None) -> list[str]:
    """The command line of one all-reduce run of ``impl`` (see the module docstring), on the
    emulated Ethernet testbed with links of rate ``netbed`` when given."""
    tool = "bench/osu_allreduce.py"
    if impl == "bitcoll-tcp":
        return [*_tcp(p, netbed), tool, "--impl", "bitcoll", *tool_args]
    if impl == "bitcoll-tcp-inplace":
        return [*_tcp(p, netbed), tool, "--impl", "bitcoll", "--inplace", *tool_args]
    if impl == "bitcoll-mpi":
        return [*_mpi(p, netbed), tool, "--impl", "bitcoll", *tool_args]
    if impl == "mpi4py":
        return [*_mpi(p, netbed), tool, "--impl", "mpi4py", *tool_args]
    if impl == "gloo":
        return [*_tcp(p, netbed), tool, "--impl", "gloo", *tool_args]
    raise ValueError(f"unknown impl {impl!r}")


def sign_command(p: int, tool_args: Sequence[str], netbed: str | None = None) -> list[str]:
    """The command line of the sign_allreduce run on ``p`` TCP ranks."""
    return [*_tcp(p, netbed), "bench/osu_sign_allreduce.py", "--compare-float32", "--floor",
            "--algorithm", "default,allgather", *tool_args]


def run(cmd: list[str], timeout: float, dry_run: bool,
        json_path: Path | None = None) -> tuple[bool, str, float]:
    """Run ``cmd`` (plus ``--json json_path`` when given, which the tool's arguments end with)
    in the project root (tool paths are relative to it); return (ok, stdout without rank
    prefixes, seconds). Its stderr goes to ours."""
    print("+ " + shlex.join(cmd), flush=True)
    if dry_run:
        return True, "", 0.0
    if json_path is not None:
        cmd = [*cmd, "--json", str(json_path)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=rank_env(), stdout=subprocess.PIPE,
                              text=True, timeout=timeout, check=False)
        ok, out = proc.returncode == 0, proc.stdout
        if not ok:
            print(f"  failed with exit status {proc.returncode}", flush=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        ok = False
        print(f"  timed out after {timeout} s", flush=True)
    took = time.monotonic() - t0
    print(f"  {took:.1f} s", flush=True)
    return ok, osu.strip_rank_prefix(out), took


def best_rows(tables: list[osu.Table]) -> dict[int, dict[str, object]]:
    """Per size, the row with the lowest average latency over the rounds' tables."""
    best: dict[int, dict[str, object]] = {}
    for t in tables:
        for row in t.rows:
            size, lat = row.get("Size"), row.get("Avg Latency(us)")
            if not isinstance(size, int) or not isinstance(lat, (int, float)):
                continue
            old = best.get(size)
            if old is None or float(lat) < float(old["Avg Latency(us)"]):  # type: ignore[arg-type]
                best[size] = row
    return best


def _value(row: dict[str, object] | None, column: str) -> float | None:
    value = None if row is None else row.get(column)
    return float(value) if isinstance(value, (int, float)) else None


def _min_latency(rows: list[dict[str, object]], n: int, variant: str) -> float | None:
    got = [v for r in rows if r.get("Elements") == n and r.get("Variant") == variant
           and (v := _value(r, "Avg Latency(us)")) is not None]
    return min(got) if got else None


def summarize(by_p: dict[int, dict[str, list[osu.Table]]], sign: dict[int, list[osu.Table]],
              rounds: int, where: str = "loopback") -> str:
    """The text of ``summary.txt`` (OSU-style tables readable by :func:`osu.parse_tables`)."""
    lines: list[str] = []
    rep = osu.Report(0, print_fn=lines.append)
    for p, per_impl in sorted(by_p.items()):
        impls = [i for i in IMPLS if i in per_impl]
        best = {i: best_rows(per_impl[i]) for i in impls}
        sizes = sorted({s for b in best.values() for s in b})
        ratios = [(a, b) for a, b in RATIOS if a in impls and b in impls]
        lat_cols = [osu.Column("Size", 10, "d")]
        lat_cols += [osu.Column(f"{i}(us)", 18, ".2f") for i in impls]
        rep.start(f"bitcoll {where} all-reduce latency, {osu.ranks(p)}",
                  ["float32 sum; lowest average latency (us) of each implementation and size "
                   f"over {rounds} round(s)"], lat_cols, ranks=p)
        for s in sizes:
            rep.row(s, *[_value(best[i].get(s), "Avg Latency(us)") for i in impls])
        cpu_cols = [osu.Column("Size", 10, "d")]
        cpu_cols += [osu.Column(f"{i}(us)", 18, ".0f") for i in impls]
        rep.start(f"bitcoll {where} all-reduce CPU time per call, {osu.ranks(p)}",
                  ["process CPU time (all threads, user + system) per call and rank, of the "
                   "rounds above; it includes busy-polling (MPICH spins while it waits) and "
                   "hardly depends on other load"], cpu_cols, ranks=p)
        for s in sizes:
            rep.row(s, *[_value(best[i].get(s), "CPU(us)") for i in impls])
        cols = [osu.Column("Size", 10, "d")]
        cols += [osu.Column(f"{i}(GB/s)", 18, ".3f") for i in impls]
        cols += [osu.Column(f"{a}/{b}", 20, ".2f") for a, b in ratios]
        rep.start(f"bitcoll {where} all-reduce bus bandwidth, {osu.ranks(p)}",
                  ["float32 sum; BusBW = Size / Avg * 2(p-1)/p (GB/s) of the round with the "
                   f"lowest average latency of each implementation and size, out of {rounds} "
                   "round(s); a/b = speed of a / speed of b (latency ratio)"], cols, ranks=p)
        for s in sizes:
            vals: list[object] = [s]
            vals += [_value(best[i].get(s), "BusBW(GB/s)") for i in impls]
            for a, b in ratios:
                la = _value(best[a].get(s), "Avg Latency(us)")
                lb = _value(best[b].get(s), "Avg Latency(us)")
                vals.append(lb / la if la and lb else None)
            rep.row(*vals)
    for p, tables in sorted(sign.items()):
        rows = [r for t in tables for r in t.rows]
        counts = sorted({r["Elements"] for r in rows if isinstance(r.get("Elements"), int)})
        cols = [osu.Column("Elements", 11, "d"), osu.Column("float32(us)", 16, ".1f"),
                osu.Column("majority(us)", 16, ".1f"),
                osu.Column("allgather(us)", 16, ".1f"), osu.Column("floor(us)", 14, ".1f"),
                osu.Column("vs-float32", 12, ".2f"), osu.Column("vs-allgather", 14, ".2f"),
                osu.Column("floor-vs-float32", 18, ".2f")]
        rep.start(f"bitcoll {where} majority sign_allreduce, {osu.ranks(p)}",
                  ["best latency over rounds of float32/allreduce, majority/default, "
                   "majority/allgather and floor/pack+unpack (local packing and unpacking "
                   "only: the bound of any sign all-reduce on this machine); vs-X = X "
                   "latency / majority latency; floor-vs-float32 = float32 / floor, the "
                   "largest speedup this machine allows"], cols, ranks=p)
        for n in counts:
            f = _min_latency(rows, n, "float32/allreduce")
            m = _min_latency(rows, n, "majority/default")
            g = _min_latency(rows, n, "majority/allgather")
            lo = _min_latency(rows, n, "floor/pack+unpack")
            rep.row(n, f, m, g, lo, f / m if f and m else None, g / m if g and m else None,
                    f / lo if f and lo else None)
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Loopback comparison matrix of the OSU-style "
                                            "tools (bitcoll-TCP, bitcoll-MPI, mpi4py, gloo).")
    p.add_argument("--ranks", default="2,4", help="comma list of world sizes (default 2,4)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma list of {', '.join(IMPLS)} (default: all)")
    p.add_argument("--sizes", default=None,
                   help="all-reduce sizes in bytes (default 1K:256M; --quick 1K:256M:4)")
    p.add_argument("--sign-sizes", default=None,
                   help="sign_allreduce sizes in elements (default 1M:64M:4; --quick 64M)")
    p.add_argument("--sign-ranks", default="4",
                   help="world sizes of the sign run, comma list, or 'none' (default 4)")
    p.add_argument("--quick", action="store_true", help="fewer sizes")
    p.add_argument("--repeat", type=int, default=1, help="rounds of the matrix (default 1)")
    p.add_argument("--iter-bytes", default=None,
                   help="passed to the tools (bytes timed per size, e.g. 512M)")
    p.add_argument("--check", action="store_true", help="pass --check to the tools")
    p.add_argument("--out", default=str(ROOT / "results"), help="output directory")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="time limit of each run in seconds (default 900)")
    p.add_argument("--nice", type=int, default=0,
                   help="run every job under `nice -n NICE` (negative: higher priority, root "
                        "only; reduces interference from other work on the machine)")
    p.add_argument("--netbed", metavar="RATE", default=None,
                   help="run everything on the emulated Ethernet testbed (bench/netbed.py), "
                        "one host per rank, links of RATE (e.g. 1gbit; root only)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    return p


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
        sign_ranks = [] if args.sign_ranks == "none" else \
            [int(r) for r in args.sign_ranks.split(",") if r.strip()]
    except ValueError:
        ap.error("--ranks and --sign-ranks take comma lists of integers")
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad or args.repeat < 1 or any(r < 1 for r in ranks + sign_ranks):
        ap.error(f"bad --impls {bad}, --repeat or rank counts")
    sizes = args.sizes or ("1K:256M:4" if args.quick else "1K:256M")
    sign_sizes = args.sign_sizes or ("64M" if args.quick else "1M:64M:4")
    for spec in (sizes, sign_sizes):
        try:
            osu.parse_sizes(spec)
        except ValueError as exc:
            ap.error(str(exc))
    common: list[str] = ["--check"] if args.check else []
    if args.iter_bytes:
        common += ["--iter-bytes", str(args.iter_bytes)]
    out_dir = Path(args.out)
    if not args.dry_run:
        out_dir.mkdir(parents=True, exist_ok=True)

    outputs: dict[str, list[str]] = {}
    by_p: dict[int, dict[str, list[osu.Table]]] = {}
    sign: dict[int, list[osu.Table]] = {}
    failed: list[str] = []
    t_start = time.monotonic()
    json_dir = Path(tempfile.mkdtemp(prefix="run_all-"))
    runs = 0

    def record(name: str, cmd: list[str]) -> list[osu.Table]:
        nonlocal runs
        if args.nice:
            cmd = ["nice", "-n", str(args.nice), *cmd]
        runs += 1
        json_path = json_dir / f"{runs}-{name}.json"
        ok, text, _ = run(cmd, args.timeout, args.dry_run, json_path)
        shown = shlex.join(osu.display_command(cmd))
        outputs.setdefault(name, []).append(f"# command: {shown}\n\n{text}\n")
        if not args.dry_run:
            (out_dir / f"{name}.txt").write_text("\n".join(outputs[name]))
        if ok and not args.dry_run and not json_path.exists():
            print(f"  wrote no {json_path}", flush=True)
            ok = False
        if not ok:
            failed.append(shown)
            return []
        return [] if args.dry_run else osu.load_tables(json_path)

    try:
        for k in range(args.repeat):
            for p in ranks:
                order = impls if k % 2 == 0 else list(reversed(impls))
                for impl in order:
                    cmd = allreduce_command(impl, p, ["-m", sizes, *common], args.netbed)
                    tables = record(f"allreduce_{impl}_np{p}", cmd)
                    by_p.setdefault(p, {}).setdefault(impl, []).extend(tables)
            for p in sign_ranks:
                tables = record(f"sign_np{p}",
                                sign_command(p, ["-m", sign_sizes, *common], args.netbed))
                sign.setdefault(p, []).extend(tables)
    finally:
        shutil.rmtree(json_dir, ignore_errors=True)
    if not args.dry_run:
        where = "loopback" if args.netbed is None else f"{args.netbed} netbed"
        text = summarize(by_p, sign, args.repeat, where)
        (out_dir / "summary.txt").write_text(text)
        print(text, end="")
    print(f"total {time.monotonic() - t_start:.0f} s; {len(failed)} failed run(s)", flush=True)
    for line in failed:
        print(f"failed: {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
