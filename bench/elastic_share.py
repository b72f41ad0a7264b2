"""How fast :func:`bitcoll.elastic.share_state` hands a joiner the job's state, alone.

Usage (on the testbed, as root)::

    python bench/netbed.py --hosts 4 --rate 1gbit bench/elastic_share.py --elements 10750000

Every rank joins with ``bitcoll.init()``; ranks ``0..size-2`` are the holders, the last rank
is the joiner. Each round, the joiner receives ``--elements`` float32 parameters (a copy) and
the holders' average of ``--elements`` float32 momenta, in one ``share_state`` call; the
joiner prints the seconds and the bytes it received, and the ratio of the seconds to the
state's bytes (parameters + momenta) over ``--rate-bytes`` (default 125e6: 1 Gbit/s).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import bitcoll
    from bitcoll.elastic import share_state

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=10_750_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate-bytes", type=float, default=125e6)
    a = ap.parse_args()
    comm = bitcoll.init()
    holders = list(range(comm.size - 1))
    joiner = comm.rank == comm.size - 1
    params = np.full(a.elements, 0.0 if joiner else 0.5, np.float32)
    mom = np.full(a.elements, float(comm.rank), np.float32)
    for r in range(a.rounds):
        comm.barrier()
        before = comm.stats.snapshot()["bytes_received"]
        t = time.monotonic()
        share_state(comm, params, holders, average=mom)
        took = time.monotonic() - t
        got = comm.stats.snapshot()["bytes_received"] - before
        if joiner:
            state = 8 * a.elements
            assert params[0] == 0.5 and params[-1] == 0.5
            assert mom[0] == np.float32(sum(holders)) / np.float32(len(holders))
            print(f"round {r}: state {state / 1e6:.1f} MB, received {got / 1e6:.1f} MB in "
                  f"{took:.3f} s = {took * a.rate_bytes / state:.2f}x the state over the "
                  f"link rate", flush=True)
        params[:] = 0.0 if joiner else 0.5
        mom[:] = float(comm.rank)
    comm.close()


if __name__ == "__main__":
    main()
