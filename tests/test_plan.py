"""The planner (:mod:`bitcoll.plan`): algorithm choice by the cost model, without ranks, and
the model's configuration (file, variables, rank 0's model on every rank)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from errcheck import raises_usage
from inproc import run_threads
from multiproc import run_world

import bitcoll
from bitcoll.plan import (
    DEFAULT_MODEL,
    DEFAULT_SEGMENT,
    REGISTRY,
    SEGMENT_CHOICES,
    Call,
    CostModel,
    Group,
    candidates,
    choose,
    group_of,
    load_model,
    pack_rate_of,
    predict,
    segment_for,
)

GBIT = 1.25e8  # bytes per second of a 1 Gbit link
ONE_GBIT = DEFAULT_MODEL.replace(remote_bandwidth=GBIT * 0.96)


def test_two_hosts_large_majority_takes_the_pipelined_direct_exchange() -> None:
    """The regression the planner fixes: with 2 ranks the all-gather and the direct exchange
    send the same bytes, but only the direct exchange overlaps packing with the wire, so
    a large majority vote takes it; a small one keeps the one-round all-gather."""
    group = Group(2, hosts=2)
    for model in (DEFAULT_MODEL, ONE_GBIT):
        big = Call(count=64 << 20)
        assert choose("packed", model, group, big) == "direct"
        assert predict("packed", "direct", model, group, big) < \
            predict("packed", "allgather", model, group, big)
        assert choose("packed", model, group, Call(count=1024)) == "allgather"


def test_direct_time_is_near_the_wire_bound_when_the_link_is_slow() -> None:
    """Over a 1 Gbit link the predicted direct exchange of 64M votes is the wire time plus
    less than 10% (packing is hidden behind the wire but the first segment), the
    all-gather's is not."""
    group = Group(2, hosts=2)
    n = 64 << 20
    wire = n / 8 / ONE_GBIT.remote_bandwidth  # each rank sends half the votes, gets half
    direct = predict("packed", "direct", ONE_GBIT, group, Call(count=n))
    allgather = predict("packed", "allgather", ONE_GBIT, group, Call(count=n))
    assert wire < direct < 1.1 * wire
    assert allgather > 1.1 * wire


def test_the_segment_follows_the_bottleneck() -> None:
    """The pipeline's segment is the planner's: small where the link is the bottleneck (the
    pipeline fills and drains sooner), larger where the CPU is (fewer stages); one segment
    per block of one host's ranks; a call that names its segment keeps it; algorithms that
    do not pipeline get the default."""
    n = 64 << 20
    call = Call(count=n)
    two_hosts = Group(2, hosts=2)
    slow = segment_for("packed", "direct", ONE_GBIT, two_hosts, call)
    fast = segment_for("packed", "direct", DEFAULT_MODEL, two_hosts, call)
    assert slow in SEGMENT_CHOICES and fast in SEGMENT_CHOICES
    assert slow <= 256 << 10 < 1 << 20 <= fast
    # the choice is the cheapest prediction among the choices, and predict() uses it
    costs = {seg: predict("packed", "direct", ONE_GBIT, two_hosts,
                          Call(count=n, segment_bytes=seg)) for seg in SEGMENT_CHOICES}
    assert costs[slow] == min(costs.values())
    assert predict("packed", "direct", ONE_GBIT, two_hosts, call) == costs[slow]
    # one host with more ranks than cores: the whole block (2 MiB of signs) in one segment
    crowded = group_of(4, None, DEFAULT_MODEL.replace(host_cores=2.0))
    assert segment_for("packed", "direct", DEFAULT_MODEL, crowded, call) >= 2 << 20
    assert segment_for("packed", "direct", ONE_GBIT, two_hosts,
                       Call(count=n, segment_bytes=12345)) == 12345
    assert segment_for("packed", "allgather", ONE_GBIT, two_hosts, call) == DEFAULT_SEGMENT
    with raises_usage("name"):
        segment_for("packed", "bogus", ONE_GBIT, two_hosts, call)


