"""Arrays beyond numpy: torch CPU tensors, DLPack and buffer-protocol objects in and out of
the collectives, other devices refused, and bfloat16 reductions (float32, rounded once)."""

from __future__ import annotations

import array
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from errcheck import raises_usage
from inproc import run_threads
from multiproc import run_world
from sweeps import rank_input

import bitcoll
from bitcoll.arrays import to_numpy
from bitcoll.communicator import Communicator

torch = pytest.importorskip("torch")

BF16_LENGTHS = (0, 1, 7, 1000, 40_000)  # 40,000 bf16 elements: above 64 KiB, the ring


def bf16_input(seed: int, rank: int, n: int) -> Any:
    """bfloat16 values m * 2**e (|m| <= 255, -8 <= e <= 0): every float32 sum of up to 5 of
    them is exact, so the reference does not depend on the order of the additions."""
    rng = np.random.default_rng([seed, rank, n, 16])
    vals = rng.integers(-255, 256, n) * np.exp2(-rng.integers(0, 9, n))
    return torch.from_numpy(vals.astype(np.float32)).to(torch.bfloat16)


def f32(t: Any) -> Any:
    return t.float().numpy()


def bits(t: Any) -> bytes:
    return bytes(t.contiguous().view(torch.int16).numpy().tobytes())


def bf16_reference(ts: list[Any], op: str) -> Any:
    """The float32 reduction rounded once to bfloat16 (torch's rounding: nearest, even)."""
    stack = np.stack([f32(t) for t in ts]).astype(np.float32)
    if op in ("sum", "avg"):
        red = np.sum(stack, axis=0, dtype=np.float32)
        if op == "avg":
            red = np.divide(red, np.float32(len(ts)))
    elif op == "max":
        red = np.max(stack, axis=0, initial=-np.inf)
    else:
        red = np.min(stack, axis=0, initial=np.inf)
    return torch.from_numpy(np.ascontiguousarray(red, dtype=np.float32)).to(torch.bfloat16)


# ---------------------------------------------------------------------- torch CPU tensors
def _torch_collectives(c: Communicator) -> None:
    p, r = c.size, c.rank
    xs = [rank_input(3, j, 24, "float32").reshape(4, 6) for j in range(p)]
    want = np.sum(xs, axis=0, dtype=np.float32)
    t = torch.from_numpy(xs[r].copy())
    got = c.allreduce(t)
    assert isinstance(got, np.ndarray) and got.shape == (4, 6) and np.array_equal(got, want)
    out = torch.full((4, 6), -1.0)
    assert c.allreduce(t, out=out) is out and np.array_equal(out.numpy(), want)
    assert c.allreduce(t, out=t) is t and np.array_equal(t.numpy(), want)  # in place
    lo, hi = bitcoll.block(24, p, r)
    part = torch.empty(hi - lo)
    assert c.reduce_scatter(torch.from_numpy(xs[r]), out=part) is part
    assert np.array_equal(part.numpy(), want.reshape(-1)[lo:hi])
    gathered = torch.empty(24 * p)
    assert c.allgather(torch.from_numpy(xs[r]), out=gathered) is gathered
    assert np.array_equal(gathered.numpy(), np.concatenate([x.reshape(-1) for x in xs]))
    buf = torch.from_numpy(xs[r].copy())
    assert c.broadcast(buf, root=p - 1) is buf and np.array_equal(buf.numpy(), xs[p - 1])
    m = 24 - 24 % p
    exch = c.alltoall(torch.from_numpy(xs[r].reshape(-1)[:m].copy()))
    blk = m // p
    assert np.array_equal(exch, np.concatenate([x.reshape(-1)[r * blk:(r + 1) * blk]
                                                for x in xs]))
    # non-contiguous input: read through a copy
    strided = torch.from_numpy(np.repeat(xs[r], 2, axis=1))[:, ::2]
    assert not strided.is_contiguous()
    assert np.array_equal(c.allreduce(strided), want)
    # packed-bit collectives
    votes = torch.from_numpy(xs[r].reshape(-1) - 0.5)
    maj = torch.empty(24, dtype=torch.int8)
    assert c.sign_allreduce(votes, tie="positive", out=maj) is maj
    assert np.array_equal(maj.numpy(), c.sign_allreduce(votes.numpy(), tie="positive"))
    q = torch.from_numpy(np.clip(xs[r].reshape(-1), -3, 3).astype(np.int8))
    sums = torch.empty(24, dtype=torch.int32)
    assert c.quantized_allreduce(q, 3, out=sums) is sums
    assert np.array_equal(sums.numpy(), np.sum([np.clip(x.reshape(-1), -3, 3) for x in xs],
                                               axis=0))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_torch_tensors_in_and_out(size: int) -> None:
    run_threads(size, _torch_collectives)


