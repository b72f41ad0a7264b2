"""Smoke tests of the benchmark tools (bench/): the OSU harness's parsing, iteration schedule,
table format and shared helpers, one run of every tool at tiny sizes on one rank and on two TCP
ranks under the launcher, with ``--check`` (results validated) and the output parsed back, and
the loss-curve figures of plot_curves.py (PNG and SVG)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from svg_check import svg_text

from lioncub.recipe.logs import LOG_FORMAT

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import osu  # noqa: E402 (bench/ is not a package: its modules are found through sys.path)
import plot_curves  # noqa: E402

PY = sys.executable
SMALL = ["-i", "3", "-x", "1", "--min-iterations", "1", "--timeout", "30"]


def run_proc(cmd: list[str], timeout: float = 60.0,
             expect: int = 0) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in the project root; check its exit status."""
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == expect, (f"{cmd} exited {proc.returncode}\nstdout:\n"
                                       f"{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def run(cmd: list[str], timeout: float = 60.0, expect: int = 0) -> str:
    """Run ``cmd`` in the project root; check its exit status; return its stdout."""
    return run_proc(cmd, timeout, expect).stdout


OSU_FULL = ["Size", "Avg Latency(us)", "Min Latency(us)", "Max Latency(us)", "Iterations"]


def read_osu(text: str) -> list[tuple[str, list[str], list[tuple[int, float]]]]:
    """A minimal reader of OSU benchmark output, independent of bench/osu.py: a table is a run
    of ``#`` lines (the first names the test, the last is the column header ``# Size  Avg
    Latency(us) ...``, columns separated by two or more spaces) and the rows after it, whose
    first field is the size in bytes and second the average latency in microseconds. Returns
    (test name, columns, [(size, avg)]) per table."""
    tables: list[tuple[str, list[str], list[tuple[int, float]]]] = []
    head: list[str] = []
    rows: list[tuple[int, float]] | None = None
    for line in text.splitlines():
        if not line.strip() or (line.startswith("#") and rows is not None):
            head, rows = [], None
        if line.startswith("#"):
            head.append(line[1:].strip())
        elif line.strip():
            if rows is None:
                rows = []
                tables.append((head[0], re.split(r"\s{2,}", head[-1]), rows))
            fields = line.split()
            rows.append((int(fields[0]), float(fields[1])))
    return tables


def tool(name: str, *args: str) -> list[str]:
    return [PY, f"bench/{name}", *args]


def launch(n: int, name: str, *args: str) -> list[str]:
    return [PY, "-m", "launch", "-n", str(n), f"bench/{name}", *args]


def one_table(text: str) -> osu.Table:
    tables = osu.parse_tables(text)
    assert len(tables) == 1, text
    return tables[0]


# ------------------------------------------------------------------------------ the harness


def test_parse_sizes() -> None:
    assert osu.parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    assert osu.parse_sizes("1K:256M:4") == [1 << k for k in range(10, 29, 2)]
    assert osu.parse_sizes("64, 1k,1KiB,3M") == [64, 1024, 3 << 20]
    assert osu.parse_sizes("1G") == [1 << 30]
    for bad in ("", "0:1K", "8K:1K", "1K:2K:1", "abc", "1K:2K:3:4", "-1"):
        with pytest.raises(ValueError):
            osu.parse_sizes(bad)


def test_schedule_shrinks_with_size() -> None:
    s = osu.Schedule(iterations=100, warmup=10, min_iterations=3, iter_bytes=1 << 30)
    assert s.for_bytes(1024) == (100, 10)
    assert s.for_bytes(16 << 20) == (64, 7)
    assert s.for_bytes(256 << 20) == (4, 1)
    assert s.for_bytes(1 << 40) == (3, 1)
    assert osu.Schedule(warmup=0).for_bytes(1) == (100, 0)
    with pytest.raises(ValueError):
        osu.Schedule(iterations=0)


def test_bandwidth_definitions() -> None:
    assert osu.bus_factor("allreduce", 4) == 1.5
    assert osu.bus_factor("reduce_scatter", 4) == 0.75
    assert osu.bus_factor("allgather", 2) == 0.5
    assert osu.bus_factor("broadcast", 8) == 1.0
    assert osu.data_bytes("allgather", 100, 4) == 400
    assert osu.data_bytes("alltoall", 100, 4) == 100
    assert osu.gbps(2e9, 2.0) == 1.0


def test_report_round_trip(tmp_path: Path) -> None:
    lines: list[str] = []
    path = tmp_path / "t.json"
    rep = osu.Report(0, str(path), print_fn=lines.append)
    cols = [osu.Column("Size", 10, "d"), osu.Column("Avg Latency(us)", 8, ".2f"),
            osu.Column("Name", 4, "s"), osu.Column("BW(GB/s)", 10, ".3f")]
    rep.start("a title, 2 ranks", ["first comment"], cols, ranks=2)
    rep.row(1024, 12345678.125, "a-very-long-name", None)
    rep.row(2048, 1.5, "x", 0.25)
    rep.note("a note")
    rep.start("second", [], cols[:2])
    rep.row(1, 2.0)
    rep.finish()
    text = "\n".join(f"[rank 0] {line}" for line in lines)
    first, second = osu.parse_tables(text)
    assert first.title == "a title, 2 ranks"
    assert first.columns == ["Size", "Avg Latency(us)", "Name", "BW(GB/s)"]
    assert first.rows == [
        {"Size": 1024, "Avg Latency(us)": 12345678.12, "Name": "a-very-long-name",
         "BW(GB/s)": None},
        {"Size": 2048, "Avg Latency(us)": 1.5, "Name": "x", "BW(GB/s)": 0.25}]
    assert first.comments == ["first comment", "a note"]
    assert second.rows == [{"Size": 1, "Avg Latency(us)": 2.0}]
    doc = json.loads(path.read_text())
    assert [t["title"] for t in doc] == ["a title, 2 ranks", "second"]
    assert doc[0]["meta"] == {"ranks": 2}
    assert doc[0]["rows"][0]["Avg Latency(us)"] == 12345678.125
    with pytest.raises(ValueError):
        osu.parse_tables("# t\n# A  B\n1 2 3\n")
    other = osu.Report(1, print_fn=lines.append)
    n = len(lines)
    other.start("hidden", [], cols[:1])
    other.row(5)
    assert len(lines) == n  # only rank 0 prints


class FakeRuntime(osu.Runtime):
    """A runtime whose peers' gathered rows are given; records barrier/abort/close calls."""

    def __init__(self, rows: list[list[float]], rank: int = 0) -> None:
        self.rows, self.rank, self.size = rows, rank, len(rows)
        self.calls: list[str] = []

    def barrier(self) -> None:
        self.calls.append("barrier")

    def gather(self, values: Sequence[float]) -> Any:
        import numpy as np

        table = np.array(self.rows, dtype=np.float64)
        table[self.rank] = values
        return table

    def abort(self, reason: str) -> None:
        self.calls.append(f"abort: {reason}")

    def close(self) -> None:
        self.calls.append("close")


def test_timing_reduction_and_check_verdict() -> None:
    # rank 0 measures its own latency and CPU (microseconds: tiny next to the figures that
    # ranks 1 and 2 report); columns are latency, CPU and wire bytes per call
    rt = FakeRuntime([[0.0, 0.0, 0.0], [1e6, 3e6, 0.0], [4e6, 6e6, 0.0]])
    t = osu.time_loop(rt, lambda: None, iterations=2, warmup=1)
    assert rt.calls == ["barrier"]
    assert 0.0 <= t.min_us < 1e5
    assert (t.max_us, t.iterations, t.wire_bytes) == (4e6, 2, None)
    assert t.avg_us == pytest.approx((t.min_us + 1e6 + 4e6) / 3)
    assert t.cpu_us == pytest.approx(3e6, rel=0.02)
    osu.agree(FakeRuntime([[1.0], [1.0]]), True, "fine")
    with pytest.raises(osu.CheckError, match=r"wrong result on ranks \[1, 2\]"):
        osu.agree(FakeRuntime([[1.0], [0.0], [0.0]]), True, "x")
    with pytest.raises(osu.CheckError, match=r"ranks \[0\]"):
        osu.agree(FakeRuntime([[1.0], [1.0]]), False, "x")


def test_run_tool_exit_status_and_abort() -> None:
    rt = FakeRuntime([[0.0]])
    assert osu.run_tool(lambda: rt, lambda r: None) == 0
    assert rt.calls == ["close"]

    def fail_check(r: osu.Runtime) -> None:
        raise osu.CheckError("bad")

    rt = FakeRuntime([[0.0]])
    assert osu.run_tool(lambda: rt, fail_check) == 1
    assert rt.calls == ["close"]  # a collective verdict: no abort

    def crash(r: osu.Runtime) -> None:
        raise MemoryError("boom")

    rt = FakeRuntime([[0.0]])
    assert osu.run_tool(lambda: rt, crash) == 1
    assert rt.calls == ["abort: MemoryError: boom", "close"]


# ------------------------------------------------------------------------------ the tools


def check_rows(table: osu.Table, sizes: list[int], iterations: int = 3,
               data_factor: int = 1) -> None:
    """Sizes, iterations, latency order and AlgBW = data_factor * Size / Avg, up to the
    printed roundings (AlgBW to 3 decimals, Avg to 2: the latter matters on a fast machine,
    where a few microseconds carry the whole table)."""
    assert [r["Size"] for r in table.rows] == sizes
    for r in table.rows:
        assert r["Iterations"] == iterations
        assert 0 < r["Min Latency(us)"] <= r["Avg Latency(us)"] <= r["Max Latency(us)"]
        assert r["CPU(us)"] >= 0
        avg = r["Avg Latency(us)"]
        want = osu.gbps(data_factor * r["Size"], avg * 1e-6)
        slack = 5e-4 + want * 0.005 / avg + 1e-9  # half a printed digit of each
        assert abs(r["AlgBW(GB/s)"] - want) <= slack, (r, want)


def numeric_rows(text: str) -> list[list[str]]:
    """The rows of OSU-format output, each checked to be numbers only (``-`` for a missing
    value): the size in bytes, then one value per column."""
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        for f in fields:
            if f != "-":
                float(f)  # ValueError: a cell that is not a number
        assert int(fields[0]) >= 0, line
        rows.append(fields)
    return rows


@pytest.mark.timeout(90)
def test_single_rank_runs(tmp_path: Path) -> None:
    metrics = ["AlgBW(GB/s)", "BusBW(GB/s)", "CPU(us)"]
    out = run(tool("osu_allreduce.py", "-f", "--metrics", "-m", "4,1K:4K", "--check", "--json",
                   str(tmp_path / "a.json"), *SMALL))
    table = one_table(out)
    assert table.title == "bitcoll OSU-style Allreduce Test, backend local, 1 rank"
    assert table.columns == [*OSU_FULL, *metrics]
    check_rows(table, [4, 1024, 2048, 4096])
    assert all(r["BusBW(GB/s)"] == 0 for r in table.rows)  # 2(p-1)/p = 0 for one rank
    doc = json.loads((tmp_path / "a.json").read_text())
    assert [r["Size"] for r in doc[0]["rows"]] == [4, 1024, 2048, 4096]
    assert [t.rows for t in osu.load_tables(tmp_path / "a.json")] == [
        [{**r, "Avg Latency(us)": pytest.approx(r["Avg Latency(us)"], abs=6e-3),
          "Min Latency(us)": pytest.approx(r["Min Latency(us)"], abs=6e-3),
          "Max Latency(us)": pytest.approx(r["Max Latency(us)"], abs=6e-3),
          "AlgBW(GB/s)": pytest.approx(r["AlgBW(GB/s)"], abs=6e-4),
          "BusBW(GB/s)": pytest.approx(r["BusBW(GB/s)"], abs=6e-4),
          "CPU(us)": pytest.approx(r["CPU(us)"], abs=0.6)} for r in table.rows]]

    # OSU's layout by default: size and average latency only (-f adds OSU's three columns);
    # the JSON still has every column
    out = run(tool("osu_allreduce.py", "-m", "1K", "--json", str(tmp_path / "b.json"), *SMALL))
    assert one_table(out).columns == ["Size", "Avg Latency(us)"]
    assert all(len(r) == 2 for r in numeric_rows(out))
    (doc_b,) = osu.load_tables(tmp_path / "b.json")
    assert doc_b.columns == ["Size", "Avg Latency(us)", *metrics]
    assert doc_b.rows[0]["Size"] == 1024 and doc_b.rows[0]["CPU(us)"] >= 0

    out = run(tool("osu_collectives.py", "--collective", "allgather,barrier", "-m", "1K",
                   "--check", "--full", "--metrics", *SMALL))
    ag, barrier = osu.parse_tables(out)
    assert ag.title.startswith("bitcoll OSU-style Allgather Test, backend local")
    assert ag.columns[:5] == barrier.columns[:5] == OSU_FULL
    check_rows(ag, [1024])
    assert barrier.rows[0]["Size"] == 0 and barrier.rows[0]["BusBW(GB/s)"] is None
    assert barrier.rows[0]["Iterations"] == 3

    out = run(tool("osu_sign_allreduce.py", "-m", "1001", "--algorithm", "default,ring",
                   "--op", "majority,packed", "--compare-float32", "--floor", "--check",
                   "--json", str(tmp_path / "s.json"), *SMALL))
    tables = osu.parse_tables(out)
    variants = ["float32/allreduce", "floor/pack+unpack", "majority/default", "majority/ring",
                "packed/default", "packed/ring"]
    assert [t.title for t in tables] == [
        f"OSU-style Sign Allreduce Test: bitcoll {v}, backend local, 1 rank" for v in variants]
    for t in tables:
        assert t.columns == ["Size", "Avg Latency(us)"]
        assert [r["Size"] for r in t.rows] == [4004]
    assert all(len(r) == 2 for r in numeric_rows(out))
    docs = osu.load_tables(tmp_path / "s.json")
    assert [t.meta["variant"] for t in docs] == variants
    for t in docs:
        (r,) = t.rows
        assert (r["Size"], r["Elements"], r["Variant"]) == (4004, 1001, t.meta["variant"])
        assert r["Wire(B/rank)"] == 0  # nothing to send alone


@pytest.mark.timeout(90)
def test_allreduce_two_tcp_ranks_and_gloo() -> None:
    cmd = launch(2, "osu_allreduce.py", "-f", "--metrics", "-m", "1K,64K,256K", "--check",
                 *SMALL)
    cmd.insert(cmd.index("launch") + 1, "--no-prefix")
    out = run(cmd)
    assert "[rank" not in out
    ((name, columns, rows),) = read_osu(out)  # what any OSU-format reader sees
    assert name == "bitcoll OSU-style Allreduce Test, backend tcp, 2 ranks"
    assert columns[:5] == OSU_FULL
    assert [size for size, _ in rows] == [1024, 65536, 262144]
    assert all(avg > 0 for _, avg in rows)
    table = one_table(out)
    assert table.title == "bitcoll OSU-style Allreduce Test, backend tcp, 2 ranks"
    check_rows(table, [1024, 65536, 262144])
    for r in table.rows:  # 2 (p - 1) / p = 1
        assert r["BusBW(GB/s)"] == pytest.approx(r["AlgBW(GB/s)"], abs=1e-3)
    out = run(launch(2, "osu_allreduce.py", "--impl", "gloo", "-f", "--metrics", "-m", "1K,8K",
                     "--check", *SMALL))
    table = one_table(out)
    assert table.title == "bitcoll OSU-style Allreduce Test, backend gloo, 2 ranks"
    check_rows(table, [1024, 8192])


def check_paired(table: osu.Table, sizes: list[int], rounds: int) -> None:
    """The paired tool's columns agree with each other: best = bitcoll / ref of the best
    rounds (up to the printed roundings), min <= median <= max, and ``faster`` a share of the
    rounds."""
    assert [r["Size"] for r in table.rows] == sizes
    for r in table.rows:
        ours, theirs = r["bitcoll(us)"], r["ref(us)"]
        assert ours > 0 and theirs > 0
        assert r["best"] == pytest.approx(ours / theirs, rel=0.01, abs=2e-3)
        assert 0 < r["min"] <= r["median"] <= r["max"]
        assert r["faster"] * rounds == pytest.approx(round(r["faster"] * rounds), abs=0.02)
        assert 0 <= r["faster"] <= 1 and r["CPU(us)"] >= 0 and r["refCPU(us)"] >= 0


@pytest.mark.timeout(120)
def test_paired_against_gloo_and_mpi4py(tmp_path: Path) -> None:
    out = run(launch(2, "osu_paired.py", "--versus", "gloo", "-m", "8,4K", "--rounds", "3",
                     "--check", "--json", str(tmp_path / "p.json"), *SMALL), timeout=90)
    table = one_table(out)
    assert table.title == "bitcoll OSU-style paired Allreduce Test, backend tcp against " \
                          "gloo, 2 ranks"
    check_paired(table, [8, 4096], 3)
    (doc,) = osu.load_tables(tmp_path / "p.json")
    for got, shown in zip(doc.rows, table.rows, strict=True):  # JSON keeps every digit
        assert got.keys() == shown.keys()
        assert got["best"] == pytest.approx(shown["best"], abs=6e-4)
    assert doc.meta["inplace"] is True  # gloo reduces in place, so bitcoll does too
    assert (doc.meta["versus"], doc.meta["rounds"]) == ("gloo", 3)
    out = run([str(Path(PY).parent / "mpiexec"), "-n", "2", PY, "bench/osu_paired.py",
               "--versus", "mpi4py", "-m", "64,1K", "--rounds", "2", "--check", "--json",
               str(tmp_path / "m.json"), *SMALL], timeout=90)
    table = one_table(out)
    assert table.title == "bitcoll OSU-style paired Allreduce Test, backend mpi against " \
                          "mpi4py, 2 ranks"
    check_paired(table, [64, 1024], 2)
    (doc,) = osu.load_tables(tmp_path / "m.json")
    assert doc.meta["inplace"] is False and doc.meta["backend"] == "mpi"
    # mpi4py under the launcher is a one-rank world: refused with what to do instead
    proc = run_proc(launch(2, "osu_paired.py", "--versus", "mpi4py", "-m", "8", *SMALL),
                    timeout=90, expect=1)
    assert "run --versus mpi4py under mpiexec" in proc.stdout + proc.stderr


@pytest.mark.timeout(90)
def test_collectives_two_tcp_ranks() -> None:
    out = run(launch(2, "osu_collectives.py", "--collective", "all", "-m", "1K,16K",
                     "--check", "-f", "--metrics", *SMALL))
    tables = osu.parse_tables(out)
    names = [t.title.split(" Test")[0].split()[-1] for t in tables]
    assert names == ["Reduce_scatter", "Allgather", "Broadcast", "Alltoall", "Barrier"]
    for t, factor in zip(tables[:-1], (1, 2, 1, 1), strict=True):
        assert "2 ranks" in t.title
        check_rows(t, [1024, 16384], data_factor=factor)  # allgather: S = p * Size


@pytest.mark.timeout(120)
def test_sign_two_tcp_ranks() -> None:
    # levels 1: the quantized and the sign-sum variants share their field widths (2 bits in,
    # 3 bits out at p = 2), which keeps the kernels compiled for this run to one set
    cmd = launch(2, "osu_sign_allreduce.py", "-m", "1001,4096", "--op",
                 "majority,packed,sum,quantized", "--algorithm", "default,allgather",
                 "--compare-float32", "--check", "--levels", "1", "-f", "--metrics", *SMALL)
    cmd.insert(cmd.index("launch") + 1, "--no-prefix")
    out = run(cmd, timeout=110)
    tables = osu.parse_tables(out)
    variants = ["float32/allreduce"] + [f"{op}/{a}" for op in ("majority", "packed", "sum",
                                                               "quantized1")
                                        for a in ("default", "allgather")]
    # what any OSU-format reader sees, without bench/osu.py: one table per variant, the size
    # in bytes of the float32 input first, then OSU's -f columns, then the tool's own
    osu_tables = read_osu(out)
    assert [name for name, _, _ in osu_tables] == [
        f"OSU-style Sign Allreduce Test: bitcoll {v}, backend tcp, 2 ranks" for v in variants]
    for (_, columns, osu_rows), t in zip(osu_tables, tables, strict=True):
        assert columns[:5] == OSU_FULL
        assert columns[5:] == ["Elements", "EffBW(GB/s)", "Wire(B/rank)", "CPU(us)", "Speedup"]
        assert osu_rows == [(r["Size"], r["Avg Latency(us)"]) for r in t.rows]
    assert all(len(r) == 10 for r in numeric_rows(out))
    assert [t.rows[0]["Iterations"] for t in tables] == [3] * len(variants)
    rows: dict[tuple[int, str], dict[str, Any]] = {
        (r["Elements"], v): r for t, v in zip(tables, variants, strict=True) for r in t.rows}
    assert sorted(rows) == sorted((n, v) for n in (1001, 4096) for v in variants)
    for (n, _), r in rows.items():
        assert r["Size"] == 4 * n
        base, avg = rows[(n, "float32/allreduce")]["Avg Latency(us)"], r["Avg Latency(us)"]
        want = base / avg  # from the printed latencies (2 decimals) and Speedup (2 decimals)
        assert abs(r["Speedup"] - want) <= 5e-3 + want * (0.005 / base + 0.005 / avg) + 1e-9

    # Counted wire bytes: a float32 ring sends the whole vector once (p = 2) plus headers;
    # the 1-bit majority sends an eighth of that order, packed or not
    f32 = rows[(4096, "float32/allreduce")]["Wire(B/rank)"]
    maj = rows[(4096, "majority/default")]["Wire(B/rank)"]
    assert 4 * 4096 <= f32 < 4 * 4096 + 4096
    assert 4096 // 8 <= maj < 4096 // 8 + 1024
    assert rows[(4096, "packed/default")]["Wire(B/rank)"] == maj


def exit_status(name: str, argv: list[str], capsys: pytest.CaptureFixture[str]
                ) -> tuple[int, str]:
    """The exit status of ``python bench/<name>.py argv`` (whose last line is
    ``sys.exit(main())``), found by calling its ``main`` in this process; and its stderr."""
    module = importlib.import_module(name)
    try:
        code: object = module.main(argv)
    except SystemExit as exc:
        code = exc.code
    status = 0 if code is None else code if isinstance(code, int) else 1
    return status, capsys.readouterr().err


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for name, argv, size in (("osu_allreduce", ["-m", "1K,6"], 6),
                             ("osu_allreduce", ["-m", "0"], 0),
                             ("osu_collectives", ["--collective", "broadcast", "-m", "1K,1027"],
                              1027)):
        status, err = exit_status(name, argv, capsys)
        assert status == 2, err
        assert f"size {size} bytes is not a whole number of float32 elements (4 bytes each)" \
            in err
    status, err = exit_status("osu_sign_allreduce", ["-m", "0"], capsys)
    assert status == 2 and "must be >= 1" in err, err
    for name, argv in (("osu_allreduce", ["-m", "8K:1K"]),
                       ("osu_allreduce", ["--impl", "mpi4py", "--algorithm", "ring"]),
                       ("osu_collectives", ["--collective", "gather"]),
                       ("osu_paired", ["-m", "8"]),  # --versus is required
                       ("osu_paired", ["--versus", "mpi4py", "--rounds", "0"]),
                       ("osu_paired", ["--versus", "gloo", "-m", "6"]),
                       ("osu_sign_allreduce", ["--op", "mean"])):
        status, err = exit_status(name, argv, capsys)
        assert status == 2, (name, argv, err)


@pytest.mark.timeout(60)
def test_run_all_dry_run_lists_the_matrix(tmp_path: Path) -> None:
    out = run([PY, "bench/run_all.py", "--dry-run", "--quick", "--out", str(tmp_path)])
    cmds = [line[2:] for line in out.splitlines() if line.startswith("+ ")]
    assert len(cmds) == 2 * 5 + 1
    assert sum("-m launch -n 4 bench/osu_allreduce.py --impl gloo" in c for c in cmds) == 1
    assert sum("mpiexec -n 2" in c and "--impl mpi4py" in c for c in cmds) == 1
    assert "osu_sign_allreduce.py --compare-float32 --floor --algorithm default,allgather -m 64M" \
        in cmds[-1]
    out = run([PY, "bench/run_all.py", "--dry-run", "--quick", "--netbed", "1gbit", "--ranks",
               "3", "--out", str(tmp_path)])
    cmds = [line[2:] for line in out.splitlines() if line.startswith("+ ")]
    assert len(cmds) == 5 + 1
    assert sum("bench/netbed.py --hosts 3 --rate 1gbit bench/osu_allreduce.py --impl gloo" in c
               for c in cmds) == 1
    assert sum("bench/netbed.py --mpi --hosts 3 --rate 1gbit bench/osu_allreduce.py --impl "
               "mpi4py" in c for c in cmds) == 1
    assert "netbed.py --hosts 4 --rate 1gbit bench/osu_sign_allreduce.py" in cmds[-1]


@pytest.mark.timeout(120)
def test_run_all_reads_the_tools_json(tmp_path: Path) -> None:
    out = run([PY, "bench/run_all.py", "--ranks", "2", "--impls", "bitcoll-tcp", "--sizes",
               "1K,4K", "--sign-ranks", "2", "--sign-sizes", "1K", "--iter-bytes", "64K",
               "--out", str(tmp_path)], timeout=110)
    assert "0 failed run(s)" in out
    lat, _cpu, _bw, sign = osu.parse_tables((tmp_path / "summary.txt").read_text())
    assert [r["Size"] for r in lat.rows] == [1024, 4096]
    assert all(r["bitcoll-tcp(us)"] > 0 for r in lat.rows)
    assert [r["Elements"] for r in sign.rows] == [1024]
    assert all(v is not None for v in sign.rows[0].values())
    text = (tmp_path / "allreduce_bitcoll-tcp_np2.txt").read_text()
    assert "--json" not in text and "bitcoll OSU-style Allreduce Test" in text


def test_run_all_summary_from_tables() -> None:
    import run_all

    def table(rows: list[tuple[int, float]], p: int) -> list[osu.Table]:
        lines: list[str] = []
        rep = osu.Report(0, print_fn=lines.append)
        rep.start("t", [], [osu.Column("Size", 10, "d"), osu.Column("Avg Latency(us)", 18, ".2f"),
                            osu.Column("BusBW(GB/s)", 14, ".3f"), osu.Column("CPU(us)", 9, ".0f")])
        for size, lat in rows:
            rep.row(size, lat, osu.gbps(size, lat * 1e-6) * 2 * (p - 1) / p, lat / 2)
        return osu.parse_tables("\n".join(lines))

    by_p = {2: {"bitcoll-tcp": table([(1024, 10.0), (1 << 20, 1000.0)], 2)
                + table([(1024, 20.0), (1 << 20, 800.0)], 2),  # a second round
                "mpi4py": table([(1024, 5.0), (1 << 20, 1600.0)], 2),
                "gloo": table([(1 << 20, 400.0)], 2)}}
    sign_lines: list[str] = []
    rep = osu.Report(0, print_fn=sign_lines.append)
    rep.start("s", [], [osu.Column("Elements", 10, "d"), osu.Column("Variant", 20, "s"),
                        osu.Column("Avg Latency(us)", 18, ".2f")])
    rep.row(64, "float32/allreduce", 900.0)
    rep.row(64, "majority/default", 100.0)
    rep.row(64, "majority/allgather", 150.0)
    rep.row(64, "floor/pack+unpack", 60.0)
    text = run_all.summarize(by_p, {4: osu.parse_tables("\n".join(sign_lines))}, rounds=2)
    lat, cpu, bw, sign = osu.parse_tables(text)
    assert cpu.rows[1] == {"Size": 1 << 20, "bitcoll-tcp(us)": 400, "mpi4py(us)": 800,
                           "gloo(us)": 200}  # the CPU of the best rounds
    assert lat.columns == ["Size", "bitcoll-tcp(us)", "mpi4py(us)", "gloo(us)"]
    assert lat.rows[1] == {"Size": 1 << 20, "bitcoll-tcp(us)": 800.0, "mpi4py(us)": 1600.0,
                           "gloo(us)": 400.0}  # best round per implementation
    assert bw.columns[-2:] == ["bitcoll-tcp/mpi4py", "bitcoll-tcp/gloo"]
    assert bw.rows[0]["bitcoll-tcp/gloo"] is None  # gloo has no 1K row
    assert bw.rows[1]["bitcoll-tcp/mpi4py"] == 2.0 and bw.rows[1]["bitcoll-tcp/gloo"] == 0.5
    assert bw.rows[1]["bitcoll-tcp(GB/s)"] == pytest.approx((1 << 20) / 800e-6 / 1e9, abs=1e-3)
    assert sign.rows == [{"Elements": 64, "float32(us)": 900.0, "majority(us)": 100.0,
                          "allgather(us)": 150.0, "floor(us)": 60.0, "vs-float32": 9.0,
                          "vs-allgather": 1.5, "floor-vs-float32": 15.0}]


# ------------------------------------------------------------------------- shared helpers


def test_fmt_bytes() -> None:
    assert osu.fmt_bytes(0) == "0 B"
    assert osu.fmt_bytes(999) == "999 B"
    assert osu.fmt_bytes(1500) == "1.5 kB"
    assert osu.fmt_bytes(2_628_288) == "2.6 MB"
    assert osu.fmt_bytes(3e12) == "3000.0 GB"


def test_free_port_can_be_bound() -> None:
    import socket

    port = osu.free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_dense_helpers() -> None:
    import numpy as np

    assert osu.ramp(15, 2.0).tolist() == [float(i % 13 + 2) for i in range(15)]
    assert osu.ramp(3, 0.0).dtype == np.float32
    assert [c.name for c in osu.dense_columns(False)] == [
        "Size", "Avg Latency(us)", "AlgBW(GB/s)", "BusBW(GB/s)", "CPU(us)"]
    assert [c.name for c in osu.dense_columns(True)][:5] == OSU_FULL


def test_tool_main_parses_validates_and_runs() -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="t")
    osu.add_dense_args(ap, ("auto", "ring"), "algorithm")
    osu.add_common_args(ap, "1K")
    seen: list[Any] = []

    def open_rt(args: argparse.Namespace) -> FakeRuntime:
        seen.append(("open", args.impl))
        return FakeRuntime([[0.0]])

    def body(args: argparse.Namespace, rt: FakeRuntime) -> None:
        seen.append(("run", args.sizes, rt.size))

    assert osu.tool_main(ap, ["-m", "1K,2K"], open_rt, body,
                         validate=osu.check_dense_args) == 0
    assert seen == [("open", "bitcoll"), ("run", [1024, 2048], 1)]
    for bad in (["-i", "0"], ["--impl", "gloo", "--algorithm", "ring"], ["-m", "6"]):
        with pytest.raises(SystemExit) as exc:
            osu.tool_main(ap, bad, open_rt, body, validate=osu.check_dense_args)
        assert exc.value.code == 2
    assert len(seen) == 2  # nothing opened or run for bad options