def test_communicators_run_the_planners_segment() -> None:
    """A communicator without a packed segment of its own runs the planner's (its frames show
    it); one set on the communicator wins; None gives the choice back to the planner."""
    n = 3 << 20  # 2 ranks: blocks of 1.5M votes, 192 KiB of signs each

    def body(comm: bitcoll.Communicator) -> list[int]:
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        sent = []
        for model, seg in ((DEFAULT_MODEL.replace(segment_cpu=1.0), None),
                           (DEFAULT_MODEL.replace(local_bandwidth=1e6), None),
                           (DEFAULT_MODEL.replace(local_bandwidth=1e6), 64 << 10)):
            comm.cost_model = model
            comm.packed_segment_bytes = seg
            comm.stats.reset()
            comm.sign_allreduce(x, algorithm="direct")
            sent.append(comm.stats.snapshot()["messages_sent"])
        return sent

    for sent in run_threads(2, body):
        # costly stages: one segment per block (a frame per phase); a slow link: the
        # smallest segments (2 of 128 KiB per block); 64 KiB set on the communicator: 3
        assert sent == [2, 4, 6], sent


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 64, 1024])
def test_choices_are_registered_eligible_and_deterministic(p: int) -> None:
    for hosts in sorted({1, max(1, p // 2), p}):
        for two_level, streams in ((False, False), (True, False), (True, True)):
            group = group_of(p, tuple(r % hosts for r in range(p)), DEFAULT_MODEL, two_level,
                             streams)
            for count in (0, 1, 7, 8, 9, 1001, 1 << 20, (1 << 26) + 1):
                for collective, call in (("packed", Call(count=count)),
                                         ("packed", Call(count=count, w_in=5, w_out=9)),
                                         ("packed", Call(count=count, gather=False)),
                                         ("allreduce", Call(nbytes=4 * count)),
                                         ("allgather", Call(nbytes=4 * count))):
                    name = choose(collective, DEFAULT_MODEL, group, call)
                    names = [a.name for a in candidates(collective, group, call)]
                    assert name in names
                    assert name == choose(collective, DEFAULT_MODEL, group, call)
                    if name == "hierarchical":
                        assert group.layered
                    best = min(predict(collective, other, DEFAULT_MODEL, group, call)
                               for other in names)  # near ties go to the first registered
                    assert predict(collective, name, DEFAULT_MODEL, group, call) == \
                        pytest.approx(best, rel=1e-9)


def test_slow_links_make_the_two_level_algorithms_the_default() -> None:
    """4 hosts of 2 ranks over 1 Gbit: the two-level algorithms move fewer bytes over the
    hosts' links (the ranks of a host share one), so they are chosen for large vectors;
    with ``two_level`` off they are never chosen."""
    on = group_of(8, (0, 0, 1, 1, 2, 2, 3, 3), ONE_GBIT, True)
    off = group_of(8, (0, 0, 1, 1, 2, 2, 3, 3), ONE_GBIT, False)
    assert choose("allreduce", ONE_GBIT, on, Call(nbytes=64 << 20)) == "hierarchical"
    assert choose("packed", ONE_GBIT, on, Call(count=64 << 20)) == "hierarchical"
    assert choose("allreduce", ONE_GBIT, off, Call(nbytes=64 << 20)) == "ring"
    assert choose("packed", ONE_GBIT, off, Call(count=64 << 20)) == "direct"


def test_latency_bound_dense_all_reduce_takes_recursive_doubling() -> None:
    for p in (2, 3, 4, 5):
        group = group_of(p, None, DEFAULT_MODEL)
        assert choose("allreduce", DEFAULT_MODEL, group, Call(nbytes=8)) == \
            "recursive_doubling"
        assert choose("allreduce", DEFAULT_MODEL, group, Call(nbytes=256 << 20)) == "ring"


def test_the_dense_all_gather_takes_bruck_unless_the_ring_streams() -> None:
    """Bruck's ceil(log2 p) rounds send the ring's bytes in fewer messages: where the ring
    also goes frame by frame, the default on one host at every size (its frames straight
    into the output, measured as fast as the ring's or faster), and on hosts of several
    ranks for small outputs (for large ones the ring crosses each host's link once). Where
    the ring's passes stream, Bruck is not a candidate."""
    for p in (2, 3, 4, 5, 8):
        group = group_of(p, None, DEFAULT_MODEL)
        for nbytes in (0, 8, 1 << 20, 256 << 20):
            assert choose("allgather", DEFAULT_MODEL, group, Call(nbytes=nbytes)) == "bruck"
        for hosts in (None, tuple(range(p))):
            streaming = group_of(p, hosts, DEFAULT_MODEL, streams=True)
            assert [a.name for a in candidates("allgather", streaming, Call(nbytes=8))] == \
                ["ring"]
    shared = group_of(8, (0, 0, 0, 0, 1, 1, 1, 1), ONE_GBIT)
    assert choose("allgather", ONE_GBIT, shared, Call(nbytes=8 << 10)) == "bruck"
    assert choose("allgather", ONE_GBIT, shared, Call(nbytes=64 << 20)) == "ring"
    assert predict("allgather", "bruck", DEFAULT_MODEL, group_of(5, None, DEFAULT_MODEL),
                   Call(nbytes=8)) < predict("allgather", "ring", DEFAULT_MODEL,
                                              group_of(5, None, DEFAULT_MODEL), Call(nbytes=8))


def test_a_ring_crosses_hosts_on_one_rank_per_host() -> None:
    """A ring over hosts of one rank each moves every rank's bytes across hosts (its time at
    10 Gbit on half a core is the CPU's); over hosts of 4 ranks sharing a core, one rank per
    host moves them across and three through shared memory, so the ring is cheaper than
    charging each rank the remote CPU on its quarter of a core, and it wins the large
    all-gathers there, as measured (2x4 at 10 Gbit: 16 MiB per rank, ring 227 ms, Bruck
    320 ms)."""
    ten = DEFAULT_MODEL.replace(remote_bandwidth=1.2e9, host_cores=1.0)
    alone = group_of(4, (0, 1, 2, 3), ten.replace(host_cores=0.5))
    n = 256 << 20
    sent = 3 / 4 * n
    cpu = 2 * sent * ten.remote_cpu / alone.cores_per_rank
    assert cpu > sent / ten.remote_bandwidth  # paced by the CPU, as before
    assert predict("allgather", "ring", ten, alone, Call(nbytes=n)) == pytest.approx(
        ten.call_cpu + 3 * (ten.remote_latency + ten.switch_wait(alone) + ten.message_cpu)
        + cpu)
    layered = group_of(8, (0, 0, 0, 0, 1, 1, 1, 1), ten)
    sent = 7 / 8 * n
    every_rank = 2 * sent * ten.remote_cpu / layered.cores_per_rank
    ring = predict("allgather", "ring", ten, layered, Call(nbytes=n))
    assert ring < every_rank
    assert choose("allgather", ten, layered, Call(nbytes=8 * (16 << 20))) == "ring"
    assert choose("allgather", ten, layered, Call(nbytes=8 * (4 << 10))) == "bruck"


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_communicators_gather_in_brucks_rounds_by_default(p: int) -> None:
    """On one host the default all-gather sends ceil(log2 p) rounds of one or two frames each
    (two where a non-power-of-two round's blocks wrap past the last rank), the forced ring
    p - 1 frames; both give every rank's block in rank order."""

    def body(comm: bitcoll.Communicator) -> tuple[int, int]:
        x = np.arange(5, dtype=np.int32) + 10 * comm.rank
        want = np.concatenate([np.arange(5, dtype=np.int32) + 10 * r for r in range(p)])
        sent = []
        for algo in (None, "ring"):
            comm.stats.reset()
            np.testing.assert_array_equal(comm.allgather(x, algorithm=algo), want)
            sent.append(comm.stats.snapshot()["messages_sent"])
        return sent[0], sent[1]

    rounds = (p - 1).bit_length()
    for r, (default, ring) in enumerate(run_threads(p, body)):
        assert ring == p - 1
        if p & (p - 1) == 0:
            assert default == rounds
        else:  # round k sends ranks r .. r + min(2^k, p - 2^k) - 1, two frames if it wraps
            assert default == sum(1 + (r + min(1 << k, p - (1 << k)) > p)
                                  for k in range(rounds))


def test_a_wait_queues_behind_every_rank_that_shares_the_core() -> None:
    """switch_wait: nothing with a core per rank, one switch_latency up to half a core, then
    one per other rank on the core; on 2 hosts of 4 ranks with a core each (a quarter per
    rank) a 64K-element majority takes the all-gather's 3 rounds, as measured on the testbed
    (the two-level algorithm's 4 phases of waits took 1.7-2.2x its time)."""
    m = DEFAULT_MODEL
    s = m.switch_latency
    assert m.switch_wait(None) == 0.0
    assert m.switch_wait(Group(4, 1, 4, 1.0)) == 0.0
    assert m.switch_wait(Group(3, 1, 3, 2 / 3)) == s
    assert m.switch_wait(Group(4, 1, 4, 0.5)) == s
    assert m.switch_wait(Group(8, 2, 4, 0.25)) == pytest.approx(3 * s)
    assert m.link(True, Group(8, 2, 4, 0.25))[0] == pytest.approx(m.remote_latency + 3 * s)
    one_gbit = m.replace(remote_bandwidth=1.2e8)
    two_by_four = Group(8, 2, 4, 0.25)
    assert choose("packed", one_gbit, two_by_four, Call(count=64 << 10)) == "allgather"
    assert choose("packed", one_gbit, two_by_four, Call(count=64 << 20)) == "hierarchical"


def test_packing_runs_at_the_cached_rate_up_to_1_mib_and_the_streamed_rate_from_64() -> None:
    """pack_rate_of: ``pack_rate_cached`` for inputs of up to 1 MiB of float32, ``pack_rate``
    from 64 MiB, geometric in between (8 MiB: the geometric mean), never rising with size;
    the all-gather's prediction of 256K elements charges the cached rate."""
    m = DEFAULT_MODEL.replace(pack_rate=2e9, pack_rate_cached=1.8e10)
    assert pack_rate_of(m, 0) == pack_rate_of(m, 256 << 10) == 1.8e10
    assert pack_rate_of(m, 16 << 20) == pack_rate_of(m, 1 << 30) == 2e9
    assert pack_rate_of(m, 2 << 20) == pytest.approx((2e9 * 1.8e10) ** 0.5)
    rates = [pack_rate_of(m, n) for n in range(200 << 10, 20 << 20, 100 << 10)]
    assert rates == sorted(rates, reverse=True)
    slow = m.replace(pack_rate_cached=2e9)
    call, group = Call(count=256 << 10), Group(2, hosts=2)
    saved = predict("packed", "allgather", slow, group, call) - \
        predict("packed", "allgather", m, group, call)
    assert saved == pytest.approx((256 << 10) * (1 / 2e9 - 1 / 1.8e10))


def test_a_link_faster_than_the_cores_is_paced_by_remote_cpu() -> None:
    """A transfer across hosts takes the longer of its wire time and its bytes' CPU
    (``remote_cpu`` per byte sent or received, on the rank's share of a core): a 256 MiB
    dense ring on 2 hosts of a 100 Gbit link is the CPU's; at 1 Gbit the wire's; on one
    host remote_cpu plays no part."""
    n = 256 << 20
    call, group = Call(nbytes=n), Group(2, hosts=2)
    fast = DEFAULT_MODEL.replace(remote_bandwidth=1.25e10, remote_cpu=4e-10)
    moved = 2 * n  # half the vector each way in each of the two phases, sent and received
    assert predict("allreduce", "ring", fast, group, call) > moved * 4e-10
    free = fast.replace(remote_cpu=1e-15)
    assert predict("allreduce", "ring", free, group, call) < 0.5 * moved * 4e-10
    half_core = Group(2, hosts=2, cores_per_rank=0.5)
    assert predict("allreduce", "ring", fast, half_core, call) > 2 * moved * 4e-10
    slow = fast.replace(remote_bandwidth=1.25e8)
    assert predict("allreduce", "ring", slow, group, call) == \
        pytest.approx(predict("allreduce", "ring", slow.replace(remote_cpu=1e-15), group, call))
    one_host = Group(2, hosts=1)
    assert predict("allreduce", "ring", fast, one_host, call) == \
        predict("allreduce", "ring", free, one_host, call)


def test_group_of_counts_hosts_ranks_and_cores() -> None:
    model = DEFAULT_MODEL.replace(host_cores=2)
    g = group_of(5, (0, 0, 1, 0, 1), model)
    assert (g.size, g.hosts, g.per_host, g.cores_per_rank) == (5, 2, 3, 2 / 3)
    assert g.layered
    assert group_of(5, None, model).hosts == 1
    assert group_of(2, (0, 1), model).cores_per_rank == 1.0
    assert not group_of(4, (0, 1, 2, 3), model).layered  # one rank per host
    assert not group_of(4, (0, 0, 1, 1), model, two_level=False).layered


def test_every_registered_formula_is_finite_and_grows_with_size() -> None:
    group = group_of(6, (0, 0, 0, 1, 1, 1), DEFAULT_MODEL)
    for algo in REGISTRY:
        times = [algo.cost(DEFAULT_MODEL, group, Call(nbytes=n, count=n))
                 for n in (0, 1 << 10, 1 << 20, 1 << 26)]
        assert all(np.isfinite(t) and t > 0 for t in times), algo
        assert times == sorted(times), algo


def test_model_round_trips_and_refuses_bad_fields() -> None:
    model = DEFAULT_MODEL.replace(remote_bandwidth=1e8, host_cores=3)
    assert CostModel.from_array(model.as_array()) == model
    with raises_usage("speed"):
        CostModel.from_mapping({"speed": 1.0})
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1e9"):
        with raises_usage("pack_rate"):
            DEFAULT_MODEL.replace(pack_rate=bad)  # type: ignore[arg-type]
    with raises_usage("name"):
        predict("packed", "telepathy", DEFAULT_MODEL, Group(2), Call(count=8))


def test_load_model_reads_the_file_then_the_variables(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    env = {"BITCOLL_COST_MODEL": str(path)}
    assert load_model(env) == DEFAULT_MODEL  # no file yet
    path.write_text(json.dumps({"_about": "x", "remote_bandwidth": 1.25e8, "pack_rate": 1e9}))
    model = load_model(env)
    assert (model.remote_bandwidth, model.pack_rate) == (1.25e8, 1e9)
    env["BITCOLL_COST_PACK_RATE"] = "2e9"
    assert load_model(env).pack_rate == 2e9
    env["BITCOLL_COST_PACK_RATE"] = "fast"
    with raises_usage("BITCOLL_COST_PACK_RATE"):
        load_model(env)
    del env["BITCOLL_COST_PACK_RATE"]
    for text, argument in (("[1, 2]", "BITCOLL_COST_MODEL"), ("{not json", "BITCOLL_COST_MODEL"),
                           (json.dumps({"latency": 1}), "latency")):
        path.write_text(text)
        with raises_usage(argument):
            load_model(env)


def test_communicators_choose_what_the_planner_chooses() -> None:
    """A communicator's defaults are the planner's choices for its model and group, and a
    model set on it (every rank the same) changes them; a wrong type is refused."""

    def body(comm: bitcoll.Communicator) -> tuple[str, str, int, int]:
        group = comm.plan_group
        # the direct exchange's size under the default model (4 ranks on this host: where
        # ranks share cores, the crossover moves up)
        n = next((k for k in (1 << 22, 1 << 23, 1 << 24)
                  if choose("packed", comm.cost_model, group, Call(count=k)) == "direct"),
                 1 << 22)
        before = choose("packed", comm.cost_model, group, Call(count=n))
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        comm.stats.reset()
        comm.sign_allreduce(x)
        default = comm.stats.snapshot()["messages_sent"]
        comm.stats.reset()
        comm.sign_allreduce(x, algorithm=before)
        assert comm.stats.snapshot()["messages_sent"] == default
        # a model under which every message costs more than any bytes
        comm.cost_model = DEFAULT_MODEL.replace(message_cpu=1.0)
        after = choose("packed", comm.cost_model, comm.plan_group, Call(count=n))
        comm.stats.reset()
        comm.sign_allreduce(x)
        with raises_usage("cost_model"):
            comm.cost_model = {"pack_rate": 1.0}  # type: ignore[assignment]
        return before, after, default, comm.stats.snapshot()["messages_sent"]

    for before, after, default, later in run_threads(4, body):
        assert (before, after) == ("direct", "allgather")
        assert later < default  # the all-gather's fewer messages


def _gather_plan(comm: bitcoll.Communicator) -> tuple[bool, str, int]:
    """(the group's streams, the default all-gather of 8 bytes a rank, the messages that
    all-gather sent), after checking its result; rank 1's transport cannot stream (it makes
    the same frames one by one), which must not change anyone's plan."""
    if comm.rank == 1:
        tcp = getattr(comm.transport, "_tcp", comm.transport)  # under shared memory's
        setattr(tcp, "streams", False)  # noqa: B010  (this rank only)
        comm.cost_model = comm.cost_model  # plan again
    x = np.full(2, comm.rank, np.float32)
    comm.stats.reset()
    got = comm.allgather(x)
    np.testing.assert_array_equal(got, np.repeat(np.arange(comm.size, dtype=np.float32), 2))
    sent = comm.stats.snapshot()["messages_sent"]
    g = comm.plan_group
    return g.streams, choose("allgather", comm.cost_model, g, Call(nbytes=8 * comm.size)), sent


@pytest.mark.parametrize("hosts, shm, streams", [
    ((0, 0, 0, 0), True, False),   # one host, shared memory: frame by frame
    ((0, 0, 0, 0), False, True),   # one host over TCP: the ring streams
    ((0, 0, 1), True, False),      # the rank alone on host 1 agrees with the others
    ((0, 1, 2), True, True),       # every rank alone on its host: TCP streams
])
def test_every_rank_sees_the_same_streaming_ring(hosts: tuple[int, ...], shm: bool,
                                                 streams: bool) -> None:
    """plan_group's ``streams`` comes from the topology and the job's agreed settings, so
    every rank plans the same all-gather, also the rank that is alone on its host (it has no
    shared memory of its own): Bruck's rounds where the ring goes frame by frame, the ring
    where it streams."""
    env = {r: {"GROUP_RANK": str(h)} for r, h in enumerate(hosts)}
    results = run_world(len(hosts), _gather_plan, timeout=120, rank_env=env, shm=shm)
    want = "ring" if streams else "bruck"
    p = len(hosts)
    assert [(s, a) for s, a, _ in results] == [(streams, want)] * p
    assert all(sent == (p - 1 if streams else (p - 1).bit_length()) for _, _, sent in results)


def test_init_gives_every_rank_rank_0s_model(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BITCOLL_COST_REMOTE_LATENCY", "0.001")
    monkeypatch.setenv("BITCOLL_COST_HOST_CORES", "3")
    with bitcoll.init("local") as comm:
        assert comm.cost_model.remote_latency == 0.001
        assert comm.cost_model.host_cores == 3
    monkeypatch.setenv("BITCOLL_COST_REMOTE_LATENCY", "-1")
    with raises_usage("remote_latency"):
        bitcoll.init("local")


def _model_fields(comm: bitcoll.Communicator) -> tuple[float, float]:
    return comm.cost_model.remote_latency, comm.cost_model.host_cores


@pytest.mark.timeout(120)
def test_tcp_ranks_take_rank_0s_model() -> None:
    """3 TCP ranks whose environments set different models: every rank plans with rank 0's
    (its variables, its host's cores), so their automatic choices agree."""
    env = {r: {"BITCOLL_COST_REMOTE_LATENCY": str(0.001 * (r + 1)),
               "BITCOLL_COST_HOST_CORES": str(r + 1)} for r in range(3)}
    assert run_world(3, _model_fields, timeout=100, rank_env=env) == [(0.001, 1.0)] * 3


def _probe_links(comm: bitcoll.Communicator) -> dict[str, float]:
    from bitcoll.probe import link_rates

    return link_rates(comm, repeats=2, nbytes=1 << 16)


def _probe_links_timed(comm: bitcoll.Communicator, call_cpu: float, kind: str
                       ) -> dict[str, float]:
    """link_rates with exchanges that take 100 us at 8 B and 100 us + 1 ms at 1 MiB, and
    50 us and 50 us + 0.5 ms of CPU; ``kind`` "remote": the two ranks on two hosts."""
    from bitcoll import probe
    from bitcoll.topology import Topology

    if kind == "remote":
        comm._topology = Topology((0, 1), comm.rank)

    def exchange(sub: object, nbytes: int, repeats: int) -> tuple[float, float]:
        return 100e-6 + (1e-3 if nbytes > 8 else 0.0), 50e-6 + (5e-4 if nbytes > 8 else 0.0)

    probe._exchange_time = exchange  # type: ignore[assignment]  # this rank's process only
    probe._small_exchange_time = lambda sub, repeats: exchange(sub, 8, repeats)  # type: ignore[assignment]
    comm.cost_model = comm.cost_model.replace(call_cpu=call_cpu, message_cpu=10e-6)
    return probe.link_rates(comm, repeats=1, nbytes=1 << 20)


@pytest.mark.parametrize("kind", ["local", "remote"])
@pytest.mark.parametrize("call_cpu, latency", [(30e-6, 50e-6), (1.0, 25e-6)])
def test_the_probes_latency_leaves_out_what_the_model_charges_elsewhere(
        call_cpu: float, latency: float, kind: str) -> None:
    """The latency is the 8-byte exchange's time less the model's ``call_cpu`` and two
    ``message_cpu`` (so the model predicts the exchange as measured), never below a quarter
    of it; the bandwidth is the bytes over the difference of the two exchanges; across hosts
    ``remote_cpu`` is the difference of their CPU times per byte sent and received."""
    first, second = run_world(2, _probe_links_timed, call_cpu, kind, timeout=120)
    assert first == second
    expected = {f"{kind}_latency": pytest.approx(latency),
                f"{kind}_bandwidth": pytest.approx((1 << 20) / 1e-3)}
    if kind == "remote":
        expected["remote_cpu"] = pytest.approx(5e-4 / (2 << 20))
    assert first == expected


def test_the_probe_keeps_its_least_disturbed_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """``probe._loop`` runs its loop three times and keeps the fastest, with that loop's CPU
    time: a first loop disturbed (200 us a call on a clock the test drives) does not become
    the model's latency."""
    import types

    from bitcoll import probe

    clock = {"wall": 0.0, "cpu": 0.0}
    costs = [200e-6] * 11 + [40e-6] * 10 + [30e-6] * 10  # the warm-up call, then 3 loops

    def call() -> None:
        took = costs.pop(0)
        clock["wall"] += took
        clock["cpu"] += took / 2

    monkeypatch.setattr(probe, "time", types.SimpleNamespace(
        perf_counter=lambda: clock["wall"], process_time=lambda: clock["cpu"]))
    assert probe._loop(call, 10) == pytest.approx((30e-6, 15e-6))
    assert not costs


def test_the_probe_measures_the_link_between_two_ranks() -> None:
    """``bitcoll.probe.link_rates`` on 2 ranks of one host: both ranks get rank 0's local
    latency and bandwidth (positive, finite), no remote figures (one host), and a model built
    from them is valid."""
    first, second = run_world(2, _probe_links, timeout=120)
    assert first == second
    assert set(first) == {"local_latency", "local_bandwidth"}
    assert all(0 < v < float("inf") for v in first.values())
    assert DEFAULT_MODEL.replace(**first).local_latency == first["local_latency"]
