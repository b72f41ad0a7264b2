"""The emulated Ethernet testbed (bench/netbed.py): option handling everywhere; building the
namespaces, shaping the links, running a TCP job across them and removing everything again
where this process may create network namespaces (root with iproute2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import netbed  # noqa: E402 (bench/ is not a package)
import netbed_helpers  # noqa: E402
import osu  # noqa: E402

PY = sys.executable
SMALL = ["-i", "3", "-x", "1", "--min-iterations", "1", "--timeout", "30"]


def run(args: list[str], timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([PY, "bench/netbed.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def ours(pid: int) -> list[str]:
    """Namespaces left behind by the testbed process ``pid``."""
    return [ns for ns in netbed.list_namespaces() if ns.startswith(f"bitcollnet{pid}-")]


def _can_make_namespaces() -> str | None:
    """None if this process can build what the testbed needs (a namespace with a bridge, a
    veth pair and a tbf qdisc), else why not."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed"
    name = f"bitcollprobe{os.getpid()}"
    steps = [["ip", "netns", "add", name],
             ["ip", "-n", name, "link", "add", "b0", "type", "bridge"],
             ["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
             ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "v0", "root", "tbf",
              "rate", "1gbit", "burst", "262144", "latency", "50ms"]]
    try:
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                return f"`{' '.join(cmd)}` failed: {done.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


WHY_NOT = _can_make_namespaces()
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")


# ----------------------------------------------------------------------------- no privileges


def test_parse_rate() -> None:
    assert netbed.parse_rate("1gbit") == 10**9
    assert netbed.parse_rate("2.5Gbit") == 2_500_000_000
    assert netbed.parse_rate("100mbit") == 10**8
    assert netbed.parse_rate(" 1000kbit ") == 10**6
    for bad in ("", "1", "1gb", "fast", "-1gbit", "999kbit", "1 gbit"):
        with pytest.raises(ValueError):
            netbed.parse_rate(bad)


def test_default_burst_is_a_millisecond_of_traffic_at_least_256k() -> None:
    assert netbed.default_burst(10**9) == 256 << 10
    assert netbed.default_burst(10**10) == 1_250_000
    assert netbed.default_burst(10**6) == 256 << 10


def test_command_line_splits_at_the_script_or_module() -> None:
    ap = netbed.parser()
    args, target = netbed.parse_command_line(ap, ["--hosts", "3", "x.py", "--hosts", "9"])
    assert (args.hosts, target) == (3, ["x.py", "--hosts", "9"])
    args, target = netbed.parse_command_line(ap, ["--probe", "-m", "mod", "a", "--probe"])
    assert args.probe and target == ["-m", "mod", "a", "--probe"]
    args, target = netbed.parse_command_line(ap, ["--rate", "1gbit", "--probe"])
    assert (args.rate, target) == ("1gbit", [])
    args, target = netbed.parse_command_line(ap, ["--grace-period", "2", "--", "-x.py", "--"])
    assert (args.grace_period, target) == (2.0, ["-x.py", "--"])


def test_one_secret_for_the_whole_job() -> None:
    env = netbed.job_environment({"PATH": "/bin"})
    assert len(env["BITCOLL_SECRET"]) == 64 and env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert netbed.job_environment({})["BITCOLL_SECRET"] != env["BITCOLL_SECRET"]
    assert netbed.job_environment({"BITCOLL_SECRET": "s"})["BITCOLL_SECRET"] == "s"


