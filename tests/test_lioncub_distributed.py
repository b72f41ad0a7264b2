"""DistributedLion on real multi-rank worlds: TCP (``run_world``, p = 1..4) and MPI
(pytest-mpi, any size).

Every rank runs :func:`target_all`, a battery of checks. Each check records None or its
traceback, plus digests of the parameters after every step; the tests then assert that every
check passed on every rank and that the digests agree across ranks (the parameters are
bitwise identical on every rank after every step).

Expected values come from :func:`simulate`, a plain numpy transcription of the variants'
published rules that simulates all ``p`` workers (their own momenta, their votes, the
aggregation) in one process; each rank can run it because every rank's gradients are
generated from seeds.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from multiproc import run_world

import lioncub
from bitcoll.errors import UsageError

f32 = np.float32
SHAPES: list[tuple[int, ...]] = [(12, 9), (9,), (0, 3), (40,), (3, 3, 3)]
NAMES = ["a.weight", "a.bias", "empty", "b.weight", "b.kernel"]
BUCKET_BYTES = 4 * 64  # several buckets, several tensors per bucket
STEPS = 6
HYPER: dict[str, Any] = {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.1}
SIGN_EXACT = ("dlion-mavo", "dlion-avg", "lioncub-mavo", "lioncub-sign")
Grads = list[list[list[np.ndarray | None]]]  # [step][rank][tensor]


# ---------------------------------------------------------------- data and reference
def initial_params(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def make_grads(p: int, steps: int, identical: bool, seed: int = 1) -> Grads:
    """Gradients of every rank at every step; rank 1 has no gradient for tensor 0 on odd
    steps (when ``identical`` is False)."""
    out: Grads = []
    for t in range(steps):
        per_rank = []
        for r in range(p):
            rng = np.random.default_rng([seed, t, 0 if identical else r])
            gs: list[np.ndarray | None] = [rng.standard_normal(s).astype(np.float32)
                                           for s in SHAPES]
            if not identical and r == 1 and t % 2 == 1:
                gs[0] = None
            per_rank.append(gs)
        out.append(per_rank)
    return out


def simulate(variant: str, params0: list[np.ndarray], grads: Grads, p: int, levels: int,
             bucket_bytes: int = BUCKET_BYTES) -> list[list[np.ndarray]]:
    """The parameters after each step, from the variants' rules (see lioncub.variants)."""
    spec = lioncub.SPECS[variant]
    lr, (b1, b2), wd = HYPER["lr"], HYPER["betas"], HYPER["weight_decay"]
    buckets = lioncub.make_buckets([x.size for x in params0], bucket_bytes // 4)
    bucket_of = {s.index: b.index for b in buckets for s in b.slots}
    theta = [x.copy() for x in params0]
    mom = [[np.zeros_like(x) for x in params0] for _ in range(p)]
    history = []
    for t, step_grads in enumerate(grads):
        for i, th in enumerate(theta):
            if th.size == 0:
                continue
            gs: list[np.ndarray] = []
            for r in range(p):
                g = step_grads[r][i]
                gs.append(np.zeros_like(th) if g is None else g)
            cs = [mom[r][i] * f32(b1) + gs[r] * f32(1 - b1) for r in range(p)]
            for r in range(p):
                mom[r][i] = mom[r][i] * f32(b2) + gs[r] * f32(1 - b2)
            if spec.kind == "majority":
                votes = sum(np.where(c >= 0, 1, -1) for c in cs)
                tie = 1 if (t + bucket_of[i]) % 2 == 0 else -1
                u = np.where(votes > 0, 1, np.where(votes < 0, -1, tie)).astype(np.float32)
            elif spec.kind in ("sign-sum", "mean"):
                total = sum(np.sign(c).astype(np.int32) for c in cs)
                u = (np.asarray(total).astype(np.float32) / f32(p) if spec.kind == "mean"
                     else np.sign(total).astype(np.float32))
            elif spec.kind == "quantized":
                assert spec.method is not None
                total = sum(lioncub.quantize(c, spec.method, levels).astype(np.int32)
                            for c in cs)
                u = np.sign(total).astype(np.float32)
            else:
                raise AssertionError("global Lion is checked against Lion, not simulated")
            th *= f32(1 - lr * wd)
            th -= f32(lr) * u
        history.append([x.copy() for x in theta])
    return history


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def run_optimizer(comm: Any, variant: str, params: list[np.ndarray], grads: Grads,
                  steps: range, opt: lioncub.DistributedLion | None = None,
                  **kwargs: Any) -> tuple[lioncub.DistributedLion, list[str]]:
    """Run ``steps`` with this rank's gradients; return the optimizer and per-step digests."""
    if opt is None:
        opt = lioncub.DistributedLion(params, comm, variant=variant,
                                      bucket_size=kwargs.pop("bucket_size", BUCKET_BYTES),
                                      names=NAMES, **HYPER, **kwargs)
    digests = []
    for t in steps:
        opt.step(grads[t][comm.rank])
        digests.append(digest(params))
    return opt, digests


# ---------------------------------------------------------------- the checks
def check_sign_variants_reproduce_lion(comm: Any, out: dict[str, Any]) -> None:
    """Identical data on every rank: the sign-based variants are single-process Lion."""
    grads = make_grads(comm.size, STEPS, identical=True)
    for variant in SIGN_EXACT:
        params = initial_params()
        ref = initial_params()
        ref_m = [np.zeros_like(x) for x in ref]
        opt = lioncub.DistributedLion(params, comm, variant=variant, bucket_size=BUCKET_BYTES,
                                      **HYPER)
        digests = []
        for t in range(STEPS):
            opt.step(grads[t][comm.rank])
            for x, g, m in zip(ref, grads[t][comm.rank], ref_m, strict=True):
                lioncub.lion_update(x, g, m, HYPER["lr"], HYPER["betas"][0], HYPER["betas"][1],
                                    HYPER["weight_decay"])
            for i, (x, want) in enumerate(zip(params, ref, strict=True)):
                assert np.array_equal(x, want), f"{variant}: tensor {i} differs at step {t}"
            digests.append(digest(params))
        out[f"exact/{variant}"] = digests


def check_variants_match_simulation(comm: Any, out: dict[str, Any]) -> None:
    """Different data per rank (and missing gradients on rank 1): every variant but global
    follows the simulation of its published rule bit for bit. The exact-sum variants do so
    with the vote agreement on (the collective returns the sums) and off (only their signs
    come back: fewer bytes, no agreement)."""
    p = comm.size
    grads = make_grads(p, STEPS, identical=False)
    for variant in lioncub.VARIANTS:
        if variant == "global":
            continue
        sums = lioncub.SPECS[variant].yields_sums
        sent: dict[bool, int] = {}
        for agreement in (False, True) if sums else (None,):
            params = initial_params()
            opt, digests = run_optimizer(comm, variant, params, grads, range(STEPS),
                                         agreement=agreement)
            expected = simulate(variant, initial_params(), grads, p, opt.levels)
            for t, want in enumerate(expected):
                assert digest(want) == digests[t], \
                    f"{variant} (agreement={agreement}) differs from simulation at step {t}"
            out[f"sim/{variant}"] = digests
            st = opt.last_stats
            assert st is not None
            if p > 1:
                assert st.bytes_sent > 0 and st.bytes_received > 0 and st.messages_sent > 0
            assert opt.agreement is bool(agreement)
            if agreement:
                assert st.agreement is not None
                out[f"agreement/{variant}"] = sorted(st.agreement.items())
            else:
                assert st.agreement is None
            sent[bool(agreement)] = st.bytes_sent
        if sums:
            # the signs (2 bits) travel back instead of the sums (2 bits or more); small
            # vectors go by the all-gather of the inputs, where both send the same
            assert sent[False] <= sent[True], (variant, sent)


def check_global_lion_batch_split(comm: Any, out: dict[str, Any]) -> None:
    """Global Lion, a linear least-squares model, the batch split across ranks: the mean of
    the per-rank gradients is the whole-batch gradient (up to rounding), so the trajectory is
    single-process Lion's within float32 tolerance."""
    p, r = comm.size, comm.rank
    rng = np.random.default_rng(42)
    n, d = 60, 20  # equal shards for 1 to 6 ranks: the mean of shard means is the batch mean
    x = rng.standard_normal((n, d))
    y = x @ rng.standard_normal(d) + 0.1 * rng.standard_normal(n)
    w0 = (0.1 * rng.standard_normal(d)).astype(np.float32)

    def grad(w: np.ndarray, rows: slice) -> np.ndarray:
        xs, ys = x[rows], y[rows]
        return (2.0 / len(ys) * xs.T @ (xs @ w.astype(np.float64) - ys)).astype(np.float32)

    shard = slice(r * n // p, (r + 1) * n // p)
    w = w0.copy()
    opt = lioncub.DistributedLion([w], comm, variant="global", lr=0.01, weight_decay=0.01)
    ref, ref_m = w0.copy(), np.zeros_like(w0)
    digests = []
    for _ in range(30):
        opt.step([grad(w, shard)])
        lioncub.lion_update(ref, grad(ref, slice(None)), ref_m, 0.01, weight_decay=0.01)
        assert np.allclose(w, ref, rtol=0, atol=1e-5), float(np.abs(w - ref).max())
        digests.append(digest([w]))
    out["global/linear"] = digests
    assert opt.momenta[0].shape == w.shape


CHECKPOINT_CASES = [
    ("global", "every:2"), ("dlion-mavo", None), ("dlion-avg", "adaptive:0.9"),
    ("lioncub-mavo", "every:2"), ("lioncub-sign", "adaptive:0.7:2"),
    ("lioncub-l1", "exp:1"), ("lioncub-l0", "early:3@b.*"), ("lioncub-linf", "exp:2:2"),
]


def check_checkpoint_resume(comm: Any, out: dict[str, Any]) -> None:
    """Save at step k, restore into a fresh optimizer on fresh arrays, continue: bitwise
    equal to the uninterrupted run (momenta, tie counter and sync schedule state included)."""
    grads = make_grads(comm.size, 8, identical=False, seed=7)
    k = 3
    for variant, sync in CHECKPOINT_CASES:
        params = initial_params(3)
        opt, _ = run_optimizer(comm, variant, params, grads, range(k), momentum_sync=sync)
        saved = opt.state_dict()
        saved_params = [x.copy() for x in params]
        _, tail = run_optimizer(comm, variant, params, grads, range(k, 8), opt=opt)
        fresh_params = [x.copy() for x in saved_params]
        fresh = lioncub.DistributedLion(fresh_params, comm, variant=variant, lr=0.5,
                                        bucket_size=BUCKET_BYTES, names=NAMES,
                                        momentum_sync=sync)
        fresh.load_state_dict(saved)
        _, tail2 = run_optimizer(comm, variant, fresh_params, grads, range(k, 8), opt=fresh)
        assert tail == tail2, f"{variant}: the resumed run diverged"
        for a, b in zip(opt.momenta, fresh.momenta, strict=True):
            assert np.array_equal(a, b), f"{variant}: momenta diverged"
        out[f"checkpoint/{variant}"] = tail


def check_momentum_sync(comm: Any, out: dict[str, Any]) -> None:
    """Selective sync averages exactly the chosen momenta (identical on every rank after
    it, others keep drifting apart); adaptive sync chooses by the documented rule."""
    p = comm.size
    grads = make_grads(p, 4, identical=False, seed=11)
    params = initial_params()
    opt, _ = run_optimizer(comm, "lioncub-l1", params, grads, range(2),
                           momentum_sync="every:2@a.*")
    st = opt.last_stats
    assert st is not None and st.synced == ("a.weight", "a.bias")
    out["sync/momenta"] = [digest([m]) for m in opt.momenta[:2]]  # the synchronized ones
    # after the sync the a.* momenta are the average of the ranks' momenta
    mom: list[list[np.ndarray]] = [[np.zeros(s, np.float32) for s in SHAPES] for _ in range(p)]
    for t in range(2):
        for r in range(p):
            for i in range(len(SHAPES)):
                grad = grads[t][r][i]
                g = np.zeros(SHAPES[i], np.float32) if grad is None else grad
                mom[r][i] = mom[r][i] * f32(0.99) + g * f32(1 - 0.99)
    for i in (0, 1):
        want = np.mean([mom[r][i].astype(np.float64) for r in range(p)], axis=0)
        assert np.allclose(opt.momenta[i], want, rtol=1e-6, atol=1e-7)
    for i in (3, 4):
        assert np.array_equal(opt.momenta[i], mom[comm.rank][i])

    params = initial_params()
    opt = lioncub.DistributedLion(params, comm, variant="lioncub-sign", names=NAMES,
                                  bucket_size=BUCKET_BYTES, momentum_sync="adaptive:0.8",
                                  **HYPER)
    decisions = []
    for t in range(4):
        opt.step(grads[t][comm.rank])
        st = opt.last_stats
        assert st is not None and st.agreement is not None
        low = tuple(n for n in NAMES if n in st.agreement and st.agreement[n] < 0.8)
        assert st.synced == low
        decisions.append((st.synced, sorted(st.agreement.items())))
    if p > 1:
        assert any(d[0] for d in decisions), "no tensor was ever synchronized"
    out["sync/adaptive"] = decisions


def check_layout_mismatch(comm: Any, out: dict[str, Any]) -> None:
    """Ranks that build the optimizer differently get UsageError on every rank."""
    if comm.size == 1:
        return
    shape = (10,) if comm.rank == 0 else (11,)
    try:
        lioncub.DistributedLion([np.zeros(shape, np.float32)], comm)
    except UsageError as exc:
        assert "differently" in str(exc)
    else:
        raise AssertionError("mismatched layouts were not detected")
    variant = "lioncub-l1" if comm.rank == 0 else "lioncub-l0"
    with pytest.raises(UsageError):
        lioncub.DistributedLion([np.zeros(4, np.float32)], comm, variant=variant)
    # the communicator is still usable
    x = np.ones(3, np.float32)
    assert comm.allreduce(x).tolist() == [comm.size] * 3


CHECKS: list[Callable[[Any, dict[str, Any]], None]] = [
    check_sign_variants_reproduce_lion,
    check_variants_match_simulation,
    check_global_lion_batch_split,
    check_checkpoint_resume,
    check_momentum_sync,
    check_layout_mismatch,
]


def target_all(comm: Any) -> dict[str, Any]:
    """Run every check on this rank; a failed check is recorded as its traceback (the
    collectives stay aligned because every check fails, if at all, after its last
    collective or identically on every rank)."""
    results: dict[str, Any] = {"failures": {}, "data": {}, "seconds": {}}
    for check in CHECKS:
        start = time.perf_counter()
        try:
            check(comm, results["data"])
        except AssertionError:
            results["failures"][check.__name__] = traceback.format_exc()
        results["seconds"][check.__name__] = time.perf_counter() - start
    return results


def assert_world(results: list[dict[str, Any]], check: str, prefix: str) -> None:
    for r, res in enumerate(results):
        assert check not in res["failures"], f"rank {r}:\n{res['failures'][check]}"
    keys = sorted(k for k in results[0]["data"] if k.startswith(prefix))
    if check != "check_layout_mismatch":
        assert keys, f"{check} recorded nothing"
    for key in keys:
        values = [res["data"][key] for res in results]
        assert all(v == values[0] for v in values), f"{key} differs between ranks: {values}"


# ---------------------------------------------------------------- TCP worlds
@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda p: f"p{p}")
def tcp_world(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_world(request.param, target_all, timeout=600.0, comm_timeout=120.0)


CASES = [
    ("check_sign_variants_reproduce_lion", "exact/"),
    ("check_variants_match_simulation", "sim/"),
    ("check_variants_match_simulation", "agreement/"),
    ("check_global_lion_batch_split", "global/"),
    ("check_checkpoint_resume", "checkpoint/"),
    ("check_momentum_sync", "sync/"),
    ("check_layout_mismatch", "-"),
]


@pytest.mark.tcp
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("check", "prefix"), CASES, ids=[c[1].rstrip("/") or c[0]
                                                          for c in CASES])
def test_tcp(tcp_world: list[dict[str, Any]], check: str, prefix: str) -> None:
    assert_world(tcp_world, check, prefix)


# ---------------------------------------------------------------- MPI worlds
@pytest.fixture(scope="module")
def mpi_world() -> list[dict[str, Any]]:
    import bitcoll

    with bitcoll.init("mpi", timeout=120.0) as comm:
        mine = target_all(comm)
        # gather every rank's results as bytes (pickled) through the communicator
        import pickle

        blob = np.frombuffer(pickle.dumps(mine), dtype=np.uint8)
        sizes = comm.allgather(np.array([blob.size], np.int64))
        padded = np.zeros(int(sizes.max()), np.uint8)
        padded[:blob.size] = blob
        everything = comm.allgather(padded).reshape(comm.size, -1)
        return [pickle.loads(everything[r, :int(sizes[r])].tobytes())
                for r in range(comm.size)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("check", "prefix"), CASES, ids=[c[1].rstrip("/") or c[0]
                                                          for c in CASES])
def test_mpi(mpi_world: list[dict[str, Any]], check: str, prefix: str) -> None:
    assert_world(mpi_world, check, prefix)
