"""Small programs that ``bench/netbed.py`` runs inside the testbed's namespaces (by path, with
the testbed's interpreter). Standard library only, so that they start fast.

Usage::

    python bench/netbed_helpers.py pin CPUS COMMAND [ARGS...]
    python bench/netbed_helpers.py probe-server PORT
    python bench/netbed_helpers.py probe-client ADDRESS PORT BYTES

``pin``: pin this process to the cores ``CPUS`` (a comma list, e.g. ``0,1``), then exec
``COMMAND`` (searched on ``PATH``) with its arguments, which inherits the pinning.

``probe-server``: accept one TCP connection on ``PORT`` (all addresses), read until the peer
closes it, print the rate in Gbit/s from the first byte received to the last.

``probe-client``: connect to ``ADDRESS:PORT`` (retrying for up to
:data:`CONNECT_DEADLINE` seconds while the server starts), send ``BYTES`` bytes (whole MiB,
rounded down) and close.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["CHUNK", "CONNECT_DEADLINE", "parse_cpus", "pin_and_exec", "probe_client",
           "probe_server", "main"]

#: Bytes per send and per receive.
CHUNK = 1 << 20
#: Seconds the client keeps trying to connect.
CONNECT_DEADLINE = 10.0


def parse_cpus(text: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``; ValueError for anything but a comma list of cores."""
    try:
        cpus = [int(c) for c in text.split(",")]
    except ValueError:
        cpus = []
    if not cpus or min(cpus) < 0:
        raise ValueError(f"expected a comma list of cores, got {text!r}")
    return cpus


def pin_and_exec(cpus: Sequence[int], command: Sequence[str]) -> NoReturn:
    """Pin this process to ``cpus`` and replace it with ``command`` (never returns)."""
    os.sched_setaffinity(0, cpus)
    os.execvp(command[0], list(command))


def probe_server(port: int) -> float:
    """Receive one connection's bytes on ``port``; return the rate in Gbit/s (0 when the
    peer sent nothing)."""
    with socket.create_server(("0.0.0.0", port)) as server:
        conn, _ = server.accept()
    buf = bytearray(CHUNK)
    got = 0
    t0: float | None = None
    with conn:
        while True:
            k = conn.recv_into(buf)
            if not k:
                break
            if t0 is None:
                t0 = time.perf_counter()
            got += k
    if t0 is None:
        return 0.0
    return got * 8 / (time.perf_counter() - t0) / 1e9


def probe_client(address: str, port: int, nbytes: int) -> None:
    """Send ``nbytes`` (rounded down to whole :data:`CHUNK`) to ``address:port``."""
    deadline = time.monotonic() + CONNECT_DEADLINE
    while True:
        try:
            conn = socket.create_connection((address, port))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    data = bytes(CHUNK)
    with conn:
        for _ in range(nbytes // CHUNK):
            conn.sendall(data)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="netbed_helpers.py",
                                description="Helper programs of bench/netbed.py.")
    sub = p.add_subparsers(dest="command", required=True)
    pin = sub.add_parser("pin", help="pin to cores, then exec a command")
    pin.add_argument("cpus", help="comma list of cores, e.g. 0,1")
    pin.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND ...")
    server = sub.add_parser("probe-server", help="receive one stream, print Gbit/s")
    server.add_argument("port", type=int)
    client = sub.add_parser("probe-client", help="send BYTES to ADDRESS:PORT")
    client.add_argument("address")
    client.add_argument("port", type=int)
    client.add_argument("nbytes", type=int, metavar="BYTES")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["pin"]:
        # by hand: the command is passed on exactly as given, ``--`` and options included
        if len(raw) < 3:
            ap.error("pin: give the cores and the command to run")
        try:
            cpus = parse_cpus(raw[1])
        except ValueError as exc:
            ap.error(f"pin: {exc}")
        pin_and_exec(cpus, raw[2:])
    args = ap.parse_args(raw)
    if args.command == "probe-server":
        print(probe_server(args.port), flush=True)
    else:
        probe_client(args.address, args.port, args.nbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
