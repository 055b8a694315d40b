"""What a worker process holds for its whole life, built once as it starts: its place in
the run, the recipe and its data, the device, its connections to the run's store, the
fault injector and the collective guard; and the blocks it carries from one plan
generation to the next. Each generation (``runtime.rank.generation``) works with it."""

from __future__ import annotations

import datetime
import gc
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import RecipeConfig, recipe_from_yaml
from odyssey_megatron.data import IndexedTokens, PreparedData
from odyssey_megatron.hooks.accelerator import Accelerator, select_accelerator
from odyssey_megatron.hooks.collective_guard import CollectiveGuard, prepare_backend
from odyssey_megatron.hooks.lr_schedule import LrSchedule
from odyssey_megatron.hooks.rendezvous_store import RendezvousStore
from odyssey_megatron.hooks.stage_optimizer import optimizer_config
from odyssey_megatron.hooks.survivor_groups import KeptWorld
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.runtime.checkpoint_index import checkpoint_directory
from odyssey_megatron.runtime.protocol.auth import SignedStore, connect_signed
from odyssey_megatron.runtime.protocol.keys import RUN_SPEC
from odyssey_megatron.runtime.protocol.launch import WorkerLaunch
from odyssey_megatron.runtime.protocol.messages import RunSpec
from odyssey_megatron.runtime.rank import op_timers
from odyssey_megatron.runtime.rank.checkpoint_writer import CheckpointWriter
from odyssey_megatron.runtime.rank.controller_link import ControllerLink
from odyssey_megatron.runtime.rank.emulation import recipe_emulation
from odyssey_megatron.runtime.rank.fault_injection import FaultInjector
from odyssey_megatron.runtime.rank.plan_runner import RunnerSettings
from odyssey_megatron.timeouts import Timeouts

__all__ = ["WorkerProcess"]


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


