"""Symmetric plans: one priced decision per class of equivalent failures, renamed per failure.

On Megatron's layout (stage s of pipeline d on worker s * DP + d, every pipeline with the
same stage boundaries and micro-batch count, no reroutes, nothing failed) two failures
are equivalent when a *structure-preserving* worker permutation pi maps one onto the
other: pi maps every worker to one of the same stage (same layer range) and keeps nodes
(two workers share a node after pi exactly when they did before). The plans used here
are pipeline permutations that keep each group of pipelines sharing nodes together.

Renaming the workers of a decision D made for the representative failure R gives a
decision pi(D) for pi(R), exact in what matters: each worker pi(w) holds the blocks w held
(same stage), so D's transfers, renamed per TP shard, still read from holders and fill
every stage; intra- and inter-node links are where they were (nodes kept), so the
estimate, the memory per pipeline position, the layout and the sole holders are D's.
Pipeline positions and micro-batch ids are not renamed: pipeline position 0 of pi(D)
may be run by the workers of another pipeline, which is still a plan of the same shape.
pi(D) is not always the decision a cold search would make for pi(R): the search breaks
ties by worker id, so mirrored failures may get cold plans a few percent apart.

Renaming touches only what names a worker of pi's support (a few pipelines); everything
else is shared with D, so a prepared decision is renamed in milliseconds at 16,384 ranks.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Mapping, Optional

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, Reroute, StagePlan, SyncUnit, Transfer
from odyssey_megatron.planner.decide import Drafts


@dataclass(frozen=True)
class Symmetry:
    """A plan on Megatron's layout whose pipelines are interchangeable in groups.

    Pipelines [k * group, (k + 1) * group) share nodes (a node holds some of their
    workers of one stage, or whole stages of every pipeline when ``group`` is DP), and
    any permutation of pipelines that maps groups onto groups keeps stages and nodes.
    """

    data_parallel: int
    stages: int
    group: int
    """Pipelines per group of pipelines that share nodes."""
    workers_per_node: int
    """Workers on one node; 1 where a worker spans one node or more."""

    def worker(self, stage: int, pipeline: int) -> int:
        return stage * self.data_parallel + pipeline

    def representatives(self) -> list[frozenset[int]]:
        """One failure per class: each stage's worker in pipeline 0, then each node of
        the first group of pipelines (every node when a node holds whole stages)."""
        singles = [frozenset([self.worker(s, 0)]) for s in range(self.stages)]
        if self.workers_per_node < 2:
            return singles
        if self.group == self.data_parallel:
            workers = self.stages * self.data_parallel
            step = self.workers_per_node
            return singles + [frozenset(range(start, min(start + step, workers))) for start in range(0, workers, step)]
        return singles + [frozenset(self.worker(s, i) for i in range(self.group)) for s in range(self.stages)]

    def relabelling(self, failed: frozenset[int]) -> Optional[tuple[frozenset[int], dict[int, int]]]:
        """(representative, pi) with pi(representative) == ``failed``, pi given on its
        support only; None unless ``failed`` is one worker or one node's workers."""
        dp, workers = self.data_parallel, self.stages * self.data_parallel
        if not failed or min(failed) < 0 or max(failed) >= workers:
            return None
        if len(failed) == 1:
            (worker,) = failed
            stage, pipeline = divmod(worker, dp)
            order = self._swap_groups(pipeline)
            at = order.index(pipeline)  # then the transposition that brings pipeline 0 to ``pipeline``
            order[0], order[at] = order[at], order[0]
            return frozenset([self.worker(stage, 0)]), self._pipeline_map(order)
        first = min(failed) // self.workers_per_node * self.workers_per_node
        if failed != frozenset(range(first, min(first + self.workers_per_node, workers))):
            return None
        if self.group == dp:  # a node holds whole stages: it is its own class
            return failed, {}
        stage, pipeline = divmod(first, dp)
        return frozenset(self.worker(stage, i) for i in range(self.group)), \
            self._pipeline_map(self._swap_groups(pipeline))

    def _swap_groups(self, pipeline: int) -> list[int]:
        """The pipeline permutation (order[j]: where pipeline j goes) that swaps the first
        group of pipelines with ``pipeline``'s, position by position."""
        order = list(range(self.data_parallel))
        block = pipeline - pipeline % self.group
        for i in range(self.group if block else 0):
            order[i], order[block + i] = block + i, i
        return order

    def _pipeline_map(self, order: list[int]) -> dict[int, int]:
        """The worker map of the pipeline permutation ``order``, on its support."""
        moved = [j for j, to in enumerate(order) if to != j]
        return {self.worker(s, j): self.worker(s, order[j]) for s in range(self.stages) for j in moved}


