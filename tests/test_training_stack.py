"""bitcoll where training jobs already run: torchrun, torch.distributed beside it, Slurm's
environment, stores passed in, and the misuses of each (clear errors, deadlines honoured)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from errcheck import raises_usage
from tcp_world import free_port

import bitcoll
from bitcoll.bootstrap import expand_hostlist, tcp_environment

SCRIPT = Path(__file__).parent / "scripts" / "stack_job.py"
BIN = Path(sys.executable).parent
TORCHRUN = BIN / "torchrun"
MPIEXEC = BIN / "mpiexec"

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "BITCOLL_MASTER_PORT", "BITCOLL_SECRET",
                "BITCOLL_INSECURE", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID",
                "SLURM_NTASKS", "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_ID",
                "SLURM_STEPID", "BITCOLL_RENDEZVOUS_TIMEOUT", "PMI_RANK", "PMI_SIZE",
                "BITCOLL_TORCH_TRANSPORT")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update({"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONFAULTHANDLER": "1"})  # an abort prints every thread's stack
    env.update(extra)
    return env


def _run(cmd: list[str], n: int, backend: str, env: dict[str, str] | None = None,
         timeout: float = 150) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         env=_env() if env is None else env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    for r in range(n):
        assert f"rank {r}/{n} backend={backend} ok" in out.stdout, text[-6000:]
    return text


# ---------------------------------------------------------------- torchrun


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["bitcoll-first"])
def test_torchrun_single_node(mode: str) -> None:
    """bitcoll initialised before gloo under torchrun (the other order runs under mpiexec and
    in the two-node torchrun test). "bitcoll-first" is also bitcoll alone under torchrun:
    ``bitcoll.init`` connects to the agent store before torch.distributed exists in the
    process, exactly as a job without torch.distributed does (a separate run of that mode,
    every check but gloo's, would add only another start of torchrun and three ranks)."""
    _run([str(TORCHRUN), "--nproc-per-node", "3", str(SCRIPT), mode], 3, "tcp")


@pytest.mark.timeout(200)
def test_torchrun_two_nodes_c10d() -> None:
    port = free_port()
    cmd = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "stack-test"]
    procs = [subprocess.Popen([*cmd, "--node-rank", str(k), str(SCRIPT), "gloo-first"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env()) for k in range(2)]
    outs = [p.communicate(timeout=150)[0] for p in procs]
    for p, text in zip(procs, outs, strict=True):
        assert p.returncode == 0, text[-6000:]
    joined = "".join(outs)
    assert "rank 0/2 backend=tcp ok" in joined and "rank 1/2 backend=tcp ok" in joined, joined


# ---------------------------------------------------------------- beside torch.distributed


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["bitcoll-first", "store"])
def test_launcher_beside_gloo(mode: str) -> None:
    """Under the launcher: bitcoll first, and bitcoll on torch's store (gloo first runs under
    mpiexec and torchrun)."""
    _run([sys.executable, "-m", "launch", "-n", "3", str(SCRIPT), mode], 3, "tcp")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["gloo-first"])
def test_mpiexec_beside_gloo(mode: str) -> None:
    """Under mpiexec, gloo initialised first (bitcoll first runs under torchrun and the
    launcher)."""
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    _run([str(MPIEXEC), "-n", "3", sys.executable, str(SCRIPT), mode], 3, "mpi", env)


# ---------------------------------------------------------------- the "bitcoll" torch backend


@pytest.mark.timeout(200)
def test_torchrun_bitcoll_backend() -> None:
    """``init_process_group("bitcoll")`` (env://) under torchrun: all_reduce, broadcast and
    barrier over bitcoll's TCP transport."""
    _run([str(TORCHRUN), "--nproc-per-node", "2", str(SCRIPT), "torch-backend"], 2, "tcp")


