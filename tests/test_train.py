"""End-to-end tests of ``train.py`` (and of the loss-curve plot built from its logs).

A tiny model trains for 30 steps on one rank in this process and on two ranks started by
``python -m launch -n 2 train.py``; the JSON logs must be complete, the losses finite and
clearly lower at the end than at the start, and the replicas identical after training. The
two-rank run is also the reference that a resumed run and an overlapped run must reproduce
bit for bit (each launch costs seconds of start-up, so they share it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from svg_check import svg_text

from lioncub.recipe import data, loop, models

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32",
        "--batch-size", "8", "--corpus-mb", "0.3", "--eval-every", "10", "--eval-batches", "2",
        "--lr", "3e-3", "--threads", "1", "--no-progress", "--comm-timeout", "30"]
STEPS = 30


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train() -> ModuleType:
    return _load("train", ROOT / "train.py")


@pytest.fixture(scope="module")
def plot_curves() -> ModuleType:
    return _load("plot_curves", ROOT / "bench" / "plot_curves.py")


def _check_log(log: dict[str, Any], optimizer: str, world_size: int) -> None:
    assert log["format"] == "lioncub-train-log/1"
    assert log["config"]["optimizer"] == optimizer
    assert log["config"]["steps"] == STEPS
    assert log["run"]["world_size"] == world_size
    steps = log["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        for key in ("loss", "lr", "time", "compute", "comm", "bytes_sent", "bytes_received"):
            assert math.isfinite(s[key]), (key, s)
        assert s["time"] > 0 and s["compute"] > 0 and s["comm"] >= 0
    assert [e["step"] for e in log["evals"]] == [0, 10, 20, 30]
    assert all(math.isfinite(e["val_loss"]) for e in log["evals"])
    # ln(97) = 4.57 at initialisation; 30 Lion steps must clearly lower both losses.
    first = sum(s["loss"] for s in steps[:5]) / 5
    last = sum(s["loss"] for s in steps[-5:]) / 5
    assert 4.0 < first < 5.0
    assert last < first - 0.5, (first, last)
    assert log["evals"][-1]["val_loss"] < log["evals"][0]["val_loss"] - 0.5
    summary = log["summary"]
    assert summary["world_size"] == world_size
    assert summary["final_val_loss"] == log["evals"][-1]["val_loss"]
    assert summary["replicas_identical"] is True
    assert 0 <= summary["mean_comm_time"] <= summary["mean_step_time"]


@pytest.fixture(scope="module")
def one_rank_log(train: ModuleType, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("one") / "log.json"
    assert train.main([*TINY, "--steps", str(STEPS), "--optimizer", "global",
                       "--json-log", str(path)]) == 0
    log: dict[str, Any] = json.loads(path.read_text())
    return log


@pytest.mark.timeout(150)
def test_one_rank_in_process(one_rank_log: dict[str, Any]) -> None:
    _check_log(one_rank_log, "global", 1)
    assert one_rank_log["run"]["backend"] == "local"
    assert all(s["bytes_sent"] == 0 for s in one_rank_log["steps"])


def _launch(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "launch", "-n", "2", str(ROOT / "train.py"),
                           *TINY, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)


# Two ranks, lioncub-l1 with momentum averaging on the exponential schedule (after steps 1, 2,
# 4, 6, 9, 13, 18 and 26: its state must survive a checkpoint taken at step 10).
TWO_RANKS = ["--steps", str(STEPS), "--optimizer", "lioncub-l1", "--momentum-sync", "exp:2"]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    path = tmp_path_factory.mktemp("two") / "log.json"
    proc = _launch([*TWO_RANKS, "--json-log", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log: dict[str, Any] = json.loads(path.read_text())
    return proc, log


@pytest.mark.timeout(200)
def test_two_ranks_with_launcher(
        two_rank_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]]) -> None:
    proc, log = two_rank_run
    _check_log(log, "lioncub-l1", 2)
    assert log["run"]["backend"] == "tcp"
    assert all(s["bytes_sent"] > 0 for s in log["steps"])
    # Rank 0 alone prints, and it prints the summary table.
    assert proc.stdout.count("| final val loss") == 1
    assert f"{log['summary']['final_val_loss']:.4f}" in proc.stdout


@pytest.mark.timeout(150)
def test_replica_mismatch_is_reported(train: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The run ends with the optimizer's replica check: a mismatch is shown in the summary,
    named on stderr (rank and parameter) and turns into exit status 1."""
    import lioncub.torch
    from lioncub.replicas import ReplicaMismatchError

    def mismatch(self: object) -> None:
        raise ReplicaMismatchError("replicas differ", 2, 5, "blocks.0.attn.qkv.weight",
                                   (2,), (5, 6))

    monkeypatch.setattr(lioncub.torch.DistributedLion, "check_replicas", mismatch)
    assert train.main([*TINY, "--steps", "2", "--eval-every", "0"]) == 1
    out, err = capsys.readouterr()
    assert "replicas identical" in out and "NO" in out
    assert ("rank 2's parameter 5 (blocks.0.attn.qkv.weight) differs from rank 0's; "
            "2 parameters differ") in err


