"""A user-space Ethernet switch with a delay line, for the testbed's far links
(``bench/netbed.py --rtt MS [--loss PCT]``): this kernel has no netem, so the delay is added
here.

Usage (inside the testbed's switch namespace, as root; ``bench/netbed.py`` starts it)::

    python bench/netbed_delay.py --ports h0,h1,h2 --delay-ms 25 [--loss 0.1] [--seed 1]

It opens one ``AF_PACKET`` socket per switch port (the switch side of each host's veth),
learns which MAC address lives behind which port, and forwards every frame that arrives on a
port to the port of its destination (floods broadcasts and unknown destinations) after
``--delay-ms`` milliseconds: one traversal of the switch, so a round trip between two hosts
takes ``2 x delay`` on top of the links' own time. The links keep their ``tbf`` rate limits
(both ends of each veth), so frames are delayed and then shaped on the way to the host, as on
a long link. Frames keep their order per port pair.

The sockets use ``PACKET_VNET_HDR``: the kernel hands over its segmentation offload frames
(up to 64 KiB of TCP payload) with a virtio header, and segments them again when they are sent
on, so the switch moves a few thousand frames per second even at 1 Gbit. ``--loss`` drops that
percentage of frames at random (one frame may carry many TCP segments: the loss is per frame,
bursty, not per packet). It runs until SIGTERM or SIGINT, then prints how many frames it
forwarded, dropped and flooded.
"""

from __future__ import annotations

import argparse
import heapq
import random
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["DelaySwitch", "main"]

ETH_P_ALL = 0x0003
PACKET_VNET_HDR = 15
SOL_PACKET = 263  # (not in the socket module on every Python)
PACKET_OUTGOING = 4
VNET_HDR_BYTES = 10
#: Largest frame read at once: a 64 KiB offload frame, its Ethernet and virtio headers.
FRAME_BYTES = (64 << 10) + 256


class DelaySwitch:
    """The switch: ``ports`` (interface names), one-way ``delay`` (seconds), ``loss``
    (fraction of frames dropped, 0 to 1)."""

    def __init__(self, ports: Sequence[str], delay: float, loss: float = 0.0,
                 seed: int = 1) -> None:
        if delay < 0 or not 0 <= loss < 1:
            raise ValueError("delay must be >= 0 and loss in [0, 1)")
        self.delay = delay
        self.loss = loss
        self._random = random.Random(seed)
        self.socks: list[socket.socket] = []
        for name in ports:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.bind((name, 0))
            self.socks.append(s)
        self._where: dict[bytes, int] = {}  # MAC address -> port index
        self._queue: list[tuple[float, int, int, bytes]] = []  # (due, order, port, frame)
        self._order = 0
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self.forwarded = self.dropped = self.flooded = 0

    def _receive(self) -> None:
        poller = select.poll()
        by_fd = {s.fileno(): i for i, s in enumerate(self.socks)}
        for s in self.socks:
            poller.register(s, select.POLLIN)
        while not self._stop.is_set():
            for fd, _ in poller.poll(200):
                port = by_fd[fd]
                frame, addr = self.socks[port].recvfrom(FRAME_BYTES)
                if addr[2] == PACKET_OUTGOING:  # our own sends, seen on the way out
                    continue
                self._route(port, frame)

    def _route(self, port: int, frame: bytes) -> None:
        if len(frame) < VNET_HDR_BYTES + 14:
            return
        eth = VNET_HDR_BYTES
        dst, src = frame[eth:eth + 6], frame[eth + 6:eth + 12]
        self._where[src] = port
        if self.loss and self._random.random() < self.loss:
            self.dropped += 1
            return
        due = time.monotonic() + self.delay
        out = self._where.get(dst) if not dst[0] & 1 else None  # group bit: broadcast
        targets = [out] if out is not None and out != port else \
            [i for i in range(len(self.socks)) if i != port]
        if len(targets) > 1:
            self.flooded += 1
        with self._cv:
            for t in targets:
                heapq.heappush(self._queue, (due, self._order, t, frame))
                self._order += 1
            self._cv.notify()

    def _send(self) -> None:
        while True:
            with self._cv:
                while not self._stop.is_set():
                    if self._queue:
                        wait = self._queue[0][0] - time.monotonic()
                        if wait <= 0:
                            break
                        self._cv.wait(wait)
                    else:
                        self._cv.wait(0.2)
                if self._stop.is_set():
                    return
                _, _, port, frame = heapq.heappop(self._queue)
            try:
                self.socks[port].send(frame)
                self.forwarded += 1
            except OSError:  # a link going down at the end of a run
                self.dropped += 1

    def run(self) -> None:
        """Forward until :meth:`stop`."""
        sender = threading.Thread(target=self._send, daemon=True)
        sender.start()
        try:
            self._receive()
        finally:
            self._stop.set()
            with self._cv:
                self._cv.notify()
            sender.join(2)
            for s in self.socks:
                s.close()

    def stop(self) -> None:
        self._stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ports", required=True, help="comma list of switch ports")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay")
    p.add_argument("--loss", type=float, default=0.0, help="percent of frames dropped")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    switch = DelaySwitch(args.ports.split(","), args.delay_ms / 1e3, args.loss / 100,
                         args.seed)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: switch.stop())
    print(f"delay line up: {len(switch.socks)} ports, {args.delay_ms} ms one way, "
          f"{args.loss}% loss", flush=True)
    switch.run()
    print(f"delay line: {switch.forwarded} frames forwarded, {switch.dropped} dropped, "
          f"{switch.flooded} flooded", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