def test_torch_tensor_is_read_without_a_copy() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view, bf16 = to_numpy(t)
    assert not bf16 and view.__array_interface__["data"][0] == t.data_ptr()
    b = t.to(torch.bfloat16)
    view, bf16 = to_numpy(b)
    assert bf16 and view.dtype == np.uint16 and view.shape == (3, 4)
    assert view.__array_interface__["data"][0] == b.data_ptr()


@pytest.mark.parametrize("call,argument", [
    (lambda c: c.allreduce(torch.ones(3, requires_grad=True)), "x"),
    (lambda c: c.allreduce(torch.ones(3), out=torch.ones(3, requires_grad=True)), "out"),
    (lambda c: c.allreduce(torch.ones(4, 2), out=torch.ones(2, 4).t()), "out"),
    (lambda c: c.allreduce(torch.empty(3, device="meta")), "x"),
    (lambda c: c.allreduce(torch.ones(3), out=torch.ones(3, dtype=torch.float64)), "out"),
    (lambda c: c.allreduce(torch.ones(3, dtype=torch.bfloat16), out=np.ones(3, np.uint16)),
     "out"),
    (lambda c: c.allreduce(torch.ones(3), out=torch.ones(3, dtype=torch.bfloat16)), "out"),
    (lambda c: c.allreduce(torch.ones(3, dtype=torch.complex64)), "x"),
    (lambda c: c.sign_allreduce(torch.ones(3, dtype=torch.bfloat16)), "x"),
    (lambda c: c.allreduce([1.0, 2.0]), "x"),
])
def test_torch_usage_errors(call: Any, argument: str) -> None:
    comm = bitcoll.init("local")
    with raises_usage(argument):
        call(comm)
    assert comm.allreduce(torch.ones(2))[0] == 1.0


class _FakeDevice:
    """An array in the memory of another device, as DLPack describes it."""

    def __init__(self, device: tuple[int, int]) -> None:
        self.device = device

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise AssertionError("bitcoll must not export an array from another device")


@pytest.mark.parametrize("device,name", [((2, 0), "cuda:0"), ((10, 3), "rocm:3"),
                                         ((99, 1), "type 99:1")])
def test_other_devices_are_refused(device: tuple[int, int], name: str) -> None:
    comm = bitcoll.init("local")
    with raises_usage("x") as info:
        comm.allreduce(_FakeDevice(device))
    assert f" on device {name} " in str(info.value)  # the device, named for the user
    with raises_usage("out") as info:
        comm.allreduce(np.ones(3, np.float32), out=_FakeDevice(device))
    assert "copy it to the CPU" in str(info.value)
    with raises_usage("bits"):
        comm.packed_sign_allreduce(_FakeDevice(device), 8)


class _Exporter:
    """A minimal DLPack exporter on the CPU (delegates to a numpy array)."""

    def __init__(self, a: np.ndarray[Any, Any]) -> None:
        self.a = a

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.a.__dlpack_device__()


