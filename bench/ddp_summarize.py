"""Summarize DDP runs of ``train.py --json-log`` (e.g. ``results/ddp_hooks/``) or of
``bench/ddp_step.py --json`` (``results/ddp_hooks/step_profile/``): per run the
mean and median step time (steps 4..N, as train.py's summary leaves out the first three), per
configuration the median over the chosen rounds of the per-run medians, and the ratios the
targets are about (Markdown tables on stdout)::

    python bench/ddp_summarize.py results/ddp_hooks [FIRST_ROUND LAST_ROUND]

A run is ``<config>_r<round>.json`` (train.py's log) beside ``<config>_r<round>.txt`` (its
command and output; the line holding "load average" gives the load at the start).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

#: (numerator, denominator) configurations whose ratio of medians is printed when both exist.
RATIOS = [("hook1", "nocomm1"), ("hook25", "nocomm"), ("hook1", "nocomm"),
          ("global_gloo", "hook1"), ("global_gloo", "hook25"),
          ("hook_l1_gloo", "nocomm_hook_l1"), ("hook_l1_bitcoll", "nocomm_hook_l1"),
          ("gloo_global", "hook_l1_gloo"), ("gloo_global", "hook_l1_bitcoll"),
          ("gloo_global", "bitcoll_global"), ("votes_after_backward_l1", "hook_l1_gloo"),
          ("hook_l1_bitcoll_signs", "nocomm_hook_l1"), ("hook_l1_bitcoll_sums", "nocomm_hook_l1"),
          ("gloo_global", "hook_l1_bitcoll_signs"),
          ("hook_l1_bitcoll_sums", "hook_l1_bitcoll_signs")]


class Run:
    """One run's figures: round, mean and median ms per step, bytes sent per step, load."""

    def __init__(self, rnd: int, mean: float, median: float, sent: float, load: str) -> None:
        self.rnd, self.mean, self.median, self.sent, self.load = rnd, mean, median, sent, load


def collect(folder: Path, first: int, last: int) -> dict[str, list[Run]]:
    """Every ``<config>_r<round>.json`` in ``folder`` with ``first <= round <= last``."""
    runs: dict[str, list[Run]] = {}
    for f in sorted(folder.glob("*.json")):
        m = re.match(r"(.*)_r(\d+)$", f.stem)
        if m is None:
            continue
        cfg, rnd = m.group(1), int(m.group(2))
        if not first <= rnd <= last:
            continue
        log = json.loads(f.read_text())
        key = "total" if "args" in log else "time"  # bench/ddp_step.py's log, or train.py's
        times = [float(s[key]) for s in log["steps"][3:]]
        if not times:
            continue
        txt = f.with_suffix(".txt")
        head = txt.read_text().splitlines() if txt.exists() else []
        load = next((ln.split("load average: ")[1] for ln in head if "load average: " in ln),
                    "?")
        runs.setdefault(cfg, []).append(Run(rnd, 1000 * statistics.mean(times),
                                            1000 * statistics.median(times),
                                            float(log["summary"].get("bytes_sent_per_step",
                                                  log["summary"].get("bytes_sent_last_step", 0))),
                                            load))
    return runs


def report(runs: dict[str, list[Run]]) -> list[str]:
    """The Markdown tables and ratios of :func:`collect`'s runs."""
    out = ["| config | round | mean ms/step | median ms/step | MB sent by bitcoll/step/rank "
           "| load avg at start |", "|---|---|---|---|---|---|"]
    med: dict[str, float] = {}
    for cfg, rs in runs.items():
        for r in sorted(rs, key=lambda r: r.rnd):
            out.append(f"| {cfg} | {r.rnd} | {r.mean:.0f} | {r.median:.0f} | "
                       f"{r.sent / 1e6:.1f} | {r.load} |")
        med[cfg] = statistics.median(r.median for r in rs)
    out += ["", "| config | median over rounds of the per-run median, ms/step |", "|---|---|"]
    out += [f"| {cfg} | {v:.0f} |" for cfg, v in med.items()]
    out.append("")
    out += [f"- {a} / {b}: {med[a] / med[b]:.2f}" for a, b in RATIOS if a in med and b in med]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("first", type=int, nargs="?", default=1)
    parser.add_argument("last", type=int, nargs="?", default=10**9)
    args = parser.parse_args(argv)
    print("\n".join(report(collect(args.folder, args.first, args.last))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