# ------------------------------------------------------------------------ loss-curve plots


def fake_log(optimizer: str, seed: int, final: float) -> dict[str, Any]:
    """A small train.py JSON log: 40 steps, an evaluation every 10, losses from 4.6 down to
    about ``final``."""
    def loss(step: int) -> float:
        return final + (4.6 - final) * 0.9 ** step

    return {"format": LOG_FORMAT,
            "config": {"optimizer": optimizer, "seed": seed, "steps": 40, "batch_size": 8,
                       "lr": 1e-3, "levels": None, "momentum_sync": None},
            "run": {"world_size": 2, "backend": "tcp", "n_params": 1234},
            "steps": [{"step": k, "loss": loss(k), "time": 0.01} for k in range(1, 41)],
            "evals": [{"step": k, "val_loss": loss(k) + 0.05, "elapsed": 0.01 * k}
                      for k in range(0, 41, 10)]}


def write_logs(tmp_path: Path) -> list[str]:
    paths = []
    for name, seed, final in (("global", 0, 2.0), ("global", 1, 2.1), ("lioncub-l1", 0, 2.05)):
        path = tmp_path / f"{name}-{seed}.json"
        path.write_text(json.dumps(fake_log(name, seed, final)))
        paths.append(str(path))
    return paths


def test_runs_are_grouped_and_averaged() -> None:
    records = [fake_log("global", 0, 2.0), fake_log("global", 1, 2.2),
               fake_log("lioncub-l1", 0, 2.0)]
    runs = plot_curves.group_runs(records)
    assert [(r.label, r.count) for r in runs] == [("global", 2), ("lioncub-l1", 1)]
    assert runs[0].val_x == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert runs[0].final_val == pytest.approx((fake_log("global", 0, 2.0)["evals"][-1]
                                               ["val_loss"] + fake_log("global", 1, 2.2)
                                               ["evals"][-1]["val_loss"]) / 2)
    assert plot_curves.subtitle_of(records) == (
        "2 ranks (tcp), 0.00M-parameter character transformer, 40 steps, batch 8 per rank, "
        "lr 0.001, seeds 0, 1")
    assert plot_curves.ema([1.0, 3.0], 0.0) == [1.0, 3.0]


