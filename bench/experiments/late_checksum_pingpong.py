"""Round trips of one checksummed TCP frame each way, with the checksum computed before the
send (the trailer leaves with the payload) and after it (``LATE_CHECKSUM_BYTES``: the
checksum is computed while the payload drains, then the trailer follows), alternating in one
job (results/checksum/late_checksum_pingpong.txt)::

    python -m launch -n 2 bench/experiments/late_checksum_pingpong.py 65536,131072,1048576

Two ranks on TCP (shared memory off); per size 12 blocks of 300 round trips per setting,
the order alternating; rank 0 prints the median over the blocks of each block's median, and
the median of the blocks' late/early ratios.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import bitcoll
import bitcoll.transport.tcp.transport as tcp
from bitcoll.transport.base import FrameHeader


def main(argv: list[str]) -> int:
    sizes = [int(s) for s in (argv[0] if argv else "65536,131072,1048576").split(",")]
    comm = bitcoll.init("tcp", shm=False)
    t = getattr(comm.transport, "tcp", comm.transport)
    rank, seq = comm.rank, 100
    medians: dict[tuple[int, bool], list[float]] = {}
    late_bytes = tcp.LATE_CHECKSUM_BYTES
    for size in sizes:
        buf, out = np.ones(size, np.uint8), np.empty(size, np.uint8)
        for blk in range(12):
            for late in ((True, False) if blk % 2 else (False, True)):
                tcp.LATE_CHECKSUM_BYTES = late_bytes if late else 1 << 62  # type: ignore[misc]
                comm.barrier()
                times = []
                for _ in range(300):
                    seq += 1
                    h = FrameHeader(seq=seq & 0xFFFFFFFF, step=0, signature=5, length=size)
                    start = time.perf_counter()
                    if rank == 0:
                        t.isend(1, buf.data, h).wait(time.monotonic() + 30)
                        t.irecv(1, out.data, h).wait(time.monotonic() + 30)
                    else:
                        t.irecv(0, out.data, h).wait(time.monotonic() + 30)
                        t.isend(0, buf.data, h).wait(time.monotonic() + 30)
                    times.append(time.perf_counter() - start)
                medians.setdefault((size, late), []).append(float(np.median(times)))
    tcp.LATE_CHECKSUM_BYTES = late_bytes  # type: ignore[misc]
    if rank == 0:
        print(f"# late_checksum_pingpong: 2 ranks, TCP, checksum on; late = from "
              f"{late_bytes} payload bytes")
        for size in sizes:
            a, b = np.array(medians[size, True]), np.array(medians[size, False])
            print(f"{size:>9} B  late {np.median(a) * 1e6:8.1f} us  early "
                  f"{np.median(b) * 1e6:8.1f} us  late/early {np.median(a / b):.3f}")
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
