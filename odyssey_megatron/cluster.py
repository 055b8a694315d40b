"""Cluster state: which ranks exist, which are alive, and how they group.

Planning works on *workers*: a worker is one tensor-parallel group (TP consecutive
ranks, as Megatron lays them out), because a TP group is only useful whole. A failed
rank takes its worker down; a failed node takes every worker on it.

``ClusterState`` owns the arithmetic between launch ranks, workers, TP ranks and nodes
(``rank``, ``worker_of``, ``tp_rank``, ``node_of_rank``): rank ``w * TP + k`` is TP rank k
of worker w, and node n holds ranks ``n * devices_per_node`` onwards. Its nodes are
counted from the first node with workers, and only ever compared with each other ("on
the same node as"). The launcher numbers nodes as launched, node 0 being the
controller's, which under ``cluster.dedicated_controller`` runs no workers: there the two
numberings are one apart. So no node number crosses from the runtime into the decision
center: a lost node comes as the ranks it ran (``detector.Failure``), its keeper's too
(``snapshot.restore``), and this module alone says which ranks share a node.
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

    @property
    def workers_per_node(self) -> int:
        """Whole workers one node holds: 0 where a worker spans nodes (TP above devices_per_node)."""
        return self.devices_per_node // self.tensor_parallel_size

    def rank(self, worker: int, tp_rank: int = 0) -> int:
        """The launch rank of ``worker``'s TP rank ``tp_rank``."""
        return worker * self.tensor_parallel_size + tp_rank

    def worker_ranks(self, worker: int) -> tuple[int, ...]:
        return tuple(self.rank(worker, k) for k in range(self.tensor_parallel_size))

    def ranks_of(self, workers: Iterable[int]) -> list[int]:
        """Every rank of ``workers``, worker by worker."""
        return [rank for worker in workers for rank in self.worker_ranks(worker)]

    def worker_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_rank(self, rank: int) -> int:
        """Launch rank ``rank``'s place in its worker's TP group."""
        return rank % self.tensor_parallel_size

    def node_of_rank(self, rank: int) -> int:
        return rank // self.devices_per_node

    def node_of_worker(self, worker: int) -> int:
        """The node of ``worker``'s first rank (the only one, unless TP spans nodes)."""
        return self.node_of_rank(self.rank(worker))

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of_worker(a) == self.node_of_worker(b)

    def node_ranks(self, node: int) -> tuple[int, ...]:
        """Node ``node``'s launch ranks (the last node's may be fewer than devices_per_node)."""
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