def test_model_link_tells_the_cost_model_the_link() -> None:
    """``--model-link``: the link's rate (and half the round trip) as the cost model's
    variables, which the ranks' bitcoll.plan.load_model reads; the user's own stay."""
    from bitcoll.plan import load_model

    env = netbed.model_link({}, 0.96, 0.0)
    assert env == {"BITCOLL_COST_REMOTE_BANDWIDTH": "1.2e+08"}
    model = load_model({"BITCOLL_COST_MODEL": "/nonexistent/model.json", **env})
    assert model.remote_bandwidth == 1.2e8
    delayed = netbed.model_link({}, 0.1, 50.0)
    assert float(delayed["BITCOLL_COST_REMOTE_LATENCY"]) == 0.025
    assert float(delayed["BITCOLL_COST_REMOTE_BANDWIDTH"]) == 1.25e7
    assert "BITCOLL_COST_REMOTE_BANDWIDTH" not in netbed.model_link(
        {"BITCOLL_COST_REMOTE_BANDWIDTH": "5e8"}, 1.0, 0.0)
    shared = netbed.model_link({}, 10.0, 0.0, host_cores=0.5)
    assert load_model({"BITCOLL_COST_MODEL": "/nonexistent/model.json",
                       **shared}).host_cores == 0.5
    assert "BITCOLL_COST_HOST_CORES" not in netbed.model_link(
        {"BITCOLL_COST_HOST_CORES": "4"}, 10.0, 0.0, host_cores=0.5)
    ap = netbed.parser()
    args, _ = netbed.parse_command_line(ap, ["--model-link", "x.py"])
    assert args.model_link


def test_job_reports_the_host_that_failed_first(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # Plain processes stand in for the hosts' launchers (no namespaces needed). Hosts 0 and 2
    # fail too, but only on the SIGTERM that the supervisor sends after host 1 failed.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    late = ("import os, signal\n"
            "signal.signal(signal.SIGTERM, lambda s, f: os._exit(4))\n"
            f"open({str(fifo)!r}, 'w').write('ready\\n')\n"
            "while True:\n    signal.pause()\n")
    first = ("import os\n"
             f"f = os.fdopen(os.open({str(fifo)!r}, os.O_RDWR))\n"  # we write too: no EOF
             "f.readline(); f.readline()\n"
             "raise SystemExit(3)\n")
    job = netbed.Job([[PY, "-c", late], [PY, "-c", first], [PY, "-c", late]], dict(os.environ),
                     grace=5.0)
    assert job.run() == 3
    assert [p.returncode for p in job.supervisor.procs] == [4, 3, 4]
    err = capsys.readouterr().err
    assert err == "netbed: host 1 exited with status 3; stopped the other hosts\n"


def test_topology_names_and_commands() -> None:
    bed = netbed.Testbed(3, "1gbit", 300000, "bitcollnet12345")
    assert bed.namespaces() == ["bitcollnet12345-sw", "bitcollnet12345-h0",
                                "bitcollnet12345-h1", "bitcollnet12345-h2"]
    assert [bed.address(k) for k in range(3)] == ["10.99.0.1", "10.99.0.2", "10.99.0.3"]
    cmds = bed.setup_commands()
    shaped = [c for c in cmds if "tbf" in c]
    assert len(shaped) == 2 * 3  # both ends of every link
    assert all(c[c.index("rate") + 1] == "1gbit" and c[c.index("burst") + 1] == "300000"
               for c in shaped)
    # interface names are per namespace and within Linux's 15 characters
    links = [c[c.index("add") + 1] for c in cmds if c[3:5] == ["link", "add"]]
    assert links == ["sw", "h0", "h1", "h2"]
    job = netbed.host_command(bed, 2, 1, ["train.py", "--steps", "3"], 5.0)
    assert job[:4] == ["ip", "netns", "exec", "bitcollnet12345-h2"]
    assert job[-3:] == ["train.py", "--steps", "3"]
    def option(name: str) -> str:
        return job[job.index(name) + 1]
    assert option("--nnodes") == "3" and option("--node-rank") == "2"
    assert option("--master-addr") == "10.99.0.1" and option("-n") == "1"


def test_hosts_get_their_share_of_the_cores() -> None:
    assert [netbed.host_cpus(k, 4, [0, 1]) for k in range(4)] == [[0], [1], [0], [1]]
    assert [netbed.host_cpus(k, 2, [0, 1, 2, 3, 4]) for k in range(2)] == [[0, 1], [2, 3, 4]]
    assert [netbed.host_cpus(k, 3, [4, 5, 6]) for k in range(3)] == [[4], [5], [6]]