def symmetry(plan: ExecutionPlan, cluster: ClusterState) -> Optional[Symmetry]:
    """The plan's symmetry on ``cluster``, or None where failures must be priced one by
    one: reroutes, pipelines with different stages or micro-batch counts, a failed or
    idle worker, workers not in Megatron's order, or nodes that split pipelines unevenly."""
    if plan.reroutes or cluster.failed_ranks or not plan.pipelines:
        return None
    dp, first = len(plan.pipelines), plan.pipelines[0]
    pp, per_pipeline = first.num_stages, len(first.micro_batches)
    ranges = [s.layers for s in first.stages]
    if cluster.num_workers != dp * pp:
        return None
    for d, pipeline in enumerate(plan.pipelines):
        if len(pipeline.micro_batches) != per_pipeline or len(pipeline.stages) != pp:
            return None
        for s, stage in enumerate(pipeline.stages):
            if stage.worker != s * dp + d or stage.layers != ranges[s]:
                return None
    tp, per_node = cluster.tensor_parallel_size, cluster.devices_per_node
    if tp % per_node == 0:
        return Symmetry(dp, pp, group=1, workers_per_node=1)
    if per_node % tp:
        return None  # a worker straddles two nodes it shares with others
    g = per_node // tp
    if dp % g == 0:
        return Symmetry(dp, pp, group=g, workers_per_node=g)
    if g % dp == 0:
        return Symmetry(dp, pp, group=dp, workers_per_node=g)
    return None


def rename_plan(plan: ExecutionPlan, pi: Mapping[int, int]) -> ExecutionPlan:
    """``plan`` with every worker w of ``pi``'s support replaced by pi[w] (the ranks of
    transfers per TP shard); objects naming no such worker are shared, not copied."""
    if not pi:
        return plan
    tp = plan.tensor_parallel_size

    def rank(r: Optional[int]) -> Optional[int]:
        return r if r is None or r // tp not in pi else pi[r // tp] * tp + r % tp

    def stage(s: StagePlan) -> StagePlan:
        return s if s.worker not in pi else StagePlan(pi[s.worker], s.layers)

    support, worker_of = pi.keys(), attrgetter("worker")  # C-level scans: a plan has up to 16,384 stages
    pipelines = tuple(
        p if support.isdisjoint(map(worker_of, p.stages)) else PipelinePlan(tuple(map(stage, p.stages)), p.micro_batches)
        for p in plan.pipelines
    )
    reroutes = tuple(r if r.worker not in pi else Reroute(r.pipeline, r.stage, pi[r.worker], r.micro_batches)
                     for r in plan.reroutes)
    transfers = tuple(t if rank(t.src) == t.src and rank(t.dst) == t.dst
                      else Transfer(t.layer, rank(t.src), rank(t.dst), t.bytes) for t in plan.transfers)
    units = tuple(_rename_unit(u, pi) for u in plan.sync_units)
    return replace(plan, pipelines=pipelines, reroutes=reroutes, sync_units=units, transfers=transfers)


def _rename_unit(unit: SyncUnit, pi: Mapping[int, int]) -> SyncUnit:
    """The unit over the renamed workers, ascending as ``restorer.sync_units`` lists them;
    the same object when pi maps its workers in the support onto themselves (a DP
    replica set that pi only reorders). Membership is found by bisection: a unit lists
    up to every pipeline, the support a few."""
    workers = unit.workers
    held = [w for w in pi if (i := bisect_left(workers, w)) < len(workers) and workers[i] == w]
    renamed = {pi[w] for w in held}
    if renamed == set(held):
        return unit
    return SyncUnit(unit.blocks, tuple(sorted(set(workers).difference(held) | renamed)))


def rename_drafts(drafts: Drafts, pi: Mapping[int, int]) -> Drafts:
    """The drafts of the representative failure, renamed for the failure pi maps it to.
    Estimates, transfer and restart times, sole holders and layouts are kept: pi keeps
    stages and nodes, so they are the renamed plans' own (module docstring)."""
    if not pi:
        return drafts
    renamed = tuple(d if d.plan is drafts.current else replace(d, plan=rename_plan(d.plan, pi))
                    for d in drafts.drafts)
    return replace(drafts, drafts=renamed)
