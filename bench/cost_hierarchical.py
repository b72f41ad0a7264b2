"""Cost model, on paper, of flat vs two-level collectives for hosts with several ranks.

Computes (runs nothing) the per-step communication time of one all-reduce of a model's
gradient from the byte formulas of bitcoll's algorithms and given link and memory speeds::

    python bench/cost_hierarchical.py                          # 1.3B, 16 hosts x 8 ranks
    python bench/cost_hierarchical.py --params 7e9 --hosts 32 --ranks-per-host 8 \\
        --gbits 10,25,100 --efficiency 0.97 --shm-gbytes 2.8

Formulas (``n`` elements, ``H`` hosts of ``g`` ranks, ``p = H g``, widths in bits; a host's
NIC carries the bytes of its ``g`` ranks in each direction; headers are negligible here):

* flat direct exchange (``algorithm="direct"``): each rank sends ``w_in`` bits of every other
  rank's block and ``w_out`` bits of its own block's result to every other rank, so per host
  and direction the NIC carries ``g (p - g) / p * n (w_in + w_out) / 8`` bytes; the
  ``(g - 1) / p`` share to the ranks of its own host goes through shared memory;
* two-level (``algorithm="hierarchical"``): inside the host ``(g - 1) / g * n w_in / 8`` bytes
  per rank (reduce-scatter) and ``(g - 1) / g * n w_out / 8`` (all-gather) through shared
  memory; between hosts each rank sends its slice's counts and results, so per host and
  direction the NIC carries ``(H - 1) / H * n (w_c + w_out) / 8`` bytes with
  ``w_c = ceil(log2(g + 1))`` (majority) or ``ceil(log2(2 g L + 1))`` (sums);
* float32 ring for reference: ``2 (p - 1) / p * 4 n`` bytes per host NIC (ranks of a host
  consecutive on the ring), two-level ``2 (H - 1) / H * 4 n``.

Times: NIC bytes / (link rate x efficiency), shared-memory bytes / the per-rank copy rate;
"total" adds the two (no overlap: an upper bound; the pipeline overlaps them).
"""

from __future__ import annotations

import argparse


def field_width(max_abs: int) -> int:
    """Bits of integers in ``[-max_abs, max_abs]`` (bitcoll.algorithms.votes.field_width)."""
    return max(1, (2 * max_abs).bit_length())


def rows(n: float, hosts: int, g: int, levels: int) -> list[tuple[str, str, float, float]]:
    """(collective, algorithm, NIC bytes per host and direction, shm bytes per rank)."""
    p = hosts * g
    out = []
    for name, w_in, w_out, w_c in (
            ("majority", 1, 1, max(1, g.bit_length())),
            (f"sum L={levels}", field_width(levels), field_width(levels * p),
             field_width(g * levels))):
        out.append((name, "flat direct", g * (p - g) / p * n * (w_in + w_out) / 8,
                    (g - 1) / p * n * (w_in + w_out) / 8))
        out.append((name, "two-level", (hosts - 1) / hosts * n * (w_c + w_out) / 8,
                    (g - 1) / g * n * (w_in + w_out) / 8))
    out.append(("float32", "flat ring", 2 * (p - 1) / p * 4 * n, 0.0))
    out.append(("float32", "two-level", 2 * (hosts - 1) / hosts * 4 * n,
                2 * (g - 1) / g * 4 * n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1.3e9, help="elements n (default 1.3e9)")
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--levels", type=int, default=31, help="sum levels L (default 31)")
    ap.add_argument("--gbits", default="10,25", help="link rates, Gbit/s (default 10,25)")
    ap.add_argument("--efficiency", type=float, default=0.972,
                    help="achieved / nominal link rate (default 0.972: the testbed's TCP probe "
                         "at 10gbit, results/netbed_10gbit/probe.txt)")
    ap.add_argument("--shm-gbytes", type=float, default=2.8,
                    help="shared-memory rate per rank, GB/s (default 2.8: the measured bus "
                         "bandwidth of the 2-rank shm all-reduce, results/shm/summary.txt)")
    a = ap.parse_args()
    rates = [float(r) for r in a.gbits.split(",")]
    g = a.ranks_per_host
    print(f"# computed, not run: n = {a.params:.3g} elements, {a.hosts} hosts x {g} ranks, "
          f"links {', '.join(f'{r:g}' for r in rates)} Gbit/s x {a.efficiency}, "
          f"shared memory {a.shm_gbytes} GB/s per rank")
    head = f"{'collective':<12} {'algorithm':<12} {'NIC GB/host':>11} {'shm GB/rank':>11}"
    for r in rates:
        head += f" {f'net@{r:g}G s':>11} {f'total@{r:g}G s':>13}"
    print(head)
    for name, algo, nic, shm in rows(a.params, a.hosts, g, a.levels):
        line = f"{name:<12} {algo:<12} {nic / 1e9:>11.3f} {shm / 1e9:>11.3f}"
        for r in rates:
            net = nic / (r * 1e9 / 8 * a.efficiency)
            line += f" {net:>11.3f} {net + shm / (a.shm_gbytes * 1e9):>13.3f}"
        print(line)


if __name__ == "__main__":
    main()
