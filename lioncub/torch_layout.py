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
``8 w`` contiguous bits in three shift-and-mask rounds (lane pairs, quads, halves); the
first ``w`` bytes of every word are then the stream (for ``w <= 4`` a round is one shift,
one or and one mask, as no field can reach its neighbour's place; for ``w = 1`` one
multiplication gathers the 8 bits). Groups of ``8 / gcd(w, 8)`` such words are then joined
into whole ``int64`` words of the stream by shifts on columns of words (the ragged end, and a
stream whose address is not a multiple of 8, by byte copies). :func:`expand` and the
splitting are the inverse. :func:`pack` and :func:`unpack` can work in tiles of fields, so
that their passes stay in the cache. Fields of 9 to 16 bits go through a bit-per-byte
expansion instead (:func:`pack_wide`, :func:`unpack_wide`): slower, and used only when
``levels * world size > 127``.

All functions take and return tensors on one device and never synchronize it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["nbytes", "padded", "ranges", "compress", "expand", "pack", "unpack", "pack_wide",
           "unpack_wide"]

_EVEN8 = 0x00FF00FF00FF00FF
_GATHER = 0x0102040810204080  # lane k's bit 0 times this lands on bit 56 + k
_SPREAD = 0x0101010101010101  # a byte times this is that byte in every lane
_SELECT = -0x7FBFDFEFF7FBFDFF  # 0x8040201008040201 as int64: bit k of lane k
_ROUND = 0x7F7F7F7F7F7F7F7F
_EVEN16 = 0x0000FFFF0000FFFF
_LOW32 = 0xFFFFFFFF


def nbytes(count: int, width: int) -> int:
    """``ceil(count * width / 8)``: bytes of ``count`` packed ``width``-bit fields."""
    return (count * width + 7) // 8


def padded(count: int) -> int:
    """``count`` rounded up to a multiple of 8 (the length of a field buffer)."""
    return (count + 7) // 8 * 8


def _masks(bits: int, spacing: int) -> int:
    """The int64 with ones at bits ``[k spacing, k spacing + bits)`` for every ``k``."""
    return sum(((1 << bits) - 1) << k for k in range(0, 64, spacing))


