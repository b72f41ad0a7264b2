"""Collective sweeps shared by the TCP, MPI and in-process tests.

Every function takes a communicator, runs many collectives with inputs generated from seeds,
computes on every rank the expected result of every rank's input locally, and raises
AssertionError naming the first case that differs. The same functions run on every transport.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

import bitcoll
from bitcoll.communicator import Communicator
from bitcoll.kernels import reference

Array = npt.NDArray[Any]

LENGTHS = (0, 1, 7, 8, 9, 1000, 2**20 + 3)
DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64")
OPS = ("sum", "avg", "max", "min")
ALLREDUCE_ALGOS = ("ring", "recursive_doubling")
ALLGATHER_ALGOS = ("ring", "bruck")


def rank_input(seed: int, rank: int, n: int, dtype: str) -> Array:
    """Rank ``rank``'s input: small integers (exact in every dtype, sums exact in float)."""
    rng = np.random.default_rng([seed, rank, n])
    lo = 0 if dtype.startswith("u") else -3
    return rng.integers(lo, 4, n).astype(dtype)


def all_inputs(seed: int, size: int, n: int, dtype: str) -> list[Array]:
    return [rank_input(seed, j, n, dtype) for j in range(size)]


def expected_reduce(xs: list[Array], op: str) -> Array:
    stack = np.stack(xs) if xs[0].size else np.zeros((len(xs), 0), xs[0].dtype)
    dt = xs[0].dtype
    result: Array
    if op == "sum":
        result = np.sum(stack, axis=0, dtype=dt)
    elif op == "avg":
        result = np.divide(np.sum(stack, axis=0, dtype=dt), np.asarray(len(xs), dtype=dt))
    elif op == "max":
        result = np.max(stack, axis=0, initial=np.iinfo(dt).min if dt.kind in "iu" else -np.inf)
    else:
        result = np.min(stack, axis=0, initial=np.iinfo(dt).max if dt.kind in "iu" else np.inf)
    return result