@pytest.mark.timeout(200)
def test_mpiexec_bitcoll_backend_mpi_transport() -> None:
    """``init_process_group("bitcoll")`` under mpiexec with ``BITCOLL_TORCH_TRANSPORT=mpi``
    (tcp:// rendezvous, torch's ranks the MPI ranks): the default group's communicator is an
    MPI one, and all_reduce, broadcast and barrier run on it."""
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               BITCOLL_TORCH_TRANSPORT="mpi")
    _run([str(MPIEXEC), "-n", "2", sys.executable, str(SCRIPT), "torch-backend"], 2, "mpi",
         env)


# ---------------------------------------------------------------- the environment contract


def test_torchrun_contract_port_rule() -> None:
    base = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
    te = tcp_environment(base)
    assert (te.rank, te.size, te.master_addr, te.master_port) == (1, 4, "10.1.2.3", 29501)
    assert not te.agent_store and te.source == "torchrun contract"
    te = tcp_environment({**base, "BITCOLL_MASTER_PORT": "31000"})
    assert te.master_port == 31000
    te = tcp_environment({**base, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert te.agent_store and te.master_port is None
    # An explicit bitcoll port wins over the agent store.
    te = tcp_environment({**base, "TORCHELASTIC_USE_AGENT_STORE": "True",
                          "BITCOLL_MASTER_PORT": "31000"})
    assert not te.agent_store and te.master_port == 31000
    te = tcp_environment({"RANK": "0", "WORLD_SIZE": "2"}, external_store=True)
    assert te.master_port is None


def test_slurm_contract() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-08,10],login1", "SLURM_JOB_ID": "123456"}
    te = tcp_environment(env)
    assert (te.rank, te.size, te.master_addr) == (5, 8, "gpu07")
    assert te.master_port == 20000 + 123456 % 20000 and te.source == "Slurm"
    assert tcp_environment({**env, "MASTER_PORT": "4000"}).master_port == 4001
    assert tcp_environment({**env, "BITCOLL_MASTER_PORT": "4000"}).master_port == 4000
    assert tcp_environment({**env, "MASTER_ADDR": "head"}).master_addr == "head"
    # The torchrun variables take precedence over Slurm's.
    te = tcp_environment({**env, "RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "a",
                          "MASTER_PORT": "100"})
    assert (te.rank, te.size, te.master_addr, te.source) == (2, 4, "a", "torchrun contract")


def test_detect_backend_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in _LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    assert bitcoll.detect_backend() == "local"
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    assert bitcoll.detect_backend() == "tcp"


def test_expand_hostlist() -> None:
    assert expand_hostlist("n1") == ["n1"]
    assert expand_hostlist("node[01-03,07],gpu1") == ["node01", "node02", "node03", "node07",
                                                      "gpu1"]
    assert expand_hostlist("r[8-10]-ib,x[2]") == ["r8-ib", "r9-ib", "r10-ib", "x2"]
    for bad in ("n[1-", "n]1[", "n[a-b]", ""):
        with pytest.raises(bitcoll.UsageError):
            expand_hostlist(bad)


def test_environment_errors() -> None:
    with pytest.raises(bitcoll.UsageError, match="SLURM_PROCID"):
        tcp_environment({})
    with raises_usage("RANK"):
        tcp_environment({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a",
                         "MASTER_PORT": "1"})
    with raises_usage("RANK"):  # (2 is not in [0, 2))
        tcp_environment({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a",
                         "MASTER_PORT": "1"})
    with raises_usage("MASTER_PORT"):  # (MASTER_PORT + 1 is not a port)
        tcp_environment({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a",
                         "MASTER_PORT": "65535"})
    with raises_usage("MASTER_PORT"):
        tcp_environment({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a"})


# ---------------------------------------------------------------- misuse: clear errors


def test_init_rejects_a_non_mpi_comm() -> None:
    with raises_usage("comm"):
        bitcoll.init(comm=object())
    with raises_usage("backend"):
        bitcoll.init("tcp", comm=object())


def test_init_rejects_a_store_missing_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    class Half:
        def set(self, key: str, value: bytes) -> None: ...

        def get(self, key: str) -> bytes:
            return b""

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with raises_usage("store", match="lacks add, wait"):  # the message names what is missing
        bitcoll.init(store=Half())
    with raises_usage("backend"):
        bitcoll.init("mpi", store=Half())


@pytest.mark.timeout(60)
def test_stale_torchrun_variables_honour_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in _LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    port = free_port()  # nobody listens there
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    with pytest.raises(bitcoll.CommTimeoutError, match="agent store"):
        bitcoll.init(timeout=2.0)
    assert time.monotonic() - t0 < 30


def test_slurm_without_srun_is_named() -> None:
    """An sbatch script that forgot srun has Slurm's variables but no srun step: the
    environment says so (and where the world size came from); a real srun step does not."""
    from bitcoll.bootstrap import slurm_without_srun

    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_JOB_ID": "77"}
    te = tcp_environment(env)
    assert te.size_from == "SLURM_NTASKS=4 (Slurm)"
    assert "not started by srun" in te.warning and "other 3 tasks" in te.warning
    assert "SLURM_STEP_ID is not set" in slurm_without_srun(env)
    batch = slurm_without_srun({**env, "SLURM_STEP_ID": str(0xFFFFFFFB)})  # the batch step
    assert "is no srun step" in batch
    for step in ({"SLURM_STEP_ID": "0"}, {"SLURM_STEPID": "12"}):
        assert slurm_without_srun({**env, **step}) == ""
        assert tcp_environment({**env, **step}).warning == ""
    assert slurm_without_srun({**env, "SLURM_NTASKS": "1"}) == ""  # one task: nothing missing
    te = tcp_environment({"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "a",
                          "MASTER_PORT": "100"})
    assert te.size_from == "WORLD_SIZE=3 (torchrun contract)" and te.warning == ""


def test_rendezvous_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from bitcoll.config import DEFAULT_RENDEZVOUS_TIMEOUT, rendezvous_timeout

    monkeypatch.delenv("BITCOLL_RENDEZVOUS_TIMEOUT", raising=False)
    assert rendezvous_timeout(300.0) == DEFAULT_RENDEZVOUS_TIMEOUT < 300.0
    assert rendezvous_timeout(10.0) == 10.0  # never longer than init's timeout
    monkeypatch.setenv("BITCOLL_RENDEZVOUS_TIMEOUT", "2.5")
    assert rendezvous_timeout(300.0) == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv("BITCOLL_RENDEZVOUS_TIMEOUT", bad)
        with raises_usage("BITCOLL_RENDEZVOUS_TIMEOUT"):
            rendezvous_timeout(300.0)


@pytest.mark.timeout(120)
def test_sbatch_without_srun_fails_at_the_rendezvous_deadline_naming_why() -> None:
    """``SLURM_PROCID=0 SLURM_NTASKS=4 python script.py`` (ranks 1-3 never start): a warning at
    once, then, at the rendezvous deadline (BITCOLL_RENDEZVOUS_TIMEOUT, not the collective
    deadline of init's timeout), CommTimeoutError naming the missing ranks, where the world
    size came from and the missing srun."""
    code = ("import bitcoll\n"
            "try:\n"
            "    bitcoll.init('tcp', timeout=600)\n"
            "except bitcoll.CommTimeoutError as exc:\n"
            "    print('RAISED', exc)\n")
    env = _env(SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_JOB_NODELIST="127.0.0.1",
               MASTER_PORT=str(free_port() - 1), BITCOLL_RENDEZVOUS_TIMEOUT="2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "RuntimeWarning" in out.stderr and "not started by srun" in out.stderr, text
    raised = out.stdout.split("RAISED", 1)[1]
    assert "ranks 1, 2, 3 never showed up" in raised, text
    assert "SLURM_NTASKS=4 (Slurm)" in raised and "not started by srun" in raised, text
    assert "within 2 s" in raised and "BITCOLL_RENDEZVOUS_TIMEOUT" in raised, text
