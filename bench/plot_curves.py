#!/usr/bin/env python3
"""Plot the training and validation loss curves of ``train.py`` runs with matplotlib (PNG by
default, SVG on request).

Usage::

    python bench/plot_curves.py runs/global.json runs/lioncub-l1.json -o loss_curves.png
    python bench/plot_curves.py results/optimizers/logs/*.json -o curves.svg --x time \\
        --title "4 ranks, TCP"

Every argument is a JSON log written by ``train.py --json-log``. A run is labelled by its
optimizer (plus ``levels`` and ``momentum_sync`` when set) unless ``--label`` names it; logs
with the same label (e.g. several seeds) are averaged point by point over the steps they share,
and the legend says how many were averaged. The figure has two panels, the training loss
(mean over ranks, smoothed by a bias-corrected exponential moving average) and the validation
loss, both against the step (``--x step``) or the elapsed training time (``--x time``). The
y range leaves out the first part of the run (``--skip``, 10% by default) so that the initial
loss of ~4.6 does not flatten the differences at the end; curves are clipped at the frame.

The image format is ``--format`` (``png`` or ``svg``), else the extension of ``-o`` (``.png``
or ``.svg``), else PNG; ``-o`` defaults to ``loss_curves.<format>``. Drawn with matplotlib's
Agg canvas (no display needed); matplotlib comes with the project's ``bench`` extra
(``pip install -e .[bench]``, which ``dev.py`` installs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lioncub.recipe.logs import LOG_FORMAT

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Run", "FORMATS", "load_log", "run_label", "group_runs", "subtitle_of", "ema",
           "figure", "save_figure", "image_format", "main"]

#: Image formats :func:`save_figure` writes; the first is the default.
FORMATS = ("png", "svg")
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#17becf", "#7f7f7f", "#bcbd22")
#: Dash patterns (matplotlib line styles), cycled together with the colours so that
#: coinciding curves stay visible.
DASHES: tuple[Any, ...] = ("-", (0, (7, 4)), (0, (2, 3)), (0, (11, 3, 2, 3)), (0, (4, 2)))
#: Pixels per inch of PNG output (the figure is 11 inches wide).
DPI = 120


@dataclass
class Run:
    """One curve of the figure: a label and the (averaged) series of one or more logs.

    ``train_x``/``train_y``: per-step training loss; ``val_x``/``val_y``: evaluations. x values
    are steps or seconds of training, depending on how the run was built.
    """

    label: str
    train_x: list[float] = field(default_factory=list)
    train_y: list[float] = field(default_factory=list)
    val_x: list[float] = field(default_factory=list)
    val_y: list[float] = field(default_factory=list)
    count: int = 1

    @property
    def final_val(self) -> float:
        return self.val_y[-1] if self.val_y else math.nan


def load_log(path: str | Path) -> dict[str, Any]:
    """Read and check a ``train.py`` JSON log; raise ``ValueError`` if it is not one."""
    try:
        record = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != LOG_FORMAT:
        raise ValueError(f"{path}: not a train.py log (format {LOG_FORMAT!r} expected)")
    for key in ("config", "steps", "evals"):
        if key not in record:
            raise ValueError(f"{path}: the log has no {key!r} section")
    return record


def run_label(record: dict[str, Any]) -> str:
    """Default label of a log: the optimizer, plus levels, momentum sync and a 16-bit
    ``--dtype`` when set."""
    cfg = record["config"]
    parts = [str(cfg.get("optimizer", "?"))]
    if cfg.get("levels") is not None:
        parts.append(f"s={cfg['levels']}")
    if cfg.get("momentum_sync"):
        parts.append(f"sync={cfg['momentum_sync']}")
    if cfg.get("dtype", "fp32") != "fp32":
        parts.append(str(cfg["dtype"]))
    return " ".join(parts)


def _series(record: dict[str, Any], xaxis: str) -> tuple[list[float], list[float],
                                                          list[float], list[float]]:
    steps = record["steps"]
    if xaxis == "time":
        tx: list[float] = []
        total = 0.0
        for s in steps:
            total += float(s["time"])
            tx.append(total)
        vx = [float(e["elapsed"]) for e in record["evals"]]
    else:
        tx = [float(s["step"]) for s in steps]
        vx = [float(e["step"]) for e in record["evals"]]
    return tx, [float(s["loss"]) for s in steps], vx, [float(e["val_loss"]) for e in
                                                      record["evals"]]


def _mean_by_key(xs: list[list[float]], ys: list[list[float]], keys: list[list[float]]
                 ) -> tuple[list[float], list[float]]:
    """Average series sharing keys (steps); x is averaged too (it is time for --x time)."""
    common = set(keys[0]).intersection(*map(set, keys[1:]))
    out_x: list[float] = []
    out_y: list[float] = []
    for k in sorted(common):
        px = [x[kk.index(k)] for x, kk in zip(xs, keys, strict=True)]
        py = [y[kk.index(k)] for y, kk in zip(ys, keys, strict=True)]
        out_x.append(sum(px) / len(px))
        out_y.append(sum(py) / len(py))
    return out_x, out_y


def group_runs(records: Sequence[dict[str, Any]], labels: Sequence[str] | None = None,
               xaxis: str = "step") -> list[Run]:
    """Build one :class:`Run` per distinct label, in order of first appearance; logs sharing
    a label are averaged over their common steps / evaluation steps."""
    if labels is not None and len(labels) != len(records):
        raise ValueError(f"{len(labels)} labels for {len(records)} logs")
    names = list(labels) if labels is not None else [run_label(r) for r in records]
    order: list[str] = []
    members: dict[str, list[dict[str, Any]]] = {}
    for name, rec in zip(names, records, strict=True):
        if name not in members:
            order.append(name)
            members[name] = []
        members[name].append(rec)
    runs = []
    for name in order:
        group = members[name]
        series = [_series(r, xaxis) for r in group]
        step_keys = [[float(s["step"]) for s in r["steps"]] for r in group]
        eval_keys = [[float(e["step"]) for e in r["evals"]] for r in group]
        tx, ty = _mean_by_key([s[0] for s in series], [s[1] for s in series], step_keys)
        vx, vy = _mean_by_key([s[2] for s in series], [s[3] for s in series], eval_keys)
        runs.append(Run(name, tx, ty, vx, vy, len(group)))
    return runs


def ema(values: Sequence[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average (``beta=0``: the values themselves)."""
    out = []
    avg = 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i) if beta > 0 else v)
    return out


