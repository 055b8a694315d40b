"""Growing back onto workers that come back (restarted by their launcher, or on a
replacement node: alive in the detector, failed in the decision center).

They are offered to the decision center (``on_join``) while the generation trains on.
Where Eq. 8 takes them, the owner asks for a handover (``StepLedger.hand_over``): the next
step to commit is the generation's last, every rank applies it and leaves, and the join's
generation starts at the step after it, naming the joining workers
(``PlanPublished.joined``), which receive their blocks by the plan's transfers. A failure
before that generation's first step commits is a failure like any other: the decision
starts again from the settled plan, with what is alive then.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from odyssey_megatron.planner import Decision
from odyssey_megatron.runtime.control.console import CONSOLE, join_line
from odyssey_megatron.runtime.control.decision_record import decision_record
from odyssey_megatron.runtime.control.detector import Failure
from odyssey_megatron.runtime.control.run_state import RunState
from odyssey_megatron.runtime.control.snapshot_following import SnapshotFollowing
from odyssey_megatron.runtime.step_ledger import Outcome

__all__ = ["GrowingBack"]

log = logging.getLogger(__name__)
console = logging.getLogger(CONSOLE)


@dataclass
class _Join:
    """One join: decided while the generation trained, carried out at a step boundary, and
    recorded once its generation's first step commits."""

    workers: list[int]
    decision: Decision
    decided_at: float
    record: dict
    """The decision: policy, alternatives, bytes moved."""
    generation: Optional[int] = None
    """Its generation, once published."""
    handover_step: Optional[int] = None
    """The last step of the generation before it."""
    published_at: Optional[float] = None
    ready_at: Optional[float] = None


class GrowingBack:
    def __init__(self, run: RunState, snapshots: SnapshotFollowing, *, check_stop: Callable[[], None]):
        """``check_stop`` raises where a stop was asked for (``StopWriter.stop_if_asked``)."""
        self.run, self.snapshots, self.check_stop = run, snapshots, check_stop
        self.join: Optional[_Join] = None
        """The join under way, until its generation's first step commits."""

    @property
    def waiting(self) -> bool:
        """A join is decided and waits for its step boundary: its generation is not published."""
        return self.join is not None and self.join.generation is None

    def take_back(self) -> None:
        """Offer the workers that came back (alive in the detector, failed in the decision
        center) to the decision center while the generation trains on; where Eq. 8 grows
        onto them, ask for a handover at the next step boundary."""
        run = self.run
        if run.committed >= run.iters - 1:
            return  # no step left to gain from them
        detector = run.controller.detector
        if detector.starting_ranks():
            return  # a node's workers come back together: one decision for all of them
        cluster = run.center.cluster
        alive = set(detector.alive_ranks())
        back = sorted(w for w in cluster.failed_workers if all(r in alive for r in cluster.worker_ranks(w)))
        if not back:
            return
        run.stop_preparing()
        decided_at = time.time()
        decision = run.center.on_join(workers=back, at_s=run.now_s())
        run.newcomers |= set(back)
        record = decision_record(decision, run.center, start_step=run.committed, committed=run.committed)
        if decision.chosen.plan is decision.replaced:
            run.controller.record.event("join", workers=back, grew=False, decided_at=decided_at, **record)
            log.info("run: workers %s are back; Eq. 8 keeps generation %d (%s)", back, run.plan.generation,
                     decision.note or "no faster plan")
            run.start_preparing()
            return
        joining = sorted(run.newcomers & set(decision.chosen.plan.workers))  # those kept back before too
        self.join = _Join(joining, decision, decided_at, record)
        run.ledger(run.plan).hand_over()
        log.info("run: workers %s are back; generation %d hands over to a %s plan of %d workers at its next step "
                 "boundary", joining, run.plan.generation, decision.chosen.policy, len(decision.chosen.plan.workers))

    def hand_over(self, on_failure: Callable[[Failure], None]) -> None:
        """Once the running generation's last step (the handover) committed, publish the
        join's generation from the step after it; a failure while it is entered goes to
        ``on_failure``, like any other."""
        run, join = self.run, self.join
        if run.committed >= run.iters:  # the run ended before the step boundary came
            run.center.settle(run.plan)
            self.join = None
            return
        if run.ledger(run.plan).decided(run.committed - 1) is not Outcome.LAST:
            return
        join.handover_step, join.published_at = run.committed - 1, time.time()
        plan = join.decision.chosen.plan
        run.publish(plan, join.decision.chosen.estimate.step_time_s, snapshot=self.snapshots.kept,
                    snapshot_interval=self.snapshots.interval)
        join.generation = plan.generation
        while (failure := run.wait_ready(self.check_stop)) is not None:
            on_failure(failure)
            if self.join is None:  # it was a recovery's to finish
                return
        join.ready_at = time.time()

    def interrupt(self, failure: Failure) -> None:
        """A failure before the join's generation trains: the recovery decides from what runs
        (the join waiting for its step boundary is dropped) or from the settled plan (its
        generation being entered), with the joiners still alive among the candidates."""
        if self.join is None:
            return
        run = self.run
        run.controller.record.event("join_interrupted", workers=self.join.workers, generation=self.join.generation,
                                    failed_ranks=list(failure.ranks))
        log.info("run: ranks %s failed during the join of workers %s", list(failure.ranks), self.join.workers)
        if self.waiting:
            run.center.settle(run.plan)
        self.join = None

    def finish(self, generation: int, *, first_step_at: float) -> None:
        """Record the join once ``generation``'s first step committed, if it is its."""
        j, run = self.join, self.run
        if j is None or j.generation != generation:
            return
        record = {**j.record, "generation": j.generation, "workers": j.workers,
                  "ranks": [r for w in j.workers for r in run.center.cluster.worker_ranks(w)], "grew": True,
                  "start_step": run.start_steps[j.generation], "decided_at": j.decided_at,
                  "handover_step": j.handover_step, "published_at": j.published_at, "ready_at": j.ready_at,
                  "first_step_at": first_step_at, "handover_s": j.published_at - j.decided_at,
                  "to_first_step_s": first_step_at - j.decided_at,
                  "training_ranks": len(run.training_ranks(run.plan))}
        run.controller.record.event("join", **record)
        console.info(join_line(record))
        self.join = None
