"""The cost model's predictions (:mod:`bitcoll.plan`) beyond this machine: 8-1024 hosts at
1, 10 and 100 Gbit with round trips of 0.1-100 ms.

::

    python bench/cost_predict.py                      # table on stdout
    python bench/cost_predict.py --plot out.png       # and a figure (matplotlib)

For each link rate and round trip, and each number of hosts (one rank per host, the model's
compute rates as measured on this project's reference machine), the table gives the
predicted time of a float32 all-reduce of ``--params`` parameters (the baseline every peer
uses), of the packed majority all-reduce of the same number of votes, and of the exact 5-bit
sum (Lion Cub's L1 quantizer with 15 levels), each with the algorithm the planner picks, and
the speedup of the vote over the float32 all-reduce. Nothing here is measured: it is what
the model says, to be compared with measurements where a testbed exists (see
``docs/cost-model.md``).
"""

from __future__ import annotations

import argparse
import sys

from bitcoll.algorithms.votes import field_width
from bitcoll.plan import DEFAULT_MODEL, Call, choose, group_of, predict

RATES = {"1gbit": 1.25e8, "10gbit": 1.25e9, "100gbit": 1.25e10}
RTTS_MS = (0.1, 1.0, 10.0, 100.0)
HOSTS = (8, 16, 32, 64, 128, 256, 512, 1024)


def rows(params: int, levels: int = 15) -> list[tuple[object, ...]]:
    """(rate, rtt_ms, hosts, float32 s, algo, majority s, algo, sum s, algo, speedup)."""
    out: list[tuple[object, ...]] = []
    for rate_name, rate in RATES.items():
        for rtt in RTTS_MS:
            model = DEFAULT_MODEL.replace(remote_bandwidth=rate, remote_latency=rtt / 2e3)
            for hosts in HOSTS:
                group = group_of(hosts, tuple(range(hosts)), model)
                dense = Call(nbytes=4 * params)
                vote = Call(count=params)
                w_out = field_width(levels * hosts)
                quant = Call(count=params, w_in=field_width(levels), w_out=w_out)
                a_d = choose("allreduce", model, group, dense)
                a_v = choose("packed", model, group, vote)
                a_q = choose("packed", model, group, quant)
                t_d = predict("allreduce", a_d, model, group, dense)
                t_v = predict("packed", a_v, model, group, vote)
                t_q = predict("packed", a_q, model, group, quant)
                out.append((rate_name, rtt, hosts, t_d, a_d, t_v, a_v, t_q, a_q, t_d / t_v))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=100_000_000,
                   help="parameters (elements) per collective (default 1e8)")
    p.add_argument("--plot", default=None, help="write a figure to this PNG file")
    args = p.parse_args(argv)
    table = rows(args.params)
    print(f"# bitcoll cost model predictions, {args.params} parameters, one rank per host")
    print("# rate     rtt_ms  hosts   float32_s  algorithm            majority_s  algorithm  "
          "  sum5_s  algorithm   speedup")
    for r in table:
        print(f"{r[0]:<9}{r[1]:>7}{r[2]:>7}{r[3]:>12.4f}  {r[4]:<19}{r[5]:>12.4f}  {r[6]:<10}"
              f"{r[7]:>8.4f}  {r[8]:<10}{r[9]:>8.1f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(RATES), figsize=(13, 4), sharey=True)
        for ax, rate_name in zip(axes, RATES, strict=True):
            for rtt in RTTS_MS:
                sel = [r for r in table if r[0] == rate_name and r[1] == rtt]
                hosts = [int(str(r[2])) for r in sel]
                ax.plot(hosts, [float(str(r[3])) for r in sel], "--", label=f"f32 {rtt} ms")
                ax.plot(hosts, [float(str(r[5])) for r in sel], "-", label=f"vote {rtt} ms")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{rate_name}, {args.params:.0e} parameters")
            ax.set_xlabel("hosts")
        axes[0].set_ylabel("predicted seconds per collective")
        axes[-1].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"# figure written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
