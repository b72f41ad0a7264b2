"""Starting weights and replica checks (lioncub.replicas, ``broadcast_parameters``,
``check_replicas``), the typing seam (lioncub.comm) and the DDP hook (lioncub.torch).

Single-process tests run on a local communicator. The multi-rank tests run one world per size
(2 and 3 ranks, real processes over TCP via ``multiproc.run_world``); every rank runs
:func:`target_all`, a battery of checks that records None or its traceback per check plus
digests of the parameters, and the tests assert that every check passed on every rank and
that the digests agree across ranks. The DDP check also joins a torch.distributed gloo group
whose rendezvous is a file store (no port shared with bitcoll).
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from errcheck import raises_usage
from multiproc import run_world

import bitcoll
import lioncub
import lioncub.torch as lt
from bitcoll.errors import UsageError
from lioncub.comm import CommLike, TrafficStatsLike
from lioncub.replicas import (
    ReplicaMismatchError,
    ReplicaSet,
    checksum,
    checksums,
    find_mismatch,
)

SHAPES: list[tuple[int, ...]] = [(12, 9), (9,), (0, 3), (40,), (3, 3, 3)]
NAMES = ["a.weight", "a.bias", "empty", "b.weight", "b.kernel"]
BUCKET_BYTES = 4 * 64
HYPER: dict[str, Any] = {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.1}


def initial_params(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def local_grads(rank: int, step: int) -> list[np.ndarray | None]:
    rng = np.random.default_rng([77, step, rank])
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def tensor_digest(tensors: list[torch.Tensor]) -> str:
    return digest([t.detach().numpy() for t in tensors])


def expect_mismatch(call: Callable[[], object]) -> ReplicaMismatchError:
    try:
        call()
    except ReplicaMismatchError as exc:
        return exc
    raise AssertionError("the replicas were not found to differ")


@pytest.fixture(scope="module")
def comm() -> Any:
    with bitcoll.init("local") as c:
        yield c


class RecordingComm:
    """A CommLike wrapper that records the collectives lioncub calls."""

    def __init__(self, inner: bitcoll.Communicator) -> None:
        self.inner = inner
        self.calls: list[str] = []

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def stats(self) -> TrafficStatsLike:
        return self.inner.stats

    def allreduce(self, x: Any, op: str = "sum", out: Any = None, *,
                  async_op: bool = False) -> Any:
        self.calls.append("allreduce")
        return self.inner.allreduce(x, op=op, out=out, async_op=async_op)

    def allgather(self, x: Any, out: Any = None) -> Any:
        self.calls.append(f"allgather:{x.dtype}:{x.size}")
        return self.inner.allgather(x, out=out)

    def broadcast(self, x: Any, root: int = 0) -> Any:
        self.calls.append(f"broadcast:{x.nbytes}")
        return self.inner.broadcast(x, root=root)

    def sign_allreduce(self, x: Any, op: str = "majority", tie: str = "alternate",
                       out: Any = None, *, async_op: bool = False,
                       algorithm: str | None = None) -> Any:
        self.calls.append("sign_allreduce")
        return self.inner.sign_allreduce(x, op=op, tie=tie, out=out, async_op=async_op,
                                         algorithm=algorithm)

    def quantized_allreduce(self, q: Any, levels: int, out: Any = None, *, op: str = "sum",
                            async_op: bool = False, algorithm: str | None = None) -> Any:
        self.calls.append("quantized_allreduce")
        return self.inner.quantized_allreduce(q, levels, out=out, op=op, async_op=async_op,
                                              algorithm=algorithm)


# ---------------------------------------------------------------- checksums
def test_checksum_is_bitwise() -> None:
    rng = np.random.default_rng(5)
    a = rng.standard_normal((33, 7)).astype(np.float32)
    base = checksum(a)
    assert checksum(a.copy()) == base
    assert checksum(np.asfortranarray(a)) == base  # the values in C order, not the memory
    flat = a.reshape(-1).view(np.uint32)
    for element in (0, 1, 2, 3, 100, a.size - 1):
        for bit in (0, 1, 22, 30, 31):  # mantissa, exponent and sign bits
            b = a.copy()
            b.reshape(-1).view(np.uint32)[element] = flat[element] ^ np.uint32(1 << bit)
            assert checksum(b) != base, (element, bit)
    zeros = np.zeros(4, np.float32)
    assert checksum(zeros) != checksum(-zeros)  # -0.0 == 0.0, but not bitwise
    # the dtype and shape count, not only the bytes
    assert len({checksum(np.zeros((2, 3), np.float32)), checksum(np.zeros((3, 2), np.float32)),
                checksum(np.zeros(6, np.float32)), checksum(np.zeros(6, np.int32)),
                checksum(np.zeros((0, 3), np.float32)), checksum(np.zeros(0, np.float32))}) == 6


def test_checksums_do_not_depend_on_threads() -> None:
    rng = np.random.default_rng(6)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in (3 << 20, 5, 2 << 20, 0)]
    one = checksums(arrays, threads=1)
    assert one.dtype == np.int64 and one.shape == (4,)
    assert np.array_equal(checksums(arrays, threads=3), one)
    assert one.tolist() == [checksum(a) for a in arrays]


def test_find_mismatch() -> None:
    same = np.array([[1, 2, 3]] * 3, np.int64)
    assert find_mismatch(same) is None
    assert find_mismatch(same[:1]) is None
    t = same.copy()
    t[2, 1] = 9
    assert find_mismatch(t) == (2, 1, (2,), (1,))
    t[1, 2] = 9
    assert find_mismatch(t) == (1, 2, (1, 2), (1, 2))
    t = same.copy()
    t[0, 0] = 7  # rank 0 is the odd one out: every other rank differs from it
    assert find_mismatch(t) == (1, 0, (1, 2), (0,))


def test_replica_set_arguments(comm: Any) -> None:
    a = np.zeros(3, np.float32)
    with raises_usage("arrays", 1):
        ReplicaSet([a, [1.0]])  # type: ignore[list-item]
    with raises_usage("arrays", 0):
        ReplicaSet([np.zeros((3, 4), np.float32).T])
    with raises_usage("names"):
        ReplicaSet([a], names=["x", "y"])
    named = ReplicaSet([a, a.copy()], names=["w", "b"])
    assert named.label(1) == "parameter 1 (b)"
    assert ReplicaSet([a], unnamed="name them").label(0) == "parameter 0 (unnamed; name them)"
    with raises_usage("root"):
        named.broadcast(comm, root=1)
    ro = np.zeros(2, np.float32)
    ro.flags.writeable = False
    with raises_usage("arrays", 0):
        ReplicaSet([ro]).broadcast(comm)
    named.check(comm)  # one rank always agrees with itself
    named.broadcast(comm)
    ReplicaSet([]).check(comm)
    assert issubclass(ReplicaMismatchError, UsageError)
    assert lioncub.ReplicaMismatchError is ReplicaMismatchError


# ---------------------------------------------------------------- one rank: the seam
def test_construction_collectives_through_comm_like(comm: Any) -> None:
    """The optimizer runs through any CommLike: construction is one agreement all-reduce,
    then one broadcast of the packed parameters (default) or one all-gather of one int64
    checksum per parameter (``broadcast_parameters=False``)."""
    rec = RecordingComm(comm)
    typed: CommLike = rec  # the wrapper satisfies the protocol (mypy-checked in lioncub)
    params = initial_params()
    opt = lioncub.DistributedLion(params, typed, names=NAMES, bucket_size=BUCKET_BYTES)
    nbytes = sum(p.nbytes for p in params)
    assert rec.calls == ["allreduce", f"broadcast:{nbytes}"]
    rec.calls.clear()
    lioncub.DistributedLion(params, rec, broadcast_parameters=False)
    assert rec.calls == ["allreduce", f"allgather:int64:{len(SHAPES)}"]
    rec.calls.clear()
    opt.check_replicas()
    assert rec.calls == [f"allgather:int64:{len(SHAPES)}"]
    rec.calls.clear()
    opt.step(local_grads(0, 0))
    assert "quantized_allreduce" in rec.calls
    with raises_usage("broadcast_parameters"):
        lioncub.DistributedLion(params, comm, broadcast_parameters=1)  # type: ignore[arg-type]
    with raises_usage("replicas"):
        lioncub.DistributedLion(params, comm, replicas=params)  # type: ignore[arg-type]


def test_torch_front_end_one_rank(comm: Any) -> None:
    """One rank: construction broadcasts or checks every tensor (frozen ones included),
    check_replicas passes, and a replaced storage is seen at check time."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    _linear(model, 0).bias.requires_grad_(False)
    rec = RecordingComm(comm)
    opt = lt.DistributedLion(model.parameters(), rec, broadcast_parameters=False)
    assert rec.calls == ["allreduce", "allgather:int64:4"]  # the frozen tensor is checked too
    opt.check_replicas()
    opt.broadcast_parameters()
    with raises_usage("root"):
        opt.broadcast_parameters(root=3)
    weight = _linear(model, 1).weight
    weight.data = weight.data.double()
    with raises_usage("params", index=2):
        opt.check_replicas()


