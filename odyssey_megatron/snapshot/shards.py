"""Who snapshots what: each block of the model is written by one of the workers that train
it, so that a stage's data-parallel replicas each keep a share of it (paper 004: every
replica saves only its 1/DP of the stage) and the model is snapshotted once.

Shares follow the plan's holders, not a fixed DP degree, so an asymmetric plan (a stage
with three replicas beside one with two, a rerouted stage with one) shares too. Shares
are whole blocks, the unit recovery moves; blocks go to holders greedily by bytes,
largest first, to the holder with the fewest bytes so far. Every rank, the controller and
a parity rebuild derive the same shares and byte layouts from the plan and the model
config alone (``owners``, ``shard_entries``), so no layout crosses the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from odyssey_megatron.blocks import Block, block_bytes, block_sort_key, state_entries, worker_blocks
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.snapshot.protection import protection_groups

__all__ = ["owners", "shard_blocks", "shard_bytes", "shard_entries", "snapshot_groups"]


def _share_out(holdings: Mapping[int, Sequence[Block]], size: Callable[[Block], int]) -> dict[Block, int]:
    """Block -> the worker that snapshots it, of the workers ``holdings`` says hold it:
    largest block first, to its holder with the fewest bytes so far (then the lowest id)."""
    holders: dict[Block, list[int]] = {}
    for worker in sorted(holdings):
        for block in holdings[worker]:
            holders.setdefault(block, []).append(worker)
    load = dict.fromkeys(holdings, 0)
    sizes = {block: size(block) for block in holders}
    chosen = {}
    for block in sorted(holders, key=lambda b: (-sizes[b], block_sort_key(b))):
        worker = min(holders[block], key=lambda w: (load[w], w))
        chosen[block] = worker
        load[worker] += sizes[block]
    return dict(sorted(chosen.items(), key=lambda item: block_sort_key(item[0])))


def owners(plan: ExecutionPlan, model: ModelConfig, *, workers: Iterable[int] | None = None) -> dict[Block, int]:
    """Block -> the worker of ``plan`` that snapshots it (one of those that train it): the
    one choice of writers, which the snapshots write by, a rollback reads by and the
    estimator prices (``estimator.snapshot``), balanced by ``blocks.block_bytes``. The
    checkpoints written without a collective (a stop, a failed owner, a lost controller)
    are shared out the same way, among the ``workers`` still alive (default: every worker
    of the plan); a block none of them holds is left out."""
    live = set(plan.workers) if workers is None else set(plan.workers) & set(workers)
    return _share_out({w: worker_blocks(plan, w, tied=model.tie_embeddings) for w in live},
                     lambda block: block_bytes(model, block, plan.tensor_parallel_size))


def shard_blocks(owned: dict[Block, int], worker: int) -> list[Block]:
    """The blocks ``worker`` snapshots, in model order."""
    return sorted((b for b, w in owned.items() if w == worker), key=block_sort_key)


def shard_entries(model: ModelConfig, blocks: Sequence[Block], *, tp_size: int) -> list[tuple]:
    """(key, torch dtype, shape) of every tensor of ``blocks``' TP shard as a snapshot holds
    them, in order: ``<block>/<export key>`` (``blocks.state_entries``), for ``keeper.payload_layout``."""
    import torch  # here, not above: the decision center shares blocks out without torch

    return [(f"{block}/{key}", getattr(torch, dtype), shape)
            for block in blocks
            for key, dtype, shape in state_entries(model, block, tp_size=tp_size)]


def snapshot_groups(plan: ExecutionPlan, *, cluster: ClusterState,
                    nodes_per_group: int) -> tuple[tuple[int, ...], ...]:
    """The parity protection groups of ``plan``'s training ranks (launch ranks, on the nodes
    ``cluster`` puts them), each on distinct nodes (``protection.protection_groups``)."""
    by_node: dict[int, list[int]] = {}
    for worker in plan.workers:
        for rank in cluster.worker_ranks(worker):
            by_node.setdefault(cluster.node_of_rank(rank), []).append(rank)
    return tuple(protection_groups(by_node, nodes_per_group))


def shard_bytes(model: ModelConfig, owned: dict[Block, int], worker: int, *, tp_size: int) -> int:
    """Bytes of the payload ``worker``'s TP shard of its snapshot share fills (``keeper.payload_layout``)."""
    from odyssey_megatron.snapshot.keeper import payload_layout

    return payload_layout(shard_entries(model, shard_blocks(owned, worker), tp_size=tp_size))[1]