def _y_range(series: list[tuple[list[float], list[float]]], skip_x: float,
             ymin: float | None, ymax: float | None) -> tuple[float, float]:
    vals = [y for xs, ys in series for x, y in zip(xs, ys, strict=True)
            if x >= skip_x and math.isfinite(y)]
    if not vals:
        vals = [y for _, ys in series for y in ys if math.isfinite(y)] or [0.0, 1.0]
    lo, hi = min(vals), max(vals)
    pad = (hi - lo) * 0.06 or 0.05
    lo, hi = lo - pad, hi + pad
    return (lo if ymin is None else ymin), (hi if ymax is None else ymax)


def _panel(ax: Axes, title: str, xlabel: str, xlim: tuple[float, float],
           ylim: tuple[float, float], curves: list[tuple[Run, list[float], list[float]]],
           styles: dict[str, tuple[str, Any]], markers: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    for run, xs, ys in curves:
        color, dash = styles[run.label]
        ax.plot(xs, ys, color=color, linestyle=dash, linewidth=1.8,
                marker="o" if markers else None, markersize=4, markeredgecolor="white",
                markeredgewidth=0.6, solid_joinstyle="round", dash_joinstyle="round")
    ax.set_title(title, fontsize=12, fontweight="bold")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats / character)")
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    ax.grid(True, color="#e5e5e5", linewidth=0.8)
    ax.set_axisbelow(True)


