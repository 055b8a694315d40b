"""Host memory each node holds for a plan's snapshots and checkpoints, budgeted before a
run starts: a cgroup OOM kills the node's launcher, and with it the node's snapshots.

Three parts grow with the model, each counted from the plan, the model config and the
cluster alone, by the byte counts the runtime allocates by:

- **keepers**: the node keeper's snapshot memory (``snapshot.keeper``): per training rank
  two buffers of its snapshot share (``estimator.snapshot.snapshot_shares``) and two of its
  parity chunk (``snapshot.protection.parity_chunk_bytes`` of its protection group; none
  for a rank alone in its group). The launcher owns it, so it stays while workers come
  and go.
- **parity temporaries**: what each rank's parity encode holds while it runs
  (``protection.encode_temporary_bytes``: spare pieces, at most ``ENCODE_WINDOW`` of
  ``ENCODE_PIECE_BYTES``, none in a pair). Every rank of a node snapshots at the same
  step, so the node holds all of them at once.
- **staging**: the background checkpoint writer's host buffers
  (``runtime.rank.checkpoint_writer``): one copy of the blocks the rank writes, which are
  its snapshot share (both shared out by ``snapshot.shards.owners``), kept from one
  checkpoint to the next.

Not counted: the processes themselves (Python, torch, Megatron, data loading), the
keeper's 64 KiB headers and 64-byte alignment (under 1 MiB a rank), a rollback's transient
copies, and, on ``cluster.device: cpu``, the training state itself (the device memory
budget). The staggered optimizer's retake copies are not counted either: ``odyssey train``
commits each step before its optimizer step and never takes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig, RecipeConfig
from odyssey_megatron.estimator.snapshot import snapshot_shares
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.snapshot.protection import encode_temporary_bytes, parity_chunk_bytes
from odyssey_megatron.snapshot.shards import snapshot_groups
from odyssey_megatron.units import GIB

__all__ = ["HostMemory", "PARTS", "budget_problem", "host_memory", "over_budget", "run_host_memory"]

PARTS = {"keepers": "keepers", "parity_temporaries": "parity temporaries", "staging": "checkpoint staging"}
"""The parts of a node's host memory and their names in words, in the order a budget is
filled (what a node keeps first, what it allocates for a moment last)."""


@dataclass(frozen=True)
class HostMemory:
    """Bytes of host memory one node holds at most, by what holds them."""

    keepers: int = 0
    """Snapshot buffers: two of each rank's share and two of its parity chunk."""
    parity_temporaries: int = 0
    """What the node's ranks' parity encodes hold at once, beside the keepers."""
    staging: int = 0
    """Checkpoint staging buffers: one copy of each rank's share."""

    @property
    def total(self) -> int:
        return self.keepers + self.parity_temporaries + self.staging

    def parts(self) -> dict[str, int]:
        """Part name (``PARTS``) -> bytes."""
        return {name: getattr(self, name) for name in PARTS}

    def describe(self) -> str:
        """The parts in GiB, as a sum: ``keepers 1.00 + parity temporaries 0.50 + checkpoint staging 0.25 GiB``."""
        return " + ".join(f"{PARTS[name]} {size / GIB:.2f}" for name, size in self.parts().items()) + " GiB"


def host_memory(plan: ExecutionPlan, model: ModelConfig, cluster: ClusterState, *, nodes_per_group: int,
                snapshots: bool, checkpoints: bool) -> dict[int, HostMemory]:
    """Node -> what its ranks of ``plan`` hold on the host, for every node ``cluster`` puts a
    training rank of ``plan`` on; ``snapshots``/``checkpoints``: whether the run takes them
    (a zero interval takes none), parity groups of ``nodes_per_group`` nodes."""
    shares = snapshot_shares(plan, model)
    share_of = {rank: shares[worker] for worker in plan.workers for rank in cluster.worker_ranks(worker)}
    chunk_of = dict.fromkeys(share_of, 0)
    temporary_of = dict.fromkeys(share_of, 0)
    if snapshots:
        for group in snapshot_groups(plan, cluster=cluster, nodes_per_group=nodes_per_group):
            if len(group) > 1:
                sizes = [share_of[rank] for rank in group]
                for rank in group:
                    chunk_of[rank], temporary_of[rank] = parity_chunk_bytes(sizes), encode_temporary_bytes(sizes)
    per_node: dict[int, HostMemory] = {}
    for rank, share in share_of.items():
        node = cluster.node_of_rank(rank)
        held = per_node.get(node, HostMemory())
        per_node[node] = HostMemory(
            keepers=held.keepers + (2 * (share + chunk_of[rank]) if snapshots else 0),
            parity_temporaries=held.parity_temporaries + temporary_of[rank],
            staging=held.staging + (share if checkpoints else 0),
        )
    return dict(sorted(per_node.items()))


def run_host_memory(config: RecipeConfig, plan: ExecutionPlan, cluster: ClusterState) -> dict[int, HostMemory]:
    """``host_memory`` of ``plan`` in a run of ``config``: it takes snapshots and checkpoints
    unless their interval is 0 (Young's interval, their default, is at least 1)."""
    odyssey = config.odyssey
    return host_memory(plan, config.model, cluster, nodes_per_group=odyssey.snapshot_parity_nodes,
                       snapshots=odyssey.snapshot_interval != 0, checkpoints=odyssey.checkpoint_interval != 0)


def budget_problem(per_node: Mapping[int, HostMemory], budget_gib: Optional[float]) -> Optional[str]:
    """What is wrong with ``per_node`` under a budget of ``budget_gib`` per node
    (``cluster.host_memory_gib``; None: no budget), in one line naming the node that needs
    the most, its need and the parts that do not fit; None if every node fits."""
    over = None if budget_gib is None else over_budget(per_node, int(budget_gib * GIB))
    if over is None:
        return None
    node, left_out = over
    held = per_node[node]
    fitted = [PARTS[name] for name, size in held.parts().items() if size and name not in left_out]
    missing = " and ".join(PARTS[name] for name in left_out)
    fits = (f"the {' and '.join(fitted)} fit, the {missing} on top {'do' if len(left_out) > 1 else 'does'} not"
            if fitted
            else f"the {PARTS[left_out[0]]} alone take more")
    return (f"node {node} needs {held.total / GIB:.2f} GiB of host memory ({held.describe()}), more than the "
            f"{budget_gib:g} GiB given: {fits}; give more, or take no snapshots (odyssey.snapshot_interval=0) or "
            "checkpoints (odyssey.checkpoint_interval=0)")


def over_budget(per_node: Mapping[int, HostMemory], budget_bytes: int) -> Optional[tuple[int, list[str]]]:
    """The node that needs the most host memory, if that is more than ``budget_bytes``, with
    the parts (``PARTS``) that do not fit once the ones before them are in; None if every
    node fits."""
    if not per_node:
        return None
    node = max(per_node, key=lambda n: (per_node[n].total, -n))
    if per_node[node].total <= budget_bytes:
        return None
    filled, left_out = 0, []
    for name, size in per_node[node].parts().items():
        filled += size
        if filled > budget_bytes and size:
            left_out.append(name)
    return node, left_out
