"""Cluster state: which ranks exist, which are alive, and how they group.

Planning works on *workers*: a worker is one tensor-parallel group (TP consecutive
ranks, as Megatron lays them out), because a TP group is only useful whole. A failed
rank takes its worker down; a failed node takes every worker on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable


@dataclass(frozen=True)
class ClusterState:
    """Ranks, liveness and grouping; immutable, so old states stay valid for comparison."""

    world_size: int
    tensor_parallel_size: int = 1
    devices_per_node: int = 8
    failed_ranks: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.world_size <= 0 or self.tensor_parallel_size <= 0 or self.devices_per_node <= 0:
            raise ValueError("world_size, tensor_parallel_size and devices_per_node must be > 0")
        if self.world_size % self.tensor_parallel_size:
            raise ValueError(
                f"world_size ({self.world_size}) must be a multiple of tensor_parallel_size ({self.tensor_parallel_size})"
            )
        bad = sorted(r for r in self.failed_ranks if not 0 <= r < self.world_size)
        if bad:
            raise ValueError(f"failed ranks {bad} are outside 0..{self.world_size - 1}")

    @property
    def num_workers(self) -> int:
        return self.world_size // self.tensor_parallel_size

    def worker_ranks(self, worker: int) -> tuple[int, ...]:
        tp = self.tensor_parallel_size
        return tuple(range(worker * tp, (worker + 1) * tp))

    def worker_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def node_of_worker(self, worker: int) -> int:
        return worker * self.tensor_parallel_size // self.devices_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of_worker(a) == self.node_of_worker(b)

    def node_ranks(self, node: int) -> tuple[int, ...]:
        start = node * self.devices_per_node
        return tuple(range(start, min(start + self.devices_per_node, self.world_size)))

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.devices_per_node)

    @property
    def failed_workers(self) -> frozenset[int]:
        return frozenset(self.worker_of(r) for r in self.failed_ranks)

    @property
    def alive_workers(self) -> tuple[int, ...]:
        failed = self.failed_workers
        return tuple(w for w in range(self.num_workers) if w not in failed)

    @property
    def alive_devices(self) -> int:
        return len(self.alive_workers) * self.tensor_parallel_size

    def fail_ranks(self, ranks: Iterable[int]) -> "ClusterState":
        return replace(self, failed_ranks=self.failed_ranks | frozenset(ranks))

    def repair_ranks(self, ranks: Iterable[int]) -> "ClusterState":
        """The cluster with ``ranks`` back in service (a repaired or replaced device)."""
        return replace(self, failed_ranks=self.failed_ranks - frozenset(ranks))

    def fail_nodes(self, nodes: Iterable[int]) -> "ClusterState":
        nodes = list(nodes)
        bad = [n for n in nodes if not 0 <= n < self.num_nodes]
        if bad:
            raise ValueError(f"failed nodes {bad} are outside 0..{self.num_nodes - 1}")
        return self.fail_ranks(r for n in nodes for r in self.node_ranks(n))
