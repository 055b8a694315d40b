"""The run's owner on node 0, beside the controller: it publishes plans, turns committed
steps into ``samples.jsonl``, and on every failure runs the decision center and
publishes the next generation.

A step is committed when every training rank of its generation has counted into it
(``runtime.step_ledger``: gradients final, optimizer step not yet applied). On a failure
the owner ends the generation (the abort key, which ends every rank's waits) and freezes
the counters from the first step it has not collected: each step the ranks completed
commits, the next one is frozen and applied nowhere, so the commit is decided exactly
once and nothing rolls back: committed steps stay, the rest replays in the next
generation from ``start_step``, on the same global batch. Until a first step commits no
trained state exists, and the plans published say so (``fresh``).

When no survivor holds some block, the decision rolls back to the last complete
in-memory snapshot instead (``_collect_snapshot`` follows them; ``snapshot.restore``):
``samples.jsonl`` forgets the steps after it, and they are trained again on the same
global batches. Two losses in one parity group leave nothing to roll back to: the run
fails, for ``--resume`` from the disk checkpoint.

A stop on purpose (``Controller.request_stop``: a signal, or a node's launcher told to
stop) ends the generation the same way, then orders every worker to write the blocks it is
the first live holder of in the settled plan, as of the last committed step, and marks
that checkpoint the one to resume from once its parts hold every block (``RunStopped``).

Workers that come back (restarted by their launcher, or on a replacement node: alive in
the detector, failed in the decision center) are offered to the decision center
(``on_join``) while the generation trains on. Where Eq. 8 takes them, the owner asks for a
handover (``StepLedger.hand_over``): the next step to commit is the generation's last,
every rank applies it and leaves, and the join's generation starts at the step after it,
naming the joining workers (``PlanPublished.joined``), which receive their blocks by the
plan's transfers. A failure before that generation's first step commits is a failure like
any other: the decision starts again from the settled plan, with what is alive then. A
failure of a rank the running generation does not use (an idle worker, a joiner not taken
back yet) ends nothing: the decision center only counts it.

What survivors hold when a failure strikes: the blocks of the last generation whose
first step committed (the last *settled* plan), plus what a later one moved to them
(workers drop blocks only once their generation's first step commits). So a decision
starts from the settled plan: a failure during a recovery restarts the decision with the
new survivor set, from the same ground.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from odyssey_megatron.config import RecipeConfig
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner import Decision
from odyssey_megatron.restorer import mapping_bytes
from odyssey_megatron.hooks.model import StageSpec
from odyssey_megatron.hooks.training_state import stage_blocks, worker_blocks
from odyssey_megatron.run_dir import append_jsonl, read_jsonl, write_jsonl
from odyssey_megatron.runtime.checkpoint_index import checkpoint_directory, mark_latest, parts_complete
from odyssey_megatron.runtime.control.console import CONSOLE, Progress, join_line, recovery_line
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.detector import Failure
from odyssey_megatron.runtime.control.online_profile import REPRICE_CHANGE, OnlineProfile, Scales
from odyssey_megatron.runtime.final_model import merge_final_parts
from odyssey_megatron.runtime.protocol import (
    RUN_DONE,
    RUN_STOP,
    StopOrder,
    ProtocolError,
    StepReport,
    final_key,
    ready_key,
    snapshot_done_key,
    step_report_key,
    stopped_key,
)
from odyssey_megatron.snapshot.restore import Restore, SnapshotRecord, SnapshotSource, participants
from odyssey_megatron.snapshot.shards import snapshot_groups
from odyssey_megatron.runtime.step_ledger import Outcome, StepLedger

__all__ = ["RunFailed", "TrainingRun", "forget_steps_from"]

log = logging.getLogger(__name__)
console = logging.getLogger(CONSOLE)

SAMPLES = "samples.jsonl"


def forget_steps_from(samples: Path, step: int) -> None:
    """Drop the records of steps from ``step`` on (and a torn last line): they are trained
    again (a resumed run, or a rollback to a snapshot)."""
    if samples.is_file():
        write_jsonl(samples, [record for record in read_jsonl(samples, key="--resume") if record["step"] < step])


class RunFailed(RuntimeError):
    """The run cannot go on; the message says why (one line)."""


class RunStopped(Exception):
    """The run stopped on purpose after ``step`` committed steps; ``saved``: they are in a
    checkpoint ``odyssey train --resume`` continues from."""

    def __init__(self, reason: str, *, status: int, step: int, saved: bool):
        super().__init__(reason)
        self.reason, self.status, self.step, self.saved = reason, status, step, saved


@dataclass
class _Recovery:
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


class TrainingRun:
    def __init__(self, *, config: RecipeConfig, controller: Controller, center: DecisionCenter, run_dir: Path,
                 start_step: int = 0):
        self.config, self.controller, self.center = config, controller, center
        self.store = controller.store.clone()
        self.run_dir = Path(run_dir)
        self.timeouts = controller.timeouts
        self.iters = config.training.train_iters
        self.committed = start_step
        """Steps committed so far: the next generation's start step."""
        self.first_step = start_step
        """The step this invocation started at: until one more commits, no trained state exists."""
        self.plan: Optional[ExecutionPlan] = None
        """The generation published last."""
        self.settled: Optional[ExecutionPlan] = None
        """The last generation whose first step committed (or the first generation)."""
        self.started = time.monotonic()
        self._recovery: Optional[_Recovery] = None
        self._prepare_stop = threading.Event()
        self._prepare_thread: Optional[threading.Thread] = None
        self.online = OnlineProfile(center.profile) if config.odyssey.online_profile else None
        """Measured op times folded into the decision center's profile."""
        self._priced_scales = Scales()
        """The online profile's factors when the decision center last took it."""
        self._start_steps: dict[int, int] = {}
        """Generation -> the step it started at."""
        self.snapshot_interval = self._snapshot_interval()
        """Steps between in-memory snapshots (``odyssey.snapshot_interval``; 0: none)."""
        self.snapshot: Optional[SnapshotRecord] = None
        """The last complete snapshot."""
        self._restore: Optional[Restore] = None
        """The rollback the generation published last carries out, if it is one."""
        self._lost_keepers: set[int] = set()
        """Ranks of the nodes lost so far: their keeper slots, and the snapshot shards in them, are gone."""
        self._join: Optional[_Join] = None
        """The join under way, until its generation's first step commits."""
        self._newcomers: set[int] = set()
        """Workers the decision center took back that no published generation has named yet
        (``PlanPublished.joined``: they hold nothing)."""
        train = config.training
        self._progress = Progress(train_iters=train.train_iters, log_interval=config.logger.log_interval,
                                  global_batch_size=train.global_batch_size, seq_length=config.model.seq_length,
                                  lr=train.lr)
        """The terminal's progress line every ``logger.log_interval`` committed steps."""

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> Path:
        """Train to the last step; returns the path of ``final.pt``. Raises RunFailed
        (UnrecoverableFailure when no plan can go on)."""
        try:
            final = self._train()
        finally:
            self._stop_preparing()  # no thread may be inside scipy when the interpreter exits
        self.controller.end_run(RUN_DONE, "1")
        self.controller.record.event("finished", steps=self.committed, generation=self.plan.generation,
                                     final=str(final))
        return final

    def _train(self) -> Path:
        self._publish(self.center.plan, self.center.estimate.step_time_s)
        self.settled = self.plan
        while not self._final_written():
            self._collect_commits()
            self._stop_if_asked()
            failure = self.controller.next_failure(timeout=self.timeouts.poll_interval)
            if failure is not None:
                self._recover(failure)
            elif self._join is not None and self._join.generation is None:
                self._hand_over()
            elif self._join is None and self._recovery is None:
                self._take_back()
        return merge_final_parts(self.run_dir, ranks=self._training_ranks(self.plan),
                                 tied=self.config.model.tie_embeddings)

    def _training_ranks(self, plan: ExecutionPlan) -> list[int]:
        tp = plan.tensor_parallel_size
        return [w * tp + k for w in plan.workers for k in range(tp)]

    def _world_size(self, plan: ExecutionPlan) -> int:
        return len(participants(plan, self._restore)) * plan.tensor_parallel_size

    def _final_written(self) -> bool:
        if self.committed < self.iters:
            return False
        return self.store.add(final_key(self.plan.generation), 0) == len(self._training_ranks(self.plan))

    @property
    def fresh(self) -> bool:
        """No step committed since this invocation started: no trained state exists."""
        return self.committed == self.first_step

    def _ledger(self, plan: ExecutionPlan) -> StepLedger:
        return StepLedger(self.store, generation=plan.generation, training_ranks=len(self._training_ranks(plan)))

    def _publish(self, plan: ExecutionPlan, estimated_step_s: float, restore: Optional[Restore] = None) -> None:
        kept = (self.snapshot.step, self.snapshot.generation) if self.snapshot is not None else None
        joined = tuple(sorted(self._newcomers & set(participants(plan, restore))))
        self.controller.publish_plan(plan, self.center.program, start_step=self.committed, fresh=self.fresh,
                                     estimated_step_s=estimated_step_s, snapshot_interval=self.snapshot_interval,
                                     snapshot=kept, restore=restore, joined=joined)
        self._newcomers -= set(joined)
        self.plan, self._restore = plan, restore
        self._start_steps[plan.generation] = self.committed
        self._start_preparing()

    def _measured(self, reports: list[StepReport]) -> None:
        """Fold a committed step's op times into the online profile; once its factors have
        moved enough, the decision center prices with it (its prepared decisions again)."""
        self.online.observe(self.plan, reports)
        if not self.online.scales.differs(self._priced_scales, by=REPRICE_CHANGE):
            return
        self._stop_preparing()
        self.center.use_profile(self.online.profile())
        self._priced_scales = self.online.scales
        self.controller.record.event("profile", generation=self.plan.generation, step=self.committed - 1,
                                     **asdict(self.online.scales), estimated_step_s=self.center.estimate.step_time_s)
        log.info("controller: profile rescaled to measured op times (forward x%.2f, backward x%.2f, "
                 "optimizer x%.2f)", *self.online.scales.as_tuple())
        self._start_preparing()

    # -- commits ------------------------------------------------------------------------

    def _collect_commits(self) -> None:
        ledger = self._ledger(self.plan)
        while self.committed < self.iters and ledger.committed(self.committed):
            self._commit(self.plan.generation, self.committed)
        self._collect_snapshot()

    # -- snapshots ----------------------------------------------------------------------

    def _snapshot_interval(self) -> int:
        """``odyssey.snapshot_interval``, or Young's interval for the starting plan."""
        configured = self.config.odyssey.snapshot_interval
        if configured is not None:
            return configured
        return self.center.snapshot_interval(nodes_per_group=self.config.odyssey.snapshot_parity_nodes)

    def _collect_snapshot(self) -> None:
        """Take in the newest snapshot of the running generation whose every part is in.
        It is one of the last three due: ranks are in step ``committed`` at most, start a
        snapshot only once the one before it is done, and have each written their part of
        one before that step's successor commits. A rank starts no snapshot once the
        generation is aborted, so after the abort this finds the one whose buffers the
        ranks keep."""
        interval, generation = self.snapshot_interval, self.plan.generation
        if not interval or self.plan is not self.settled:
            return
        newest = self.committed - self.committed % interval
        for step in (newest, newest - interval, newest - 2 * interval):
            if step <= self._start_steps[generation]:
                return
            if self.snapshot is not None and (self.snapshot.generation, self.snapshot.step) >= (generation, step):
                return
            if self.store.check([snapshot_done_key(generation, step)]):
                odyssey = self.config.odyssey
                groups = snapshot_groups(self.plan, devices_per_node=self.config.cluster.devices_per_node,
                                         nodes_per_group=odyssey.snapshot_parity_nodes)
                self.snapshot = SnapshotRecord(step, generation, self.plan, groups)
                self.controller.record.event("snapshot", step=step, generation=generation)
                return

    def _snapshot_source(self, committed_before: int) -> SnapshotSource:
        """The last snapshot as the decision center sees it (``DecisionCenter.on_failure``),
        rolling back from ``committed_before`` steps."""
        return SnapshotSource(self.snapshot, frozenset(self._lost_keepers), self.config.model,
                              replayed_steps=committed_before - self.snapshot.step)

    def _roll_back(self, restore: Restore) -> None:
        """The run goes back to the snapshot's step: the steps since are trained again."""
        replayed = self.committed - restore.step
        forget_steps_from(self.run_dir / SAMPLES, restore.step)
        self.controller.record.event("rollback", step=restore.step, generation=restore.generation, replayed=replayed)
        log.info("run: rolled back to the snapshot of step %d (%d committed steps to train again)", restore.step,
                 replayed)
        self.committed = restore.step
        self._progress.rolled_back()

    def _commit(self, generation: int, step: int) -> None:
        """Record committed ``step``: its samples and loss, checked to cover every micro-batch once."""
        by_micro_batch: dict[int, tuple[float, tuple[int, ...]]] = {}
        size = self.config.training.micro_batch_size
        reports = []
        for line in self.store.get(step_report_key(generation, step)).decode().splitlines():
            try:
                report = StepReport.from_json(line)
            except ProtocolError as exc:
                raise RunFailed(f"step {step}: malformed step report: {exc}") from None
            reports.append(report)
            for i, m in enumerate(report.micro_batches):
                if m in by_micro_batch:
                    raise RunFailed(f"step {step}: micro-batch {m} ran twice (rank {report.rank} too)")
                by_micro_batch[m] = report.losses[i], report.samples[i * size:(i + 1) * size]
        expected = self.config.training.num_micro_batches
        if sorted(by_micro_batch) != list(range(expected)):
            raise RunFailed(f"step {step}: micro-batches {sorted(by_micro_batch)} ran; expected 0..{expected - 1}")
        loss = sum(loss for loss, _ in by_micro_batch.values()) / expected
        samples = [i for m in range(expected) for i in by_micro_batch[m][1]]
        append_jsonl(self.run_dir / SAMPLES, {"step": step, "generation": generation, "samples": samples,
                                              "loss": loss})
        self.controller.record.event("step", step=step, generation=generation, loss=loss)
        self.committed = step + 1
        if self.online is not None and step > self._start_steps[generation]:
            self._measured(reports)
        if self.settled is not self.plan:
            self.settled = self.plan
        if self._recovery is not None and self._recovery.generation == generation:
            self._finish_recovery_record(first_step_at=time.time())
        if self._join is not None and self._join.generation == generation:
            self._finish_join_record(first_step_at=time.time())
        if (line := self._progress.committed(step=step, loss=loss, ranks=len(self._training_ranks(self.plan)))):
            console.info(line)

    # -- recovery -----------------------------------------------------------------------

    def _recover(self, failure: Failure) -> None:
        """Decide and publish the next generation after ``failure``; a failure before
        every rank of it is ready restarts the decision with the new survivors."""
        if self._recovery is None and self._outside_the_generation(failure):
            return
        self._interrupt_join(failure)
        failures, seen, restarts, before = [failure], [], 0, None
        if self._recovery is not None:  # the last recovery had not reached its first step
            seen, restarts = list(self._recovery.failures), self._recovery.restarts + 1
            before = self._recovery.committed_before
        while failures:
            self._stop_preparing()
            time.sleep(self.timeouts.poll_interval)  # ranks failing together arrive together
            while (more := self.controller.next_failure(timeout=0)) is not None:
                failures.append(more)
            seen += failures
            self._lost_keepers.update(r for f in failures for r in f.node_ranks)
            self._newcomers -= {self.center.cluster.worker_of(r) for f in failures for r in f.ranks}
            self.end_generation()
            before = self.committed if before is None else before
            decision = self._decide(failures, committed_before=before)
            if decision.rollback is not None:
                self._roll_back(decision.rollback)
            self._recovery = _Recovery(generation=decision.chosen.plan.generation, failures=list(seen),
                                       restarts=restarts, decided_at=time.time(),
                                       record=self._decision_record(decision, committed=before),
                                       committed_before=before)
            self._publish(decision.chosen.plan, decision.chosen.estimate.step_time_s, decision.rollback)
            failures = self._wait_ready()
            restarts += 1
        self._recovery.ready_at = time.time()

    def _outside_the_generation(self, failure: Failure) -> bool:
        """Whether ``failure`` touches no rank of the running generation (an idle worker, a
        joiner not taken back yet) while no join waits for its step boundary: then the
        decision center only counts it, and training goes on."""
        if self._join is not None and self._join.generation is None:
            return False  # the join's decision counted on what is alive: decide again
        cluster = self.center.cluster
        running = {r for w in participants(self.plan, self._restore) for r in cluster.worker_ranks(w)}
        if running & set(failure.ranks):
            return False
        self.center.on_idle_failure(ranks=failure.ranks, running=self.plan, at_s=time.monotonic() - self.started)
        self._newcomers -= {self.center.cluster.worker_of(r) for r in failure.ranks}
        self._lost_keepers.update(failure.node_ranks)
        log.info("run: ranks %s failed outside generation %d, which trains on", list(failure.ranks),
                 self.plan.generation)
        return True

    def _interrupt_join(self, failure: Failure) -> None:
        """A failure before the join's generation trains: the recovery decides from what runs
        (the join waiting for its step boundary) or from the settled plan (its generation
        being entered), with the joiners still alive among the candidates."""
        if self._join is None:
            return
        self.controller.record.event("join_interrupted", workers=self._join.workers, generation=self._join.generation,
                                     failed_ranks=list(failure.ranks))
        log.info("run: ranks %s failed during the join of workers %s", list(failure.ranks), self._join.workers)
        self._join = None

    def end_generation(self) -> None:
        """Stop the running generation: the abort key, and freeze its step counters (the
        steps every rank completed commit first, in order)."""
        self.controller.abort(self.plan.generation)
        if self.committed < self.iters:
            for step in self._ledger(self.plan).freeze(self.committed, self.iters - 1):
                self._commit(self.plan.generation, step)
        self._collect_snapshot()  # one the owner had not seen done yet

    def _decide(self, failures: list[Failure], *, committed_before: int) -> Decision:
        """Run the decision center from the settled plan on the new survivors;
        ``committed_before``: steps committed when the recovery began."""
        # A recovery that failed before its first step leaves survivors with the settled plan's
        # blocks; a join that waited for its step boundary, with the running plan's.
        held = self.plan if self.settled is self.plan else replace(self.settled, generation=self.plan.generation,
                                                                   transfers=())
        # A lost node comes as the ranks it held: the decision center needs no node numbering.
        ranks = sorted({r for f in failures for r in f.ranks})
        # Fresh (no step committed yet), every block is drawn again from the seed or checkpoint.
        # A rollback interrupted before its first step rolls back again: the blocks the
        # survivors hold are the snapshot's, not the settled plan's.
        snapshot = (self._snapshot_source(committed_before) if self.snapshot is not None and not self.fresh
                    else None)
        decision = self.center.on_failure(ranks=ranks, at_s=time.monotonic() - self.started, in_memory=not self.fresh,
                                          from_plan=held, snapshot=snapshot,
                                          roll_back=self._restore is not None and self.settled is not self.plan)
        log.info("run: generation %d (%s) after ranks %s failed", decision.chosen.plan.generation,
                 decision.chosen.policy, ranks)
        return decision

    def _decision_record(self, decision: Decision, *, committed: int) -> dict:
        def candidate(c) -> dict:
            return {"policy": c.policy, "layout": c.layout, "step_time_s": c.estimate.step_time_s,
                    "transition_s": c.transition_s, "score": c.score}

        plan = decision.chosen.plan
        chosen_bytes, naive_bytes = mapping_bytes(before=decision.replaced, after=plan, cluster=self.center.cluster,
                                                  profile=self.center.profile)
        return {"policy": decision.chosen.policy, "mapping_bytes": chosen_bytes, "naive_mapping_bytes": naive_bytes,
                "chosen": candidate(decision.chosen),
                "alternatives": [candidate(c) for c in decision.alternatives],
                "search_time_s": decision.search_time_s, "decision_source": decision.source,
                "start_step": self.committed,
                "transfers": len(plan.transfers), "transfer_bytes": sum(t.bytes for t in plan.transfers),
                **self._rollback_record(decision, committed=committed)}

    def _rollback_record(self, decision: Decision, *, committed: int) -> dict:
        """What a rollback costs: the snapshot's step, the steps trained again and their
        estimated seconds on the new plan, the shards rebuilt from parity, and the failed
        ranks whose shards were read from their node's keeper."""
        restore = decision.rollback
        if restore is None:
            return {"snapshot_step": None, "replayed_steps": 0, "replay_s": 0.0, "rebuilt_shards": 0,
                    "read_for_failed_ranks": []}
        replayed = committed - restore.step
        failed = self.center.cluster.failed_ranks
        return {"snapshot_step": restore.step, "replayed_steps": replayed,
                "replay_s": replayed * decision.chosen.estimate.step_time_s, "rebuilt_shards": len(restore.rebuilds),
                "read_for_failed_ranks": sorted(r.owner for r in restore.reads if r.owner in failed)}

    def _wait_ready(self) -> list[Failure]:
        """Until every rank of the published generation is in it; the failures that came
        first, if any (the recovery starts again with them)."""
        deadline = time.monotonic() + self.timeouts.recovery_timeout
        key, world = ready_key(self.plan.generation), self._world_size(self.plan)
        while self.store.add(key, 0) < world:
            self._stop_if_asked()
            failure = self.controller.next_failure(timeout=self.timeouts.poll_interval)
            if failure is not None:
                log.info("run: ranks %s failed while generation %d was being entered", list(failure.ranks),
                         self.plan.generation)
                return [failure]
            if time.monotonic() > deadline:
                raise RunFailed(f"generation {self.plan.generation} was not entered within the recovery timeout "
                                f"({self.timeouts.recovery_timeout} s)")
        return []

    def _finish_recovery_record(self, *, first_step_at: float) -> None:
        r = self._recovery
        failed_at, detected_at = min(f.failed_at for f in r.failures), min(f.detected_at for f in r.failures)
        record = dict(
            generation=r.generation, failed_ranks=sorted({rank for f in r.failures for rank in f.ranks}),
            cause=",".join(sorted({f.cause.value for f in r.failures})), failed_at=failed_at, detected_at=detected_at,
            decided_at=r.decided_at, ready_at=r.ready_at, first_step_at=first_step_at,
            detection_s=detected_at - failed_at, to_plan_s=r.decided_at - failed_at,
            to_first_step_s=first_step_at - failed_at, restarts=r.restarts, **r.record)
        self.controller.record.event("recovery", **record)
        console.info(recovery_line(record))
        self._recovery = None

    # -- growing back -----------------------------------------------------------------------

    def _take_back(self) -> None:
        """Offer the workers that came back (alive in the detector, failed in the decision
        center) to the decision center while the generation trains on; where Eq. 8 grows
        onto them, ask for a handover at the next step boundary."""
        if self.committed >= self.iters - 1:
            return  # no step left to gain from them
        detector = self.controller.detector
        if detector.starting_ranks():
            return  # a node's workers come back together: one decision for all of them
        cluster = self.center.cluster
        alive = set(detector.alive_ranks())
        back = sorted(w for w in cluster.failed_workers if all(r in alive for r in cluster.worker_ranks(w)))
        if not back:
            return
        self._stop_preparing()
        decided_at = time.time()
        decision = self.center.on_join(workers=back, at_s=time.monotonic() - self.started)
        self._newcomers |= set(back)
        record = self._decision_record(decision, committed=self.committed)
        if decision.chosen.plan is decision.replaced:
            self.controller.record.event("join", workers=back, grew=False, decided_at=decided_at, **record)
            log.info("run: workers %s are back; Eq. 8 keeps generation %d (%s)", back, self.plan.generation,
                     decision.note or "no faster plan")
            self._start_preparing()
            return
        joining = sorted(self._newcomers & set(decision.chosen.plan.workers))  # those kept back before too
        self._join = _Join(joining, decision, decided_at, record)
        self._ledger(self.plan).hand_over()
        log.info("run: workers %s are back; generation %d hands over to a %s plan of %d workers at its next step "
                 "boundary", joining, self.plan.generation, decision.chosen.policy, len(decision.chosen.plan.workers))

    def _hand_over(self) -> None:
        """Once the running generation's last step (the handover) committed, publish the
        join's generation from the step after it; a failure while it is entered is recovered
        from like any other."""
        join = self._join
        if self.committed >= self.iters:  # the run ended before the step boundary came
            self.center.withdraw(self.plan)
            self._join = None
            return
        if self._ledger(self.plan).decided(self.committed - 1) is not Outcome.LAST:
            return
        join.handover_step, join.published_at = self.committed - 1, time.time()
        plan = join.decision.chosen.plan
        self._publish(plan, join.decision.chosen.estimate.step_time_s)
        join.generation = plan.generation
        while failures := self._wait_ready():
            self._recover(failures[0])
            if self._join is None:  # it was a recovery's to finish
                return
        join.ready_at = time.time()

    def _finish_join_record(self, *, first_step_at: float) -> None:
        j = self._join
        record = {**j.record, "generation": j.generation, "workers": j.workers,
                  "ranks": [r for w in j.workers for r in self.center.cluster.worker_ranks(w)], "grew": True,
                  "start_step": self._start_steps[j.generation], "decided_at": j.decided_at,
                  "handover_step": j.handover_step, "published_at": j.published_at, "ready_at": j.ready_at,
                  "first_step_at": first_step_at, "handover_s": j.published_at - j.decided_at,
                  "to_first_step_s": first_step_at - j.decided_at,
                  "training_ranks": len(self._training_ranks(self.plan))}
        self.controller.record.event("join", **record)
        console.info(join_line(record))
        self._join = None

    # -- stopping on purpose --------------------------------------------------------------

    def _stop_if_asked(self) -> None:
        """Stop the run (raising RunStopped) if the controller was asked to."""
        request = self.controller.stop_request
        if request is None:
            return
        reason, status = request
        self._stop_preparing()
        self.end_generation()
        self.controller.record.event("stop", reason=reason, step=self.committed)
        if self.fresh:
            self.controller.end_run(RUN_STOP, StopOrder(self.committed, reason, {}).to_json())
            raise RunStopped(reason, status=status, step=self.committed, saved=False)
        writers = self._writers()
        self.controller.end_run(RUN_STOP, StopOrder(self.committed, reason,
                                                    {str(b): w for b, w in writers.items()}).to_json())
        tp = self.settled.tensor_parallel_size
        writing = {w * tp + k for w in set(writers.values()) for k in range(tp)}
        deadline = time.monotonic() + self.timeouts.recovery_timeout
        while time.monotonic() < deadline:  # every writer done, or gone (then its blocks are missing)
            live = set(self.controller.detector.live_ranks())
            if all(r not in live or self.store.check([stopped_key(r)]) for r in writing):
                break
            time.sleep(self.timeouts.poll_interval)
        # A block no live worker holds is missing; so is one whose writer's part never came.
        missing = [str(b) for b in self._all_blocks() if b not in writers] or parts_complete(
            checkpoint_directory(self.run_dir, self.committed), list(writers), tp_size=tp)
        if not missing:
            mark_latest(self.run_dir, self.committed)
            raise RunStopped(reason, status=status, step=self.committed, saved=True)
        log.error("run: the stop's checkpoint lacks blocks %s", missing)
        raise RunStopped(reason, status=status, step=self.committed, saved=False)

    def _all_blocks(self) -> list:
        model = self.config.model
        return stage_blocks(model, StageSpec((0, model.num_layers), first=True, last=True))

    def _writers(self) -> dict:
        """Block -> the first worker of the settled plan that holds it and is alive."""
        live = set(self.controller.detector.live_ranks())
        tp = self.settled.tensor_parallel_size
        writers = {}
        for worker in self.settled.workers:
            if all(worker * tp + k in live for k in range(tp)):
                for block in worker_blocks(self.config.model, self.settled, worker):
                    writers.setdefault(block, worker)
        return writers

    # -- decisions in advance -------------------------------------------------------------

    def _start_preparing(self) -> None:
        """Price the next likely failures in the background (``DecisionCenter.prepare``)."""
        self._stop_preparing()
        self._prepare_stop = threading.Event()
        stop = self._prepare_stop
        self._prepare_thread = threading.Thread(target=lambda: self.center.prepare(stop=stop.is_set),
                                                name="odyssey-prepare", daemon=True)
        self._prepare_thread.start()

    def _stop_preparing(self) -> None:
        if self._prepare_thread is not None:
            self._prepare_stop.set()
            self._prepare_thread.join()
            self._prepare_thread = None
