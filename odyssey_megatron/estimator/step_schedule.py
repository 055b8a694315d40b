"""Which op lists one training step runs: plain 1F1B, or decoupled weight gradients on
rerouting peers where that pays (``estimator.decoupled``), and what a step costs: its
makespan, or under staggered optimizer steps, where they pay (``staggers``), the
steady-state period (``estimator.staggered``)."""

from __future__ import annotations

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.decoupled import decoupled_pipelines
from odyssey_megatron.estimator.distinct import sub_plan, touched_pipelines
from odyssey_megatron.estimator.memory import peak_memory
from odyssey_megatron.estimator.pipeline import OpGraph, PipelineTiming, op_graph, simulate_pipelines
from odyssey_megatron.estimator.staggered import staggered_period
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import WEIGHT_GRAD

ROUNDING = 1e-9
"""Relative difference below which a staggered period equals the makespan: the two sum
the same op times in different orders, and staggering that gains nothing but rounding
only risks retakes."""


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
    memo: dict | None = None,
) -> tuple[PipelineTiming, float]:
    """``step_schedule`` and its ``step_time``, which the choice may already have computed.
    A ``memo`` kept for one decision (one profile and cluster) remembers each choice."""
    if not (decouple and plan.reroutes):
        graph = op_graph(plan, profile, cluster)
        timing = simulate_pipelines(plan, profile, cluster, graph=graph)
        return timing, step_time(plan, profile, cluster, timing, staggered=staggered, graph=graph)
    touched = _touched(plan)
    chosen, chosen_s = _split_if_faster(touched, profile, cluster, staggered, memo)
    if len(touched.pipelines) == len(plan.pipelines):
        return chosen, chosen_s
    graph = op_graph(plan, profile, cluster)
    if any(op.kind == WEIGHT_GRAD for ops in chosen.schedule.values() for op in ops):
        timing = decoupled_pipelines(plan, profile, cluster, graph=graph).first
    else:
        timing = simulate_pipelines(plan, profile, cluster, graph=graph)
    return timing, step_time(plan, profile, cluster, timing, staggered=staggered, graph=graph)


def step_time(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None,
    timing: PipelineTiming,
    *,
    staggered: bool,
    graph: OpGraph | None = None,
) -> float:
    """Pipeline seconds per step of ``timing``'s op lists: the makespan, or with
    ``staggered`` optimizer steps, the steady-state period where it is shorter. Without
    reroutes it never is (every pipeline's first stage holds layer 0, so all first stages
    wait for each other, and each ends its pipeline's step, 1F1B's last backward, so the
    next step starts when the last pipeline ends, and every other stage's partners are
    done before its first input arrives; retake snapshots only add to the period)."""
    if not (staggered and plan.reroutes):
        return timing.makespan_s
    period = staggered_period(plan, profile, cluster, timing.schedule, graph=graph)
    return period if period < timing.makespan_s * (1 - ROUNDING) else timing.makespan_s


def staggers(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None, timing: PipelineTiming
) -> bool:
    """Whether the runtime staggers optimizer steps over ``timing``'s op lists (when
    ``odyssey.staggered_optimizer`` allows it): where ``step_time`` prices them staggered."""
    return step_time(plan, profile, cluster, timing, staggered=True) < timing.makespan_s


def rerouted_makespan(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None = None,
    *,
    decouple: bool = False,
    staggered: bool = False,
    memo: dict | None = None,
) -> float:
    """Pipeline seconds per step (``step_time``) of the pipelines a reroute touches: those
    with a failed stage and those whose owners adopt micro-batches. The rest run their
    plain 1F1B schedules, unchanged, so comparing reroutes of one layout needs only this
    (a small share of a large plan). ``decouple``, ``staggered`` and ``memo`` as in
    ``timed_step_schedule``."""
    touched = _touched(plan)
    if decouple and plan.reroutes:
        return _split_if_faster(touched, profile, cluster, staggered, memo)[1]
    graph = op_graph(touched, profile, cluster)
    timing = simulate_pipelines(touched, profile, cluster, graph=graph)
    return step_time(touched, profile, cluster, timing, staggered=staggered, graph=graph)


def _split_if_faster(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None, staggered: bool, memo: dict | None
) -> tuple[PipelineTiming, float]:
    """Split op lists if their ``step_time`` beats plain 1F1B's and they fit in memory;
    the chosen timing and its step time."""
    if memo is None:
        return _choose_split(plan, profile, cluster, staggered)
    key = (plan, staggered)
    if key not in memo:
        memo[key] = _choose_split(plan, profile, cluster, staggered)
    return memo[key]


def _choose_split(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None, staggered: bool
) -> tuple[PipelineTiming, float]:
    graph = op_graph(plan, profile, cluster)
    plain = simulate_pipelines(plan, profile, cluster, graph=graph)
    plain_s = step_time(plan, profile, cluster, plain, staggered=staggered, graph=graph)
    split = decoupled_pipelines(plan, profile, cluster, graph=graph).first
    split_s = step_time(plan, profile, cluster, split, staggered=staggered, graph=graph)
    if split_s >= plain_s:
        return plain, plain_s
    if max(peak_memory(plan, profile, split.schedule).values(), default=0) > profile.memory_budget_bytes:
        return plain, plain_s
    return split, split_s


def _touched(plan: ExecutionPlan) -> ExecutionPlan:
    """The sub-plan of pipelines a reroute touches, without sync or transfers (so equal
    reroutes give equal sub-plans, for the memo)."""
    return sub_plan(plan, touched_pipelines(plan))
