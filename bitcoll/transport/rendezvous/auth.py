"""Job secrets and HMAC proofs for the TCP backend (store connections and peer hellos).

Threat model: the job's own processes are trusted; other local users and the network are not.
Every connection a rank accepts or makes (to the rendezvous store, to a peer) starts with a
challenge-response in which both ends prove that they know the job's *secret*, over fresh
nonces from both sides, so that neither a replayed nor a relayed handshake verifies. No
secret ever crosses a socket.

Where the secret comes from (:func:`job_secret`, in this order):

1. ``BITCOLL_SECRET``: any non-empty string, the same on every rank. ``python -m launch``
   generates one per job (single node) and passes it to its ranks; users of other launchers
   set it themselves for multi-host jobs. Every proof of it can be tested against guesses
   offline by whoever sees or provokes one, so for a job on several hosts (its rendezvous
   address is not a loopback address) a secret shorter than :data:`MIN_SECRET_BYTES` bytes
   (128 bits) is refused (:func:`check_secret`) unless ``BITCOLL_WEAK_SECRET=1``.
2. ``BITCOLL_INSECURE=1``: no secret (the proofs are computed with an empty key, i.e. they
   prove nothing). For a trusted network only; documented as an explicit opt-out. Frame
   integrity (``integrity=True``) is refused with it: its keys would come from the empty
   secret and the job id, which travels in clear.
3. Otherwise a *secret file*: rank 0 writes 32 random bytes into a new file that only its user
   can read (:class:`SecretFile`, mode 0600 in a 0700 directory) and tells the other ranks its
   path (the path is not secret). A rank that cannot read the file, or finds it owned by
   another user or readable by others, refuses to start: its ranks are then on several hosts
   and need ``BITCOLL_SECRET``.

The proof is ``HMAC-SHA256(secret, label || fields)`` where every field is length-prefixed, so
that no two different field lists give the same message. Labels name the role of the message
("store-client", "hello-accept", ...), which binds the direction.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import struct
import tempfile
from typing import Final

from ...errors import UsageError

__all__ = [
    "SECRET_ENV",
    "INSECURE_ENV",
    "WEAK_SECRET_ENV",
    "MIN_SECRET_BYTES",
    "check_secret",
    "is_loopback",
    "NONCE_BYTES",
    "MAC_BYTES",
    "mac",
    "verify",
    "new_nonce",
    "env_secret",
    "SecretFile",
    "read_secret_file",
]

SECRET_ENV: Final = "BITCOLL_SECRET"
INSECURE_ENV: Final = "BITCOLL_INSECURE"
#: ``BITCOLL_WEAK_SECRET=1`` lets a job on several hosts use a secret shorter than
#: :data:`MIN_SECRET_BYTES` (the user's explicit choice).
WEAK_SECRET_ENV: Final = "BITCOLL_WEAK_SECRET"
#: Shortest ``BITCOLL_SECRET`` (UTF-8 bytes) a job on several hosts accepts: 128 bits.
MIN_SECRET_BYTES: Final = 16
#: Bytes of every nonce (128 bits: never repeats).
NONCE_BYTES: Final = 16
#: Bytes of every proof (HMAC-SHA256).
MAC_BYTES: Final = 32
#: Bytes of a generated secret.
SECRET_BYTES: Final = 32
#: The key of an insecure job (``BITCOLL_INSECURE=1``): proves nothing.
INSECURE_SECRET: Final = b""

_LEN: Final = struct.Struct("<I")


def _field(value: bytes | str | int) -> bytes:
    if isinstance(value, int):
        raw = str(value).encode("ascii")
    elif isinstance(value, str):
        raw = value.encode("utf-8")
    else:
        raw = bytes(value)
    return _LEN.pack(len(raw)) + raw


def mac(secret: bytes, label: str, *fields: bytes | str | int) -> bytes:
    """``HMAC-SHA256(secret, label, fields...)`` with every part length-prefixed
    (:data:`MAC_BYTES` bytes)."""
    msg = _field(label) + b"".join(_field(f) for f in fields)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def verify(secret: bytes, proof: bytes, label: str, *fields: bytes | str | int) -> bool:
    """True when ``proof`` is :func:`mac` of the same inputs (constant-time comparison)."""
    return hmac.compare_digest(bytes(proof), mac(secret, label, *fields))


def new_nonce() -> bytes:
    """A fresh random nonce of :data:`NONCE_BYTES` bytes."""
    return secrets.token_bytes(NONCE_BYTES)


def env_secret(environ: dict[str, str] | None = None) -> bytes | None:
    """The secret the environment gives: ``BITCOLL_SECRET`` (UTF-8), :data:`INSECURE_SECRET`
    with ``BITCOLL_INSECURE=1``, or None when neither is set (a secret file is then used).

    Raises UsageError for an empty ``BITCOLL_SECRET`` or a ``BITCOLL_INSECURE`` other than
    ``0``/``1``."""
    env = os.environ if environ is None else environ
    if SECRET_ENV in env:
        value = env[SECRET_ENV]
        if not value:
            raise UsageError(f"{SECRET_ENV} is set but empty; set it to the same non-empty "
                             "string on every rank, or unset it")
        return value.encode("utf-8")
    insecure = env.get(INSECURE_ENV, "0")
    if insecure not in ("0", "1", ""):
        raise UsageError(f"{INSECURE_ENV} must be 0 or 1, got {insecure!r}")
    if insecure == "1":
        return INSECURE_SECRET
    return None


def check_secret(secret: bytes | None, multi_host: bool, integrity: bool,
                 environ: dict[str, str] | None = None) -> None:
    """Refuse settings that leave the job's proofs weak (UsageError, before any connection):

    * ``integrity`` with the insecure empty secret (``BITCOLL_INSECURE=1``): the frame keys
      would be derived from nothing secret, so the tags would protect nothing;
    * for a ``multi_host`` job, a hand-set ``secret`` shorter than :data:`MIN_SECRET_BYTES`
      bytes, unless ``BITCOLL_WEAK_SECRET=1``: every proof of the secret (the store's, a
      peer's, one seen on the network) lets it be guessed offline, at the speed of HMAC.

    ``secret``: what :func:`env_secret` returned (None: a generated secret file is used)."""
    env = os.environ if environ is None else environ
    if secret == INSECURE_SECRET:
        if integrity:
            raise UsageError(f"integrity=True cannot be combined with {INSECURE_ENV}=1: without "
                             "a secret the frame keys come from the job id alone, which "
                             f"travels in clear, and the tags protect nothing; set "
                             f"{SECRET_ENV} (or unset {INSECURE_ENV}) to use integrity")
        return
    if secret is None or not multi_host or len(secret) >= MIN_SECRET_BYTES:
        return
    weak = env.get(WEAK_SECRET_ENV, "0")
    if weak not in ("0", "1", ""):
        raise UsageError(f"{WEAK_SECRET_ENV} must be 0 or 1, got {weak!r}")
    if weak != "1":
        raise UsageError(
            f"{SECRET_ENV} has {len(secret)} bytes; a job on several hosts needs at least "
            f"{MIN_SECRET_BYTES} (128 bits), since its proofs can be tested against guesses "
            "offline: use e.g. python -c \"import secrets; print(secrets.token_hex(16))\", "
            f"or set {WEAK_SECRET_ENV}=1 to accept the risk")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) resolves only to loopback addresses (False
    when it does not resolve)."""
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback
                               for i in infos)


