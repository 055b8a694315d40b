"""What every job of the run's owner reads and moves: the generation published last, the
steps committed so far, and the two acts the jobs share, publishing a generation and
recording a committed step.

A step is committed when every training rank of its generation has counted into it
(``runtime.step_ledger``: gradients final, optimizer step not yet applied). On a failure
the owner ends the generation (the abort key, which ends every rank's waits) and freezes
the counters from the first step it has not collected: each step the ranks completed
commits, the next one is frozen and applied nowhere, so the commit is decided exactly
once and nothing rolls back: committed steps stay, the rest replays in the next
generation from ``start_step``, on the same global batch. Until a first step commits no
trained state exists, and the plans published say so (``fresh``).

The jobs built on this state (``training_run`` wires them): following snapshots
(``snapshot_following``), recovering from failures (``recovery``), growing back onto
workers that return (``growing_back``) and stopping on purpose (``stop_writer``).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Optional

from odyssey_megatron.config import RecipeConfig
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.run_dir import append_jsonl, read_jsonl, write_jsonl
from odyssey_megatron.runtime.control.console import CONSOLE, Progress
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.detector import Failure
from odyssey_megatron.runtime.protocol.keys import ready_key, step_report_key
from odyssey_megatron.runtime.protocol.messages import ProtocolError, StepReport
from odyssey_megatron.runtime.step_ledger import StepLedger
from odyssey_megatron.snapshot.restore import Restore, participants

__all__ = ["RunFailed", "RunState", "SAMPLES", "forget_steps_from", "step_rate"]

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


def step_rate(step: int, reports: list[StepReport]) -> float:
    """The learning rate every rank took ``step`` at (its reports'); RunFailed where they
    disagree: some rank's optimizer was not set to the committed step."""
    rates = {report.lr for report in reports}
    if len(rates) != 1:
        raise RunFailed(f"step {step}: the ranks took it at different learning rates {sorted(rates)}")
    return rates.pop()


class RunState:
    """The owner's state: the generation published last, the steps committed, the
    decisions prepared in advance. ``_after_commit`` is what the owner does once a step
    is recorded."""

    def __init__(self, *, config: RecipeConfig, controller: Controller, center: DecisionCenter, run_dir: Path,
                 start_step: int = 0, in_memory: bool = False, start_rebuildable: bool = True):
        """``in_memory``: the ranks hold the trained state of ``start_step`` in memory (the
        survivors a restarted controller took back), not the seed's or a checkpoint's.
        ``start_rebuildable``: every rank can rebuild that state (from the seed, the
        checkpoint resumed from, or the survivors' own save of it), so a rollback to the
        run's start can go back to it."""
        self.config, self.controller, self.center = config, controller, center
        self.in_memory_at_start = in_memory
        self.start_rebuildable = start_rebuildable
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
        self.restore: Optional[Restore] = None
        """The rollback the generation published last carries out, if it is one."""
        self.start_steps: dict[int, int] = {}
        """Generation -> the step it started at."""
        self.started = time.monotonic()
        self.newcomers: set[int] = set()
        """Workers the decision center took back that no published generation has named yet
        (``PlanPublished.joined``: they hold nothing)."""
        self._prepare_stop = threading.Event()
        self._prepare_thread: Optional[threading.Thread] = None
        train = config.training
        self.progress = Progress(train_iters=train.train_iters, log_interval=config.logger.log_interval,
                                 global_batch_size=train.global_batch_size, seq_length=config.model.seq_length)
        """The terminal's progress line every ``logger.log_interval`` committed steps."""

    @property
    def fresh(self) -> bool:
        """No step committed since this invocation started, from the seed or a checkpoint:
        no trained state exists in memory."""
        return self.committed == self.first_step and not self.in_memory_at_start

    @property
    def settled(self) -> bool:
        """Whether the generation published last has settled (its first step committed, or
        it is the first one): the ranks hold its blocks."""
        return self.center.settled is self.plan

    def now_s(self) -> float:
        """The run's clock for the decision center: seconds since this invocation started."""
        return time.monotonic() - self.started

    def training_ranks(self, plan: ExecutionPlan) -> list[int]:
        return self.center.cluster.ranks_of(plan.workers)

    def running_ranks(self) -> set[int]:
        """Every rank the generation published last uses: its participants' (a rollback's
        snapshot readers too)."""
        cluster = self.center.cluster
        return {r for w in participants(self.plan, self.restore) for r in cluster.worker_ranks(w)}

    def ledger(self, plan: ExecutionPlan) -> StepLedger:
        return StepLedger(self.store, generation=plan.generation, training_ranks=len(self.training_ranks(plan)))

    # -- publishing -----------------------------------------------------------------------

    def publish(self, plan: ExecutionPlan, estimated_step_s: float, *, snapshot: Optional[tuple[int, int]],
                snapshot_interval: int, restore: Optional[Restore] = None) -> None:
        """Publish ``plan`` as the next generation, from the steps committed so far;
        ``snapshot``: (step, generation) of the last complete in-memory snapshot, if any."""
        joined = tuple(sorted(self.newcomers & set(participants(plan, restore))))
        self.controller.publish_plan(plan, self.center.program, start_step=self.committed, fresh=self.fresh,
                                     estimated_step_s=estimated_step_s, snapshot_interval=snapshot_interval,
                                     snapshot=snapshot, restore=restore, joined=joined)
        self.newcomers -= set(joined)
        self.plan, self.restore = plan, restore
        self.start_steps[plan.generation] = self.committed
        self.start_preparing()

    def wait_ready(self, check_stop) -> Optional[Failure]:
        """Until every rank of the published generation is in it; the failure that came
        first, if any (the recovery starts again with it). Ranks that beat but are not in
        it within the recovery timeout are failed (``Controller.fail_late``): the others
        waited for them. RunFailed only where every rank beats from inside it and the count
        is still short. ``check_stop`` is called while waiting (a stop asked for meanwhile)."""
        deadline = time.monotonic() + self.timeouts.recovery_timeout
        key = ready_key(self.plan.generation)
        world = len(participants(self.plan, self.restore)) * self.plan.tensor_parallel_size
        while self.store.add(key, 0) < world:
            check_stop()
            failure = self.controller.next_failure(timeout=self.timeouts.poll_interval)
            if failure is not None:
                log.info("run: ranks %s failed while generation %d was being entered", list(failure.ranks),
                         self.plan.generation)
                return failure
            if time.monotonic() > deadline:
                if self.controller.fail_late(sorted(self.running_ranks()), self.plan.generation):
                    deadline = time.monotonic() + self.timeouts.recovery_timeout  # its failure comes next
                    continue
                raise RunFailed(f"generation {self.plan.generation} was not entered within the recovery timeout "
                                f"({self.timeouts.recovery_timeout} s)")
        return None

    # -- commits ----------------------------------------------------------------------------

    def collect_commits(self) -> None:
        ledger = self.ledger(self.plan)
        while self.committed < self.iters and ledger.committed(self.committed):
            self.commit(self.plan.generation, self.committed)

    def end_generation(self) -> None:
        """Stop the running generation: the abort key, and freeze its step counters (the
        steps every rank completed commit first, in order)."""
        self.controller.abort(self.plan.generation)
        if self.committed < self.iters:
            for step in self.ledger(self.plan).freeze(self.committed, self.iters - 1):
                self.commit(self.plan.generation, step)

    def commit(self, generation: int, step: int) -> None:
        """Record committed ``step``: its samples and loss, checked to cover every micro-batch
        once, and the learning rate every rank took it at; the generation settles with its
        first committed step."""
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
        lr = step_rate(step, reports)
        samples = [i for m in range(expected) for i in by_micro_batch[m][1]]
        append_jsonl(self.run_dir / SAMPLES, {"step": step, "generation": generation, "samples": samples,
                                              "loss": loss})
        self.controller.record.event("step", step=step, generation=generation, loss=loss, lr=lr)
        self.committed = step + 1
        if not self.settled:
            self.center.settle(self.plan)
        self._after_commit(generation, step, reports)
        if (line := self.progress.committed(step=step, loss=loss, lr=lr, ranks=len(self.training_ranks(self.plan)))):
            console.info(line)

    def _after_commit(self, generation: int, step: int, reports: list[StepReport]) -> None:
        """What the owner does once ``step`` of ``generation`` is recorded."""

    # -- decisions in advance -------------------------------------------------------------

    def start_preparing(self) -> None:
        """Price the next likely failures in the background (``DecisionCenter.prepare``)."""
        self.stop_preparing()
        self._prepare_stop = threading.Event()
        stop = self._prepare_stop
        self._prepare_thread = threading.Thread(target=lambda: self.center.prepare(stop=stop.is_set),
                                                name="odyssey-prepare", daemon=True)
        self._prepare_thread.start()

    def stop_preparing(self) -> None:
        if self._prepare_thread is not None:
            self._prepare_stop.set()
            self._prepare_thread.join()
            self._prepare_thread = None