# ---------------------------------------------------------------- multi-rank checks
def _odd_rank(p: int) -> int:
    return min(2, p - 1)


def check_core_broadcast(comm: Any, out: dict[str, Any], store: str) -> None:
    """Diverging starting weights: construction makes them rank 0's; broadcast_parameters
    copies any root's; ReplicaSet.broadcast packs small arrays and sends large ones where
    they are."""
    p, r = comm.size, comm.rank
    params = initial_params(seed=100 + r)  # every rank different
    opt = lioncub.DistributedLion(params, comm, names=NAMES, bucket_size=BUCKET_BYTES,
                                  **HYPER)
    want = initial_params(seed=100)
    for i, (x, w) in enumerate(zip(params, want, strict=True)):
        assert np.array_equal(x, w), f"parameter {i} is not rank 0's after construction"
    opt.check_replicas()
    out["core/broadcast"] = digest(params)
    # the same memory is still the optimizer's: train, check
    for t in range(3):
        opt.step(local_grads(r, t))
    opt.check_replicas()
    out["core/trained"] = digest(params)
    # every rank perturbs parameter 1 differently; broadcast from the last rank
    params[1] += np.float32(r)
    opt.broadcast_parameters(root=p - 1)
    out["core/root_last"] = digest(params)
    # chunked broadcast: arrays of 0, 10, 90, 400 and 4 bytes with 100-byte chunks
    arrays = [np.full(n, r + 1, np.uint8) for n in (0, 10, 90, 400, 4)]
    ReplicaSet(arrays).broadcast(comm, root=p - 1, chunk_bytes=100)
    assert all(np.all(a == p) for a in arrays)
    ReplicaSet(arrays).check(comm)


