#!/usr/bin/env python3
"""End-to-end benchmark: ``train.py`` on the emulated Ethernet testbed, one run per link rate
and optimizer, plus the compute floor; a table, a JSON summary and a figure.

Usage (root: the testbed needs network namespaces, see bench/netbed.py)::

    python bench/e2e.py                                   # 100mbit, 1gbit, 10gbit; 5 optimizers
    python bench/e2e.py --rates 1gbit 100mbit --steps 40 --target-loss 3.2
    python bench/e2e.py --rates 1gbit --configs global lioncub-l1 --batch-size 16 \\
        --seq-len 128 --steps 8 --out results/e2e/default_batch
    python bench/e2e.py --reuse ...                       # keep runs already in --out
    BITCOLL_SEND_BUFFER=0 python bench/e2e.py --rates 100mbit --rtt 50 ...  # far links

Every run is ``python bench/netbed.py --hosts H --rate RATE train.py --model M --batch-size B
--seq-len T --steps S ... --json-log ...`` (one emulated host per rank, hosts
pinned to their share of the cores); arguments after ``--`` go to every run. The
configurations (``--configs``):

* ``global``, ``dlion-mavo``, ``lioncub-mavo``, ``lioncub-l1``: ``--optimizer NAME``;
* ``lioncub-l1+exp4``: ``--optimizer lioncub-l1 --momentum-sync exp:4`` (momenta averaged at
  exponentially spaced steps, which costs float32 all-reduces of the momenta);
* not in the default set, torch DDP: ``ddp-gloo-global`` (``--backend gloo --optimizer
  global``: DDP's float32 average over gloo, then Lion) and ``ddp-hook-lioncub-l1``
  (``--backend bitcoll --hook --optimizer lioncub-l1``: the votes inside DDP's backward).

The *compute floor* is ``train.py --no-comm --optimizer global`` with the same model, per-rank
batch and pinning (run once, on the first rate's testbed: it sends nothing, so the link does
not matter): forward, backward and Lion's arithmetic, with no collective.

Written to ``--out`` (default ``results/e2e``): ``logs/<rate>/<config>-seed<S>.json`` and
``.txt`` (each run's log and console output), ``e2e.json`` (one record per run: step time
split into forward + backward, optimizer and exposed communication, bytes sent per step and
rank, the step and seconds of steps at which the validation loss first reached the target,
final validation loss), ``results.md`` (the commands and the tables) and ``e2e.png`` (left:
mean step time against link rate per configuration, the compute floor dashed; then one panel
per rate: validation loss against seconds of steps). Step times are means over ranks and steps
(the first three steps of a run left out, see train.py); "seconds of steps" sums the step times
up to an evaluation (warm-up step and evaluations left out).

Exit status 0 when every run succeeded, 1 otherwise (the others are still reported).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_optimizers as compare  # sibling scripts, not a package
import netbed as netbed_tool
import osu

ROOT = Path(__file__).resolve().parents[1]
CONFIGS: dict[str, list[str]] = {
    "global": ["--optimizer", "global"],
    "dlion-mavo": ["--optimizer", "dlion-mavo"],
    "lioncub-mavo": ["--optimizer", "lioncub-mavo"],
    "lioncub-l1": ["--optimizer", "lioncub-l1"],
    "lioncub-l1+exp4": ["--optimizer", "lioncub-l1", "--momentum-sync", "exp:4"],
    # torch DDP: gloo's float32 gradient average then Lion, against Lion Cub's votes inside
    # DDP's backward over the bitcoll torch backend (not in the default set)
    "ddp-gloo-global": ["--backend", "gloo", "--optimizer", "global"],
    "ddp-hook-lioncub-l1": ["--backend", "bitcoll", "--hook", "--optimizer", "lioncub-l1"],
}
DEFAULT_CONFIGS = ("global", "dlion-mavo", "lioncub-mavo", "lioncub-l1", "lioncub-l1+exp4")
FLOOR = "compute floor"
FLOOR_ARGS = ["--optimizer", "global", "--no-comm"]
DEFAULT_RATES = ("100mbit", "1gbit", "10gbit")


@dataclass
class Point:
    """One finished run, reduced to the figures of the report."""

    rate: str
    config: str
    step_time: float
    forward_backward: float
    optimizer: float
    comm: float
    bytes_sent: float
    final_val: float
    target_step: int | None
    target_seconds: float | None
    evals: list[tuple[float, float]]  # (seconds of steps, validation loss)
    log: str

    def as_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "rate_bits": netbed_tool.parse_rate(self.rate),
                "config": self.config, "step_time": self.step_time,
                "forward_backward": self.forward_backward, "optimizer": self.optimizer,
                "comm": self.comm, "bytes_sent_per_step": self.bytes_sent,
                "final_val_loss": self.final_val, "target_step": self.target_step,
                "target_step_seconds": self.target_seconds, "evals": self.evals,
                "log": self.log}


def point_of(rate: str, config: str, record: dict[str, Any], log: Path,
             target: float | None) -> Point:
    """The figures of one ``train.py`` log; the target is found as ``train.py --target-loss``
    finds it (first evaluation at or below it), so that it can change without new runs."""
    s = record["summary"]
    hit = None if target is None else compare.first_at_or_below(record, target)
    return Point(rate, config, s["mean_step_time"], s["mean_forward_backward_time"],
                 s["mean_optimizer_time"], s["mean_comm_time"], s["bytes_sent_per_step"],
                 s["final_val_loss"], None if hit is None else int(hit["step"]),
                 None if hit is None else float(hit["step_seconds"]),
                 [(float(e["step_seconds"]), float(e["val_loss"])) for e in record["evals"]],
                 str(log))


def _ms(x: float) -> str:
    return f"{1e3 * x:.0f} ms"


def report(points: Sequence[Point], failed: Sequence[str], commands: Sequence[str],
           setup: str, target: float | None) -> str:
    """The markdown report: commands, set-up, one table row per run, the floor and the
    communication-to-compute ratio of Global Lion."""
    lines = ["# End-to-end: train.py on the emulated Ethernet testbed", "", "Commands:", ""]
    lines += [f"    {c}" for c in commands]
    lines += ["", setup, "",
              "| link | optimizer | step time | forward + backward | optimizer | exposed comm "
              f"| sent / step / rank | val loss <= {target:g}: step | seconds of steps | "
              "final val loss |" if target is not None else
              "| link | optimizer | step time | forward + backward | optimizer | exposed comm "
              "| sent / step / rank | - | - | final val loss |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        reached = p.target_step is not None and p.target_seconds is not None
        lines.append(
            f"| {p.rate if p.config != FLOOR else '(none)'} | {p.config} | {_ms(p.step_time)} | "
            f"{_ms(p.forward_backward)} | {_ms(p.optimizer)} | {_ms(p.comm)} | "
            f"{osu.fmt_bytes(p.bytes_sent)} | {p.target_step if reached else 'not reached'} | "
            f"{f'{p.target_seconds:.1f} s' if reached else '-'} | {p.final_val:.4f} |")
    for f in failed:
        lines.append(f"| {f} | failed | | | | | | | | |")
    floor = next((p for p in points if p.config == FLOOR), None)
    lines += ["", "Step time = forward + backward + optimizer (arithmetic, packing) + exposed "
              "communication (time blocked in collectives), means over ranks and steps. "
              "Seconds of steps: sum of step times up to the first evaluation at or below the "
              "target (warm-up step and evaluations left out). The compute floor trains "
              "every rank's replica alone (no collective), so its validation loss is not that "
              "of a data-parallel run.", ""]
    for p in points:
        if p.config == "global" and p.forward_backward + p.optimizer > 0:
            ratio = p.comm / (p.forward_backward + p.optimizer)
            lines.append(f"- Global Lion at {p.rate}: exposed communication {ratio:.1f} x its "
                         "compute.")
    if floor is not None:
        lines.append(f"- Compute floor: {_ms(floor.step_time)} per step.")
    return "\n".join(lines) + "\n"


def plot(points: Sequence[Point], rates: Sequence[str], path: Path, title: str,
         target: float | None) -> None:
    """Step time against link rate (left) and validation loss against seconds of steps at
    each rate (one panel per rate), written as PNG."""
    import plot_curves
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    configs = [c for c in CONFIGS if any(p.config == c for p in points)]
    style = {c: (plot_curves.PALETTE[i], plot_curves.DASHES[i % len(plot_curves.DASHES)])
             for i, c in enumerate(configs)}
    shown = [r for r in rates if any(p.rate == r and p.config != FLOOR for p in points)]
    fig = Figure(figsize=(5.0 * (1 + len(shown)), 5.2), facecolor="#fafafa")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 1 + len(shown), squeeze=False)[0]
    fig.suptitle(title, fontsize=13, fontweight="bold")
    ax = axes[0]
    for c in configs:
        pts = sorted((netbed_tool.parse_rate(p.rate) / 1e6, 1e3 * p.step_time)
                     for p in points if p.config == c)
        ax.plot([x for x, _ in pts], [y for _, y in pts], color=style[c][0],
                linestyle=style[c][1], marker="o", linewidth=2, label=c)
    floor = next((p for p in points if p.config == FLOOR), None)
    if floor is not None:
        ax.axhline(1e3 * floor.step_time, color="#555555", linestyle="--", linewidth=1.5,
                   label=FLOOR)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (Mbit/s)")
    ax.set_ylabel("mean step time (ms)")
    ax.set_title("Step time against link rate")
    ax.grid(True, which="both", color="#e5e5e5")
    ax.legend(fontsize=9)
    for ax, rate in zip(axes[1:], shown, strict=True):
        for c in configs:
            for p in points:
                if p.rate == rate and p.config == c:
                    ax.plot([x for x, _ in p.evals], [y for _, y in p.evals],
                            color=style[c][0], linestyle=style[c][1], marker="o",
                            linewidth=2, label=c)
        if target is not None:
            ax.axhline(target, color="#999999", linestyle=":", linewidth=1)
        ax.set_xlabel("seconds of steps (evaluations left out)")
        ax.set_ylabel("validation loss (nats/char)")
        ax.set_title(f"Validation loss, {rate} links")
        ax.grid(True, color="#e5e5e5")
        ax.legend(fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110, facecolor=fig.get_facecolor())


def main(argv: Sequence[str] | None = None) -> int:
    raw, extra = compare.split_passthrough(argv)
    p = argparse.ArgumentParser(
        prog="e2e.py", description="train.py on the emulated Ethernet testbed: step time, "
        "bytes and time to a validation loss per link rate and optimizer, plus the compute "
        "floor. Arguments after `--` go to every train.py run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", nargs="+", default=list(DEFAULT_RATES),
                   help="link rates, run in this order")
    p.add_argument("--configs", nargs="*", choices=list(CONFIGS), default=list(DEFAULT_CONFIGS),
                   help="optimizer configurations (none: only the compute floor)")
    p.add_argument("--no-floor", action="store_true", help="skip the compute floor run")
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts (one rank each)")
    p.add_argument("--rtt", type=float, default=0.0, metavar="MS",
                   help="round trip added to every link (bench/netbed.py --rtt; far links "
                   "also want BITCOLL_SEND_BUFFER=0 in the environment)")
    p.add_argument("--model", default="small", help="train.py --model")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--target-loss", type=float, default=3.2,
                   help="validation loss whose first evaluation at or below it is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "e2e")
    p.add_argument("--reuse", action="store_true",
                   help="keep runs already in --out whose command line is unchanged")
    args = p.parse_args(raw)
    try:
        for r in args.rates:
            netbed_tool.parse_rate(r)
    except ValueError as exc:
        p.error(str(exc))
    if args.rtt < 0:
        p.error("--rtt must be >= 0")
    common = ["--model", args.model, "--batch-size", str(args.batch_size), "--seq-len",
              str(args.seq_len), "--lr", str(args.lr), "--eval-every", str(args.eval_every),
              "--eval-batches", str(args.eval_batches), *extra]
    jobs: list[tuple[str, compare.Spec]] = []
    if not args.no_floor:
        jobs.append((args.rates[0], compare.Spec(FLOOR, FLOOR_ARGS)))
    jobs += [(rate, compare.Spec(c, CONFIGS[c])) for rate in args.rates for c in args.configs]
    points: list[Point] = []
    failed: list[str] = []
    commands = [shlex.join(["python", "bench/e2e.py", *raw, *(["--", *extra] if extra
                                                             else [])])]
    for i, (rate, spec) in enumerate(jobs, 1):
        logdir = args.out / "logs" / rate
        logdir.mkdir(parents=True, exist_ok=True)
        print(f"[{i}/{len(jobs)}] {spec.label} at {rate} ...", end=" ", flush=True)
        o = compare.run_one(spec, args.seed, args.steps, args.hosts, "tcp", common, logdir,
                            args.timeout, args.reuse, rate, args.rtt)
        console = o.log.with_suffix(".txt")
        if len(commands) < 3 and console.exists():  # the floor's and one optimizer's command
            head = console.read_text().split("\n", 1)[0]
            if head.startswith("$ "):
                commands.append(head[2:])
        if o.record is None:
            print(f"FAILED (exit {o.returncode}; see {console})", flush=True)
            failed.append(f"{rate} {spec.label}")
            continue
        pt = point_of(rate, spec.label, o.record, o.log.relative_to(args.out), args.target_loss)
        points.append(pt)
        print(f"{_ms(pt.step_time)}/step (comm {_ms(pt.comm)}), val {pt.final_val:.4f}, "
              f"target {'step ' + str(pt.target_step) if pt.target_step else 'not reached'}",
              flush=True)
    first_rec = next((json.loads(Path(args.out / pt.log).read_text()) for pt in points), None)
    setup = ""
    if first_rec is not None:
        run, cfg = first_rec["run"], first_rec["config"]
        links = f", {args.rtt:g} ms round trips added by the delay line" if args.rtt else ""
        if "BITCOLL_SEND_BUFFER" in os.environ:
            links += f", BITCOLL_SEND_BUFFER={os.environ['BITCOLL_SEND_BUFFER']}"
        setup = (f"{args.hosts} emulated hosts (bench/netbed.py: one network namespace and one "
                 f"rank each, hosts pinned to their share of the cores{links}, "
                 f"{run.get('threads_per_rank')} torch thread(s) per rank); model "
                 f"`{cfg.get('model')}` ({run.get('n_params', 0) / 1e6:.2f}M parameters), "
                 f"batch {cfg.get('batch_size')} x {cfg.get('seq_len')} characters per rank, "
                 f"{cfg.get('steps')} steps, lr {cfg.get('lr')}, {cfg.get('dtype')}; "
                 f"evaluation every {cfg.get('eval_every')} steps on "
                 f"{cfg.get('eval_batches')} x {cfg.get('batch_size')} windows per rank.")
    text = report(points, failed, commands, setup, args.target_loss)
    (args.out / "results.md").write_text(text)
    (args.out / "e2e.json").write_text(json.dumps(
        {"command": commands[0], "points": [pt.as_dict() for pt in points],
         "failed": failed}, indent=1) + "\n")
    if points:
        plot(points, args.rates, args.out / "e2e.png",
             f"train.py --model {args.model}, {args.hosts} hosts"
             f"{f', {args.rtt:g} ms round trips' if args.rtt else ''}, batch "
             f"{args.batch_size} x {args.seq_len} per rank", args.target_loss)
    print()
    print(text)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
