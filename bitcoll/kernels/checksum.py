"""CRC32C (Castagnoli), the checksum of the TCP transport's data frames: numba kernels, and
the C implementation of the ``crc32c`` package for whole frames.

The value is the standard CRC-32C (iSCSI, ext4, SCTP): reflected polynomial ``0x82F63B78``,
initial value and final xor ``0xFFFFFFFF``; ``crc32c(b"123456789") == 0xE3069283``. Updates
chain: ``crc32c(b, crc32c(a)) == crc32c(a + b)``, so a frame can be checksummed piece by piece
as its bytes pass (:func:`crc32c_update` takes an address, so a kernel that is moving the bytes
anyway checksums them while they are still in the cache: :mod:`bitcoll.kernels.stream`).

Two implementations, one result:

* **Hardware** (x86-64 with SSE4.2, used when the CPU has it): the ``crc32`` instruction over 8
  bytes at a time, in three independent streams over three adjacent blocks of a piece (the
  instruction's latency is three times its issue interval), the three partial values joined
  with precomputed "append n zero bytes" operators (the method of Intel's white paper and of
  Mark Adler's ``crc32c.c``).
* **Software** (any CPU): slicing-by-8 tables.

A whole frame or a piece of one (:func:`frame_checksum`, :data:`crc32c_raw`) goes to the
``crc32c`` package (C, the same instruction where the CPU has it, ARMv8's too): a call costs
about 0.25 us there against 1-2.7 us for a numba call and its argument conversions, which is
most of the cost of a small frame's checksum (``bench/checksum_cost.py``). Its result is the
same value (``tests/test_checksum_kernel.py``).

What it detects, for one frame (header, payload) of fewer than 2**31 bits (256 MiB): every
error of one or two flipped bits, every error flipping an odd number of bits (the polynomial
has the factor ``x + 1``), every burst of at most 32 bits (the flipped bits lie within 32
consecutive bit positions), and any other error pattern except with probability 2**-32. It is
a checksum against accidents (a faulty NIC, switch, cable or memory), not against an attacker,
who can recompute it: that is the keyed tag of ``integrity=True``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Final

import crc32c as _crc32c_c
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]  # llvmlite ships no types
from numba import types
from numba.extending import intrinsic

from ..errors import UsageError
from .bits import _helper, _kernel

__all__ = ["crc32c", "crc32c_raw", "crc32c_update", "crc32c_hw", "crc32c_sw", "frame_checksum",
           "HARDWARE", "CHECKSUM_BYTES"]

#: Bytes of a frame's checksum on the wire (little-endian CRC32C).
CHECKSUM_BYTES: Final = 4

_POLY: Final = 0x82F63B78  # reflected 0x1EDC6F41
# Blocks of the three-stream hardware loop: each stream covers LONG (then SHORT) bytes.
_LONG: Final = 8192
_SHORT: Final = 256


def _cpu_has_sse42() -> bool:
    """Whether the code numba generates here may use SSE4.2: an x86-64 host CPU that has it,
    and no ``NUMBA_CPU_NAME`` asking for a generic target (a cache meant for other CPUs)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    name = os.environ.get("NUMBA_CPU_NAME", "host")
    features = os.environ.get("NUMBA_CPU_FEATURES", "")
    if name != "host":
        return "+sse4.2" in features.split(",")
    from llvmlite import binding as llvm

    try:
        return bool(llvm.get_host_cpu_features().get("sse4.2", False))
    except RuntimeError:
        return False


#: Whether :func:`crc32c` uses the CPU's ``crc32`` instruction (else the table version).
HARDWARE: Final = _cpu_has_sse42()


# --------------------------------------------------------------------------------------------
# Tables (built once at import, in numpy: a few milliseconds)
# --------------------------------------------------------------------------------------------


