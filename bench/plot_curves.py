#!/usr/bin/env python3
"""Plot the training and validation loss curves of ``train.py`` runs as an SVG (stdlib only).

Usage::

    python bench/plot_curves.py runs/global.json runs/lioncub-l1.json -o loss_curves.svg
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
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

__all__ = ["Run", "load_log", "run_label", "group_runs", "subtitle_of", "nice_ticks",
           "render_svg", "main"]

LOG_FORMAT = "lioncub-train-log/1"
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#17becf", "#7f7f7f", "#bcbd22")
#: Dash patterns, cycled together with the colours so that coinciding curves stay visible.
DASHES = ("", "7 4", "2 3", "11 3 2 3", "4 2")
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"


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
    """Default label of a log: the optimizer, plus levels and momentum sync when set."""
    cfg = record["config"]
    parts = [str(cfg.get("optimizer", "?"))]
    if cfg.get("levels") is not None:
        parts.append(f"s={cfg['levels']}")
    if cfg.get("momentum_sync"):
        parts.append(f"sync={cfg['momentum_sync']}")
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


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 times a power of ten) covering ``[lo, hi]``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) * 0.1 or 1.0)
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _fmt_tick(v: float, ticks: Sequence[float]) -> str:
    """``v`` with as many decimals as the tick spacing needs (``12k`` for large round values)."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else abs(v) or 1.0
    decimals = next(d for d in range(8) if abs(round(step, d) - step) <= 1e-9 * step or d == 7)
    if decimals == 0 and abs(v) >= 10000 and v % 1000 == 0:
        return f"{v / 1000:g}k"
    return f"{v:.{decimals}f}"


@dataclass
class _Panel:
    x0: float
    y0: float
    w: float
    h: float
    xlo: float
    xhi: float
    ylo: float
    yhi: float

    def px(self, x: float) -> float:
        return self.x0 + (x - self.xlo) / (self.xhi - self.xlo) * self.w

    def py(self, y: float) -> float:
        return self.y0 + self.h - (y - self.ylo) / (self.yhi - self.ylo) * self.h


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


def _panel_svg(out: list[str], pid: str, panel: _Panel, title: str, xlabel: str,
               curves: list[tuple[str, str, list[float], list[float], bool]]) -> None:
    p = panel
    xt = [t for t in nice_ticks(p.xlo, p.xhi) if p.xlo <= t <= p.xhi]
    yt = [t for t in nice_ticks(p.ylo, p.yhi) if p.ylo <= t <= p.yhi]
    out.append(f'<text x="{p.x0 + p.w / 2:.1f}" y="{p.y0 - 10:.1f}" text-anchor="middle" '
               f'font-size="14" font-weight="bold">{escape(title)}</text>')
    out.append(f'<rect x="{p.x0:.1f}" y="{p.y0:.1f}" width="{p.w:.1f}" height="{p.h:.1f}" '
               'fill="#ffffff" stroke="none"/>')
    for t in yt:
        y = p.py(t)
        out.append(f'<line x1="{p.x0:.1f}" y1="{y:.1f}" x2="{p.x0 + p.w:.1f}" y2="{y:.1f}" '
                   'stroke="#e5e5e5" stroke-width="1"/>')
        out.append(f'<line x1="{p.x0 - 5:.1f}" y1="{y:.1f}" x2="{p.x0:.1f}" y2="{y:.1f}" '
                   'stroke="#333" stroke-width="1"/>')
        out.append(f'<text x="{p.x0 - 8:.1f}" y="{y + 4:.1f}" text-anchor="end" '
                   f'font-size="11">{_fmt_tick(t, yt)}</text>')
    for t in xt:
        x = p.px(t)
        out.append(f'<line x1="{x:.1f}" y1="{p.y0:.1f}" x2="{x:.1f}" y2="{p.y0 + p.h:.1f}" '
                   'stroke="#f0f0f0" stroke-width="1"/>')
        out.append(f'<line x1="{x:.1f}" y1="{p.y0 + p.h:.1f}" x2="{x:.1f}" '
                   f'y2="{p.y0 + p.h + 5:.1f}" stroke="#333" stroke-width="1"/>')
        out.append(f'<text x="{x:.1f}" y="{p.y0 + p.h + 19:.1f}" text-anchor="middle" '
                   f'font-size="11">{_fmt_tick(t, xt)}</text>')
    out.append(f'<clipPath id="{pid}"><rect x="{p.x0:.1f}" y="{p.y0:.1f}" width="{p.w:.1f}" '
               f'height="{p.h:.1f}"/></clipPath>')
    out.append(f'<g clip-path="url(#{pid})" fill="none" stroke-linejoin="round" '
               'stroke-linecap="round">')
    for color, dash, xs, ys, markers in curves:
        pts = [(p.px(x), p.py(y)) for x, y in zip(xs, ys, strict=True) if math.isfinite(y)]
        if not pts:
            continue
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<polyline points="{path}" stroke="{color}" stroke-width="1.8"'
                   f'{dash_attr}/>')
        if markers:
            out.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.6" fill="{color}" '
                       'stroke="#fff" stroke-width="0.6"/>' for x, y in pts)
    out.append("</g>")
    out.append(f'<rect x="{p.x0:.1f}" y="{p.y0:.1f}" width="{p.w:.1f}" height="{p.h:.1f}" '
               'fill="none" stroke="#333" stroke-width="1"/>')
    out.append(f'<text x="{p.x0 + p.w / 2:.1f}" y="{p.y0 + p.h + 38:.1f}" '
               f'text-anchor="middle" font-size="12">{escape(xlabel)}</text>')
    cy = p.y0 + p.h / 2
    out.append(f'<text x="{p.x0 - 48:.1f}" y="{cy:.1f}" text-anchor="middle" font-size="12" '
               f'transform="rotate(-90 {p.x0 - 48:.1f} {cy:.1f})">loss (nats / character)'
               "</text>")