def test_helpers_pin_then_exec() -> None:
    core = sorted(os.sched_getaffinity(0))[-1]
    # the command goes on exactly as given, "--" included
    done = subprocess.run(netbed.helper("pin", str(core), PY, "-c",
                                        "import os, sys; print(sorted(os.sched_getaffinity(0)),"
                                        " sys.argv[1:])", "--", "-x"),
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"[{core}] ['--', '-x']"
    bad = subprocess.run(netbed.helper("pin", "x", "true"), capture_output=True, text=True,
                         timeout=30, check=False)
    assert bad.returncode == 2 and "comma list of cores" in bad.stderr
    assert netbed_helpers.parse_cpus("0,3") == [0, 3]
    for text in ("", "a", "1,-1"):
        with pytest.raises(ValueError):
            netbed_helpers.parse_cpus(text)


def test_helpers_probe_on_loopback() -> None:
    port = osu.free_port()
    server = subprocess.Popen(netbed.helper("probe-server", str(port)), stdout=subprocess.PIPE,
                              text=True)
    try:
        subprocess.run(netbed.helper("probe-client", "127.0.0.1", str(port), str(8 << 20)),
                       check=True, timeout=30)
        out, _ = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0 and float(out) > 0


@pytest.mark.parametrize("args, message", [
    ([], "give the script"),
    (["--hosts", "0", "x.py"], "--hosts must be in [1, 250]"),
    (["--rate", "fast", "x.py"], "rate must look like"),
    (["--nproc-per-host", "0", "x.py"], "--nproc-per-host must be >= 1"),
    (["--hosts", "1", "--probe", "x.py"], "--probe needs at least 2 hosts"),
    (["--burst", "100", "x.py"], "--burst must be at least one packet"),
    (["--rtt", "-1", "x.py"], "--rtt must be >= 0"),
    (["--loss", "1", "x.py"], "--loss needs --rtt"),
    (["--rtt", "10", "--loss", "100", "x.py"], "--loss in [0, 100)"),
])
def test_bad_options_exit_2_with_a_message(args: list[str], message: str) -> None:
    done = run(args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="checks the message for non-root users")
def test_not_root_is_a_usage_error() -> None:
    done = run(["x.py"])
    assert done.returncode == 2 and "run it as root" in done.stderr


# ------------------------------------------------------------------------- real namespaces


def run_bed(args: list[str], timeout: float = 150.0) -> tuple[int, str, str, int]:
    """Run the testbed; return (exit status, stdout, stderr, its pid)."""
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([PY, "bench/netbed.py", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err, proc.pid


@needs_netns
@pytest.mark.timeout(180)
def test_sign_allreduce_across_shaped_links_then_clean_up() -> None:
    rc, out, err, pid = run_bed(["--hosts", "3", "--rate", "1gbit",
                                 "bench/osu_sign_allreduce.py", "-m", "1001",
                                 "--compare-float32", "--check", *SMALL])
    assert rc == 0, out + err
    assert out.startswith("netbed: 3 hosts x 1 ranks, links 1gbit (tbf burst 262144), "
                          "bitcoll TCP, hosts pinned to their share of the cores")
    text = "\n".join(line.split("] ", 1)[1] if line.startswith("[rank") else line
                     for line in out.splitlines())
    tables = osu.parse_tables(text)
    assert [t.title for t in tables] == [  # one OSU-format table per variant
        f"OSU-style Sign Allreduce Test: bitcoll {v}, backend tcp, 3 ranks"
        for v in ("float32/allreduce", "majority/default")]
    assert all(t.rows and t.rows[0]["Avg Latency(us)"] > 0 for t in tables)
    assert ours(pid) == []


@needs_netns
@pytest.mark.timeout(180)
def test_delay_line_adds_its_round_trip_then_clean_up() -> None:
    """``--rtt 40``: the user-space switch delays every frame by 20 ms, so an 8-byte
    all-reduce between two hosts (one exchange) takes at least 20 ms, and every result is
    still checked; the switch and the namespaces are gone afterwards."""
    rc, out, err, pid = run_bed(["--hosts", "2", "--rate", "100mbit", "--rtt", "40",
                                 "bench/osu_allreduce.py", "-m", "8,4K", "--check", *SMALL])
    assert rc == 0, out + err
    assert "round trip 40 ms added in user space" in out.splitlines()[0]
    text = "\n".join(line.split("] ", 1)[1] if line.startswith("[rank") else line
                     for line in out.splitlines()[1:])
    (table,) = osu.parse_tables(text)
    assert [r["Size"] for r in table.rows] == [8, 4096]
    assert all(r["Avg Latency(us)"] >= 20_000 for r in table.rows)
    assert "frames forwarded, 0 dropped" in err
    assert ours(pid) == []


@needs_netns
@pytest.mark.timeout(120)
def test_links_are_shaped_hosts_pinned_stale_namespaces_removed(tmp_path: Path) -> None:
    # a namespace left by a testbed that was SIGKILLed (no process has a pid this large)
    stale = "bitcollnet99999999-sw"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    script = tmp_path / "cpus.py"
    script.write_text("import hashlib, os\n"
                      "print('cpus', sorted(os.sched_getaffinity(0)))\n"
                      "secret = os.environ['BITCOLL_SECRET'].encode()\n"
                      "print('secret', len(secret), hashlib.sha256(secret).hexdigest())\n")
    try:
        rc, out, err, pid = run_bed(["--hosts", "2", "--rate", "400mbit", "--probe",
                                     str(script)])
        assert stale not in netbed.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, check=False)
    assert rc == 0, out + err
    assert "netbed: removed the namespaces of earlier testbeds that no longer run: " in err
    assert stale in err
    usable = sorted(os.sched_getaffinity(0))
    for k in range(2):
        assert f"[rank {k}] cpus {netbed.host_cpus(k, 2, usable)}" in out
    secrets = {line.split("] ", 1)[1] for line in out.splitlines() if "] secret " in line}
    assert len(secrets) == 1 and secrets.pop().startswith("secret 64 ")  # one for both hosts

    line = next(ln for ln in out.splitlines() if ln.startswith("netbed: probe"))
    gbits = float(line.split(": ")[-1].split()[0])
    assert 0 < gbits <= 0.4 * 1.05, line  # tbf never lets TCP exceed the configured rate
    assert ours(pid) == []

    rc, out, err, pid = run_bed(["--hosts", "2", "--rate", "1gbit", "--probe"])  # probe only
    assert rc == 0, out + err
    assert "netbed: probe host 1 -> host 0: " in out and "[rank" not in out
    assert ours(pid) == []


@needs_netns
@pytest.mark.timeout(120)
def test_failing_host_stops_the_job_and_namespaces_go(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\n"
                      "import bitcoll\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    sys.exit(3)\n"
                      "bitcoll.init(timeout=60)  # waits for rank 1 until stopped\n")
    rc, out, err, pid = run_bed(["--hosts", "2", "--grace-period", "2", str(script)])
    assert rc == 3, out + err
    assert "rank 1" in err and "exited with status 3" in err
    assert "netbed: host 1 exited with status 3; stopped the other hosts" in err
    assert ours(pid) == []


def test_mpi_command_is_one_mpmd_mpiexec() -> None:
    bed = netbed.Testbed(2, "1gbit", 300000, "bitcollnet7")
    cmd = netbed.mpi_command(bed, "mpiexec", 2, ["x.py", "-v"], [[0], [1]])
    segments = " ".join(cmd[3:]).split(" : ")
    assert cmd[:3] == ["mpiexec", "-launcher", "fork"] and len(segments) == 2
    for k, seg in enumerate(segments):
        assert seg.startswith("-n 2 ")
        assert f" {k} ip netns exec bitcollnet7-h{k} {PY} x.py -v" in seg
    env = netbed.mpi_env({"UCX_TLS": "tcp"})
    assert env["UCX_TLS"] == "tcp" and env["MPIR_CVAR_NOLOCAL"] == "1"


@needs_netns
@pytest.mark.timeout(180)
def test_mpi_job_across_shaped_links() -> None:
    rc, out, err, pid = run_bed(["--mpi", "--hosts", "2", "--rate", "1gbit",
                                 "bench/osu_allreduce.py", "--impl", "mpi4py", "-m", "1K,64K",
                                 "--check", *SMALL])
    assert rc == 0, out + err
    assert out.startswith("netbed: 2 hosts x 1 ranks, links 1gbit (tbf burst 262144), "
                          "mpiexec (MPICH over TCP)")
    (table,) = osu.parse_tables(out)
    assert "2 ranks" in table.title
    assert [r["Size"] for r in table.rows] == [1024, 65536]
    assert ours(pid) == []
