"""One rank's training state under one plan generation.

Builds, in order: the plan's process groups (collective), the rank's stage model on
Megatron-Core and Megatron-Core's optimizer over it (``hooks.stage_optimizer``), both loaded from the rank's per-block ``TrainingState``
(``hooks.training_state``; ``initial_state`` draws it from the seed once), the
layer-granular gradient sync, and the schedule: Megatron's own 1F1B when the step is
plain 1F1B, else the Odyssey executor over this worker's op list in the plan's step
program (``schedules.program``: rerouted micro-batches, split backwards, exactly as the
decision center priced them). ``train_step`` runs one global batch. Where the program
staggers optimizer steps, a rank steps without waiting for the global gradient norm
(``runtime.rank.staggered_step``), so it starts the next step as soon as its own DP peers are
done; ``settle`` ends the last such step. ``training_state`` reads the blocks back, to
carry them into the next plan generation.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, replace
from typing import Callable

import torch
from megatron.core.optimizer import OptimizerConfig

from odyssey_megatron.config import ModelConfig
from odyssey_megatron.hooks.grad_sync import LayerGradSync, block_owners, parameters_by_block
from odyssey_megatron.hooks.lr_schedule import LrSchedule
from odyssey_megatron.blocks import StageSpec
from odyssey_megatron.hooks.model import build_stage_model, forget_stage_models
from odyssey_megatron.hooks.process_groups import RankMap, build_plan_groups, megatron_pipeline
from odyssey_megatron.hooks.stage_optimizer import StageOptimizer
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.hooks.weight_grad import split_linear_backward
from odyssey_megatron.optimizer_shards import REPLICAS
from odyssey_megatron.phases import Phase
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan
from odyssey_megatron.hooks.op_clock import OpClock
from odyssey_megatron.hooks.stage_step import MicroBatch
from odyssey_megatron.runtime.rank.emulation import DeviceEmulation
from odyssey_megatron.runtime.rank.executor import StepExecutor
from odyssey_megatron.runtime.rank.megatron_1f1b import MegatronPipelineSchedule
from odyssey_megatron.runtime.rank.op_timers import OpTimers
from odyssey_megatron.runtime.rank.retake_copy import RetakeCopy, RetakeCopyPool
from odyssey_megatron.runtime.rank.staggered_step import StaggeredStep
from odyssey_megatron.schedules.ops import BACKWARD, WEIGHT_GRAD
from odyssey_megatron.schedules.program import StepProgram

SCHEDULES = ("auto", "odyssey", "megatron")


@dataclass(frozen=True)
class StepResult:
    losses: dict[int, float]
    """Loss per micro-batch whose last stage ran on this rank."""
    grad_norm: float | None
    """Global norm before clipping; None while the step is staggered (``PlanRunner.settle``)."""


def resolve_schedule(schedule: str, *, plan: ExecutionPlan, program: StepProgram, worker: int, ranks: RankMap,
                     emulated: bool) -> str:
    """Which schedule runs ``worker``'s steps: ``megatron`` (Megatron-Core's own 1F1B) or
    ``odyssey`` (the op-list executor). ``auto`` takes Megatron's where the step is plain
    1F1B on this worker's pipeline; ``megatron`` is refused, naming why, wherever it
    could not run the step as the program was priced."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    refusals = [why for refused, why in (
        (bool(plan.reroutes), "Megatron's 1F1B cannot run a plan with rerouted micro-batches"),
        (emulated, "Megatron's 1F1B cannot be paced for device-time emulation; use schedule auto or odyssey"),
        (program.split_backward, "Megatron's 1F1B cannot run split backwards; publish the step program with "
                                 "odyssey.decoupled_weight_grads=false"),
        (program.staggered_optimizer, "Megatron's 1F1B has no settle point for a staggered optimizer step; publish "
                                      "the step program with odyssey.staggered_optimizer=false"),
    ) if refused]
    if schedule == "megatron":
        if not refusals and not all(megatron_pipeline(p, ranks) for p in plan.pipelines):
            refusals.append("Megatron's 1F1B needs every pipeline's stage ranks in ascending order")
        if refusals:
            raise ValueError(refusals[0])
        return "megatron"
    if schedule == "auto" and not refusals and megatron_pipeline(_pipeline_of(plan, worker), ranks):
        return "megatron"
    return "odyssey"