def check_core_mismatch(comm: Any, out: dict[str, Any], store: str) -> None:
    """broadcast_parameters=False: identical weights pass; one parameter differing on one
    rank (a sign of zero, the smallest bitwise difference) raises the same error on every
    rank; the communicator stays usable; check_replicas after training passes and finds a
    later divergence."""
    p, r = comm.size, comm.rank
    odd = _odd_rank(p)
    params = initial_params()
    opt = lioncub.DistributedLion(params, comm, names=NAMES, bucket_size=BUCKET_BYTES,
                                  broadcast_parameters=False, **HYPER)
    for t in range(4):
        opt.step(local_grads(r, t))
    opt.check_replicas()
    out["core/checked_trained"] = digest(params)

    bad = initial_params()
    bad[3][7] = np.float32(0.0)
    if r == odd:
        bad[3][7] = np.float32(-0.0)
    exc = expect_mismatch(lambda: lioncub.DistributedLion(
        bad, comm, names=NAMES, broadcast_parameters=False))
    assert (exc.rank, exc.index, exc.name, exc.ranks, exc.indices) == \
        (odd, 3, "b.weight", (odd,), (3,)), exc
    assert f"rank {odd}'s parameter 3 (b.weight) differs from rank 0's" in str(exc)
    out["core/error"] = str(exc)
    # unnamed: index only, and how to get names
    exc = expect_mismatch(lambda: lioncub.DistributedLion(bad, comm,
                                                          broadcast_parameters=False))
    assert exc.name is None and f"rank {odd}'s parameter 3 (unnamed; pass names=" in str(exc)
    # the communicator is still usable: the default broadcast repairs the replicas
    opt = lioncub.DistributedLion(bad, comm, names=NAMES, **HYPER)
    assert np.signbit(bad[3][7]) == np.False_
    for t in range(2):
        opt.step(local_grads(r, t))
    opt.check_replicas()
    # a divergence after training is found too (every rank raises)
    if r == odd:
        bad[4].reshape(-1)[-1] += np.float32(1.0)
    exc = expect_mismatch(opt.check_replicas)
    assert (exc.rank, exc.index, exc.name) == (odd, 4, "b.kernel")
    if p >= 3:  # rank 0 is the odd one out: every other rank differs from it
        fresh = initial_params()
        if r == 0:
            fresh[0][0, 0] += np.float32(1.0)
        exc = expect_mismatch(lambda: ReplicaSet(fresh, NAMES).check(comm))
        assert (exc.rank, exc.index, exc.ranks) == (1, 0, tuple(range(1, p)))
    # ranks disagreeing about broadcast_parameters: the construction check says so
    with pytest.raises(UsageError, match="differently"):
        lioncub.DistributedLion(initial_params(), comm, broadcast_parameters=r != 0)
    # None: neither broadcast nor check (the differing replicas stay as they are) until the
    # caller checks them; a value that is not True, False or None is refused
    bad = initial_params()
    if r == odd:
        bad[3].reshape(-1)[0] += np.float32(1.0)
    kept = digest(bad)
    opt = lioncub.DistributedLion(bad, comm, names=NAMES, broadcast_parameters=None)
    assert digest(bad) == kept
    exc = expect_mismatch(opt.check_replicas)
    assert (exc.rank, exc.index) == (odd, 3), exc
    with pytest.raises(UsageError) as refused:
        lioncub.DistributedLion(initial_params(), comm, broadcast_parameters="yes")  # type: ignore[arg-type]
    assert refused.value.argument == "broadcast_parameters"


