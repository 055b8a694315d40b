"""Symmetric plans: one priced decision per class of equivalent failures, renamed per failure.

On Megatron's layout (stage s of pipeline d on worker s * DP + d, every pipeline with the
same stage boundaries and micro-batch count) two failures are equivalent when a
*structure-preserving* worker permutation pi maps one onto the other: pi maps every
worker to one of the same stage (same layer range) and keeps nodes (two workers share a
node after pi exactly when they did before). The plans used here are pipeline
permutations that keep each group of pipelines sharing nodes together.

After a failure the plan is still symmetric on most of it: the groups of pipelines the
recovery left alone (every stage alive and in Megatron's position, no reroute from or to
them) are interchangeable among themselves, and pi permutes only those, so the reroutes,
failed workers and moved stages of the others are its fixed points. A failure in another
group has no equivalent and is priced on its own.

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
from collections import Counter
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
    any permutation of the ``eligible`` groups' pipelines that maps groups onto groups
    keeps stages and nodes.
    """

    data_parallel: int
    stages: int
    group: int
    """Pipelines per group of pipelines that share nodes."""
    workers_per_node: int
    """Workers on one node; 1 where a worker spans one node or more."""
    eligible: tuple[int, ...]
    """The first pipeline of each interchangeable group, ascending: every group of a
    failure-free plan, the groups a recovery left alone after a failure (``symmetry``)."""

    def worker(self, stage: int, pipeline: int) -> int:
        return stage * self.data_parallel + pipeline

    def covers(self, worker: int) -> bool:
        """Whether ``worker``'s failure is renamed from a representative's: it is one of
        Megatron's workers in an eligible group."""
        if not 0 <= worker < self.stages * self.data_parallel:
            return False
        block = worker % self.data_parallel // self.group * self.group
        i = bisect_left(self.eligible, block)
        return i < len(self.eligible) and self.eligible[i] == block

    def representatives(self) -> list[frozenset[int]]:
        """One failure per class: each stage's worker in the first eligible pipeline,
        then each node of the first eligible group (every node when a node holds whole
        stages)."""
        first = self.eligible[0]
        singles = [frozenset([self.worker(s, first)]) for s in range(self.stages)]
        if self.workers_per_node < 2:
            return singles
        if self.group == self.data_parallel:
            workers = self.stages * self.data_parallel
            step = self.workers_per_node
            return singles + [frozenset(range(start, min(start + step, workers))) for start in range(0, workers, step)]
        return singles + [frozenset(self.worker(s, first + i) for i in range(self.group)) for s in range(self.stages)]

    def relabelling(self, failed: frozenset[int]) -> Optional[tuple[frozenset[int], dict[int, int]]]:
        """(representative, pi) with pi(representative) == ``failed``, pi given on its
        support only; None unless ``failed`` is one worker or one node's workers of an
        eligible group. ``failed`` is the new failure only, without workers failed before."""
        dp, workers, first = self.data_parallel, self.stages * self.data_parallel, self.eligible[0]
        if not failed or not all(map(self.covers, failed)):
            return None
        if len(failed) == 1:
            (worker,) = failed
            stage, pipeline = divmod(worker, dp)
            order = self._swap_groups(pipeline)
            at = order.index(pipeline)  # then the transposition that brings the first pipeline to ``pipeline``
            order[first], order[at] = order[at], order[first]
            return frozenset([self.worker(stage, first)]), self._pipeline_map(order)
        start = min(failed) // self.workers_per_node * self.workers_per_node
        if failed != frozenset(range(start, min(start + self.workers_per_node, workers))):
            return None
        if self.group == dp:  # a node holds whole stages: it is its own class
            return failed, {}
        stage, pipeline = divmod(start, dp)
        return frozenset(self.worker(stage, first + i) for i in range(self.group)), \
            self._pipeline_map(self._swap_groups(pipeline))

    def _swap_groups(self, pipeline: int) -> list[int]:
        """The pipeline permutation (order[j]: where pipeline j goes) that swaps the first
        eligible group of pipelines with ``pipeline``'s, position by position."""
        order = list(range(self.data_parallel))
        first, block = self.eligible[0], pipeline - pipeline % self.group
        for i in range(self.group if block != first else 0):
            order[first + i], order[block + i] = block + i, first + i
        return order

    def _pipeline_map(self, order: list[int]) -> dict[int, int]:
        """The worker map of the pipeline permutation ``order``, on its support."""
        moved = [j for j, to in enumerate(order) if to != j]
        return {self.worker(s, j): self.worker(s, order[j]) for s in range(self.stages) for j in moved}


def symmetry(plan: ExecutionPlan, cluster: ClusterState) -> Optional[Symmetry]:
    """The plan's symmetry on ``cluster``, or None where failures must be priced one by
    one: no group of pipelines is eligible, or nodes split pipelines unevenly.

    A group is eligible when each of its pipelines has every stage alive on its Megatron
    worker, with the layer ranges and micro-batch count most such pipelines have, and no
    reroute, failed worker or other stage names its pipeline or workers. Its nodes then
    hold only its workers (a node holds workers of one group, or one worker spans nodes),
    all alive. Where a node holds whole stages (``group`` is DP) one failure anywhere
    leaves no group eligible: nothing is interchangeable after it."""
    if not plan.pipelines:
        return None
    dp = len(plan.pipelines)
    pp, rest = divmod(cluster.num_workers, dp)
    if rest or not pp:
        return None
    tp, per_node, per = cluster.tensor_parallel_size, cluster.devices_per_node, cluster.workers_per_node
    if tp % per_node == 0:
        group, per = 1, 1
    elif per_node % tp:
        return None  # a worker straddles two nodes it shares with others
    elif dp % per == 0:
        group = per
    elif per % dp == 0:
        group = dp
    else:
        return None
    named = Counter(s.worker for p in plan.pipelines for s in p.stages)  # a worker named twice is not free
    taken = {r.worker for r in plan.reroutes} | set(cluster.failed_workers)
    sources = {r.pipeline for r in plan.reroutes}
    keys: list[Optional[tuple]] = []
    for d, pipeline in enumerate(plan.pipelines):
        free = d not in sources and len(pipeline.stages) == pp and all(
            stage.worker == s * dp + d and stage.worker not in taken and named[stage.worker] == 1
            for s, stage in enumerate(pipeline.stages))
        keys.append((tuple(s.layers for s in pipeline.stages), len(pipeline.micro_batches)) if free else None)
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return None
    reference = max(counts, key=counts.__getitem__)  # the first most common one
    eligible = tuple(b for b in range(0, dp, group) if all(k == reference for k in keys[b:b + group]))
    if not eligible:
        return None
    return Symmetry(dp, pp, group=group, workers_per_node=per, eligible=eligible)


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
