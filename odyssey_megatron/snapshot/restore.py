"""Where a rollback finds each block: the last complete snapshot, read from the keeper of
the node its writer ran on, or rebuilt from parity when that node is gone.

A snapshot of step S is written under a plan (``shards.owners``: one writer per block,
each TP shard by the writer's TP rank). When every live copy of some block is lost, the
run rolls every block back to S: a shard whose node still lives is read from that node's
keeper by a live worker of the node (one that trains the block next, where one does, so
it moves nowhere); a shard whose node is lost, or has no live worker left to read it, is
rebuilt by XOR over its protection group (``parity``): every other member's shard and
parity chunk, each read on its own node. Two members of one group lost leave nothing to
rebuild from: ``SnapshotLost`` says which, and the run falls back to the disk checkpoint.
The blocks then move from where they were read to the workers of the new plan, as any
plan's transfers do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from odyssey_megatron.blocks import EMBEDDING, OUTPUT, Block, block_bytes, worker_blocks
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.plan import ExecutionPlan, Transfer
from odyssey_megatron.snapshot.shards import owners, shard_blocks

__all__ = ["Restore", "SnapshotLost", "SnapshotRead", "SnapshotRebuild", "SnapshotRecord", "SnapshotSource",
           "block_from_key", "participants", "plan_restore"]


def block_from_key(text: str) -> Block:
    """The block a snapshot key (``<block>/...``) or a block's ``str`` names."""
    name = text.partition("/")[0]
    if name in (EMBEDDING, OUTPUT):
        return name
    if not name.isdigit():
        raise ValueError(f"{text!r} names no block: expected a layer index, {EMBEDDING!r} or {OUTPUT!r}")
    return int(name)


class SnapshotLost(RuntimeError):
    """The snapshot cannot be restored (two losses in one protection group); the message says which."""


@dataclass(frozen=True)
class SnapshotRecord:
    """A complete snapshot as the controller knows it: every training rank of its
    generation wrote its shard and parity chunk of step ``step``."""

    step: int
    """Committed steps the snapshotted state has taken."""
    generation: int
    plan: ExecutionPlan
    """The plan it was written under (its ``owners``)."""
    groups: tuple[tuple[int, ...], ...]
    """Its protection groups, in launch ranks (``protection.protection_groups``)."""


@dataclass(frozen=True)
class SnapshotRead:
    """Launch rank ``reader`` reads the shard launch rank ``owner`` wrote on the same node."""

    reader: int
    owner: int


@dataclass(frozen=True)
class SnapshotRebuild:
    """Launch rank ``lost``'s shard, rebuilt from its protection group: ``readers[i]`` reads
    the shard and parity chunk of the i-th surviving member of ``group`` on that member's
    node; ``readers[0]`` ends holding the rebuilt shard."""

    lost: int
    group: tuple[int, ...]
    readers: tuple[int, ...]