def compress(words: torch.Tensor, width: int, tmp: torch.Tensor) -> None:
    """In place: every int64 word of ``words`` holds 8 byte lanes, lane ``j`` (bits
    ``[8 j, 8 j + 8)``) a field below ``2**width``; afterwards it holds field ``j`` at bits
    ``[j width, (j + 1) width)`` and zeros above bit ``8 width``. ``tmp``: int64 scratch of
    ``words``' shape. ``1 <= width <= 8`` (8 leaves the words as they are)."""
    if width == 8:
        return
    if width <= 4:  # a field never reaches the next one's place: shift, or, mask
        for step, keep in ((8, _masks(2 * width, 16)), (16, _masks(4 * width, 32)),
                           (32, (1 << (8 * width)) - 1)):
            torch.bitwise_right_shift(words, step - (step // 8) * width, out=tmp)
            words.bitwise_or_(tmp).bitwise_and_(keep)
        return
    # pairs: odd lanes move down next to the even ones (bits [16 i, 16 i + 2 w))
    torch.bitwise_right_shift(words, 8, out=tmp)
    tmp.bitwise_and_(_EVEN8)
    words.bitwise_and_(_EVEN8)
    tmp.bitwise_left_shift_(width)
    words.bitwise_or_(tmp)
    # quads: bits [32 k, 32 k + 4 w)
    torch.bitwise_right_shift(words, 16, out=tmp)
    tmp.bitwise_and_(_EVEN16)
    words.bitwise_and_(_EVEN16)
    tmp.bitwise_left_shift_(2 * width)
    words.bitwise_or_(tmp)
    # halves: bits [0, 8 w)
    torch.bitwise_right_shift(words, 32, out=tmp)
    words.bitwise_and_(_LOW32)
    tmp.bitwise_left_shift_(4 * width)
    words.bitwise_or_(tmp)


def expand(words: torch.Tensor, width: int, tmp: torch.Tensor) -> None:
    """In place, the inverse of :func:`compress`: field ``j`` at bits ``[j width, (j + 1)
    width)`` (bits from ``8 width`` up ignored) moves to byte lane ``j``."""
    if width == 8:
        return
    if width <= 4:  # the inverse rounds of compress: shift up, or, mask
        for step, keep in ((32, _masks(4 * width, 32)), (16, _masks(2 * width, 16)),
                           (8, _masks(width, 8))):
            torch.bitwise_left_shift(words, step - (step // 8) * width, out=tmp)
            words.bitwise_or_(tmp).bitwise_and_(keep)
        return
    half = (1 << (4 * width)) - 1
    torch.bitwise_right_shift(words, 4 * width, out=tmp)
    tmp.bitwise_and_(half)
    words.bitwise_and_(half)
    tmp.bitwise_left_shift_(32)
    words.bitwise_or_(tmp)
    quad = ((1 << (2 * width)) - 1) * (1 + (1 << 32))
    torch.bitwise_right_shift(words, 2 * width, out=tmp)
    tmp.bitwise_and_(quad)
    words.bitwise_and_(quad)
    tmp.bitwise_left_shift_(16)
    words.bitwise_or_(tmp)
    lane = ((1 << width) - 1) * 0x0001000100010001
    torch.bitwise_right_shift(words, width, out=tmp)
    tmp.bitwise_and_(lane)
    words.bitwise_and_(lane)
    tmp.bitwise_left_shift_(8)
    words.bitwise_or_(tmp)


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
    done, written = _join(words, width, out[:n], tmp)
    words, out, groups, n = words[done:], out[written:n], groups - done, n - written
    streams = words.view(torch.uint8).view(groups, 8)[:, :width]
    whole = min(groups, n // width)  # groups whose bytes all belong to the stream
    out[:whole * width].view(whole, width).copy_(streams[:whole])
    if whole < groups:
        out[whole * width:n].copy_(streams[whole].reshape(-1)[:n - whole * width])


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
    done, read = _split(stream[:n], width, words, tmp)
    lanes = fields[8 * done:].view(groups - done, 8)
    whole = min(groups - done, (n - read) // width)
    lanes.zero_()
    lanes[:whole, :width].copy_(stream[read:read + whole * width].view(whole, width))
    if done + whole < groups:
        rest = stream[read + whole * width:n]
        lanes[whole].reshape(-1)[:rest.numel()].copy_(rest)
    expand(words, width, tmp[:groups])


def _groups(width: int, words: int, nbytes_: int, stream: torch.Tensor) -> tuple[int, int]:
    """``(q, g)``: ``q`` compressed words (``8 width`` bits each) make ``q width / 8`` whole
    int64 words of the stream; ``g`` such groups lie within ``words`` words and
    ``nbytes_`` bytes (0 when the stream's address is not a multiple of 8)."""
    q = 8 // math.gcd(width, 8)
    if stream.data_ptr() % 8:
        return q, 0
    return q, min(words // q, nbytes_ // (q * width))


def _join(words: torch.Tensor, width: int, out: torch.Tensor,
          tmp: torch.Tensor) -> tuple[int, int]:
    """Write the stream of as many whole groups of compressed ``words`` (:func:`compress`,
    ``2 <= width <= 7``) as fit ``out`` with int64 column operations (each word's
    ``8 width`` bits shifted into place) instead of a byte-strided copy; return the words
    consumed and the bytes written."""
    w8 = 8 * width
    q, g = _groups(width, words.numel(), out.numel(), out)
    if g == 0:
        return 0, 0
    r = q * width // 8
    src = words[:g * q].view(g, q)
    dst = out[:g * r * 8].view(torch.int64).view(g, r)
    t = tmp[:g]
    for j in range(q):
        k, sh = divmod(j * w8, 64)
        if sh == 0:  # the first bits of word k
            dst[:, k].copy_(src[:, j])
        else:
            torch.bitwise_left_shift(src[:, j], sh, out=t)
            dst[:, k].bitwise_or_(t)
        if sh + w8 > 64:  # the rest starts word k + 1 (values < 2**56: the shift is logical)
            torch.bitwise_right_shift(src[:, j], 64 - sh, out=dst[:, k + 1])
    return g * q, g * r * 8


def _split(stream: torch.Tensor, width: int, words: torch.Tensor,
           tmp: torch.Tensor) -> tuple[int, int]:
    """The inverse of :func:`_join`: the compressed words of as many whole groups as
    ``stream`` and ``words`` hold (zeros above bit ``8 width``); return the words written
    and the bytes read."""
    w8 = 8 * width
    q, g = _groups(width, words.numel(), stream.numel(), stream)
    if g == 0:
        return 0, 0
    r = q * width // 8
    src = stream[:g * r * 8].view(torch.int64).view(g, r)
    dst = words[:g * q].view(g, q)
    t = tmp[:g]
    for j in range(q):
        k, sh = divmod(j * w8, 64)
        col = dst[:, j]
        torch.bitwise_right_shift(src[:, k], sh, out=col)  # arithmetic: masked below
        if sh + w8 > 64:
            col.bitwise_and_((1 << (64 - sh)) - 1)
            torch.bitwise_left_shift(src[:, k + 1], 64 - sh, out=t)
            col.bitwise_or_(t)
        col.bitwise_and_((1 << w8) - 1)
    return g * q, g * r * 8


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
