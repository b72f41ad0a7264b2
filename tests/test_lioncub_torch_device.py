"""lioncub.torch's torch engine (``backend="torch"``): the device-generic step.

Runs on the CPU here; the tests marked ``cuda`` run the same checks on a GPU when one is
present (skipped otherwise). Worlds are threads of one process (tests/inproc.py).
"""

from __future__ import annotations

import copy
import io
from typing import Any

import numpy as np
import pytest
import torch
from errcheck import raises_usage
from inproc import run_threads

import bitcoll
import lioncub
import lioncub.torch as lt
from bitcoll import layout
from bitcoll.errors import UsageError
from lioncub import torch_layout as tl
from lioncub.torch_engine import TorchEngine

CUDA = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[CUDA, needs_cuda])]


def _model(seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32
           ) -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5),
                            torch.nn.Tanh(), torch.nn.Linear(5, 3))
    gen = torch.Generator().manual_seed(seed)  # not the global generator: ranks are threads
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return m.to(device=device, dtype=dtype)


def _backward(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    p = next(model.parameters())
    x = torch.randn(16, 7, generator=gen).to(device=p.device, dtype=p.dtype)
    y = 0.5 * x[:, :3] + 0.1  # a target the model can learn
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
    loss.backward()  # type: ignore[no-untyped-call]
    return loss.detach()


def _engine(opt: lt.DistributedLion) -> TorchEngine:
    engine = opt.core
    assert isinstance(engine, TorchEngine)
    return engine


# ---------------------------------------------------------------------- layout
@pytest.mark.parametrize("device", DEVICES)
def test_layout_matches_bitcoll(device: str) -> None:
    """torch_layout packs and unpacks exactly like bitcoll.layout, every width 1..16."""
    rng = np.random.default_rng(7)
    for width in range(1, 17):
        for count in (0, 1, 7, 8, 9, 1001):
            values = rng.integers(0, 2 ** width, count)
            ref = layout.pack_fields(values, width)
            out = torch.full((tl.nbytes(count, width),), 0xAA, dtype=torch.uint8,
                             device=device)
            if width <= 8:
                fields = torch.zeros(tl.padded(count), dtype=torch.uint8, device=device)
                fields[:count] = torch.from_numpy(values.astype(np.uint8)).to(device)
                words = torch.empty(tl.padded(count) // 8, dtype=torch.int64, device=device)
                tl.pack(fields, count, width, out, words)
                back = torch.full((tl.padded(count),), 0x55, dtype=torch.uint8, device=device)
                tl.unpack(torch.from_numpy(ref).to(device), count, width, back, words)
                got = back[:count].cpu().numpy()
            else:
                tl.pack_wide(torch.from_numpy(values).to(device), width, out)
                got = tl.unpack_wide(torch.from_numpy(ref).to(device), count, width).cpu().numpy()
            assert np.array_equal(out.cpu().numpy(), ref), (width, count)
            assert np.array_equal(got, values), (width, count)
            if width <= 8:  # in tiles of 16 fields (tile=9 rounds up to 16): the same bytes
                fields[:count] = torch.from_numpy(values.astype(np.uint8)).to(device)
                out.fill_(0xAA)
                tl.pack(fields, count, width, out, words, tile=9)
                back.fill_(0x55)
                tl.unpack(torch.from_numpy(ref).to(device), count, width, back, words, tile=9)
                assert np.array_equal(out.cpu().numpy(), ref), (width, count)
                assert np.array_equal(back[:count].cpu().numpy(), values), (width, count)
                # a stream at an odd address (copied in byte lanes): the same bytes
                odd = torch.full((out.numel() + 1,), 0xAA, dtype=torch.uint8, device=device)
                fields[:count] = torch.from_numpy(values.astype(np.uint8)).to(device)
                tl.pack(fields, count, width, odd[1:], words)
                assert np.array_equal(odd[1:].cpu().numpy(), ref), (width, count)
                back.fill_(0x55)
                tl.unpack(odd[1:], count, width, back, words)
                assert np.array_equal(back[:count].cpu().numpy(), values), (width, count)


# ---------------------------------------------------------------------- float32 == numpy core
def _pair_run(comm: Any, variant: str, sync: str | None, steps: int,
              tile: int = 0, packing: str = "auto") -> dict[str, Any]:
    """The numpy core and the torch engine side by side on this rank's gradients (``tile``:
    the torch engine's tile size when not 0; ``packing``: the torch engine's)."""
    rank = int(comm.rank)
    models = [_model(2), _model(2)]
    opts = []
    for m, backend in zip(models, ("numpy", "torch"), strict=True):
        m[2].bias.requires_grad_(False)  # type: ignore[index]
        named = list(m.named_parameters())
        groups = [{"params": named[:2], "lr": 2e-2, "weight_decay": 0.1},
                  {"params": named[2:], "betas": (0.8, 0.95)}]
        opts.append(lt.DistributedLion(groups, comm, variant=variant, lr=1e-2,
                                       bucket_size=4 * 90, momentum_sync=sync,
                                       backend=backend,
                                       packing=packing if backend == "torch" else "auto"))
    assert [o.backend for o in opts] == ["numpy", "torch"]
    if tile:
        engine = opts[1].core
        assert isinstance(engine, TorchEngine)
        engine.tile = tile
    for step in range(steps):
        for m in models:
            _backward(m, rank, step)
            if step == 2 and rank == 1:
                m[4].weight.grad = None  # type: ignore[index]  # no gradient on one rank
        for o in opts:
            o.step()
        a, b = (list(m.parameters()) for m in models)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (variant, step)
        for x, y in zip(a, b, strict=True):
            if x.requires_grad:
                assert torch.equal(opts[0].state[x]["momentum"], opts[1].state[y]["momentum"])
        sa, sb = opts[0].last_stats, opts[1].last_stats
        assert sa is not None and sb is not None
        assert (sa.agreement, sa.synced) == (sb.agreement, sb.synced)
        assert sa.host_device_bytes == 0
    opts[1].check_replicas()
    return {"params": [p.detach().clone() for p in models[1].parameters()]}


@pytest.mark.parametrize("packing", ["host", "device"])
@pytest.mark.parametrize("variant", lioncub.VARIANTS)
def test_float32_trajectory_is_the_numpy_cores(variant: str, packing: str) -> None:
    """Every variant, 3 ranks, votes packed by bitcoll (the CPU default) or on the device:
    the torch engine on float32 CPU tensors reproduces the numpy core bit for bit
    (parameters, momenta, agreement, syncs), with param groups, a frozen tensor, a missing
    gradient and a momentum schedule."""
    sync = None if variant == "global" else (
        "adaptive:0.5" if lioncub.SPECS[variant].yields_sums else "every:2")
    out = run_threads(3, lambda c: _pair_run(c, variant, sync, 4, packing=packing),
                      timeout=120)
    for r in out[1:]:
        assert all(torch.equal(x, y) for x, y in zip(out[0]["params"], r["params"],
                                                       strict=True))


@pytest.mark.parametrize("packing", ["host", "device"])
@pytest.mark.parametrize("variant", lioncub.VARIANTS)
def test_small_tiles_give_the_same_trajectory(variant: str, packing: str) -> None:
    """3 ranks: the torch engine's element-wise passes and packing cut into tiles of 5 / 8
    elements (tiles ending inside tensors and packed bytes) still reproduce the numpy core
    bit for bit."""
    run_threads(3, lambda c: _pair_run(c, variant, "every:2", 3, tile=5, packing=packing),
                timeout=120)


@pytest.mark.parametrize("packing", ["host", "device"])
def test_mean_of_signs_divides_as_numpy_does(packing: str) -> None:
    """7 ranks, dlion-avg: ``sum / p`` is a correctly rounded division in the torch engine too
    (multiplying by a rounded 1/7, as torch's CUDA kernels do for a scalar divisor, gives
    other bits for some sums), so it follows the numpy core bit for bit."""
    run_threads(7, lambda c: _pair_run(c, "dlion-avg", None, 3, packing=packing), timeout=120)


def test_even_world_ties_match() -> None:
    """2 ranks: ties of the 1-bit majority (alternating rule) as in the numpy core."""
    run_threads(2, lambda c: _pair_run(c, "lioncub-mavo", None, 4), timeout=120)


# ---------------------------------------------------------------------- low precision
def _low_precision(comm: Any, device: str, dtype: torch.dtype, mdtype: torch.dtype | None,
                   variant: str) -> list[Any]:
    rank = int(comm.rank)
    model = _model(10 + rank, device, dtype)  # rank 0's weights are broadcast
    opt = lt.DistributedLion(model.named_parameters(), comm, variant=variant, lr=1e-2,
                             weight_decay=0.01, momentum_sync="every:3",
                             momentum_dtype=mdtype)
    assert opt.backend == "torch"
    assert all(m.dtype == (mdtype or torch.float32) and m.device.type == device
               for m in (opt.state[p]["momentum"] for p in model.parameters()))
    losses = []
    for step in range(12):
        losses.append(float(_backward(model, rank, step)))  # each rank its own data
        opt.step()
    losses.append(float(_backward(model, rank, 12)))
    opt.check_replicas()
    return [losses, [p.detach().cpu().clone() for p in model.parameters()]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,mdtype,variant", [
    (torch.bfloat16, None, "lioncub-l1"),
    (torch.float16, None, "lioncub-mavo"),
    (torch.bfloat16, torch.bfloat16, "lioncub-sign"),
    (torch.float32, torch.bfloat16, "lioncub-linf"),
])
def test_low_precision_trains_with_identical_replicas(device: str, dtype: torch.dtype,
                                                       mdtype: torch.dtype | None,
                                                       variant: str) -> None:
    out = run_threads(3, lambda c: _low_precision(c, device, dtype, mdtype, variant),
                      timeout=120)
    for losses, params in out:
        assert np.mean(losses[-3:]) < np.mean(losses[:3])
        assert all(p.dtype == dtype for p in params)
        assert all(torch.equal(x, y) for x, y in zip(out[0][1], params, strict=True))


# ------------------------------------------------------------ bytes between host and device
@pytest.mark.parametrize("variant", ["lioncub-mavo", "dlion-mavo", "lioncub-sign", "dlion-avg",
                                     "lioncub-l1", "global"])
def test_host_device_bytes(variant: str) -> None:
    """Per step exactly the packed votes go out and the packed result comes back: count/8
    bytes each way for the 1-bit variants, count*w/8 for fields of w bits (per bucket,
    rounded up), 4*count for "global"."""
    def run(comm: Any) -> None:
        model = _model(3)
        opt = lt.DistributedLion(model.parameters(), comm, variant=variant, lr=1e-3,
                                 bucket_size=4 * 100, backend="torch", packing="device")
        _backward(model, int(comm.rank), 0)
        opt.step()
        stats = opt.last_stats
        assert stats is not None
        p = int(comm.size)
        levels = opt.core.levels
        w_in, w_out = {"majority": (1, 1), "global": (32, 32),
                       "quantized": (layout.field_width(levels),
                                     layout.field_width(levels * p))}.get(
            opt.core.spec.kind, (2, layout.field_width(p)))
        sizes = [b.size for b in opt.core.buckets]
        assert len(sizes) > 1
        assert stats.device_to_host_bytes == sum(-(-n * w_in // 8) for n in sizes)
        assert stats.host_to_device_bytes == sum(-(-n * w_out // 8) for n in sizes)
        assert stats.host_device_bytes == stats.device_to_host_bytes + \
            stats.host_to_device_bytes
    run_threads(3, run, timeout=60)


@pytest.mark.parametrize("variant", ["global", "lioncub-mavo", "dlion-avg", "lioncub-l1",
                                     "lioncub-linf"])
def test_host_packing_moves_the_same_wire_bytes(variant: str) -> None:
    """3 ranks, 2 steps: votes packed by bitcoll ("host", the CPU default) and on the device
    give the same parameters, the same bytes and messages on the wire, and no device/host
    copies with "host"; the 1-rank-sums path (int16 results: 31 levels x 5 > 127) too."""
    def run(comm: Any) -> None:
        models = [_model(3), _model(3)]
        opts = [lt.DistributedLion(m.parameters(), comm, variant=variant, lr=1e-3,
                                   bucket_size=4 * 100, backend="torch", packing=k)
                for m, k in zip(models, ("host", "device"), strict=True)]
        assert [_engine(o).packing for o in opts] == ["host", "device"]
        for step in range(2):
            for m, o in zip(models, opts, strict=True):
                _backward(m, int(comm.rank), step)
                o.step()
            a, b = (o.last_stats for o in opts)
            assert a is not None and b is not None
            assert (a.bytes_sent, a.messages_sent) == (b.bytes_sent, b.messages_sent)
            assert a.host_device_bytes == 0 and b.host_device_bytes > 0
            for x, y in zip(models[0].parameters(), models[1].parameters(), strict=True):
                assert torch.equal(x, y)
    run_threads(3 if variant != "lioncub-l1" else 5, run, timeout=60)


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mdtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(device: str, mdtype: torch.dtype) -> None:
    def train(opt: lt.DistributedLion, model: torch.nn.Module, steps: range) -> None:
        for step in steps:
            _backward(model, 0, step)
            opt.step()

    with bitcoll.init("local") as comm:
        model = _model(3, device, torch.bfloat16)
        kw: dict[str, Any] = {"variant": "lioncub-l1", "momentum_sync": "exp:2",
                              "momentum_dtype": mdtype}
        opt = lt.DistributedLion(model.parameters(), comm, lr=1e-2, **kw)
        train(opt, model, range(4))
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        saved_model = copy.deepcopy(model.state_dict())
        train(opt, model, range(4, 9))
        model2 = _model(4, device, torch.bfloat16)
        model2.load_state_dict(saved_model)
        opt2 = lt.DistributedLion(model2.parameters(), comm, lr=0.3, **kw)
        opt2.load_state_dict(saved)
        assert opt2.param_groups[0]["lr"] == 1e-2
        train(opt2, model2, range(4, 9))
        for a, b in zip(model.parameters(), model2.parameters(), strict=True):
            assert torch.equal(a, b)
        for a, b in zip(model.parameters(), model2.parameters(), strict=True):
            assert torch.equal(opt.state[a]["momentum"], opt2.state[b]["momentum"])


# ---------------------------------------------------------------------- errors
def test_bad_inputs() -> None:
    with bitcoll.init("local") as comm:
        bf = _model(0, dtype=torch.bfloat16)
        with raises_usage("params"):
            lt.DistributedLion(bf.parameters(), comm, backend="numpy")
        with raises_usage("backend"):
            lt.DistributedLion(bf.parameters(), comm, backend="jax")
        with raises_usage("momentum_dtype"):
            lt.DistributedLion(bf.parameters(), comm, momentum_dtype=torch.float16)
        with raises_usage("packing"):
            lt.DistributedLion(bf.parameters(), comm, packing="gpu")
        with raises_usage("packing"):
            lt.DistributedLion(_model(0).parameters(), comm, backend="numpy",
                               packing="device")
        forced = lt.DistributedLion(_model(0).parameters(), comm, packing="device")
        assert forced.backend == "torch" and _engine(forced).packing == "device"
        assert _engine(lt.DistributedLion(bf.parameters(), comm)).packing == "host"
        with raises_usage("params"):
            lt.DistributedLion(_model(0).double().parameters(), comm, backend="torch")
        opt = lt.DistributedLion(bf.parameters(), comm, variant="lioncub-l0")
        assert opt.backend == "torch"
        assert lt.DistributedLion(_model(0).parameters(), comm).backend == "numpy"
        _backward(bf, 0, 0)
        w = bf[0].weight  # type: ignore[index]
        good = w.grad
        w.grad = None
        opt.step()  # a missing gradient is a zero gradient
        n = len(list(bf.parameters()))
        engine: Any = opt.core
        with raises_usage("grads", 0):
            engine.step([torch.zeros(3, 3, dtype=torch.bfloat16)] + [None] * (n - 1))
        with raises_usage("grads", 0):
            engine.step([torch.zeros(16, 7, dtype=torch.int32)] + [None] * (n - 1))
        assert good is not None
        bad = good.clone()
        bad.view(-1)[5] = float("nan")
        w.grad = bad
        with raises_usage("grads", 0):
            opt.step()


@pytest.mark.parametrize("packing", ["host", "device"])
def test_l0_scale_with_zeros_and_subnormals_is_the_numpy_cores(packing: str) -> None:
    """3 ranks: l0's scale (the mean of log|c| over the nonzero c) on tiles holding zeros,
    subnormal and huge values (the torch engine's exponent/mantissa sums, and its
    logarithm-by-logarithm path where a tile holds subnormals) gives the numpy core's
    trajectory bit for bit (the summed votes expose any change of scale)."""
    def run(comm: Any) -> None:
        rank = int(comm.rank)
        models = [_model(6), _model(6)]
        opts = [lt.DistributedLion(m.parameters(), comm, variant="lioncub-l0", lr=1e-2,
                                   backend=b, momentum_sync="adaptive:0.5",
                                   packing=packing if b == "torch" else "auto")
                for m, b in zip(models, ("numpy", "torch"), strict=True)]
        engine = opts[1].core
        assert isinstance(engine, TorchEngine)
        engine.tile = 16  # some tiles with subnormals, some without
        gen = torch.Generator().manual_seed(3 + rank)
        for step in range(3):
            grads = [torch.randn(p.shape, generator=gen) for p in models[0].parameters()]
            flat = grads[0].view(-1)
            flat[:20] = 0.0
            flat[30] *= 1e-40  # a subnormal c (float32)
            flat[60] = 3e38
            grads[2].view(-1)[:] = 0.0  # a whole tensor of zeros
            for m in models:
                for p, g in zip(m.parameters(), grads, strict=True):
                    p.grad = g.clone()
            for o in opts:
                o.step()
            for x, y in zip(models[0].parameters(), models[1].parameters(), strict=True):
                assert torch.equal(x, y), step
            sa, sb = opts[0].last_stats, opts[1].last_stats
            assert sa is not None and sb is not None
            assert sa.agreement is not None and sa.agreement == sb.agreement, step
    run_threads(3, run, timeout=60)


@pytest.mark.parametrize("variant", ["lioncub-mavo", "lioncub-sign", "lioncub-l1",
                                     "lioncub-l0", "lioncub-linf"])
@pytest.mark.parametrize("tile", [0, 8])
@pytest.mark.parametrize("packing", ["host", "device"])
def test_non_finite_names_the_parameter(variant: str, tile: int, packing: str) -> None:
    """A non-finite gradient element in the third parameter (of one bucket with others) is
    reported with that parameter's name, whole tensors or tiles of 8 elements."""
    with bitcoll.init("local") as comm:
        model = _model(0)
        opt = lt.DistributedLion(model.named_parameters(), comm, variant=variant,
                                 backend="torch", packing=packing)
        engine = opt.core
        assert isinstance(engine, TorchEngine)
        if tile:
            engine.tile = tile
        _backward(model, 0, 0)
        grad = model[2].weight.grad  # type: ignore[index]
        assert grad is not None
        grad.view(-1)[17] = float("inf")
        with raises_usage("grads", 2):
            opt.step()


# ---------------------------------------------------------------------- the same on a GPU
@CUDA
@needs_cuda
@pytest.mark.parametrize("variant", lioncub.VARIANTS)
def test_cuda_matches_cpu_engine(variant: str) -> None:
    """The engine on CUDA float32 tensors follows the CPU engine bit for bit on the same
    gradients (same float32 element-wise arithmetic; only the float64 scale sums of l1/l0
    are ordered differently, which changes a vote only when they straddle a float32
    rounding boundary), through page-locked host buffers."""
    def body(comm: Any) -> None:
        cpu, gpu = _model(5), _model(5, "cuda")
        opts = [lt.DistributedLion(m.parameters(), comm, variant=variant, lr=1e-3,
                                   bucket_size=4 * 100, momentum_sync="every:2")
                for m in (cpu, gpu)]
        assert [o.backend for o in opts] == ["numpy", "torch"]
        for step in range(5):
            _backward(cpu, int(comm.rank), step)
            for a, b in zip(cpu.parameters(), gpu.parameters(), strict=True):
                assert a.grad is not None
                b.grad = a.grad.to("cuda")
            for o in opts:
                o.step()
            for a, b in zip(cpu.parameters(), gpu.parameters(), strict=True):
                assert torch.equal(a, b.cpu()), (variant, step)
        opts[1].check_replicas()
        engine: Any = opts[1].core
        assert all(st.host_in.is_pinned() for st in engine._stages)
    run_threads(2, body, timeout=120)


# ---------------------------------------------------------------------- overlap with backward
class _Net(torch.nn.Module):
    """Three layers and a side branch used only when asked (its parameters then get no
    gradient)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.body = _model(seed)
        self.side = torch.nn.Linear(7, 3)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in self.side.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        y: torch.Tensor = self.body(x)
        return y + self.side(x) if side else y


def _micro(net: _Net, rank: int, step: int, k: int) -> None:
    gen = torch.Generator().manual_seed(10_000 * rank + 10 * step + k)
    x = torch.randn(8, 7, generator=gen)
    side = not (rank == 1 and step == 2)  # one rank, one step: no gradient for the branch
    loss = torch.nn.functional.mse_loss(net(x, side), 0.5 * x[:, :3])
    loss.backward()  # type: ignore[no-untyped-call]


def _overlap_run(comm: Any, variant: str, backend: str) -> None:
    rank = int(comm.rank)
    nets = [_Net(4), _Net(4)]
    opts = [lt.DistributedLion(n.named_parameters(), comm, variant=variant, lr=1e-2,
                               weight_decay=0.05, bucket_size=4 * 40, backend=backend,
                               momentum_sync=None if variant == "global" else "every:2",
                               overlap=overlap)
            for n, overlap in zip(nets, (False, True), strict=True)]
    assert len(opts[1].core.buckets) >= 3
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    for step in range(3):
        # overlapped optimizer first: no other collective may come between its backward
        # and its step (ranks start buckets at different points of the backward)
        for net, opt, sched in zip(nets[::-1], opts[::-1], scheds[::-1], strict=True):
            opt.zero_grad(set_to_none=True)
            for k in range(2):  # accumulate over micro-steps
                with opt.no_sync():
                    _micro(net, rank, step, k)
            _micro(net, rank, step, 2)  # the last micro-step: buckets start in backward
            if opt.overlap:
                core: Any = opt.core
                assert core.pending
                # started before step(), unless the branch (in the last bucket, which must
                # start first) got no gradient
                assert bool(core._early.inflight) == (not (rank == 1 and step == 2))
                with pytest.raises(UsageError, match="step"):
                    opt.state_dict()
            opt.step()
            sched.step()
        for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
            assert torch.equal(a, b), (variant, backend, step)
        sa, sb = opts[0].last_stats, opts[1].last_stats
        assert sa is not None and sb is not None
        assert (sa.agreement, sa.synced) == (sb.agreement, sb.synced)
    da, db = opts[0].state_dict(), opts[1].state_dict()
    for i, entry in da["state"].items():
        assert torch.equal(entry["momentum"], db["state"][i]["momentum"])
    assert da["lioncub"]["step"] == db["lioncub"]["step"] == 3
    # a second backward without no_sync declares gradients twice
    opts[1].zero_grad(set_to_none=True)
    _micro(nets[1], rank, 9, 0)
    with raises_usage("index"):
        _micro(nets[1], rank, 9, 1)
    opts[1].step()  # the step completes with the first backward's gradients


@pytest.mark.parametrize("variant,backend", [(v, "torch") for v in lioncub.VARIANTS]
                         + [("lioncub-l1", "numpy"), ("lioncub-mavo", "numpy")])
def test_overlap_matches_plain_step(variant: str, backend: str) -> None:
    """overlap=True (3 ranks): buckets start during backward, last layers first; with
    gradient accumulation (no_sync), a parameter without a gradient on one rank, an LR
    scheduler and zero_grad(set_to_none=True), every step equals the plain step bit for
    bit."""
    run_threads(3, lambda c: _overlap_run(c, variant, backend), timeout=120)


def test_overlap_rejects_elementwise_ties() -> None:
    with bitcoll.init("local") as comm, raises_usage("overlap"):
        lt.DistributedLion(_model(0).parameters(), comm, variant="lioncub-mavo",
                           tie="elementwise", overlap=True)
