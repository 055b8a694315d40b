"""Pricing reroutes on thousands of pipelines from a few of them, at the same price.

What rerouting costs (``rerouted_makespan``) is set by the pipelines the reroute touches
(failed ones and the peers adopting their micro-batches) and, class by class, by the
untouched ones. Two cuts keep the price and drop the rest:

- ``pricing_window``: peers adopt micro-batches in pipeline order, one round-robin share
  each, so only the first few peers of each stage ever adopt any. Pipelines with a
  failed stage, plus a prefix of every class of alike pipelines (``distinct_pipelines``'
  key) long enough to hold every adopting peer and one untouched pipeline, reroute
  exactly as the whole plan does, whichever of their stages the failures sit on.
- ``alike_components``: touched pipelines fall into independent components (a failed
  pipeline and the peers adopting from it; none shares an op with another), and a node
  failure makes several of the same shape. Alike components time alike, as untouched
  alike pipelines do, so one of each shape is priced.

Both are exact: the tests compare their prices with those of the whole plan.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import AbstractSet

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.distinct import sub_plan, touched_pipelines
from odyssey_megatron.estimator.memory import held_profile
from odyssey_megatron.estimator.step_schedule import rerouted_makespan
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, Reroute
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.settings import Pricing


def pipeline_kind(pipeline: PipelinePlan, cluster: ClusterState | None) -> tuple:
    """What an untouched pipeline's timing depends on (as in ``distinct_pipelines``)."""
    stages = pipeline.stages
    return (
        len(pipeline.micro_batches),
        tuple(stage.layers for stage in stages),
        tuple(cluster is None or cluster.same_node(a.worker, b.worker) for a, b in zip(stages, stages[1:])),
    )


def pricing_window(layout: ExecutionPlan, *, failed: AbstractSet[int], cluster: ClusterState | None) -> list[int]:
    """Pipelines of ``layout`` whose rerouted plan, with the workers ``failed`` gone, costs
    what the whole one costs, wherever in their pipelines the failures are moved: those
    with a failed stage, and of every other kind the first ones in pipeline order, as many
    as micro-batches can be adopted plus one that stays untouched."""
    broken = {pi for pi, _, stage in layout.stage_positions() if stage.worker is None or stage.worker in failed}
    prefix = sum(len(layout.pipelines[pi].micro_batches) for pi in broken) + len(broken) + 1
    taken: Counter = Counter()
    window = []
    for pi, pipeline in enumerate(layout.pipelines):
        if pi not in broken:
            kind = pipeline_kind(pipeline, cluster)
            if taken[kind] >= prefix:
                continue
            taken[kind] += 1
        window.append(pi)
    return window


class RerouteCost:
    """``rerouted_makespan`` of rerouted plans for one decision (one profile and
    cluster), priced on one touched component of each shape (``alike_components``) and
    remembered by those shapes and the kinds of the untouched pipelines: keys without
    worker ids, so moving one of a node's failures prices the others' alike moves too."""

    def __init__(self, profile: ModelProfile, cluster: ClusterState, *, pricing: Pricing, memo: dict):
        self.profile = profile
        self.cluster = cluster
        self.pricing = pricing
        self.memo = memo
        self._priced: dict[tuple, float | None] = {}

    def __call__(self, plan: ExecutionPlan) -> float | None:
        held = held_profile(plan, self.profile, pricing=self.pricing)  # the whole plan's holders, not the cut's
        cut, key = alike_components(plan, self.cluster)
        key = key, held
        if key not in self._priced:
            self._priced[key] = rerouted_makespan(cut, held, self.cluster, pricing=self.pricing, memo=self.memo)
        return self._priced[key]


def alike_components(plan: ExecutionPlan, cluster: ClusterState | None) -> tuple[ExecutionPlan, tuple]:
    """(``plan`` (rerouted) with one touched component of each shape and every untouched
    pipeline, which ``rerouted_makespan`` prices as it prices ``plan``; what that price
    depends on: the shapes and the kinds of untouched pipelines)."""
    touched = touched_pipelines(plan)
    owner = {stage.worker: pi for pi, _, stage in plan.stage_positions() if stage.worker is not None}
    parent = {pi: pi for pi in touched}

    def root(pi: int) -> int:
        while parent[pi] != pi:
            parent[pi] = parent[parent[pi]]
            pi = parent[pi]
        return pi

    for r in plan.reroutes:
        parent[root(owner[r.worker])] = root(r.pipeline)
    members: dict[int, list[int]] = {}
    for pi in sorted(touched):
        members.setdefault(root(pi), []).append(pi)
    by_pipeline: dict[int, list[Reroute]] = {}
    for r in plan.reroutes:
        by_pipeline.setdefault(r.pipeline, []).append(r)
    untouched = set(range(len(plan.pipelines))) - touched
    shapes, kept = set(), set(untouched)
    for component in members.values():
        shape = _shape(plan, component, [r for pi in component for r in by_pipeline.get(pi, ())], cluster)
        if shape not in shapes:
            shapes.add(shape)
            kept.update(component)
    key = frozenset(shapes), frozenset(pipeline_kind(plan.pipelines[pi], cluster) for pi in untouched)
    if len(kept) == len(plan.pipelines):
        return plan, key
    return sub_plan(replace(plan, reroutes=tuple(r for r in plan.reroutes if r.pipeline in kept)), kept), key


def _shape(plan: ExecutionPlan, component: list[int], reroutes: list[Reroute], cluster: ClusterState | None) -> tuple:
    """The component up to renaming pipelines, workers and micro-batches in order: what
    its timing depends on (layers, orders of micro-batches and workers, who shares a node)."""
    local = {pi: k for k, pi in enumerate(component)}
    ids = sorted(m for pi in component for m in plan.pipelines[pi].micro_batches)
    mb = {m: k for k, m in enumerate(ids)}
    workers = sorted(s.worker for pi in component for s in plan.pipelines[pi].stages if s.worker is not None)
    rank = {w: k for k, w in enumerate(workers)}
    nodes: dict[int, int] = {}
    node_of = {w: nodes.setdefault(cluster.node_of_worker(w) if cluster else 0, len(nodes)) for w in workers}
    pipelines = tuple(
        (tuple(s.layers for s in plan.pipelines[pi].stages),
         tuple(mb[m] for m in plan.pipelines[pi].micro_batches),
         tuple(None if s.worker is None else (rank[s.worker], node_of[s.worker]) for s in plan.pipelines[pi].stages))
        for pi in component
    )
    moved = tuple((local[r.pipeline], r.stage, rank[r.worker], tuple(mb[m] for m in r.micro_batches))
                  for r in reroutes)
    return pipelines, moved