def test_plot_png_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib import image

    monkeypatch.chdir(tmp_path)
    assert plot_curves.main(write_logs(tmp_path)) == 0
    out = tmp_path / "loss_curves.png"  # the default output
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    pixels = image.imread(out)
    assert pixels.shape[1] == 11 * plot_curves.DPI and pixels.shape[0] > 500
    assert pixels.std() > 0.01  # not a blank image
    # the format follows the extension of -o; --format png on another name writes PNG
    other = tmp_path / "sub" / "curves.img"
    assert plot_curves.main([*write_logs(tmp_path), "-o", str(other), "--format", "png",
                             "--x", "time"]) == 0
    assert other.read_bytes().startswith(b"\x89PNG")


def test_plot_svg_on_request(tmp_path: Path) -> None:
    logs = write_logs(tmp_path)
    svg = tmp_path / "curves.svg"
    assert plot_curves.main([*logs, "-o", str(svg), "--title", "T & t"]) == 0
    texts = svg_text(svg)  # well-formed XML, title escaped
    assert "T & t" in texts and "Validation loss" in texts and "step" in texts
    assert "global (mean of 2)" in texts and "lioncub-l1" in texts
    assert "2 ranks (tcp)" in texts  # the subtitle derived from the logs
    again = tmp_path / "again.svg"
    assert plot_curves.main([*logs, "-o", str(again), "--title", "T & t"]) == 0
    assert again.read_bytes() == svg.read_bytes()  # no date, fixed ids: reproducible
    named = tmp_path / "named"
    assert plot_curves.main([*logs, "-o", str(named), "--format", "svg"]) == 0
    svg_text(named)  # well-formed SVG


