"""The authenticated peer hello of the TCP transport (wire format and checks, no sockets).

The lower rank ``a`` of a pair connects to the higher rank ``b`` at the address ``b``
published (``addr_b``, the text ``"<port> <host>"``) and the two exchange four messages,
all little-endian:

1. ``a -> b`` :data:`HELLO_SIZE` bytes: ``u32 magic, u16 version, u16 kind=1, u32 rank a,
   u32 world size, u64 job id, 16-byte nonce_a``.
2. ``b -> a`` :data:`ACCEPT_SIZE` bytes: the same fields for ``b`` (kind 2, its rank, its
   ``nonce_b``) followed by ``proof_b = mac(secret, "hello-accept", job, size, a, b, nonce_a,
   nonce_b, addr_b)``.
3. ``a -> b`` :data:`CONFIRM_SIZE` bytes: ``proof_a = mac(secret, "hello-connect", job, size,
   a, b, nonce_a, nonce_b, addr_b)``.
4. ``b -> a`` :data:`DONE_SIZE` bytes: ``mac(secret, "hello-done", job, size, a, b, nonce_a,
   nonce_b, addr_b)``: ``b`` has verified ``proof_a`` and keeps the connection.

``b`` accepts the connection once ``proof_a`` verifies (and it has sent message 4), ``a`` once
``proof_b`` and message 4 do. The proofs cover fresh nonces of both ends (a recorded hello does
not verify on another connection), the job, both ranks and the direction (the labels differ),
and the address ``a`` dialed: a process that relays ``a``'s connection to ``b`` from another
address fails, because ``a`` computes the proof over the relay's address and ``b`` over its
own. Message 4 makes the outcome the same on both ends: ``b`` may drop a connection that has
not proven itself in time (it cannot tell a slow rank from a stranger), and ``a`` then sees the
connection end before message 4 and dials again, instead of starting the job over a
connection ``b`` has closed.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import Final

from ..wire import MAGIC, PROTOCOL_VERSION
from . import auth

__all__ = ["HELLO_SIZE", "ACCEPT_SIZE", "CONFIRM_SIZE", "DONE_SIZE", "Hello", "proof", "verify"]

_FIXED: Final = struct.Struct("<IHHIIQ")  # magic, version, kind, rank, world size, job id
KIND_HELLO: Final = 1
KIND_ACCEPT: Final = 2
HELLO_SIZE: Final = _FIXED.size + auth.NONCE_BYTES
ACCEPT_SIZE: Final = HELLO_SIZE + auth.MAC_BYTES
CONFIRM_SIZE: Final = auth.MAC_BYTES
DONE_SIZE: Final = auth.MAC_BYTES


@dataclass(frozen=True)
class Hello:
    """The fixed part of messages 1 and 2."""

    kind: int
    rank: int
    size: int
    job_id: int
    nonce: bytes
    magic: int = MAGIC
    version: int = PROTOCOL_VERSION

    def pack(self) -> bytes:
        return _FIXED.pack(self.magic, self.version, self.kind, self.rank, self.size,
                           self.job_id) + self.nonce

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Hello:
        """Decode the first :data:`HELLO_SIZE` bytes of ``data`` (never raises for any
        bytes of that length)."""
        magic, version, kind, rank, size, job = _FIXED.unpack_from(data)
        nonce = bytes(data[_FIXED.size:HELLO_SIZE])
        return cls(kind, rank, size, job, nonce, magic, version)

    def matches(self, kind: int, size: int, job_id: int) -> bool:
        """True for a message of this protocol, ``kind``, world ``size`` and job."""
        return (self.magic == MAGIC and self.version == PROTOCOL_VERSION and self.kind == kind
                and self.size == size and self.job_id == job_id)


def proof(secret: bytes, role: str, job_id: int, size: int, a: int, b: int, nonce_a: bytes,
          nonce_b: bytes, addr_b: str) -> bytes:
    """The proof of ``role`` ("accept" from ``b``, "connect" from ``a``, "done" from ``b``)."""
    return auth.mac(secret, f"hello-{role}", job_id, size, a, b, nonce_a, nonce_b, addr_b)


def verify(secret: bytes, given: bytes | bytearray | memoryview, role: str, job_id: int,
           size: int, a: int, b: int, nonce_a: bytes, nonce_b: bytes, addr_b: str) -> bool:
    """True when ``given`` is the :func:`proof` of ``role`` (constant-time comparison)."""
    return hmac.compare_digest(bytes(given), proof(secret, role, job_id, size, a, b, nonce_a,
                                                   nonce_b, addr_b))
