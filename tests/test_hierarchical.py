"""Two-level collectives (bitcoll.algorithms.hierarchical): exact, bit for bit the flat
algorithms' packed results, on even and uneven hosts; counters of bytes between hosts."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from errcheck import raises_usage
from inproc import InprocTransport, _World
from multiproc import run_world
from sweeps import (
    TIES,
    dense_sweep,
    expected_majority,
    expected_sign_sum,
    float_input,
    float_sweep,
    pack_bits_ref,
    packed_io_sweep,
    packed_sweep,
    vote_input,
)

import bitcoll
from bitcoll.algorithms.context import OpContext, Slot
from bitcoll.algorithms.hierarchical import HostPlan
from bitcoll.algorithms.sign_allreduce_direct import segment_elements
from bitcoll.algorithms.votes import (
    MajorityCodec,
    SumCodec,
    TernarySumCodec,
    field_width,
    make_codec,
)
from bitcoll.communicator import Communicator
from bitcoll.partition import block_bounds
from bitcoll.plan import DEFAULT_MODEL, Call, choose
from bitcoll.topology import Topology
from bitcoll.transport.base import HEADER_SIZE

Array = Any


def run_hosts(hosts: Sequence[int], fn: Callable[[Communicator], Any],
              timeout: float = 60.0, **kwargs: Any) -> list[Any]:
    """``fn(comm)`` on ``len(hosts)`` thread-ranks whose communicators know that rank ``r``
    runs on host ``hosts[r]`` (the ``topology`` constructor argument)."""
    world = _World(len(hosts))
    comms = [Communicator(InprocTransport(world, r), timeout=timeout,
                          topology=Topology(tuple(hosts), r), **kwargs)
             for r in range(len(hosts))]
    results: list[Any] = [None] * len(hosts)
    errors: list[BaseException] = []

    def target(r: int) -> None:
        try:
            results[r] = fn(comms[r])
        except BaseException as exc:
            errors.append(exc)
            comms[r].transport.abort(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=target, args=(r,), daemon=True)
               for r in range(len(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    if errors:
        raise errors[0]
    return results


# Hosts: even, uneven (interleaved ranks, a host of one), one host, one rank per host.
LAYOUTS = [(0, 0, 1, 1), (0, 1, 0, 1, 1), (0, 0, 0, 1, 2, 2, 1, 0), (0, 0, 0), (0, 1, 2)]


def test_plan_slices_and_owners() -> None:
    plan = HostPlan((0, 0, 0, 1, 2, 2, 1, 0), 1001)
    assert plan.members == [[0, 1, 2, 7], [3, 6], [4, 5]]
    assert plan.slices == 4
    sb = plan.slice_bounds()
    assert sb[0] == 0 and sb[-1] == 1001 and all(b % 8 == 0 for b in sb[:-1])
    # Host 1 (2 ranks) gives each rank two slices; every slice has one owner per host.
    assert [plan.owner(1, s) for s in range(4)] == [3, 6, 3, 6]
    assert plan.cross_group(3) == [7, 6, 5]


def test_codec_classes_and_count_fields() -> None:
    maj, tern, ints = (make_codec("majority", "sign", 1, 5), make_codec("sum", "sign", 1, 5),
                       make_codec("sum", "int", 31, 5, packed_io=True))
    assert type(maj) is MajorityCodec and type(tern) is TernarySumCodec and \
        type(ints) is SumCodec
    assert maj.majority and not tern.majority and not ints.majority
    assert (maj.w_in, maj.w_out, tern.w_in, tern.w_out) == (1, 1, 2, field_width(5))
    assert (ints.w_in, ints.bias_in, ints.w_out, ints.bias_out) == (6, 31, field_width(155), 155)
    assert ints.packed_in and ints.packed_out and not maj.packed_in
    assert maj.count_field(4) == (3, 0)  # counts 0..4
    assert maj.count_field(1) == (1, 0)
    assert ints.count_field(4) == (field_width(124), 124)
    assert tern.count_field(3) == (field_width(3), 3)


@pytest.mark.parametrize("hosts", LAYOUTS)
def test_packed_exact_inproc(hosts: tuple[int, ...]) -> None:
    """Majority (every tie rule) and exact sums, all-reduce and reduce-scatter, against the
    local references (which the flat algorithms match bit for bit)."""
    lengths = (0, 1, 9, 65, 1000, 20_003)

    def body(comm: Communicator) -> int:
        return packed_sweep(comm, seed=len(hosts), lengths=lengths,
                            algorithms=("hierarchical",))

    assert all(c > 0 for c in run_hosts(hosts, body))


@pytest.mark.parametrize("hosts", [(0, 1, 1, 0, 2, 2, 2, 2)])
def test_packed_io_inproc(hosts: tuple[int, ...]) -> None:
    """Packed input and output forms: the same bits as the unpacked forms, identical on every
    rank; small segments so that the pipeline runs several segments."""

    def body(comm: Communicator) -> list[int]:
        _, digests = packed_io_sweep(comm, lengths=(0, 7, 1001, 20_001),
                                     algorithms=("hierarchical", "direct"),
                                     levels_list=(1, 31))
        return digests

    digests = run_hosts(hosts, body, packed_segment_bytes=256)
    assert all(d == digests[0] for d in digests)


def test_same_bits_as_direct_and_default() -> None:
    """The default on several hosts with several ranks is hierarchical and gives the flat
    direct exchange's bits, ties included (tie counter aligned call by call)."""
    hosts = (0, 1, 1, 0, 0, 1)
    n = 50_001

    def body(comm: Communicator) -> None:
        x = vote_input(3, comm.rank, n, "float32")
        for tie in TIES:
            a = comm.sign_allreduce(x, tie=tie, algorithm="direct")
            comm._majority_calls -= 1  # the same tie counter for the second call
            b = comm.sign_allreduce(x, tie=tie)
            assert np.array_equal(a, b), tie
        q = np.random.default_rng(comm.rank).integers(-31, 32, n).astype(np.int8)
        assert np.array_equal(comm.quantized_allreduce(q, 31, algorithm="direct"),
                              comm.quantized_allreduce(q, 31))
        assert comm._algorithm("packed", None, "hierarchical") == "hierarchical"

    run_hosts(hosts, body, packed_segment_bytes=1024)


