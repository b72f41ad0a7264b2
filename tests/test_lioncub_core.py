"""lioncub's numpy core on one process: the update rule, quantizers, kernels, buckets,
momentum schedules, DistributedLion on a one-rank communicator, argument checking."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from errcheck import raises_usage

import bitcoll
import lioncub
from bitcoll.errors import UsageError
from lioncub import kernels
from lioncub.sync import (
    Adaptive,
    EarlyPhase,
    EveryK,
    Exponential,
    NoSync,
    Selective,
    parse_sync,
)

f32 = np.float32


def transcribed_lion(theta: np.ndarray, g: np.ndarray, m: np.ndarray, lr: float, b1: float,
                     b2: float, wd: float) -> tuple[np.ndarray, np.ndarray]:
    """Chen et al. 2023, Algorithm 2, in float32 numpy (returns new theta, m)."""
    theta = theta * f32(1 - lr * wd)
    c = m * f32(b1) + g * f32(1 - b1)
    theta = theta - f32(lr) * np.sign(c)
    m = m * f32(b2) + g * f32(1 - b2)
    return theta, m


@pytest.fixture(scope="module")
def comm() -> Any:
    with bitcoll.init("local") as c:
        yield c


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- lion_update
def test_lion_update_matches_transcription_bitwise() -> None:
    rng = np.random.default_rng(0)
    theta = _rand(rng, 37, 5)
    m = np.zeros_like(theta)
    ref_t, ref_m = theta.copy(), m.copy()
    for step in range(60):
        g = _rand(rng, 37, 5)
        lr, wd = 1e-2 * (1 + step % 3), 0.1 if step % 2 else 0.0
        lioncub.lion_update(theta, g, m, lr, beta1=0.9, beta2=0.99, weight_decay=wd)
        ref_t, ref_m = transcribed_lion(ref_t, g, ref_m, lr, 0.9, 0.99, wd)
        assert np.array_equal(theta, ref_t) and np.array_equal(m, ref_m)


def test_lion_update_none_grad_and_zero_direction() -> None:
    theta = np.array([1.0, -1.0, 0.5], np.float32)
    m = np.array([0.0, 0.0, 2.0], np.float32)
    lioncub.lion_update(theta, None, m, lr=0.25)
    # c = 0.9 m: sign(0) = 0 leaves the first two alone
    assert theta.tolist() == [1.0, -1.0, 0.25]
    assert m.tolist() == [0.0, 0.0, np.float32(2.0) * np.float32(0.99)]


def test_lion_update_non_contiguous_grad() -> None:
    rng = np.random.default_rng(1)
    theta, m = _rand(rng, 6, 4), np.zeros((6, 4), np.float32)
    g = _rand(rng, 4, 6).T  # Fortran-ordered view
    ref_t, ref_m = transcribed_lion(theta, np.ascontiguousarray(g), m, 0.1, 0.9, 0.99, 0.0)
    lioncub.lion_update(theta, g, m, 0.1)
    assert np.array_equal(theta, ref_t) and np.array_equal(m, ref_m)


@pytest.mark.parametrize("kwargs", [
    {"lr": -1.0}, {"lr": float("nan")}, {"beta1": 1.5}, {"beta2": -0.1},
    {"weight_decay": -1.0}, {"lr": "0.1"},
])
def test_lion_update_bad_hyperparameters(kwargs: dict[str, Any]) -> None:
    p, m = np.zeros(3, np.float32), np.zeros(3, np.float32)
    args = {"lr": 0.1, **kwargs}
    with pytest.raises(UsageError):
        lioncub.lion_update(p, np.ones(3, np.float32), m, **args)


def test_lion_update_bad_arrays() -> None:
    p, m = np.zeros(3, np.float32), np.zeros(3, np.float32)
    with raises_usage("grad"):
        lioncub.lion_update(p, np.ones(3), m, 0.1)
    with raises_usage("grad"):
        lioncub.lion_update(p, np.ones(4, np.float32), m, 0.1)
    with raises_usage("momentum"):
        lioncub.lion_update(p, np.ones(3, np.float32), np.zeros(4, np.float32), 0.1)
    with raises_usage("param"):
        lioncub.lion_update(np.zeros((3, 3), np.float32).T, None, np.zeros((3, 3), np.float32),
                            0.1)
    with raises_usage("momentum"):
        lioncub.lion_update(p, None, p, 0.1)


# ---------------------------------------------------------------- kernels vs numpy
def test_kernels_equal_numpy_expressions() -> None:
    rng = np.random.default_rng(2)
    m, g = _rand(rng, 1001), _rand(rng, 1001)
    b1, a1, b2, a2 = f32(0.9), f32(1 - 0.9), f32(0.99), f32(1 - 0.99)
    c = np.empty_like(m)
    m2 = m.copy()
    total = kernels.direction(m2, g, c, b1, a1, b2, a2)
    want_c = m * b1 + g * a1
    assert np.array_equal(c, want_c)
    assert np.array_equal(m2, m * b2 + g * a2)
    assert total == kernels.abs_sum(want_c.astype(np.float32))
    assert total == pytest.approx(float(np.abs(want_c.astype(np.float64)).sum()), rel=1e-12)

    s = rng.integers(-5, 6, 1001).astype(np.int16)
    p = _rand(rng, 1001)
    want = p * f32(0.999) - f32(0.01) * np.sign(s).astype(np.float32)
    got = p.copy()
    assert kernels.apply_sign(got, s, f32(0.01), f32(0.999)) == int(np.abs(s).sum())
    assert np.array_equal(got, want)

    for dt, n in ((np.int16, 1001), (np.int8, 7), (np.int16, 0),
                  (np.int16, kernels.PARALLEL_MIN_ELEMENTS + 3 * kernels.BLOCK + 5)):
        si = rng.integers(-5, 6, n).astype(dt)
        u = np.full(n, np.nan, np.float32)
        assert kernels.sign_into(si, u) == int(np.abs(si.astype(np.int64)).sum()), (dt, n)
        # bit for bit numpy's sign (+0.0 where the sum is 0)
        assert np.array_equal(u.view(np.uint32), np.sign(si).astype(np.float32).view(np.uint32))

    got = p.copy()
    kernels.apply_mean(got, s, f32(0.01), f32(1.0), f32(5))
    assert np.array_equal(got, p - f32(0.01) * (s.astype(np.float32) / f32(5)))

    q = np.empty(1001, np.int8)
    kernels.quantize_scaled(c, f32(3.7), 7, q)
    assert np.array_equal(q, np.rint(np.clip(c * f32(3.7), -7, 7)).astype(np.int8))
    assert not kernels.copy_checked(np.array([1.0, np.inf], np.float32), np.empty(2, np.float32))


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 6, 7, 1001])
def test_direction_sum_is_abs_sum(n: int) -> None:
    rng = np.random.default_rng(n)
    mom, grad = rng.standard_normal((2, n)).astype(np.float32)
    out = np.empty(n, np.float32)
    mom2 = mom.copy()
    total = kernels.direction(mom, grad, out, f32(0.9), f32(0.1), f32(0.99), f32(0.01))
    assert total == kernels.abs_sum(out)  # the same float64 summation order, bit for bit
    out2 = np.empty(n, np.float32)
    both = kernels.direction_with_max(mom2, grad, out2, f32(0.9), f32(0.1), f32(0.99),
                                      f32(0.01))
    assert np.array_equal(out2, out) and np.array_equal(mom2, mom)
    assert both == (total, kernels.abs_max(out))
    assert total == pytest.approx(float(np.abs(out.astype(np.float64)).sum()), rel=1e-12)


@pytest.mark.parametrize("n", [0, 1, 7, 255, 256, 257, 1000, 100_003])
@pytest.mark.parametrize("subnormal", [False, True])
def test_log_abs_sum(n: int, subnormal: bool) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.uniform(1e-6, 1e3, n)).astype(np.float32)
    x[::5] = 0.0
    if subnormal and n:
        x[n // 2] = -1e-41  # below float32's smallest normal: the exact fallback path
    total, count = kernels.log_abs_sum(x)
    nz = np.abs(x[x != 0]).astype(np.float64)
    assert count == nz.size
    assert total == pytest.approx(float(np.log(nz).sum()), rel=1e-12, abs=1e-9)


# ---------------------------------------------------------------- quantize
def _expected_q(c: np.ndarray, method: str, levels: int) -> np.ndarray:
    a = np.abs(c.astype(np.float64))
    if method == "sign":
        return np.sign(c).astype(np.int8)  # type: ignore[no-any-return]
    if method == "l1":
        scale, num = a.mean(), levels / 2
    elif method == "l0":
        scale, num = np.exp(np.log(a[a > 0]).mean()), levels / 2
    else:
        scale, num = a.max(), levels
    return np.clip(np.rint(c * f32(num / scale)), -levels, levels).astype(np.int8)


@pytest.mark.parametrize("method", lioncub.METHODS)
@pytest.mark.parametrize("levels", [1, 3, 31, 127])
def test_quantize_formulas(method: str, levels: int) -> None:
    rng = np.random.default_rng(levels)
    c = (rng.standard_normal((20, 51)) * rng.uniform(0.1, 10, 51)).astype(np.float32)
    c[0, :5] = 0.0
    q = lioncub.quantize(c, method, levels)
    assert q.dtype == np.int8 and q.shape == c.shape
    assert int(np.abs(q).max()) <= (1 if method == "sign" else levels)
    expected = _expected_q(c, method, levels)
    # the scale's float64 summation order differs from numpy's pairwise sum in the last bits
    assert np.mean(q == expected) > 0.999
    if method == "linf":
        assert int(np.abs(q).max()) == levels
    out = np.empty(c.size, np.int8)
    assert lioncub.quantize(c, method, levels, out=out) is out
    assert np.array_equal(out, q.reshape(-1))


def test_quantize_small_examples() -> None:
    c = np.array([0.5, -1.0, 0.0, 2.5], np.float32)  # mean |c| = 1
    assert lioncub.quantize(c, "l1", 4).tolist() == [1, -2, 0, 4]
    assert lioncub.quantize(c, "linf", 5).tolist() == [1, -2, 0, 5]
    assert lioncub.quantize(c, "sign", 9).tolist() == [1, -1, 0, 1]
    # geometric mean of 0.5, 1, 2.5 = 1.077..: 2.5 / 1.077 * 2 = 4.64 -> clipped to 4
    assert lioncub.quantize(c, "l0", 4).tolist() == [1, -2, 0, 4]


@pytest.mark.parametrize("method", lioncub.METHODS)
def test_quantize_zero_and_empty(method: str) -> None:
    assert lioncub.quantize(np.zeros(10, np.float32), method, 7).tolist() == [0] * 10
    assert lioncub.quantize(np.zeros(0, np.float32), method, 7).size == 0


def test_quantize_bad_inputs() -> None:
    c = np.ones(4, np.float32)
    with raises_usage("method"):
        lioncub.quantize(c, "l2", 3)
    for bad in (0, 128, -1, 2.5, True, None):
        with raises_usage("levels"):
            lioncub.quantize(c, "l1", bad)  # type: ignore[arg-type]
    with raises_usage("c"):
        lioncub.quantize(np.ones(4, np.int32), "l1", 3)
    for method in lioncub.METHODS:
        with raises_usage("c"):
            lioncub.quantize(np.array([1.0, np.nan], np.float32), method, 3)
        with raises_usage("c"):
            lioncub.quantize(np.array([1.0, -np.inf], np.float32), method, 3)
    with raises_usage("out"):
        lioncub.quantize(c, "l1", 3, out=np.empty(4, np.int16))


def test_default_levels() -> None:
    assert [lioncub.default_levels(p) for p in (1, 2, 4, 5, 8, 16, 127, 128, 1000)] == \
        [31, 31, 31, 25, 15, 7, 1, 1, 1]


# ---------------------------------------------------------------- buckets
def test_buckets_layout() -> None:
    bs = lioncub.make_buckets([3, 0, 4, 10, 2, 2], 8)
    assert [[(s.index, s.offset, s.size) for s in b.slots] for b in bs] == [
        [(0, 0, 3), (2, 3, 4)], [(3, 0, 10)], [(4, 0, 2), (5, 2, 2)]]
    assert [b.size for b in bs] == [7, 10, 4]
    with pytest.raises(UsageError):
        lioncub.make_buckets([1], 0)


# ---------------------------------------------------------------- sync schedules
NAMES = ("a.weight", "a.bias", "b.weight", "b.bias")


def _steps(sched: lioncub.MomentumSync, n: int,
           agreement: dict[int, float] | None = None) -> list[int]:
    return [t for t in range(1, n + 1) if sched.select(t, agreement, NAMES)]


def test_sync_schedules() -> None:
    assert _steps(NoSync(), 20) == []
    assert _steps(EveryK(4), 13) == [4, 8, 12]
    assert _steps(EarlyPhase(5), 20) == [1, 2, 3, 4, 5]
    assert _steps(EarlyPhase(9, every=3), 20) == [3, 6, 9]
    # T_{j+1} = T_j + 2^(j/k): k=1 from 1: 1, 2, 4, 8, 16
    assert _steps(Exponential(1), 20) == [1, 2, 4, 8, 16]
    # k=2: intervals 1, 1.41, 2, 2.83, 4, 5.66: T = 1, 2, 3.41, 5.41, 8.24, 12.24, 17.9
    assert _steps(Exponential(2), 20) == [1, 2, 4, 6, 9, 13, 18]
    assert EveryK(2).select(4, None, NAMES) == [0, 1, 2, 3]


def test_sync_selective_and_adaptive() -> None:
    sel = Selective(EveryK(2), "*.bias")
    assert sel.select(1, None, NAMES) == [] and sel.select(2, None, NAMES) == [1, 3]
    assert Selective("every:1", re.compile(r"^b\.")).select(1, None, NAMES) == [2, 3]
    assert Selective(EveryK(1), lambda n: n.startswith("a")).select(1, None, NAMES) == [0, 1]
    ad = Adaptive(0.5, min_interval=3, warmup=1)
    agree = {0: 0.2, 1: 0.9, 2: 0.49, 3: 0.5}
    assert ad.select(1, agree, NAMES) == []            # warm-up
    assert ad.select(2, agree, NAMES) == [0, 2]
    assert ad.select(3, agree, NAMES) == []            # min_interval
    assert ad.select(5, agree, NAMES) == [0, 2]
    assert Selective(Adaptive(0.5), ["a.*"]).select(1, agree, NAMES) == [0]
    with pytest.raises(UsageError):
        ad.select(7, None, NAMES)


def test_sync_specs_and_state() -> None:
    for spec in ("none", "every:3", "exp:2:5", "early:10:2", "adaptive:0.25:2:3",
                 "every:3@*.bias,a.*"):
        sched = parse_sync(spec)
        assert parse_sync(sched.spec()).spec() == sched.spec()
    assert isinstance(parse_sync(None), NoSync)
    assert parse_sync("exp:3").spec() == "exp:3:1"
    for bad in ("every", "every:0", "every:x", "sometimes", "exp:1:2:3", "adaptive:2",
                "adaptive:nan", "early:-1", 7):
        with pytest.raises(UsageError):
            parse_sync(bad)  # type: ignore[arg-type]
    a = Exponential(2)
    _steps(a, 7)
    b = Exponential(2)
    b.load_state_dict(a.state_dict())
    assert [t for t in range(8, 40) if a.select(t, None, NAMES)] == \
        [t for t in range(8, 40) if b.select(t, None, NAMES)]
    with pytest.raises(UsageError):
        EveryK(2).load_state_dict(EveryK(3).state_dict())


# ---------------------------------------------------------------- DistributedLion, one rank
def _model(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [_rand(rng, 12, 9), _rand(rng, 9), np.zeros((0, 3), np.float32), _rand(rng, 40),
            _rand(rng, 3, 3, 3)]


def _one_rank_reference(variant: str, p: np.ndarray, g: np.ndarray | None, m: np.ndarray,
                        lr: float, b1: float, b2: float, wd: float, levels: int) -> None:
    """What one rank must do, from the published rules: Lion with sign(c) replaced by the
    variant's vote of a single worker."""
    spec = lioncub.SPECS[variant]
    if spec.kind in ("global", "sign-sum", "mean"):
        lioncub.lion_update(p, g, m, lr, b1, b2, wd)
        return
    gg = np.zeros_like(p) if g is None else g
    c = m * f32(b1) + gg * f32(1 - b1)
    if spec.kind == "majority":
        u = np.where(c >= 0, 1, -1).astype(np.float32)  # 1-bit votes: 0 votes +1
    else:
        assert spec.method is not None
        u = np.sign(lioncub.quantize(c, spec.method, levels)).astype(np.float32)
    p *= f32(1 - lr * wd)
    p -= f32(lr) * u
    m[:] = m * f32(b2) + gg * f32(1 - b2)