def _byte_table() -> np.ndarray[Any, np.dtype[np.uint32]]:
    """Slicing-by-8 tables: ``t[0]`` the classic byte table, ``t[k][b]`` = ``t[k-1][b]``
    advanced by one more zero byte."""
    t = np.zeros((8, 256), np.uint32)
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        t[0, b] = c
    for k in range(1, 8):
        prev = t[k - 1]
        t[k] = (prev >> 8) ^ t[0][prev & 0xFF]
    return t


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _zeros_table(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """``t[k][b]``: the raw CRC register ``b << 8k`` advanced over ``nbytes`` zero bytes (the
    operator is linear, so a register is advanced by xoring its four bytes' entries)."""
    # The operator of one zero bit, then squared up to the bits of nbytes (zlib's method).
    odd = [_POLY] + [1 << (i - 1) for i in range(1, 32)]
    op: list[int] | None = None
    power = odd
    n = nbytes * 8
    while n:
        if n & 1:
            op = power if op is None else [_gf2_times(power, v) for v in op]
        n >>= 1
        if n:
            power = [_gf2_times(power, v) for v in power]
    assert op is not None
    t = np.zeros((4, 256), np.uint32)
    for k in range(4):
        for b in range(256):
            t[k, b] = _gf2_times(op, b << (8 * k))
    return t


_TABLE: Final = _byte_table()
_ZEROS_LONG: Final = _zeros_table(_LONG)
_ZEROS_SHORT: Final = _zeros_table(_SHORT)


# --------------------------------------------------------------------------------------------
# Intrinsics: unaligned loads from an address, the crc32 instruction
# --------------------------------------------------------------------------------------------


def _load_typer(width: int) -> Callable[..., Any]:
    def typer(typingctx: Any, addr: Any) -> Any:
        if not isinstance(addr, types.Integer):
            return None
        ret = types.uint64 if width == 64 else types.uint8
        sig = ret(addr)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ity = ir.IntType(width)
            addr_ = context.cast(builder, args[0], signature.args[0], types.uintp)
            ptr = builder.inttoptr(addr_, ity.as_pointer())
            return builder.load(ptr, align=1)

        return sig, codegen

    return typer


_ld64: Callable[..., Any] = intrinsic(_load_typer(64))
_ld8: Callable[..., Any] = intrinsic(_load_typer(8))


def _declare(module: Any, fnty: Any, name: str) -> Any:
    """The LLVM function ``name`` of ``module``, declared on first use."""
    fn = module.globals.get(name)
    return fn if fn is not None else ir.Function(module, fnty, name)


def _crc64_typer(typingctx: Any, crc: Any, value: Any) -> Any:
    if crc != types.uint64 or value != types.uint64:
        return None
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        fn = _declare(builder.module, ir.FunctionType(i64, [i64, i64]),
                      "llvm.x86.sse42.crc32.64.64")
        return builder.call(fn, args)

    return sig, codegen


def _crc8_typer(typingctx: Any, crc: Any, value: Any) -> Any:
    if crc != types.uint32 or value != types.uint8:
        return None
    sig = types.uint32(types.uint32, types.uint8)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32, i8 = ir.IntType(32), ir.IntType(8)
        fn = _declare(builder.module, ir.FunctionType(i32, [i32, i8]),
                      "llvm.x86.sse42.crc32.32.8")
        return builder.call(fn, args)

    return sig, codegen


_crc_q: Callable[..., Any] = intrinsic(_crc64_typer)  # crc32 r64, m64 (raw register)
_crc_b: Callable[..., Any] = intrinsic(_crc8_typer)  # crc32 r32, m8


# --------------------------------------------------------------------------------------------
# Kernels over raw registers (no initial/final inversion), bytes at an address
# --------------------------------------------------------------------------------------------


_MASK: Final = np.uint64(0xFFFFFFFF)
_FF: Final = np.uint64(0xFF)
_S8: Final = np.uint64(8)
_S16: Final = np.uint64(16)
_S24: Final = np.uint64(24)
_S32: Final = np.uint64(32)
_S40: Final = np.uint64(40)
_S48: Final = np.uint64(48)
_S56: Final = np.uint64(56)


@_helper()
def _shift(zeros: Any, c: Any) -> Any:
    """Raw register ``c`` (uint64) advanced over the zero bytes of table ``zeros``."""
    return np.uint64(zeros[0, c & _FF] ^ zeros[1, (c >> _S8) & _FF]
                     ^ zeros[2, (c >> _S16) & _FF] ^ zeros[3, (c >> _S24) & _FF])


@_helper()
def _raw_sw(c: Any, addr: int, n: int, table: Any) -> Any:
    """Slicing-by-8 over ``n`` bytes at ``addr`` (raw register in, raw register out)."""
    c = np.uint64(c)
    i = 0
    while i + 8 <= n:
        v = _ld64(addr + i) ^ c
        c = np.uint64(table[7, v & _FF] ^ table[6, (v >> _S8) & _FF]
                      ^ table[5, (v >> _S16) & _FF] ^ table[4, (v >> _S24) & _FF]
                      ^ table[3, (v >> _S32) & _FF] ^ table[2, (v >> _S40) & _FF]
                      ^ table[1, (v >> _S48) & _FF] ^ table[0, v >> _S56])
        i += 8
    while i < n:
        c = np.uint64(table[0, (c ^ np.uint64(_ld8(addr + i))) & _FF]) ^ (c >> _S8)
        i += 1
    return c


@_helper()
def _raw_hw(c: Any, addr: int, n: int, zlong: Any, zshort: Any) -> Any:
    """The ``crc32`` instruction over ``n`` bytes at ``addr``: three streams over blocks of
    3 x 8 KiB, then of 3 x 256 bytes, then one stream (raw register in and out)."""
    c0 = np.uint64(c)
    i = 0
    while n - i >= 3 * _LONG:
        c1 = np.uint64(0)
        c2 = np.uint64(0)
        end = i + _LONG
        while i < end:
            c0 = _crc_q(c0, _ld64(addr + i))
            c1 = _crc_q(c1, _ld64(addr + i + _LONG))
            c2 = _crc_q(c2, _ld64(addr + i + 2 * _LONG))
            i += 8
        c0 = _shift(zlong, c0) ^ c1
        c0 = _shift(zlong, c0) ^ c2
        i += 2 * _LONG
    while n - i >= 3 * _SHORT:
        c1 = np.uint64(0)
        c2 = np.uint64(0)
        end = i + _SHORT
        while i < end:
            c0 = _crc_q(c0, _ld64(addr + i))
            c1 = _crc_q(c1, _ld64(addr + i + _SHORT))
            c2 = _crc_q(c2, _ld64(addr + i + 2 * _SHORT))
            i += 8
        c0 = _shift(zshort, c0) ^ c1
        c0 = _shift(zshort, c0) ^ c2
        i += 2 * _SHORT
    while i + 8 <= n:
        c0 = _crc_q(c0, _ld64(addr + i))
        i += 8
    c32 = np.uint32(c0)
    while i < n:
        c32 = _crc_b(c32, _ld8(addr + i))
        i += 1
    return np.uint64(c32)


@_helper()
def crc32c_hw(crc: int, addr: int, n: int) -> Any:
    """CRC32C of the ``n`` bytes at ``addr`` continuing ``crc`` (0 to start), with the
    ``crc32`` instruction (only where :data:`HARDWARE` is true). Returns uint64 < 2**32."""
    c = np.uint64(crc) ^ _MASK
    return _raw_hw(c, addr, n, _ZEROS_LONG, _ZEROS_SHORT) ^ _MASK


@_helper()
def crc32c_sw(crc: int, addr: int, n: int) -> Any:
    """As :func:`crc32c_hw`, with tables (any CPU)."""
    c = np.uint64(crc) ^ _MASK
    return _raw_sw(c, addr, n, _TABLE) ^ _MASK


#: The update kernels use (``crc32c_update(crc, addr, n)``, callable from other kernels): the
#: hardware one where the CPU has it.
crc32c_update: Callable[[Any, Any, Any], Any] = crc32c_hw if HARDWARE else crc32c_sw


@_kernel()
def _crc_hw_array(crc: int, a: Any) -> Any:
    return crc32c_hw(crc, a.ctypes.data, a.shape[0])


@_kernel()
def _crc_sw_array(crc: int, a: Any) -> Any:
    return crc32c_sw(crc, a.ctypes.data, a.shape[0])


#: ``crc32c_raw(data, value=0)``: the C CRC32C of ``data`` (a flat C-contiguous buffer),
#: continuing ``value``; no argument checks, for the transport's per-frame path (releases the
#: GIL from 32 KiB).
crc32c_raw: Final[Callable[..., int]] = _crc32c_c.crc32c


def frame_checksum(head: bytes | bytearray | memoryview, payload: memoryview) -> bytes:
    """The trailer of a TCP data frame: the little-endian CRC32C of ``head`` followed by
    ``payload`` (:data:`CHECKSUM_BYTES` bytes; equal to
    ``crc32c(payload, crc32c(head)).to_bytes(4, "little")``). Both must be flat C-contiguous
    byte buffers (the transport's frame views): two C calls, no argument checks, for the
    per-frame path."""
    return crc32c_raw(payload, crc32c_raw(head)).to_bytes(CHECKSUM_BYTES, "little")


def _bytes_of(data: object) -> np.ndarray[Any, np.dtype[np.uint8]]:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise UsageError("crc32c needs a C-contiguous array", argument="data")
        return data.reshape(-1).view(np.uint8)
    try:
        mv = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise UsageError(f"crc32c needs a buffer (bytes, bytearray, memoryview or a numpy "
                         f"array), got {type(data).__name__}", argument="data") from None
    if not mv.c_contiguous:
        raise UsageError("crc32c needs a C-contiguous buffer", argument="data")
    return np.frombuffer(mv.cast("B") if mv.nbytes else b"", np.uint8)


def crc32c(data: object, value: int = 0, *, hardware: bool | None = None) -> int:
    """The CRC32C of ``data`` (any C-contiguous buffer: its bytes), continuing ``value`` (the
    CRC32C of the bytes before it; 0 to start). ``hardware``: force one implementation (None:
    :data:`HARDWARE`; True where the CPU lacks SSE4.2 is a UsageError). Never copies."""
    if not 0 <= value < 1 << 32:
        raise UsageError(f"crc32c value must be in [0, 2**32), got {value}", argument="value")
    a = _bytes_of(data)
    hw = HARDWARE if hardware is None else hardware
    if hw and not HARDWARE and not _cpu_has_sse42():
        raise UsageError("this CPU has no SSE4.2 crc32 instruction", argument="hardware")
    return int((_crc_hw_array if hw else _crc_sw_array)(value, a))