@dataclass(frozen=True)
class Restore:
    """A rollback to snapshot ``step`` (written in ``generation``), as the workers carry it out."""

    step: int
    generation: int
    owners: tuple[tuple[Block, int], ...]
    """(block, writer worker) of the snapshot's plan."""
    reads: tuple[SnapshotRead, ...]
    rebuilds: tuple[SnapshotRebuild, ...]

    def workers(self, tp_size: int) -> set[int]:
        """Workers that read a shard or take part in a rebuild."""
        ranks = {r.reader for r in self.reads} | {r for b in self.rebuilds for r in b.readers}
        return {rank // tp_size for rank in ranks}

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "generation": self.generation,
                "owners": [[str(block), worker] for block, worker in self.owners],
                "reads": [[r.reader, r.owner] for r in self.reads],
                "rebuilds": [{"lost": b.lost, "group": list(b.group), "readers": list(b.readers)}
                             for b in self.rebuilds]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Restore":
        return cls(step=int(data["step"]), generation=int(data["generation"]),
                   owners=tuple((block_from_key(str(b)), int(w)) for b, w in data["owners"]),
                   reads=tuple(SnapshotRead(int(r), int(o)) for r, o in data["reads"]),
                   rebuilds=tuple(SnapshotRebuild(int(b["lost"]), tuple(map(int, b["group"])),
                                                  tuple(map(int, b["readers"]))) for b in data["rebuilds"]))


def participants(plan: ExecutionPlan, restore: Optional[Restore]) -> tuple[int, ...]:
    """Workers that enter ``plan``'s generation: the plan's, and those that read a snapshot
    shard for its rollback (``restore``), ascending."""
    readers = restore.workers(plan.tensor_parallel_size) if restore is not None else set()
    return tuple(sorted(set(plan.participants) | readers))


@dataclass(frozen=True)
class SnapshotSource:
    """The last complete snapshot as a decision sees it: where a plan would get every block
    back from (``restore``) and how many committed steps a rollback to it trains again."""

    record: SnapshotRecord
    lost_keepers: frozenset[int]
    """Launch ranks whose keeper slots are gone: every rank a lost node ran. Ranks, not
    node numbers: the launcher counts nodes from the controller's, the cluster from the
    first with workers (``cluster``)."""
    model: ModelConfig
    replayed_steps: int

    def restore(self, plan: ExecutionPlan, cluster: ClusterState) -> tuple[Restore, tuple[Transfer, ...]]:
        return plan_restore(self.record, plan=plan, cluster=cluster, lost_keepers=set(self.lost_keepers),
                            model=self.model)


def plan_restore(record: SnapshotRecord, *, plan: ExecutionPlan, cluster: ClusterState, lost_keepers: set[int],
                 model: ModelConfig) -> tuple[Restore, tuple[Transfer, ...]]:
    """How ``plan`` (the new generation's) gets every block back as of ``record``'s step on
    the survivors of ``cluster``, where the keeper slots of ``lost_keepers`` (launch ranks)
    are gone with their node: the restore the workers carry out and the plan's transfers
    (every block from where it is read or rebuilt to each worker that trains it). Raises
    SnapshotLost."""
    tp = plan.tensor_parallel_size
    written = owners(record.plan, model)
    needs = {w: set(worker_blocks(plan, w, tied=model.tie_embeddings)) for w in plan.workers}
    alive = set(cluster.alive_workers)
    lost = {cluster.worker_of(rank) for rank in lost_keepers}

    def readers_of(worker: int) -> list[int]:
        """Live workers that can read ``worker``'s shards: those on its node, while its keeper lives."""
        return [] if worker in lost else sorted(w for w in alive if cluster.same_node(w, worker))

    source: dict[tuple[Block, int], int] = {}
    """(block, TP rank) -> the launch rank that holds it once read or rebuilt."""
    reads, rebuilds = [], []
    for owner in sorted(set(written.values())):
        blocks = shard_blocks(written, owner)
        on_node = readers_of(owner)
        if on_node:  # its keeper lives: read there, by a worker that trains most of it next
            reader = max(on_node, key=lambda w: (len(needs.get(w, set()) & set(blocks)), w == owner, -w))
            for k in range(tp):
                reads.append(SnapshotRead(cluster.rank(reader, k), cluster.rank(owner, k)))
                source.update({(block, k): cluster.rank(reader, k) for block in blocks})
            continue
        for k in range(tp):
            rebuild = _rebuild(cluster.rank(owner, k), record.groups, readers_of=readers_of, cluster=cluster)
            rebuilds.append(rebuild)
            source.update({(block, k): rebuild.readers[0] for block in blocks})
    transfers = tuple(Transfer(block, source[(block, k)], cluster.rank(worker, k), block_bytes(model, block, tp))
                      for worker in plan.workers for block in sorted(needs[worker], key=str)
                      for k in range(tp) if source[(block, k)] != cluster.rank(worker, k))
    restore = Restore(record.step, record.generation, tuple(written.items()), tuple(reads), tuple(rebuilds))
    return restore, transfers


def _rebuild(lost: int, groups: tuple[tuple[int, ...], ...], *, readers_of, cluster: ClusterState) -> SnapshotRebuild:
    """Rank ``lost``'s shard from the rest of its protection group, each member read by a
    live worker of the member's node (the member itself where it lives)."""
    group = next((g for g in groups if lost in g), (lost,))
    readers = []
    for member in group:
        if member == lost:
            continue
        owner = cluster.worker_of(member)
        on_node = readers_of(owner)
        if not on_node:
            gone = [m for m in group if not readers_of(cluster.worker_of(m))]
            raise SnapshotLost(f"the snapshot shards of ranks {gone} are all lost, and their protection group "
                               f"(ranks {list(group)}) rebuilds one at most")
        reader = owner if owner in on_node else on_node[0]
        readers.append(cluster.rank(reader, cluster.tp_rank(member)))
    if not readers:
        raise SnapshotLost(f"rank {lost}'s snapshot shard is lost and no parity protects it (its protection group "
                           "has no other node)")
    return SnapshotRebuild(lost, group, tuple(readers))
