"""The run's owner on node 0, beside the controller: it publishes plans, turns committed
steps into ``samples.jsonl``, and on every failure runs the decision center and
publishes the next generation.

Its jobs, each in a module of its own, share one state (``run_state``: the generation
published last, the steps committed, publishing and committing):
- following the in-memory snapshots, and rolling back to the last complete one where no
  survivor holds some block (``snapshot_following``);
- following the disk checkpoints the ranks write in the background, and marking each the
  latest once its parts are all in (``checkpoint_following``);
- recovering from failures (``recovery``);
- growing back onto workers that return, at a step boundary (``growing_back``);
- stopping on purpose, with a checkpoint of the last committed step (``stop_writer``);
- pricing the likely next failures in the background (``RunState.start_preparing``),
  folding measured op times into the profile it prices with (``online_profile``), and
  watching them for stragglers, reported, or removed where the decision center says that
  pays (``stragglers``, ``DecisionCenter.on_straggler``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

from odyssey_megatron.config import RecipeConfig
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.planner.straggler import StragglerDecision
from odyssey_megatron.runtime.control.checkpoint_following import CheckpointFollowing
from odyssey_megatron.runtime.control.console import CONSOLE, failure_line
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.detector import Failure
from odyssey_megatron.runtime.control.growing_back import GrowingBack
from odyssey_megatron.runtime.control.online_profile import REPRICE_CHANGE, OnlineProfile, Scales
from odyssey_megatron.runtime.control.reattaching import Continuation
from odyssey_megatron.runtime.control.recovery import Recovery
from odyssey_megatron.runtime.control.run_state import SAMPLES, RunFailed, RunState, forget_steps_from
from odyssey_megatron.runtime.control.snapshot_following import SnapshotFollowing
from odyssey_megatron.runtime.control.stop_writer import RunStopped, StopWriter
from odyssey_megatron.runtime.control.stragglers import Straggler, StragglerWatch, straggler_line
from odyssey_megatron.runtime.protocol.keys import RUN_DONE, final_key
from odyssey_megatron.runtime.protocol.messages import StepReport

__all__ = ["RunFailed", "RunStopped", "SAMPLES", "TrainingRun", "forget_steps_from"]

log = logging.getLogger(__name__)
console = logging.getLogger(CONSOLE)


class TrainingRun(RunState):
    def __init__(self, *, config: RecipeConfig, controller: Controller, center: DecisionCenter, run_dir: Path,
                 start_step: int = 0, continuing: Optional[Continuation] = None):
        """``center`` must be told when each plan settles (``settles_at_once=False``): a
        recovery can fail before its first step. ``continuing``: the run goes on from the
        memory of the survivors a restarted controller took back, at ``start_step``."""
        if center.settles_at_once:
            raise ValueError("the live run's decision center settles plans when told (settles_at_once=False)")
        super().__init__(config=config, controller=controller, center=center, run_dir=run_dir,
                         start_step=start_step, in_memory=continuing is not None,
                         start_rebuildable=continuing is None or continuing.saved)
        self.continuing = continuing
        self.online = OnlineProfile(center.profile) if config.odyssey.online_profile else None
        """Measured op times folded into the decision center's profile."""
        self._priced_scales = Scales()
        """The online profile's factors when the decision center last took it."""
        odyssey = config.odyssey
        self.stragglers = StragglerWatch(center.profile, threshold=odyssey.straggler_slowdown,
                                         steps=odyssey.straggler_steps)
        """Ranks whose ops are slower than their peers', step after step."""
        self.snapshots = SnapshotFollowing(self)
        self.checkpoints = CheckpointFollowing(self)
        self.stop = StopWriter(self)
        self.recovery = Recovery(self, self.snapshots, check_stop=self.stop.stop_if_asked)
        self.joins = GrowingBack(self, self.snapshots, check_stop=self.stop.stop_if_asked)

    def run(self) -> Path:
        """Train to the last step; returns the path of ``final.pt``. Raises RunFailed
        (UnrecoverableFailure when no plan can go on)."""
        try:
            final = self._train()
        finally:
            self.stop_preparing()  # no thread may be inside scipy when the interpreter exits
        self.controller.end_run(RUN_DONE, "1")
        self.controller.record.event("finished", steps=self.committed, generation=self.plan.generation,
                                     final=str(final))
        return final

    def _train(self) -> Path:
        if self.continuing is None:
            self._await_first_ranks()
            self.publish(self.center.plan, self.center.estimate.step_time_s, snapshot=self.snapshots.kept,
                         snapshot_interval=self.snapshots.interval)
        else:
            self._continue(self.continuing)
        while not self._final_written():
            self.collect_commits()
            self.stop.stop_if_asked()
            failure = self.controller.next_failure(timeout=self.timeouts.poll_interval)
            if failure is not None:
                self._on_failure(failure)
            elif self.joins.waiting:
                self.joins.hand_over(self._on_failure)
            elif self.joins.join is None and self.recovery.underway is None:
                self.joins.take_back()
        # Megatron-Core comes in with it, seconds of CPU: only node 0's owner needs it, at the end.
        from odyssey_megatron.runtime.final_model import merge_final_parts

        return merge_final_parts(self.run_dir, ranks=self.training_ranks(self.plan),
                                 tied=self.config.model.tie_embeddings)

    def _await_first_ranks(self) -> None:
        """Before the first generation: until every rank of its plan has registered from a
        process of this start, or failed (then recovered from as in any generation), up to
        the recovery timeout. Published at once, a generation whose ranks come later than the
        collective timeout (a node's command started again after its survivors were
        refused, measured 40 s later) ends under the ranks that came first, which wait then
        for a plan that nothing fails them into, and those that come later stall alone."""
        generation, ranks = self.center.plan.generation, self.training_ranks(self.center.plan)
        deadline = time.monotonic() + self.timeouts.recovery_timeout
        awaited = self.controller.awaited(ranks)
        if awaited:
            log.info("run: generation %d waits for ranks %s to register", generation, list(awaited))
        while awaited and self.controller.stop_request is None:
            if time.monotonic() > deadline:
                raise RunFailed(f"ranks {', '.join(map(str, awaited))} did not register within the recovery timeout "
                                f"({self.timeouts.recovery_timeout} s): are their nodes' commands started?")
            time.sleep(self.timeouts.poll_interval)
            awaited = self.controller.awaited(ranks)

    def _continue(self, continuing: Continuation) -> None:
        """The first generation after the lost controller's last: that plan again, where every
        rank of it came back, else a recovery from the failure of those that did not."""
        plan = continuing.plan
        self.controller.continue_after(plan.generation)
        self.plan = plan
        self.start_steps[plan.generation] = self.committed
        if continuing.lost is not None:
            self.controller.record.event("failure", **continuing.lost.to_record())
            console.warning(failure_line(continuing.lost))
            self.recovery.recover(continuing.lost)
            return
        self.center.settle(replace(plan, generation=plan.generation + 1, transfers=()))
        self.publish(self.center.plan, self.center.estimate.step_time_s, snapshot=None,
                     snapshot_interval=self.snapshots.interval)

    def _on_failure(self, failure: Failure) -> None:
        """Recover from ``failure``, unless it touches nothing the running generation uses
        while no join waits for its step boundary (whose decision counted on what is alive)."""
        if not self.joins.waiting and self.recovery.outside_the_generation(failure):
            return
        self.joins.interrupt(failure)
        self.recovery.recover(failure)

    def _final_written(self) -> bool:
        if self.committed < self.iters:
            return False
        return self.store.add(final_key(self.plan.generation), 0) == len(self.training_ranks(self.plan))

    def collect_commits(self) -> None:
        super().collect_commits()
        self.snapshots.collect()
        self.checkpoints.collect()

    def end_generation(self) -> None:
        super().end_generation()
        self.snapshots.collect()  # one the owner had not seen done yet
        self.checkpoints.collect()

    def _after_commit(self, generation: int, step: int, reports: list[StepReport]) -> None:
        if step > self.start_steps[generation]:  # a generation's first step allocates: not measured
            if self.online is not None:
                self._measured(reports)
            self._watch_stragglers(generation, step, reports)
        self.recovery.finish(generation, first_step_at=time.time())
        self.joins.finish(generation, first_step_at=time.time())

    def _watch_stragglers(self, generation: int, step: int, reports: list[StepReport]) -> None:
        """Report each straggler found (console, ``straggler`` event, W&B); under
        ``odyssey.straggler: remove``, price removing it (``_priced``) and have it failed
        where that pays (the recovery then decides it as any failure), else say it was kept,
        with both prices, and price it again when the watch offers it (slower, or a new plan)."""
        remove = self.config.odyssey.straggler == "remove"
        for found in self.stragglers.observe(self.plan, step, reports):
            priced = self._priced(found) if remove else None
            if remove and priced is None:
                continue
            removed = priced is not None and priced.remove
            why = f"odyssey.straggler=remove: {priced.summary}" if priced else "odyssey.straggler=report"
            console.warning(straggler_line(found, removed=removed, why=why))
            self.controller.record.event("straggler", rank=found.rank, slowdown=found.slowdown,
                                         first_step=found.first_step, last_step=found.last_step,
                                         generation=generation, action=self.config.odyssey.straggler.value,
                                         removed=removed, priced_slowdown=found.priced_slowdown,
                                         priced_generation=found.priced_generation,
                                         **(priced.prices if priced else {}))
            if removed:
                self.controller.remove_straggler(found.rank, generation=generation, detail=found.detail)
            elif priced is not None:
                self.stragglers.kept(found, generation=generation)

    def _priced(self, found: Straggler) -> StragglerDecision | None:
        """Keeping ``found`` against removing it, priced as its failure would be decided
        (``Recovery``'s snapshot and rollback terms); None while a decision waits for its
        generation (a join before its step boundary): the rank is watched afresh, and priced
        once the plan it would be removed from runs."""
        if self.center.plan is not self.center.settled:
            self.stragglers.again(found.rank)
            return None
        return self.center.on_straggler(rank=found.rank, slowdown=found.slowdown, in_memory=not self.fresh,
                                        snapshot=self.snapshots.source(self.committed),
                                        start_replay_steps=self.snapshots.start_replay_steps(self.committed))

    def _measured(self, reports: list[StepReport]) -> None:
        """Fold a committed step's op times into the online profile; once its factors have
        moved enough, the decision center prices with it (its prepared decisions again)."""
        self.online.observe(self.plan, reports)
        if not self.online.scales.differs(self._priced_scales, by=REPRICE_CHANGE):
            return
        self.stop_preparing()
        self.center.use_profile(self.online.profile())
        self.stragglers.profile_rescaled()
        self._priced_scales = self.online.scales
        self.controller.record.event("profile", generation=self.plan.generation, step=self.committed - 1,
                                     **asdict(self.online.scales), estimated_step_s=self.center.estimate.step_time_s)
        log.info("controller: profile rescaled to measured op times (forward x%.2f, backward x%.2f, "
                 "optimizer x%.2f)", *self.online.scales.as_tuple())
        self.start_preparing()
