"""``train.py --fault-tolerant`` under ``python -m launch --max-restarts N`` with real processes,
and the periodic replica check (``--check-every``) of the fault-tolerant and DDP hook paths.

This file is also the program the launcher starts on every rank (``python -m launch ...
tests/test_train_fault_tolerant.py <train.py options>``): it runs ``train.main()`` with faults
placed at exact steps, read from the environment:

* ``FT_KILL=R:K``: the first incarnation of initial rank ``R`` SIGKILLs itself when it is
  about to run step ``K`` (the event is the step count, not a timer);
* ``FT_HOLD=K``: before step ``K``, rank 0 of a shrunken epoch waits until a restarted
  process has registered as a joiner (so the world grows back before the end of a short
  run, however long the replacement takes to start); the other ranks wait in the step's
  collectives;
* ``FT_KILL_IN_CHECK=R:K``: the first incarnation of initial rank ``R`` SIGKILLs itself
  inside the replica check that follows step ``K``;
* ``FT_DIVERGE=R:K``: after step ``K`` initial rank ``R`` adds 1 to one of its parameters,
  so that the next replica check must name it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32",
        "--batch-size", "8", "--corpus-mb", "0.3", "--eval-every", "4", "--eval-batches", "2",
        "--lr", "3e-3", "--threads", "1", "--no-progress"]


def _launch(ranks: int, restarts: int | None, args: list[str], faults: dict[str, str],
            timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1", **faults)
    env.pop("BITCOLL_SECRET", None)
    launch = [sys.executable, "-m", "launch", "-n", str(ranks)]
    if restarts is not None:
        launch += ["--max-restarts", str(restarts)]
    return subprocess.run([*launch, str(Path(__file__)), *TINY, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_a_killed_rank_is_replaced_and_training_finishes(tmp_path: Path) -> None:
    """3 ranks; rank 0 (the store is the launcher's, so rank 0 may die) is SIGKILLed as it
    starts step 4: the survivors lose that step only, go on as 2 ranks, the replacement
    joins, and the run ends at 3 ranks with identical replicas, a log with every step and
    the live ranks' checkpoint."""
    log, ckpt = tmp_path / "log.json", tmp_path / "ckpt"
    proc = _launch(3, 1, ["--steps", "12", "--check-every", "3", "--comm-timeout", "120",
                          "--save", str(ckpt), "--save-every", "6",
                          "--fault-tolerant", "--json-log", str(log)],
                   {"FT_KILL": "0:4", "FT_HOLD": "10"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "restart 1 of 1" in proc.stderr, out
    assert "membership: epoch 1 after 3 committed steps: rank 0 left; 2 ranks now (was 3)" \
        in proc.stdout, out
    assert "1 process joined as rank 2; 3 ranks now (was 2)" in proc.stdout, out
    assert "| membership changes    | 2 (1 left, 1 joined, started with 3); 1 steps lost" \
        in proc.stdout, out
    rec: dict[str, Any] = json.loads(log.read_text())
    steps = rec["steps"]
    assert [s["step"] for s in steps] == list(range(1, 13))
    sizes = [s["world_size"] for s in steps]
    back = sizes.index(3, 3)  # the first step after the joiner came in
    assert sizes == [3] * 3 + [2] * (back - 3) + [3] * (12 - back), sizes
    assert 4 < back <= 10, sizes
    summary = rec["summary"]
    assert summary["world_size"] == 3 and summary["initial_world_size"] == 3
    assert summary["replicas_identical"] is True
    assert summary["lost_steps"] == 1
    assert [(m["left"], m["joined"]) for m in summary["membership"]] == [([0], []), ([], [2])]
    losses = [s["loss"] for s in steps]
    assert all(math.isfinite(v) for v in losses)
    assert rec["evals"][-1]["step"] == 12
    assert rec["evals"][-1]["val_loss"] < 4.3  # ln(97) = 4.57 at the start
    # the live ranks' checkpoint: one file per rank of the last epoch, identical models
    import torch

    assert sorted(p.name for p in ckpt.iterdir()) == ["rank0.pt", "rank1.pt", "rank2.pt"]
    states = [torch.load(ckpt / f"rank{r}.pt", weights_only=True) for r in range(3)]
    assert [(s["step"], s["world_size"], s["rank"]) for s in states] == \
        [(12, 3, 0), (12, 3, 1), (12, 3, 2)]
    for name, value in states[0]["model"].items():
        assert all(torch.equal(value, s["model"][name]) for s in states[1:]), name


@pytest.mark.timeout(300)
def test_without_restarts_the_survivors_finish(tmp_path: Path) -> None:
    """3 ranks, no restart: rank 2 is SIGKILLed inside the replica check after step 3; the
    other two move to a new epoch, check again and train to the end without losing a step.
    The launcher's status reports the lost rank (its last process was killed); the log is
    complete."""
    log = tmp_path / "log.json"
    proc = _launch(3, 0, ["--steps", "8", "--check-every", "3", "--comm-timeout", "60",
                          "--fault-tolerant", "--json-log", str(log)],
                   {"FT_KILL_IN_CHECK": "2:3"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGKILL, out
    assert "step 3: a failure interrupted the check or checkpoint" in proc.stdout, out
    assert "membership: epoch 1 after 3 committed steps: rank 2 left; 2 ranks now (was 3)" \
        in proc.stdout, out
    rec: dict[str, Any] = json.loads(log.read_text())
    assert [s["step"] for s in rec["steps"]] == list(range(1, 9))
    assert [s["world_size"] for s in rec["steps"]] == [3] * 3 + [2] * 5
    assert rec["summary"]["world_size"] == 2 and rec["summary"]["replicas_identical"] is True
    assert rec["summary"]["lost_steps"] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["fault-tolerant", "hook"])
def test_periodic_check_names_the_diverged_rank(mode: str) -> None:
    """--check-every 3 after rank 1 changed a parameter at step 2: every rank stops at the
    check of step 3 with an error naming rank 1 and the parameter."""
    if mode == "fault-tolerant":
        proc = _launch(2, 0, ["--steps", "8", "--check-every", "3", "--comm-timeout", "60",
                              "--fault-tolerant"], {"FT_DIVERGE": "1:2"})
    else:
        proc = _launch(2, None, ["--steps", "8", "--check-every", "3", "--comm-timeout", "60",
                                 "--backend", "gloo", "--hook"], {"FT_DIVERGE": "1:2"})
    assert proc.returncode != 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] train.py: rank" in proc.stderr and \
            "the model replicas differ after step 3 (rank 1's parameter 0 (tok.weight) " \
            "differs from rank 0's" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------------------------
# the program of every rank
# --------------------------------------------------------------------------------------------


def _pair(name: str) -> tuple[int, int] | None:
    value = os.environ.get(name)
    if not value:
        return None
    rank, step = value.split(":")
    return int(rank), int(step)


def _rank_main() -> int:
    from bitcoll.elastic import ElasticGroup
    from lioncub.distributed import DistributedLion
    from lioncub.elastic import ElasticLion
    from lioncub.recipe.ddp import DDPOptimizer

    spec = importlib.util.spec_from_file_location("train", ROOT / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    rank = int(os.environ["RANK"])
    first = os.environ.get("BITCOLL_RESTART_COUNT", "0") == "0"
    kill, diverge = _pair("FT_KILL"), _pair("FT_DIVERGE")
    kill_in_check = _pair("FT_KILL_IN_CHECK")
    hold = int(os.environ.get("FT_HOLD", "0"))
    full = int(os.environ["WORLD_SIZE"])

    # a heartbeat may starve for a while on a loaded machine; joiners are looked for at
    # every commit, so that the one FT_HOLD waits for is taken in at that step
    from_env = ElasticGroup.from_env.__func__  # type: ignore[attr-defined]

    def patient(cls: type[ElasticGroup], /, **kwargs: Any) -> ElasticGroup:
        kwargs.update(dead_after=5.0, join_check=0.0)
        group: ElasticGroup = from_env(cls, **kwargs)
        return group

    ElasticGroup.from_env = classmethod(patient)  # type: ignore[method-assign,assignment]

    def diverged(params: list[Any], step: int) -> None:
        if first and diverge is not None and diverge == (rank, step):
            params[0].reshape(-1)[0] += 1.0

    elastic_step = ElasticLion.step

    def step(self: ElasticLion, grads: Any) -> bool:
        k = self.step_count + 1
        if first and kill is not None and kill == (rank, k):
            os.kill(os.getpid(), signal.SIGKILL)
        epoch = self.group.epoch
        if k == hold and epoch.rank == 0 and epoch.size < full:
            deadline = time.monotonic() + 200.0
            while not self.group.store.add("elastic/joiners/count", 0):
                assert time.monotonic() < deadline, "no replacement registered"
                time.sleep(0.01)
        done = elastic_step(self, grads)
        diverged(self.params, self.step_count)
        return done

    ElasticLion.step = step  # type: ignore[method-assign]

    core_check = DistributedLion.check_replicas

    def check(self: DistributedLion) -> None:
        if first and kill_in_check is not None and kill_in_check == (rank, self.step_count):
            os.kill(os.getpid(), signal.SIGKILL)
        core_check(self)

    DistributedLion.check_replicas = check  # type: ignore[method-assign]

    ddp_step = DDPOptimizer.step
    count = 0

    def hooked_step(self: DDPOptimizer) -> None:
        nonlocal count
        ddp_step(self)
        count += 1
        if first and diverge is not None and diverge == (rank, count):
            with train.torch.no_grad():
                self.named[0][1].reshape(-1)[0] += 1.0

    DDPOptimizer.step = hooked_step  # type: ignore[method-assign]
    status: int = train.main()
    return status


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(_rank_main())
