"""Which op lists one training step runs: plain 1F1B, or decoupled weight gradients on
rerouting peers where that pays (``estimator.decoupled``), and what a step costs: its
makespan, or under staggered optimizer steps the steady-state period
(``estimator.staggered``)."""

from __future__ import annotations

from dataclasses import replace

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.decoupled import decoupled_pipelines
from odyssey_megatron.estimator.memory import peak_memory
from odyssey_megatron.estimator.pipeline import PipelineTiming, simulate_pipelines
from odyssey_megatron.estimator.staggered import staggered_period
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import WEIGHT_GRAD


def step_schedule(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None = None,
    *,
    decouple: bool = False,
    staggered: bool = False,
) -> PipelineTiming:
    """The op lists a step of ``plan`` runs, and their timing: with decoupled weight
    gradients on rerouting peers when ``decouple`` is on, the plan reroutes, and that is
    faster (per step: by ``step_time``) than plain 1F1B and fits the memory budget; else
    plain 1F1B. The estimator and the runtime both call this, so the schedule priced is
    the schedule executed. Only the pipelines a reroute touches can differ, so the choice
    is made on those alone."""
    return timed_step_schedule(plan, profile, cluster, decouple=decouple, staggered=staggered)[0]


def timed_step_schedule(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None = None,
    *,
    decouple: bool = False,
    staggered: bool = False,
) -> tuple[PipelineTiming, float]:
    """``step_schedule`` and its ``step_time``, which the choice may already have computed."""
    if not (decouple and plan.reroutes):
        timing = simulate_pipelines(plan, profile, cluster)
        return timing, step_time(plan, profile, cluster, timing, staggered=staggered)
    touched = _touched_pipelines(plan)
    chosen, chosen_s = _split_if_faster(touched or plan, profile, cluster, staggered)
    if touched is None:
        return chosen, chosen_s
    if any(op.kind == WEIGHT_GRAD for ops in chosen.schedule.values() for op in ops):
        timing = decoupled_pipelines(plan, profile, cluster).first
    else:
        timing = simulate_pipelines(plan, profile, cluster)
    return timing, step_time(plan, profile, cluster, timing, staggered=staggered)


def step_time(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None, timing: PipelineTiming, *, staggered: bool
) -> float:
    """Pipeline seconds per step of ``timing``'s op lists: the makespan, or with
    ``staggered`` optimizer steps the steady-state period. Without reroutes the two are
    equal: every pipeline's first stage holds layer 0, so all first stages wait for each
    other, and each ends its pipeline's step (1F1B's last backward), so the next step
    starts when the last pipeline ends, and every other stage's partners are done before
    its first input arrives."""
    if staggered and plan.reroutes:
        return staggered_period(plan, profile, cluster, timing.schedule)
    return timing.makespan_s


def rerouted_makespan(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None = None,
    *,
    decouple: bool = False,
    staggered: bool = False,
) -> float:
    """Pipeline seconds per step (``step_time``) of the pipelines a reroute touches: those
    with a failed stage and those whose owners adopt micro-batches. The rest run their
    plain 1F1B schedules, unchanged, so comparing reroutes of one layout needs only this
    (a small share of a large plan). ``decouple`` and ``staggered`` as in ``step_schedule``."""
    touched = _touched_pipelines(plan) or plan
    if decouple and plan.reroutes:
        return _split_if_faster(touched, profile, cluster, staggered)[1]
    return step_time(touched, profile, cluster, simulate_pipelines(touched, profile, cluster), staggered=staggered)


def _split_if_faster(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None, staggered: bool
) -> tuple[PipelineTiming, float]:
    """Split op lists if their ``step_time`` beats plain 1F1B's and they fit in memory;
    the chosen timing and its step time."""
    plain = simulate_pipelines(plan, profile, cluster)
    plain_s = step_time(plan, profile, cluster, plain, staggered=staggered)
    split = decoupled_pipelines(plan, profile, cluster).first
    split_s = step_time(plan, profile, cluster, split, staggered=staggered)
    if split_s >= plain_s:
        return plain, plain_s
    if max(peak_memory(plan, profile, split.schedule).values(), default=0) > profile.memory_budget_bytes:
        return plain, plain_s
    return split, split_s


def _touched_pipelines(plan: ExecutionPlan) -> ExecutionPlan | None:
    """The sub-plan of pipelines with a failed stage or a rerouting peer; None if that is all."""
    owner_pipeline = {stage.worker: pi for pi, _, stage in plan.stage_positions() if stage.worker is not None}
    involved = {pi for pi, _, stage in plan.stage_positions() if stage.worker is None}
    involved |= {owner_pipeline[r.worker] for r in plan.reroutes}
    if len(involved) == len(plan.pipelines):
        return None
    index = {old: new for new, old in enumerate(sorted(involved))}
    return replace(
        plan,
        pipelines=tuple(plan.pipelines[pi] for pi in sorted(involved)),
        reroutes=tuple(replace(r, pipeline=index[r.pipeline]) for r in plan.reroutes),
        sync_units=(), comm_rounds=(), transfers=(),
    )
