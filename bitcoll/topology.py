"""Which ranks share a host: ``comm.local_rank``, ``comm.local_size``, ``comm.host_index``.

Every rank names its host with a *host key* (:func:`host_key`), first match wins:

1. ``GROUP_RANK``: the node index torchrun and ``python -m launch`` give every rank
   (``--node-rank``), so two launcher instances on one machine (as on the emulated testbed)
   are two hosts;
2. ``SLURM_NODEID``: Slurm's node index of the task;
3. the host name and the network namespace of the process (``/proc/self/ns/net``), so that
   processes in different namespaces of one machine count as different hosts.

The ranks exchange their keys once (one all-gather of 8-byte digests, done by
``bitcoll.init``); hosts are numbered in the order of their lowest rank, and a rank's local
rank is its position among the ranks of its host in rank order. Hosts may have different
numbers of ranks.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Topology", "host_key", "digest", "usable_cores"]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def host_key(environ: Mapping[str, str] | None = None) -> str:
    """This process's host key (see the module docstring)."""
    env = os.environ if environ is None else environ
    if env.get("GROUP_RANK", "").isdigit():
        return f"group:{int(env['GROUP_RANK'])}"
    if env.get("SLURM_NODEID", "").isdigit():
        return f"slurm:{int(env['SLURM_NODEID'])}"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"host:{socket.gethostname()}/netns:{netns}"


def digest(key: str) -> int:
    """A 63-bit digest of a host key (fits an int64 all-gather)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class Topology:
    """Host of every rank of a communicator: ``hosts[r]`` is rank ``r``'s host index."""

    hosts: tuple[int, ...]
    rank: int

    @classmethod
    def from_digests(cls, digests: Sequence[int], rank: int) -> Topology:
        """Number hosts in the order of their lowest rank."""
        index: dict[int, int] = {}
        hosts = tuple(index.setdefault(int(d), len(index)) for d in digests)
        return cls(hosts, rank)

    def subset(self, members: Sequence[int], new_rank: int) -> Topology:
        """The topology of a sub-communicator over ``members`` (in their new order)."""
        return Topology.from_digests([self.hosts[m] for m in members], new_rank)

    @property
    def host_index(self) -> int:
        return self.hosts[self.rank]

    @property
    def num_hosts(self) -> int:
        return len(set(self.hosts))

    @property
    def local_ranks(self) -> list[int]:
        """The ranks on this rank's host, in rank order."""
        return [r for r, h in enumerate(self.hosts) if h == self.host_index]

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)

    @property
    def oversubscribed(self) -> bool:
        """Whether this rank's host runs more ranks than this process has cores (waiting
        ranks then do not spin: it would keep the awaited rank off the core)."""
        return self.local_size > usable_cores()

    def local_rank_of(self, rank: int) -> int:
        """The local rank of ``rank`` on its host."""
        h = self.hosts[rank]
        return sum(1 for r in range(rank) if self.hosts[r] == h)

    def as_array(self) -> np.ndarray[tuple[int], np.dtype[np.int64]]:
        return np.asarray(self.hosts, dtype=np.int64)
