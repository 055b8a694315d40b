"""Seconds of a step's optimizer phase: the global gradient norm's all-reduce, then Adam.

After the DP sync every training rank all-reduces one scalar, its share of the squared
global norm (``hooks.stage_optimizer.StageOptimizer.clip``), over all training ranks, then clips
and steps Adam over the blocks it holds; the next step waits for the slowest rank.
Under staggered optimizer steps the norm's all-reduce runs beside the next step
(``runtime.rank.staggered_step``), so only Adam counts.
"""

from __future__ import annotations

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.communication import allreduce_time
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile

NORM_BYTES = 4
"""The norm is one float32: the all-reduce is all latency."""


def norm_allreduce_time(plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None) -> float:
    """Seconds of the global norm's all-reduce over every training rank."""
    workers = plan.workers
    spans_nodes = cluster is None or len({cluster.node_of_worker(w) for w in workers}) > 1
    bandwidth, latency_s = profile.allreduce_link(spans_nodes=spans_nodes)
    return allreduce_time(NORM_BYTES, group_size=len(workers) * plan.tensor_parallel_size, bandwidth=bandwidth,
                          latency_s=latency_s)


def optimizer_time(plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None, *,
                   staggered: bool, sharded: bool = False) -> float:
    """Seconds from the end of the DP sync to the end of the slowest rank's Adam step;
    ``sharded`` (the distributed optimizer): each rank steps its owned ranges of each
    block, their share at the block's holder count in ``plan``.
    Each distinct stage (layers and pipeline position) is priced once: at scale thousands
    of ranks hold the same blocks."""
    stages = {(stage.layers, si == 0, si == len(p.stages) - 1)
              for p in plan.pipelines for si, stage in enumerate(p.stages) if stage.worker is not None}
    holders = plan.holder_counts(profile) if sharded else None
    adam_s = max((profile.optimizer_s(profile.stage_blocks(start, end, first=first, last=last), holders)
                  for (start, end), first, last in stages), default=0.0)
    return adam_s + (0.0 if staggered else norm_allreduce_time(plan, profile, cluster))
