"""lioncub.torch_hooks: Lion Cub's vote inside DistributedDataParallel's backward.

The Lion Cub hook + LionCubStep must give bit for bit the parameters (and momenta) of
lioncub.torch.DistributedLion on the same local gradients: every built-in variant, world
sizes 2-4, parameters of odd sizes, DDP buckets of one and of several parameters (DDP
rebuilds them after the first step; gradients copied out of them or views of them), core
buckets small enough that one DDP bucket spans
core buckets of both tie parities, several momentum schedules. The sign hook's gradients
are checked against a numpy reference built from every rank's local gradients.

Every rank runs DDP over gloo (file:// store) with a bitcoll TCP communicator for the
votes; one case runs DDP over the "bitcoll" backend instead, the hook voting on the default
group's own communicator (``comm=None``). Differences are collected and asserted after the
last collective, so that a failure on one rank cannot leave the others waiting.
"""

from __future__ import annotations

import copy
import datetime
import traceback
from typing import Any

import numpy as np
import pytest
import torch
from errcheck import raises_usage
from multiproc import run_world

import lioncub
import lioncub.torch as lt
from lioncub.torch_hooks import (
    LionCubHookState,
    LionCubStep,
    SignHookState,
    lioncub_hook,
    sign_hook,
)

STEPS = 4

#: (variant, options of DistributedLion, DDP bucket_cap_mb): every variant, with schedules,
#: tie rules, levels and bucket layouts spread over them.
CASES: list[tuple[str, dict[str, Any], float]] = [
    ("global", {}, 25.0),
    ("dlion-mavo", {"bucket_size": 64}, 0.0002),
    ("dlion-avg", {"momentum_sync": "every:2"}, 0.0002),
    ("lioncub-mavo", {"bucket_size": 128, "momentum_sync": "every:3@*.bias"}, 0.0005),
    ("lioncub-mavo", {"tie": "negative"}, 25.0),
    ("lioncub-sign", {"momentum_sync": "adaptive:0.9"}, 0.0002),
    ("lioncub-l1", {"bucket_size": 64, "momentum_sync": "exp:1"}, 0.0002),
    ("lioncub-l1", {"levels": 3}, 25.0),
    ("lioncub-l0", {"momentum_sync": "every:1"}, 0.0005),
    ("lioncub-linf", {"bucket_size": 200}, 0.0002),
]


