"""The event-driven engine: every system lives through the same events.

Between events a system trains at its current throughput (times the share of time not
spent saving checkpoints, the same for all systems). At an event it reports an
``Outcome``: a pause, optional ramp phases, a new throughput and progress lost; the
engine turns that into segments of a timeline. An event during a pause or a ramp cuts
it short and the system's next outcome decides what follows. Samples lost to a rollback
are subtracted from progress, never below zero; the wall time they took is kept too
(for the effective training time ratio), and so are the samples a shrunken batch lacked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.simulator.events import FAIL, ClusterEvent
from odyssey_megatron.simulator.system import STOPPED, TRAINING, Horizon, Outcome, Phase, System


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    state: str
    samples_per_s: float
    active_devices: int
    dropped_per_s: float = 0.0


@dataclass
class Timeline:
    system: str
    segments: list[Segment] = field(default_factory=list)
    lost_samples: float = 0.0
    lost_time_s: float = 0.0
    """Wall seconds of training whose progress a rollback threw away."""
    notes: list[tuple[float, str]] = field(default_factory=list)
    horizons: list[Horizon] = field(default_factory=list)
    """The horizon of each Eq. 8 decision (``Outcome.horizon``), in event order."""

    @property
    def samples(self) -> float:
        trained = sum((s.end_s - s.start_s) * s.samples_per_s for s in self.segments)
        return max(0.0, trained - self.lost_samples)

    @property
    def dropped_samples(self) -> float:
        """Samples the steps trained lacked against the job's global batch."""
        return sum((s.end_s - s.start_s) * s.dropped_per_s for s in self.segments)

    def trained_since(self, now_s: float, last_event_s: float) -> float:
        """Seconds trained without a pause up to ``now_s``, counted from ``last_event_s``
        at the earliest (what a rollback at ``now_s`` can throw away)."""
        since = last_event_s
        for segment in reversed(self.segments):
            if segment.end_s <= last_event_s:
                break
            if segment.samples_per_s == 0:
                since = max(since, segment.end_s)
                break
        return max(0.0, now_s - since)

    def time_in(self, *states: str) -> float:
        return sum(s.end_s - s.start_s for s in self.segments if s.state in states)


def _phases(outcome: Outcome, start_s: float, duty: float) -> list[tuple[float, Phase]]:
    """(end time, phase) for the pause and the ramp of ``outcome``, rates scaled by ``duty``."""
    phases = [Phase(outcome.pause_s, 0.0, state=outcome.pause_state), *outcome.ramp]
    ends, t = [], start_s
    for phase in phases:
        t += phase.duration_s
        if phase.duration_s > 0:
            ends.append((t, Phase(phase.duration_s, phase.samples_per_s * duty, phase.dropped_per_s * duty,
                                  phase.state)))
    return ends


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
    rate, dropped = system.start(cluster) * checkpoint_duty, 0.0
    ahead: list[tuple[float, Phase]] = []  # (end time, phase) before ``rate`` applies
    last_event = 0.0

    def add(start: float, end: float, state: str, samples_per_s: float, dropped_per_s: float) -> None:
        timeline.segments.append(Segment(start, end, state, samples_per_s, cluster.alive_devices, dropped_per_s))

    def advance(until: float) -> None:
        start = timeline.segments[-1].end_s if timeline.segments else 0.0
        while ahead and start < until:
            end, phase = ahead[0]
            stop = min(end, until)
            if stop > start:
                add(start, stop, TRAINING if phase.samples_per_s > 0 else phase.state, phase.samples_per_s,
                    phase.dropped_per_s)
                start = stop
            if stop >= end:
                ahead.pop(0)
        if start < until:
            add(start, until, TRAINING if rate > 0 else STOPPED, rate, dropped)

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
        current = timeline.segments[-1].samples_per_s if timeline.segments else rate
        rolled_back = min(outcome.lost_s, timeline.trained_since(event.time_s, last_event))
        timeline.lost_samples += current * rolled_back
        timeline.lost_time_s += rolled_back
        rate, dropped = outcome.samples_per_s * checkpoint_duty, outcome.dropped_per_s * checkpoint_duty
        ahead[:] = _phases(outcome, event.time_s, checkpoint_duty)
        last_event = event.time_s
        timeline.notes.append((event.time_s, f"{event.kind} {len(changed) * tp} device(s): {outcome.note}"))
        if outcome.horizon is not None:
            timeline.horizons.append(outcome.horizon)
        if on_event is not None:
            on_event()
    advance(duration_s)
    return timeline