class WorkerProcess:
    # -- its place in the run
    launch: WorkerLaunch
    link: ControllerLink
    """The heartbeat thread and the controller's plans."""
    store: SignedStore
    """The run's store (the controller's)."""
    spec: RunSpec
    config: RecipeConfig
    run_dir: Path
    tp: int
    worker_id: int
    tp_rank: int
    # -- the device and the data
    accelerator: Accelerator
    device: torch.device
    data: IndexedTokens
    op_timers: op_timers.OpTimers
    """Every op's seconds (the online profile, the straggler watch) and where the rank is
    in its step (its heartbeat), whatever ``odyssey.online_profile`` says."""
    runner_settings: RunnerSettings
    """What every generation's runner runs with; ``emulation`` is ``cluster.emulate_device``'s: every
    op paced to that device's time, or None (real time)."""
    # -- failures
    injector: FaultInjector
    timeouts: Timeouts
    collective_timeout: datetime.timedelta
    guard: CollectiveGuard
    """Ends every wait on the generation's groups when the controller aborts it."""
    controller_lost: Optional[str]
    """Why the controller is gone, once the heartbeat thread found it so."""
    # -- connections of their own
    group_store: SignedStore
    """The step ledger's connection: waits no longer than a collective may."""
    snapshot_store: SignedStore
    """The snapshot thread's connection: it counts in while the training thread may wait on the ledger."""
    rendezvous: RendezvousStore
    """Where the process groups meet: an abort ends a setup that waits for a dead member."""
    checkpoints: CheckpointWriter
    """This rank's periodic checkpoint writes, one in flight at most across generations."""
    # -- the blocks, across generations
    state: Optional[TrainingState]
    """The blocks held; None: none yet, drawn from the seed or checkpoint on entering a
    generation (a joiner holds nothing and receives every block)."""
    spare: Optional[TrainingState]
    """Blocks held before this generation that its stage does not train (``Generation``)."""
    admitted: bool
    """A joiner is admitted by the first generation that names it (``PlanPublished.joined``)."""
    kept_world: Optional[KeptWorld]
    """The last generation's default group, kept where the next world may shrink it
    (``Generation.leave``, ``entering``); None: the next generation meets afresh."""
    settled: Optional[ExecutionPlan]
    """The plan of the last generation whose first step this worker saw commit (None: none
    yet): whose blocks the ranks hold, and the writers of a save without the controller
    follow from it (``runtime.rank.stopping``)."""

    def __init__(self, launch: WorkerLaunch, link: ControllerLink):
        self.launch, self.link, self.store = launch, link, link.store
        spec = RunSpec.from_json(self.store.get(RUN_SPEC))
        self.spec = spec
        self.config = recipe_from_yaml(spec.config_yaml)
        self.run_dir = Path(spec.run_dir)
        _write_output_to(self.run_dir / "logs" / f"rank-{launch.rank}.log")
        train = self.config.training
        par = self.config.parallel
        self.tp = par.tensor_model_parallel_size
        self.cluster = ClusterState(world_size=par.num_ranks, tensor_parallel_size=self.tp,
                                    devices_per_node=self.config.cluster.devices_per_node)
        """The job's ranks as launched: which worker and TP place each has."""
        self.worker_id, self.tp_rank = self.cluster.worker_of(launch.rank), self.cluster.tp_rank(launch.rank)
        self.accelerator = select_accelerator("auto")
        self.device = self.accelerator.bind(launch.local_rank)
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
        self.op_timers = op_timers.OpTimers(self.device)
        link.progress = self.op_timers
        self.timeouts = launch.timeouts
        self.collective_timeout = datetime.timedelta(seconds=self.timeouts.collective_timeout)
        self.runner_settings = RunnerSettings(
            model=self.config.model, micro_batch_size=train.micro_batch_size,
            optimizer=optimizer_config(train, self.config.model.params_dtype), lr_schedule=LrSchedule.of(train),
            device=self.device,
            emulation=recipe_emulation(self.config), op_timers=self.op_timers,
            collective_timeout=self.collective_timeout)
        self.guard = CollectiveGuard(backend=self.accelerator.backend, timeout_s=self.timeouts.collective_timeout,
                                     device=self.device)
        prepare_backend(self.accelerator.backend, timeout_s=self.timeouts.collective_timeout)
        self.guard.install()
        self.controller_lost = None
        link.on_controller_lost = self._on_controller_lost
        link.on_abort = lambda generation: self.guard.abort(f"the controller ended generation {generation}",
                                                            generation=generation)
        self._connect(self.store)
        self.checkpoints = CheckpointWriter(self.run_dir, rank=launch.rank, tp_rank=self.tp_rank, tp_size=self.tp,
                                            model=self.config.model, store=self.store.clone(),
                                            host_buffer=self.accelerator.host_buffer,
                                            synchronize=self.accelerator.synchronize)
        self.state = TrainingState() if launch.joining else None
        self.admitted = not launch.joining
        self.spare = None
        self.kept_world = None
        self.settled = None

    def node_store(self) -> SignedStore:
        """A connection to the node's store (its launcher's), where the node's ranks commit together."""
        return connect_signed("127.0.0.1", self.launch.node_store_port, timeout=self.collective_timeout,
                              signer=self.link.signer)

    def store_for_steps(self) -> SignedStore:
        """A connection of its own that waits no longer than a collective may."""
        store = self.store.clone()
        store.set_timeout(self.collective_timeout)
        return store

    def renew_group_store(self) -> SignedStore:
        """A fresh ``group_store``, after a wait on it ran out: that wait's late answer must
        not be read as the next request's."""
        self.group_store = self.store_for_steps()
        return self.group_store

    def _connect(self, store: SignedStore) -> None:
        """The connections to the run's store this process holds beside ``store`` itself:
        the step and snapshot stores, and torch's rendezvous (its keys unsigned)."""
        self.store = store
        self.group_store = self.store_for_steps()
        self.snapshot_store = self.store_for_steps()
        self.rendezvous = RendezvousStore(store.unsigned.clone(), guard=self.guard)

    def reconnected(self, *, epoch: int, step: int) -> None:
        """After the restarted controller of start ``epoch`` took this worker back at the
        committed ``step`` (``ControllerLink.reattach``): every connection to the run's store
        anew, to the restarted one (the fault injector's and the checkpoint writer's too),
        its start named from now on (should it be lost too), and the run's start now the
        step it holds: a rollback to it loads the survivors' save of that step."""
        self.spec = replace(self.spec, epoch=epoch, resume=str(checkpoint_directory(self.run_dir, step)))
        self._connect(self.link.store)
        self.injector.follow(self.store)
        self.checkpoints.store = self.store.clone()
        self.controller_lost = None

    def _on_controller_lost(self, why: str) -> None:
        """On the heartbeat thread: end the generation; the training thread saves and exits."""
        self.controller_lost = why
        self.guard.abort(f"the controller is gone ({why})")