def _linear(model: torch.nn.Sequential, index: int) -> torch.nn.Linear:
    layer = model[index]
    assert isinstance(layer, torch.nn.Linear)
    return layer


def _torch_model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _torch_step(model: torch.nn.Module, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(16, 6, generator=gen)
    y = torch.randn(16, 3, generator=gen)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]


def check_torch_front_end(comm: Any, out: dict[str, Any], store: str) -> None:
    """The torch front end: construction broadcasts every tensor, the frozen one included;
    with broadcast_parameters=False a frozen tensor differing on one rank is reported by its
    index in the param groups and its name (or as unnamed)."""
    p, r = comm.size, comm.rank
    odd = _odd_rank(p)
    model = _torch_model(seed=200 + r)
    _linear(model, 0).bias.requires_grad_(False)
    opt = lt.DistributedLion(model.named_parameters(), comm, lr=1e-2)
    reference = _torch_model(seed=200)
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} is not rank 0's after construction"
    for t in range(3):
        _torch_step(model, r, t)
        opt.step()
    opt.check_replicas()
    assert torch.equal(_linear(model, 0).bias, _linear(reference, 0).bias)
    out["torch/trained"] = tensor_digest(list(model.parameters()))

    model = _torch_model(seed=3)
    _linear(model, 0).bias.requires_grad_(False)
    if r == odd:
        with torch.no_grad():
            _linear(model, 0).bias[2] += 1.0
    exc = expect_mismatch(lambda: lt.DistributedLion(model.named_parameters(), comm,
                                                     broadcast_parameters=False))
    assert (exc.rank, exc.index, exc.name) == (odd, 1, "0.bias"), exc
    assert f"rank {odd}'s parameter 1 (0.bias)" in str(exc)
    exc = expect_mismatch(lambda: lt.DistributedLion(model.parameters(), comm,
                                                     broadcast_parameters=False))
    assert exc.name is None
    assert "parameter 1 (unnamed; pass model.named_parameters() or names=" in str(exc)
    out["torch/error"] = str(exc)