def _pipeline_of(plan: ExecutionPlan, worker: int) -> PipelinePlan:
    """The pipeline whose stage ``worker`` owns (a plan Megatron's 1F1B runs reroutes nothing)."""
    return next(p for p in plan.pipelines if worker in {s.worker for s in p.stages})


def initial_state(*, plan: ExecutionPlan, rank: int, ranks: RankMap, model: ModelConfig, seed: int,
                  device: torch.device = torch.device("cpu")) -> TrainingState:
    """What ``rank`` starts a run on ``plan`` from: its stage's blocks drawn from ``seed``."""
    tp = plan.tensor_parallel_size
    return TrainingState.initial(model, StageSpec.of_worker(plan, ranks.worker(rank)), seed=seed, tp_rank=rank % tp,
                                 tp_size=tp, device=device)


@dataclass(frozen=True)
class RunnerSettings:
    """What a rank's ``PlanRunner`` runs with that stays the same across a run's plan
    generations: the model and batch the recipe trains, how its optimizer and gradient
    sync run, and this rank's device, op timers, emulation and collective timeout. A
    worker builds them once, where it is set up, and gives them to every generation's
    runner; what changes with each generation (the plan, its step program, the rank map,
    the blocks held, the fault injector's phase hook) is passed to the runner itself."""

    model: ModelConfig
    """The whole model the stages are cut from."""
    micro_batch_size: int
    """Samples per micro-batch."""
    optimizer: OptimizerConfig
    """Megatron's optimizer config (``hooks.stage_optimizer.optimizer_config`` of a recipe); the
    runner trains the state's tensors in place with it."""
    lr_schedule: LrSchedule
    """Each step's learning rate and weight decay, from its step number (``hooks.lr_schedule``)."""
    schedule: str = "auto"
    """auto, odyssey or megatron (``resolve_schedule``)."""
    overlap_grad_sync: bool = False
    """Start each sync unit's all-reduce as soon as backward is done with it."""
    device: torch.device = torch.device("cpu")
    """This rank's accelerator device (``hooks.select_accelerator``)."""
    emulation: DeviceEmulation | None = None
    """Pace every op to a profile's device time (``runtime.rank.emulation``); Megatron's
    schedule cannot be paced, so the op-list executor runs. None: real time."""
    op_timers: OpTimers | None = None
    """Becomes Megatron's ``timers`` of the model and optimizer configs
    (``runtime.rank.op_timers``): each op's seconds, for the online profile."""
    collective_timeout: datetime.timedelta | None = None
    """The plan's process groups' timeout (``build_plan_groups``)."""
    distributed_optimizer: bool = False
    """Shard the optimizer state of each sync unit of more than two holders over them
    (``optimizer_shards``); fault-free only: the state cannot be snapshotted, saved or moved yet."""


