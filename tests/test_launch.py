"""The launcher (``python -m launch`` / ``bitcoll-run``): real child processes, tiny scripts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launch.__main__ import LaunchConfig, child_env, describe_exit, exit_status, parse_args

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
    cfg = parse_args(["-n", "4", "--master-port", "1234", "train.py", "-n", "9", "--lr=1"])
    assert (cfg.nproc_per_node, cfg.master_port, cfg.script) == (4, 1234, "train.py")
    assert cfg.args == ["-n", "9", "--lr=1"]  # everything after the script is the script's
    assert cfg.command() == [sys.executable, "train.py", "-n", "9", "--lr=1"]
    cfg = parse_args(["--nproc-per-node=2", "-m", "pkg.mod", "-x"])
    assert (cfg.module, cfg.args, cfg.script) == ("pkg.mod", ["-x"], None)
    assert cfg.command() == [sys.executable, "-m", "pkg.mod", "-x"]
    cfg = parse_args(["-n", "1", "--", "-weird-name.py"])
    assert cfg.script == "-weird-name.py"


@pytest.mark.parametrize("argv", [
    ["-n", "0", "x.py"], ["x.py"], ["-n", "2"], ["-n", "2", "--nnodes", "2", "x.py"],
    ["-n", "2", "--node-rank", "1", "x.py"], ["-n", "2", "--master-port", "70000", "x.py"],
    ["-n", "2", "-m"],
])
def test_bad_command_lines_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2


def test_child_env_follows_the_torchrun_contract() -> None:
    cfg = LaunchConfig(nproc_per_node=4, nnodes=3, node_rank=2, master_addr="10.0.0.1",
                       master_port=29500, script="x.py")
    env = child_env(cfg, 1, 29500, base={"PATH": "/bin", "PYTHONUNBUFFERED": "0"})
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "9", "WORLD_SIZE": "12", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert env["PATH"] == "/bin" and env["PYTHONUNBUFFERED"] == "0"  # kept when already set


def test_exit_status_and_description() -> None:
    assert exit_status(0) == 0 and exit_status(3) == 3
    assert exit_status(-signal.SIGKILL) == 137
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"


# --------------------------------------------------------------------------------------------
# Real runs
# --------------------------------------------------------------------------------------------

_ENV_SCRIPT = """
    import json, os, sys
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT"]
    print(json.dumps({k: os.environ[k] for k in keys} | {"argv": sys.argv[1:],
                                                         "exe": sys.executable}))
    print("to stderr", os.environ["RANK"], file=sys.stderr)
    print("no newline at the end", end="")
"""


def _check_env_run(proc: subprocess.CompletedProcess[str], n: int, argv: list[str]) -> None:
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
    ports = {d["MASTER_PORT"] for d in seen.values()}
    assert len(ports) == 1 and 0 < int(str(ports.pop())) < 65536
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
    proc = _run([*LAUNCH, "-n", "3", str(script), "a", "--flag", "-n", "7"])
    _check_env_run(proc, 3, ["a", "--flag", "-n", "7"])


@pytest.mark.timeout(60)
def test_console_script_and_module_form(tmp_path: Path) -> None:
    _script(tmp_path, _ENV_SCRIPT, name="envmod.py")
    exe = Path(sys.executable).with_name("bitcoll-run")
    assert exe.exists(), "the bitcoll-run console script is not installed"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = _run([str(exe), "-n", "2", "-m", "envmod", "x"], env=env)
    _check_env_run(proc, 2, ["x"])


@pytest.mark.timeout(60)
def test_failing_rank_stops_the_others_and_sets_the_exit_status(tmp_path: Path) -> None:
    script = _script(tmp_path, f"""
        import os, sys, time
        rank = int(os.environ["RANK"])
        open(os.path.join({str(tmp_path)!r}, f"pid{{rank}}"), "w").write(str(os.getpid()))
        if rank == 1:
            time.sleep(0.5)
            print("rank one gives up", flush=True)
            sys.exit(3)
        time.sleep(120)
    """)
    t0 = time.monotonic()
    proc = _run([*LAUNCH, "-n", "3", str(script)])
    assert time.monotonic() - t0 < 20
    assert proc.returncode == 3
    assert "[rank 1] rank one gives up" in proc.stdout
    assert "launch: rank 1 (pid " in proc.stderr
    assert "exited with status 3; terminated the other ranks" in proc.stderr
    for r in range(3):
        assert _dead(int((tmp_path / f"pid{r}").read_text()))


@pytest.mark.timeout(60)
def test_rank_killed_by_a_signal_is_reported(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os, signal, time
        if os.environ["RANK"] == "2":
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    """)
    t0 = time.monotonic()
    proc = _run([*LAUNCH, "-n", "3", str(script)])
    assert time.monotonic() - t0 < 20
    assert proc.returncode == 128 + signal.SIGKILL
    assert "launch: rank 2 (pid " in proc.stderr
    assert "was killed by SIGKILL; terminated the other ranks" in proc.stderr


@pytest.mark.timeout(60)
def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os, signal, sys, time
        if os.environ["RANK"] == "0":
            time.sleep(0.3)
            sys.exit(5)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        time.sleep(120)
    """)
    t0 = time.monotonic()
    proc = _run([*LAUNCH, "--grace-period", "0.5", "-n", "2", str(script)])
    assert time.monotonic() - t0 < 20
    assert proc.returncode == 5
    assert "launch: rank 0 (pid " in proc.stderr and "exited with status 5" in proc.stderr


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