def check_ddp_hook(comm: Any, out: dict[str, Any], store: str) -> None:
    """A DDP-wrapped model with no_allreduce_hook, trained with lioncub's DistributedLion,
    follows the unwrapped model's trajectory bit for bit (gradients and parameters after
    every step), with and without gradient_as_bucket_view; the gradients stay local (they
    differ between the ranks, where DDP's averaging would make them equal). Differences are
    collected and asserted after the last collective, so that a failure on one rank cannot
    leave the others waiting.

    (No gloo work is started during backward here, on purpose: torch stashes a Python object
    in the thread-local state of every backward pass, a work started then keeps a copy, and
    gloo's worker thread, which releases works, then needs the GIL; destroying the process
    group, which joins that thread while holding the GIL, can then deadlock. Plain DDP's
    averaging all-reduce is such a work.)"""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    p, r = comm.size, comm.rank
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=r, world_size=p,
                            timeout=datetime.timedelta(seconds=60))
    problems: list[str] = []
    try:
        plain = _torch_model(seed=5)
        models = {"ddp": copy.deepcopy(plain), "ddp-view": copy.deepcopy(plain)}
        wrapped = {"ddp": DDP(models["ddp"]),
                   "ddp-view": DDP(models["ddp-view"], gradient_as_bucket_view=True)}
        for w in wrapped.values():
            w.register_comm_hook(state=None, hook=lt.no_allreduce_hook)
        opts = {k: lt.DistributedLion(m.named_parameters(), comm, lr=1e-2)
                for k, m in models.items()}
        ref_opt = lt.DistributedLion(plain.named_parameters(), comm, lr=1e-2)
        for t in range(4):
            _torch_step(plain, r, t)
            for k, w in wrapped.items():
                _torch_step(w, r, t)
                for (name, a), b in zip(models[k].named_parameters(), plain.parameters(),
                                        strict=True):
                    if a.grad is None or b.grad is None or not torch.equal(a.grad, b.grad):
                        problems.append(f"{k}: {name}.grad differs at step {t}")
            ref_opt.step()
            for k in wrapped:
                opts[k].step()
                for (name, a), b in zip(models[k].named_parameters(), plain.parameters(),
                                        strict=True):
                    if not torch.equal(a, b):
                        problems.append(f"{k}: {name} differs at step {t}")
        opts["ddp"].check_replicas()
        out["ddp/trained"] = tensor_digest(list(plain.parameters()))
        # the gradients were not averaged: every tensor's gradient differs between ranks
        grads = [g.detach().numpy() for g in (q.grad for q in models["ddp"].parameters())
                 if g is not None]
        table = np.asarray(comm.allgather(checksums(grads))).reshape(p, -1)
        if len(grads) != 4 or (table == table[:1]).any(axis=1)[1:].any():
            problems.append(f"DDP gradient checksums do not all differ: {table}")
        del wrapped, opts
    finally:
        dist.destroy_process_group()
    assert not problems, problems


CHECKS: list[Callable[[Any, dict[str, Any], str], None]] = [
    check_core_broadcast,
    check_core_mismatch,
    check_torch_front_end,
    check_ddp_hook,
]


def target_all(comm: Any, store: str) -> dict[str, Any]:
    """Run every check on this rank; a failed check is recorded as its traceback. A check
    that fails on some ranks only leaves the collectives misaligned: the next collective then
    fails on every rank (ProtocolError or a timeout), and so do the later checks."""
    torch.set_num_threads(1)
    results: dict[str, Any] = {"failures": {}, "data": {}, "seconds": {}}
    for check in CHECKS:
        start = time.perf_counter()
        try:
            check(comm, results["data"], store)
        except Exception:  # recorded; a failed collective aborts the later checks too
            results["failures"][check.__name__] = traceback.format_exc()
        results["seconds"][check.__name__] = time.perf_counter() - start
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"p{p}")
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> list[dict[str, Any]]:
    store = tmp_path_factory.mktemp(f"gloo{request.param}") / "store"
    return run_world(request.param, target_all, str(store), timeout=300.0, comm_timeout=60.0)


CASES = [
    ("check_core_broadcast", "core/broadcast"),
    ("check_core_broadcast", "core/trained"),
    ("check_core_broadcast", "core/root_last"),
    ("check_core_mismatch", "core/checked_trained"),
    ("check_core_mismatch", "core/error"),
    ("check_torch_front_end", "torch/trained"),
    ("check_torch_front_end", "torch/error"),
    ("check_ddp_hook", "ddp/trained"),
]


@pytest.mark.tcp
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("check", "key"), CASES, ids=[c[1] for c in CASES])
def test_world(world: list[dict[str, Any]], check: str, key: str) -> None:
    failures = {r: res["failures"][check] for r, res in enumerate(world)
                if check in res["failures"]}
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items())
    values = [res["data"][key] for res in world]
    assert all(v == values[0] for v in values), f"{key} differs between ranks: {values}"
