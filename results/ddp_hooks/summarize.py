"""Summarize the DDP hook runs of this directory: per run the mean and median step time
(steps 4..N, as train.py's summary leaves out the first three), per config the median over
the chosen rounds, and the ratios the targets are about.

    python results/ddp_hooks/summarize.py results/ddp_hooks [FIRST_ROUND LAST_ROUND]
"""
import json
import re
import statistics
import sys
from pathlib import Path

d = Path(sys.argv[1])
lo, hi = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (1, 10**9)
runs = {}
for f in sorted(d.glob("*.json")):
    log = json.loads(f.read_text())
    times = [s["time"] for s in log["steps"][3:]]
    m = re.match(r"(.*)_r(\d+)$", f.stem)
    cfg, rnd = m.group(1), int(m.group(2))
    if not lo <= rnd <= hi:
        continue
    head = (d / (f.stem + ".txt")).read_text().splitlines()
    load = next((ln.split("load average: ")[1] for ln in head if "load average" in ln), "?")
    runs.setdefault(cfg, []).append((rnd, 1000 * statistics.mean(times),
                                     1000 * statistics.median(times),
                                     log["summary"]["bytes_sent_per_step"], load))
print("| config | round | mean ms/step | median ms/step | MB sent by bitcoll/step/rank "
      "| load avg at start |")
print("|---|---|---|---|---|---|")
med = {}
for cfg, rs in runs.items():
    for rnd, mean, median, sent, load in sorted(rs):
        print(f"| {cfg} | {rnd} | {mean:.0f} | {median:.0f} | {sent / 1e6:.1f} | {load} |")
    med[cfg] = statistics.median(r[2] for r in rs)
print()
print("| config | median over rounds of the per-run median, ms/step |")
print("|---|---|")
for cfg, v in med.items():
    print(f"| {cfg} | {v:.0f} |")
def ratio(a, b):
    if a in med and b in med:
        print(f"- {a} / {b}: {med[a] / med[b]:.2f}")
print()
ratio("hook_l1_gloo", "nocomm_hook_l1")
ratio("hook_l1_bitcoll", "nocomm_hook_l1")
ratio("gloo_global", "hook_l1_gloo")
ratio("gloo_global", "hook_l1_bitcoll")
ratio("gloo_global", "bitcoll_global")
ratio("votes_after_backward_l1", "hook_l1_gloo")
