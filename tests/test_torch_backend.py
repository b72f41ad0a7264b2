"""The torch.distributed backend "bitcoll" (bitcoll.torch) on real ranks.

Each test is one multi-process run that packs many checks: every ReduceOp and dtype and a
sweep of lengths against references computed locally from the seeds, every collective and
group shape, point-to-point, the object collectives, DDP and FSDP2 against gloo, under each
init method (tcp://, file://, store=, env:// through ``python -m launch``), and a rank killed
inside a collective. A rank returns the list of checks that failed (empty: all passed).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from multiproc import context, free_port, start  # noqa: E402

R = dist.ReduceOp
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
          torch.complex128]
SMALL_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
LENGTHS = [0, 1, 9, 1001]
INTS = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
TIMEOUT = 60.0  # seconds: each rank's collectives' deadline


# ------------------------------------------------------------------------ references
def _values(rank: int, dtype: Any, n: int, salt: int, lo: int = -3, hi: int = 4) -> Any:
    """Rank ``rank``'s input: small integers (exact sums in every dtype), from a seed."""
    g = torch.Generator().manual_seed(7919 * salt + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype == torch.uint8:
        lo = max(lo, 0)
    if dtype.is_complex:
        re = torch.randint(lo, hi, (n,), generator=g).double()
        im = torch.randint(lo, hi, (n,), generator=g).double()
        return torch.complex(re, im).to(dtype)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def _ops(dtype: Any) -> list[Any]:
    if dtype == torch.bool:
        return [R.SUM, R.MAX, R.MIN, R.PRODUCT, R.BAND, R.BOR, R.BXOR]
    if dtype.is_complex:
        return [R.SUM, R.AVG, "premul"]
    if dtype in INTS:
        return [R.SUM, R.MAX, R.MIN, R.PRODUCT, R.BAND, R.BOR, R.BXOR]
    return [R.SUM, R.AVG, R.MAX, R.MIN, R.PRODUCT, "premul"]


def _reference(rows: list[Any], op: Any, dtype: Any) -> Any:
    """The reduction of the ranks' rows, computed here (wide types, then cast)."""
    stack = torch.stack(rows)
    if dtype == torch.bool:
        if op in (R.SUM, R.MAX, R.BOR):
            return stack.any(0)
        if op in (R.MIN, R.PRODUCT, R.BAND):
            return stack.all(0)
        return functools.reduce(torch.bitwise_xor, rows)
    if op in (R.BAND, R.BOR, R.BXOR):
        fn = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or,
              R.BXOR: torch.bitwise_xor}[op]
        return functools.reduce(fn, rows)
    wide = stack.to(torch.complex128 if dtype.is_complex else
                    torch.int64 if dtype in INTS else torch.float64)
    if op == R.SUM:
        out = wide.sum(0)
    elif op == R.AVG:
        out = wide.sum(0) / len(rows)
    elif op == "premul":
        out = wide.sum(0) * 0.5
    elif op == R.MAX:
        out = wide.amax(0)
    elif op == R.MIN:
        out = wide.amin(0)
    else:
        out = wide.prod(0)
    return out.to(dtype)


def _same(got: Any, want: Any, dtype: Any, exact: bool = True) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if exact or dtype in INTS or dtype == torch.bool:
        return bool(torch.equal(got, want))
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)
    return bool(torch.allclose(got, want, rtol=tol, atol=tol))


def _torch_op(op: Any) -> Any:
    return dist._make_nccl_premul_sum(0.5) if op == "premul" else op


