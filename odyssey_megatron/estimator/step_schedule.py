"""Which op lists one training step runs: plain 1F1B, or decoupled weight gradients
where that pays (``estimator.decoupled``), and what a step costs: its makespan, or under
staggered optimizer steps, where they pay (``staggers``), the steady-state period
(``estimator.staggered``).

Every plan gets the same options, a failure-free one as much as a rerouted one, so a
failure never makes the estimated step faster. A plan falls into independent parts:
the pipelines a reroute touches (their workers share micro-batches) and the untouched
rest (each its own 1F1B pipeline); each part picks split or plain op lists by its own
step time, which keeps the choice for the touched part, the one that differs between
the reroutes of one layout, a small computation."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.decoupled import decoupled_pipelines
from odyssey_megatron.estimator.distinct import distinct_pipelines, sub_plan, touched_pipelines
from odyssey_megatron.estimator.memory import peak_memory
from odyssey_megatron.estimator.pipeline import (
    PipelineTiming, fixed_order_step, makespan_lower_bound, simulate_pipelines,
)
from odyssey_megatron.estimator.replay import KINDS, OpGraph, op_graph, op_kinds
from odyssey_megatron.estimator.staggered import staggered_period
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import WEIGHT_GRAD
from odyssey_megatron.settings import PLAIN, Pricing

ROUNDING = 1e-9
"""Relative difference below which a staggered period equals the makespan: the two sum
the same op times in different orders, and staggering that gains nothing but rounding
only risks retakes."""


def step_schedule(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None = None,
    *,
    pricing: Pricing = PLAIN,
) -> PipelineTiming:
    """The op lists a step of ``plan`` runs, and their timing: with ``pricing.decouple``,
    each part of the plan (the touched pipelines, the untouched ones) runs decoupled weight
    gradients where that is faster (per step: by ``step_time``) than plain 1F1B and fits
    the memory budget; else plain 1F1B. Split op lists are the first step's of the list
    schedule or, with ``pricing.staggered`` steps, those of a later step, ordered for a staggered
    start, whichever is faster. The estimator and the runtime both call this, so the
    schedule priced is the schedule executed."""
    return timed_step_schedule(plan, profile, cluster, pricing=pricing)[0]


def timed_step_schedule(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None = None,
    *,
    pricing: Pricing = PLAIN,
    memo: dict | None = None,
    slowdowns: Mapping[int, float] | None = None,
) -> tuple[PipelineTiming, float]:
    """``step_schedule`` and its ``step_time``, which the choice may already have computed.
    A ``memo`` kept for one decision (one cluster) remembers each choice, by plan and
    profile: the profile's memory is the whole plan's (``memory.held_profile``), which
    differs between plans whose priced parts look alike.
    ``slowdowns``: workers whose ops take that many times their profiled seconds
    (``replay.op_graph``): a straggler priced at its measured speed."""
    staggered = pricing.staggered
    if not pricing.decouple:
        graph = op_graph(plan, profile, cluster, slowdowns=slowdowns)
        timing = simulate_pipelines(plan, profile, cluster, graph=graph)
        return timing, step_time(plan, profile, cluster, timing, staggered=staggered, graph=graph)
    touched = touched_pipelines(plan)
    untouched = set(range(len(plan.pipelines))) - touched
    if not touched or not untouched:
        return _split_if_faster(plan, profile, cluster, staggered, memo, slowdowns)[:2]
    schedule = {}
    parts = ((sorted(touched), sub_plan(plan, touched)),
             (sorted(untouched), sub_plan(replace(plan, reroutes=()), untouched)))
    for ids, part in parts:  # each part's pipelines are renumbered in order
        chosen = _split_if_faster(part, profile, cluster, staggered, memo, slowdowns)[0]
        schedule.update({worker: [op._replace(pipeline=ids[op.pipeline]) for op in ops]
                         for worker, ops in chosen.schedule.items()})
    graph = op_graph(plan, profile, cluster, slowdowns=slowdowns)
    timing = fixed_order_step(plan, profile, cluster, schedule, graph=graph)
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
    ``staggered`` optimizer steps, the steady-state period where it is shorter. That
    needs split backwards: without them every op of a step precedes a first-stage
    backward (each pipeline's last op), every op of the next step follows a first-stage
    forward, and all first stages wait for each other (they hold layer 0), so the next
    step starts when the last one ends; retake snapshots only add to the period."""
    weight_grad = KINDS.index(WEIGHT_GRAD)  # split backwards run W ops
    if not (staggered and any((op_kinds(timing.schedule, w) == weight_grad).any() for w in timing.schedule)):
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
    pricing: Pricing = PLAIN,
    memo: dict | None = None,
) -> float | None:
    """Pipeline seconds per step (``step_time``) of the pipelines a reroute touches (those
    with a failed stage and those whose owners adopt micro-batches), but no less than the
    step time of the untouched ones on their own, which bound the step too; None where
    the touched workers' op lists exceed the memory budget. Comparing reroutes of one
    layout needs only this (a small share of a large plan), and a reroute whose touched
    pipelines beat the untouched ones gains nothing by beating them further.
    ``pricing`` and ``memo`` as in ``timed_step_schedule``; ``profile``'s memory is the
    whole rerouted plan's (``memory.held_profile``) where ``plan`` is a cut of it."""
    staggered = pricing.staggered
    touched_ids = touched_pipelines(plan)
    touched = sub_plan(plan, touched_ids)  # without sync or transfers: equal reroutes, equal memo keys
    if pricing.decouple:
        timing, touched_s, fits = _split_if_faster(touched, profile, cluster, staggered, memo)
    else:
        graph = op_graph(touched, profile, cluster)
        timing = simulate_pipelines(touched, profile, cluster, graph=graph)
        touched_s = step_time(touched, profile, cluster, timing, staggered=staggered, graph=graph)
        fits = _fits_memory(touched, profile, timing)
    if not fits:
        return None
    return max(touched_s, _untouched_step(plan, touched_ids, profile, cluster, pricing, memo))