def render_svg(runs: Sequence[Run], title: str, subtitle: str = "", xaxis: str = "step",
               smooth: float = 0.9, skip: float = 0.1, ymin: float | None = None,
               ymax: float | None = None) -> str:
    """The figure as SVG text: title, subtitle, the training panel (EMA ``smooth``), the
    validation panel and a legend with each run's final validation loss.

    ``skip``: fraction of the x range left out when choosing the y range. ``ymin``/``ymax``
    fix the y range of both panels. Raises ``ValueError`` for no runs.
    """
    if not runs:
        raise ValueError("nothing to plot")
    colors = {r.label: PALETTE[i % len(PALETTE)] for i, r in enumerate(runs)}
    dashes = {r.label: DASHES[i % len(DASHES)] for i, r in enumerate(runs)}
    train = [(r.train_x, ema(r.train_y, smooth)) for r in runs]
    val = [(r.val_x, r.val_y) for r in runs]
    xs_all = [x for xs, _ in train + val for x in xs]
    xlo = 0.0
    xhi = max(xs_all) if xs_all else 1.0
    xhi = xhi if xhi > xlo else xlo + 1.0
    skip_x = xlo + skip * (xhi - xlo)
    width, pw, ph = 1100.0, 440.0, 330.0
    top = 100.0 if subtitle else 80.0
    left = _Panel(90.0, top, pw, ph, xlo, xhi, *_y_range(train, skip_x, ymin, ymax))
    right = _Panel(width - 50.0 - pw, top, pw, ph, xlo, xhi, *_y_range(val, skip_x, ymin, ymax))
    columns = 1 if len(runs) == 1 else 2 if len(runs) <= 4 else 3
    rows = math.ceil(len(runs) / columns)
    legend_top = top + ph + 62.0
    height = legend_top + 26.0 * rows + 20.0

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="{FONT}" fill="#222">',
           f'<rect width="{width:.0f}" height="{height:.0f}" fill="#fafafa"/>',
           f'<text x="{width / 2:.1f}" y="34" text-anchor="middle" font-size="19" '
           f'font-weight="bold">{escape(title)}</text>']
    if subtitle:
        out.append(f'<text x="{width / 2:.1f}" y="58" text-anchor="middle" font-size="13" '
                   f'fill="#555">{escape(subtitle)}</text>')
    xlabel = "training time (s)" if xaxis == "time" else "step"
    smooth_note = f", EMA {smooth:g}" if smooth > 0 else ""
    _panel_svg(out, "clip-train", left, f"Training loss (mean over ranks{smooth_note})",
               xlabel, [(colors[r.label], dashes[r.label], xs, ys, False)
                        for r, (xs, ys) in zip(runs, train, strict=True)])
    _panel_svg(out, "clip-val", right, "Validation loss (held-out files)", xlabel,
               [(colors[r.label], dashes[r.label], r.val_x, r.val_y, True) for r in runs])
    col_w = (width - 140.0) / columns
    for i, r in enumerate(runs):
        x = 90.0 + (i % columns) * col_w
        y = legend_top + 26.0 * (i // columns)
        c = colors[r.label]
        d = f' stroke-dasharray="{dashes[r.label]}"' if dashes[r.label] else ""
        out.append(f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x + 28:.1f}" y2="{y:.1f}" '
                   f'stroke="{c}" stroke-width="2.5"{d}/>')
        out.append(f'<circle cx="{x + 14:.1f}" cy="{y:.1f}" r="3" fill="{c}"/>')
        extra = f" (mean of {r.count})" if r.count > 1 else ""
        final = f"final val {r.final_val:.4f}" if math.isfinite(r.final_val) else "no eval"
        out.append(f'<text x="{x + 36:.1f}" y="{y + 4.5:.1f}" font-size="13">'
                   f'{escape(r.label + extra)} <tspan fill="#666">— {final}</tspan></text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


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
    parser.add_argument("-o", "--output", type=Path, default=Path("loss_curves.svg"),
                        help="SVG file to write")
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
    try:
        records = [load_log(p) for p in args.logs]
    except (OSError, ValueError) as exc:
        print(f"plot_curves.py: {exc}", file=sys.stderr)
        return 1
    runs = group_runs(records, args.label, args.xaxis)
    subtitle = subtitle_of(records) if args.subtitle is None else args.subtitle
    svg = render_svg(runs, args.title, subtitle, args.xaxis, args.smooth, args.skip,
                     args.ymin, args.ymax)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(svg)
    print(f"wrote {args.output} ({len(runs)} curve{'s' if len(runs) != 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