# ------------------------------------------------------------------------ the sweeps
def _sweep(group: Any, dtypes: list[Any], lengths: list[int], fails: list[str],
           salt: int = 0) -> None:
    """Every collective on ``group`` for these dtypes and lengths, against references."""
    p, me = dist.get_world_size(group), dist.get_rank(group)
    for dtype in dtypes:
        for n in lengths:
            salt += 1
            rows = [_values(r, dtype, n, salt) for r in range(p)]
            tag = f"{dtype} n={n} p={p}"
            # all_reduce, every op (a non-contiguous input for odd n)
            for op in _ops(dtype):
                prows = [_values(r, dtype, n, salt, -2, 3) for r in range(p)] \
                    if op == R.PRODUCT else rows
                want = _reference(prows, op, dtype)
                # contiguous (the second call of an op and dtype takes the lean path), and
                # for odd n a strided view as well
                for strided in (False, True)[:1 + n % 2]:
                    if strided:
                        big = torch.zeros(2 * n, dtype=dtype)
                        x = big[::2]
                        x.copy_(prows[me])
                    else:
                        x = prows[me].clone()
                    dist.all_reduce(x, op=_torch_op(op), group=group)
                    if not _same(x, want, dtype, exact=op not in (R.AVG, "premul")):
                        fails.append(f"all_reduce {op} {tag} strided={strided}: {x[:5]} != "
                                     f"{want[:5]}")
            # async all_reduce: the future's value is the output
            x = rows[me].clone()
            work = dist.all_reduce(x, group=group, async_op=True)
            work.wait()
            value = work.get_future().wait()
            if not (work.is_completed() and value[0] is not None and
                    _same(x, _reference(rows, R.SUM, dtype), dtype)):
                fails.append(f"async all_reduce {tag}")
            # broadcast from a rank that depends on n
            root = n % p
            x = rows[me].clone()
            dist.broadcast(x, group_src=root, group=group)
            if not torch.equal(x, rows[root]):
                fails.append(f"broadcast root {root} {tag}")
            # reduce: the root gets the sum, the others keep their input
            if dtype != torch.bool:
                x = rows[me].clone()
                dist.reduce(x, group_dst=root, group=group)
                want = _reference(rows, R.SUM, dtype) if me == root else rows[me]
                if not _same(x, want, dtype):
                    fails.append(f"reduce root {root} {tag}")
            # all_gather (list, sizes differing by rank) and into one tensor
            outs = [torch.empty(n + r, dtype=dtype) for r in range(p)]
            mine = torch.cat([rows[me], rows[me][:me]]) if n >= me else None
            if mine is not None and n >= p:
                outs_ok = [torch.cat([rows[r], rows[r][:r]]) for r in range(p)]
                dist.all_gather(outs, mine, group=group)
                if not all(torch.equal(a, b) for a, b in zip(outs, outs_ok, strict=True)):
                    fails.append(f"all_gather list {tag}")
            # contiguous (the lean path), and for odd n a strided input (the general path)
            for strided in (False, True)[:1 + n % 2]:
                out = torch.empty(p * n, dtype=dtype)
                if strided:
                    big = torch.zeros(2 * n, dtype=dtype)
                    x = big[::2]
                    x.copy_(rows[me])
                else:
                    x = rows[me]
                dist.all_gather_into_tensor(out, x, group=group)
                if not torch.equal(out, torch.cat(rows)):
                    fails.append(f"all_gather_into_tensor {tag} strided={strided}")
            # reduce_scatter: list and tensor forms (rank r gets block r of the sum)
            if dtype != torch.bool:
                blocks = [_values(r, dtype, p * n, salt + 500) for r in range(p)]
                total = _reference(blocks, R.SUM, dtype)
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, blocks[me], group=group)
                if not _same(out, total[me * n:(me + 1) * n], dtype):
                    fails.append(f"reduce_scatter_tensor {tag}")
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(out, list(blocks[me].chunk(p)) if n else
                                    [torch.empty(0, dtype=dtype)] * p, group=group)
                if not _same(out, total[me * n:(me + 1) * n], dtype):
                    fails.append(f"reduce_scatter list {tag}")
            # gather and scatter
            gl = [torch.empty(n, dtype=dtype) for _ in range(p)] if me == root else None
            dist.gather(rows[me], gl, group_dst=root, group=group)
            if me == root and not all(torch.equal(a, b) for a, b in
                                      zip(gl or [], rows, strict=True)):
                fails.append(f"gather {tag}")
            out = torch.empty(n, dtype=dtype)
            dist.scatter(out, rows if me == root else None, group_src=root, group=group)
            if not torch.equal(out, rows[me]):
                fails.append(f"scatter {tag}")
            # all_to_all_single with uneven splits: rank i sends (i + j) % 3 rows to rank j
            sizes = [[(i + j + n) % 3 for j in range(p)] for i in range(p)]
            src = [_values(i, dtype, 2 * sum(sizes[i]), salt + 900).reshape(-1, 2)
                   for i in range(p)]
            parts = [list(src[i].split(sizes[i])) for i in range(p)]
            out = torch.empty(sum(sizes[i][me] for i in range(p)), 2, dtype=dtype)
            dist.all_to_all_single(out, src[me], [sizes[i][me] for i in range(p)],
                                   sizes[me], group=group)
            if not torch.equal(out, torch.cat([parts[i][me] for i in range(p)])):
                fails.append(f"all_to_all_single uneven {tag}")
            outs = [torch.empty(sizes[i][me], 2, dtype=dtype) for i in range(p)]
            dist.all_to_all(outs, parts[me], group=group)
            if not all(torch.equal(outs[i], parts[i][me]) for i in range(p)):
                fails.append(f"all_to_all list {tag}")