def figure(runs: Sequence[Run], title: str, subtitle: str = "", xaxis: str = "step",
           smooth: float = 0.9, skip: float = 0.1, ymin: float | None = None,
           ymax: float | None = None) -> Figure:
    """The figure: title, subtitle, the training panel (EMA ``smooth``), the validation
    panel and a legend with each run's final validation loss, on matplotlib's Agg canvas.

    ``skip``: fraction of the x range left out when choosing the y range. ``ymin``/``ymax``
    fix the y range of both panels. Raises ``ValueError`` for no runs, ``RuntimeError`` when
    matplotlib is not installed.
    """
    if not runs:
        raise ValueError("nothing to plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as exc:
        raise RuntimeError(f"plotting needs matplotlib ({exc}); install the bench extra: "
                           "pip install -e .[bench]") from None
    styles = {r.label: (PALETTE[i % len(PALETTE)], DASHES[i % len(DASHES)])
              for i, r in enumerate(runs)}
    train = [(r.train_x, ema(r.train_y, smooth)) for r in runs]
    val = [(r.val_x, r.val_y) for r in runs]
    xs_all = [x for xs, _ in train + val for x in xs]
    xlo = 0.0
    xhi = max(xs_all) if xs_all else 1.0
    xhi = xhi if xhi > xlo else xlo + 1.0
    skip_x = xlo + skip * (xhi - xlo)
    columns = 1 if len(runs) == 1 else 2
    rows = math.ceil(len(runs) / columns)
    # layout in inches from the top: title, subtitle, panels (4 in), axis labels, legend
    head = 1.35 if subtitle else 1.0
    legend_h = 0.3 * rows + 0.2
    height = head + 4.0 + 0.65 + legend_h
    fig = Figure(figsize=(11.0, height), facecolor="#fafafa")
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.075, right=0.985, top=1 - head / height,
                        bottom=(legend_h + 0.65) / height, wspace=0.22)
    left, right = fig.subplots(1, 2)
    fig.suptitle(title, fontsize=16, fontweight="bold", y=1 - 0.2 / height, va="top")
    if subtitle:
        fig.text(0.5, 1 - 0.6 / height, subtitle, ha="center", va="top", fontsize=11,
                 color="#555555")
    xlabel = "training time (s)" if xaxis == "time" else "step"
    smooth_note = f", EMA {smooth:g}" if smooth > 0 else ""
    _panel(left, f"Training loss (mean over ranks{smooth_note})", xlabel, (xlo, xhi),
           _y_range(train, skip_x, ymin, ymax),
           [(r, xs, ys) for r, (xs, ys) in zip(runs, train, strict=True)], styles, False)
    _panel(right, "Validation loss (held-out files)", xlabel, (xlo, xhi),
           _y_range(val, skip_x, ymin, ymax), [(r, r.val_x, r.val_y) for r in runs], styles,
           True)
    handles = [Line2D([], [], color=styles[r.label][0], linestyle=styles[r.label][1],
                      linewidth=2.5, marker="o", markersize=5) for r in runs]
    labels = []
    for r in runs:
        extra = f" (mean of {r.count})" if r.count > 1 else ""
        final = f"final val {r.final_val:.4f}" if math.isfinite(r.final_val) else "no eval"
        labels.append(f"{r.label}{extra} — {final}")
    # row-major order: matplotlib fills a legend column by column
    order = [i for c in range(columns) for i in range(c, len(runs), columns)]
    fig.legend([handles[i] for i in order], [labels[i] for i in order], ncols=columns,
               loc="lower center", bbox_to_anchor=(0.5, 0.1 / height),
               frameon=False, fontsize=11, handlelength=3.0)
    return fig