def test_dlpack_and_buffer_protocol_objects() -> None:
    comm = bitcoll.init("local")
    a = np.arange(6, dtype=np.float32)
    assert np.array_equal(comm.allreduce(_Exporter(a)), a)
    out = np.zeros(6, np.float32)
    assert comm.allreduce(_Exporter(a), out=_Exporter(out)).a is out
    assert np.array_equal(out, a)
    # buffer protocol: array.array, memoryview over a bytearray (written in place), bytes
    assert np.array_equal(comm.allreduce(array.array("f", [1, 2, 3])), [1, 2, 3])
    raw = bytearray(12)
    mv = memoryview(raw).cast("f")
    assert comm.allreduce(np.array([4, 5, 6], np.float32), out=mv) is mv
    assert np.array_equal(np.frombuffer(raw, np.float32), [4, 5, 6])
    assert np.array_equal(comm.allgather(bytes([1, 2, 3])), [1, 2, 3])
    with raises_usage("out"):  # (bytes are read-only)
        comm.allreduce(np.zeros(3, np.uint8), out=bytes(3))
    bits = bytearray([0b101])
    assert comm.packed_sign_allreduce(bits, 3).tolist() == [0b101]


def test_bitcoll_never_imports_torch() -> None:
    code = ("import sys, numpy as np, bitcoll\n"
            "c = bitcoll.init('local')\n"
            "c.allreduce(np.ones(3)); c.allreduce(memoryview(bytearray(4)).cast('f'))\n"
            "c.packed_sign_allreduce(np.zeros(1, np.uint8), 8)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------- bfloat16
def _bf16_sweep(c: Communicator, algorithms: tuple[str, ...] = ("ring", "recursive_doubling")
                ) -> list[bytes]:
    """bfloat16 through every dense collective; returns the bits of every all-reduce result
    (the caller compares them across ranks)."""
    p, r = c.size, c.rank
    results: list[bytes] = []
    for n in BF16_LENGTHS:
        ts = [bf16_input(1, j, n) for j in range(p)]
        mine = ts[r].clone()
        lo, hi = bitcoll.block(n, p, r)
        for op in ("sum", "avg", "max", "min"):
            want = bf16_reference(ts, op)
            for algo in algorithms:
                got = c.allreduce(mine, op=op, algorithm=algo)
                assert got.dtype == torch.bfloat16 and got.shape == (n,)
                assert bits(got) == bits(want), f"allreduce bf16 n={n} {op} {algo} p={p}"
                results.append(bits(got))
            part = torch.empty(hi - lo, dtype=torch.bfloat16)
            assert c.reduce_scatter(mine, op=op, out=part) is part
            assert bits(part) == bits(want[lo:hi]), f"reduce_scatter bf16 n={n} {op}"
        inplace = mine.clone()
        assert c.allreduce(inplace, out=inplace) is inplace
        assert bits(inplace) == bits(bf16_reference(ts, "sum"))
        assert bits(c.allgather(mine)) == bits(torch.cat(ts))
        buf = mine.clone()
        c.broadcast(buf, root=n % p)
        assert bits(buf) == bits(ts[n % p])
        m = n - n % p
        blk = m // p
        got = c.alltoall(mine[:m].clone())
        assert bits(got) == bits(torch.cat([t[r * blk:(r + 1) * blk] for t in ts]))
        assert bits(mine) == bits(ts[r])  # input untouched
    return results


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_bf16_reductions_round_once(size: int) -> None:
    results = run_threads(size, _bf16_sweep, timeout=120, segment_bytes=4096)
    assert all(res == results[0] for res in results)  # bitwise identical on every rank


def test_bf16_reference_detects_double_rounding() -> None:
    """Rounding the partial sums to bfloat16 at every step (what a ring moving bfloat16 would
    do) gives other bits than rounding once: the bf16 test above tells them apart."""
    ts = [bf16_input(1, j, 40_000) for j in range(4)]
    acc = ts[0]
    for t in ts[1:]:
        acc = (acc.float() + t.float()).to(torch.bfloat16)
    assert bits(acc) != bits(bf16_reference(ts, "sum"))


def _bf16_tcp(comm: Communicator) -> list[bytes]:
    # The spawned ranks import this module, and torch with it.
    return _bf16_sweep(comm, algorithms=("ring",))


@pytest.mark.tcp
def test_bf16_tcp() -> None:
    results = run_world(3, _bf16_tcp, timeout=300)
    assert all(res == results[0] for res in results)
