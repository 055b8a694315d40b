"""How a receiver judges a sender alive: on its own monotonic clock, by watching the
sender's heartbeat sequence number change, so clock skew between nodes never fails a worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from odyssey_megatron.runtime.protocol.messages import Heartbeat


def missed_beat(exc: BaseException) -> bool:
    """Whether a store error is a read that timed out (a beat missed: on a busy node the
    store may answer late; staleness decides) rather than a closed connection (the
    controller is gone). By type: a TCPStore read past its timeout raises
    ``DistStoreError``; a closed or refused connection ``DistNetworkError`` (both provoked
    in tests/test_missed_beat.py)."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistStoreError)


@dataclass
class HeartbeatWatch:
    """One receiver's view of one sender: when (receiver's monotonic clock) the sender's
    sequence number last changed. Stale once it has not changed for ``timeout`` seconds."""

    timeout: float
    changed_at: float
    """Monotonic time of the last change; the start of watching counts as one."""
    last: Optional[Heartbeat] = None

    def see(self, beat: Heartbeat, now: float) -> None:
        if self.last is None or beat.seq != self.last.seq:
            self.last = beat
            self.changed_at = now

    def stale(self, now: float) -> bool:
        return now - self.changed_at > self.timeout
