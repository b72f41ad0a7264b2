"""bitcoll's packed-bit layouts (:mod:`bitcoll.layout`) written with torch operations, so
votes are packed and sums unpacked on the tensors' own device (CPU or CUDA).

The layouts are exactly those of :mod:`bitcoll.layout`: a packed stream is a ``uint8``
tensor whose stream bit ``j`` is bit ``j % 8`` of byte ``j // 8``; a field of width ``w``
(``1 <= w <= 16``) for element ``i`` occupies stream bits ``[i w, (i + 1) w)``, least
significant bit first; signs are fields of width 1 (1 = +1). ``count`` fields take
``ceil(count w / 8)`` bytes and the padding bits after the last field are 0.

Method (``w <= 8``): the fields are held one per byte (``uint8``) in a buffer padded to a
multiple of 8 elements, read as ``int64`` words of 8 byte lanes (little-endian, as on every
platform torch supports). :func:`compress` moves the 8 lanes of every word together into
``8 w`` contiguous bits in three rounds of two operations (a shift, and a subtraction of the
shifted value times a constant) on lanes of 16, 32 and 64 bits; for ``w = 1`` one
multiplication gathers the 8 bits. The first ``w`` bytes of every word are then the
stream's ``w`` bytes for its 8 fields, copied by one strided copy per lane of 4, 2 or 1
bytes (the widest dividing ``w``). :func:`expand` and the copies back are the inverse.
:func:`pack` and :func:`unpack` can work in tiles of fields, so that their passes stay in
the cache. Fields of 9 to 16 bits go through a bit-per-byte expansion instead
(:func:`pack_wide`, :func:`unpack_wide`): slower, and used only when
``levels * world size > 127``.

All functions take and return tensors on one device and never synchronize it.
"""

from __future__ import annotations

import torch

__all__ = ["nbytes", "padded", "ranges", "compress", "expand", "pack", "unpack", "pack_wide",
           "unpack_wide"]

_GATHER = 0x0102040810204080  # lane k's bit 0 times this lands on bit 56 + k
_SPREAD = 0x0101010101010101  # a byte times this is that byte in every lane
_SELECT = -0x7FBFDFEFF7FBFDFF  # 0x8040201008040201 as int64: bit k of lane k
_ROUND = 0x7F7F7F7F7F7F7F7F


def nbytes(count: int, width: int) -> int:
    """``ceil(count * width / 8)``: bytes of ``count`` packed ``width``-bit fields."""
    return (count * width + 7) // 8


def padded(count: int) -> int:
    """``count`` rounded up to a multiple of 8 (the length of a field buffer)."""
    return (count + 7) // 8 * 8


def compress(words: torch.Tensor, width: int, tmp: torch.Tensor) -> None:
    """In place: every int64 word of ``words`` holds 8 byte lanes, lane ``j`` (bits
    ``[8 j, 8 j + 8)``) a field below ``2**width``; afterwards it holds field ``j`` at bits
    ``[j width, (j + 1) width)`` and zeros above bit ``8 width``. ``tmp``: int64 scratch of
    ``words``' shape. ``1 <= width <= 8`` (8 leaves the words as they are).

    Three rounds, each two operations on lanes of 16, 32 and 64 bits: a lane ``lo + 2**h hi``
    (two halves of ``h`` bits, ``hi < 2**(h - 1)``) becomes ``lo + 2**k hi`` as
    ``lane - (2**h - 2**k) * (lane >> h)``, exact in the lane's integer type."""
    if width == 8:
        return
    for lanes, half, part in ((torch.int16, 8, width), (torch.int32, 16, 2 * width),
                              (torch.int64, 32, 4 * width)):
        x, t = words.view(lanes), tmp.view(lanes)
        torch.bitwise_right_shift(x, half, out=t)
        x.sub_(t, alpha=(1 << half) - (1 << part))


def expand(words: torch.Tensor, width: int, tmp: torch.Tensor) -> None:
    """In place, the inverse of :func:`compress`: field ``j`` at bits ``[j width, (j + 1)
    width)`` moves to byte lane ``j``; the bits from ``8 width`` up must be 0. The rounds of
    :func:`compress` in reverse: ``lo + 2**k hi`` becomes ``lane + (2**h - 2**k) *
    (lane >> k)``."""
    if width == 8:
        return
    for lanes, half, part in ((torch.int64, 32, 4 * width), (torch.int32, 16, 2 * width),
                              (torch.int16, 8, width)):
        x, t = words.view(lanes), tmp.view(lanes)
        torch.bitwise_right_shift(x, part, out=t)
        x.add_(t, alpha=(1 << half) - (1 << part))


