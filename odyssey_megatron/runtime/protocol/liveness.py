"""How a receiver judges a sender alive: on its own monotonic clock, by watching the
sender's heartbeat sequence number change, so clock skew between nodes never fails a worker;
and never for the receiver's own lateness: a look that comes late (its process stopped, a
GC pause, swap, a thread held on a lock) measures every sender's silence from itself,
not from before the receiver's stall (``Looks``)."""

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

    def excuse(self, now: float) -> None:
        """The receiver looked late at ``now`` (``Looks``): the sender's silence is measured
        from this look."""
        self.changed_at = max(self.changed_at, now)


@dataclass
class Looks:
    """When a receiver looked at its senders' beats (its monotonic clock), to tell its own
    lateness from theirs. A look more than ``late_after`` after the previous one is late:
    the receiver was away, and beats written meanwhile may not be readable yet (a stopped
    process that hosts the store answers nothing), so the silence before it is no one's.
    At most one late look is excused per ``excuse_every`` seconds, though: with that at
    twice the senders' timeout, a receiver late at every look still finds a dead sender."""

    late_after: float
    excuse_every: float
    looked_at: Optional[float] = None
    excused_at: Optional[float] = None
    """The last look excused."""

    def look(self, now: float) -> float:
        """Count a look at ``now``: the time since the previous look if this one was late
        and excuses the silence before it, else 0."""
        gap = None if self.looked_at is None else now - self.looked_at
        self.looked_at = now
        if gap is None or gap <= self.late_after:
            return 0.0
        if self.excused_at is not None and now - self.excused_at < self.excuse_every:
            return 0.0
        self.excused_at = now
        return gap
