"""The packed pipeline's segment size against the planner's choice: the majority
``sign_allreduce`` of ``-m`` float32 elements with each fixed segment of ``--segments`` and
with the planner's (``packed_segment_bytes=None``), in interleaved rounds (the order reversed
every other round), best round per row; rank 0 prints one JSON line per row: the segment
(``"auto"``: the planner's, with the bytes it chose), the algorithm the planner ran it with,
microseconds per call and the bytes this rank sent per call.

::

    python bench/netbed.py --hosts 2 --rate 1gbit --probe --model-link \\
        bench/experiments/packed_segments.py -m 64M
    python -m launch -n 4 bench/experiments/packed_segments.py -m 64M --segments 1M,2M,4M

(results/packed_segments/, with the commands and the machine.)
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import osu

from bitcoll.plan import Call, choose, segment_for


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--elements", type=osu.parse_size, default=64 << 20)
    p.add_argument("--segments", default="128K,256K,512K,1M,2M,4M",
                   help="fixed segment sizes (bytes of packed signs per block and segment)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=2)
    args = p.parse_args(argv)
    rt = osu.BitcollRuntime(backend="auto", timeout=300.0)
    comm = rt.comm
    n = args.elements
    v = np.random.default_rng(rt.rank).standard_normal(n).astype(np.float32)
    out = np.empty(n, np.int8)
    rows: list[int | None] = [osu.parse_size(s) for s in args.segments.split(",")]
    rows.append(None)
    best = {seg: float("inf") for seg in rows}
    sent = {seg: 0.0 for seg in rows}
    try:
        for r in range(args.rounds):
            for seg in rows if r % 2 == 0 else rows[::-1]:
                comm.packed_segment_bytes = seg
                t = osu.time_loop(rt, partial(comm.sign_allreduce, v, out=out), args.iters, 1)
                best[seg] = min(best[seg], t.avg_us)
                sent[seg] = t.wire_bytes or 0.0
        if rt.rank == 0:
            model, group = comm.cost_model, comm.plan_group
            for seg in rows:
                # The algorithm each row ran: with a fixed segment the planner may prefer one
                # that does not pipeline (the all-gather at small segments).
                call = Call(count=n, segment_bytes=seg or 0)
                algo = choose("packed", model, group, call)
                extra = {} if seg is not None else {
                    "chosen": segment_for("packed", algo, model, group, call)}
                print(json.dumps({"segment": seg if seg is not None else "auto", **extra,
                                  "algorithm": algo, "us": round(best[seg]),
                                  "bytes": sent[seg]}), flush=True)
    finally:
        rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