class PlanRunner:
    def __init__(
        self,
        *,
        plan: ExecutionPlan,
        program: StepProgram,
        rank: int,
        ranks: RankMap,
        state: TrainingState,
        settings: RunnerSettings,
        on_phase: Callable[[Phase], None] | None = None,
    ):
        """``program`` is the plan's step program (published with it). ``state`` holds
        exactly this rank's stage's blocks; the runner trains its tensors in place.
        ``settings`` is what stays the same across the run's generations. ``on_phase`` is
        called as the step enters each phase (forward, backward, grad_sync, optimizer: after
        the global norm and the commit, before the step is applied), once per micro-batch
        for the forward and backward, and with group_setup here, before the plan's groups
        are built, and mid_group_setup after each group this rank shares is made: where a
        fault injector acts."""
        if program.generation != plan.generation:
            raise ValueError(f"step program of generation {program.generation} given for plan generation "
                             f"{plan.generation}")
        self.plan, self.worker, self.tp_rank = plan, ranks.worker(rank), rank % plan.tensor_parallel_size
        if settings.distributed_optimizer and program.staggered_optimizer:
            raise ValueError("a staggered optimizer step cannot run with the distributed optimizer (its weight "
                             "all-gather waits for the step); publish the step program with "
                             "odyssey.staggered_optimizer=false")
        runs_megatron = resolve_schedule(settings.schedule, plan=plan, program=program, worker=self.worker,
                                         ranks=ranks, emulated=settings.emulation is not None) == "megatron"
        self._speculative: StaggeredStep | None = None
        self.retaken_steps = 0
        """Staggered steps retaken because clipping engaged (each cost the forwards before a settle point)."""
        self._on_phase = on_phase or (lambda phase: None)
        self._on_phase(Phase.group_setup)
        self.groups = build_plan_groups(plan, rank=rank, ranks=ranks, timeout=settings.collective_timeout,
                                        on_shared=lambda: self._on_phase(Phase.mid_group_setup))
        self.stage = StageSpec.of_worker(plan, self.worker)
        self.device = settings.device
        self.model = build_stage_model(settings.model, self.stage, pg_collection=self.groups.pg_collection)
        self.model.to(settings.device)
        self.model.config.timers = settings.op_timers
        if on_phase is not None:
            self.model.register_forward_pre_hook(lambda *_: on_phase(Phase.forward))
            next(self.model.parameters()).register_post_accumulate_grad_hook(lambda _: on_phase(Phase.backward))
        self.optimizer = StageOptimizer(
            state, self.model, self.stage, config=replace(settings.optimizer, timers=settings.op_timers),
            lr_schedule=settings.lr_schedule,
            counted_blocks={b for b, owner in block_owners(plan).items() if owner == self.worker},
            norm_group=self.groups.norm_group, tp_group=self.groups.pg_collection.tp, worker=self.worker,
            sharded_units=[(self.groups.unit_groups[index], unit.workers, unit.blocks)
                           for index, unit in enumerate(plan.sync_units)
                           if settings.distributed_optimizer and self.worker in unit.workers
                           and len(unit.workers) > REPLICAS])
        self.params = parameters_by_block(self.model, self.stage)
        self.ops = list(program.ops_of(self.worker))
        self.clock = OpClock() if settings.emulation is None else settings.emulation.clock(
            plan=plan, ranks=ranks, worker=self.worker, ops=self.ops, device=settings.device,
            distributed_optimizer=settings.distributed_optimizer)
        self.grad_sync = LayerGradSync(
            plan=plan, worker=self.worker, params=self.params, unit_groups=self.groups.unit_groups,
            overlap=settings.overlap_grad_sync, clock=self.clock,
        )
        self.staggered_optimizer = program.staggered_optimizer
        self._retake_copies = (RetakeCopyPool(settings.device)
                           if self.staggered_optimizer and settings.optimizer.clip_grad > 0 else None)
        self._retake_copy: RetakeCopy | None = None
        """The host copy a staggered step of the forward-backward in progress will retake from."""
        self.executor: StepExecutor | MegatronPipelineSchedule
        if runs_megatron:
            pipeline = _pipeline_of(plan, self.worker)
            self.executor = MegatronPipelineSchedule(
                model=self.model,
                pipeline_group=self.groups.pipeline_group,
                stage_collection=self.groups.pg_collection,
                micro_batches=pipeline.micro_batches,
                total_micro_batches=plan.num_micro_batches,
                seq_length=settings.model.seq_length,
                micro_batch_size=settings.micro_batch_size,
            )
        else:
            self.executor = StepExecutor(
                plan=plan,
                ranks=ranks,
                tp_rank=self.tp_rank,
                model=self.model,
                activation_shape=(settings.model.seq_length, settings.micro_batch_size, settings.model.hidden_size),
                dtype=self.model.config.params_dtype,
                device=settings.device,
                ops=self.ops,
                weight_grads=split_linear_backward(self.model) if any(op.kind == WEIGHT_GRAD for op in self.ops)
                else None,
                clock=self.clock,
            )

    def train_step(self, batches: Callable[[int], MicroBatch], *, step: int, apply: bool = True) -> StepResult:
        """Forward and backward every micro-batch of this worker, sync and clip gradients,
        and (if ``apply``) take the optimizer step of training step ``step``."""
        return self.finish_step(self.forward_backward(batches), step=step, apply=apply)

    def forward_backward(self, batches: Callable[[int], MicroBatch]) -> dict[int, float]:
        """First half of a step: every forward and backward of this worker; returns the
        losses of the micro-batches whose last stage ran here. The previous step, if
        staggered, is settled at the op list's settle point, before the first backward:
        its gradients, which a retake steps with, are this step's buffers until then."""
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad()  # fp32 masters of a bf16 model
        self._take_retake_copy()
        on_device = lambda m: {k: v.to(self.device) for k, v in batches(m).items()}  # noqa: E731
        if self._speculative is not None:
            return self.executor.run(batches=on_device, settle=self._settle_at_settle_point)
        self._start_gradients()
        return self.executor.run(batches=on_device)

    def _start_gradients(self) -> None:
        self.grad_sync.start_step(backward_passes=sum(op.kind == BACKWARD for op in self.ops))

    def _take_retake_copy(self) -> None:
        """Start copying what a staggered step of this forward-backward would retake from."""
        if self._retake_copies is None:
            return
        if self._retake_copy is not None:  # unused: the step was not applied, or a retake changed the weights
            self._retake_copy.release()
        self._retake_copy = self._retake_copies.take(self.optimizer.adam)

    def _settle_at_settle_point(self) -> bool:
        """The executor's settle hook: True when the step in flight was retaken (then this
        step's retake copy, taken from the speculative weights, is taken again)."""
        retaken = self._settle()[1]
        if retaken:
            self._take_retake_copy()
        self._start_gradients()
        return retaken

    def finish_step(self, losses: dict[int, float], *, step: int, apply: bool = True,
                    commit: Callable[[], None] | None = None) -> StepResult:
        """Second half: DP sync, global-norm clipping and (if ``apply``) the optimizer
        step, at the learning rate of training step ``step`` (the steps committed before
        it: ``hooks.lr_schedule``); staggered, the step is taken now and clipping is
        settled later. ``commit`` (not with a staggered program) is called once the
        gradients are final and the step's learning rate is set (``optimizer.lr``), before
        the step is applied: the live run's commit, which raises if the step did not commit."""
        self._on_phase(Phase.grad_sync)
        self.grad_sync.sync()
        self.optimizer.set_step(step)
        if self.staggered_optimizer and apply:
            if commit is not None:
                raise ValueError("a staggered optimizer step is taken before the global norm: it cannot wait "
                                 "for its commit")
            self._on_phase(Phase.optimizer)
            with self.clock.optimizer_step(None):
                self.optimizer.grads_to_masters()
                self._speculative = StaggeredStep(self.optimizer, group=self.groups.norm_group,
                                                  retake_copy=self._retake_copy)
            self._retake_copy = None
            return StepResult(losses=losses, grad_norm=None)
        with self.clock.optimizer_step(self.groups.norm_group):
            self.optimizer.grads_to_masters()
            norm = self.optimizer.clip()
            if apply:
                if commit is not None:
                    commit()
                self._on_phase(Phase.optimizer)
                self.optimizer.step()
        return StepResult(losses=losses, grad_norm=norm)

    def settle(self) -> float | None:
        """End the staggered step in flight, if any (collective): before the parameters
        are read, saved or handed to another plan. Returns its global norm."""
        return self._settle()[0] if self._speculative is not None else None

    def training_state(self) -> TrainingState:
        """This rank's blocks as trained so far, for the next plan generation: the runner's
        own tensors, not copies, so the runner is done with them (export copies to keep
        training here). Only after ``settle``: a staggered step may still be retaken."""
        if self._speculative is not None:
            raise RuntimeError("a staggered step is in flight: settle() before reading the training state")
        return self.optimizer.state()

    def release(self, *, abandoned: bool) -> TrainingState:
        """End the generation here: destroy its process groups and return this rank's
        blocks, for the next one. ``abandoned`` (a failure ended the step in flight), they
        are as they are, maybe one optimizer step (speculative or not) past the last
        committed step, which the next generation rolls back; else as ``training_state``.
        The runner is not used again: drop it, so its stage model goes too."""
        if abandoned:
            self._speculative = None
        state = self.optimizer.state() if abandoned else self.training_state()
        self.groups.destroy()
        forget_stage_models()
        return state

    def _settle(self) -> tuple[float, bool]:
        norm, retaken = self._speculative.settle(pending=self._retake_copy)
        self._speculative = None
        self.retaken_steps += retaken
        return norm, retaken
