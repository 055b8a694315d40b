"""The part of a rank that trains in a plan generation: build its stage on Megatron-Core
from the per-block state it holds and train from the plan's ``start_step``.

A step counts once every rank of the generation has its final gradients
(``runtime.step_ledger``, counted per node: ``runtime.rank.node_ledger``); a rank applies
its optimizer step only after that, so a step that did not commit was applied nowhere and
no step is ever undone. Every ``snapshot_interval`` steps the rank also writes its share of
an in-memory snapshot into its node's keeper (``runtime.rank.snapshots``), and every
``checkpoint_interval`` steps its share of a disk checkpoint, in the background
(``runtime.rank.checkpoint_writer``). A generation before one that
admits a joiner ends at a step boundary: the step the controller's handover marks last
(``step_ledger.Outcome.LAST``) is applied, then every rank leaves.
"""

from __future__ import annotations

import datetime
import logging

from odyssey_megatron.phases import Phase
from odyssey_megatron.runtime.final_model import write_final_part
from odyssey_megatron.runtime.protocol.keys import abort_key, final_key
from odyssey_megatron.runtime.rank.generation import Generation, GenerationEnded
from odyssey_megatron.runtime.rank.live_step import AfterStall, commit_step, train_step
from odyssey_megatron.runtime.rank.plan_runner import PlanRunner
from odyssey_megatron.runtime.rank.snapshots import SnapshotTaker
from odyssey_megatron.runtime.rank.worker_process import WorkerProcess
from odyssey_megatron.runtime.step_ledger import Outcome
from odyssey_megatron.snapshot.shards import owners, shard_blocks

__all__ = ["TrainingLoop"]

log = logging.getLogger(__name__)


class TrainingLoop:
    """The ``Role.train`` part of ``generation``, once it is entered: its runner and
    snapshots are the generation's (it lets go of them as it leaves)."""

    generation: Generation
    process: WorkerProcess
    handed_over: bool
    """The step just committed is the generation's last (a handover for a join)."""

    def __init__(self, generation: Generation):
        self.generation, self.process = generation, generation.process
        self.handed_over = False
        process = self.process
        self._after_stall = AfterStall(
            report=lambda detail: process.link.report_stall(generation.plan.generation, detail),
            reconnect=process.renew_group_store, timeout=datetime.timedelta(seconds=process.timeouts.recovery_timeout))
        """A wait for a step's decision that ran out: reported, then the controller's decision taken."""

    def run(self) -> None:
        """Build the stage, train to the run's last step or the handover, write the final
        model's part, then wait for the generation's end."""
        generation, process = self.generation, self.process
        plan, published = generation.plan, generation.published
        train = process.config.training
        generation.runner = runner = PlanRunner(
            plan=plan, program=published.program, rank=generation.rank, ranks=generation.ranks,
            state=process.state, settings=process.runner_settings, on_phase=generation.on_phase)
        process.guard.track(runner.groups.owned)
        protection = generation.protection_group()
        if published.snapshot_interval:
            generation.snapshots = SnapshotTaker(
                slot=process.launch.keeper[process.launch.local_rank], rank=process.launch.rank,
                cluster=process.cluster, model=process.config.model, published=published, protection=protection,
                store=process.snapshot_store, ended=lambda: process.store.check([abort_key(plan.generation)]),
                poll_s=process.timeouts.poll_interval / 10)
        generation.entered()
        interval = process.config.odyssey.checkpoint_interval
        for step in range(published.start_step, train.train_iters):
            generation.step = step
            if interval and step > published.start_step and step % interval == 0:
                self._save_checkpoint(step)
            if generation.snapshots is not None and generation.snapshots.due(step):
                generation.on_phase(Phase.snapshot)
                generation.snapshots.take(step, runner.training_state())
            self._train_step(step)
            if self.handed_over and step + 1 < train.train_iters:
                log.info("rank %d: generation %d handed over after step %d", process.launch.rank, plan.generation,
                         step)
                generation.step = step + 1
                return
        generation.step = train.train_iters
        write_final_part(process.run_dir, plan=plan, model=process.config.model, worker=process.worker_id,
                         tp_rank=process.tp_rank, state=runner.training_state(), rank=process.launch.rank)
        process.store.add(final_key(plan.generation), 1)
        process.checkpoints.wait()  # a checkpoint still being written is finished before the worker exits
        generation.wait_until_ended()

    def _train_step(self, step: int) -> None:
        self.generation.phase = Phase.forward
        self.process.op_timers.begin_step(step, stretch=self.process.injector.slowdown(step))
        train_step(self.generation.runner, step=step, load=self.process.data.micro_batch, commit=self._commit)

    def _commit(self, step: int, losses: dict[int, float], samples: dict[int, list[int]]) -> None:
        """With this rank's gradients final: report the step, count in, and return once it
        committed (then the optimizer step is applied); GenerationEnded if it was frozen."""
        process, snapshots = self.process, self.generation.snapshots
        outcome = commit_step(ledger=self.generation.ledger, rank=process.launch.rank, step=step, losses=losses,
                              samples=samples, lr=self.generation.runner.optimizer.lr, op_timers=process.op_timers,
                              timeout=process.collective_timeout, after_stall=self._after_stall)
        if not outcome.committed:
            raise GenerationEnded(f"step {step} did not commit")
        self.handed_over = outcome is Outcome.LAST
        process.spare = None  # a step of this generation committed: it is settled
        process.settled = self.generation.plan
        if snapshots is not None:
            snapshots.wait_copied()  # the optimizer step overwrites what the snapshot copies

    def _save_checkpoint(self, committed: int) -> None:
        """Start writing this rank's share of the checkpoint after ``committed`` steps: the
        blocks its worker writes (``snapshot.shards.owners``), copied to host memory now."""
        self.generation.phase = Phase.checkpoint
        process, plan = self.process, self.generation.plan
        blocks = shard_blocks(owners(plan, process.config.model), process.worker_id)
        process.checkpoints.start(self.generation.runner.training_state(), blocks, step=committed,
                                  generation=plan.generation)
