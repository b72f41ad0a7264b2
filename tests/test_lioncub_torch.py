"""lioncub.torch: the torch.optim front ends (one process)."""

from __future__ import annotations

import copy
import io
from typing import Any

import numpy as np
import pytest
import torch
from errcheck import raises_usage

import bitcoll
import lioncub
import lioncub.torch as lt
from bitcoll.errors import UsageError

f32 = np.float32


@pytest.fixture(scope="module")
def comm() -> Any:
    with bitcoll.init("local") as c:
        yield c


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _backward(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 7, generator=gen)
    y = torch.randn(32, 3, generator=gen)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]


def test_lion_matches_transcription_with_groups_and_weight_decay() -> None:
    """lioncub.torch.Lion vs the published rule, transcribed in float64 numpy, over 60 steps,
    two param groups with their own lr / weight decay / betas and an LR change mid-run."""
    model = _model()
    params = list(model.parameters())
    groups = [{"params": params[:2], "lr": 3e-3, "weight_decay": 0.2},
              {"params": params[2:], "betas": (0.85, 0.98)}]
    opt = lt.Lion(groups, lr=1e-3, weight_decay=0.0)
    ref = [p.detach().numpy().astype(np.float64) for p in params]
    mom = [np.zeros_like(r) for r in ref]
    hyper = [(3e-3, 0.2, 0.9, 0.99)] * 2 + [(1e-3, 0.0, 0.85, 0.98)] * 2
    worst = 0.0
    for step in range(60):
        if step == 30:
            opt.param_groups[1]["lr"] = 5e-4
            hyper[2:] = [(5e-4, 0.0, 0.85, 0.98)] * 2
        # gradients at the reference point, so both runs see the same gradients
        with torch.no_grad():
            for p, r in zip(params, ref, strict=True):
                p.copy_(torch.from_numpy(r.astype(np.float32)))
        _backward(model, step)
        grads = [p.grad.detach().numpy().astype(np.float64) for p in params]  # type: ignore[union-attr]
        opt.step()
        for i, (g, (lr, wd, b1, b2)) in enumerate(zip(grads, hyper, strict=True)):
            ref[i] = ref[i] * (1 - lr * wd)
            c = b1 * mom[i] + (1 - b1) * g
            ref[i] = ref[i] - lr * np.sign(c)
            mom[i] = b2 * mom[i] + (1 - b2) * g
        for p, r, m in zip(params, ref, mom, strict=True):
            worst = max(worst, float(np.abs(p.detach().numpy() - r).max()))
            assert np.allclose(opt.state[p]["exp_avg"].numpy(), m, rtol=1e-5, atol=1e-7)
    assert worst < 1e-5  # float32 rounding of theta only: no sign ever differed (2 lr = 1e-3)


def test_lion_state_dict_and_none_grads() -> None:
    model = _model(1)
    opt = lt.Lion(model.parameters(), lr=1e-2)
    for step in range(3):
        _backward(model, step)
        opt.step()
    model2 = _model(1)
    model2.load_state_dict(model.state_dict())
    opt2 = lt.Lion(model2.parameters(), lr=0.5)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as if through a file
    assert opt2.param_groups[0]["lr"] == 1e-2
    for step in range(3, 6):
        for m in (model, model2):
            _backward(m, step)
        opt.step()
        opt2.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    model.zero_grad(set_to_none=True)
    before = [p.clone() for p in model.parameters()]
    opt.step()  # no gradients: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(UsageError):
        lt.Lion(model.parameters(), lr=-1.0)
    with pytest.raises(UsageError):
        lt.Lion(model.parameters(), betas=(0.9, 1.5))


