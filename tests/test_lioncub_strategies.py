"""The variant registry and its extension point (lioncub.variants, lioncub.strategies).

A toy variant, one strategy class and one ``register`` line, runs end to end on thread worlds:
a majority vote whose +-1 votes travel as float32 through a plain ``allreduce(op="sum")`` and
whose ties go to +1. That is lioncub-mavo with ``tie="positive"`` by other means, so the
parameters and momenta must match lioncub-mavo's bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from errcheck import raises_usage
from inproc import run_threads

import lioncub
from lioncub.buckets import Bucket
from lioncub.comm import WorkLike
from lioncub.lion import Hyper
from lioncub.strategies import Buffers, QuantizedSum, VariantStrategy
from lioncub.variants import VariantSpec, register, unregister

SIZES = (0, 1, 7, 8, 9, 1001)  # element counts of the toy model's tensors
BUCKET_BYTES = 4 * 12          # several buckets, some with several tensors
STEPS = 4
TOY = "toy-float-majority"


class FloatMajority(VariantStrategy):
    """+-1 votes (``c >= 0`` votes +1) summed as float32; ``lr * (+1 if sum >= 0 else -1)``."""

    kind = "float-majority"
    result_dtype = np.int8

    def prepare(self, core: Any, bucket: Bucket, buf: Buffers,
                grads: Sequence[np.ndarray | None], hypers: Sequence[Hyper]) -> None:
        for s in bucket.slots:
            f = buf.f[s.offset:s.stop]
            self.direction(core, s, f, grads, hypers)
            f[:] = np.where(f >= 0, np.float32(1), np.float32(-1))

    def start(self, core: Any, bucket: Bucket, buf: Buffers) -> WorkLike:
        n = bucket.size
        work: WorkLike = core.comm.allreduce(buf.f[:n], op="sum", out=buf.f[:n],
                                             async_op=True)
        return work

    def finish(self, core: Any, bucket: Bucket, buf: Buffers, hypers: Sequence[Hyper],
               sums: dict[int, int]) -> None:
        n = bucket.size
        buf.s[:n] = np.where(buf.f[:n] >= 0, 1, -1)
        for s in bucket.slots:
            self.apply_signs(core, s, buf.s[s.offset:s.stop], hypers[s.index])


@pytest.fixture
def toy() -> Iterator[VariantSpec]:
    spec = register(VariantSpec(TOY, FloatMajority, summary="majority of float32 votes"))
    try:
        yield spec
    finally:
        unregister(TOY)


def _params() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal(n).astype(np.float32) for n in SIZES]


def _grads(rank: int, step: int) -> list[np.ndarray | None]:
    rng = np.random.default_rng([rank, step])
    grads: list[np.ndarray | None] = [rng.standard_normal(n).astype(np.float32)
                                      for n in SIZES]
    if rank == 1 and step % 2 == 1:
        grads[4] = None  # a zero gradient on one rank
    return grads


def _run(comm: Any, variant: str, **kwargs: Any) -> tuple[list[np.ndarray], list[np.ndarray],
                                                          lioncub.DistributedLion]:
    params = _params()
    opt = lioncub.DistributedLion(params, comm, variant=variant, lr=0.01, weight_decay=0.1,
                                  bucket_size=BUCKET_BYTES, **kwargs)
    for t in range(STEPS):
        opt.step(_grads(int(comm.rank), t))
    return params, [m.copy() for m in opt.momenta], opt


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_registered_toy_variant_runs_end_to_end(toy: VariantSpec, world: int) -> None:
    """The toy variant, registered with one line, trains like lioncub-mavo (tie +1) bit for
    bit on every rank, through its own collective."""
    def body(comm: Any) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray],
                                 list[np.ndarray]]:
        params, moms, opt = _run(comm, TOY)
        assert isinstance(opt.strategy, FloatMajority) and opt.spec is toy
        assert opt.levels == 1 and opt.step_count == STEPS and len(opt.buckets) > 2
        st = opt.last_stats
        assert st is not None and st.agreement is None
        if comm.size > 1:
            assert st.bytes_sent > 0
        ref_params, ref_moms, _ = _run(comm, "lioncub-mavo", tie="positive")
        return params, moms, ref_params, ref_moms

    results = run_threads(world, body, timeout=60)
    for params, moms, ref_params, ref_moms in results:
        for got, want in zip(params + moms, ref_params + ref_moms, strict=True):
            assert np.array_equal(got, want)
    first = results[0][0]
    for params, *_ in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(params, first, strict=True))
    assert any(not np.array_equal(p, q) for p, q in zip(first, _params(), strict=True))


def test_toy_variant_in_the_registry(toy: VariantSpec) -> None:
    """Registered variants are in SPECS (not in the built-in VARIANTS) with their strategy's
    flags; names are unique; built-ins stay."""
    assert lioncub.SPECS[TOY] is toy and TOY not in lioncub.VARIANTS
    assert (toy.kind, toy.yields_sums, toy.uses_levels, toy.local_momentum) == \
        ("float-majority", False, False, True)
    with raises_usage("spec"):
        register(VariantSpec(TOY, FloatMajority))
    with raises_usage("name"):
        unregister("lioncub-l1")
    # a torch engine needs a torch counterpart of the strategy class
    torch = pytest.importorskip("torch")
    import lioncub.torch as lt

    def body(comm: Any) -> None:
        model = torch.nn.Linear(3, 2)
        with raises_usage("variant"):
            lt.DistributedLion(model.parameters(), comm, variant=TOY, backend="torch")
        opt = lt.DistributedLion(model.parameters(), comm, variant=TOY, backend="numpy")
        assert opt.variant == TOY

    run_threads(1, body)


def test_registry_refuses_bad_specs() -> None:
    """Bad registrations are UsageErrors and leave the registry as it was."""
    before = dict(lioncub.SPECS)

    class Kindless(VariantStrategy):  # no kind: not a complete strategy
        prepare = FloatMajority.prepare
        start = FloatMajority.start
        finish = FloatMajority.finish

    for spec in (
            VariantSpec("", FloatMajority),
            VariantSpec("x", int),  # type: ignore[arg-type]  # not a VariantStrategy
            VariantSpec("x", Kindless),  # a strategy without a kind
            VariantSpec("x", QuantizedSum, method="sign"),
            VariantSpec("x", QuantizedSum)):  # no quantizer method
        with raises_usage("spec"):
            register(spec)
    with raises_usage("spec"):
        register("x")  # type: ignore[arg-type]
    with raises_usage("name"):
        unregister("x")
    assert before == lioncub.SPECS
    with raises_usage("variant"):
        lioncub.variants.get_spec("x")


def test_builtin_registry() -> None:
    """Every built-in variant names its strategy class; the public kinds are unchanged."""
    kinds = {name: spec.kind for name, spec in lioncub.SPECS.items()}
    assert kinds == {"global": "global", "dlion-mavo": "majority", "dlion-avg": "mean",
                     "lioncub-mavo": "majority", "lioncub-sign": "sign-sum",
                     "lioncub-l1": "quantized", "lioncub-l0": "quantized",
                     "lioncub-linf": "quantized"}
    assert tuple(lioncub.SPECS) == lioncub.VARIANTS
    for spec in lioncub.SPECS.values():
        strategy = spec.make_strategy()
        assert isinstance(strategy, spec.strategy) and strategy.spec is spec
        assert spec.local_momentum == (spec.name != "global")
        assert spec.yields_sums == (spec.kind in ("mean", "sign-sum", "quantized"))
        assert spec.uses_levels == (spec.kind == "quantized")


def test_toy_variant_with_a_torch_counterpart(toy: VariantSpec) -> None:
    """A torch counterpart, bound with one TORCH_STRATEGIES line, runs the toy variant on the
    torch engine with the numpy engine's results bit for bit (3 thread ranks)."""
    torch = pytest.importorskip("torch")
    import lioncub.torch as lt
    from lioncub.torch_strategies import TORCH_STRATEGIES, Stage, StageSizes, TorchStrategy

    class TorchFloatMajority(TorchStrategy):
        def stage_sizes(self, engine: Any, size: int) -> StageSizes:
            return StageSizes(4 * size, 0, 0, 0, 0)

        def encode(self, engine: Any, bucket: Bucket, buf: Stage, lo: Any, hi: Any) -> int:
            n = bucket.size
            votes = torch.where(buf.c[:n] >= 0, 1.0, -1.0)
            buf.host_in[:4 * n].view(torch.float32).copy_(votes)
            return 4 * n

        def start(self, engine: Any, bucket: Bucket, buf: Stage) -> WorkLike:
            host = buf.host_in[:4 * bucket.size].view(torch.float32).numpy()
            work: WorkLike = engine.comm.allreduce(host, op="sum", out=host, async_op=True)
            return work

        def fetch(self, engine: Any, bucket: Bucket, buf: Stage) -> int:
            n = bucket.size
            buf.t[:n].copy_(buf.host_in[:4 * n].view(torch.float32))
            return 4 * n

        def apply(self, engine: Any, bucket: Bucket, buf: Stage, hypers: Sequence[Hyper],
                  sums: dict[int, int]) -> None:
            u = torch.where(buf.t[:bucket.size] >= 0, 1.0, -1.0)
            for s in bucket.slots:
                engine.apply_update(s, u[s.offset:s.stop], hypers[s.index])

    def train(comm: Any, backend: str) -> list[Any]:
        gen = torch.Generator().manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.Linear(7, 1))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        start = [p.detach().clone() for p in model.parameters()]
        opt = lt.DistributedLion(model.parameters(), comm, variant=TOY, lr=0.01,
                                 bucket_size=4 * 16, backend=backend)
        assert opt.backend == backend
        for t in range(STEPS):
            g = torch.Generator().manual_seed(100 * int(comm.rank) + t)
            x = torch.randn(8, 9, generator=g)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), start,
                                                         strict=True))
        return [p.detach().clone() for p in model.parameters()]

    TORCH_STRATEGIES[FloatMajority] = TorchFloatMajority
    try:
        out = run_threads(3, lambda c: (train(c, "torch"), train(c, "numpy")), timeout=60)
    finally:
        del TORCH_STRATEGIES[FloatMajority]
    for on_torch, on_numpy in out:
        for a, b in zip(on_torch, on_numpy, strict=True):
            assert torch.equal(a, b)