#: Where secret files go: ``bitcoll-<uid>`` in this directory when it is writable (memory, not
#: disk), else in the temporary directory.
SHARED_DIR = "/dev/shm"


def _private_dir() -> tuple[str, bool]:
    """A directory only this user can enter (created with mode 0700 if needed), and whether
    it is a fresh one made for this secret alone (the usual name was taken by someone else:
    its owner removes it with the file)."""
    base = SHARED_DIR if os.path.isdir(SHARED_DIR) and os.access(SHARED_DIR, os.W_OK) \
        else tempfile.gettempdir()
    path = os.path.join(base, f"bitcoll-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        # Someone else owns the name (or it is a link): use a fresh private directory.
        return tempfile.mkdtemp(prefix="bitcoll-"), True
    return path, False


class SecretFile:
    """A fresh random secret in a file only this user can read (rank 0's side).

    ``SecretFile()`` creates the file (``O_EXCL``, mode 0600, random name in a private
    directory); :attr:`secret` is its content and :attr:`path` its name, to be published to the
    other ranks. :meth:`remove` deletes it (idempotent), once every rank has read it, and
    with it the directory when it was a fresh fallback one (``bitcoll-<uid>`` taken by
    someone else); both are also removed at interpreter exit if still there.
    """

    def __init__(self) -> None:
        self.secret = secrets.token_bytes(SECRET_BYTES)
        folder, self._own_dir = _private_dir()
        self.path = os.path.join(folder, f"secret-{secrets.token_hex(16)}")
        atexit.register(self.remove)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         0o600)
            try:
                os.write(fd, self.secret)
            finally:
                os.close(fd)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Delete the file (and a fallback directory of its own). Idempotent; never
        raises."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self._own_dir:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))
        atexit.unregister(self.remove)


def read_secret_file(path: str) -> bytes:
    """Read a secret written by :class:`SecretFile` (the other ranks' side).

    Raises UsageError when the file cannot be read (another host: the message says to set
    ``BITCOLL_SECRET``), is not a regular file, is owned by another user, can be read by
    others, or does not hold exactly :data:`SECRET_BYTES` bytes."""
    hint = (f"the job's ranks seem to run on several hosts: set {SECRET_ENV} to the same "
            f"non-empty string on every rank (or {INSECURE_ENV}=1 on a trusted network)")
    try:
        # O_NONBLOCK: opening a FIFO planted under the hinted name must not block (the check
        # below then refuses it); no effect on a regular file.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise UsageError(f"cannot read the job's secret file {path!r} made by rank 0 "
                         f"({exc.strerror}); {hint}", argument=SECRET_ENV) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise UsageError(f"the job's secret file {path!r} is not a private file of this "
                             f"user (uid {st.st_uid}, mode {st.st_mode & 0o777:o}); refusing "
                             f"it; {hint}")
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != SECRET_BYTES:
        raise UsageError(f"the job's secret file {path!r} holds {len(data)} bytes, expected "
                         f"{SECRET_BYTES}")
    return data
