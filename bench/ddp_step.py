"""Where a DDP training step's time goes: Lion Cub's in-backward hook against the same run
without communication and against global Lion over gloo, with DDP's bucket size as a knob.

Run on every rank of a job (env:// init, one rank per host on the testbed)::

    python bench/netbed.py --hosts 4 --rate 1gbit bench/ddp_step.py --mode hook
    python bench/netbed.py --hosts 4 --rate 1gbit bench/ddp_step.py --mode hook \\
        --bucket-cap-mb 4
    python bench/netbed.py --hosts 4 --rate 1gbit bench/ddp_step.py --mode nocomm

The model is train.py's character transformer (:mod:`lioncub.recipe.models`, default
``--d-model 384 --layers 6 --heads 6``: 10.75M parameters) on random byte tokens, batch
``--batch-size`` x ``--seq-len`` per rank, ``--threads`` torch threads. Modes:

* ``hook``: ``DistributedDataParallel(bucket_cap_mb=...)`` over ``--backend`` (bitcoll or
  gloo) with :func:`lioncub.torch_hooks.lioncub_hook` (``--variant``, default lioncub-l1) and
  :class:`~lioncub.torch_hooks.LionCubStep`: the votes travel while backward runs;
* ``nocomm``: the same code on one-rank groups (every rank its own world): the compute alone;
* ``global``: DDP's float32 average over ``--backend`` and plain Lion
  (:class:`lioncub.torch.Lion`): the baseline.

Per step the script takes the forward, backward and optimizer-step wall times, and in
``hook`` mode, per DDP bucket, when the hook was called (the bucket became ready) and when its
future completed (the vote arrived and the update direction was written), both from the
start of backward. Output (rank 0): one line per step, then the medians over the steps after
the first ``--skip`` (DDP rebuilds its buckets after the first iteration): ``step``,
``forward``, ``backward``, ``optimizer``, ``cpu`` (the process's CPU time over the step, all
threads; ms), and per bucket ``ready``/``done`` (ms) with
its size. ``--json`` writes every rank-0 figure to a file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("hook", "nocomm", "global"), default="hook")
    ap.add_argument("--backend", choices=("bitcoll", "gloo"), default="bitcoll")
    ap.add_argument("--variant", default="lioncub-l1")
    ap.add_argument("--momentum-sync", default=None)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="DDP's bucket_cap_mb (torch's default 25)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3, help="steps left out of the medians")
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None, help="write rank 0's figures to this file")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bitcoll
    import bitcoll.torch
    from lioncub.recipe.models import CharTransformer, token_loss
    from lioncub.torch import Lion
    from lioncub.torch_hooks import LionCubHookState, LionCubStep, lioncub_hook

    torch.set_num_threads(args.threads)
    limit = datetime.timedelta(seconds=args.timeout)
    rank = int(os.environ.get("RANK", "0"))
    if args.mode == "nocomm":
        dist.init_process_group("bitcoll", store=dist.HashStore(),  # type: ignore[attr-defined]
                                rank=0, world_size=1, timeout=limit)
    else:
        dist.init_process_group(args.backend, timeout=limit)
    torch.manual_seed(0)
    model = CharTransformer(256, args.d_model, args.layers, args.heads, args.seq_len)
    net = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    state: LionCubHookState | None = None
    events: list[tuple[int, int, float, float]] = []  # (bucket, elements, ready, done)
    t_bwd = [0.0]
    if args.mode == "global":
        opt: torch.optim.Optimizer = Lion(net.module.parameters(), lr=args.lr)
    else:
        opt = LionCubStep(net.module.named_parameters(), lr=args.lr)
        comm: Any = None
        if args.backend == "gloo" and args.mode == "hook":
            comm = bitcoll.init(timeout=args.timeout)
        state = LionCubHookState(opt, comm, variant=args.variant,
                                 momentum_sync=args.momentum_sync, private=True)

        def timed(st: LionCubHookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
            ready = time.perf_counter() - t_bwd[0]
            index, n = bucket.index(), bucket.buffer().numel()
            fut = lioncub_hook(st, bucket)

            def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                events.append((index, n, ready, time.perf_counter() - t_bwd[0]))
                return f.value()

            return fut.then(done)

        timed.__annotations__.update(lioncub_hook.__annotations__)
        net.register_comm_hook(state, timed)
    g = torch.Generator().manual_seed(1000 + rank)
    steps: list[dict[str, Any]] = []
    for step in range(args.steps):
        x = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=g)
        events.clear()
        c0 = time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = token_loss(net, x[:, :-1], x[:, 1:])
        t1 = time.perf_counter()
        t_bwd[0] = t1
        loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        rec: dict[str, Any] = {"step": step, "total": t3 - t0, "forward": t1 - t0,
                               "backward": t2 - t1, "optimizer": t3 - t2,
                               "cpu": time.process_time() - c0,
                               "loss": float(loss.item()), "buckets": sorted(events)}
        steps.append(rec)
        if rank == 0:
            print(f"step {step:3d}  {1e3 * rec['total']:7.1f} ms  fwd {1e3 * rec['forward']:6.1f}"
                  f"  bwd {1e3 * rec['backward']:6.1f}  opt {1e3 * rec['optimizer']:5.1f}"
                  f"  cpu {1e3 * rec['cpu']:6.1f}  "
                  + "  ".join(f"b{b}[{n / 1e6:.2f}M] {1e3 * r:.0f}->{1e3 * d:.0f}"
                              for b, n, r, d in rec["buckets"]), flush=True)
    if state is not None:
        state.close()
    kept = steps[args.skip:] or steps
    summary: dict[str, Any] = {k: 1e3 * statistics.median(s[k] for s in kept)
                               for k in ("total", "forward", "backward", "optimizer", "cpu")}
    per_bucket: dict[int, list[tuple[int, float, float]]] = {}
    for s in kept:
        for b, n, r, d in s["buckets"]:
            per_bucket.setdefault(b, []).append((n, r, d))
    summary["buckets"] = {b: {"elements": v[0][0],
                              "ready_ms": 1e3 * statistics.median(r for _, r, _ in v),
                              "done_ms": 1e3 * statistics.median(d for _, _, d in v)}
                          for b, v in sorted(per_bucket.items())}
    if state is not None and state.last_stats is not None:
        summary["bytes_sent_last_step"] = state.last_stats.bytes_sent
    if rank == 0:
        print(f"# {' '.join([os.path.basename(sys.executable), *sys.argv])}")
        print(f"# median over steps {args.skip}..{args.steps - 1}: step "
              f"{summary['total']:.1f} ms, forward {summary['forward']:.1f}, backward "
              f"{summary['backward']:.1f}, optimizer {summary['optimizer']:.1f}, process CPU "
              f"{summary['cpu']:.1f} (all threads)")
        for b, v in summary["buckets"].items():
            print(f"#   bucket {b}: {v['elements'] / 1e6:.2f}M elements, ready "
                  f"{v['ready_ms']:.1f} ms, done {v['done_ms']:.1f} ms after backward began")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "summary": summary, "steps": steps}, f,
                          indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
