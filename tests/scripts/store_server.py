"""Serve a rendezvous store in a process of its own, for tests that measure the server's process
(RSS, threads, descriptors) or limit it (RLIMIT_NOFILE).

    python store_server.py SECRET_HEX [--nofile N] [--auth-seconds S] [--io-seconds S]

Prints ``PORT <port>`` once serving. Prints ``ACCEPT-FAILED <message>`` the first time the
accept loop reports an error (EMFILE...). Then reads commands on stdin, one a line, and answers
each on stdout: ``ping`` -> ``PONG``; ``threads`` -> ``THREADS <names of the Python threads,
comma-separated>``; ``quit`` (or end of input) closes the server and prints
``CLOSED <seconds close() took>`` before exiting 0.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import threading
import time

from bitcoll.transport.rendezvous.store import StoreServer

_out_lock = threading.Lock()


def _say(line: str) -> None:
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class _FirstAcceptFailure(logging.Handler):
    """Reports the first "accept failed" record of the store on stdout (only the first: the
    test may not read stdout while it floods the server)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.seen:
            return
        msg = record.getMessage()
        if "accept failed" in msg:
            self.seen = True
            _say(f"ACCEPT-FAILED {msg}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("secret_hex")
    parser.add_argument("--nofile", type=int, default=0)
    parser.add_argument("--auth-seconds", type=float, default=5.0)
    parser.add_argument("--io-seconds", type=float, default=30.0)
    args = parser.parse_args()
    logger = logging.getLogger("bitcoll.store")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(_FirstAcceptFailure())
    logger.propagate = False
    if args.nofile:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, hard))
    server = StoreServer("127.0.0.1", 0, secret=bytes.fromhex(args.secret_hex),
                         auth_seconds=args.auth_seconds, io_seconds=args.io_seconds)
    _say(f"PORT {server.port}")
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "ping":
            _say("PONG")
        elif cmd == "threads":
            _say("THREADS " + ",".join(sorted(t.name for t in threading.enumerate())))
        elif cmd == "quit":
            break
    t0 = time.monotonic()
    server.close()
    threads = ",".join(sorted(t.name for t in threading.enumerate()))
    _say(f"CLOSED {time.monotonic() - t0:.3f} {threads}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