def _p2p_and_objects(fails: list[str]) -> None:
    p, me = dist.get_world_size(), dist.get_rank()
    # a ring exchange of 1 MiB in both directions at once (must not deadlock)
    right, left = (me + 1) % p, (me - 1) % p
    out = torch.full((1 << 18,), float(me))
    got = torch.empty(1 << 18)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, right),
                                   dist.P2POp(dist.irecv, got, left)])
    for r in reqs:
        r.wait()
    if not torch.equal(got, torch.full((1 << 18,), float(left))):
        fails.append("batch_isend_irecv ring")
    # ordered messages per pair and tag; two tags; a bfloat16 and a bool tensor
    if me == 0:
        works = [dist.isend(torch.tensor([k, 10 * k], dtype=torch.int64), 1, tag=5)
                 for k in range(3)]
        dist.send(torch.arange(4, dtype=torch.bfloat16), 1, tag=7)
        for w in works:
            w.wait()
        dist.send(torch.tensor([True, False]), 1)
    elif me == 1:
        b = torch.empty(4, dtype=torch.bfloat16)
        dist.recv(b, 0, tag=7)  # another tag: its own channel, not blocked by tag 5
        for k in range(3):
            t = torch.empty(2, dtype=torch.int64)
            dist.irecv(t, 0, tag=5).wait()
            if t.tolist() != [k, 10 * k]:
                fails.append(f"recv #{k} in order: {t.tolist()}")
        if not torch.equal(b, torch.arange(4, dtype=torch.bfloat16)):
            fails.append("recv bfloat16 tag 7")
        flags = torch.empty(2, dtype=torch.bool)
        dist.recv(flags, 0)
        if flags.tolist() != [True, False]:
            fails.append("recv bool")
    # the object collectives
    objs: list[Any] = [None] * p
    dist.all_gather_object(objs, {"rank": me, "pad": "x" * me})
    if objs != [{"rank": r, "pad": "x" * r} for r in range(p)]:
        fails.append(f"all_gather_object {objs}")
    lst: list[Any] = [me, None] if me else ["zero", {"k": 1}]
    dist.broadcast_object_list(lst, src=0)
    if lst != ["zero", {"k": 1}]:
        fails.append(f"broadcast_object_list {lst}")
    gathered: list[Any] | None = [None] * p if me == 0 else None
    dist.gather_object(("g", me), gathered, dst=0)
    if me == 0 and gathered != [("g", r) for r in range(p)]:
        fails.append(f"gather_object {gathered}")
    got_obj: list[Any] = [None]
    dist.scatter_object_list(got_obj, [f"s{r}" for r in range(p)] if me == 0 else None,
                             src=0)
    if got_obj != [f"s{me}"]:
        fails.append(f"scatter_object_list {got_obj}")
    dist.barrier()
    # coalesced forms
    xs = [torch.full((3,), float(me)), torch.full((2,), float(me)),
          torch.full((4,), float(me))]
    dist.all_reduce_coalesced(xs)
    s = sum(range(p))
    if [x.tolist() for x in xs] != [[float(s)] * 3, [float(s)] * 2, [float(s)] * 4]:
        fails.append(f"all_reduce_coalesced {xs}")
    # the coalescing manager's fast paths (FSDP's): one coalesced call per kind
    ins = [torch.full((2,), float(me)), torch.full((3,), 1.0 + me)]
    gathered_t = [torch.empty(2 * p), torch.empty(3 * p)]
    scattered = [torch.empty(2), torch.empty(3)]
    reduced = [x.clone() for x in ins]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, x in zip(gathered_t, ins, strict=True):
            dist.all_gather_into_tensor(o, x)
    cm.wait()
    with dist._coalescing_manager():
        for o, x in zip(scattered, gathered_t, strict=True):
            dist.reduce_scatter_tensor(o, x)
    with dist._coalescing_manager():
        for x in reduced:
            dist.all_reduce(x, op=R.MAX)
    if [g.tolist() for g in gathered_t] != [
            [float(r) for r in range(p) for _ in range(2)],
            [1.0 + r for r in range(p) for _ in range(3)]]:
        fails.append(f"coalesced all_gather_into_tensor {gathered_t}")
    if [o.tolist() for o in scattered] != [[float(p * me)] * 2, [float(p * (1 + me))] * 3]:
        fails.append(f"coalesced reduce_scatter_tensor {scattered}")
    if [x.tolist() for x in reduced] != [[float(p - 1)] * 2, [float(p)] * 3]:
        fails.append(f"coalesced all_reduce MAX {reduced}")


def _errors(fails: list[str]) -> None:
    """Bad arguments raise ValueError naming the rank, on every rank, without a hang."""
    me = dist.get_rank()
    calls: list[Callable[[], object]] = [
        lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=R.AVG),
        lambda: dist.all_reduce(torch.ones(3), op=R.BXOR)]
    for call in calls:
        try:
            call()
            fails.append("a bad op did not raise")
        except ValueError as exc:
            if f"rank {me}" not in str(exc):
                fails.append(f"error does not name the rank: {exc}")
    import bitcoll.torch as bt

    if bt.communicator_of().size != dist.get_world_size():
        fails.append("communicator_of: wrong size")
    try:
        bt.communicator_of(dist.new_group(backend="gloo"))
        fails.append("communicator_of(gloo group) did not raise")
    except ValueError:
        pass
    if bt.submit(lambda comm: comm.rank).wait() != me:
        fails.append("submit")
    bt.register()  # again: harmless
    if dist.get_backend() != "bitcoll" or "BITCOLL" not in dist.Backend._plugins:
        fails.append("registration")


def _callbacks(fails: list[str]) -> None:
    """A future's callback that issues a collective and waits for it (PowerSGD's hook does):
    torch runs the callback on the thread that completed the future, the group's worker, which
    then runs the new collective itself instead of waiting for it forever."""
    p = dist.get_world_size()
    x, y, z = torch.ones(2), torch.ones(3), torch.ones(4)

    def nested(fut: Any) -> Any:
        dist.all_reduce(y, async_op=True).get_future().wait()
        dist.all_reduce(z)  # synchronous, also inside the callback
        return fut.value()[0].tolist()

    got = dist.all_reduce(x, async_op=True).get_future().then(nested).wait()
    if got != [float(p)] * 2 or y.tolist() != [float(p)] * 3 or z.tolist() != [float(p)] * 4:
        fails.append(f"collectives inside a future's callback: {got} {y} {z}")