def _fits_memory(plan: ExecutionPlan, profile: ModelProfile, timing: PipelineTiming) -> bool:
    return max(peak_memory(plan, profile, timing.schedule).values(), default=0) <= profile.memory_budget_bytes


def _untouched_step(
    plan: ExecutionPlan, touched: set[int], profile: ModelProfile, cluster: ClusterState | None,
    pricing: Pricing, memo: dict | None,
) -> float:
    """Step time of the pipelines not in ``touched`` on their own, as ``timed_step_schedule``
    prices them (0 if there are none)."""
    untouched = set(range(len(plan.pipelines))) - touched
    if not untouched:
        return 0.0
    classes = distinct_pipelines(sub_plan(replace(plan, reroutes=()), untouched), cluster)[0]
    key = ("untouched", classes, pricing, profile)
    if memo is None or key not in memo:
        step_s = timed_step_schedule(classes, profile, cluster, pricing=pricing)[1]
        if memo is None:
            return step_s
        memo[key] = step_s
    return memo[key]


def _split_if_faster(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None, staggered: bool, memo: dict | None,
    slowdowns: Mapping[int, float] | None = None,
) -> tuple[PipelineTiming, float, bool]:
    """Split op lists if their ``step_time`` beats plain 1F1B's and they fit in memory;
    the chosen timing, its step time, and whether it fits in memory (plain 1F1B may not)."""
    if memo is None:
        return _choose_split(plan, profile, cluster, staggered, slowdowns)
    # keyed without what the choice never reads, so a plan priced bare (``rerouted_makespan``)
    # and again with its sync and transfers (``estimate_plan``) is chosen once
    key = (replace(plan, sync_units=(), comm_rounds=(), transfers=()), staggered,
           frozenset((slowdowns or {}).items()), profile)
    if key not in memo:
        memo[key] = _choose_split(plan, profile, cluster, staggered, slowdowns)
    return memo[key]


def _choose_split(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None, staggered: bool,
    slowdowns: Mapping[int, float] | None = None,
) -> tuple[PipelineTiming, float, bool]:
    """Plain 1F1B, or split op lists (the list scheduler's first step, or with
    ``staggered`` steps its later one) where faster and within memory; plain 1F1B's
    replay is spared where split op lists that fit beat its ``makespan_lower_bound``."""
    graph = op_graph(plan, profile, cluster, slowdowns=slowdowns)
    decoupled = decoupled_pipelines(plan, profile, cluster, graph=graph, iterations=2 if staggered else 1)
    first_s = step_time(plan, profile, cluster, decoupled.first, staggered=staggered, graph=graph)
    first_fits = _fits_memory(plan, profile, decoupled.first)
    if first_fits and first_s < makespan_lower_bound(graph) * (1 - ROUNDING):  # plain 1F1B cannot beat it
        plain, best = None, (decoupled.first, first_s)
    else:
        plain = simulate_pipelines(plan, profile, cluster, graph=graph)
        best = plain, step_time(plan, profile, cluster, plain, staggered=staggered, graph=graph)
        if first_fits and first_s < best[1]:
            best = decoupled.first, first_s
    if staggered and decoupled.period_s < best[1] * (1 - ROUNDING):  # the list scheduler's steady state is faster
        last = fixed_order_step(plan, profile, cluster, decoupled.last, graph=graph)
        last_s = step_time(plan, profile, cluster, last, staggered=staggered, graph=graph)
        if last_s < best[1] and _fits_memory(plan, profile, last):
            best = last, last_s
    return *best, best[0] is not plain or _fits_memory(plan, profile, plain)