def image_format(path: Path, fmt: str | None = None) -> str:
    """The format to write ``path`` in: ``fmt`` when given, else its extension when that is
    one of :data:`FORMATS`, else the default (PNG). ValueError for an unknown ``fmt``."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown image format {fmt!r}; expected one of "
                             f"{', '.join(FORMATS)}")
        return fmt
    suffix = path.suffix.lower().lstrip(".")
    return suffix if suffix in FORMATS else FORMATS[0]


def save_figure(runs: Sequence[Run], path: Path, title: str, subtitle: str = "",
                xaxis: str = "step", smooth: float = 0.9, skip: float = 0.1,
                ymin: float | None = None, ymax: float | None = None,
                fmt: str | None = None) -> str:
    """Draw :func:`figure` and write it to ``path`` (parents created) in
    :func:`image_format` ``(path, fmt)``; return the format written. SVG text stays text
    (searchable) and both formats carry no date, so the same runs give the same file."""
    from matplotlib import rc_context

    kind = image_format(path, fmt)
    fig = figure(runs, title, subtitle, xaxis, smooth, skip, ymin, ymax)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata: dict[str, str | None] = {"Date": None} if kind == "svg" else {}
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "plot_curves"}):
        fig.savefig(path, format=kind, dpi=DPI, facecolor=fig.get_facecolor(),
                    metadata=metadata)
    return kind


def subtitle_of(records: Sequence[dict[str, Any]]) -> str:
    runs = [r.get("run", {}) for r in records]
    cfgs = [r["config"] for r in records]
    parts = []
    sizes = {x.get("world_size") for x in runs}
    backends = {x.get("backend") for x in runs}
    if len(sizes) == 1 and None not in sizes:
        size = sizes.pop()
        b = f" ({backends.pop()})" if len(backends) == 1 and None not in backends else ""
        parts.append(f"{size} rank{'s' if size != 1 else ''}{b}")
    params = {x.get("n_params") for x in runs}
    if len(params) == 1 and None not in params:
        parts.append(f"{params.pop() / 1e6:.2f}M-parameter character transformer")
    for key, fmt in (("steps", "{} steps"), ("batch_size", "batch {} per rank"),
                     ("lr", "lr {}")):
        vals = {c.get(key) for c in cfgs}
        if len(vals) == 1 and None not in vals:
            parts.append(fmt.format(vals.pop()))
    seeds = sorted({c.get("seed") for c in cfgs if c.get("seed") is not None})
    if seeds:
        parts.append(("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds)))
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="plot_curves.py", description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path, help="train.py JSON logs")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="image file to write (default: loss_curves.<format>)")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="image format (default: from the extension of --output, else "
                             "png)")
    parser.add_argument("--title", default="Lion Cub vs. baselines: loss curves")
    parser.add_argument("--subtitle", default=None,
                        help="line under the title (default: derived from the logs)")
    parser.add_argument("--label", action="append", default=None, metavar="NAME",
                        help="label of each log, in order (repeat once per log)")
    parser.add_argument("--x", dest="xaxis", choices=("step", "time"), default="step",
                        help="x axis: step or training time")
    parser.add_argument("--smooth", type=float, default=0.9,
                        help="EMA factor of the training curve, in [0, 1)")
    parser.add_argument("--skip", type=float, default=0.1,
                        help="fraction of the x range ignored when choosing the y range")
    parser.add_argument("--ymin", type=float, default=None)
    parser.add_argument("--ymax", type=float, default=None)
    args = parser.parse_args(argv)
    if not 0 <= args.smooth < 1:
        parser.error("--smooth must be in [0, 1)")
    if not 0 <= args.skip < 1:
        parser.error("--skip must be in [0, 1)")
    if args.label is not None and len(args.label) != len(args.logs):
        parser.error(f"{len(args.label)} --label for {len(args.logs)} logs")
    output: Path = args.output or Path(f"loss_curves.{args.format or FORMATS[0]}")
    suffix = output.suffix.lower().lstrip(".")
    if args.format is not None and suffix in FORMATS and suffix != args.format:
        parser.error(f"--format {args.format} but --output {output} ends in .{suffix}")
    try:
        records = [load_log(p) for p in args.logs]
    except (OSError, ValueError) as exc:
        print(f"plot_curves.py: {exc}", file=sys.stderr)
        return 1
    runs = group_runs(records, args.label, args.xaxis)
    subtitle = subtitle_of(records) if args.subtitle is None else args.subtitle
    try:
        kind = save_figure(runs, output, args.title, subtitle, args.xaxis, args.smooth,
                           args.skip, args.ymin, args.ymax, args.format)
    except (OSError, RuntimeError) as exc:
        print(f"plot_curves.py: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {output} ({kind.upper()}, {len(runs)} curve{'s' if len(runs) != 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
