"""Recovering from failures: on every failure the owner ends the generation, runs the
decision center on the survivors and publishes the next generation; a failure before every
rank of it is ready starts the decision again with the new survivors.

What survivors hold when a failure strikes: the blocks of the last generation whose
first step committed (the decision center's settled plan), plus what a later one moved to
them (workers drop blocks only once their generation's first step commits). So a decision
starts from the settled plan (``DecisionCenter.on_failure``): a failure during a recovery
restarts the decision with the new survivor set, from the same ground. Where no survivor
holds some block, the run rolls back: to the last in-memory snapshot, or, before the first
one, to its start (``snapshot_following``). A failure of a rank
the running generation does not use (an idle worker, a joiner not taken back yet) ends
nothing: the decision center only counts it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from odyssey_megatron.estimator.host_memory import budget_problem, run_host_memory
from odyssey_megatron.planner import Decision
from odyssey_megatron.runtime.control.console import CONSOLE, recovery_line
from odyssey_megatron.runtime.control.decision_record import decision_record
from odyssey_megatron.runtime.control.detector import Cause, Failure
from odyssey_megatron.runtime.control.run_state import RunState
from odyssey_megatron.runtime.control.snapshot_following import SnapshotFollowing

__all__ = ["Recovery"]

log = logging.getLogger(__name__)
console = logging.getLogger(CONSOLE)


@dataclass
class _Underway:
    """Times (wall clock) of one recovery, recorded when its first step commits. A failure
    before then makes it a longer recovery, not a new one."""

    generation: int
    failures: list[Failure]
    """Every failure the recovery handles, the first one first."""
    restarts: int
    """Decisions it started again because of a later failure."""
    decided_at: float
    record: dict
    """The decision: policy, alternatives, bytes moved."""
    committed_before: int
    """Steps committed when the recovery began: a rollback trains again those after its snapshot."""
    ready_at: Optional[float] = None


class Recovery:
    def __init__(self, run: RunState, snapshots: SnapshotFollowing, *, check_stop: Callable[[], None]):
        """``check_stop`` raises where a stop was asked for (``StopWriter.stop_if_asked``)."""
        self.run, self.snapshots, self.check_stop = run, snapshots, check_stop
        self.underway: Optional[_Underway] = None
        """The recovery whose generation has not committed its first step yet."""

    def outside_the_generation(self, failure: Failure) -> bool:
        """Whether ``failure`` touches no rank of the running generation (an idle worker, a
        joiner not taken back yet): then the decision center only counts it, and training
        goes on."""
        run = self.run
        if self.underway is not None or run.running_ranks() & set(failure.ranks):
            return False
        run.center.on_idle_failure(ranks=failure.ranks, at_s=run.now_s())
        run.newcomers -= {run.center.cluster.worker_of(r) for r in failure.ranks}
        self.snapshots.failed(failure)
        log.info("run: ranks %s failed outside generation %d, which trains on", list(failure.ranks),
                 run.plan.generation)
        return True

    def recover(self, failure: Failure) -> None:
        """Decide and publish the next generation after ``failure``; a failure before
        every rank of it is ready restarts the decision with the new survivors."""
        run = self.run
        failures, seen, restarts, before = [failure], [], 0, None
        if self.underway is not None:  # the last recovery had not reached its first step
            seen, restarts = list(self.underway.failures), self.underway.restarts + 1
            before = self.underway.committed_before
        while failures:
            run.stop_preparing()
            time.sleep(run.timeouts.poll_interval)  # ranks failing together arrive together
            while (more := run.controller.next_failure(timeout=0)) is not None:
                failures.append(more)
            seen += failures
            for f in failures:
                self.snapshots.failed(f)
            run.newcomers -= {run.center.cluster.worker_of(r) for f in failures for r in f.ranks}
            run.end_generation()
            before = run.committed if before is None else before
            decision = self._decide(failures, committed_before=before)
            if decision.rollback is not None:
                self.snapshots.roll_back(decision.rollback)
            elif decision.from_start:
                self.snapshots.roll_back_to_start()
            self.underway = _Underway(generation=decision.chosen.plan.generation, failures=list(seen),
                                      restarts=restarts, decided_at=time.time(),
                                      record=decision_record(decision, run.center, start_step=run.committed,
                                                             committed=before),
                                      committed_before=before)
            run.publish(decision.chosen.plan, decision.chosen.estimate.step_time_s, snapshot=self.snapshots.kept,
                        snapshot_interval=self.snapshots.interval, restore=decision.rollback)
            late = run.wait_ready(self.check_stop)
            failures = [late] if late is not None else []
            restarts += 1
        self.underway.ready_at = time.time()

    def _decide(self, failures: list[Failure], *, committed_before: int) -> Decision:
        """Run the decision center on the new survivors; ``committed_before``: steps
        committed when the recovery began."""
        run = self.run
        # A lost node comes as the ranks it held: the decision center needs no node numbering.
        ranks = sorted({r for f in failures for r in f.ranks})
        # Fresh (no step committed yet), every block is drawn again from the seed or checkpoint;
        # so it is, the steps since trained again, where no survivor and no snapshot holds some block.
        decision = run.center.on_failure(ranks=ranks, at_s=run.now_s(), in_memory=not run.fresh,
                                         snapshot=self.snapshots.source(committed_before),
                                         start_replay_steps=self.snapshots.start_replay_steps(committed_before),
                                         removed=all(f.cause == Cause.STRAGGLER for f in failures))
        log.info("run: generation %d (%s) after ranks %s failed", decision.chosen.plan.generation,
                 decision.chosen.policy, ranks)
        budget = run.config.cluster.host_memory_gib
        if budget is not None:  # checked before the run for its starting plan; a recovery goes on, said aloud
            problem = budget_problem(run_host_memory(run.config, decision.chosen.plan, run.center.cluster), budget)
            if problem is not None:
                console.warning("generation %d: over cluster.host_memory_gib: %s", decision.chosen.plan.generation,
                                problem)
        return decision

    def finish(self, generation: int, *, first_step_at: float) -> None:
        """Record the recovery once ``generation``'s first step committed, if it is its."""
        r = self.underway
        if r is None or r.generation != generation:
            return
        failed_at, detected_at = min(f.failed_at for f in r.failures), min(f.detected_at for f in r.failures)
        record = dict(
            generation=r.generation, failed_ranks=sorted({rank for f in r.failures for rank in f.ranks}),
            cause=",".join(sorted({f.cause.value for f in r.failures})), failed_at=failed_at, detected_at=detected_at,
            decided_at=r.decided_at, ready_at=r.ready_at, first_step_at=first_step_at,
            detection_s=detected_at - failed_at, to_plan_s=r.decided_at - failed_at,
            to_first_step_s=first_step_at - failed_at, restarts=r.restarts, **r.record)
        self.run.controller.record.event("recovery", **record)
        console.info(recovery_line(record))
        self.underway = None
