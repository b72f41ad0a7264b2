#!/usr/bin/env python3
"""Optimizer overhead apart from the wire: Lion Cub steps on a one-rank communicator versus
a plain torch Lion step, on a model of about 10M parameters, measured in one run.

    python bench/bench_optimizer_overhead.py                      # lioncub-l1, lioncub-mavo
    python bench/bench_optimizer_overhead.py --variants all --steps 30 --json out.json

Each optimizer owns its own copy of the same model (same parameters, same fixed random
gradients). After ``--warmup`` untimed steps each, the optimizers take turns, one step each
per round, for ``--steps`` rounds, so that slow drifts of the machine hit them alike; the
table reports the median and the minimum step time and the ratio of the medians to
``lioncub.torch.Lion``'s. A one-rank communicator moves no bytes, so the Lion Cub figure is
everything the optimizer adds besides the network: computing ``c``, quantizing, the
collective's packing and unpacking, applying the update, bookkeeping. The Lion Cub rows
also show the time blocked in the collective (``last_stats.comm_seconds``, median: on one rank
that is bitcoll's local encode / aggregate / decode work) and the ratio of the rest of the
step (the optimizer's own work) to the torch Lion step.

Both sides get the same number of threads by default (``--threads 1``: the numba kernels run
single-threaded, as they do in a multi-rank job with one rank per core); ``--threads 0`` lets
torch use its own default (all cores) while the kernels stay single-threaded.

The target is a ratio of at most 2 (Lion Cub's extra work per step must stay small next to
the forward and backward passes that any optimizer needs).

``--torch-engine`` adds, per variant, the torch engine (``backend="torch"``: the same step
written with torch operations, as it runs on a GPU) on the same CPU float32 tensors, and a
second verdict: its step time is at most 2x the numpy engine's (same thread count). Its
rows also show the bytes it copied between host and device per step. The last column is the
CPU time of the step (``time.process_time``, every thread of the process, median), which a
busy machine disturbs less than the wall time; the torch engine's ratios are printed in it too.
``--device cuda --dtype bfloat16`` runs those rows on a GPU in another dtype instead.

    python bench/bench_optimizer_overhead.py --torch-engine --threads 1
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import bitcoll
import bitcoll.kernels
import lioncub
import lioncub.torch as lt

TARGET_RATIO = 2.0


def build_model(width: int, blocks: int, vocab: int) -> torch.nn.Module:
    """A transformer-shaped stack of Linear and LayerNorm layers (no forward pass is run)."""
    layers: list[torch.nn.Module] = [torch.nn.Embedding(vocab, width)]
    for _ in range(blocks):
        layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, 3 * width),
                   torch.nn.Linear(width, width), torch.nn.LayerNorm(width),
                   torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)]
    layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab)]
    return torch.nn.Sequential(*layers)


@dataclass
class Entry:
    """One optimizer under test."""

    name: str
    step: Callable[[], Any]
    stats: Callable[[], lioncub.StepStats | None] | None = None
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    comm: list[float] = field(default_factory=list)
    engine_of: str | None = None  # torch-engine rows: the numpy row they are compared with
    host_device_bytes: int = 0
    sync: Callable[[], None] | None = None

    def run(self) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        self.step()
        if self.sync is not None:
            self.sync()
        self.times.append(time.perf_counter() - t0)
        self.cpu.append(time.process_time() - c0)
        st = self.stats() if self.stats is not None else None
        if st is not None:
            self.comm.append(st.comm_seconds)
            self.host_device_bytes = st.host_device_bytes


def make_entries(args: argparse.Namespace, comm: Any) -> tuple[list[Entry], int]:
    template = build_model(args.width, args.blocks, args.vocab)
    n_params = sum(p.numel() for p in template.parameters())
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) for p in template.parameters()]

    def clone(device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        model = build_model(args.width, args.blocks, args.vocab)
        model.load_state_dict(template.state_dict())
        model.to(device=device, dtype=dtype)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.to(device=device, dtype=dtype)
        return model

    sync = torch.cuda.synchronize if args.device == "cuda" else None

    entries = []
    base = lt.Lion(clone().parameters(), lr=1e-4, weight_decay=0.1)
    entries.append(Entry("lioncub.torch.Lion", base.step))
    for variant in args.variants:
        opt = lt.DistributedLion(clone().named_parameters(), comm, variant=variant, lr=1e-4,
                                 weight_decay=0.1)
        front = f"{variant} (torch front end)"
        entries.append(Entry(front, opt.step, functools.partial(getattr, opt, "last_stats")))
        if args.torch_engine:
            dtype = getattr(torch, args.dtype)
            eng = lt.DistributedLion(clone(args.device, dtype).named_parameters(), comm,
                                     variant=variant, lr=1e-4, weight_decay=0.1,
                                     backend="torch")
            tag = "" if (args.device, args.dtype) == ("cpu", "float32") \
                else f" {args.device} {args.dtype}"
            entries.append(Entry(f"{variant} (torch engine{tag})", eng.step,
                                 functools.partial(getattr, eng, "last_stats"),
                                 engine_of=front, sync=sync))
        if args.numpy_core:
            model = clone()
            arrays = [p.detach().numpy() for p in model.parameters()]
            np_grads = [p.grad.numpy() for p in model.parameters()]  # type: ignore[union-attr]
            core = lioncub.DistributedLion(arrays, comm, variant=variant, lr=1e-4,
                                           weight_decay=0.1)
            entries.append(Entry(f"{variant} (numpy core)", functools.partial(core.step, np_grads),
                                 functools.partial(getattr, core, "last_stats")))
    return entries, n_params


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="lioncub-l1,lioncub-mavo",
                   help="comma-separated lioncub variants, or 'all' (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="timed rounds (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per optimizer first")
    p.add_argument("--width", type=int, default=512, help="model width (default: %(default)s)")
    p.add_argument("--blocks", type=int, default=3, help="blocks (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=1024, help="embedding rows (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1, like the single-threaded numba "
                        "kernels of a rank; 0 = torch's own choice)")
    p.add_argument("--numpy-core", action="store_true",
                   help="also time lioncub.DistributedLion on numpy arrays directly")
    p.add_argument("--torch-engine", action="store_true",
                   help="also time the torch engine (backend='torch') on the same tensors")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="device of the torch engine rows (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="parameter dtype of the torch engine rows (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    args.variants = (list(lioncub.VARIANTS) if args.variants == "all"
                     else [v.strip() for v in args.variants.split(",") if v.strip()])
    for v in args.variants:
        if v not in lioncub.VARIANTS:
            p.error(f"unknown variant {v!r}; expected one of {', '.join(lioncub.VARIANTS)}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    bitcoll.kernels.set_num_threads(1)  # the numba kernels of this (the stepping) thread

    def threads() -> None:
        """Torch's thread count as asked: a numba kernel on OpenMP can change it."""
        if args.threads and torch.get_num_threads() != args.threads:
            torch.set_num_threads(args.threads)

    with bitcoll.init("local") as comm:
        entries, n_params = make_entries(args, comm)
        for e in entries:
            for _ in range(args.warmup):
                threads()
                e.step()
        for _ in range(args.steps):
            for e in entries:
                threads()
                e.run()

    command = " ".join([os.path.basename(sys.executable), *sys.argv]) if argv is None \
        else "bench_optimizer_overhead.py " + " ".join(argv)
    base = statistics.median(entries[0].times)
    print(f"# optimizer overhead apart from the wire: {n_params / 1e6:.2f}M parameters, "
          f"{sum(1 for _ in build_model(8, args.blocks, 8).parameters())} tensors")
    print(f"# {args.steps} rounds after {args.warmup} warm-up steps; torch "
          f"{torch.__version__}, {torch.get_num_threads()} torch threads; numpy kernels "
          f"single-threaded; {platform.machine()}, {os.cpu_count()} cpus")
    print(f"# command: {command}")
    header = (f"{'optimizer':<40}{'median ms':>11}{'min ms':>9}{'ratio':>8}"
              f"{'in coll. ms':>13}{'ratio w/o coll.':>17}{'host<->dev B':>14}"
              f"{'CPU ms':>9}")
    print(header)
    rows: list[dict[str, Any]] = []
    for e in entries:
        med = statistics.median(e.times)
        coll = statistics.median(e.comm) if e.comm else None
        own = None if coll is None else statistics.median(
            t - c for t, c in zip(e.times, e.comm, strict=True)) / base
        rows.append({"optimizer": e.name, "median_ms": med * 1e3, "min_ms": min(e.times) * 1e3,
                     "cpu_median_ms": statistics.median(e.cpu) * 1e3,
                     "ratio": med / base, "collective_ms": None if coll is None else coll * 1e3,
                     "ratio_without_collective": own, "engine_of": e.engine_of,
                     "host_device_bytes": e.host_device_bytes})
        coll_txt = "-" if coll is None else f"{coll * 1e3:.1f}"
        own_txt = "-" if own is None else f"{own:.2f}"
        hd_txt = "-" if e.engine_of is None else str(e.host_device_bytes)
        print(f"{e.name:<40}{med * 1e3:>11.1f}{min(e.times) * 1e3:>9.1f}{med / base:>8.2f}"
              f"{coll_txt:>13}{own_txt:>17}{hd_txt:>14}"
              f"{statistics.median(e.cpu) * 1e3:>9.1f}")
    numpy_rows = [r for r in rows[1:] if r["engine_of"] is None]
    worst = max(float(r["ratio"]) for r in numpy_rows) if numpy_rows else 0.0
    verdict = "met" if worst <= TARGET_RATIO else "NOT met"
    print(f"# target: Lion Cub step <= {TARGET_RATIO:g}x the torch Lion step: {verdict} "
          f"(worst ratio {worst:.2f})")
    medians = {r["optimizer"]: float(r["median_ms"]) for r in rows}
    engine_ratios = {r["optimizer"]: float(r["median_ms"]) / medians[r["engine_of"]]
                     for r in rows if r["engine_of"] is not None}
    if engine_ratios:
        worst_engine = max(engine_ratios.values())
        verdict = "met" if worst_engine <= TARGET_RATIO else "NOT met"
        print(f"# target: torch engine step <= {TARGET_RATIO:g}x the numpy engine's: {verdict} "
              "(" + ", ".join(f"{k}: {v:.2f}" for k, v in engine_ratios.items()) + ")")
        cpu = {r["optimizer"]: float(r["cpu_median_ms"]) for r in rows}
        print("# the same ratios in CPU time (less disturbed by other load): " + ", ".join(
            f"{r['optimizer']}: {cpu[r['optimizer']] / cpu[r['engine_of']]:.2f}"
            for r in rows if r["engine_of"] is not None))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": command, "n_params": n_params, "steps": args.steps,
                       "torch_threads": torch.get_num_threads(), "rows": rows,
                       "torch_engine_ratios": engine_ratios,
                       "target_ratio": TARGET_RATIO, "worst_ratio": worst}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