@pytest.mark.parametrize("variant", lioncub.VARIANTS)
def test_one_rank_matches_reference(comm: Any, variant: str) -> None:
    """On one rank every variant is Lion with its own vote in place of sign(c), bit for bit:
    Lion itself for global / dlion-avg / lioncub-sign. Param groups carry their own lr,
    weight decay and betas; a missing gradient is a zero gradient."""
    params = _model()
    ref = [p.copy() for p in params]
    ref_m = [np.zeros_like(p) for p in params]
    groups = [{"params": params[:2], "lr": 0.01, "weight_decay": 0.5},
              {"params": params[2:], "betas": (0.8, 0.95)}]
    sums = lioncub.SPECS[variant].yields_sums
    opt = lioncub.DistributedLion(groups, comm, variant=variant, lr=0.003, bucket_size=4 * 64,
                                  agreement=True if sums else None)
    assert len(opt.buckets) > 1
    rng = np.random.default_rng(5)
    for step in range(12):
        grads: list[np.ndarray | None] = [_rand(rng, *p.shape) for p in params]
        if step % 3 == 2:
            grads[1] = None
        opt.step(grads)
        for i, (p, g, m) in enumerate(zip(ref, grads, ref_m, strict=True)):
            lr, wd, (b1, b2) = (0.01, 0.5, (0.9, 0.99)) if i < 2 else (0.003, 0.0, (0.8, 0.95))
            _one_rank_reference(variant, p, g, m, lr, b1, b2, wd, opt.levels)
        for p, want in zip(params, ref, strict=True):
            assert np.array_equal(p, want)
        for m, want in zip(opt.momenta, ref_m, strict=True):
            assert np.array_equal(m, want)
    assert opt.step_count == 12
    st = opt.last_stats
    assert st is not None and st.step == 12 and st["step"] == 12
    assert st.bytes_sent == 0 and st.compute_seconds >= 0 and st.comm_seconds >= 0
    if sums:
        assert st.agreement is not None and set(st.agreement) == {"0", "1", "3", "4"}
        assert all(0.0 <= a <= 1.0 for a in st.agreement.values())
    else:
        assert st.agreement is None


