"""The event-driven engine: every system lives through the same events.

Between events a system trains at its current throughput (times the share of time not
spent saving checkpoints, the same for all systems). At an event it reports an
``Outcome``: a pause, a new throughput and progress lost; the engine turns that into
segments of a timeline. An event during a pause cuts the pause short and the system's
next outcome decides what follows. Samples lost to a rollback are subtracted from
progress, never below zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.simulator.events import FAIL, ClusterEvent
from odyssey_megatron.simulator.system import STOPPED, TRAINING, System


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    state: str
    samples_per_s: float
    active_devices: int


@dataclass
class Timeline:
    system: str
    segments: list[Segment] = field(default_factory=list)
    lost_samples: float = 0.0
    notes: list[tuple[float, str]] = field(default_factory=list)

    @property
    def samples(self) -> float:
        trained = sum((s.end_s - s.start_s) * s.samples_per_s for s in self.segments)
        return max(0.0, trained - self.lost_samples)

    def time_in(self, *states: str) -> float:
        return sum(s.end_s - s.start_s for s in self.segments if s.state in states)


def run_system(
    system: System,
    *,
    cluster: ClusterState,
    events: list[ClusterEvent],
    duration_s: float,
    checkpoint_duty: float,
    on_event: Callable[[], None] | None = None,
) -> Timeline:
    """Live through ``events`` with ``system``; ``checkpoint_duty`` is the share of
    training time not blocked by checkpoint saves; ``on_event`` is called after each event
    (progress reporting)."""
    timeline = Timeline(system.name)
    rate = system.start(cluster) * checkpoint_duty
    state, resume_at, last_event = TRAINING, 0.0, 0.0

    def advance(until: float) -> None:
        nonlocal state
        start = timeline.segments[-1].end_s if timeline.segments else 0.0
        if state != TRAINING and start < until:
            pause_end = min(resume_at, until)
            if pause_end > start:
                timeline.segments.append(Segment(start, pause_end, state, 0.0, cluster.alive_devices))
                start = pause_end
            if pause_end >= resume_at:
                state = TRAINING if rate > 0 else STOPPED
        if start < until:
            current = TRAINING if rate > 0 else STOPPED
            timeline.segments.append(Segment(start, until, current, rate, cluster.alive_devices))

    for event in events:
        if event.time_s >= duration_s:
            break
        advance(event.time_s)
        before = cluster
        tp = cluster.tensor_parallel_size
        if event.kind == FAIL:
            cluster = cluster.fail_ranks(event.devices)
            changed = frozenset(cluster.failed_workers - before.failed_workers)
        else:
            cluster = cluster.repair_ranks(event.devices)
            changed = frozenset(before.failed_workers - cluster.failed_workers)
        if not changed:
            continue  # a device of an already-failed TP group, or a repair of a group still down
        outcome = (system.on_failure if event.kind == FAIL else system.on_join)(cluster, changed, event.time_s)
        trained_since = event.time_s - max(last_event, resume_at if state == TRAINING else event.time_s)
        timeline.lost_samples += rate * min(outcome.lost_s, max(0.0, trained_since))
        rate = outcome.samples_per_s * checkpoint_duty
        state, resume_at, last_event = outcome.pause_state, event.time_s + outcome.pause_s, event.time_s
        timeline.notes.append((event.time_s, f"{event.kind} {len(changed) * tp} device(s): {outcome.note}"))
        if on_event is not None:
            on_event()
    advance(duration_s)
    return timeline