def _sparse(fails: list[str]) -> None:
    """Sparse COO all_reduce (SUM): every rank gets the sum, the same indices and bits
    everywhere; rank-dependent entry counts, duplicates, an empty rank, a dense dimension.
    Shapes that differ are a ValueError on every rank and leave the group usable; other ops
    and other collectives refuse sparse tensors with a ValueError naming the rank."""
    p, me = dist.get_world_size(), dist.get_rank()

    def mine(r: int) -> Any:
        g = torch.Generator().manual_seed(500 + r)
        n = 0 if r == 1 else 3 + 2 * r  # rank 1 holds no entries
        idx = torch.randint(0, 6, (2, n), generator=g)  # duplicates among them
        vals = torch.randn(n, 3, generator=g, dtype=torch.float64)
        return torch.sparse_coo_tensor(idx, vals, (6, 5, 3))

    x = mine(me)
    dist.all_reduce(x)
    want = sum(mine(r).to_dense() for r in range(p))
    if not x.is_sparse or not torch.allclose(x.to_dense(), want, rtol=0, atol=1e-12):
        fails.append(f"sparse all_reduce: {x}")
    got = [None] * p
    dist.all_gather_object(got, (x.indices().tolist(), x.values().tolist()))
    if any(g != got[0] for g in got):
        fails.append("sparse all_reduce: the ranks' results differ")
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: dist.all_reduce(torch.zeros(2 + me, 2).to_sparse()), "different shapes"),
        (lambda: dist.all_reduce(mine(me), op=R.MAX), "ReduceOp.SUM only"),
        (lambda: dist.broadcast(mine(me), src=0), "use .to_dense()")]
    for bad, why in cases:
        try:
            bad()
            fails.append(f"no error for {why}")
        except ValueError as exc:
            if why not in str(exc) or f"rank {me}" not in str(exc):
                fails.append(f"unclear error for {why}: {exc}")
    y = torch.ones(2)
    dist.all_reduce(y)
    if y.tolist() != [float(p)] * 2:
        fails.append("the group is not usable after the sparse errors")


