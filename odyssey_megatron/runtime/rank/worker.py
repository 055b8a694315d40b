"""The training worker: one process per device, started by its node's launcher, that
trains plan generation after plan generation until the run is done.

A generation is one plan: the worker joins a fresh process group among the plan's
participants (on the generation's store prefix), moves the blocks the plan's transfers
name, builds its stage on Megatron-Core from the per-block state it holds and trains
from the plan's ``start_step``. A step counts once every rank of the generation has its
final gradients (``runtime.step_ledger``, counted per node: ``runtime.rank.node_ledger``);
a rank applies its optimizer step only after
that, so a step that did not commit was applied nowhere and no step is ever undone.
Until the first step of the run (or of a resumed run) commits, no trained state exists:
a worker entering a generation then (``PlanPublished.fresh``) draws its stage from the
seed or the checkpoint, and no block moves. Every ``snapshot_interval`` steps the worker
also writes its share of an in-memory snapshot into its node's keeper
(``runtime.rank.snapshots``); where a failure leaves some block with no live copy, the
next generation is a rollback (``PlanPublished.restore``): the worker drops what it
holds, reads or rebuilds the snapshot's shards it is named for, and the plan's transfers
move them, so the run goes on from the snapshot's step.

A worker its launcher restarted, or one on a replacement node, joins the running job
(``WorkerLaunch.joining``): it holds nothing, sits out every generation until one admits it
(``PlanPublished.joined``), and receives its stage's blocks there by the plan's transfers.
The generation before that one ends at a step boundary: the step the controller's
handover marks last (``step_ledger.Outcome.LAST``) is applied, then every rank leaves.

When a peer fails, the survivors' collectives end: gloo reports a closed connection as
soon as a dead peer's sockets close, and where nothing closes (a frozen node, a dropped
link) the controller names the failure from missed heartbeats and aborts the generation,
which the worker's heartbeat thread hears of (its launcher relays the controller's
heartbeat) and turns into an abort of every wait
on the generation's groups (``hooks.collective_guard``). Either way the wait raises
``PeerLost`` where the collective was called. The worker then leaves the generation: it
keeps its blocks, lets go of its process groups (held until their operations have surely
ended) and waits for the controller's next plan. A collective that waits past the
collective timeout with no abort is reported to the controller, which ends the generation.
An error of its own (an injected fault, a bug) is reported to the controller and ends the
process.

A worker ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches every process of the
group; SLURM signals every process of the job): its launcher passes the request on, and
the controller stops the run with a ``StopOrder``, which the worker carries out between
generations: it writes the blocks the order assigns it, as of the last committed step.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from odyssey_megatron.config import RecipeConfig, recipe_from_yaml
from odyssey_megatron.data import IndexedTokens, PreparedData
from odyssey_megatron.hooks.accelerator import select_accelerator
from odyssey_megatron.hooks.collective_guard import CollectiveGuard, PeerLost, prepare_backend
from odyssey_megatron.hooks.model import StageSpec
from odyssey_megatron.hooks.process_groups import PlanGroups, RankMap, build_plan_groups
from odyssey_megatron.hooks.rendezvous_store import RendezvousStore
from odyssey_megatron.hooks.stage_optimizer import optimizer_config
from odyssey_megatron.hooks.training_state import TrainingState, worker_blocks
from odyssey_megatron.runtime.checkpoint import load_checkpoint, save_checkpoint, save_part
from odyssey_megatron.runtime.final_model import write_final_part
from odyssey_megatron.runtime.protocol.keys import (
    ALL_ARRIVED,
    RUN_DONE,
    RUN_SPEC,
    RUN_STOP,
    abort_key,
    all_arrived_key,
    arrived_key,
    final_key,
    process_group_prefix,
    ready_key,
    stopped_key,
    successor_key,
)
from odyssey_megatron.runtime.protocol.launch import EXIT_CONTROLLER_LOST, WorkerLaunch
from odyssey_megatron.runtime.protocol.liveness import missed_beat
from odyssey_megatron.runtime.protocol.messages import RunSpec, StopOrder
from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished
from odyssey_megatron.runtime.rank import op_timers
from odyssey_megatron.runtime.rank.block_transfer import execute_transfers
from odyssey_megatron.runtime.rank.controller_link import ControllerLink
from odyssey_megatron.runtime.rank.emulation import recipe_emulation
from odyssey_megatron.runtime.rank.fault_injection import FaultInjector
from odyssey_megatron.runtime.rank.live_step import commit_step, train_step
from odyssey_megatron.runtime.rank.node_ledger import NodeLedger
from odyssey_megatron.runtime.rank.plan_runner import PlanRunner, RunnerSettings, initial_state
from odyssey_megatron.runtime.rank.snapshots import (
    SnapshotAbandoned,
    SnapshotTaker,
    protection_group,
    restore_snapshot,
)
from odyssey_megatron.runtime.step_ledger import Outcome, StepLedger

__all__ = ["GenerationEnded", "train_worker"]

log = logging.getLogger(__name__)


class GenerationEnded(Exception):
    """The controller ended the generation the worker runs (a failure elsewhere)."""


_GENERATION_LEFT = (GenerationEnded, PeerLost, dist.DistError, SnapshotAbandoned)
"""What ends a generation without being this worker's own error: the controller ended it,
a collective lost a peer (raised where it was called), or the store rendezvous failed."""


def train_worker(launch: WorkerLaunch) -> None:
    """The launcher's target: run the worker; an error of its own is reported, then the
    process ends with status 1; a worker that lost the controller ends with
    ``EXIT_CONTROLLER_LOST`` once it saved what it holds."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {launch.rank} %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its dataset index chatter, once per rank
    for stop in (signal.SIGINT, signal.SIGTERM):  # the launcher and the controller stop the run
        signal.signal(stop, signal.SIG_IGN)
    link = ControllerLink(launch)
    link.start()
    try:
        status = Worker(launch, link).run()
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(status)  # at once: interpreter teardown (torch, gloo) can outlast a heartbeat timeout
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the controller must know
        log.exception("rank %d: failed", launch.rank)
        link.report_failure(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)