def _eq(got: Array, want: Array, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        bad: Any = np.flatnonzero(got != want)[:5] if got.shape == want.shape else []
        raise AssertionError(f"{what}: got {got.dtype}{got.shape}, want {want.dtype}"
                             f"{want.shape}; first differences at {list(bad)}")


def dense_sweep(comm: Communicator, seed: int = 0, lengths: tuple[int, ...] = LENGTHS,
                dtypes: tuple[str, ...] = DTYPES, algorithms: tuple[str, ...] = ALLREDUCE_ALGOS,
                large_dtypes: tuple[str, ...] = ("float32", "int8")) -> int:
    """All dense collectives over lengths x dtypes x ops x algorithms. Returns #checks."""
    p, r = comm.size, comm.rank
    checks = 0
    for n in lengths:
        for dt in dtypes:
            if n > 10_000 and dt not in large_dtypes:
                continue
            xs = all_inputs(seed, p, n, dt)
            mine = xs[r]
            original = mine.copy()
            for op in OPS:
                if op == "avg" and dt[0] in "iu":
                    continue
                want = expected_reduce(xs, op)
                for algo in algorithms:
                    if algo == "recursive_doubling" and n > 10_000:
                        continue  # latency algorithm: small vectors only
                    got = comm.allreduce(mine, op=op, algorithm=algo)
                    _eq(got, want, f"allreduce n={n} {dt} {op} {algo} p={p}")
                    checks += 1
                lo, hi = bitcoll.block(n, p, r)
                _eq(comm.reduce_scatter(mine, op=op), want[lo:hi],
                    f"reduce_scatter n={n} {dt} {op} p={p}")
                checks += 1
            gathered = np.concatenate(xs)
            _eq(comm.allgather(mine), gathered, f"allgather n={n} {dt} p={p}")
            for algo in ALLGATHER_ALGOS:
                _eq(comm.allgather(mine, algorithm=algo), gathered,
                    f"allgather n={n} {dt} {algo} p={p}")
            root = (n + seed) % p
            buf = mine.copy()
            comm.broadcast(buf, root=root)
            _eq(buf, xs[root], f"broadcast n={n} {dt} root={root} p={p}")
            m = n - n % p
            got = comm.alltoall(mine[:m])
            blk = m // p
            want = np.concatenate([x[r * blk:(r + 1) * blk] for x in xs]) if m else mine[:0]
            _eq(got, want, f"alltoall n={m} {dt} p={p}")
            _eq(mine, original, f"input left untouched n={n} {dt} p={p}")
            checks += 4 + len(ALLGATHER_ALGOS)
    comm.barrier()
    return checks



FLOAT_DTYPES = ("float16", "float32", "float64")
FLOAT_LENGTHS = (1, 7, 9, 1000, 100_003)


def float_input(seed: int, rank: int, n: int, dtype: str) -> Array:
    """Rank ``rank``'s input: random floats of mixed signs over four orders of magnitude, so
    that the order of the additions changes the rounded sums (small integers cannot show it)."""
    rng = np.random.default_rng([seed, rank, n, 11])
    scale = 10.0 ** rng.integers(-2, 2, n)
    return (rng.standard_normal(n) * scale).astype(dtype)


def float_sweep(comm: Communicator, seed: int = 0, lengths: tuple[int, ...] = FLOAT_LENGTHS,
                dtypes: tuple[str, ...] = FLOAT_DTYPES,
                algorithms: tuple[str, ...] = ALLREDUCE_ALGOS) -> int:
    """Dense all-reduce / reduce-scatter of random floats. Every rank must get bitwise the
    same all-reduce result (compared through an all-gather of the raw bytes), max and min
    exactly the float64 reference, and sum / avg within the rounding bound of p additions in
    the dtype: ``|got - ref| <= (p + 1) * u * sum_j |x_j|`` (``u`` = unit roundoff, ``ref`` the
    float64 sum), plus one rounding of the division for avg. Returns #checks."""
    p, r = comm.size, comm.rank
    checks = 0
    for n in lengths:
        for dt in dtypes:
            if n > 10_000 and dt != "float32":
                continue
            xs = [float_input(seed, j, n, dt) for j in range(p)]
            wide = np.stack([x.astype(np.float64) for x in xs])
            u = float(np.finfo(dt).eps) / 2
            bound = (p + 1) * u * np.sum(np.abs(wide), axis=0)
            refs = {"sum": wide.sum(axis=0), "avg": wide.sum(axis=0) / p,
                    "max": wide.max(axis=0), "min": wide.min(axis=0)}
            lo, hi = bitcoll.block(n, p, r)
            for op in OPS:
                ref = refs[op]
                tol = bound / p + u * np.abs(ref) if op == "avg" else bound
                for algo in algorithms:
                    if algo == "recursive_doubling" and n > 10_000:
                        continue
                    what = f"float allreduce n={n} {dt} {op} {algo} p={p}"
                    got = comm.allreduce(xs[r], op=op, algorithm=algo)
                    _close(got, ref, tol, op, dt, what)
                    everyone = comm.allgather(got.view(np.uint8))
                    mine = np.tile(got.view(np.uint8), p)
                    _eq(everyone, mine, f"{what}: not bitwise identical on every rank")
                    checks += 2
                got = comm.reduce_scatter(xs[r], op=op)
                _close(got, ref[lo:hi], tol[lo:hi], op, dt,
                       f"float reduce_scatter n={n} {dt} {op} p={p}")
                checks += 1
    comm.barrier()
    return checks


def mixed_paths_sweep(comm: Communicator) -> tuple[int, int]:
    """Ring collectives with rank 1 making its frames one at a time and the others streaming
    theirs (the wire carries the same frames either way), on a transport that streams;
    returns the checks made and the streams this rank ran. Changes the communicator (its
    transport's stream settings, ``segment_bytes``): give it a communicator of its own."""
    t = comm.transport
    streamed = [0]
    if comm.rank == 1:
        setattr(t, "streams", False)  # noqa: B010  (this rank only)
    else:
        run = t.stream

        def counting(*args: Any) -> bool:
            done = run(*args)
            streamed[0] += done
            return done

        setattr(t, "stream", counting)  # noqa: B010
    n = dense_sweep(comm, lengths=(0, 1, 9, 100_003), dtypes=("float16", "float32", "int16"),
                    algorithms=("ring",), large_dtypes=("float32", "int16"))
    n += float_sweep(comm, lengths=(9, 100_003))
    if importlib.util.find_spec("torch") is not None:
        # bfloat16: reduce-scatter in float32, rounded once at the owner, all-gather of bf16.
        import torch

        p = comm.size
        xs = [torch.from_numpy(float_input(4, j, 100_003, "float32")).to(torch.bfloat16)
              for j in range(p)]
        got = comm.allreduce(xs[comm.rank], algorithm="ring")
        bits = got.view(torch.int16).numpy()
        assert np.array_equal(comm.allgather(bits), np.tile(bits, p))  # same bits everywhere
        ref = np.sum([x.double().numpy() for x in xs], axis=0)  # exact sum of the bf16 inputs
        assert np.allclose(got.double().numpy(), ref, rtol=2 ** -8, atol=1e-30)
        n += 1
    comm.segment_bytes = 40
    n += dense_sweep(comm, lengths=(9, 305), dtypes=("float32", "int16"), algorithms=("ring",))
    return n, streamed[0]


def _close(got: Array, ref: Array, tol: Array, op: str, dt: str, what: str) -> None:
    if got.dtype != np.dtype(dt) or got.shape != ref.shape:
        raise AssertionError(f"{what}: got {got.dtype}{got.shape}, want {dt}{ref.shape}")
    if op in ("max", "min"):
        _eq(got, ref.astype(dt), what)
        return
    err = np.abs(got.astype(np.float64) - ref)
    bad = np.flatnonzero(err > tol)
    if bad.size:
        i = int(bad[0])
        raise AssertionError(f"{what}: element {i} = {got[i]!r}, float64 reference "
                             f"{ref[i]!r}, error {err[i]:.3g} > bound {tol[i]:.3g} "
                             f"({bad.size} elements out of bound)")


def inplace_and_async(comm: Communicator, seed: int = 1) -> int:
    """out=x in place, shaped inputs, non-contiguous inputs, async Work handles."""
    p, r = comm.size, comm.rank
    xs = [rank_input(seed, j, 24, "float32").reshape(4, 6) for j in range(p)]
    want = expected_reduce([x.reshape(-1) for x in xs], "sum").reshape(4, 6)
    x = xs[r].copy()
    got = comm.allreduce(x, out=x)
    assert got is x
    _eq(x, want, "in-place allreduce")
    strided = np.repeat(xs[r], 2, axis=1)[:, ::2]
    _eq(comm.allreduce(strided), want, "non-contiguous allreduce")
    works = [comm.allreduce(xs[r], async_op=True) for _ in range(3)]
    works.append(comm.allgather(xs[r][0], async_op=True))
    for w in works[:3]:
        _eq(w.wait(timeout=60), want, "async allreduce")
    _eq(works[3].wait(), np.concatenate([x[0] for x in xs]), "async allgather")
    assert all(w.is_completed() for w in works)
    assert comm.barrier(async_op=True).wait() is None
    return 6


# ---------------------------------------------------------------------- packed-bit collectives
PACKED_LENGTHS = (0, 1, 7, 8, 9, 63, 64, 65, 1000, 100_003)
PACKED_ALGOS = ("direct", "ring", "allgather")
TIES = ("positive", "negative", "alternate")


def vote_input(seed: int, rank: int, n: int, dtype: str) -> Array:
    """Signs with many zeros (both +0.0 and -0.0) so that ties and zero votes occur."""
    rng = np.random.default_rng([seed, rank, n, 7])
    x = rng.integers(-2, 3, n).astype(dtype)
    x[rng.random(n) < 0.1] = -0.0
    return x


def expected_majority(xs: list[Array], tie: str, call: int) -> Array:
    n = xs[0].size
    votes = np.sum([np.where(x < 0, -1, 1) for x in xs], axis=0).reshape(n)
    result: Array = reference.majority_of_sums(votes, tie, call)
    return result


def expected_sign_sum(xs: list[Array]) -> Array:
    return np.sum([np.sign(x).astype(np.int32) for x in xs], axis=0,
                  dtype=np.int32).reshape(xs[0].size)


def packed_sweep(comm: Communicator, seed: int = 0,
                 lengths: tuple[int, ...] = PACKED_LENGTHS,
                 algorithms: tuple[str, ...] = PACKED_ALGOS) -> int:
    """sign_allreduce / sign_reduce_scatter (majority, every tie rule; sum; sign of the sum)
    and quantized_allreduce / quantized_reduce_scatter (sum; sign of the sum) against numpy
    references."""
    p, r = comm.size, comm.rank
    checks = 0
    for n in lengths:
        lo, hi = bitcoll.block(n, p, r)
        for dt in ("float32", "float16", "float64"):
            if n > 100 and dt != "float32":
                continue  # every float width on short vectors, float32 on all
            xs = [vote_input(seed, j, n, dt) for j in range(p)]
            ssum = expected_sign_sum(xs)
            for algo in algorithms:
                for tie in TIES if dt == "float32" else ("alternate",):
                    call = comm.majority_calls
                    want = expected_majority(xs, tie, call)
                    _eq(comm.sign_allreduce(xs[r], tie=tie, algorithm=algo), want,
                        f"sign_allreduce majority n={n} {dt} {algo} tie={tie} p={p}")
                    call = comm.majority_calls
                    want = expected_majority(xs, tie, call)[lo:hi]
                    _eq(comm.sign_reduce_scatter(xs[r], tie=tie, algorithm=algo), want,
                        f"sign_reduce_scatter majority n={n} {dt} {algo} tie={tie} p={p}")
                    checks += 2
                _eq(comm.sign_allreduce(xs[r], op="sum", algorithm=algo), ssum,
                    f"sign_allreduce sum n={n} {dt} {algo} p={p}")
                _eq(comm.sign_reduce_scatter(xs[r], op="sum", algorithm=algo), ssum[lo:hi],
                    f"sign_reduce_scatter sum n={n} {dt} {algo} p={p}")
                checks += 2
                if dt == "float32":
                    sign = np.sign(ssum).astype(np.int8)
                    _eq(comm.sign_allreduce(xs[r], op="sign", algorithm=algo), sign,
                        f"sign_allreduce sign n={n} {algo} p={p}")
                    _eq(comm.sign_reduce_scatter(xs[r], op="sign", algorithm=algo),
                        sign[lo:hi], f"sign_reduce_scatter sign n={n} {algo} p={p}")
                    checks += 2
        for levels in (1, 3, 15, 127):
            for qdt in ("int8", "int16", "int64"):
                if qdt != "int8" and (n > 1000 or levels != 3):
                    continue  # wide input dtypes once per length
                qs = [np.random.default_rng([seed, j, n, levels]).integers(
                    -levels, levels + 1, n).astype(qdt) for j in range(p)]
                want = np.sum(qs, axis=0, dtype=np.int32).reshape(n)
                for algo in algorithms:
                    _eq(comm.quantized_allreduce(qs[r], levels, algorithm=algo), want,
                        f"quantized_allreduce n={n} L={levels} {qdt} {algo} p={p}")
                    _eq(comm.quantized_reduce_scatter(qs[r], levels, algorithm=algo),
                        want[lo:hi], f"quantized_reduce_scatter n={n} L={levels} {algo}")
                    checks += 2
                    if qdt == "int8" and levels in (3, 127):
                        sign = np.sign(want).astype(np.int8)
                        _eq(comm.quantized_allreduce(qs[r], levels, op="sign", algorithm=algo),
                            sign, f"quantized_allreduce sign n={n} L={levels} {algo} p={p}")
                        _eq(comm.quantized_reduce_scatter(qs[r], levels, op="sign",
                                                          algorithm=algo),
                            sign[lo:hi], f"quantized_reduce_scatter sign n={n} L={levels} {algo}")
                        checks += 2
    return checks


def packed_bandwidth(comm: Communicator, n: int = 100_003, levels: int = 7,
                     packed: bool = False) -> dict[str, Any]:
    """Bytes each rank sends, checked exactly against the cost model (headers excluded).
    ``packed``: run the packed-input forms (packed_sign_allreduce, packed_quantized_allreduce)
    on the same votes and values, packed beforehand (the same model must hold)."""
    from bitcoll.algorithms.votes import field_width
    from bitcoll.transport.base import HEADER_SIZE

    p, r = comm.size, comm.rank
    x = vote_input(5, r, n, "float32")
    q = np.random.default_rng([r, 9]).integers(-levels, levels + 1, n).astype(np.int8)
    lens = [b - a for a, b in bitcoll.partition(n, p)]
    report: dict[str, Any] = {}
    # The bytes each frame adds to its payload (header; TCP: and its checksum or tag).
    overhead = getattr(comm.transport, "frame_overhead", HEADER_SIZE)
    if packed:
        bits = pack_bits_ref(x >= 0)
        fields = pack_fields_ref(q, field_width(levels), levels)
        comm = _PackedFront(comm, bits, fields, n)  # type: ignore[assignment]

    def payload(fn: Any) -> tuple[int, int]:
        comm.barrier()
        comm.stats.reset()
        fn()
        s = comm.stats.snapshot()
        comm.barrier()
        return s["bytes_sent"] - overhead * s["messages_sent"], s["messages_sent"]

    # majority, direct: every other block's bits once, then this block's result to p-1 peers
    sent, msgs = payload(lambda: comm.sign_allreduce(x, algorithm="direct"))
    exact = sum(-(-lens[j] // 8) for j in range(p) if j != r) + (p - 1) * -(-lens[r] // 8)
    bound = 2 * (p - 1) / p * n / 8 + 2 * (p - 1)
    assert sent == exact and sent <= bound, (sent, exact, bound)
    report["majority_direct"] = (sent, msgs)
    # majority, all-gather baseline: the whole packed vector to every peer (ring: p-1 hops)
    sent, msgs = payload(lambda: comm.sign_allreduce(x, algorithm="allgather"))
    assert sent == (p - 1) * -(-n // 8), (sent, (p - 1) * -(-n // 8))
    report["majority_allgather"] = (sent, msgs)
    # exact sums: w_in bits to each owner, w_out bits back
    w_in, w_out = field_width(levels), field_width(levels * p)
    sent, msgs = payload(lambda: comm.quantized_allreduce(q, levels, algorithm="direct"))
    exact = (sum(-(-lens[j] * w_in // 8) for j in range(p) if j != r)
             + (p - 1) * -(-lens[r] * w_out // 8))
    bound = (p - 1) / p * n * (w_in + w_out) / 8 + 2 * (p - 1)
    assert sent == exact and sent <= bound, (sent, exact, bound)
    report["quantized_direct"] = (sent, msgs)
    return report


# ---------------------------------------------------------------------- packed input and output
PACKED_IO_LENGTHS = (0, 1, 7, 8, 9, 63, 64, 65, 1000, 100_003)


def pack_bits_ref(bits: Array) -> Array:
    """numpy's packing of booleans, bit i = element i, little-endian within each byte."""
    return np.packbits(np.asarray(bits, dtype=bool).reshape(-1), bitorder="little")


def pack_fields_ref(values: Array, width: int, bias: int) -> Array:
    """``values + bias`` as ``width``-bit fields, element i at stream bits [i w, (i+1) w),
    least significant bit first (numpy only)."""
    f = values.astype(np.int64).reshape(-1) + bias
    assert f.size == 0 or (f.min() >= 0 and f.max() < (1 << width))
    bits = (f[:, None] >> np.arange(width)) & 1
    return np.packbits(bits.reshape(-1).astype(np.uint8), bitorder="little")


def set_padding(packed: Array, nbits: int) -> Array:
    """A copy of ``packed`` with every padding bit after stream bit ``nbits - 1`` set."""
    out = packed.copy()
    if nbits % 8:
        out[-1] |= np.uint8(0xFF & ~((1 << (nbits % 8)) - 1))
    return out


class _PackedFront:
    """Runs packed_bandwidth's calls through the packed forms on pre-packed inputs."""

    def __init__(self, comm: Communicator, bits: Array, fields: Array, n: int) -> None:
        self.comm, self.bits, self.fields, self.n = comm, bits, fields, n
        self.size, self.rank, self.stats = comm.size, comm.rank, comm.stats

    def barrier(self) -> None:
        self.comm.barrier()

    def sign_allreduce(self, x: Array, algorithm: str | None = None) -> Any:
        return self.comm.packed_sign_allreduce(self.bits, self.n, algorithm=algorithm)

    def quantized_allreduce(self, q: Array, levels: int, algorithm: str | None = None) -> Any:
        return self.comm.packed_quantized_allreduce(self.fields, self.n, levels,
                                                    algorithm=algorithm)


def packed_io_sweep(comm: Communicator, seed: int = 0,
                    lengths: tuple[int, ...] = PACKED_IO_LENGTHS,
                    algorithms: tuple[str, ...] = PACKED_ALGOS,
                    levels_list: tuple[int, ...] = (1, 3, 7, 127)) -> tuple[int, list[int]]:
    """The packed-input/-output collectives against the unpacked ones, bit for bit.

    Each packed result must equal the unpacked collective's result packed by numpy
    (``numpy.packbits(bitorder="little")``, a numpy field packer), padding bits zero, also
    with every padding bit of the input set and ``out`` pre-filled with ones. Tie rules:
    calls k (unpacked all-reduce), k+1 (unpacked reduce-scatter), k+2 (packed all-reduce),
    k+3 (packed reduce-scatter), so the alternate rule's parity matches pairwise. Returns
    (#checks, crc32 of every all-reduce result: identical on every rank)."""
    import zlib

    from bitcoll.algorithms.votes import field_width

    p, r = comm.size, comm.rank
    checks = 0
    digests: list[int] = []
    for n in lengths:
        lo, hi = bitcoll.block(n, p, r)
        xs = [vote_input(seed, j, n, "float32") for j in range(p)]
        bits = pack_bits_ref(xs[r] >= 0)
        for case, algo in enumerate(algorithms):
            for tie in TIES:
                dirty = case % 2 == 1  # padding set, out pre-filled with ones
                src = set_padding(bits, n) if dirty else bits
                call = comm.majority_calls
                whole = comm.sign_allreduce(xs[r], tie=tie, algorithm=algo)
                part = comm.sign_reduce_scatter(xs[r], tie=tie, algorithm=algo)
                _eq(whole, expected_majority(xs, tie, call), f"majority n={n} {algo} {tie}")
                out = np.full(-(-n // 8), 0xFF, np.uint8) if dirty else None
                got = comm.packed_sign_allreduce(src, n, tie=tie, algorithm=algo, out=out)
                assert out is None or got is out
                _eq(got, pack_bits_ref(whole > 0),
                    f"packed_sign_allreduce n={n} {algo} tie={tie} p={p} dirty={dirty}")
                got = comm.packed_sign_reduce_scatter(src, n, tie=tie, algorithm=algo)
                _eq(got, pack_bits_ref(part > 0),
                    f"packed_sign_reduce_scatter n={n} {algo} tie={tie} p={p} [{lo}, {hi})")
                digests.append(zlib.crc32(comm.packed_sign_allreduce(bits, n, tie=tie,
                                                                     algorithm=algo)))
                checks += 3
            for levels in levels_list:
                if levels * p > 32767 or (levels == 127 and n > 1000):
                    continue
                w_in, w_out = field_width(levels), field_width(levels * p)
                qs = [np.random.default_rng([seed, j, n, levels]).integers(
                    -levels, levels + 1, n).astype(np.int8) for j in range(p)]
                fields = pack_fields_ref(qs[r], w_in, levels)
                dirty = (case + levels) % 2 == 1
                src = set_padding(fields, n * w_in) if dirty else fields
                whole = comm.quantized_allreduce(qs[r], levels, algorithm=algo)
                part = comm.quantized_reduce_scatter(qs[r], levels, algorithm=algo)
                out = np.full(-(-n * w_out // 8), 0xFF, np.uint8) if dirty else None
                got = comm.packed_quantized_allreduce(src, n, levels, algorithm=algo, out=out)
                _eq(got, pack_fields_ref(whole, w_out, levels * p),
                    f"packed_quantized_allreduce n={n} L={levels} {algo} p={p} dirty={dirty}")
                digests.append(zlib.crc32(got))
                got = comm.packed_quantized_reduce_scatter(src, n, levels, algorithm=algo)
                _eq(got, pack_fields_ref(part, w_out, levels * p),
                    f"packed_quantized_reduce_scatter n={n} L={levels} {algo} p={p}")
                checks += 2
    return checks, digests


# ---------------------------------------------------------------------- kernel warm-up
def warm_kernels(sizes: tuple[int, ...] = (1, 2, 3, 4, 5), timeout: float = 600.0) -> None:
    """Load from numba's disk cache (compile, when it is empty) every kernel the packed
    sweeps call, in this process: one short :func:`packed_sweep` and :func:`packed_io_sweep`
    on a thread world of each size (the field widths depend on the size). About 3 s with a
    cache, a minute without."""
    from inproc import run_threads

    def body(comm: Communicator) -> None:
        packed_sweep(comm, lengths=(9,))
        packed_io_sweep(comm, lengths=(9,))

    for size in sizes:
        run_threads(size, body, timeout=timeout)


# ---------------------------------------------------------------------- sub-communicators
def siblings_from_threads(comm: Communicator, a: Communicator, b: Communicator,
                          calls: int) -> None:
    """All-reduces on the sub-communicators ``a`` and ``b`` (each over every rank of
    ``comm``, ``b`` in reversed order) from two threads while ``comm`` runs them in this
    thread: every result must be its own communicator's (no frame lands in another)."""
    r, p = comm.rank, comm.size
    errors: list[BaseException] = []

    def loop(c: Communicator, scale: float) -> None:
        try:
            for i in range(calls):
                y = c.allreduce(np.full(9, scale * (r + 1) + i))
                want = scale * p * (p + 1) / 2 + p * i
                assert (y == want).all(), (y, want)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(a, 1.0)),
               threading.Thread(target=loop, args=(b, 1000.0))]
    for t in threads:
        t.start()
    loop(comm, 1e6)
    for t in threads:
        t.join()
    assert not errors, errors