def _training(fails: list[str]) -> None:
    """DDP and FSDP2 on the bitcoll backend against the same runs on gloo."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    me = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def batches() -> list[Any]:
        g = torch.Generator().manual_seed(100 + me)
        return [torch.randn(4, 8, generator=g) for _ in range(4)]

    def steps(m: Any, full: Callable[[Any], Any] = lambda q: q, opt: Any = None,
              extra: int = 0, join: bool = False) -> list[Any]:
        """Train ``m`` on the batches (``extra`` more on this rank; every rank under DDP's
        ``join()`` with ``join``) with ``opt`` (default SGD); its parameters after (``full``
        of each)."""
        opt = opt or torch.optim.SGD(m.parameters(), lr=0.1)
        with m.join() if join else contextlib.nullcontext():
            for x in batches() + batches()[:extra]:
                opt.zero_grad()
                m(x).pow(2).mean().backward()
                opt.step()
        return [full(q).detach().clone() for q in m.parameters()]

    def ddp(pg: Any) -> list[Any]:
        return steps(DDP(copy.deepcopy(base), process_group=pg, bucket_cap_mb=0.0001))

    def fsdp(pg: Any) -> list[Any]:
        m = copy.deepcopy(base)
        mesh = DeviceMesh.from_group(pg, "cpu")
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return steps(m, lambda q: q.full_tensor())

    class Sparse(torch.nn.Module):  # type: ignore[misc,name-defined]  # torch: Any here
        def __init__(self) -> None:
            super().__init__()
            self.e = torch.nn.Embedding(50, 8, sparse=True)
            self.l = torch.nn.Linear(8, 4)

        def forward(self, x: Any) -> Any:
            idx = (x.abs() * 10).long().clamp(max=49)  # rank-dependent rows of the embedding
            return torch.stack([self.l(self.e(idx[:, j])) for j in range(2)]).sum(0)

    sparse_base = Sparse()

    def ddp_sparse(pg: Any) -> list[Any]:
        """DDP over sparse embedding gradients (its reducer all-reduces them unbucketed)."""
        return steps(DDP(copy.deepcopy(sparse_base), process_group=pg))

    def ddp_powersgd(pg: Any) -> list[Any]:
        """DDP with torch's PowerSGD hook (collectives inside its futures' callbacks), one
        bucket: with several, the callbacks' collectives and the next buckets' race for
        their places in the order on a CPU backend (gloo then aborts the process with a size
        mismatch, bitcoll raises a ProtocolError)."""
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        m = DDP(copy.deepcopy(base), process_group=pg)
        m.register_comm_hook(ps.PowerSGDState(process_group=pg, matrix_approximation_rank=1,
                                              start_powerSGD_iter=2), ps.powerSGD_hook)
        return steps(m)

    def ddp_fp16(pg: Any) -> list[Any]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        m = DDP(copy.deepcopy(base), process_group=pg)
        m.register_comm_hook(pg, default_hooks.fp16_compress_hook)
        return steps(m)

    def ddp_join(pg: Any) -> list[Any]:
        """Uneven inputs: rank r trains r more steps under ``join()``."""
        return steps(DDP(copy.deepcopy(base), process_group=pg), extra=me, join=True)

    def ddp_zero(pg: Any) -> list[Any]:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        m = DDP(copy.deepcopy(base), process_group=pg)
        return steps(m, opt=ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD,
                                                    process_group=pg, lr=0.1))

    for name, fn in (("DDP", ddp), ("FSDP2", fsdp), ("DDP, sparse embedding", ddp_sparse),
                     ("DDP, PowerSGD hook", ddp_powersgd), ("DDP, fp16 hook", ddp_fp16),
                     ("DDP, join", ddp_join), ("DDP, ZeRO", ddp_zero)):
        a, b = fn(dist.group.WORLD), fn(gloo)
        if not all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b,
                                                                                 strict=True)):
            fails.append(f"{name} differs from gloo")
        start = sparse_base if name.startswith("DDP, sparse") else base
        if any(torch.equal(x, y) for x, y in zip(a, start.parameters(), strict=True)):
            fails.append(f"{name} did not train")


# ------------------------------------------------------------------------ scenarios
def _scenario_full(fails: list[str]) -> None:
    _sweep(None, DTYPES, LENGTHS, fails)
    _p2p_and_objects(fails)
    _errors(fails)
    _sparse(fails)
    _callbacks(fails)
    p, me = dist.get_world_size(), dist.get_rank()
    sub = dist.new_group([0, p - 1])  # every rank calls it; only the members get a group
    if me in (0, p - 1):
        _sweep(sub, SMALL_DTYPES, [0, 9], fails, salt=3000)
    mine, _ = dist.new_subgroups(group_size=1)
    x = torch.full((2,), float(me))
    dist.all_reduce(x, group=mine)
    if x.tolist() != [float(me)] * 2:
        fails.append("new_subgroups of one rank")


def _monitored(fails: list[str]) -> None:
    """bitcoll.torch.monitored_barrier: passes when all arrive; names the ranks that stayed
    out (the first, or all with wait_all_ranks) on every rank, the late ones included."""
    import bitcoll.torch as bt

    p, me = dist.get_world_size(), dist.get_rank()
    try:
        dist.monitored_barrier()
        fails.append("torch's monitored_barrier accepted a bitcoll group")
    except ValueError:
        pass  # torch serves it for gloo only
    bt.monitored_barrier()
    out = [r for r in range(p) if r >= 2]
    limit = datetime.timedelta(seconds=2)
    for wait_all, named in ((True, ", ".join(map(str, out))), (False, str(out[0]))):
        if me not in out:  # the others stay out until the verdict is given
            try:
                bt.monitored_barrier(timeout=limit, wait_all_ranks=wait_all)
                fails.append("monitored_barrier passed with ranks missing")
            except dist.DistBackendError as exc:
                if f"{named} of {p} did not arrive" not in str(exc):
                    fails.append(f"monitored_barrier does not name ranks {named}: {exc}")
        dist.barrier()
        if me in out:  # late: the verdict is there, naming this rank
            try:
                bt.monitored_barrier(timeout=limit, wait_all_ranks=wait_all)
                fails.append("a late rank passed monitored_barrier")
            except dist.DistBackendError as exc:
                if "did not arrive" not in str(exc):
                    fails.append(f"late rank: {exc}")
        bt.monitored_barrier(timeout=datetime.timedelta(seconds=TIMEOUT))  # in step again


def _lean(fails: list[str]) -> None:
    """The synchronous all-reduce of one contiguous tensor runs on the calling thread at once
    when nothing is queued, but never ahead of a job queued before it; shapes it handles
    (0-d, a parameter that requires grad, one element of a strided tensor)."""
    import bitcoll.torch as bt

    p, me = dist.get_world_size(), dist.get_rank()
    total = p * (p - 1) // 2
    for x in (torch.tensor(float(me)), torch.full((3,), float(me), requires_grad=True),
              torch.zeros(8)[3:4].fill_(me), torch.full((2, 3), me, dtype=torch.int64),
              torch._neg_view(torch.full((3,), -float(me)))):
        dist.all_reduce(x)
        if not bool((x == total).all()):
            fails.append(f"lean all_reduce of shape {tuple(x.shape)}: {x}")
    started, go = threading.Event(), threading.Event()
    order: list[str] = []

    def first(comm: Any) -> None:
        started.set()
        go.wait(TIMEOUT)
        order.append("submitted")

    fut = bt.submit(first)
    started.wait(TIMEOUT)
    y = torch.full((5,), float(me))
    worker = bt._group(None)._worker
    moved = threading.Event()  # the call was queued, or (wrongly) it finished
    queue_it = worker.submit

    def submit(*args: Any, **kwargs: Any) -> Any:
        work = queue_it(*args, **kwargs)
        moved.set()
        return work

    def sync_call() -> None:
        dist.all_reduce(y)
        order.append("sync")
        moved.set()

    worker.submit = submit  # type: ignore[method-assign]
    caller = threading.Thread(target=sync_call)
    caller.start()
    moved.wait(TIMEOUT)
    worker.submit = queue_it  # type: ignore[method-assign]
    if not worker._pending or not caller.is_alive():
        fails.append(f"a synchronous all_reduce ran ahead of a queued job: {order}")
    go.set()
    caller.join(TIMEOUT)
    fut.wait()
    if order != ["submitted", "sync"] or not bool((y == total).all()):
        fails.append(f"order {order}, result {y}")


def _scenario_small(fails: list[str]) -> None:
    _lean(fails)
    _sweep(None, SMALL_DTYPES, [0, 1, 9, 1001], fails)
    _p2p_and_objects(fails)
    _monitored(fails)


def _dtensor_and_checkpoint(fails: list[str]) -> None:
    """DTensor (shard, replicate, a sharded matmul, functional collectives) and a
    distributed checkpoint saved and loaded, on the default (bitcoll) group."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    p, me = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (p,))
    x = torch.arange(p * 4.0).reshape(p * 2, 2)
    d = distribute_tensor(x, mesh, [Shard(0)])
    if not torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), x) or \
            not torch.equal(d.full_tensor(), x):
        fails.append("DTensor shard/replicate")
    a = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    b = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])
    c: Any = a @ b  # a DTensor (typed as a Tensor)
    if c.full_tensor().sum().item() != 64.0:
        fails.append("DTensor matmul")
    if funcol.all_reduce(torch.full((3,), float(me)), "sum", mesh).tolist() != \
            [float(sum(range(p)))] * 3:
        fails.append("functional all_reduce")
    where = [tempfile.mkdtemp(prefix="bitcoll-dcp-") if me == 0 else None]
    dist.broadcast_object_list(where, src=0)
    dcp.save({"w": torch.arange(4.0) + 10}, checkpoint_id=where[0])  # type: ignore[attr-defined]
    back = {"w": torch.zeros(4)}
    dcp.load(back, checkpoint_id=where[0])  # type: ignore[attr-defined]
    if back["w"].tolist() != [10.0, 11.0, 12.0, 13.0]:
        fails.append(f"DCP save/load: {back}")