def test_plot_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = write_logs(tmp_path)
    for bad in (["-o", "x.png", "--format", "svg"], ["--format", "pdf"], ["--smooth", "1"],
                ["--label", "only-one"]):
        with pytest.raises(SystemExit) as exc:
            plot_curves.main([*logs, *bad])
        assert exc.value.code == 2
    (tmp_path / "bad.json").write_text("{}")
    assert plot_curves.main([str(tmp_path / "bad.json"), "-o", str(tmp_path / "x.png")]) == 1
    assert "not a train.py log" in capsys.readouterr().err
    assert plot_curves.image_format(Path("a.SVG")) == "svg"
    assert plot_curves.image_format(Path("a.pdf")) == "png"
    with pytest.raises(ValueError):
        plot_curves.figure([], "t")


def test_gate_calibration_stores_the_median_and_the_measured_noise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench/gate.py --calibrate N``: each figure's reference is the median of the N runs and
    its tolerance twice the worst run's distance above it (at least 5%); the runs are kept.
    The suites are replaced by a recorded sequence of figures (nothing is timed)."""
    import gate

    assert gate.calibrated([1.0, 1.2, 1.1]) == {"ratio": 1.1, "tolerance": 0.182,
                                               "runs": [1.0, 1.2, 1.1]}
    assert gate.calibrated([2.0, 2.0, 2.01, 2.0])["tolerance"] == gate.MIN_TOLERANCE
    assert gate.calibrated([0.5, 0.7, 0.6, 0.4])["ratio"] == 0.55
    seq = iter([{"a": 1.0, "b": 3.0}, {"a": 1.5, "b": 3.0}, {"a": 1.2, "b": 3.3}])
    monkeypatch.setattr(gate, "run_suite", lambda suite, tree=None: next(seq))
    figures = tmp_path / "gate_figures.json"
    figures.write_text(json.dumps({"figures": {"old": {"ratio": 9.0, "tolerance": 0.25}}}))
    monkeypatch.setattr(gate, "FIGURES", figures)
    monkeypatch.setattr(gate, "ROOT", tmp_path)
    assert gate.main(["--only", "loopback", "--calibrate", "3"]) == 0
    stored = json.loads(figures.read_text())["figures"]
    assert stored["a"] == {"ratio": 1.2, "tolerance": 0.5, "runs": [1.0, 1.5, 1.2]}
    assert stored["b"]["ratio"] == 3.0 and stored["b"]["tolerance"] == 0.2
    assert stored["old"] == {"ratio": 9.0, "tolerance": 0.25}  # figures not measured stay
    for bad in (["--calibrate", "2"], ["--calibrate", "3", "--update"]):
        with pytest.raises(SystemExit) as exc:
            gate.main(["--only", "loopback", *bad])
        assert exc.value.code == 2


def test_gate_against_another_tree_judges_the_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``bench/gate.py --against TREE``: the verdict compares each figure with TREE's from the
    same run (a regression beyond the tolerance fails, after both are measured once more); a
    figure worse than stored in both trees (a slower machine) is named and passes. Without
    ``--against`` the stored figures decide. The suites are recorded figures (nothing is
    timed)."""
    import gate

    figures = tmp_path / "gate_figures.json"
    figures.write_text(json.dumps({"figures": {"a": {"ratio": 1.0, "tolerance": 0.1}}}))
    monkeypatch.setattr(gate, "FIGURES", figures)
    monkeypatch.setattr(gate, "ROOT", tmp_path)
    other_tree = tmp_path / "other"
    calls: list[str] = []

    def recorded(mine: list[float], theirs: list[float]) -> None:
        seqs = {"now": iter(mine), "other": iter(theirs)}

        def run_suite(suite: str, tree: Path = tmp_path) -> dict[str, float]:
            side = "other" if tree == other_tree else "now"
            calls.append(side)
            return {"a": next(seqs[side])}

        calls.clear()
        monkeypatch.setattr(gate, "run_suite", run_suite)

    against = ["--only", "loopback", "--against", str(other_tree)]
    recorded([2.05], [2.0])  # both slower than stored, alike: the machine
    assert gate.main(against) == 0
    out = capsys.readouterr().out
    assert "ok (both trees worse than stored)" in out and "gate passed" in out
    assert calls == ["other", "now"]
    recorded([1.15], [1.05])  # worse than stored, within the noise of the other tree
    assert gate.main(against) == 0
    assert "ok (worse than stored, within the noise of against)" in capsys.readouterr().out
    recorded([1.5, 1.4], [1.0, 1.1])  # this tree slower than the other, twice: a regression
    assert gate.main(against) == 1
    assert "FAILED: worse than the other tree's beyond noise: a" in capsys.readouterr().out
    assert calls == ["other", "now", "other", "now"]
    recorded([1.5, 1.05], [1.0, 1.0])  # one disturbed run: the better one counts
    assert gate.main(against) == 0
    capsys.readouterr()
    recorded([1.5, 1.5], [])  # without --against: the stored figure decides
    assert gate.main(["--only", "loopback"]) == 1
    assert "FAILED: worse than stored beyond noise: a" in capsys.readouterr().out
    assert calls == ["now", "now"]