def test_quantized_step_uses_quantize(comm: Any) -> None:
    """One rank, lioncub-l1: the update is sign(quantize(c, "l1", levels)) per tensor."""
    params = _model(3)
    before = [p.copy() for p in params]
    opt = lioncub.DistributedLion(params, comm, variant="lioncub-l1", lr=0.5, levels=20)
    assert opt.levels == 20
    rng = np.random.default_rng(9)
    grads = [_rand(rng, *p.shape) for p in params]
    opt.step(grads)
    zeros = 0
    for p, b, g in zip(params, before, grads, strict=True):
        c = g * f32(1 - 0.9)
        q = lioncub.quantize(c, "l1", 20)
        assert np.array_equal(p, b - f32(0.5) * np.sign(q).astype(np.float32))
        zeros += int((q == 0).sum())
    assert zeros > 0  # some votes rounded to 0: the update is not plain sign(c)


def test_one_rank_state_dict_roundtrip(comm: Any) -> None:
    def run(opt: lioncub.DistributedLion, params: list[np.ndarray], seed: int, n: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(n):
            opt.step([_rand(rng, *p.shape) for p in params])

    a = _model()
    opt_a = lioncub.DistributedLion(a, comm, variant="lioncub-sign", momentum_sync="exp:1",
                                    lr=0.01)
    run(opt_a, a, 1, 5)
    saved, saved_params = opt_a.state_dict(), [p.copy() for p in a]
    run(opt_a, a, 2, 6)
    b = [p.copy() for p in saved_params]
    opt_b = lioncub.DistributedLion(b, comm, variant="lioncub-sign", momentum_sync="exp:1",
                                    lr=0.5)
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["lr"] == 0.01 and opt_b.step_count == 5
    run(opt_b, b, 2, 6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(opt_a.momenta, opt_b.momenta, strict=True))
    other = lioncub.DistributedLion(_model(), comm, variant="lioncub-l1")
    with raises_usage("state"):
        other.load_state_dict(saved)
    with pytest.raises(UsageError):
        lioncub.DistributedLion(_model(), comm, variant="lioncub-sign").load_state_dict(saved)


def test_bad_arguments(comm: Any) -> None:
    params = _model()
    opt = lioncub.DistributedLion(params, comm)
    good = [np.zeros(p.shape, np.float32) for p in params]
    with raises_usage("grads"):
        opt.step(good[:-1])
    last = len(good) - 1
    with pytest.raises(UsageError) as info:
        opt.step([*good[:-1], np.zeros(3, np.float32)])
    assert str(info.value) == (f"gradient {last} ({opt.names[last]}) has shape (3,), the "
                               f"parameter has {params[last].shape}")
    with raises_usage("grads", 0):
        opt.step([good[0].astype(np.float64), *good[1:]])
    with raises_usage("grads", 0):
        opt.step([good[0].tolist(), *good[1:]])  # type: ignore[list-item]
    with pytest.raises(UsageError):
        opt.step(good[0])  # type: ignore[arg-type]
    bad_grad = [g.copy() for g in good]
    bad_grad[0][1, 1] = np.nan
    with raises_usage("grads", 0):
        opt.step(bad_grad)
    with raises_usage("variant"):
        lioncub.DistributedLion(params, comm, variant="lion")
    for levels in (0, 128, 2.0, True):
        with raises_usage("levels"):
            lioncub.DistributedLion(params, comm, levels=levels)  # type: ignore[arg-type]
    with raises_usage("tie"):
        lioncub.DistributedLion(params, comm, variant="lioncub-mavo", tie="random")
    with raises_usage("momentum_sync"):
        lioncub.DistributedLion(params, comm, variant="lioncub-mavo", momentum_sync="adaptive:0.5")
    with raises_usage("params", 0):
        lioncub.DistributedLion([np.zeros(3)], comm)
    with raises_usage("params", 1):
        lioncub.DistributedLion([params[0], params[0]], comm)
    with raises_usage("params", 1):
        lioncub.DistributedLion([params[0][1:], params[0][:2]], comm)
    with raises_usage("params", 0):
        lioncub.DistributedLion([np.zeros((3, 4), np.float32).T], comm)
    with raises_usage("params"):
        lioncub.DistributedLion([], comm)
    with raises_usage("names"):
        lioncub.DistributedLion(params, comm, names=["x"])
    with raises_usage("lr"):
        lioncub.DistributedLion(params, comm, lr=-1.0)
    with raises_usage("betas"):
        lioncub.DistributedLion(params, comm, betas=(0.9,))  # type: ignore[arg-type]
    with raises_usage("bucket_size"):
        lioncub.DistributedLion(params, comm, bucket_size=0)
    opt.param_groups[0]["lr"] = float("inf")
    with raises_usage("lr"):
        opt.step(good)
    assert issubclass(UsageError, bitcoll.errors.BitcollError)


def test_parallel_kernels_give_the_serial_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocked reductions and element-wise kernels on numba's pool (the prange kernels, with
    however many threads numba has here) equal the serial ones."""
    import bitcoll.kernels

    n = 3 * kernels.BLOCK + 5

    def run() -> list[Any]:
        rng = np.random.default_rng(7)
        m, g, p = rng.standard_normal((3, n)).astype(np.float32)
        s = rng.integers(-3, 4, n).astype(np.int32)
        out, q, p2, m2 = np.empty(n, np.float32), np.empty(n, np.int8), p.copy(), m.copy()
        res: list[Any] = [kernels.direction_with_max(m, g, out, f32(0.9), f32(0.1),
                                                     f32(0.99), f32(0.01))]
        kernels.quantize_scaled(out, f32(3.0), 7, q)
        res.append(kernels.apply_sign(p, s, f32(1e-3), f32(0.999)))
        kernels.lion_step(p2, g, m2, f32(1e-3), f32(0.999), f32(0.9), f32(0.1), f32(0.99),
                          f32(0.01))
        res.append(kernels.log_abs_sum(out))
        return res + [a.tobytes() for a in (out, q, p, m, p2, m2)]

    monkeypatch.setattr(kernels, "PARALLEL_MIN_ELEMENTS", n + 1)
    serial = run()
    monkeypatch.setattr(kernels, "PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(bitcoll.kernels, "_nb_get_num_threads", lambda: 2)
    calls: list[str] = []

    def spy(name: str, kern: Any) -> Any:
        def call(*a: Any) -> Any:
            calls.append(name)
            return kern(*a)
        return call

    for name in ("_direction_blocks_par", "_quantize_scaled_par", "_apply_sign_par",
                 "_lion_step_par", "_log_abs_sum_blocks_par"):
        monkeypatch.setattr(kernels, name, spy(name, getattr(kernels, name)))
    parallel = run()
    assert len(calls) == 5  # every kernel took the parallel path
    assert serial == parallel


@pytest.mark.parametrize(("variant", "kwargs"), [
    ("lioncub-mavo", {"agreement": True}),  # a 1-bit majority has no sums
    ("lioncub-l1", {"agreement": False, "momentum_sync": "adaptive:0.5"}),
    ("lioncub-l1", {"agreement": "yes"}),
])
def test_agreement_is_checked(comm: Any, variant: str, kwargs: dict[str, Any]) -> None:
    with raises_usage("agreement"):
        lioncub.DistributedLion(_model(), comm, variant=variant, **kwargs)


@pytest.mark.parametrize("sync", [None, "adaptive:0.5"])
def test_agreement_follows_the_momentum_sync_by_default(comm: Any, sync: str | None) -> None:
    opt = lioncub.DistributedLion(_model(), comm, variant="lioncub-l1", momentum_sync=sync)
    assert opt.agreement is (sync is not None)