def _scenario_training(fails: list[str]) -> None:
    _sweep(None, [torch.float16, torch.int8, torch.complex64], [7], fails)
    _training(fails)
    _dtensor_and_checkpoint(fails)


def _scenario_killed(fails: list[str]) -> None:
    """The last rank dies before the second all_reduce; the others must raise torch's error
    for a lost peer (``DistNetworkError``) naming their rank, in well under the group's
    deadline (TIMEOUT): its connections close, nothing waits for the deadline."""
    p, me = dist.get_world_size(), dist.get_rank()
    dist.all_reduce(torch.ones(4))
    if me == p - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 16))
        dist.all_reduce(torch.ones(4))
        fails.append("no error after a rank was killed")
    except dist.DistNetworkError as exc:
        elapsed = time.monotonic() - t0
        if f"rank {me}" not in str(exc):
            fails.append(f"error does not name the rank: {exc}")
        if elapsed >= TIMEOUT / 2:
            fails.append(f"raised after {elapsed:.1f} s, not well before the {TIMEOUT:.0f} s "
                         "deadline")
    except dist.DistError as exc:
        fails.append(f"{type(exc).__name__} instead of DistNetworkError: {exc}")
    try:
        dist.all_reduce(torch.ones(4))
        fails.append("the group is usable after the failure")
    except dist.DistError:
        pass


def _ddp_killed(fails: list[str], hook: bool) -> None:
    """The last rank dies in the third step of DDP training (with lioncub's hook when
    ``hook``): the others' backward raises (DDP's reducer reads the failed future) instead
    of crashing the process or failing to read it, well before the group's deadline,
    naming the lost peer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lioncub.torch_hooks import LionCubHookState, LionCubStep, lioncub_hook

    p, me = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    m = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4)))
    opt: Any = torch.optim.SGD(m.parameters(), lr=0.1)
    state = None
    if hook:
        opt = LionCubStep(m.parameters(), lr=1e-3)
        state = LionCubHookState(opt, variant="lioncub-l1")  # its own communicator
        m.register_comm_hook(state, lioncub_hook)
    t0 = time.monotonic()
    try:
        for step in range(4):
            if step == 2:
                if me == p - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                t0 = time.monotonic()
            opt.zero_grad()
            m(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
        fails.append("no error after a rank was killed")
    except RuntimeError as exc:
        if ("PeerLostError" not in str(exc) and "peer lost" not in str(exc)) or \
                f"rank {me}" not in str(exc):
            fails.append(f"unclear error: {exc}")
        if time.monotonic() - t0 >= TIMEOUT / 2:
            fails.append(f"raised after {time.monotonic() - t0:.1f} s")
    finally:
        if state is not None:  # the hook's thread, and the communicator split for it
            state.close()
            state.comm.close()  # type: ignore[attr-defined]


def _scenario_timeout(fails: list[str]) -> None:
    """The last rank stays out of an all_reduce: the others raise by the group's deadline
    (init_process_group's timeout, short here) naming their rank; it waits for them through
    the store (no sleep), then everyone stops. Rank 0 hosts the store, so it stays until the
    last rank has read the keys (else the store could vanish under its wait)."""
    p, me = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    dist.all_reduce(torch.ones(4))  # connected
    if me == p - 1:
        store.wait([f"test/raised/{r}" for r in range(p - 1)],
                   datetime.timedelta(seconds=TIMEOUT))
        store.set("test/seen", "1")
        return
    try:
        dist.all_reduce(torch.ones(4))
        fails.append("no error although a rank stayed out")
    except dist.DistError as exc:
        if f"rank {me}" not in str(exc):
            fails.append(f"error does not name the rank: {exc}")
    store.set(f"test/raised/{me}", "1")
    if me == 0:
        store.wait(["test/seen"], datetime.timedelta(seconds=TIMEOUT))


NOTE = "failed its argument check before it started"


def _lopsided_call(call: Callable[[], object], quote: str, fails: list[str]) -> None:
    """``call`` fails its argument check on rank 1 only: a ValueError there; on the others a
    DistError whose message quotes rank 1's reason (contains ``quote``)."""
    me = dist.get_rank()
    try:
        call()
        fails.append(f"no error, expected one quoting {quote!r}")
    except ValueError as exc:
        if me != 1:
            fails.append(f"rank {me} raised ValueError: {exc}")
    except dist.DistError as exc:
        if me == 1:
            fails.append(f"rank 1 raised {type(exc).__name__}: {exc}")
        elif quote not in str(exc):
            fails.append(f"rank {me}'s error does not quote rank 1's check: {exc}")


def _scenario_lopsided(fails: list[str]) -> None:
    """A bad argument on one rank only: its check raises there, before the collective; the
    ranks whose arguments passed are left in the collective and fail when rank 1 goes on to
    its next call, and their errors quote rank 1's reason (the note it left in the group's
    store); rank 1's next call names its own failed check. A mistake every rank made leaves
    the group usable, and its notes are not quoted by a later, unrelated mismatch."""
    p, me = dist.get_world_size(), dist.get_rank()
    sub = dist.new_group(backend="bitcoll")  # for the second half (the default group dies)
    # The same mistake on every rank, then a mismatch of its own at the same number.
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.int32), op=R.AVG)
        fails.append("a bad op did not raise")
    except ValueError:
        pass
    try:
        dist.all_reduce(torch.ones(4 + me))
        fails.append("mismatched lengths did not raise")
    except dist.DistError as exc:
        if NOTE in str(exc):
            fails.append(f"a mismatch quotes the checks every rank failed: {exc}")
    # One rank's mistake.
    x = torch.full((4,), float(me))
    out = torch.empty(4 * p + (1 if me == 1 else 0))
    _lopsided_call(lambda: dist.all_gather_into_tensor(out, x, group=sub),
                   f"rank 1's all_gather_into_tensor {NOTE}: output must have", fails)
    if me == 1:
        try:
            dist.barrier(group=sub)
            fails.append("the barrier after a lopsided call passed")
        except dist.DistError as exc:
            if f"this rank's all_gather_into_tensor had {NOTE[:-25]}" not in str(exc):
                fails.append(f"rank 1's next call does not name its failed check: {exc}")


