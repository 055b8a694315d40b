"""Identical pipelines time alike, so the estimator simulates one of each.

A pipeline no reroute touches runs plain 1F1B on its own workers: its ops take the same
times as those of any other such pipeline with the same stage layer ranges, the same
number of micro-batches and the same kind of link (within a node or across) between
adjacent stages. Its stages hold the same blocks, so they are in the same DP sync groups
and, under staggered optimizer steps, wait for the same group ends. Keeping one pipeline
of each such class (and every touched pipeline) leaves the makespan, the staggered period
and each stage's peak memory unchanged, and a decision on 1024 ranks costs about what
one on 32 does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan


def touched_pipelines(plan: ExecutionPlan) -> set[int]:
    """Pipelines with a failed stage or a stage owner that adopts rerouted micro-batches."""
    owner_pipeline = {stage.worker: pi for pi, _, stage in plan.stage_positions() if stage.worker is not None}
    involved = {pi for pi, _, stage in plan.stage_positions() if stage.worker is None}
    return involved | {owner_pipeline[r.worker] for r in plan.reroutes}


def sub_plan(plan: ExecutionPlan, pipelines: Iterable[int]) -> ExecutionPlan:
    """``plan`` cut down to ``pipelines`` (renumbered in order), without sync or transfers."""
    kept = sorted(pipelines)
    index = {old: new for new, old in enumerate(kept)}
    return replace(
        plan,
        pipelines=tuple(plan.pipelines[pi] for pi in kept),
        reroutes=tuple(replace(r, pipeline=index[r.pipeline]) for r in plan.reroutes),
        sync_units=(), comm_rounds=(), transfers=(),
    )


def distinct_pipelines(plan: ExecutionPlan, cluster: ClusterState | None, *,
                       slowdowns: Mapping[int, float] | None = None) -> tuple[ExecutionPlan, tuple[int, ...]]:
    """(``plan`` with its touched pipelines and one pipeline of each class of untouched
    ones, the index in it of the pipeline that stands for each of ``plan``'s). A pipeline
    with a worker in ``slowdowns`` (slower than the profile says) stands only for those
    whose workers are slowed alike."""
    touched = touched_pipelines(plan)
    first_of: dict[tuple, int] = {}
    kept: list[int] = []
    stands_for: list[int] = []
    for pi, pipeline in enumerate(plan.pipelines):
        stages = pipeline.stages
        key = ("touched", pi) if pi in touched else (
            len(pipeline.micro_batches),
            tuple(stage.layers for stage in stages),
            tuple(cluster is None or cluster.same_node(a.worker, b.worker) for a, b in zip(stages, stages[1:])),
            tuple(slowdowns.get(stage.worker, 1.0) for stage in stages) if slowdowns else (),
        )
        if key not in first_of:
            first_of[key] = len(kept)
            kept.append(pi)
        stands_for.append(first_of[key])
    if len(kept) == len(plan.pipelines):
        return plan, tuple(stands_for)
    return sub_plan(plan, kept), tuple(stands_for)