def _write_output_to(path: Path) -> None:
    """Everything this process writes from now on (its log, a traceback, gloo's and
    Megatron's messages from C++) goes to ``path``, appended: a rank's detail stays off the
    terminal, where the controller says in one line what failed."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, sys.stdout.fileno())
    os.dup2(fd, sys.stderr.fileno())
    os.close(fd)


class Worker:
    def __init__(self, launch: WorkerLaunch, link: ControllerLink):
        self.launch, self.link, self.store = launch, link, link.store
        spec = RunSpec.from_json(self.store.get(RUN_SPEC))
        self.spec = spec
        self.config: RecipeConfig = recipe_from_yaml(spec.config_yaml)
        self.run_dir = Path(spec.run_dir)
        _write_output_to(self.run_dir / "logs" / f"rank-{launch.rank}.log")
        train, par = self.config.training, self.config.parallel
        self.tp = par.tensor_model_parallel_size
        self.worker_id, self.tp_rank = launch.rank // self.tp, launch.rank % self.tp
        self.accelerator = select_accelerator("auto")
        self.device = self.accelerator.device(launch.local_rank)
        if self.accelerator.device_type == "cpu":
            from odyssey_megatron.hooks.cpu_shim import CpuShim

            # The node's ranks share its cores; torch's default (all cores each) thrashes.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.config.cluster.devices_per_node))
            CpuShim().install(seed=train.seed)
        from megatron.core import parallel_state

        parallel_state._set_global_memory_buffer()
        self.data = IndexedTokens(PreparedData.from_json(spec.data), micro_batch_size=train.micro_batch_size,
                                  num_micro_batches=train.num_micro_batches)
        # What is here now (torch, Megatron, the data) lives as long as the process: keep it
        # out of the collections that free each generation's stage, so they take milliseconds.
        gc.freeze()
        self.injector = FaultInjector.for_worker(self.config.odyssey.faults, launch, store=self.store)
        self.op_timers = op_timers.OpTimers(self.device) if self.config.odyssey.online_profile else None
        self.timeouts = launch.timeouts
        self.collective_timeout = datetime.timedelta(seconds=self.timeouts.collective_timeout)
        self.runner_settings = RunnerSettings(
            model=self.config.model, micro_batch_size=train.micro_batch_size,
            optimizer=optimizer_config(train, self.config.model.params_dtype), device=self.device,
            emulation=recipe_emulation(self.config), op_timers=self.op_timers,
            collective_timeout=self.collective_timeout)
        """What every generation's runner runs with; ``emulation`` is ``cluster.emulate_device``'s: every
        op paced to that device's time, or None (real time)."""
        self.guard = CollectiveGuard(backend=self.accelerator.backend, timeout_s=self.timeouts.collective_timeout)
        """Ends every wait on the generation's groups when the controller aborts it."""
        prepare_backend(self.accelerator.backend)
        self.guard.install()
        self.controller_lost: Optional[str] = None
        """Why the controller is gone, once the heartbeat thread found it so."""
        link.on_controller_lost = self._on_controller_lost
        link.on_abort = lambda generation: self.guard.abort(f"the controller ended generation {generation}",
                                                            generation=generation)
        self.group_store = self._store_for_steps()
        """The step ledger's connection: waits no longer than a collective may."""
        self.snapshot_store = self._store_for_steps()
        """The snapshot thread's connection: it counts in while the training thread may wait on the ledger."""
        self.rendezvous = RendezvousStore(self.store.clone(), guard=self.guard)
        """Where the process groups meet: an abort ends a setup that waits for a dead member."""
        self.state: Optional[TrainingState] = TrainingState() if launch.joining else None
        """The blocks held; None: none yet, drawn from the seed or checkpoint on entering a
        generation (a joiner holds nothing and receives every block)."""
        self.admitted = not launch.joining
        """A joiner is admitted by the first generation that names it (``PlanPublished.joined``)."""
        self.handed_over = False
        """The step just committed is the generation's last (a handover for a join)."""
        self.spare: Optional[TrainingState] = None
        """Blocks held before this generation that its stage does not train (``_set_aside``)."""
        self.runner: Optional[PlanRunner] = None
        self.snapshots: Optional[SnapshotTaker] = None
        """The generation's in-memory snapshots on this rank, when it takes them."""
        self.training_ranks = 0
        """Ranks that train in the current generation: those that count its steps."""
        self.ledger: Optional[NodeLedger] = None
        """The current generation's step counters."""
        self.generation = -1
        self.step = 0
        """The step running (or, between steps, the next one)."""
        self.start_step = 0
        """The generation's first step."""
        self.idle_groups: Optional[PlanGroups] = None
        """The plan's groups, held by a participant that only sends blocks (group creation is collective)."""
        self.phase = "recovery"

    # -- the generation loop -----------------------------------------------------------

    def run(self) -> int:
        """Train generation after generation; returns the process's exit status."""
        if self.launch.joining:
            self.generation = max(-1, self.link.published_at_start - 1)  # watch from the running one
        while True:
            if self.controller_lost is not None:
                self._save_held()
                return EXIT_CONTROLLER_LOST
            try:
                published = self._next_plan()
            except dist.DistError:
                if not self._wait_controller_lost():
                    raise
                continue
            if isinstance(published, StopOrder):
                self._carry_out(published)
                return 0
            if published is None:
                log.info("rank %d: the run is done", self.launch.rank)
                return 0
            self.generation = published.plan.generation
            self.link.watching = self.generation
            try:
                self._run_generation(published)
                ended = False
            except _GENERATION_LEFT as exc:
                if isinstance(exc, PeerLost) and exc.timed_out:
                    self.link.report_stall(self.generation, str(exc))
                log.warning("rank %d: generation %d ended in %s of step %d: %s", self.launch.rank, self.generation,
                            self.phase, self.step, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                ended = True
            if not ended and self.store.check([RUN_DONE]):
                log.info("rank %d: the run is done", self.launch.rank)
                return 0  # the process ends now: nothing to tear down for
            # Outside the except block: its frame holds references that keep gloo's sockets open.
            self._leave_generation(abandoned=ended)

    def _next_plan(self) -> PlanPublished | StopOrder | None:
        """The next generation's plan, the order to stop, or None once the run is done;
        waits (on the successor key, without polling) up to the recovery timeout."""
        try:
            following = self.link.next_after(self.generation)
        except dist.DistStoreError as exc:
            if not missed_beat(exc):
                raise
            raise TimeoutError(f"no plan generation {self.generation + 1} within the recovery timeout "
                               f"({self.timeouts.recovery_timeout} s)") from None
        if following == RUN_STOP:
            return StopOrder.from_json(self.store.get(RUN_STOP))
        if following == RUN_DONE:
            return None
        return following

    def _node_store(self) -> dist.Store:
        """A connection to the node's store (its launcher's), where the node's ranks commit together."""
        return dist.TCPStore("127.0.0.1", self.launch.node_store_port, is_master=False,
                             timeout=self.collective_timeout)

    def _store_for_steps(self) -> dist.Store:
        """A connection of its own that waits no longer than a collective may."""
        store = self.store.clone()
        store.set_timeout(self.collective_timeout)
        return store

    def _on_controller_lost(self, why: str) -> None:
        """On the heartbeat thread: end the generation; the training thread saves and exits."""
        self.controller_lost = why
        self.guard.abort(f"the controller is gone ({why})")

    def _wait_controller_lost(self) -> bool:
        """After a store error: whether the heartbeat thread finds the controller gone."""
        deadline = time.monotonic() + 2 * self.timeouts.heartbeat_timeout
        while self.controller_lost is None and time.monotonic() < deadline:
            time.sleep(self.timeouts.poll_interval)
        return self.controller_lost is not None

    def _save_held(self) -> None:
        """With the controller gone, nobody can assign writers: write every block held, as
        a part of the checkpoint of the steps it has taken (all committed: a rank applies
        committed steps only). ``--resume`` takes the newest step whose parts hold every block."""
        held = self.state.held() if self.state is not None else []
        by_step: dict[int, list] = {}
        for block in held:
            by_step.setdefault(self.state.blocks[block].step, []).append(block)
        for step, blocks in sorted(by_step.items()):
            save_part(self.run_dir, self.state, blocks, step=step, rank=self.launch.rank, tp_rank=self.tp_rank,
                      tp_size=self.tp, model=self.config.model)
        log.warning("rank %d: the controller is gone (%s); saved %s", self.launch.rank, self.controller_lost,
                    {step: [str(b) for b in blocks] for step, blocks in by_step.items()} or "nothing")

    def _carry_out(self, order: StopOrder) -> None:
        """Write the blocks ``order`` assigns this worker (its TP shard), as of the last
        committed step, then count in: the controller marks the checkpoint once all are in."""
        held = self.state.held() if self.state is not None else []
        mine = [block for block in held if order.writers.get(str(block)) == self.worker_id]
        if mine:
            steps = {self.state.blocks[block].step for block in mine}
            if steps != {order.step}:
                raise RuntimeError(f"asked to save blocks at {order.step} committed steps; they have taken {steps}")
            save_part(self.run_dir, self.state, mine, step=order.step, rank=self.launch.rank, tp_rank=self.tp_rank,
                      tp_size=self.tp, model=self.config.model)
        self.store.set(stopped_key(self.launch.rank), "1")
        log.info("rank %d: stopped (%s); saved %s as of step %d", self.launch.rank, order.reason,
                 [str(b) for b in mine] or "nothing", order.step)

    def _run_generation(self, published: PlanPublished) -> None:
        plan, program = published.plan, published.program
        self.guard.reopen(plan.generation)
        self.phase, self.step = "recovery", published.start_step
        self.start_step = published.start_step
        ranks = RankMap.of(published.participants(), self.tp)
        self.training_ranks = len(plan.workers) * self.tp
        node_ranks = sum(1 for r in self.launch.node_ranks if r // self.tp in plan.workers)
        self.ledger = NodeLedger(StepLedger(self.group_store, generation=plan.generation,
                                            training_ranks=self.training_ranks),
                                 self._node_store, node_ranks=node_ranks, check_s=self.timeouts.heartbeat_interval)
        self.injector.in_join, self.handed_over = bool(published.joined), False
        # A generation published before this process registered named an earlier one of this rank.
        named = self.worker_id in published.joined and plan.generation > self.link.published_at_start
        if not self.admitted and named:
            self.admitted = True
            log.info("rank %d: joins the run in generation %d", self.launch.rank, plan.generation)
        if published.fresh and self.admitted:  # nothing trained yet: every stage is drawn again
            self.state, self.spare = None, None
        if published.restore is not None:  # a rollback: every block comes back from the snapshot
            self.state, self.spare = TrainingState(), None
        if self.worker_id not in ranks.workers or not self.admitted:  # idle until the next plan
            log.info("rank %d: idle in generation %d", self.launch.rank, plan.generation)
            if self.state is not None:
                self._set_aside([], held=self.state.blocks)
                self.state = TrainingState()
            self.link.generation = plan.generation
            self._wait_until_ended()
            return
        rank = ranks.rank(self.worker_id, self.tp_rank)
        if plan.generation > 0:
            self.injector.fire("recovery", self.step)
        self._wait_all_arrived(ranks.world_size)
        dist.init_process_group(self.accelerator.backend, rank=rank, world_size=ranks.world_size,
                                store=dist.PrefixStore(process_group_prefix(plan.generation), self.rendezvous),
                                timeout=self.collective_timeout)
        self.guard.track([dist.distributed_c10d._get_default_group()])
        training = self.worker_id in plan.workers
        if published.restore is not None:
            self.phase = "restore"
            self.state = restore_snapshot(
                published.restore, rank=self.launch.rank, node_first_rank=self.launch.rank - self.launch.local_rank,
                slots=self.launch.keeper, model=self.config.model, tp_size=self.tp,
                rank_in_generation=ranks.of_launch_rank, timeout=self.collective_timeout,
                track=self.guard.track)
        elif self.state is None:
            self.state = self._first_state(plan, ranks, rank) if training else TrainingState()
        self._check_steps(published.start_step)
        self.phase = "transfer"
        needed = worker_blocks(self.config.model, plan, self.worker_id)
        held = dict(self.state.blocks)
        if plan.transfers and not published.fresh:
            self.injector.fire("transfer", self.step)
            execute_transfers(plan=plan, state=self.state, rank=rank, ranks=ranks, model=self.config.model,
                              device=self.device, on_moved=lambda: self.injector.fire("mid_transfer", self.step))
        self.state.keep(needed)
        self._set_aside(needed, held=held)
        if not training:  # sent its blocks; holds nothing the plan trains
            self.idle_groups = build_plan_groups(plan, rank=rank, ranks=ranks, timeout=self.collective_timeout)
            self.guard.track(self.idle_groups.owned)
            self._protection_group(published, ranks)
            self._entered(plan.generation)
            self._wait_until_ended()
            return
        train = self.config.training
        self.runner = PlanRunner(plan=plan, program=program, rank=rank, ranks=ranks, state=self.state,
                                 settings=self.runner_settings, on_phase=self._on_phase)
        self.guard.track(self.runner.groups.owned)
        protection = self._protection_group(published, ranks)
        if published.snapshot_interval:
            self.snapshots = SnapshotTaker(
                slot=self.launch.keeper[self.launch.local_rank], rank=self.launch.rank, model=self.config.model,
                published=published, protection=protection, store=self.snapshot_store,
                ended=lambda: self.store.check([abort_key(plan.generation)]), poll_s=self.timeouts.poll_interval / 10)
        self._entered(plan.generation)
        interval = self.config.odyssey.checkpoint_interval
        for step in range(published.start_step, train.train_iters):
            self.step = step
            if interval and step > published.start_step and step % interval == 0:
                self._save_checkpoint(step)
            if self.snapshots is not None and self.snapshots.due(step):
                self._on_phase("snapshot")
                self.snapshots.take(step, self.runner.training_state())
            self._train_step(step)
            if self.handed_over and step + 1 < train.train_iters:
                log.info("rank %d: generation %d handed over after step %d", self.launch.rank, plan.generation, step)
                self.step = step + 1
                return
        self.step = train.train_iters
        write_final_part(self.run_dir, plan=plan, model=self.config.model, worker=self.worker_id,
                         tp_rank=self.tp_rank, state=self.runner.training_state(), rank=self.launch.rank)
        self.store.add(final_key(plan.generation), 1)
        self._wait_until_ended()

    def _protection_group(self, published: PlanPublished, ranks: RankMap):
        """This rank's snapshot protection group, built with every rank of the generation
        (``snapshots.protection_group``), where the generation snapshots."""
        if not published.snapshot_interval:
            return None
        found = protection_group(published.plan, rank=self.launch.rank,
                                 devices_per_node=self.config.cluster.devices_per_node,
                                 nodes_per_group=self.config.odyssey.snapshot_parity_nodes,
                                 rank_in_generation=ranks.of_launch_rank,
                                 timeout=self.collective_timeout)
        if found is not None:
            self.guard.track([found[1]])
        return found

    def _entered(self, generation: int) -> None:
        """Count this rank in the generation (its groups built, blocks moved, stage built)."""
        self.store.add(ready_key(generation), 1)
        self.link.generation = generation

    def _set_aside(self, needed: list, *, held: dict) -> None:
        """Of the blocks ``held`` before the generation, keep those not ``needed`` aside in
        ``spare`` until the generation's first step commits: until then the controller
        plans from the last settled generation, whose blocks they may be."""
        self.spare = TrainingState({**(self.spare.blocks if self.spare else {}),
                                    **{b: s for b, s in held.items() if b not in set(needed)}})

    def _first_state(self, plan, ranks: RankMap, rank: int) -> TrainingState:
        """The blocks a run starts from: the resumed checkpoint's, else drawn from the seed."""
        if self.spec.resume is not None:
            return load_checkpoint(Path(self.spec.resume), model=self.config.model,
                                   stage=StageSpec.of_worker(plan, self.worker_id), tp_rank=self.tp_rank,
                                   tp_size=self.tp)
        return initial_state(plan=plan, rank=rank, ranks=ranks, model=self.config.model,
                             seed=self.config.training.seed, device=self.device)

    def _check_steps(self, committed: int) -> None:
        """Every block held has taken exactly ``committed`` steps: a rank applies only
        committed steps, so anything else means it could not learn a step's fate (its
        wait for the decision failed) and cannot join."""
        steps = {block.step for block in self.state.blocks.values()}
        if steps - {committed}:
            raise RuntimeError(f"blocks at steps {sorted(steps)}; generation {self.generation} starts after "
                               f"{committed} committed steps")

    def _train_step(self, step: int) -> None:
        self.phase = "forward"
        train_step(self.runner, step=step, load=self.data.micro_batch, commit=self._commit)

    def _commit(self, step: int, losses: dict[int, float], samples: dict[int, list[int]]) -> None:
        """With this rank's gradients final: report the step, count in, and return once it
        committed (then the optimizer step is applied); GenerationEnded if it was frozen."""
        outcome = commit_step(ledger=self.ledger, rank=self.launch.rank, step=step, losses=losses, samples=samples,
                              op_timers=self.op_timers, timeout=self.collective_timeout)
        if not outcome.committed:
            raise GenerationEnded(f"step {step} did not commit")
        self.handed_over = outcome is Outcome.LAST
        self.spare = None  # a step of this generation committed: it is settled
        if self.snapshots is not None:
            self.snapshots.wait_written()  # the optimizer step overwrites what the snapshot copies

    def _save_checkpoint(self, committed: int) -> None:
        """Save the blocks after ``committed`` steps, with every training rank."""
        self.phase = "checkpoint"
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            save_checkpoint(self.run_dir, self.runner.training_state(), step=committed, tp_rank=self.tp_rank,
                            tp_size=self.tp, group=self.runner.groups.norm_group)
        except CheckpointException as exc:  # a BaseException: a peer's failure ended the save
            raise GenerationEnded(f"the checkpoint of step {committed} failed: {str(exc)[:200]}") from None

    def _on_phase(self, phase: str) -> None:
        self.phase = phase
        self.injector.fire(phase, self.step)

    # -- waiting on the store ----------------------------------------------------------

    def _wait_all_arrived(self, world_size: int) -> None:
        """Count this rank in and wait for the generation's every rank, or its abort."""
        if self.store.check([abort_key(self.generation)]):  # a rank that comes late counts in nowhere
            raise GenerationEnded("the controller ended the generation before this rank arrived")
        everyone = all_arrived_key(self.generation)
        if self.store.add(arrived_key(self.generation), 1) == world_size:
            self.store.compare_set(everyone, "", ALL_ARRIVED)
        try:
            self.group_store.wait([everyone])  # it waits up to the collective timeout
        except dist.DistStoreError as exc:
            if not missed_beat(exc):
                raise
            self.group_store = self._store_for_steps()  # its late answer must not be read as the next one's
            raise GenerationEnded(f"not every rank arrived within the collective timeout "
                                  f"({self.timeouts.collective_timeout} s)") from None
        if self.group_store.get(everyone) != ALL_ARRIVED:
            raise GenerationEnded("the controller ended the generation before every rank arrived")

    def _first_step_committed(self) -> bool:
        """Whether the generation's first step committed: its plan is then the settled one."""
        outcome = self.ledger.decided(self.start_step)
        return outcome is not None and outcome.committed

    def _settled_here(self) -> bool:
        """``_first_step_committed``, or False where the store is gone (keep the spare blocks)."""
        try:
            return self._first_step_committed()
        except dist.DistError:
            return False

    def _wait_until_ended(self) -> None:
        """An idle worker (or one done training) waits for the next plan or the run's end;
        it drops its spare blocks once the generation's first step commits."""
        successor = successor_key(self.generation)
        while not self.link.aborted(self.generation):
            if self.store.check([successor]):
                if self.store.get(successor) == RUN_STOP.encode():
                    raise GenerationEnded("the run stops")
                return
            if self.spare is not None and self._first_step_committed():
                self.spare = None
            time.sleep(self.timeouts.poll_interval)
        raise GenerationEnded("the controller ended the generation")

    def _leave_generation(self, *, abandoned: bool) -> None:
        """Keep the blocks, drop the stage model and let go of every process group (the
        guard holds an abandoned generation's groups until their operations have ended)."""
        self.guard.abandon()
        if self.snapshots is not None:
            self.snapshots.abandon()
            self.snapshots = None
        if self.runner is not None:
            self.state = self.runner.release(abandoned=abandoned)
            self.runner = None
        if self.spare is not None and not self._settled_here():
            self.state = TrainingState({**self.spare.blocks, **(self.state.blocks if self.state else {})})
        self.spare = None
        if self.idle_groups is not None:
            self.idle_groups.destroy()
            self.idle_groups = None
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()  # the stage's reference cycles: milliseconds, with the process's long-lived objects frozen