def _scenario_lopsided_timeout(fails: list[str]) -> None:
    """As in ``lopsided``, but rank 1 makes no further call (it waits for the others through
    the store): they raise at the group's deadline, quoting rank 1's reason."""
    p, me = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    dist.all_reduce(torch.ones(4))  # connected
    _lopsided_call(lambda: dist.broadcast(torch.ones(4), src=0 if me != 1 else p),
                   f"rank 1's broadcast {NOTE}: root {p} is not a rank", fails)
    if me == 1:
        store.wait([f"test/raised/{r}" for r in range(p) if r != 1],
                   datetime.timedelta(seconds=TIMEOUT))
        store.set("test/seen", "1")
        return
    store.set(f"test/raised/{me}", "1")
    if me == 0:
        store.wait(["test/seen"], datetime.timedelta(seconds=TIMEOUT))


SCENARIOS: dict[str, Callable[[list[str]], None]] = {
    "full": _scenario_full, "small": _scenario_small, "training": _scenario_training,
    "killed": _scenario_killed, "timeout": _scenario_timeout,
    "lopsided": _scenario_lopsided, "lopsided_timeout": _scenario_lopsided_timeout,
    "ddp_killed": functools.partial(_ddp_killed, hook=False),
    "ddp_hook_killed": functools.partial(_ddp_killed, hook=True)}
#: init_process_group's timeout (seconds) where a scenario needs another one.
SCENARIO_TIMEOUT = {"timeout": 3.0, "lopsided_timeout": 3.0}


def _rank_main(rank: int, size: int, how: str, where: str, scenario: str,
               results: Any) -> None:
    os.environ["NUMBA_NUM_THREADS"] = "1"
    fails: list[str] = []
    try:
        import bitcoll.torch  # noqa: F401  (registers "bitcoll")

        timeout = datetime.timedelta(seconds=SCENARIO_TIMEOUT.get(scenario, TIMEOUT))
        if how == "store":
            host, port = where.split(":")
            store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout)
            dist.init_process_group("bitcoll", store=store, rank=rank, world_size=size,
                                    timeout=timeout)
        elif how == "env":
            dist.init_process_group("bitcoll", timeout=timeout)
        else:
            dist.init_process_group("bitcoll", init_method=where, rank=rank, world_size=size,
                                    timeout=timeout)
        SCENARIOS[scenario](fails)
        dist.destroy_process_group()
        # the groups' threads ended with them: none is left to be cut short by pthread_exit
        # (an abort) when the interpreter finalizes
        left = [t.name for t in threading.enumerate() if t.name.startswith("bitcoll-")]
        if left:
            fails.append(f"threads alive after destroy_process_group: {left}")
    except BaseException:
        fails.append(f"rank {rank} raised:\n{traceback.format_exc()}")
    results.put((rank, fails))


def _run(size: int, how: str, scenario: str, timeout: float = 240.0,
         expect_dead: tuple[int, ...] = ()) -> None:
    if how == "tcp":
        where = f"tcp://127.0.0.1:{free_port()}"
    elif how == "file":
        where = "file://" + os.path.join(tempfile.mkdtemp(prefix="bitcoll-torch-"), "rdv")
    else:
        where = f"127.0.0.1:{free_port()}"
    results = context(__name__).Queue()
    procs = [start(_rank_main, r, size, how, where, scenario, results) for r in range(size)]
    got: dict[int, list[str]] = {}
    try:
        while len(got) < size - len(expect_dead):
            try:
                rank, fails = results.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(size)) - set(got))} did not "
                                     f"finish within {timeout} s") from None
            got[rank] = fails
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    bad = {r: f for r, f in got.items() if f}
    assert not bad, "\n".join(f"--- rank {r}:\n" + "\n".join(f) for r, f in sorted(bad.items()))
    assert set(got) == set(range(size)) - set(expect_dead)


