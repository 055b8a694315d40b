"""Data-parallel gradient sync time for layer-granular all-reduces in coloured rounds.

Units in one round touch disjoint workers and run concurrently; rounds run one after
another (paper 001, section IV-B). A symmetric layout is one round; asymmetric layouts
add units and rounds, which is the cost Eq. 8 must see.
"""

from __future__ import annotations

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan, SyncUnit
from odyssey_megatron.profile import ModelProfile


def allreduce_time(num_bytes: float, *, group_size: int, bandwidth: float, latency_s: float) -> float:
    """Ring all-reduce: 2 (n-1)/n of the bytes over the slowest link, 2 (n-1) latencies."""
    if group_size <= 1 or num_bytes == 0:
        return 0.0
    steps = 2 * (group_size - 1)
    return steps / group_size * num_bytes / bandwidth + steps * latency_s


def unit_sync_time(unit: SyncUnit, profile: ModelProfile, cluster: ClusterState | None) -> float:
    """Seconds of one sync unit's all-reduce, on the profile's all-reduce fit
    (``ModelProfile.allreduce_link``)."""
    num_bytes = sum(profile.block(b).grad_bytes for b in unit.blocks)
    spans_nodes = cluster is None or len({cluster.node_of_worker(w) for w in unit.workers}) > 1
    bandwidth, latency_s = profile.allreduce_link(spans_nodes=spans_nodes)
    return allreduce_time(num_bytes, group_size=len(unit.workers), bandwidth=bandwidth, latency_s=latency_s)


def sync_time(plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None = None) -> float:
    """Seconds of DP gradient sync per step for the plan's rounds."""
    return sum(
        max((unit_sync_time(plan.sync_units[u], profile, cluster) for u in round_), default=0.0)
        for round_ in plan.comm_rounds
    )
