"""Data-parallel gradient sync time for layer-granular all-reduces in coloured rounds.

Units in one round touch disjoint workers and run concurrently; rounds run one after
another (paper 001, section IV-B). A symmetric layout is one round; asymmetric layouts
add units and rounds, which is the cost Eq. 8 must see. With the distributed optimizer
the owners' stepped weights are all-gathered over the same units after the step
(``param_gather_time``).
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


def unit_link(unit: SyncUnit, profile: ModelProfile, cluster: ClusterState | None) -> tuple[float, float]:
    """(bandwidth, latency) of one sync unit's collectives, on the profile's all-reduce fit
    (``ModelProfile.allreduce_link``): the slower link where the unit spans nodes."""
    spans_nodes = cluster is None or len({cluster.node_of_worker(w) for w in unit.workers}) > 1
    return profile.allreduce_link(spans_nodes=spans_nodes)


def unit_sync_time(unit: SyncUnit, profile: ModelProfile, cluster: ClusterState | None) -> float:
    """Seconds of one sync unit's all-reduce."""
    num_bytes = sum(profile.block(b).grad_bytes for b in unit.blocks)
    bandwidth, latency_s = unit_link(unit, profile, cluster)
    return allreduce_time(num_bytes, group_size=len(unit.workers), bandwidth=bandwidth, latency_s=latency_s)


def sync_time(plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None = None) -> float:
    """Seconds of DP gradient sync per step for the plan's rounds."""
    return _in_rounds(plan, lambda unit: unit_sync_time(unit, profile, cluster))


def allgather_time(num_bytes: float, *, group_size: int, bandwidth: float, latency_s: float) -> float:
    """Ring all-gather of ``num_bytes`` in all: each rank receives (n-1)/n of them, n-1 latencies."""
    if group_size <= 1 or num_bytes == 0:
        return 0.0
    steps = group_size - 1
    return steps / group_size * num_bytes / bandwidth + steps * latency_s


def param_gather_time(plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None = None) -> float:
    """Seconds per step of the distributed optimizer's weight all-gather (``optimizer_shards``):
    every unit's weights, each block's sent once from one of its owners, as Megatron-Core's
    ``DistributedOptimizer`` gathers its shards, in the gradient sync's rounds."""
    def unit_time(unit: SyncUnit) -> float:
        bandwidth, latency_s = unit_link(unit, profile, cluster)
        return allgather_time(sum(profile.block(b).param_bytes for b in unit.blocks), group_size=len(unit.workers),
                              bandwidth=bandwidth, latency_s=latency_s)

    return _in_rounds(plan, unit_time)


def _in_rounds(plan: ExecutionPlan, unit_time) -> float:
    """Units of a round run at once, rounds one after another."""
    return sum(max((unit_time(plan.sync_units[u]) for u in round_), default=0.0) for round_ in plan.comm_rounds)