@pytest.mark.timeout(300)
def test_every_collective_tcp_init_three_ranks() -> None:
    """tcp://, 3 ranks: every op and dtype and length, sub-groups, p2p, objects, errors."""
    _run(3, "tcp", "full")


@pytest.mark.timeout(300)
def test_store_init_four_ranks() -> None:
    """An explicit TCPStore (store=), 4 ranks."""
    _run(4, "store", "small")


@pytest.mark.timeout(300)
def test_ddp_and_fsdp_match_gloo_file_init() -> None:
    """file://, 2 ranks: DDP and FSDP2 train to gloo's parameters."""
    _run(2, "file", "training")


@pytest.mark.timeout(300)
def test_killed_rank_fails_the_survivors() -> None:
    """A killed rank: the others raise DistNetworkError naming their rank, in under half the
    group's 60 s deadline."""
    _run(3, "tcp", "killed", expect_dead=(2,))


@pytest.mark.timeout(300)
def test_killed_rank_inside_ddp_backward() -> None:
    """DDP training, a rank killed, with DDP's own all-reduce and with lioncub's hook: the
    survivors' backward raises (DDP's reducer crashed the process when the failed future
    carried the error as its value; the hook's failure could not be read as a tensor)."""
    _run(3, "tcp", "ddp_killed", expect_dead=(2,))
    _run(3, "tcp", "ddp_hook_killed", expect_dead=(2,))


@pytest.mark.timeout(300)
def test_timeout_of_init_process_group_is_honoured() -> None:
    """A rank that stays out of a collective: the others raise DistError by the 3 s deadline
    given to init_process_group (not the 60 s of the other tests)."""
    _run(3, "tcp", "timeout", timeout=120.0)


@pytest.mark.timeout(300)
def test_a_bad_argument_on_one_rank_is_quoted_by_the_others() -> None:
    """One rank's argument check fails: the others, left in the collective, quote its reason
    when it moves on (3 ranks) and when it does not (at the 3 s deadline)."""
    _run(3, "tcp", "lopsided")
    _run(3, "tcp", "lopsided_timeout", timeout=120.0)


@pytest.mark.timeout(300)
def test_env_init_under_launch() -> None:
    """env:// with the ranks started by ``python -m launch``."""
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "launch", "-n", "2", __file__], env=env,
                          capture_output=True, text=True, timeout=240,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("bitcoll env:// OK") == 2, proc.stdout + proc.stderr


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_cuda_tensors_staged() -> None:
    """CUDA tensors through the host (needs a CUDA device)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _run(2, "tcp", "cuda")


def _scenario_cuda(fails: list[str]) -> None:
    me, p = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", me % torch.cuda.device_count())
    x = torch.full((1000,), float(me + 1), device=dev)
    dist.all_reduce(x)
    if x.device != dev or not torch.equal(x.cpu(), torch.full((1000,), float(sum(range(1,
                                                                                    p + 1))))):
        fails.append("cuda all_reduce")
    big = torch.arange(2 * p * 6, dtype=torch.float32, device=dev).reshape(2 * p, 6)[:, ::2]
    out = torch.empty(p * 2 * p, 3, device=dev)
    dist.all_gather_into_tensor(out, big)
    if not torch.equal(out.cpu(), torch.cat([big.cpu()] * p)):
        fails.append("cuda all_gather_into_tensor of a non-contiguous tensor")
    t = torch.full((3,), float(me), device=dev)
    dist.broadcast(t, 1)
    if t.cpu().tolist() != [1.0] * 3:
        fails.append("cuda broadcast")


SCENARIOS["cuda"] = _scenario_cuda


def _main() -> None:
    """Run by ``python -m launch -n 2 tests/test_torch_backend.py`` (env:// init)."""
    fails: list[str] = []
    import bitcoll.torch  # noqa: F401

    dist.init_process_group("bitcoll", timeout=datetime.timedelta(seconds=TIMEOUT))
    _sweep(None, [torch.float32, torch.int32], [0, 9], fails)
    _p2p_and_objects(fails)
    dist.destroy_process_group()
    if fails:
        print("\n".join(fails))
        sys.exit(1)
    print("bitcoll env:// OK")


if __name__ == "__main__":
    _main()


def test_store_secret_across_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without BITCOLL_SECRET the ranks of one host leave the secret to rank 0's private file
    (None); ranks on several hosts agree on a fresh per-group secret through the store."""
    import socket
    import threading

    import bitcoll.torch as bt

    monkeypatch.delenv("BITCOLL_SECRET", raising=False)
    monkeypatch.delenv("BITCOLL_INSECURE", raising=False)
    for hosts, shared in ((["a", "a", "a"], False), (["a", "b", "a"], True)):
        monkeypatch.setattr(socket, "gethostname",
                            lambda hosts=hosts: hosts[int(threading.current_thread().name)])
        store = dist.HashStore()
        got: dict[int, Any] = {}

        def rank(r: int, store: Any = store, got: dict[int, Any] = got) -> None:
            got[r] = bt._store_secret(store, r, 3)

        threads = [threading.Thread(target=rank, args=(r,), name=str(r)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(got) == 3
        if shared:
            assert got[0] is not None and len(got[0]) == 64 and got[0] == got[1] == got[2]
        else:
            assert got == {0: None, 1: None, 2: None}
