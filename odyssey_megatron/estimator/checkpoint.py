"""What a periodic disk checkpoint costs, which sets its default interval.

Each block's TP shards are written once, by the ranks of the worker that snapshots it
(``snapshot.shards.owners``: spread over the data-parallel replicas), so a rank writes
about its share of its stage divided by DP. As its step starts, a rank copies its share
into host memory (at ``host_bandwidth``); the write to disk then runs in the background,
the ranks of a node sharing its write bandwidth (``cluster.disk_write_gb_s``). The
checkpoint's whole time, copy and the busiest node's write, stands for its cost in
Young's rule (as the in-memory snapshot's does: ``estimator.snapshot``).
"""

from __future__ import annotations

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.estimator.snapshot import snapshot_shares
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile

__all__ = ["checkpoint_time_s"]


def checkpoint_time_s(plan: ExecutionPlan, profile: ModelProfile, *, model: ModelConfig, cluster: ClusterState,
                      disk_write_bytes_s: float) -> float:
    """Seconds a checkpoint of ``plan`` takes until it is durable: the largest rank's copy to
    host memory, then the busiest node's write at ``disk_write_bytes_s``. A rank writes its
    worker's snapshot share (one TP shard of it), as the checkpoint writer does."""
    by_rank = {rank: share for worker, share in snapshot_shares(plan, model).items()
               for rank in cluster.worker_ranks(worker)}
    by_node: dict[int, int] = {}
    for rank, written in by_rank.items():
        node = cluster.node_of_rank(rank)
        by_node[node] = by_node.get(node, 0) + written
    copy_s = max(by_rank.values(), default=0) / profile.host_bandwidth
    return copy_s + max(by_node.values(), default=0) / disk_write_bytes_s