def test_bad_options_exit_2(train: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in ((["--optimizer", "adam"], "invalid choice"),
                         (["--steps", "0"], "must be >= 1"),
                         (["--d-model", "30", "--heads", "4"], "multiple of --heads"),
                         (["--lr", "-1"], "must be in"),
                         (["--warmup", "5", "--steps", "5"], "smaller than --steps"),
                         (["--overlap", "--dtype", "fp16"], "--overlap cannot be used"),
                         (["--hook"], "--hook needs --backend"),
                         (["--backend", "gloo", "--overlap"], "--overlap cannot be used with "
                                                              "--backend"),
                         (["--backend", "mpi"], "invalid choice"),
                         (["--check-every", "-1"], "must be >= 0"),
                         (["--stale", "--overlap"], "--stale cannot be used with --overlap"),
                         (["--stale", "--backend", "gloo"], "--stale cannot be used with "
                                                            "--backend"),
                         (["--fault-tolerant", "--backend", "gloo"],
                          "--fault-tolerant cannot be used with --backend"),
                         (["--fault-tolerant", "--resume", "x"],
                          "--fault-tolerant cannot be used with --resume"),
                         (["--fault-tolerant", "--dtype", "fp16"],
                          "--fault-tolerant cannot be used with --dtype fp16")):
        with pytest.raises(SystemExit) as exc:
            train.parse_args(argv)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err
    usage = " ".join(train.build_parser().format_help().split())
    for text in ("torchrun --nproc-per-node 4 train.py", "srun -N 4", "--backend", "--hook",
                 "--check-every", "--max-restarts 2 train.py --fault-tolerant"):
        assert text in usage, text


def test_corpus_and_schedule(train: ModuleType) -> None:
    a = data.load_corpus(0.3)
    b = data.load_corpus(0.3)
    assert a.digest == b.digest and a.val_files >= 1 and a.train_files >= 9
    assert a.train.size + a.val.size >= 0.3e6
    assert int(max(a.train.max(), a.val.max())) < data.VOCAB_SIZE
    text = "def f(x):\n    return x + 1\n"
    assert data.decode(data.encode(text.encode())) == text
    assert data.decode(data.encode("é".encode())) == "\ufffd\ufffd"
    # Different ranks draw different windows, the same rank the same ones.
    s0 = data.BatchSampler(a.train, 4, 16, seed=1, rank=0).next()[0]
    s0b = data.BatchSampler(a.train, 4, 16, seed=1, rank=0).next()[0]
    s1 = data.BatchSampler(a.train, 4, 16, seed=1, rank=1).next()[0]
    assert bool((s0 == s0b).all()) and not bool((s0 == s1).all())
    assert loop.lr_at(1, 100, 1.0, 10, "cosine") == pytest.approx(0.1)
    assert loop.lr_at(10, 100, 1.0, 10, "cosine") == pytest.approx(1.0)
    assert loop.lr_at(100, 100, 1.0, 10, "cosine") == pytest.approx(0.1)
    assert loop.lr_at(55, 100, 1.0, 10, "cosine") == pytest.approx(0.55)
    assert loop.lr_at(100, 100, 1.0, 10, "constant") == 1.0


@pytest.mark.timeout(150)
def test_plot_from_log(plot_curves: ModuleType, one_rank_log: dict[str, Any],
                       tmp_path: Path) -> None:
    second = json.loads(json.dumps(one_rank_log))
    second["config"]["optimizer"] = "lioncub-l1"
    paths = []
    for i, rec in enumerate((one_rank_log, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(rec))
    out = tmp_path / "curves.svg"
    assert plot_curves.main([*map(str, paths), "-o", str(out), "--title", "T & t"]) == 0
    texts = svg_text(out)  # well-formed XML, title escaped
    assert "T & t" in texts and "global" in texts and "lioncub-l1" in texts
    assert "Validation loss" in texts and "step" in texts
    assert [r.label for r in plot_curves.group_runs([one_rank_log, second])] == [
        "global", "lioncub-l1"]


def test_comparison_report(one_rank_log: dict[str, Any], tmp_path: Path) -> None:
    compare = _load("compare_optimizers", ROOT / "bench" / "compare_optimizers.py")
    specs = [compare.Spec(name, ["--optimizer", name])
             for name in ("global", "dlion-mavo", "lioncub-l1")]
    outcomes = []
    for spec, val in zip(specs, (2.0, 2.1, 2.04), strict=True):
        rec = json.loads(json.dumps(one_rank_log))
        rec["summary"]["final_val_loss"] = val
        outcomes.append(compare.Outcome(spec, 0, tmp_path / f"{spec.label}.json", 0, 1.0, rec))
    outcomes.append(compare.Outcome(specs[1], 1, tmp_path / "x.json", 1, 1.0, None))
    report = compare.summarize(outcomes, specs, "cmd", 1, "tcp", STEPS, [0, 1])
    assert "| global | 2.0000 | +0.00% |" in report
    assert "| dlion-mavo (1 failed) | 2.1000 | +5.00% |" in report
    assert "| lioncub-l1 | 2.0400 | +2.00% |" in report
    assert "| dlion-mavo | 1 | - | - | 1 |" in report  # the failed run, per-run table
    assert "+2.00% final validation loss (target: within 3%: met)" in report
    assert "vs Lion Cub: +2.94% (worse than Lion Cub; higher loss with 1 of 1 seed)" in report
    netbed = compare.summarize(outcomes, specs, "cmd", 4, "tcp", STEPS, [0, 1], "100mbit")
    assert "with a 100mbit link to a bridge (bench/netbed.py)" in netbed


def test_comparison_time_to_target(one_rank_log: dict[str, Any], tmp_path: Path) -> None:
    """The time-to-loss table: the first evaluation at or below the target, per seed; the
    seeds that never reach it counted; Global Lion's seconds over each run's, paired by
    seed."""
    compare = _load("compare_optimizers", ROOT / "bench" / "compare_optimizers.py")
    specs = [compare.Spec(name, ["--optimizer", name]) for name in ("global", "lioncub-l1")]
    # (seed, label) -> evaluations as (step, seconds of steps, validation loss)
    curves = {(0, "global"): [(10, 4.0, 3.0), (20, 8.0, 2.5), (30, 12.0, 2.4)],
              (1, "global"): [(10, 6.0, 2.9), (20, 12.0, 2.45)],
              (0, "lioncub-l1"): [(10, 1.0, 2.6), (20, 2.0, 2.5)],
              (1, "lioncub-l1"): [(10, 2.0, 2.7), (20, 4.0, 2.6)]}
    outcomes = []
    for (seed, label), evals in curves.items():
        rec = json.loads(json.dumps(one_rank_log))
        rec["evals"] = [{"step": k, "step_seconds": t, "val_loss": v} for k, t, v in evals]
        spec = next(s for s in specs if s.label == label)
        outcomes.append(compare.Outcome(spec, seed, tmp_path / f"{label}{seed}.json", 0, 1.0,
                                        rec))
    assert compare.first_at_or_below(outcomes[0].record, 2.5)["step"] == 20
    assert compare.first_at_or_below(outcomes[0].record, 2.0) is None
    report = compare.summarize(outcomes, specs, "cmd", 4, "tcp", STEPS, [0, 1], target=2.5)
    assert "Time to a validation loss of 2.5" in report
    assert "| global | 2 of 2 | 20 ± 0 | 10.0 ± 2.8 s | 1.00 ± 0.00x |" in report
    # seed 0 only: 8.0 s against 2.0 s
    assert "| lioncub-l1 | 1 of 2 | 20 | 2.0 s | 4.00x |" in report
    assert "Time to a validation loss" not in compare.summarize(
        outcomes, specs, "cmd", 4, "tcp", STEPS, [0, 1])


def test_comparison_on_the_testbed_command() -> None:
    compare = _load("compare_optimizers", ROOT / "bench" / "compare_optimizers.py")
    cmd = compare.launch_command("tcp", 4, ["--steps", "3"], "1gbit")
    assert cmd[1:] == [str(ROOT / "bench" / "netbed.py"), "--hosts", "4", "--rate", "1gbit",
                       str(ROOT / "train.py"), "--steps", "3"]
    assert compare.launch_command("tcp", 2, ["--steps", "3"])[1:4] == ["-m", "launch", "-n"]
    far = compare.launch_command("tcp", 4, ["--steps", "3"], "100mbit", 50.0)
    assert far[1:] == [str(ROOT / "bench" / "netbed.py"), "--hosts", "4", "--rate", "100mbit",
                       "--rtt", "50", str(ROOT / "train.py"), "--steps", "3"]
    with pytest.raises(SystemExit):
        compare.main(["--netbed", "1gbit", "--launcher", "mpi"])


def test_presets_dtype_and_device_options(train: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    args = train.parse_args(["--model", "small"])
    assert (args.d_model, args.layers, args.heads) == (384, 6, 6)
    args = train.parse_args(["--model", "medium", "--layers", "2"])
    assert (args.d_model, args.layers, args.heads) == (512, 2, 8)
    args = train.parse_args([])
    assert (args.dtype, args.device, args.model, args.d_model) == ("fp32", "cpu", "tiny", 128)
    # The presets' sizes are those their help text states.
    for name, shape in models.PRESETS.items():
        model = models.CharTransformer(data.VOCAB_SIZE, shape.d_model, shape.layers,
                                      shape.heads, 128)
        n = sum(p.numel() for p in model.parameters()) / 1e6
        assert n == pytest.approx(float(shape.approx_params.rstrip("M")), rel=0.01), name
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: False)
    for argv, needle in ((["--device", "cuda"], "--device cuda: CUDA is not available"),
                         (["--dtype", "fp8"], "invalid choice"),
                         (["--steps", "10", "--stop-after", "11"], "must not exceed --steps"),
                         (["--save-every", "5"], "--save-every needs --save")):
        with pytest.raises(SystemExit) as exc:
            train.parse_args(argv)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err


@pytest.mark.timeout(150)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_compute(train: ModuleType, dtype: str, tmp_path: Path) -> None:
    """bf16 / fp16 autocast: float32 parameters stay float32, the run learns, fp16's loss
    scale is carried, and the replicas are checked as in float32."""
    path = tmp_path / "log.json"
    assert train.main([*TINY, "--steps", "12", "--eval-every", "0", "--dtype", dtype,
                       "--json-log", str(path)]) == 0
    log = json.loads(path.read_text())
    assert log["summary"]["dtype"] == dtype and log["summary"]["replicas_identical"] is True
    assert log["evals"][-1]["val_loss"] < log["evals"][0]["val_loss"] - 0.3
    assert log["summary"]["skipped_steps"] == 0


def test_loss_scale_skips_overflow_on_every_rank(train: ModuleType) -> None:
    import torch

    import bitcoll
    comm = bitcoll.init()
    scaler = loop.LossScale(True)
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.tensor([2.0, -4.0, 8.0]) * scaler.scale
    assert scaler.unscale([p], comm) and p.grad.tolist() == [2.0, -4.0, 8.0]
    p.grad = torch.tensor([1.0, math.inf, 0.0])
    assert not scaler.unscale([p], comm) and scaler.scale == loop.LossScale.INITIAL / 2
    off = loop.LossScale(False)
    p.grad = torch.tensor([math.nan, 0.0, 0.0])
    assert off.unscale([p], comm) and off.scale == 1.0
    comm.close()


@pytest.mark.timeout(150)
def test_target_loss_and_no_comm(train: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "log.json"
    assert train.main([*TINY, "--steps", "20", "--eval-every", "5", "--target-loss", "3.9",
                       "--no-comm", "--json-log", str(path)]) == 0
    log = json.loads(path.read_text())
    summary = log["summary"]
    first = next(e for e in log["evals"] if e["val_loss"] <= 3.9)
    assert summary["target_reached"]["step"] == first["step"] > 0
    expected = sum(s["time"] for s in log["steps"][:first["step"]] if not s.get("warmup"))
    assert summary["target_reached"]["step_seconds"] == pytest.approx(expected)
    assert summary["no_comm"] is True and summary["replicas_identical"] is None
    assert log["steps"][0]["warmup"] is True
    assert not any(s.get("warmup") for s in log["steps"][1:])
    assert summary["first_step_time"] == log["steps"][0]["time"]
    for s in log["steps"]:
        assert s["time"] == pytest.approx(s["forward_backward"] + s["optimizer"] + s["comm"])


@pytest.mark.timeout(300)
def test_resume_equals_an_uninterrupted_run(
        two_rank_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
        tmp_path: Path) -> None:
    """The two-rank run (30 steps straight) against 10 steps + save + resume for the other
    20: bit-identical training and validation losses, and the same momentum syncs."""
    a = two_rank_run[1]
    resumed, ckpt = tmp_path / "b.json", tmp_path / "ckpt"
    proc = _launch([*TWO_RANKS, "--stop-after", "10", "--save", str(ckpt)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["rank0.pt", "rank1.pt"]
    proc = _launch([*TWO_RANKS, "--resume", str(ckpt), "--json-log", str(resumed)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout
    b = json.loads(resumed.read_text())
    assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
    assert [e["val_loss"] for e in a["evals"]] == [e["val_loss"] for e in b["evals"]]
    assert [s["synced_tensors"] for s in a["steps"]] == [s["synced_tensors"]
                                                         for s in b["steps"]]
    assert b["run"]["resumed_at"] == 10 and b["steps"][10]["warmup"] is True
    assert b["summary"]["replicas_identical"] is True


@pytest.mark.timeout(300)
def test_overlap_gives_the_same_run(
        two_rank_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
        tmp_path: Path) -> None:
    """The two-rank run again with --overlap (buckets started inside backward, the optimizer
    on its own communicator): bit-identical losses."""
    a = two_rank_run[1]
    overlapped = tmp_path / "b.json"
    proc = _launch([*TWO_RANKS, "--overlap", "--json-log", str(overlapped)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    b = json.loads(overlapped.read_text())
    assert b["config"]["overlap"] is True and not a["config"]["overlap"]
    assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
    assert [e["val_loss"] for e in a["evals"]] == [e["val_loss"] for e in b["evals"]]
    assert [s["synced_tensors"] for s in a["steps"]] == [s["synced_tensors"]
                                                         for s in b["steps"]]
    assert b["summary"]["replicas_identical"] is True


def test_stale_run_applies_updates_a_step_late(
        two_rank_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
        tmp_path: Path) -> None:
    """The two-rank run with --stale: the first step (on the same starting weights) has the
    same loss, the second does not (its weights miss the first update), and the run ends
    with identical replicas and every evaluation made."""
    a = two_rank_run[1]
    log = tmp_path / "stale.json"
    proc = _launch([*TWO_RANKS, "--stale", "--json-log", str(log)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    b = json.loads(log.read_text())
    assert b["config"]["stale"] is True
    assert a["steps"][0]["loss"] == b["steps"][0]["loss"]
    assert a["steps"][1]["loss"] != b["steps"][1]["loss"]
    assert [e["step"] for e in a["evals"]] == [e["step"] for e in b["evals"]]
    assert b["summary"]["replicas_identical"] is True


@pytest.mark.timeout(300)
def test_ddp_hook_gives_the_same_run(
        two_rank_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
        tmp_path: Path) -> None:
    """The two-rank run again through DistributedDataParallel over gloo with the votes
    inside backward (--hook: lioncub_hook + LionCubStep), stopped after step 10 with a
    checkpoint and resumed (the hook's momenta and counters travel in it): bit-identical
    losses, the same momentum averaging, replicas checked every 7 steps."""
    a = two_rank_run[1]
    path, ckpt = tmp_path / "hook.json", tmp_path / "ckpt"
    hook = ["--backend", "gloo", "--hook", "--check-every", "7"]
    proc = _launch([*TWO_RANKS, *hook, "--stop-after", "10", "--save", str(ckpt)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DDP over gloo with the lioncub hook" in proc.stdout
    assert "compiling kernels (first step only)" in proc.stdout
    proc = _launch([*TWO_RANKS, *hook, "--resume", str(ckpt), "--json-log", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    b = json.loads(path.read_text())
    assert b["run"]["resumed_at"] == 10
    assert b["config"]["hook"] == "lioncub" and b["config"]["backend"] == "gloo"
    assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
    assert [e["val_loss"] for e in a["evals"]] == [e["val_loss"] for e in b["evals"]]
    assert [s["synced_tensors"] for s in a["steps"]] == [s["synced_tensors"]
                                                         for s in b["steps"]]
    assert all(s["bytes_sent"] > 0 and s["comm"] == 0 for s in b["steps"])
    assert b["summary"]["replicas_identical"] is True


@pytest.mark.timeout(300)
def test_ddp_sign_hook_and_plain_ddp(tmp_path: Path) -> None:
    """The other DDP modes train and keep identical replicas: the sign hook (AdamW) over
    the bitcoll backend, and DDP's own averaging with Lion (global)."""
    for extra in (["--backend", "bitcoll", "--hook", "sign"],
                  ["--backend", "gloo", "--optimizer", "global", "--check-every", "5"]):
        path = tmp_path / "log.json"
        proc = _launch(["--steps", "12", "--eval-every", "0", *extra, "--json-log", str(path)])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        log = json.loads(path.read_text())
        assert log["summary"]["replicas_identical"] is True, extra
        losses = [s["loss"] for s in log["steps"]]
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], extra


def test_periodic_replica_check_stops_the_run(train: ModuleType,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """--check-every N: a mismatch found after step N stops the run (exit 1) naming the
    rank and the parameter."""
    import lioncub.torch
    from lioncub.replicas import ReplicaMismatchError

    calls: list[int] = []

    def mismatch(self: object) -> None:
        calls.append(1)
        raise ReplicaMismatchError("replicas differ", 1, 3, "head.weight", (1,), (3,))

    monkeypatch.setattr(lioncub.torch.DistributedLion, "check_replicas", mismatch)
    assert train.main([*TINY, "--steps", "6", "--eval-every", "0", "--check-every", "2"]) == 1
    err = capsys.readouterr().err
    assert "differ after step 2 (rank 1's parameter 3 (head.weight)" in err
    assert len(calls) == 1


def test_checkpoint_of_another_run_is_refused(train: ModuleType, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    common = [*TINY, "--steps", "4", "--eval-every", "0"]
    assert train.main([*common, "--stop-after", "2", "--save", str(ckpt)]) == 0
    assert train.main([*common, "--optimizer", "global", "--resume", str(ckpt)]) == 1
    assert "--optimizer 'lioncub-l1' (now 'global')" in capsys.readouterr().err
    assert train.main([*common, "--resume", str(tmp_path / "none")]) == 1
    assert "cannot read the checkpoint" in capsys.readouterr().err


def test_e2e_report_and_figure(one_rank_log: dict[str, Any], tmp_path: Path) -> None:
    e2e = _load("e2e", ROOT / "bench" / "e2e.py")
    target = one_rank_log["evals"][2]["val_loss"]  # reached at the second evaluation or sooner
    points = [e2e.point_of(rate, config, one_rank_log, Path("x.json"), target)
              for rate, config in (("1gbit", "compute floor"), ("100mbit", "global"),
                                   ("1gbit", "global"), ("1gbit", "lioncub-l1"))]
    first = next(e for e in one_rank_log["evals"] if e["val_loss"] <= target)
    assert points[1].target_step == first["step"]
    assert points[1].target_seconds == first["step_seconds"]
    assert e2e.point_of("1gbit", "global", one_rank_log, Path("x.json"), 0.1).target_step is None
    text = e2e.report(points, ["10gbit lioncub-l1"], ["cmd"], "setup", target)
    assert f"| 1gbit | global | {1e3 * points[2].step_time:.0f} ms |" in text
    assert "| 10gbit lioncub-l1 | failed |" in text and "Global Lion at 100mbit" in text
    png = tmp_path / "e2e.png"
    e2e.plot(points, ["100mbit", "1gbit"], png, "title", target)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_comparison_in_two_dtypes(one_rank_log: dict[str, Any], tmp_path: Path) -> None:
    compare = _load("compare_optimizers", ROOT / "bench" / "compare_optimizers.py")
    assert compare.dtype_label("global", "bf16", ["fp32", "bf16"]) == "global (bf16)"
    assert compare.dtype_label("global", "bf16", ["bf16"]) == "global"
    specs = [compare.Spec("global", []), compare.Spec("global (bf16)", []),
             compare.Spec("lioncub-l1", []), compare.Spec("lioncub-l1 (bf16)", [])]
    outcomes = []
    for spec, val in zip(specs, (2.0, 2.01, 2.0, 2.05), strict=True):
        rec = json.loads(json.dumps(one_rank_log))
        rec["summary"]["final_val_loss"] = val
        outcomes.append(compare.Outcome(spec, 0, tmp_path / "x.json", 0, 1.0, rec))
    report = compare.summarize(outcomes, specs, "cmd", 1, "tcp", STEPS, [0])
    assert "global (bf16) vs global in fp32: +0.50% final validation loss (target: within " \
           "1%: met)" in report
    assert "lioncub-l1 (bf16) vs lioncub-l1 in fp32: +2.50% final validation loss " \
           "(target: within 1%: NOT met)" in report


@pytest.mark.timeout(150)
def test_native_bf16_parameters_resume_exactly(train: ModuleType, tmp_path: Path) -> None:
    """--native: the parameters themselves are bfloat16 (momenta too with --momentum-dtype);
    the run learns, and a save + resume reproduces the straight run's losses bit for bit."""
    common = [*TINY, "--steps", "8", "--eval-every", "4", "--dtype", "bf16", "--native",
              "--momentum-dtype", "bf16"]
    straight, resumed, ckpt = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "ckpt"
    assert train.main([*common, "--json-log", str(straight)]) == 0
    assert train.main([*common, "--stop-after", "4", "--save", str(ckpt)]) == 0
    assert train.main([*common, "--resume", str(ckpt), "--json-log", str(resumed)]) == 0
    a, b = json.loads(straight.read_text()), json.loads(resumed.read_text())
    assert a["summary"]["precision"] == "native parameters"
    assert a["evals"][-1]["val_loss"] < a["evals"][0]["val_loss"] - 0.2
    assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
    assert [e["val_loss"] for e in a["evals"]] == [e["val_loss"] for e in b["evals"]]
    state = train.torch.load(ckpt / "rank0.pt", weights_only=True)
    assert all(v.dtype == train.torch.bfloat16 for v in state["model"].values())


def test_recipe_imports_torch_only_where_it_must() -> None:
    """lioncub itself and the log reader's module (bench/plot_curves.py) load without torch;
    train.py's own pieces are in lioncub.recipe."""
    code = ("import sys, lioncub, lioncub.recipe, lioncub.recipe.logs; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_fault_tolerant_needs_a_store_that_outlives_the_ranks(
        train: ModuleType, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Started without `python -m launch --max-restarts N` (or torchrun), --fault-tolerant
    stops with exit status 1 and says how to start it."""
    monkeypatch.delenv("BITCOLL_ELASTIC_STORE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert train.main([*TINY, "--steps", "2", "--fault-tolerant"]) == 1
    assert "--max-restarts" in capsys.readouterr().err
