#!/usr/bin/env python3
"""Run ``train.py`` with several optimizers on identical seeds and steps, then tabulate and plot.

Usage::

    python bench/compare_optimizers.py                       # 5 optimizers, 4 ranks, TCP
    python bench/compare_optimizers.py --seeds 0 1 2 --steps 600
    python bench/compare_optimizers.py --optimizers global lioncub-l1 \\
        --run "l1, 3 levels" "--optimizer lioncub-l1 --levels 3" -- --lr 5e-4

Every run is ``python -m launch -n N train.py --optimizer X --seed S --steps T --json-log ...``
(``--launcher mpi``: ``mpiexec -n N python train.py ...``; ``--netbed RATE``: ``python
bench/netbed.py --hosts N --rate RATE train.py ...``, one emulated host per rank joined by
links of RATE, root only, see bench/netbed.py); arguments after ``--`` go to every
run. ``--run LABEL ARGS`` adds a run with its own train.py arguments (e.g. another
``--levels``; ARGS is one shell-quoted string). ``--dtypes fp32 bf16`` runs every optimizer in
each ``train.py --dtype`` and compares each 16-bit run's final validation loss with the fp32
run of the same optimizer (target: within 1%).
Runs happen one after another (they share the machine). Written to ``--out``
(default ``results/optimizers``):

* ``logs/<label>-seed<S>.json`` and ``.txt``: each run's JSON log and its console output;
* ``loss_curves.png`` (against steps), ``loss_curves_zoom.png`` (y range fitted to the second
  half of the run) and ``loss_curves_time.png`` (against training time), drawn by
  ``bench/plot_curves.py`` (matplotlib; ``--format svg`` for SVG files);
* ``results.md``: the command, the set-up and a table of final validation / training loss,
  the gap to Global Lion, step time split into compute and communication, and bytes sent per
  step and rank (means over seeds; per-seed values below the main table).

``--reuse`` keeps the logs of runs already in ``--out`` whose train.py command line is unchanged,
so a comparison can be extended or resumed without running everything again.

Exit status 0 when every run succeeded, 1 otherwise (the others are still tabulated).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netbed as netbed_tool
import osu  # sibling scripts, not a package
import plot_curves

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train.py"
DEFAULT_OPTIMIZERS = ("global", "dlion-mavo", "dlion-avg", "lioncub-mavo", "lioncub-l1")
BASELINE = "global"
LION_CUB = "lioncub-l1"
#: The figures: file name without extension, x axis, fraction of the x range left out when
#: choosing the y range (see bench/plot_curves.py), alt text in results.md.
FIGURES = (("loss_curves", "step", 0.1, "loss curves against steps"),
           ("loss_curves_zoom", "step", 0.5, "the second half, zoomed"),
           ("loss_curves_time", "time", 0.1, "loss curves against training time"))
MAJORITY = "dlion-mavo"
TARGET_GAP = 3.0  # percent: Lion Cub's final validation loss vs Global Lion's
DTYPES = ("fp32", "bf16", "fp16")
DTYPE_GAP = 1.0  # percent: a 16-bit run's final validation loss vs the fp32 run's


def dtype_label(optimizer: str, dtype: str, dtypes: Sequence[str]) -> str:
    """The run label of ``optimizer`` in ``dtype``: the optimizer's name for fp32 (or when
    ``dtypes`` is that dtype alone), else ``"<optimizer> (<dtype>)"``."""
    return optimizer if dtype == "fp32" or list(dtypes) == [dtype] else f"{optimizer} ({dtype})"


@dataclass
class Spec:
    """One configuration to run: a label and its train.py arguments (seed/steps/log added)."""

    label: str
    args: list[str]


@dataclass
class Outcome:
    spec: Spec
    seed: int
    log: Path
    returncode: int
    seconds: float
    record: dict[str, Any] | None


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "run"


def launch_command(launcher: str, ranks: int, train_args: Sequence[str],
                   netbed: str | None = None, rtt_ms: float = 0.0) -> list[str]:
    """The command that starts ``train.py`` with ``train_args`` on ``ranks`` ranks (on the
    emulated Ethernet testbed with links of rate ``netbed`` when given, ``rtt_ms`` > 0 adding
    that round trip; TCP only)."""
    py = sys.executable
    if netbed is not None:
        return [*netbed_tool.invocation(ranks, netbed, rtt_ms=rtt_ms), str(TRAIN), *train_args]
    if launcher == "tcp":
        return [py, "-m", "launch", "-n", str(ranks), str(TRAIN), *train_args]
    mpiexec = Path(py).with_name("mpiexec")
    exe = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec") or "mpiexec"
    return [exe, "-n", str(ranks), py, str(TRAIN), *train_args]


def run_one(spec: Spec, seed: int, steps: int, ranks: int, launcher: str, extra: list[str],
            logdir: Path, timeout: float, reuse: bool = False,
            netbed: str | None = None, rtt_ms: float = 0.0) -> Outcome:
    """Run one configuration; its console output goes to ``logdir/<slug>-seed<S>.txt``.

    ``reuse``: when the JSON log of an earlier run with the same command line exists, load it
    instead of running again.
    """
    stem = f"{_slug(spec.label)}-seed{seed}"
    log = logdir / f"{stem}.json"
    train_args = [*spec.args, "--seed", str(seed), "--steps", str(steps), "--json-log",
                  str(log), "--no-progress", *extra]
    cmd = launch_command(launcher, ranks, train_args, netbed, rtt_ms)
    where = [launcher] if netbed is None else \
        ["netbed", netbed, *([f"rtt {rtt_ms:g} ms"] if rtt_ms else [])]
    if reuse and log.exists():
        try:
            record = plot_curves.load_log(log)
        except ValueError:
            record = None
        if record is not None and record.get("command") == train_args \
                and record.get("launched", ["tcp"]) == where:
            return Outcome(spec, seed, log, 0, 0.0, record)
    log.unlink(missing_ok=True)
    env = dict(os.environ)
    env.setdefault("NUMBA_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    with (logdir / f"{stem}.txt").open("w") as console:
        console.write("$ " + shlex.join(osu.display_command(cmd)) + "\n")
        console.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=console,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            console.write(f"\ncompare_optimizers.py: timed out after {timeout:.0f} s\n")
            rc = 124
    seconds = time.perf_counter() - t0
    record = plot_curves.load_log(log) if rc == 0 and log.exists() else None
    if record is not None and record.get("run", {}).get("world_size") == ranks:
        record["command"] = train_args  # remembered for --reuse
        record["launched"] = where
        log.write_text(json.dumps(record, indent=1) + "\n")
    elif record is not None:
        record = None
        rc = rc or 1
    return Outcome(spec, seed, log, rc, seconds, record)


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def _pm(xs: Sequence[float], fmt: str) -> str:
    if not xs:
        return "failed"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(_mean(xs), fmt)} ± {format(statistics.stdev(xs), fmt)}"


def _paired_gaps(vals: dict[int, float], ref: dict[int, float]) -> list[float]:
    """Per seed present in both: ``100 * (vals / ref - 1)``, percent."""
    return [100 * (v / ref[seed] - 1) for seed, v in sorted(vals.items())
            if seed in ref and ref[seed] != 0]


def _gap(gaps: Sequence[float]) -> str:
    if not gaps:
        return "-"
    if len(gaps) == 1:
        return f"{gaps[0]:+.2f}%"
    return f"{_mean(gaps):+.2f}% ± {statistics.stdev(gaps):.2f}"


def first_at_or_below(record: dict[str, Any], target: float) -> dict[str, Any] | None:
    """The first evaluation of a train.py JSON log whose validation loss is at or below
    ``target`` (as ``train.py --target-loss`` finds it), or None."""
    return next((e for e in record["evals"] if e["val_loss"] <= target), None)


def _time_to_target(outcomes: Sequence[Outcome], specs: Sequence[Spec],
                    target: float) -> list[str]:
    """The report's table of the time to a validation loss: per configuration, the seeds
    that reached ``target``, the step and the seconds of steps (sum of step times up to that
    evaluation, evaluations left out) at which they did, and Global Lion's seconds over these,
    paired by seed."""
    hits: dict[str, dict[int, tuple[int, float]]] = {s.label: {} for s in specs}
    runs: dict[str, int] = {s.label: 0 for s in specs}
    for o in outcomes:
        if o.record is None:
            continue
        runs[o.spec.label] += 1
        e = first_at_or_below(o.record, target)
        if e is not None:
            hits[o.spec.label][o.seed] = (int(e["step"]), float(e["step_seconds"]))
    base = hits.get(BASELINE, {})
    lines = [f"Time to a validation loss of {target:g} (the first evaluation at or below it; "
             "seconds of steps: the step times up to it, evaluations left out; 'faster than "
             "global': Global Lion's seconds over this configuration's, seed by seed):", "",
             "| optimizer | seeds that reached it | step | seconds of steps | faster than "
             "global |", "|---|---|---|---|---|"]
    for spec in specs:
        got = hits[spec.label]
        if not got:
            lines.append(f"| {spec.label} | 0 of {runs[spec.label]} | - | - | - |")
            continue
        ratios = [base[k][1] / v[1] for k, v in sorted(got.items()) if k in base and v[1] > 0]
        lines.append(
            f"| {spec.label} | {len(got)} of {runs[spec.label]} | "
            f"{_pm([float(v[0]) for v in got.values()], '.0f')} | "
            f"{_pm([v[1] for v in got.values()], '.1f')} s | "
            f"{_pm(ratios, '.2f') + 'x' if ratios else '-'} |")
    return [*lines, ""]


def summarize(outcomes: Sequence[Outcome], specs: Sequence[Spec], command: str,
              ranks: int, launcher: str, steps: int, seeds: Sequence[int],
              netbed: str | None = None, image_format: str = "png",
              target: float | None = None) -> str:
    """The markdown report: set-up, main table, verdicts, the time to a validation loss of
    ``target`` when given, per-seed table; the figures are linked as
    ``loss_curves*.<image_format>``."""
    by_label: dict[str, list[dict[str, Any]]] = {s.label: [] for s in specs}
    for o in outcomes:
        if o.record is not None:
            by_label[o.spec.label].append(o.record["summary"])
    val = {k: [s["final_val_loss"] for s in v] for k, v in by_label.items()}
    val_by_seed: dict[str, dict[int, float]] = {s.label: {} for s in specs}
    for o in outcomes:
        if o.record is not None:
            val_by_seed[o.spec.label][o.seed] = float(o.record["summary"]["final_val_loss"])
    base = val_by_seed.get(BASELINE, {})
    first = next((o.record for o in outcomes if o.record is not None), None)
    lines = ["# Lion Cub vs. baselines: final losses", "",
             f"Command: `{command}`", ""]
    if first is not None:
        cfg, run = first["config"], first["run"]
        corpus = run.get("corpus", {})
        lines += [
            f"- {ranks} ranks, {'TCP launcher' if launcher == 'tcp' else 'MPI'} "
            f"(backend `{run.get('backend')}`), {run.get('threads_per_rank')} torch thread(s) "
            "per rank, all ranks on this machine"
            + (f", each in its own network namespace with a {netbed} link to a bridge "
               "(bench/netbed.py)" if netbed else ""),
            f"- model: {run.get('n_params', 0) / 1e6:.2f}M-parameter character transformer "
            f"(d_model {cfg.get('d_model')}, {cfg.get('layers')} layers, {cfg.get('heads')} "
            f"heads), batch {cfg.get('batch_size')} x {cfg.get('seq_len')} per rank, "
            f"{cfg.get('dtype', 'fp32')} on {cfg.get('device', 'cpu')}",
            f"- data: {corpus.get('train_tokens', 0) / 1e6:.2f}M training / "
            f"{corpus.get('val_tokens', 0) / 1e6:.2f}M validation characters of the Python "
            "standard library (validation = held-out files)",
            f"- {steps} steps, lr {cfg.get('lr')} ({cfg.get('schedule')}, warm-up "
            f"{cfg.get('warmup')}), weight decay {cfg.get('weight_decay')}, seeds "
            f"{', '.join(map(str, seeds))}",
            ""]
    lines += ["| optimizer | final val loss | vs global | final train loss | step time | "
              "compute | comm | sent / step / rank | train.py wall time |",
              "|---|---|---|---|---|---|---|---|---|"]
    for spec in specs:
        sums = by_label[spec.label]
        n_fail = sum(1 for o in outcomes if o.spec.label == spec.label and o.record is None)
        fail = f" ({n_fail} failed)" if n_fail else ""
        if not sums:
            lines.append(f"| {spec.label} | failed{fail} | | | | | | | |")
            continue
        lines.append(
            f"| {spec.label}{fail} | {_pm(val[spec.label], '.4f')} | "
            f"{_gap(_paired_gaps(val_by_seed[spec.label], base))} | "
            f"{_pm([s['final_train_loss'] for s in sums], '.4f')} | "
            f"{1e3 * _mean([s['mean_step_time'] for s in sums]):.0f} ms | "
            f"{1e3 * _mean([s['mean_compute_time'] for s in sums]):.0f} ms | "
            f"{1e3 * _mean([s['mean_comm_time'] for s in sums]):.1f} ms | "
            f"{osu.fmt_bytes(_mean([s['bytes_sent_per_step'] for s in sums]))} | "
            f"{_mean([s['wall_time'] for s in sums]):.0f} s |")
    lines += ["", "Final losses are nats per character; the training loss is the mean over "
              "ranks of the last steps, the validation loss the last evaluation. Step time is "
              "averaged over ranks and steps; comm is the time the optimizer spent in its "
              "collectives. \"vs global\" is the relative gap to Global Lion's final "
              "validation loss with the same seed (mean ± standard deviation over seeds).", ""]
    if target is not None:
        lines += _time_to_target(outcomes, specs, target)
    cub = val_by_seed.get(LION_CUB, {})
    maj = val_by_seed.get(MAJORITY, {})
    gaps = _paired_gaps(cub, base)
    if gaps:
        verdict = "met" if _mean(gaps) <= TARGET_GAP else "NOT met"
        lines.append(f"- Lion Cub ({LION_CUB}) vs Global Lion: {_gap(gaps)} final validation "
                     f"loss (target: within {TARGET_GAP:g}%: {verdict}).")
    gaps = _paired_gaps(maj, cub)
    if gaps:
        worse = "worse" if _mean(gaps) > 0 else "not worse"
        seeds_worse = sum(1 for g in gaps if g > 0)
        lines.append(f"- Distributed Lion majority vote ({MAJORITY}) vs Lion Cub: "
                     f"{_gap(gaps)} ({worse} than Lion Cub; higher loss with "
                     f"{seeds_worse} of {len(gaps)} seed{'s' if len(gaps) > 1 else ''}).")
    for spec in specs:
        m = re.fullmatch(r"(.+) \((bf16|fp16)\)", spec.label)
        if m is None or m.group(1) not in val_by_seed:
            continue
        gaps = _paired_gaps(val_by_seed[spec.label], val_by_seed[m.group(1)])
        if gaps:
            ok = all(abs(g) <= DTYPE_GAP for g in gaps)
            lines.append(f"- {spec.label} vs {m.group(1)} in fp32: {_gap(gaps)} final "
                         f"validation loss (target: within {DTYPE_GAP:g}%: "
                         f"{'met' if ok else 'NOT met'}); replicas identical after training "
                         "(checked by train.py, which fails the run otherwise).")
    if val.get("dlion-mavo") and val.get("dlion-mavo") == val.get("lioncub-mavo"):
        lines.append("- dlion-mavo and lioncub-mavo compute the same majority vote with the same "
                     "tie rule, so their losses coincide; they differ in the collective "
                     "(all-gather of sign bits vs. bandwidth-optimal 1-bit all-reduce), hence "
                     "in bytes and time.")
    if first is not None:
        lines += [""]
        for name, _, _, alt in FIGURES:
            lines += [f"![{alt}]({name}.{image_format})", ""]
        lines.pop()
    if len(seeds) > 1 or any(o.record is None for o in outcomes):
        lines += ["", "Per run:", "", "| optimizer | seed | final val loss | final train loss "
                  "| exit | log |", "|---|---|---|---|---|---|"]
        for o in outcomes:
            s = o.record["summary"] if o.record is not None else None
            v = f"{s['final_val_loss']:.4f}" if s else "-"
            t = f"{s['final_train_loss']:.4f}" if s else "-"
            lines.append(f"| {o.spec.label} | {o.seed} | {v} | {t} | {o.returncode} | "
                         f"`logs/{o.log.name}` |")
    return "\n".join(lines) + "\n"


def split_passthrough(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """``(own options, options after "--" passed through to train.py)`` of ``argv`` (default
    ``sys.argv[1:]``)."""
    raw = list(sys.argv[1:] if argv is None else argv)
    if "--" not in raw:
        return raw, []
    cut = raw.index("--")
    return raw[:cut], raw[cut + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    raw, extra = split_passthrough(argv)
    parser = argparse.ArgumentParser(
        prog="compare_optimizers.py",
        description="Run train.py for several optimizers with identical seeds and steps; "
                    "write JSON logs, loss-curve figures and a markdown table. Arguments after "
                    "`--` are passed to every train.py run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--optimizers", nargs="*", default=list(DEFAULT_OPTIMIZERS),
                        metavar="NAME", help="train.py --optimizer values")
    parser.add_argument("--run", action="append", nargs=2, default=[],
                        metavar=("LABEL", "ARGS"),
                        help="an extra run labelled LABEL with the train.py arguments ARGS "
                             "(one quoted string; repeatable)")
    parser.add_argument("-n", "--ranks", type=int, default=4, help="ranks per run")
    parser.add_argument("--launcher", choices=("tcp", "mpi"), default="tcp",
                        help="python -m launch (TCP backend) or mpiexec (MPI backend)")
    parser.add_argument("--netbed", metavar="RATE", default=None,
                        help="run every job on the emulated Ethernet testbed with links of "
                             "RATE (e.g. 1gbit; root only; TCP launcher)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["fp32"],
                        help="run every optimizer with each train.py --dtype; runs in a 16-bit "
                             "dtype are labelled '<optimizer> (<dtype>)' and compared with the "
                             "fp32 run of the same optimizer")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "optimizers")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--title", default="Lion Cub vs. Global Lion and Distributed Lion")
    parser.add_argument("--format", choices=plot_curves.FORMATS, default=plot_curves.FORMATS[0],
                        help="image format of the loss-curve figures")
    parser.add_argument("--target-loss", type=float, default=None, metavar="LOSS",
                        help="also tabulate the time to this validation loss per "
                             "configuration (the runs are not changed: with --reuse, a new "
                             "target needs no new runs)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the results of runs already in --out/logs whose train.py "
                             "command line is unchanged instead of running them again")
    args = parser.parse_args(raw)
    if args.ranks < 1 or args.steps < 1:
        parser.error("--ranks and --steps must be >= 1")
    if args.netbed is not None and args.launcher != "tcp":
        parser.error("--netbed runs the TCP launcher on every emulated host: drop --launcher")
    specs = [Spec(dtype_label(name, dt, args.dtypes), ["--optimizer", name, "--dtype", dt]
                  if dt != "fp32" else ["--optimizer", name])
             for dt in args.dtypes for name in args.optimizers]
    for label, rest in args.run:
        if not label.strip():
            parser.error("--run: empty label")
        specs.append(Spec(label.strip(), shlex.split(rest)))
    if not specs:
        parser.error("nothing to run")
    if len({s.label for s in specs}) != len(specs):
        parser.error("run labels must be distinct")

    logdir = args.out / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "bench/compare_optimizers.py", *raw,
                          *(["--", *extra] if extra else [])])
    outcomes: list[Outcome] = []
    total = len(specs) * len(args.seeds)
    for seed in args.seeds:
        for spec in specs:
            print(f"[{len(outcomes) + 1}/{total}] {spec.label}, seed {seed} ...", end=" ",
                  flush=True)
            o = run_one(spec, seed, args.steps, args.ranks, args.launcher, extra, logdir,
                        args.timeout, args.reuse, args.netbed)
            outcomes.append(o)
            if o.record is not None:
                s = o.record["summary"]
                when = f"{o.seconds:.0f} s" if o.seconds else "reused"
                print(f"val {s['final_val_loss']:.4f}, train {s['final_train_loss']:.4f}, "
                      f"{1e3 * s['mean_step_time']:.0f} ms/step, {when}", flush=True)
            else:
                print(f"FAILED (exit {o.returncode}; see {o.log.with_suffix('.txt')})",
                      flush=True)

    done = [o for o in outcomes if o.record is not None]
    if done:
        records = [o.record for o in done if o.record is not None]
        labels = [o.spec.label for o in done]
        subtitle = plot_curves.subtitle_of(records)
        for name, xaxis, skip, _ in FIGURES:
            runs = plot_curves.group_runs(records, labels, xaxis)
            plot_curves.save_figure(runs, args.out / f"{name}.{args.format}", args.title,
                                    subtitle, xaxis, skip=skip, fmt=args.format)
    report = summarize(outcomes, specs, command, args.ranks, args.launcher, args.steps,
                       args.seeds, args.netbed, args.format, args.target_loss)
    (args.out / "results.md").write_text(report)
    (args.out / "outcomes.json").write_text(json.dumps(
        [{"label": o.spec.label, "args": o.spec.args, "seed": o.seed, "returncode": o.returncode,
          "seconds": o.seconds, "log": str(o.log.relative_to(args.out))} for o in outcomes],
        indent=1) + "\n")
    print()
    print(report)
    print(f"written to {args.out}/ (results.md, loss_curves*.{args.format}, logs/)")
    return 0 if len(done) == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