def test_two_level_off_makes_the_flat_algorithms_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``two_level=False`` (``BITCOLL_TWO_LEVEL=0``): on several hosts with several ranks
    the defaults send exactly what the flat algorithms the cost model picks send; on (the
    default) the model may pick the two-level ones, and does for a dense all-reduce over slow
    links. Splits inherit the setting; a bad value is a UsageError."""
    hosts = (0, 0, 1, 1)
    n = 40_001
    slow = DEFAULT_MODEL.replace(remote_bandwidth=1.25e8)  # 1 Gbit links

    def sent(comm: Communicator, packed: str | None = None, dense: str | None = None
             ) -> tuple[int, int]:
        x = vote_input(5, comm.rank, n, "float32")
        comm.stats.reset()
        comm.sign_allreduce(x, algorithm=packed)
        comm.allreduce(x, algorithm=dense)
        snap = comm.stats.snapshot()
        return snap["bytes_sent"], snap["messages_sent"]

    def body(comm: Communicator) -> tuple[tuple[int, int], tuple[int, int], str, str]:
        group = comm.plan_group
        packed = choose("packed", comm.cost_model, group, Call(count=n))
        dense = choose("allreduce", comm.cost_model, group, Call(nbytes=4 * n))
        return sent(comm), sent(comm, packed, dense), packed, dense

    for on in (False, True):
        for default, forced, packed, dense in run_hosts(hosts, body, two_level=on,
                                                        cost_model=slow):
            assert default == forced
            assert (dense == "hierarchical") is on
            if not on:
                assert packed != "hierarchical"
    for value, want in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv("BITCOLL_TWO_LEVEL", value)
        with bitcoll.init("local") as comm:
            assert comm.two_level is want
    with bitcoll.init("local", two_level=False) as comm:
        assert comm.two_level is False
        sub = comm.split(0)
        assert sub is not None and sub.two_level is False
        sub.close()
    monkeypatch.setenv("BITCOLL_TWO_LEVEL", "yes")
    with raises_usage("BITCOLL_TWO_LEVEL"):
        bitcoll.init("local")
    monkeypatch.delenv("BITCOLL_TWO_LEVEL")
    with raises_usage("two_level"):
        bitcoll.init("local", two_level="no")  # type: ignore[arg-type]


def _between_hosts_bytes(hosts: Sequence[int], rank: int, n: int, kind: str, levels: int,
                         seg: int) -> tuple[int, int]:
    """The formula: payload bytes and messages rank ``rank`` sends to other hosts in one
    all-reduce of ``n`` elements cut in segments of ``seg`` elements (see the algorithm's
    module docstring), computed here from the plan alone."""
    plan = HostPlan(tuple(hosts), n)
    p, H, me = len(hosts), plan.num_hosts, hosts[rank]
    g = len(plan.members[me])
    wc = max(1, g.bit_length()) if kind == "majority" else field_width(g * levels)
    w_out = 1 if kind == "majority" else field_width(levels * p)
    sb = plan.slice_bounds()
    nseg = max(1, -(-max(sb[s + 1] - sb[s] for s in range(plan.slices)) // seg))
    total = msgs = 0
    for s in range(plan.slices):
        if plan.owner(me, s) != rank:
            continue
        for k in range(nseg):
            a, b = min(sb[s] + k * seg, sb[s + 1]), min(sb[s] + (k + 1) * seg, sb[s + 1])
            groups = -(-(b - a) // 8)
            sub = [min(b, a + 8 * int(v)) for v in block_bounds(groups, H)]
            for t in range(H):
                if t != me:
                    m = sub[t + 1] - sub[t]  # counts to host t: bit planes or fields
                    total += wc * -(-m // 8) if kind == "majority" else -(-m * wc // 8)
                    total += -(-(sub[me + 1] - sub[me]) * w_out // 8)  # result to host t
                    msgs += 2
    return total, msgs


@pytest.mark.parametrize("hosts", [(0, 1, 0, 1, 1), (0, 0, 0, 1, 2, 2, 1, 0)])
def test_dense_allreduce_inproc(hosts: tuple[int, ...]) -> None:
    """Dense two-level all-reduce: integers exact in every dtype and op; random floats within
    the rounding bound of the additions and bitwise identical on every rank; in place; small
    segments so that slices move in several segments."""

    def body(comm: Communicator) -> int:
        checks = dense_sweep(comm, seed=len(hosts), lengths=(0, 1, 9, 1000, 30_001),
                             dtypes=("float16", "float64", "int8", "uint32", "int64"),
                             algorithms=("hierarchical",), large_dtypes=("float64",))
        checks += float_sweep(comm, seed=len(hosts), lengths=(7, 1000, 30_001),
                              dtypes=("float32", "float16"), algorithms=("hierarchical",))
        x = float_input(9, comm.rank, 5001, "float32")
        want = comm.allreduce(x, algorithm="hierarchical")
        y = x.copy()
        assert comm.allreduce(y, out=y, algorithm="hierarchical") is y
        assert np.array_equal(y, want)
        # Where the planner's default is two-level: the same bits as asking for it (the
        # crossover moves up where ranks share this machine's cores).
        n = next(k for k in (160_000, 640_000, 2_560_000)
                 if choose("allreduce", comm.cost_model, comm.plan_group,
                           Call(nbytes=4 * k)) == "hierarchical")
        big = float_input(10, comm.rank, n, "float32")
        assert np.array_equal(comm.allreduce(big), comm.allreduce(big, algorithm="hierarchical"))
        return checks

    assert all(c > 0 for c in run_hosts(hosts, body, segment_bytes=4096))


def test_dense_bfloat16() -> None:
    torch = pytest.importorskip("torch")
    hosts = (0, 0, 1, 1, 1)

    def body(comm: Communicator) -> tuple[bytes, Any]:
        x = float_input(4, comm.rank, 3001, "float32")
        got = comm.allreduce(torch.from_numpy(x).to(torch.bfloat16), algorithm="hierarchical")
        assert got.dtype == torch.bfloat16
        return got.view(torch.int16).numpy().tobytes(), got.float().numpy()

    res = run_hosts(hosts, body)
    assert all(r[0] == res[0][0] for r in res)  # identical bits on every rank
    ref = np.sum([float_input(4, j, 3001, "float32") for j in range(5)], axis=0)
    assert np.allclose(res[0][1], ref, rtol=2 ** -7, atol=0.05)


def test_explicit_choices_and_errors() -> None:
    """``algorithm="direct"`` keeps the flat exchange; a topology that does not fit the
    communicator is a UsageError; scratch slots are named."""
    world = _World(2)
    with raises_usage("topology"):
        Communicator(InprocTransport(world, 0), topology=Topology((0, 0, 1), 0))
    with raises_usage("topology"):
        Communicator(InprocTransport(world, 0), topology=Topology((0, 1), 1))
    ctx = OpContext(InprocTransport(world, 0), 0, 0, 1e18, 1024)
    with pytest.raises(TypeError, match="Slot members"):
        ctx.scratch(3, 8, np.dtype(np.uint8))  # type: ignore[arg-type]
    assert ctx.scratch(Slot.HIER_LAND, 8, np.dtype(np.uint8)).size == 8

    hosts = (0, 0, 1, 1)

    def body(comm: Communicator) -> tuple[int, int]:
        x = vote_input(2, comm.rank, 4000, "float32")
        comm.stats.reset()
        comm.sign_allreduce(x, algorithm="direct")
        flat = comm.stats.snapshot()["messages_sent"]
        comm.stats.reset()
        comm.sign_allreduce(x, algorithm="hierarchical")
        return flat, comm.stats.snapshot()["messages_sent"]

    # Flat direct: 2 (p - 1) messages per rank. Two-level (2 hosts of 2, one segment): one
    # contribution, counts and result to the other host, one result inside the host.
    assert run_hosts(hosts, body) == [(6, 4)] * 4


# ------------------------------------------------------------------ real ranks over TCP
TCP_HOSTS = (0, 0, 1, 0, 1)  # 5 ranks on hosts of 3 and 2 (interleaved)


def _remote_sent(comm: Communicator, fn: Callable[[], Any]) -> tuple[int, int, int]:
    """(bytes and messages sent between hosts, bytes sent within the host) by ``fn()``."""
    comm.barrier()
    comm.stats.reset()
    fn()
    remote, local = comm.stats_remote.snapshot(), comm.stats_local.snapshot()
    comm.barrier()
    return remote["bytes_sent"], remote["messages_sent"], local["bytes_sent"]


def _tcp_world(comm: Communicator) -> dict[str, Any]:
    p, r = comm.size, comm.rank
    assert comm.num_hosts == 2
    hosts = comm.topology.hosts
    out: dict[str, Any] = {}
    # Exact results, ties (even p), lengths divisible by nothing in sight.
    for n in (0, 13, 30_001):
        xs = [vote_input(6, j, n, "float32") for j in range(p)]
        for tie in TIES:
            call = comm.majority_calls
            got = comm.sign_allreduce(xs[r], tie=tie)
            assert np.array_equal(got, expected_majority(xs, tie, call)), (n, tie)
            lo, hi = bitcoll.block(n, p, r)
            call = comm.majority_calls
            got = comm.packed_sign_reduce_scatter(pack_bits_ref(xs[r] >= 0), n, tie=tie)
            assert np.array_equal(got, pack_bits_ref(expected_majority(xs, tie, call)[lo:hi]
                                                     > 0)), (n, tie)
        assert np.array_equal(comm.sign_allreduce(xs[r], op="sum"), expected_sign_sum(xs))
        qs = [np.random.default_rng([j, n]).integers(-31, 32, n).astype(np.int8)
              for j in range(p)]
        want: Array = np.sum(qs, axis=0, dtype=np.int32)
        assert np.array_equal(comm.quantized_allreduce(qs[r], 31), want)
        lo, hi = bitcoll.block(n, p, r)
        assert np.array_equal(comm.quantized_reduce_scatter(qs[r], 31), want[lo:hi])
    # Bytes between hosts: exactly the formula (payload + one header per message).
    n = 60_001
    x = vote_input(7, r, n, "float32")
    q = np.random.default_rng([r, 3]).integers(-31, 32, n).astype(np.int8)
    widest = max(len(m) for m in HostPlan(hosts, n).members)
    runs: dict[str, tuple[Callable[[], Any], Callable[[], Any], int]] = {
        "majority": (lambda: comm.sign_allreduce(x, algorithm="hierarchical"),
                     lambda: comm.sign_allreduce(x, algorithm="direct"),
                     make_codec("majority", "sign", 1, p).count_field(widest)[0]),
        "sum": (lambda: comm.quantized_allreduce(q, 31, algorithm="hierarchical"),
                lambda: comm.quantized_allreduce(q, 31, algorithm="direct"),
                max(field_width(31), field_width(31 * p),
                    make_codec("sum", "int", 31, p).count_field(widest)[0]))}
    for kind, (two_level, direct, width) in runs.items():
        sent, msgs, local = _remote_sent(comm, two_level)
        assert comm.packed_segment_bytes is not None  # set by the caller: a fixed pipeline
        seg = segment_elements(comm.packed_segment_bytes, width)
        payload, count = _between_hosts_bytes(hosts, r, n, kind, 31, seg)
        # Between hosts the frames are TCP's: header and checksum (its frame_overhead).
        overhead = getattr(getattr(comm.transport, "tcp", comm.transport), "frame_overhead",
                           HEADER_SIZE)
        assert (sent, msgs) == (payload + overhead * count, count), (kind, sent, msgs)
        assert local > 0
        out[kind] = (sent, _remote_sent(comm, direct)[0])
    # Dense: the same bits on every rank.
    y = float_input(8, r, 50_001, "float32")
    got = comm.allreduce(y)
    everyone = comm.allgather(got.view(np.uint8))
    assert np.array_equal(everyone, np.tile(got.view(np.uint8), p))
    ref = np.sum([float_input(8, j, 50_001, "float32").astype(np.float64) for j in range(p)],
                 axis=0)
    assert np.allclose(got, ref, rtol=1e-5, atol=1e-3)
    return out


@pytest.mark.timeout(300)
def test_tcp_uneven_hosts() -> None:
    """5 processes on 2 emulated hosts (GROUP_RANK) over TCP with shared memory inside each
    host: exact results, the between-host byte counters against the formula, and fewer bytes
    between hosts than the flat direct exchange."""
    env = {r: {"GROUP_RANK": str(h)} for r, h in enumerate(TCP_HOSTS)}
    res = run_world(len(TCP_HOSTS), _tcp_world, timeout=280, rank_env=env, shm=True,
                    packed_segment_bytes=4096)
    for rank, got in enumerate(res):
        for kind, (two_level, flat) in got.items():
            assert two_level < flat, (rank, kind, two_level, flat)


def _single_rank_host(comm: Communicator) -> list[int]:
    p, r = comm.size, comm.rank
    comm.barrier()
    xs = [vote_input(9, j, 1001, "float32") for j in range(p)]
    call = comm.majority_calls
    assert np.array_equal(comm.sign_allreduce(xs[r]), expected_majority(xs, "alternate", call))
    got = comm.allreduce(np.full(40_000, r + 1.0, np.float32))
    assert (got == p * (p + 1) / 2).all()
    return [comm.local_size, comm.stats_local.snapshot()["bytes_sent"]]


@pytest.mark.timeout(200)
def test_tcp_host_with_one_rank_beside_shared_memory() -> None:
    """Hosts 0, 0, 1 over TCP with shared memory on: the lone rank of host 1 maps no segment
    but must start its communicator in step with the others (a regression: it kept the
    set-up communicator, two collectives ahead, and the first call was a ProtocolError)."""
    env = {r: {"GROUP_RANK": str(h)} for r, h in enumerate((0, 0, 1))}
    res = run_world(3, _single_rank_host, timeout=180, rank_env=env, shm=True)
    assert [local_size for local_size, _ in res] == [2, 2, 1]
    assert res[0][1] > 0 and res[2][1] == 0


def _streamed_between_hosts(comm: Communicator) -> tuple[str, int]:
    """A two-level dense all-reduce (sum, avg) whose ring between hosts streams over TCP;
    returns the transport's class name and the TCP streams it ran."""
    inner = getattr(comm.transport, "_tcp")  # noqa: B009  (the hybrid's TCP side)
    streamed = [0]
    run = inner.stream

    def counting(*args: Any) -> bool:
        done: bool = run(*args)
        streamed[0] += done
        return done

    setattr(inner, "stream", counting)  # noqa: B010
    p, r = comm.size, comm.rank
    xs = [float_input(9, j, 300_001, "float32") for j in range(p)]
    got = comm.allreduce(xs[r])
    everyone = comm.allgather(got.view(np.uint8))
    assert np.array_equal(everyone, np.tile(got.view(np.uint8), p))
    assert np.allclose(got, np.sum([x.astype(np.float64) for x in xs], axis=0), rtol=1e-5,
                       atol=1e-3)
    ints = [np.random.default_rng([j, 9]).integers(-1000, 1000, 300_001).astype(np.int32)
            for j in range(p)]
    assert np.array_equal(comm.allreduce(ints[r], op="max"), np.max(ints, axis=0))
    avg = comm.allreduce(np.full(300_001, r, np.float64), op="avg")
    assert np.array_equal(avg, np.full(300_001, sum(range(p)) / p))
    return type(comm.transport).__name__, streamed[0]


@pytest.mark.timeout(200)
def test_tcp_ring_between_hosts_streams() -> None:
    """Hosts of two ranks each with shared memory on: the cross-host rings of the two-level
    all-reduce run as TCP streams (from a sub-group of the call), with the same bits on every
    rank and avg divided once by the world size."""
    env = {r: {"GROUP_RANK": str(h)} for r, h in enumerate((0, 0, 1, 1))}
    res = run_world(4, _streamed_between_hosts, timeout=180, rank_env=env, shm=True)
    assert all(name == "HybridTransport" and streamed == 3 for name, streamed in res), res