@pytest.mark.parametrize("variant", ["lioncub-l1", "lioncub-mavo", "global", "dlion-avg"])
def test_distributed_front_end_matches_numpy_core(comm: Any, variant: str) -> None:
    """The torch front end and the numpy core follow the same trajectory bit for bit, with
    param groups, named parameters, a frozen tensor and a missing gradient."""
    model = _model(2)
    model[0].bias.requires_grad_(False)  # type: ignore[index]
    named = list(model.named_parameters())
    groups = [{"params": named[:2], "lr": 2e-3, "weight_decay": 0.1},
              {"params": named[2:]}]
    opt = lt.DistributedLion(groups, comm, variant=variant, lr=1e-3, bucket_size=4 * 60,
                             momentum_sync="every:3@2.*")
    assert opt.core.names == ("0.weight", "2.weight", "2.bias")
    arrays = [p.detach().numpy().copy() for _, p in named if p.requires_grad]
    core = lioncub.DistributedLion(
        [{"params": arrays[:1], "lr": 2e-3, "weight_decay": 0.1}, {"params": arrays[1:]}],
        comm, variant=variant, lr=1e-3, bucket_size=4 * 60, momentum_sync="every:3@2.*",
        names=["0.weight", "2.weight", "2.bias"])
    frozen = model[0].bias.detach().clone()  # type: ignore[index]
    for step in range(7):
        _backward(model, step)
        if step == 4:
            model[2].bias.grad = None  # type: ignore[index]
        grads = [None if p.grad is None else p.grad.numpy().copy()
                 for _, p in named if p.requires_grad]
        opt.step()
        core.step(grads)
        trained = [p for _, p in named if p.requires_grad]
        for p, a in zip(trained, arrays, strict=True):
            assert np.array_equal(p.detach().numpy(), a)
        for p, m in zip(trained, core.momenta, strict=True):
            assert np.array_equal(opt.state[p]["momentum"].numpy(), m)
    assert torch.equal(model[0].bias, frozen)  # type: ignore[index]
    stats = opt.last_stats
    assert stats is not None and stats.step == 7
    if variant != "global":
        assert stats.synced == ("2.weight", "2.bias") or opt.core.step_count % 3
    # the front end shares memory with torch: no parameter copies
    assert opt.core.params[0].ctypes.data == named[0][1].data_ptr()


def test_distributed_front_end_state_dict(comm: Any) -> None:
    def train(opt: lt.DistributedLion, model: torch.nn.Module, steps: range) -> None:
        for step in steps:
            _backward(model, step)
            opt.step()

    model = _model(3)
    opt = lt.DistributedLion(model.parameters(), comm, variant="lioncub-l1", lr=1e-2,
                             momentum_sync="exp:2")
    train(opt, model, range(4))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # the state is plain data: weights_only loading works
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    train(opt, model, range(4, 9))

    model2 = _model(4)
    model2.load_state_dict(saved_model)
    opt2 = lt.DistributedLion(model2.parameters(), comm, variant="lioncub-l1", lr=0.3,
                              momentum_sync="exp:2")
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == 1e-2
    train(opt2, model2, range(4, 9))
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(UsageError):
        opt2.load_state_dict({"state": {}})


def test_distributed_front_end_bad_inputs(comm: Any) -> None:
    model = _model()
    with raises_usage("params"):
        lt.DistributedLion(_model().double().parameters(), comm)
    with raises_usage("params"):
        lt.DistributedLion([torch.nn.Parameter(torch.zeros(4, 3).t())], comm)
    with raises_usage("variant"):
        lt.DistributedLion(model.parameters(), comm, variant="adam")
    with raises_usage("levels"):
        lt.DistributedLion(model.parameters(), comm, levels=0)
    with raises_usage("names"):
        lt.DistributedLion(model.parameters(), comm, names=["a"])
    opt = lt.DistributedLion(model.parameters(), comm)
    with pytest.raises(UsageError):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    _backward(model, 0)
    weight = model[0].weight  # type: ignore[index]
    weight.grad_dtype = None  # torch checks gradient dtypes unless told not to
    weight.grad = weight.grad.double()
    with raises_usage("grad"):
        opt.step()
    _backward(model, 0)
    model[0].weight.data = torch.zeros_like(model[0].weight)  # type: ignore[index]
    with raises_usage("params"):
        opt.step()
