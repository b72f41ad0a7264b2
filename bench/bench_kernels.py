"""Benchmark of the packed-bit kernels against plain numpy.

    python bench/bench_kernels.py [--n 67108864] [--repeat 5] [--threads 1] [--p 8] [--width 5]

Times every kernel of :mod:`bitcoll.kernels` on ``n`` random elements (float32 normal votes,
``p`` packed vote vectors, ``width``-bit fields) and the numpy way of computing the same result
(:mod:`bitcoll.kernels.reference`, or ``numpy.packbits(x > 0)`` for the sign pack), and prints a
markdown table: best time of ``repeat`` runs after a warm-up call (which also compiles), the
input bandwidth (bytes of the input arrays / time), elements per second and the speedup over
numpy (whose best of ``min(repeat, 3)`` runs is used). ``--threads 1``
(the default) measures the single-thread kernels; more threads let inputs of at least
``PARALLEL_MIN_ELEMENTS`` elements use the parallel variants.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bitcoll import kernels as K
from bitcoll.kernels import reference as R


def best_time(fn: Callable[[], Any], repeat: int) -> float:
    """Best wall time in seconds of ``repeat`` calls of ``fn`` after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--n", type=int, default=64 * 1024 * 1024, help="elements (default 64M)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per kernel (best kept)")
    ap.add_argument("--threads", type=int, default=1, help="numba threads (1 = serial)")
    ap.add_argument("--p", type=int, default=8, help="vote vectors for count/majority")
    ap.add_argument("--width", type=int, default=5, help="field width in bits")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n, p, w, repeat = args.n, args.p, args.width, max(1, args.repeat)
    K.set_num_threads(args.threads)

    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal(n, dtype=np.float32)
    bits = K.pack_signs(x)
    votes = rng.integers(0, 256, size=(p, K.packed_nbytes(n)), dtype=np.uint8)
    half = 1 << (w - 1)
    values = rng.integers(-half, half, size=n).astype(np.int8 if w <= 8 else np.int16)
    fields = K.pack_fields(values, w, half)
    acc = np.zeros(n, dtype=np.int32)
    out_u8 = np.empty(K.packed_nbytes(n), dtype=np.uint8)
    out_f32 = np.empty(n, dtype=np.float32)
    out_i32 = np.empty(n, dtype=np.int32)

    def np_unpack_signs() -> Any:
        b = np.unpackbits(bits, count=n, bitorder="little").view(bool)
        return np.where(b, np.float32(-1e-3), np.float32(1e-3))

    def np_add_fields() -> Any:
        acc2 = np.zeros(n, dtype=np.int32)
        return R.add_fields(fields, n, w, half, acc2)

    rows = np.stack([K.pack_fields(rng.integers(-half, half, size=n).astype(values.dtype),
                                   w, half) for _ in range(p)])
    out_sign = np.empty(K.packed_nbytes(n, 2), dtype=np.uint8)

    def four_passes() -> Any:  # what the exact sum's sign took before sum_sign_fields
        K.unpack_fields(rows[0], n, w, half, out=out_i32)
        for row in rows[1:]:
            K.add_fields(row, n, w, half, out_i32)
        return K.pack_fields(np.sign(out_i32, out=out_i32), 2, 1, out=out_sign)

    # (name, input bytes, kernel, numpy equivalent)
    cases: list[tuple[str, int, Callable[[], Any], Callable[[], Any]]] = [
        ("pack_signs float32", x.nbytes,
         lambda: K.pack_signs(x, out=out_u8),
         lambda: np.packbits(x > 0, bitorder="little")),
        ("pack_ternary float32", x.nbytes,
         lambda: K.pack_ternary(x),
         lambda: R.pack_ternary(x)),
        ("unpack_signs -> float32 (scale -1e-3)", bits.nbytes,
         lambda: K.unpack_signs(bits, n, out=out_f32, dtype=np.float32, scale=-1e-3),
         np_unpack_signs),
        (f"count_votes p={p}", votes.nbytes,
         lambda: K.count_votes(votes, n, out=out_i32),
         lambda: R.count_votes(votes, n)),
        (f"majority p={p} (tie alternate)", votes.nbytes,
         lambda: K.majority(votes, n, K.TIE_ALTERNATE, out=out_u8),
         lambda: R.majority(votes, n, R.TIE_ALTERNATE)),
        (f"count_planes p={p} (width {p.bit_length()})", votes.nbytes,
         lambda: K.count_planes(votes, n, p.bit_length()),
         lambda: R.count_votes(votes, n)),
        (f"pack_fields w={w} {values.dtype}", values.nbytes,
         lambda: K.pack_fields(values, w, half),
         lambda: R.pack_fields(values, w, half)),
        (f"unpack_fields w={w} -> int32", fields.nbytes,
         lambda: K.unpack_fields(fields, n, w, half, out=out_i32),
         lambda: R.unpack_fields(fields, n, w, half)),
        (f"add_fields w={w} += int32", fields.nbytes,
         lambda: K.add_fields(fields, n, w, half, acc),
         np_add_fields),
        (f"sum_sign_fields w={w} p={p}", rows.nbytes,
         lambda: K.sum_sign_fields(rows, n, w, half, out=out_sign),
         lambda: R.sum_sign_fields(rows, n, w, half)),
        (f"unpack+add+sign+pack w={w} p={p}", rows.nbytes, four_passes,
         lambda: R.sum_sign_fields(rows, n, w, half)),
    ]

    print(f"command: {' '.join(shlex.quote(a) for a in ['python', *sys.argv])}")
    print(f"n={n} p={p} width={w} repeat={repeat} threads={K.get_num_threads()} "
          f"NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS', '(default)')} "
          f"cpu_count={os.cpu_count()} python={platform.python_version()} "
          f"numpy={np.__version__}")
    print()
    print("| kernel | input MB | time ms | GB/s of input | Gelem/s | numpy ms | speedup vs numpy |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, nbytes, kern, ref in cases:
        tk = best_time(kern, repeat)
        tr = best_time(ref, min(repeat, 3))  # the numpy side is slow; 3 runs are plenty
        print(f"| {name} | {nbytes / 1e6:.1f} | {tk * 1e3:.1f} | {nbytes / tk / 1e9:.2f} | "
              f"{n / tk / 1e9:.2f} | {tr * 1e3:.1f} | {tr / tk:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