def _model(seed: int) -> torch.nn.Module:
    """Odd sizes: 63, 9, 45, 5, 5, 1 elements."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 1))


def _backward(model: torch.nn.Module, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(12, 7, generator=gen)
    y = torch.randn(12, 1, generator=gen)
    for p in model.parameters():
        p.grad = None
    torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]


#: The cases each world size runs (every case once; the 1-bit majority, whose ties need an
#: even world size, at 2 and 4 ranks).
CASES_OF: dict[int, list[int]] = {2: [1, 3, 6, 9], 3: [0, 5, 8], 4: [2, 4, 7]}


def check_lioncub_hook(comm: Any, problems: list[str], cases: list[int] | None = None,
                       on_group: bool = False) -> None:
    """The hook against DistributedLion (on ``comm``) for ``cases`` (indices into CASES;
    None: this world size's CASES_OF). ``on_group``: the hook votes on the default process
    group's communicator (``comm=None``, a "bitcoll" group), not on ``comm``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r = comm.rank
    for k in CASES_OF[comm.size] if cases is None else cases:
        variant, options, cap = CASES[k]
        view = k % 2 == 1  # DDP's gradients as views of its buckets, or copies
        label = f"{variant} {options} cap={cap} view={view} on_group={on_group}"
        plain = _model(seed=7)
        hooked = copy.deepcopy(plain)
        ddp = DDP(hooked, bucket_cap_mb=cap, gradient_as_bucket_view=view)
        opt = LionCubStep(ddp.module.named_parameters(), lr=0.01, weight_decay=0.5)
        state = LionCubHookState(opt, None if on_group else comm, variant, **options)
        ddp.register_comm_hook(state, lioncub_hook)
        ref = lt.DistributedLion(plain.named_parameters(), comm, variant, lr=0.01,
                                 weight_decay=0.5, **options)
        for t in range(STEPS):
            if t == 2:  # a schedule step changes the learning rate of both
                opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 0.003
            _backward(ddp, r, t)
            opt.step()
            _backward(plain, r, t)
            ref.step()
            for (name, a), b in zip(hooked.named_parameters(), plain.parameters(),
                                    strict=True):
                if not torch.equal(a, b):
                    problems.append(f"{label}: {name} differs at step {t}: "
                                    f"{(a - b).abs().max().item()}")
            mine, theirs = state.core.momenta, ref.core.momenta
            for i, (m1, m2) in enumerate(zip(mine, theirs, strict=True)):
                if not np.array_equal(m1, m2):
                    problems.append(f"{label}: momentum {i} differs at step {t}")
            stats, expected = state.last_stats, ref.last_stats
            assert stats is not None and expected is not None
            if stats.synced != expected.synced or stats.agreement != expected.agreement:
                problems.append(f"{label}: synced/agreement differ at step {t}: "
                                f"{stats.synced}/{stats.agreement} vs "
                                f"{expected.synced}/{expected.agreement}")
        state.check_replicas()
        state.close()


def _sign_reference(grads: np.ndarray, errors: np.ndarray, sizes: list[int], tie: str
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's gradients ``grads[rank]`` (flat, parameter order) and errors: the
    expected common gradient and the new errors."""
    v = grads + errors
    votes = np.where(v >= 0, 1, -1)
    total = votes.sum(axis=0)
    majority = np.sign(total) + (total == 0) * (1 if tie == "positive" else -1)
    out = np.empty(v.shape[1], np.float32)
    new = np.empty_like(v)
    a = 0
    for n in sizes:
        local = np.abs(v[:, a:a + n]).mean(axis=1, dtype=np.float64)
        out[a:a + n] = majority[a:a + n] * np.float32(local.mean())
        new[:, a:a + n] = v[:, a:a + n] - votes[:, a:a + n] * local[:, None].astype(np.float32)
        a += n
    return out, new


def check_sign_hook(comm: Any, problems: list[str]) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    p, r = comm.size, comm.rank
    for tie, cap in (("positive", 0.0002), ("negative", 25.0)):
        model = _model(seed=11)
        ddp = DDP(model, bucket_cap_mb=cap)
        state = SignHookState(comm, tie=tie)
        ddp.register_comm_hook(state, sign_hook)
        local = copy.deepcopy(model)
        sizes = [q.numel() for q in model.parameters()]
        errors = np.zeros((p, sum(sizes)), np.float32)
        for t in range(3):
            _backward(ddp, r, t)
            _backward(local, r, t)
            mine = np.concatenate([q.grad.numpy().ravel() for q in local.parameters()
                                   if q.grad is not None])
            everyone = np.asarray(comm.allgather(mine)).reshape(p, -1)
            expected, errors = _sign_reference(everyone, errors, sizes, tie)
            got = np.concatenate([q.grad.numpy().ravel() for q in model.parameters()
                                  if q.grad is not None])
            if not np.allclose(got, expected, rtol=1e-5, atol=1e-7) or \
                    not np.array_equal(np.sign(got), np.sign(expected)):
                problems.append(f"sign hook tie={tie}: gradients differ at step {t}")
            kept = np.concatenate([state.errors[q].numpy() for q in model.parameters()])
            if not np.allclose(kept, errors[r], rtol=1e-5, atol=1e-6):
                problems.append(f"sign hook tie={tie}: errors differ at step {t}")
        state.close()


#: The case run over the "bitcoll" backend (2 ranks; several DDP buckets, core buckets of
#: both tie parities, momentum averaging every step).
BITCOLL_BACKEND_CASE = 6


def check_lioncub_hook_on_group(comm: Any, problems: list[str]) -> None:
    """BITCOLL_BACKEND_CASE with the hook on the default ("bitcoll") group's communicator."""
    check_lioncub_hook(comm, problems, [BITCOLL_BACKEND_CASE], on_group=True)


def target(comm: Any, store: str, backend: str = "gloo") -> list[str]:
    """DDP over ``backend``: for gloo every check of this world size; for "bitcoll" the
    Lion Cub hook on the group's communicator, BITCOLL_BACKEND_CASE only."""
    import torch.distributed as dist

    if backend == "bitcoll":
        import bitcoll.torch  # noqa: F401  (registers "bitcoll")

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=comm.rank,
                            world_size=comm.size, timeout=datetime.timedelta(seconds=60))
    problems: list[str] = []
    checks = [check_lioncub_hook, check_sign_hook] if backend == "gloo" else \
        [check_lioncub_hook_on_group]
    try:
        for check in checks:
            try:
                check(comm, problems)
            except Exception:  # recorded; a failed collective fails the later checks too
                problems.append(f"{check.__name__}: {traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    return problems


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_hooks_bitwise_like_distributed_lion(size: int, tmp_path: Any) -> None:
    results = run_world(size, target, str(tmp_path / "store"), timeout=240, comm_timeout=60)
    failures = {r: probs for r, probs in enumerate(results) if probs}
    assert not failures, "\n".join(f"rank {r}: {p}" for r, p in failures.items())


@pytest.mark.timeout(300)
def test_lioncub_hook_bitwise_over_the_bitcoll_backend(tmp_path: Any) -> None:
    """DDP over init_process_group("bitcoll"), 2 ranks, the hook on the group's own
    communicator: bit for bit DistributedLion, as over gloo."""
    results = run_world(2, target, str(tmp_path / "store"), "bitcoll", timeout=240,
                        comm_timeout=60)
    failures = {r: probs for r, probs in enumerate(results) if probs}
    assert not failures, "\n".join(f"rank {r}: {p}" for r, p in failures.items())


def test_refusals() -> None:
    """Arguments a user can get wrong, refused before anything is sent."""
    import bitcoll

    comm = bitcoll.init("local")
    model = _model(seed=0)
    opt = LionCubStep(model.parameters(), lr=0.1)
    with raises_usage("tie"):
        LionCubHookState(opt, comm, "lioncub-mavo", tie="elementwise")
    with raises_usage("optimizer"):
        LionCubHookState(torch.optim.SGD(model.parameters(), lr=0.1), comm)  # type: ignore[arg-type]
    with raises_usage("optimizer", index=0):
        LionCubHookState(LionCubStep([torch.zeros(3, dtype=torch.float64,
                                                  requires_grad=True)]), comm)
    with raises_usage("comm"):
        LionCubHookState(opt, object())
    with raises_usage("tie"):
        SignHookState(comm, tie="elementwise")
    with raises_usage("lr"):
        LionCubStep(model.parameters(), lr=-1.0)
    assert "lioncub-l1" in lioncub.VARIANTS


def test_step_is_the_update() -> None:
    """LionCubStep: p <- p * (1 - lr * wd) - lr * grad, each operation rounded in float32
    (the numpy expression), parameters without a gradient untouched."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(9, generator=gen)
    b = torch.randn(5, generator=gen)
    u = torch.randn(9, generator=gen)
    a0, b0 = a.clone(), b.clone()
    opt = LionCubStep([a, b], lr=0.01, weight_decay=0.3)
    a.grad = u
    opt.step()
    h = lioncub.Hyper.of(0.01, 0.9, 0.99, 0.3)
    expected = a0.numpy() * h.decay - h.lr * u.numpy()
    assert np.array_equal(a.numpy(), expected)
    assert torch.equal(b, b0)
