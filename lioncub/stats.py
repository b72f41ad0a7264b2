"""What one distributed optimizer step cost and observed (``DistributedLion.last_stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepStats"]


@dataclass(frozen=True)
class StepStats:
    """Figures of one ``DistributedLion.step`` on this rank.

    ``step``: the 1-based step count. ``compute_seconds``: wall time of the step minus
    ``comm_seconds``, the time this rank was blocked in collective calls (starting them and
    waiting for them; transfers that overlap computation are not counted). ``bytes_sent`` /
    ``bytes_received`` / ``messages_sent`` / ``messages_received``: this rank's traffic during
    the step from ``comm.stats`` (frame headers included; momentum synchronization included).
    ``synced``: names of the tensors whose momenta were averaged after this step.
    ``agreement``: per tensor name, ``sum|S| / (n p levels)`` of the exact vote sums ``S``
    (see :mod:`lioncub.sync`), for the variants whose collective returns sums; None for the
    others. ``device_to_host_bytes`` / ``host_to_device_bytes``: bytes the optimizer copied
    between the parameters' device and host memory during the step (the packed votes out,
    the packed results in, momentum synchronization included); 0 for the numpy core, which
    works on host memory in place. Item access (``stats["comm_seconds"]``) works too.
    """

    step: int
    compute_seconds: float
    comm_seconds: float
    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int
    synced: tuple[str, ...] = ()
    agreement: dict[str, float] | None = field(default=None)
    device_to_host_bytes: int = 0
    host_to_device_bytes: int = 0

    @property
    def host_device_bytes(self) -> int:
        """``device_to_host_bytes + host_to_device_bytes``."""
        return self.device_to_host_bytes + self.host_to_device_bytes

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)
