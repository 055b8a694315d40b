"""One plan generation on one rank: its role, what it built, where the rank is in it, and
how it ends.

The rank works out its ``Role`` as the generation begins. A rank the generation leaves
idle waits for the next plan, its blocks set aside. Any other enters it
(``runtime.rank.entering``), then trains (``runtime.rank.training_loop``) or, having only
sent blocks, waits for the generation's end. A worker its launcher restarted, or one on a
replacement node, joins the running job (``WorkerLaunch.joining``): it holds nothing, sits
out every generation until one admits it (``PlanPublished.joined``), and receives its
stage's blocks there by the plan's transfers.

Blocks held before the generation that its stage does not train stay aside (``spare``)
until the generation's first step commits: until then the controller plans from the last
settled generation, whose blocks they may be. Leaving, the worker keeps its blocks, drops
the stage model and lets go of its process groups (held until their operations have surely
ended), but for the default group of a generation it entered and that ended without an
abort, where the backend could shrink it into the next world (``survivor_groups``).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Optional

import torch.distributed as dist

from odyssey_megatron.hooks.process_groups import PlanGroups, RankMap, build_plan_groups
from odyssey_megatron.hooks.survivor_groups import KeptWorld, keeps_parent, runtime_nccl_version, torch_offers
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.phases import Phase
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.runtime.protocol.keys import RUN_STOP, ready_key, successor_key
from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished
from odyssey_megatron.runtime.rank.node_ledger import NodeLedger
from odyssey_megatron.runtime.rank.plan_runner import PlanRunner
from odyssey_megatron.runtime.rank.role import Role
from odyssey_megatron.runtime.rank.snapshots import SnapshotTaker, protection_group
from odyssey_megatron.runtime.rank.worker_process import WorkerProcess
from odyssey_megatron.runtime.step_ledger import StepLedger

__all__ = ["Generation", "GenerationEnded"]

log = logging.getLogger(__name__)


class GenerationEnded(Exception):
    """The controller ended the generation the worker runs (a failure elsewhere)."""


class Generation:
    """Generation ``published.plan.generation`` on this rank. The worker calls ``begin``,
    which returns the rank's role, then the role's part (``sit_out``; or ``entering.enter``,
    then ``send_blocks`` or a ``TrainingLoop``), then ``leave``, whatever ended it."""

    # -- where the rank is
    process: WorkerProcess
    published: PlanPublished
    plan: ExecutionPlan
    """``published``'s plan."""
    phase: Phase
    step: int
    """The step running (or, between steps, the next one)."""
    # -- what it built
    ledger: Optional[NodeLedger]
    """The generation's step counters."""
    ranks: Optional[RankMap]
    rank: Optional[int]
    """This rank in the generation's world (``entering.enter`` sets both)."""
    groups: Optional[PlanGroups]
    """The plan's groups, held by a participant that only sends blocks (group creation is collective)."""
    runner: Optional[PlanRunner]
    snapshots: Optional[SnapshotTaker]
    """The generation's in-memory snapshots on this rank, when it takes them."""

    def __init__(self, process: WorkerProcess, published: PlanPublished):
        self.process, self.published, self.plan = process, published, published.plan
        self.phase, self.step = Phase.recovery, published.start_step
        self.ledger = self.ranks = self.rank = self.groups = self.runner = self.snapshots = None

    def begin(self) -> Role:
        """Open the generation's step counters, admit a joiner it names, drop what a fresh
        start or a rollback replaces; the rank's role in it."""
        process, plan, published = self.process, self.plan, self.published
        process.guard.reopen(plan.generation)
        process.op_timers.end_steps()  # no step of this generation runs yet (the heartbeat says none)
        training_ranks = len(plan.workers) * process.tp
        node_ranks = sum(1 for r in process.launch.node_ranks if process.cluster.worker_of(r) in plan.workers)
        self.ledger = NodeLedger(StepLedger(process.group_store, generation=plan.generation,
                                            training_ranks=training_ranks),
                                 process.node_store, node_ranks=node_ranks,
                                 check_s=process.timeouts.heartbeat_interval)
        process.injector.in_join = bool(published.joined)
        # A generation published before this process registered named an earlier one of this rank.
        named = process.worker_id in published.joined and plan.generation > process.link.published_at_start
        if not process.admitted and named:
            process.admitted = True
            log.info("rank %d: joins the run in generation %d", process.launch.rank, plan.generation)
        if published.fresh and process.admitted:  # nothing trained yet: every stage is drawn again
            process.state, process.spare = None, None
        if published.restore is not None:  # a rollback: every block comes back from the snapshot
            process.state, process.spare = TrainingState(), None
        return Role.of(published, worker=process.worker_id, admitted=process.admitted)

    def sit_out(self) -> None:
        """Idle until the next plan, the blocks held set aside."""
        process = self.process
        log.info("rank %d: idle in generation %d", process.launch.rank, self.plan.generation)
        if process.state is not None:
            self.set_aside([], held=process.state.blocks)
            process.state = TrainingState()
        process.link.generation = self.plan.generation
        self.wait_until_ended()

    def send_blocks(self) -> None:
        """A participant that trains nothing (its blocks sent): hold the plan's groups, then
        wait for the generation's end."""
        self.groups = build_plan_groups(self.plan, rank=self.rank, ranks=self.ranks,
                                        timeout=self.process.collective_timeout)
        self.process.guard.track(self.groups.owned)
        self.protection_group()
        self.entered()
        self.wait_until_ended()

    def protection_group(self):
        """This rank's snapshot protection group, built with every rank of the generation
        (``snapshots.protection_group``), where the generation snapshots."""
        if not self.published.snapshot_interval:
            return None
        process = self.process
        found = protection_group(self.plan, rank=process.launch.rank, cluster=process.cluster,
                                 nodes_per_group=process.config.odyssey.snapshot_parity_nodes,
                                 rank_in_generation=self.ranks.of_launch_rank,
                                 timeout=process.collective_timeout)
        if found is not None:
            process.guard.track([found[1]])
        return found

    def entered(self) -> None:
        """Count this rank in the generation (its groups built, blocks moved, stage built)."""
        self.process.store.add(ready_key(self.plan.generation), 1)
        self.process.link.generation = self.plan.generation

    def on_phase(self, phase: Phase) -> None:
        """The step enters ``phase``: where a fault aimed there strikes."""
        self.phase = phase
        self.process.injector.fire(phase, self.step)

    def set_aside(self, needed: list, *, held: dict) -> None:
        """Of the blocks ``held`` before the generation, keep those not ``needed`` aside in
        ``spare`` until the generation's first step commits: until then the controller
        plans from the last settled generation, whose blocks they may be."""
        spare = self.process.spare
        self.process.spare = TrainingState({**(spare.blocks if spare else {}),
                                            **{b: s for b, s in held.items() if b not in set(needed)}})

    # -- waiting on the store ----------------------------------------------------------

    def _first_step_committed(self) -> bool:
        """Whether the generation's first step committed: its plan is then the settled one."""
        outcome = self.ledger.decided(self.published.start_step)
        return outcome is not None and outcome.committed

    def _settled_here(self) -> bool:
        """``_first_step_committed``, or False where the store is gone (keep the spare blocks)."""
        try:
            return self._first_step_committed()
        except dist.DistError:
            return False

    def wait_until_ended(self) -> None:
        """An idle worker (or one done training) waits for the next plan or the run's end;
        it drops its spare blocks once the generation's first step commits."""
        process, successor = self.process, successor_key(self.plan.generation)
        while not process.link.aborted(self.plan.generation):
            if process.store.check([successor]):
                if process.store.get(successor) == RUN_STOP.encode():
                    raise GenerationEnded("the run stops")
                return
            if process.spare is not None and self._first_step_committed():
                process.spare, process.settled = None, self.plan
            time.sleep(process.timeouts.poll_interval)
        raise GenerationEnded("the controller ended the generation")

    def _keep_or_destroy_world(self, *, abandoned: bool) -> None:
        """Keep this generation's default group for the next one's shrink where the
        generation made it and ended without an abort (``keeps_parent``); else destroy the
        world there is (a world kept from an earlier generation this rank did not enter too)."""
        process = self.process
        world = dist.distributed_c10d._get_default_group()
        entered = self.ranks is not None and process.kept_world is None  # ``entering`` took the kept one
        healthy = entered and not abandoned and not process.guard.aborted
        if healthy and keeps_parent(backend=process.accelerator.backend, nccl_version=runtime_nccl_version(),
                                    offered=torch_offers()):
            process.kept_world = KeptWorld(world, self.ranks)
            return
        process.kept_world = None
        dist.destroy_process_group()

    def leave(self, *, abandoned: bool) -> None:
        """Keep the blocks, drop the stage model and let go of every process group (the
        guard's reaper drops their last references, off this thread)."""
        process = self.process
        process.guard.abandon()
        if self.snapshots is not None:
            self.snapshots.abandon()
            self.snapshots = None
        if self.runner is not None:
            process.state = self.runner.release(abandoned=abandoned)
            self.runner = None
        if process.spare is not None and not self._settled_here():
            process.state = TrainingState({**process.spare.blocks, **(process.state.blocks if process.state else {})})
        process.spare = None
        if self.groups is not None:
            self.groups.destroy()
            self.groups = None
        if dist.is_initialized():
            self._keep_or_destroy_world(abandoned=abandoned)
        gc.collect()  # the stage's reference cycles: milliseconds, with the process's long-lived objects frozen
        process.guard.done_leaving()  # the guard's reaper drops the groups' last references