def ranges(count: int, tile: int) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of at most ``padded(tile)`` fields covering ``[0, count)``, every
    ``a`` a multiple of 8 (so a range starts on a byte of the stream); ``tile <= 0``: one."""
    step = padded(tile) if tile > 0 else max(count, 1)
    return [(a, min(count, a + step)) for a in range(0, count, step)]


def pack(fields: torch.Tensor, count: int, width: int, out: torch.Tensor,
         tmp: torch.Tensor, tile: int = 0) -> None:
    """Pack ``count`` fields of ``width <= 8`` bits into the stream ``out`` (uint8,
    ``nbytes(count, width)`` elements). ``fields``: uint8, ``padded(count)`` elements, one
    field per byte, zeros after ``count``; it is overwritten (used as the words). ``tmp``:
    int64 scratch of ``padded(min(count, tile)) // 8`` elements. ``tile > 0``: packed
    ``padded(tile)`` fields at a time (the same stream; the passes stay in the cache)."""
    if 0 < tile < count:
        for a, b in ranges(count, tile):
            pack(fields[a:a + padded(b - a)], b - a, width, out[a * width // 8:nbytes(b, width)],
                 tmp)
        return
    words = fields.view(torch.int64)
    groups = words.numel()
    if groups == 0:
        return
    if width == 1:  # one multiplication gathers the 8 lanes' bits into bits 56..63
        words.mul_(_GATHER).bitwise_right_shift_(56).bitwise_and_(0xFF)
        out.copy_(words)
        return
    compress(words, width, tmp[:groups])
    n = nbytes(count, width)
    whole = min(groups, n // width)  # groups whose bytes all belong to the stream
    for dst, src in _columns(words[:whole], width, out[:whole * width]):
        dst.copy_(src)
    if whole < groups:
        streams = words.view(torch.uint8).view(groups, 8)
        out[whole * width:n].copy_(streams[whole][:n - whole * width])


def unpack(stream: torch.Tensor, count: int, width: int, fields: torch.Tensor,
           tmp: torch.Tensor, tile: int = 0) -> None:
    """Unpack ``count`` fields of ``width <= 8`` bits from ``stream`` (uint8,
    ``nbytes(count, width)`` elements) into ``fields`` (uint8, ``padded(count)`` elements:
    one field per byte; the elements after ``count`` are left undefined). ``tmp``: int64
    scratch of ``padded(min(count, tile)) // 8`` elements. ``tile > 0``: unpacked
    ``padded(tile)`` fields at a time."""
    if 0 < tile < count:
        for a, b in ranges(count, tile):
            unpack(stream[a * width // 8:nbytes(b, width)], b - a, width,
                   fields[a:a + padded(b - a)], tmp, tile=0)
        return
    groups = fields.numel() // 8
    if groups == 0:
        return
    words = fields.view(torch.int64)
    if width == 1:  # byte k of the stream to every lane, lane j keeps bit j, made 0 / 1
        words.copy_(stream[:groups])
        words.mul_(_SPREAD).bitwise_and_(_SELECT).add_(_ROUND)
        words.bitwise_right_shift_(7).bitwise_and_(_SPREAD)
        return
    n = nbytes(count, width)
    whole = min(groups, n // width)
    words.zero_()  # expand needs zeros above bit 8 width
    for src, dst in _columns(words[:whole], width, stream[:whole * width]):
        dst.copy_(src)
    if whole < groups:
        rest = stream[whole * width:n]
        fields[8 * whole:8 * whole + rest.numel()].copy_(rest)
    expand(words, width, tmp[:groups])


def _columns(words: torch.Tensor, width: int,
             stream: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(stream part, word part)`` pairs of equal 1-D views: the first ``width`` bytes of
    every compressed word (:func:`compress`, ``8 width`` bits) are the ``width`` bytes of
    its group in ``stream``; copied as lanes of 4, 2 or 1 bytes (the widest dividing
    ``width`` and the stream's address), one strided copy per lane position."""
    groups = words.numel()
    if groups == 0:
        return []
    lane = next(k for k in (4, 2, 1) if width % k == 0 and stream.data_ptr() % k == 0
                and stream.storage_offset() % k == 0)
    dtype = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[lane]
    per = width // lane
    src = words.view(dtype).view(groups, 8 // lane)
    dst = stream.view(dtype).view(groups, per)
    return [(dst[:, i], src[:, i]) for i in range(per)]


def pack_wide(values: torch.Tensor, width: int, out: torch.Tensor) -> None:
    """Pack ``values`` (any integer dtype, each in ``[0, 2**width)``, ``width <= 16``) into
    the stream ``out`` (uint8, ``nbytes(values.numel(), width)`` elements), one bit per
    byte on the way (:func:`pack` is the fast path for ``width <= 8``)."""
    count = values.numel()
    shifts = torch.arange(width, device=values.device, dtype=torch.int32)
    bits = ((values.reshape(-1, 1).to(torch.int32) >> shifts) & 1).to(torch.uint8)
    flat = torch.zeros(padded(count * width), dtype=torch.uint8, device=values.device)
    flat[:count * width] = bits.reshape(-1)
    tmp = torch.empty(flat.numel() // 8, dtype=torch.int64, device=values.device)
    pack(flat, count * width, 1, out, tmp)


def unpack_wide(stream: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The ``count`` fields of ``width`` bits in ``stream`` as an int32 tensor."""
    total = count * width
    flat = torch.empty(padded(total), dtype=torch.uint8, device=stream.device)
    tmp = torch.empty(flat.numel() // 8, dtype=torch.int64, device=stream.device)
    unpack(stream, total, 1, flat, tmp)
    shifts = torch.arange(width, device=stream.device, dtype=torch.int32)
    bits = flat[:total].view(count, width).to(torch.int32) << shifts
    return bits.sum(dim=1, dtype=torch.int32)
