"""Failure normalization (paper 003, 4.2.1) for rerouting, used by Odyssey and ReCycle.

Where a failure sits in its pipeline changes what rerouting costs: the adopted
micro-batches land in different bubbles of the peers' 1F1B schedules. A survivor of the
failed worker's pipeline can take over the failed stage (copying its weights and
optimizer state from a same-stage peer) and leave its own stage to be rerouted instead.
Each new failure is moved, greedily, to the stage of its pipeline where the caller's
cost of the rerouted plan is least; a swap must gain, so ties keep the failure in place.
The same bookkeeping lets idle workers (repaired or spare) take over rerouted stages,
the costliest first. Both return layouts only: the copies a layout needs come from what
survivors hold before it (``restorer.plan_transfers``), not from the layout itself,
where a survivor just moved in holds nothing yet and one moved away still holds its old
stage. On a large cluster each swap is priced on a window of the layout that reroutes
and prices exactly as the whole does (``reroute_pricing``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import AbstractSet, Callable, Optional

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.distinct import sub_plan
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan
from odyssey_megatron.planner.reroute import reroute_plan
from odyssey_megatron.planner.reroute_pricing import pricing_window
from odyssey_megatron.profile import ModelProfile


def normalize_failures(
    layout: ExecutionPlan,
    *,
    new_failures: AbstractSet[int],
    cluster: ClusterState,
    profile: ModelProfile,
    cost: Callable[[ExecutionPlan], Optional[float]],
) -> ExecutionPlan:
    """``layout`` with each of ``new_failures`` moved to its pipeline's cheapest stage
    (``layout`` itself when nothing moves); reroute it to run it. ``cost`` prices a
    rerouted plan (None: infeasible); ``layout`` still names the failed workers."""
    failed = cluster.failed_workers
    before = layout  # who holds what: a survivor swapped in below holds nothing yet
    window = pricing_window(layout, failed=failed, cluster=cluster)  # prices as the whole layout does
    part = sub_plan(replace(layout, reroutes=()), window)
    for worker in sorted(new_failures):
        slot = _slot_of(part, worker)
        if slot is None or not _has_holder(before, window[slot[0]], slot[1], failed, profile):
            continue  # not a stage owner, or nobody left to copy its stage from
        pi, si = slot
        best_cost, best = _rerouted_cost(part, failed, profile, cost), None
        for sj, stage in enumerate(part.pipelines[pi].stages):
            if sj == si or stage.worker is None or stage.worker in failed:
                continue
            candidate = _swap(part, pi, si, sj)
            price = _rerouted_cost(candidate, failed, profile, cost)
            if price is not None and (best_cost is None or price < best_cost - 1e-9):
                best_cost, best = price, sj
        if best is not None:
            part = _swap(part, pi, si, best)
            layout = _swap(layout, window[pi], si, best)
    return layout


def refill_failed_stages(
    plan: ExecutionPlan,
    *,
    idle_workers: AbstractSet[int],
    cluster: ClusterState,
    profile: ModelProfile,
    cost: Callable[[ExecutionPlan], Optional[float]],
) -> ExecutionPlan:
    """Idle workers (repaired, or spare) take over stages whose micro-batches are rerouted,
    each the one whose rerouting ``cost`` most, after a stage copy from a peer. Stages
    nobody can copy from stay rerouted. On a large cluster every price is a whole-plan
    estimate, so prices are skipped where they cannot change the outcome: when there are
    idle workers for every such stage, all are filled in order; and failed stages that
    differ only in their pipeline (same stage, layer split, micro-batch count and failed
    stages) cost alike, so the first of each kind stands for the rest."""
    before = plan  # who holds what: an idle worker given a stage below holds nothing yet
    workers = sorted(idle_workers)
    for n, worker in enumerate(workers):
        fillable = [(pi, si) for pi, si, stage in plan.stage_positions()
                    if stage.worker is None and _has_holder(before, pi, si, cluster.failed_workers, profile)]
        if not fillable:
            break
        if len(workers) - n >= len(fillable):  # a worker for each: all get filled, in any order
            pi, si = fillable[0]
            plan = _assign(plan, pi, si, worker)
            continue
        options = []
        priced = set()
        for pi, si in fillable:
            pipeline = plan.pipelines[pi]
            kind = (si, pipeline.layer_counts, len(pipeline.micro_batches),
                    tuple(s.worker is None for s in pipeline.stages))
            if kind in priced:
                continue
            priced.add(kind)
            filled = _assign(plan, pi, si, worker)
            rerouted = reroute_plan(filled, failed_workers=cluster.failed_workers, profile=profile)
            price = None if rerouted is None else cost(rerouted)
            if price is not None:
                options.append((price, pi, si, filled))
        if not options:
            break
        plan = min(options, key=lambda option: option[:3])[3]
    return plan


def _rerouted_cost(layout, failed, profile, cost) -> Optional[float]:
    plan = reroute_plan(layout, failed_workers=failed, profile=profile)
    return None if plan is None else cost(plan)


def _slot_of(layout: ExecutionPlan, worker: int) -> tuple[int, int] | None:
    for pi, si, stage in layout.stage_positions():
        if stage.worker == worker:
            return pi, si
    return None


def _has_holder(layout: ExecutionPlan, pi: int, si: int, failed: AbstractSet[int], profile: ModelProfile) -> bool:
    """Whether a live owner of stage ``si`` of some pipeline holds the blocks of pipeline ``pi``'s."""
    blocks = layout.blocks_of_stage(pi, si, profile)
    return any(
        stage.worker is not None and stage.worker not in failed and layout.blocks_of_stage(pj, si, profile) == blocks
        for pj, pipeline in enumerate(layout.pipelines) if si < pipeline.num_stages
        for stage in (pipeline.stages[si],)
    )


def _assign(layout: ExecutionPlan, pi: int, si: int, worker: Optional[int]) -> ExecutionPlan:
    stages = list(layout.pipelines[pi].stages)
    stages[si] = StagePlan(worker, stages[si].layers)
    pipelines: list[PipelinePlan] = list(layout.pipelines)
    pipelines[pi] = replace(pipelines[pi], stages=tuple(stages))
    return replace(layout, pipelines=tuple(pipelines))


def _swap(layout: ExecutionPlan, pi: int, si: int, sj: int) -> ExecutionPlan:
    stages = layout.pipelines[pi].stages
    return _assign(_assign(layout, pi, si, stages[sj].worker), pi, sj, stages[si].worker)
