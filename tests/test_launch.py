"""The launcher (``python -m launch`` / ``bitcoll-run``): real child processes, tiny scripts."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launch.__main__ import (
    JobEnv,
    LaunchConfig,
    child_env,
    describe_exit,
    exit_status,
    job_env,
    parse_args,
    parse_ranks,
)

LAUNCH = [sys.executable, "-m", "launch"]


def _script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _run(args: list[str], timeout: float = 60,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# --------------------------------------------------------------------------------------------
# The command line and the environment contract (in-process)
# --------------------------------------------------------------------------------------------


def test_parse_script_and_module_targets() -> None:
    cfg = parse_args(["-n", "4", "--master-port", "1234", "train.py", "-n", "9", "--lr=1"],
                     environ={})
    assert (cfg.nproc_per_node, cfg.master_port, cfg.script) == (4, 1234, "train.py")
    assert cfg.args == ["-n", "9", "--lr=1"]  # everything after the script is the script's
    assert cfg.command() == [sys.executable, "train.py", "-n", "9", "--lr=1"]
    assert cfg.bitcoll_master_port == 1235
    cfg = parse_args(["--nproc-per-node=2", "-m", "pkg.mod", "-x"], environ={})
    assert (cfg.module, cfg.args, cfg.script) == ("pkg.mod", ["-x"], None)
    assert cfg.command() == [sys.executable, "-m", "pkg.mod", "-x"]
    assert cfg.bitcoll_master_port is None and cfg.prefix and cfg.output_ranks is None
    cfg = parse_args(["-n", "1", "--module", "pkg", "-m", "x", "--no-prefix"], environ={})
    assert (cfg.module, cfg.args, cfg.prefix) == ("pkg", ["-m", "x", "--no-prefix"], True)
    cfg = parse_args(["-n", "1", "--", "-weird-name.py"], environ={})
    assert cfg.script == "-weird-name.py"
    cfg = parse_args(["-n", "1", "x.py", "--", "--", "a"], environ={})  # '--' is the script's
    assert (cfg.script, cfg.args) == ("x.py", ["--", "--", "a"])
    cfg = parse_args(["--no-prefix", "-n", "4", "--output-ranks", "0,2-3", "x.py",
                      "--output-ranks", "1"], environ={})
    assert (cfg.prefix, cfg.output_ranks, cfg.args) == (False, frozenset({0, 2, 3}),
                                                            ["--output-ranks", "1"])
    cfg = parse_args(["-n", "2", "--master-port", "65535", "x.py"],
                     environ={"BITCOLL_MASTER_PORT": "4000"})  # the environment's port wins
    assert cfg.bitcoll_master_port == 4000


def test_parse_ranks() -> None:
    assert parse_ranks("0") == {0}
    assert parse_ranks("0,2, 5-7") == {0, 2, 5, 6, 7}
    for bad in ("", "a", "1,", "3-1", "-1", "1-2-3"):
        with pytest.raises(ValueError):
            parse_ranks(bad)


@pytest.mark.parametrize("argv, environ", [
    (["-n", "0", "x.py"], {}), (["x.py"], {}), (["-n", "2"], {}),
    (["-n", "2", "--nnodes", "2", "x.py"], {}), (["-n", "2", "--node-rank", "1", "x.py"], {}),
    (["-n", "2", "--master-port", "70000", "x.py"], {}), (["-n", "2", "-m"], {}),
    (["-n", "2", "--master-port", "65535", "x.py"], {}),  # no room for BITCOLL_MASTER_PORT
    (["-n", "2", "x.py"], {"BITCOLL_MASTER_PORT": "x"}),
    (["-n", "2", "x.py"], {"BITCOLL_MASTER_PORT": "70000"}),
    (["-n", "2", "--master-port", "5000", "x.py"], {"BITCOLL_MASTER_PORT": "5000"}),
    (["-n", "2", "--output-ranks", "2", "x.py"], {}),  # outside the world of 2
    (["-n", "2", "--output-ranks", "zero", "x.py"], {}),
    (["-n", "2", "--bogus", "x.py"], {}), (["--nproc", "2", "x.py"], {}),  # no abbreviations
])
def test_bad_command_lines_exit_2(argv: list[str], environ: dict[str, str],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv, environ=environ)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_child_env_follows_the_torchrun_contract() -> None:
    cfg = LaunchConfig(nproc_per_node=4, nnodes=3, node_rank=2, master_addr="10.0.0.1",
                       master_port=29500, script="x.py")
    job = JobEnv(29500, 29501, secret=None)
    env = child_env(cfg, 1, job, base={"PATH": "/bin", "PYTHONUNBUFFERED": "0",
                                       "BITCOLL_SECRET": "given"})
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT", "BITCOLL_MASTER_PORT")} == {
        "RANK": "9", "WORLD_SIZE": "12", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "BITCOLL_MASTER_PORT": "29501"}
    assert env["PATH"] == "/bin" and env["PYTHONUNBUFFERED"] == "0"  # kept when already set
    assert env["BITCOLL_SECRET"] == "given"  # passed through
    env = child_env(cfg, 0, JobEnv(1, 2, secret="ab" * 32), base={"BITCOLL_SECRET": "old"})
    assert env["BITCOLL_SECRET"] == "ab" * 32 and env["PYTHONUNBUFFERED"] == "1"
    assert "ab" * 32 not in repr(JobEnv(1, 2, secret="ab" * 32))


def test_job_env_ports_and_secret() -> None:
    one = LaunchConfig(nproc_per_node=2, script="x.py")
    job = job_env(one, environ={})
    assert job.master_port != job.bitcoll_master_port
    assert all(0 < p < 65536 for p in (job.master_port, job.bitcoll_master_port))
    assert job.secret is not None and len(job.secret) == 64
    assert int(job.secret, 16) >= 0 and job_env(one, environ={}).secret != job.secret
    assert job_env(one, environ={"BITCOLL_SECRET": "mine"}).secret is None  # user's wins
    fixed = parse_args(["-n", "2", "--master-port", "29500", "x.py"], environ={})
    job = job_env(fixed, environ={})
    assert (job.master_port, job.bitcoll_master_port) == (29500, 29501)
    env_port = parse_args(["-n", "2", "x.py"], environ={"BITCOLL_MASTER_PORT": "29777"})
    job = job_env(env_port, environ={})
    assert job.bitcoll_master_port == 29777 and job.master_port != 29777
    multi = parse_args(["-n", "2", "--nnodes", "2", "--master-port", "29500", "x.py"],
                       environ={})
    job = job_env(multi, environ={})
    assert (job.master_port, job.bitcoll_master_port, job.secret) == (29500, 29501, None)


def test_exit_status_and_description() -> None:
    assert exit_status(0) == 0 and exit_status(3) == 3
    assert exit_status(-signal.SIGKILL) == 137
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"


# --------------------------------------------------------------------------------------------
# Real runs
# --------------------------------------------------------------------------------------------

def _env(**extra: str) -> dict[str, str]:
    """Our environment without the job variables a launcher might have left, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("BITCOLL_SECRET", "BITCOLL_MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(extra)
    return env


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


_ENV_SCRIPT = """
    import hashlib, json, os, sys
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "BITCOLL_MASTER_PORT"]
    secret = os.environ["BITCOLL_SECRET"]
    if os.environ["RANK"] == "0":  # where the test can see it; never printed
        with open(os.path.join(os.path.dirname(__file__), "secret"), "w") as f:
            f.write(secret)
    print(json.dumps({k: os.environ[k] for k in keys} | {
        "argv": sys.argv[1:], "exe": sys.executable,
        "secret_sha": hashlib.sha256(secret.encode()).hexdigest()}))
    print("to stderr", os.environ["RANK"], file=sys.stderr)
    print("no newline at the end", end="")
"""


def _check_env_run(proc: subprocess.CompletedProcess[str], n: int, argv: list[str],
                   secret: str) -> None:
    assert proc.returncode == 0, proc.stderr
    seen: dict[int, dict[str, object]] = {}
    tails = set()
    for line in proc.stdout.splitlines():
        assert line.startswith("[rank "), line
        prefix, _, rest = line.partition("] ")
        rank = int(prefix[len("[rank "):])
        if rest.startswith("{"):
            seen[rank] = json.loads(rest)
        else:
            assert rest == "no newline at the end"
            tails.add(rank)
    assert sorted(seen) == list(range(n)) and tails == set(range(n))
    (port,) = {d["MASTER_PORT"] for d in seen.values()}
    (bitcoll_port,) = {d["BITCOLL_MASTER_PORT"] for d in seen.values()}
    assert 0 < int(str(port)) < 65536 and 0 < int(str(bitcoll_port)) < 65536
    assert port != bitcoll_port  # torch.distributed and bitcoll can share a script
    assert {d["secret_sha"] for d in seen.values()} == {_sha(secret)}  # one secret per job
    assert secret not in proc.stdout + proc.stderr
    for r, d in seen.items():
        assert d["RANK"] == d["LOCAL_RANK"] == str(r)
        assert d["WORLD_SIZE"] == d["LOCAL_WORLD_SIZE"] == str(n)
        assert d["MASTER_ADDR"] == "127.0.0.1"
        assert d["argv"] == argv
        assert d["exe"] == sys.executable
    err = sorted(line for line in proc.stderr.splitlines() if "to stderr" in line)
    assert err == [f"[rank {r}] to stderr {r}" for r in range(n)]


@pytest.mark.timeout(60)
def test_three_ranks_get_their_environment_and_prefixed_output(tmp_path: Path) -> None:
    script = _script(tmp_path, _ENV_SCRIPT)
    proc = _run([*LAUNCH, "-n", "3", str(script), "a", "--flag", "-n", "7"], env=_env())
    secret = (tmp_path / "secret").read_text()
    assert len(secret) == 64 and int(secret, 16) >= 0  # generated: 32 random bytes in hex
    _check_env_run(proc, 3, ["a", "--flag", "-n", "7"], secret)


@pytest.mark.timeout(60)
def test_console_script_and_module_form(tmp_path: Path) -> None:
    _script(tmp_path, _ENV_SCRIPT, name="envmod.py")
    exe = Path(sys.executable).with_name("bitcoll-run")
    assert exe.exists(), "the bitcoll-run console script is not installed"
    env = _env(PYTHONPATH=str(tmp_path), BITCOLL_SECRET="the user's own secret")
    proc = _run([str(exe), "-n", "2", "-m", "envmod", "x", "--", "-m"], env=env)
    _check_env_run(proc, 2, ["x", "--", "-m"], "the user's own secret")  # passed through


#: Ranks other than ``WAITER`` write their pid to ``pid<rank>`` and a line to the FIFO once
#: ready (after SETUP); the waiter writes its pid and reads one line per other rank, so it
#: acts only when all of them are ready. No sleeps: the FIFO orders the events.
_READY = """
    import os, signal, sys
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    here = os.path.dirname(__file__)
    with open(os.path.join(here, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    def ready():
        with open(os.path.join(here, "fifo"), "w") as f:
            f.write(f"{rank}\\n")
    def wait_for_the_others():
        fd = os.open(os.path.join(here, "fifo"), os.O_RDWR)  # never EOF: we hold a writer
        with os.fdopen(fd) as f:
            for _ in range(size - 1):
                f.readline()
"""


def _ready_script(tmp_path: Path, body: str) -> Path:
    """Write ``tmp_path/job.py``, a rank script running :data:`_READY` then ``body``, and
    create the FIFO ``tmp_path/fifo`` that :data:`_READY` synchronises on; return the script's
    path. ``body`` is indented like :data:`_READY` (the script is dedented as a whole)."""
    os.mkfifo(tmp_path / "fifo")
    return _script(tmp_path, _READY + body)


@pytest.mark.timeout(120)
def test_ranks_of_one_host_share_its_cores_for_the_kernels(tmp_path: Path) -> None:
    """3 ranks launched without NUMBA_NUM_THREADS: after bitcoll.init each rank's kernels
    use the host's usable cores divided by 3 (at least 1, at most numba's pool), not one
    thread per core each; with NUMBA_NUM_THREADS set, numba's count stays."""
    script = _script(tmp_path, """
    import numba
    import bitcoll
    import bitcoll.kernels as K

    pool = numba.config.NUMBA_NUM_THREADS
    with bitcoll.init("tcp") as comm:
        want = max(1, min(pool, K.usable_cores() // 3)) if comm.local_size == 3 else -1
        print("threads", K.get_num_threads(), want, pool, flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    proc = _run([*LAUNCH, "-n", "3", str(script)], timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = re.findall(r"threads (\d+) (-?\d+) (\d+)", proc.stdout)
    assert len(lines) == 3, proc.stdout
    assert all(got == want for got, want, _ in lines), lines
    proc = _run([*LAUNCH, "-n", "3", str(script)], timeout=100,
                env={**env, "NUMBA_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("threads 1 1 1") == 3, proc.stdout


@pytest.mark.timeout(60)
def test_failing_rank_stops_the_others_and_sets_the_exit_status(tmp_path: Path) -> None:
    script = _ready_script(tmp_path, """
    if rank == 1:
        wait_for_the_others()
        print("rank one gives up", flush=True)
        sys.exit(3)
    ready()
    signal.pause()  # until the launcher stops us
    """)
    proc = _run([*LAUNCH, "-n", "3", str(script)])
    assert proc.returncode == 3
    assert "[rank 1] rank one gives up" in proc.stdout
    assert "launch: rank 1 (pid " in proc.stderr
    assert "exited with status 3; terminated the other ranks" in proc.stderr
    for r in range(3):
        assert _dead(int((tmp_path / f"pid{r}").read_text()))


@pytest.mark.timeout(60)
def test_the_rank_that_fails_first_in_time_is_reported(tmp_path: Path) -> None:
    # Ranks 0 and 2 fail too (status 4), but only when the launcher's SIGTERM tells them that
    # rank 1 has failed: the report and the exit status must be rank 1's, not rank 0's.
    script = _ready_script(tmp_path, """
    def fail_late(signum, frame):
        print(f"rank {rank} got SIGTERM, fails with status 4", flush=True)
        os._exit(4)
    if rank == 1:
        wait_for_the_others()
        os._exit(3)
    signal.signal(signal.SIGTERM, fail_late)
    ready()
    while True:
        signal.pause()
    """)
    proc = _run([*LAUNCH, "-n", "3", str(script)])
    assert proc.returncode == 3, proc.stderr
    assert "[rank 0] rank 0 got SIGTERM, fails with status 4" in proc.stdout
    assert "[rank 2] rank 2 got SIGTERM, fails with status 4" in proc.stdout
    (report,) = [line for line in proc.stderr.splitlines() if line.startswith("launch:")]
    assert report.startswith("launch: rank 1 (pid ")
    assert report.endswith("exited with status 3; terminated the other ranks")


@pytest.mark.timeout(60)
def test_rank_killed_by_a_signal_is_reported(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os, signal
        if os.environ["RANK"] == "2":
            os.kill(os.getpid(), signal.SIGKILL)
        signal.pause()
    """)
    proc = _run([*LAUNCH, "-n", "3", str(script)])
    assert proc.returncode == 128 + signal.SIGKILL
    assert "launch: rank 2 (pid " in proc.stderr
    assert "was killed by SIGKILL; terminated the other ranks" in proc.stderr


@pytest.mark.timeout(120)
def test_survivors_of_a_killed_rank_print_their_own_errors(tmp_path: Path) -> None:
    """Rank 2 of a bitcoll job is SIGKILLed inside a collective: the launcher gives the other
    ranks a moment before it terminates them, and each prints its own PeerLostError naming
    rank 2."""
    script = _script(tmp_path, """
    import os, signal
    import numpy as np
    import bitcoll

    comm = bitcoll.init("tcp", timeout=60)
    comm.allreduce(np.ones(8, np.float32))
    if comm.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.allreduce(np.ones(8, np.float32))
    except bitcoll.BitcollError as exc:
        print(f"rank {comm.rank} caught {type(exc).__name__}: {exc}", flush=True)
        raise SystemExit(1)
    """)
    proc = _run([*LAUNCH, "-n", "3", str(script)], timeout=100)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "launch: rank 2 (pid " in proc.stderr and "was killed by SIGKILL" in proc.stderr
    for r in (0, 1):
        caught = [line for line in proc.stdout.splitlines()
                  if line.startswith(f"[rank {r}] rank {r} caught PeerLostError")]
        assert caught and "rank 2" in caught[0], proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_a_usage_error_of_every_rank_is_shown_once(tmp_path: Path) -> None:
    """A mistyped option of the script: every rank prints the same usage message and exits
    2; the launcher shows it once and says so. Lines that differ are all shown."""
    script = _script(tmp_path, """
    import argparse, os, sys
    p = argparse.ArgumentParser(prog="job.py")
    p.add_argument("--lr", type=float)
    p.add_argument("--differ", action="store_true")
    args = p.parse_args()
    print("same line", file=sys.stderr)
    print(f"rank {os.environ['RANK']} differs", file=sys.stderr)
    """)
    proc = _run([*LAUNCH, "-n", "3", str(script), "--lrr", "1"])
    assert proc.returncode == 2, proc.stderr
    usage = [line for line in proc.stderr.splitlines() if "usage: job.py" in line]
    errors = [line for line in proc.stderr.splitlines() if "unrecognized arguments" in line]
    assert len(usage) == 1 and len(errors) == 1, proc.stderr
    proc = _run([*LAUNCH, "-n", "3", str(script), "--differ"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert sorted(line for line in lines if "differs" in line) == [
        f"[rank {r}] rank {r} differs" for r in range(3)], proc.stderr
    assert sum("same line" in line for line in lines) == 3, proc.stderr


@pytest.mark.timeout(60)
def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    script = _ready_script(tmp_path, """
    if rank == 0:
        wait_for_the_others()
        sys.exit(5)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready()
    while True:
        signal.pause()
    """)
    proc = _run([*LAUNCH, "--grace-period", "0.5", "-n", "2", str(script)])
    assert proc.returncode == 5
    assert "launch: rank 0 (pid " in proc.stderr and "exited with status 5" in proc.stderr
    assert _dead(int((tmp_path / "pid1").read_text()))


_CHATTY = """
    import os, sys
    rank = os.environ["RANK"]
    print(f"out {rank}")
    print(f"err {rank}", file=sys.stderr)
    if rank == "1":  # far more than a pipe holds: must not block although nobody shows it
        for _ in range(64):
            sys.stdout.write("x" * 32767 + "\\n")
            sys.stderr.write("y" * 32767 + "\\n")
"""


@pytest.mark.timeout(60)
def test_no_prefix_and_output_ranks(tmp_path: Path) -> None:
    script = _script(tmp_path, _CHATTY)
    proc = _run([*LAUNCH, "-n", "3", "--no-prefix", "--output-ranks", "0,2", str(script)])
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["out 0", "out 2"]
    assert sorted(proc.stderr.splitlines()) == ["err 0", "err 2"]
    proc = _run([*LAUNCH, "-n", "2", "--no-prefix", str(script)])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert {"out 0", "out 1"} <= set(lines) and len(lines) == 2 + 64  # whole lines, bare
    assert all(ln in ("out 0", "out 1") or ln == "x" * 32767 for ln in lines)
    proc = _run([*LAUNCH, "-n", "3", "--output-ranks", "1", str(script)])
    assert proc.returncode == 0, proc.stderr
    assert {ln.partition("] ")[0] for ln in proc.stdout.splitlines()} == {"[rank 1"}


@pytest.mark.timeout(60)
def test_hidden_rank_failure_is_still_reported(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os, signal, sys
        if os.environ["RANK"] == "1":
            print("hidden traceback", file=sys.stderr)
            sys.exit(3)
        signal.pause()
    """)
    proc = _run([*LAUNCH, "-n", "2", "--output-ranks", "0", str(script)])
    assert proc.returncode == 3
    assert "hidden" not in proc.stdout + proc.stderr
    assert "launch: rank 1 (pid " in proc.stderr and "exited with status 3" in proc.stderr


def test_help_is_the_manual() -> None:
    proc = _run([*LAUNCH, "--help"])
    assert proc.returncode == 0
    for text in ("--no-prefix", "--output-ranks", "BITCOLL_MASTER_PORT", "BITCOLL_SECRET",
                 "--master-port + 1", "Failure handling"):
        assert text in proc.stdout


@pytest.mark.timeout(60)
def test_sigterm_to_the_launcher_is_forwarded(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os, signal, sys, time
        def bye(signum, frame):
            print("got", signal.Signals(signum).name, flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("ready", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([*LAUNCH, "-n", "2", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready = 0
    while ready < 2:
        line = proc.stdout.readline()
        assert line, "the launcher ended early"
        ready += line.endswith("ready\n")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM
    assert sorted(line for line in out.splitlines() if "got" in line) == [
        "[rank 0] got SIGTERM", "[rank 1] got SIGTERM"]
    assert "received SIGTERM" in err
