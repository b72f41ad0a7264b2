"""Measure the cost model's parameters on this machine (:mod:`bitcoll.plan`).

``python -m bitcoll.probe`` (one process) measures the per-core rates of packing, counting,
decoding and reducing with bitcoll's own kernels and writes them to the cost model's cache file
(:func:`bitcoll.plan.model_path`). Under a launcher with several ranks (``python -m launch
-n 2 -m bitcoll.probe``, ``mpiexec -n 2 python -m bitcoll.probe``; one rank per host or several)
it also measures the latency and bandwidth between ranks of one host and, when the ranks span
several hosts, between hosts, and rank 0 writes the file. It takes a few seconds. Options:
``--dry-run`` prints the model without writing it; ``--output PATH`` writes elsewhere.

Every compute rate is the best of several repetitions (the least disturbed), the way the cost
model uses them: a prediction of an undisturbed call; the links' figures are the mean of a
loop of exchanges (see ``_exchange_time``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .plan import PACK_CACHED_BYTES, CostModel, load_model, model_path

__all__ = ["compute_rates", "link_rates", "main"]


def _best(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()  # compile / warm the caches
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def compute_rates(n: int = 1 << 24, rows: int = 4) -> dict[str, float]:
    """Per-core rates of this process, measured on ``n`` elements: ``pack_rate`` (float32
    signs packed to bits, elements/s), ``pack_rate_cached`` (the same on an input of
    :data:`~bitcoll.plan.PACK_CACHED_BYTES`, which fits the cache), ``count_rate``
    (majority of ``rows`` packed rows, row-elements/s), ``decode_rate`` (bits to int8
    +-1, elements/s), ``reduce_rate`` (float32 ``a += b``, bytes of ``a`` per second),
    ``repack_rate`` (one step of the packed ring: this rank's votes packed and unpacked,
    the incoming 2-bit counts unpacked, added and packed again at 3 bits; elements/s)."""
    from . import kernels

    old = kernels.get_num_threads()
    kernels.set_num_threads(1)
    try:
        rng = np.random.default_rng(0)
        x = rng.standard_normal(n).astype(np.float32)
        bits = kernels.pack_signs(x)
        packed = np.stack([kernels.pack_signs(rng.standard_normal(n).astype(np.float32))
                           for _ in range(rows)])
        res = np.empty_like(bits)
        out = np.empty(n, np.int8)
        y = np.ones(n, np.float32)
        t_pack = _best(lambda: kernels.pack_signs(x, out=bits))
        small = x[:PACK_CACHED_BYTES // 4]
        small_bits = bits[:small.size // 8]
        t_pack_cached = _best(lambda: kernels.pack_signs(small, out=small_bits), 50)
        t_count = _best(lambda: kernels.majority(packed, n, kernels.TIE_POSITIVE, 0, out=res))
        t_decode = _best(lambda: kernels.unpack_signs(bits, n, out=out, dtype=np.int8))
        t_reduce = _best(lambda: np.add(y, x, out=y))
        counts = kernels.pack_fields(rng.integers(-1, 2, n).astype(np.int32), 2, 1)

        def ring_step() -> None:  # as sign_allreduce_ring's step
            own = kernels.unpack_fields(kernels.pack_signs(x), n, 1, 0, dtype=np.int32)
            acc = kernels.unpack_fields(counts, n, 2, 1, dtype=np.int32)
            acc += own
            kernels.pack_fields(acc, 3, 2)
        t_repack = _best(ring_step)
    finally:
        kernels.set_num_threads(old)
    return {"pack_rate": n / t_pack, "pack_rate_cached": small.size / t_pack_cached,
            "count_rate": rows * n / t_count,
            "decode_rate": n / t_decode, "reduce_rate": 4 * n / t_reduce,
            "repack_rate": n / t_repack}


def _loop(call: Callable[[], object], repeats: int, rounds: int = 3) -> tuple[float, float]:
    """Mean time and process CPU time (every thread, user and system: the transport's
    threads and the kernel's work in its system calls) per call of a loop of ``repeats``
    calls after one more: the way collectives are called and measured (one call alone
    varies: on the 1 Gbit testbed single 8-byte all-gathers took from 50 to 114 us). The
    loop runs ``rounds`` times and the fastest counts (with its CPU time), as the benchmarks
    keep their best round: one disturbed loop had cached a local latency of 203 us where
    the next two probes measured 33 us."""
    call()
    best = (math.inf, math.inf)
    for _ in range(rounds):
        c0 = time.process_time()
        t0 = time.perf_counter()
        for _ in range(repeats):
            call()
        took = (time.perf_counter() - t0) / repeats, (time.process_time() - c0) / repeats
        if took[0] < best[0]:
            best = took
    return best


def _exchange_time(comm: Any, nbytes: int, repeats: int) -> tuple[float, float]:
    """:func:`_loop` of one exchange of ``nbytes`` in each direction at once on the 2-rank
    ``comm``: an all-gather, which on 2 ranks is one step of one message each way (a
    broadcast would add its root check's round and count two latencies)."""
    buf = np.zeros(max(1, nbytes), np.uint8)
    out = np.empty(2 * buf.size, np.uint8)
    return _loop(lambda: comm.allgather(buf, out=out), repeats)


def _small_exchange_time(comm: Any, repeats: int) -> tuple[float, float]:
    """:func:`_loop` of the packed all-gather of 8 votes on the 2-rank ``comm``: one round
    of one 1-byte message each way, which the model predicts as ``call_cpu + latency + 2
    message_cpu`` (plus kernels too short to count). The dense all-gather of 8 bytes takes
    the collectives' general path and costs about 50 us more per call on this VM, the dense
    all-reduce's lean path about 25 us less than this one: the latency is taken from the
    exchange whose formula names it."""
    votes = np.ones(8, np.float32)
    out = np.empty(8, np.int8)
    return _loop(lambda: comm.sign_allreduce(votes, out=out, algorithm="allgather"), repeats)


def link_rates(comm: Any, repeats: int = 5, nbytes: int = 8 << 20) -> dict[str, float]:
    """Latency and bandwidth between ranks 0 and 1 of one host and, when the ranks span
    several hosts, between host 0's first rank and host 1's first rank (collective over
    ``comm``; the figures are rank 0's). Keys: ``local_latency``, ``local_bandwidth``,
    ``remote_latency``, ``remote_bandwidth``, ``remote_cpu`` (only those the world can
    measure).

    The latency is what the cost model means by it: the time of one small exchange (the
    packed all-gather of 8 votes, :func:`_small_exchange_time`) less what the model already
    charges such an exchange elsewhere, ``call_cpu`` and a ``message_cpu`` for the send and
    one for the receive (``comm.cost_model``'s), so that the model's prediction of the
    exchange is the time measured (never below a quarter of that time, in case those two
    figures exceed this machine's). The bandwidth: ``nbytes`` over
    the large exchange's time less the small one's. ``remote_cpu``: the large exchange's CPU
    time less the small one's, per byte sent and received (``2 nbytes``), as rank 0 spent
    it."""
    model = comm.cost_model
    overhead = model.call_cpu + 2 * model.message_cpu
    hosts = comm.topology.hosts
    pairs: dict[str, tuple[int, int]] = {}
    same = [r for r in range(comm.size) if hosts[r] == hosts[0]]
    if len(same) > 1:
        pairs["local"] = (same[0], same[1])
    other = [r for r in range(comm.size) if hosts[r] != hosts[0]]
    if other:
        pairs["remote"] = (0, other[0])
    out: dict[str, float] = {}
    for kind in ("local", "remote"):
        pair = pairs.get(kind)
        color = 0 if pair is not None and comm.rank in pair else None
        sub = comm.split(color, key=0 if pair is not None and comm.rank == pair[0] else 1)
        if sub is None:
            continue
        try:
            small, small_cpu = _small_exchange_time(sub, repeats * 20)
            large, large_cpu = _exchange_time(sub, nbytes, repeats)
        finally:
            sub.close()
        out[f"{kind}_latency"] = max(small - overhead, small / 4)
        out[f"{kind}_bandwidth"] = nbytes / max(large - small, 1e-9)
        if kind == "remote":
            out["remote_cpu"] = max(large_cpu - small_cpu, 1e-6) / (2 * nbytes)
    # rank 0's figures for everyone (rank 0 may not be in the local pair)
    keys = ("local_latency", "local_bandwidth", "remote_latency", "remote_bandwidth",
            "remote_cpu")
    mine = np.array([out.get(k, np.nan) for k in keys], np.float64)
    table = comm.allgather(mine).reshape(comm.size, len(keys))
    merged: dict[str, float] = {}
    for j, key in enumerate(keys):
        column = table[:, j][~np.isnan(table[:, j])]
        if column.size:
            merged[key] = float(column[0])
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bitcoll.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print, do not write")
    parser.add_argument("--output", type=Path, default=None, help="file to write")
    args = parser.parse_args(argv)
    fields = compute_rates()
    import bitcoll

    with bitcoll.init() as comm:
        if comm.size > 1:
            fields.update(link_rates(comm))
        # every rank measured its own rates: the model takes the slowest rank's
        rates = ("pack_rate", "pack_rate_cached", "count_rate", "decode_rate", "reduce_rate",
                 "repack_rate")
        mine = np.array([fields[k] for k in rates], np.float64)
        low = comm.allreduce(mine, op="min")
        fields.update({k: float(v) for k, v in zip(rates, low, strict=True)})
        if comm.rank != 0:
            return 0
    from .topology import usable_cores

    fields["host_cores"] = float(usable_cores())
    model = CostModel.from_mapping(fields, load_model())
    text = json.dumps({"_about": "bitcoll cost model, measured by python -m bitcoll.probe",
                       **{k: v for k, v in vars(model).items()}}, indent=2)
    print(text)
    if not args.dry_run:
        path = args.output or model_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
