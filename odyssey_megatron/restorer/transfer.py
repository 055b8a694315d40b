"""Weight transfer: which survivor takes which new stage, and who sends it what.

Paper IV-B: moving weights between plans is a bipartite matching between survivors and
the new plan's stages, where pairing worker i with stage j costs the bytes of the blocks
j needs that i does not hold; Kuhn-Munkres finds the cheapest pairing. We then pick, per
missing block, the survivor that sends it so that no single sender becomes the
bottleneck, and expand worker-level moves to rank-level TP shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan, Transfer
from odyssey_megatron.profile import Block, ModelProfile, block_sort_key


@dataclass(frozen=True)
class TransferPlan:
    """A survivor per new stage plus the rank-level transfers that fill the gaps."""

    assignment: tuple[int, ...]
    """Worker chosen for each slot, in slot order."""
    transfers: tuple[Transfer, ...]
    """Rank-level shard moves, in slot order, then model order, then TP rank."""
    cost_bytes: int
    """Per-rank bytes the chosen workers are missing, summed over slots (the KM objective)."""


def assignment_cost(
    *,
    holdings: Mapping[int, Sequence[Block]],
    slots: Sequence[Sequence[Block]],
    assignment: Sequence[int],
    profile: ModelProfile,
) -> int:
    """Bytes that must move if ``assignment[j]`` takes ``slots[j]``: the objective any
    mapping (naive, brute force, KM) is judged by."""
    if len(assignment) != len(slots):
        raise ValueError(f"{len(assignment)} workers assigned to {len(slots)} slots")
    return sum(
        profile.block(b).state_bytes
        for worker, slot in zip(assignment, slots)
        for b in set(slot) - set(holdings[worker])
    )


def plan_weight_transfer(
    *,
    holdings: Mapping[int, Sequence[Block]],
    slots: Sequence[Sequence[Block]],
    profile: ModelProfile,
    cluster: ClusterState,
) -> TransferPlan:
    """Cheapest survivor-to-slot mapping (Kuhn-Munkres) and load-spread sources.

    ``holdings`` maps every survivor to the blocks in its memory now (possibly none);
    ``slots`` lists the blocks of each stage of the new plan, pipeline by pipeline.
    """
    workers = sorted(holdings)
    if len(slots) > len(workers):
        raise ValueError(f"{len(slots)} slots need at least as many survivors, got {len(workers)}")
    if not slots:
        return TransferPlan(assignment=(), transfers=(), cost_bytes=0)

    costs = _cost_matrix(workers=workers, holdings=holdings, slots=slots, profile=profile)
    rows, cols = linear_sum_assignment(costs)
    assignment = [0] * len(slots)
    for row, col in zip(rows, cols):
        assignment[col] = workers[row]
    transfers = _shard_transfers(holdings=holdings, slots=slots, assignment=assignment, profile=profile,
                                 cluster=cluster)
    return TransferPlan(assignment=tuple(assignment), transfers=transfers, cost_bytes=int(costs[rows, cols].sum()))


def live_holdings(plan: ExecutionPlan, *, cluster: ClusterState, profile: ModelProfile) -> dict[int, list[Block]]:
    """What every live worker holds while ``plan`` runs: its stage's blocks, or nothing
    (idle, repaired or spare). A failed worker holds nothing anyone can read."""
    held: dict[int, list[Block]] = {worker: [] for worker in cluster.alive_workers}
    for worker, blocks in plan.holdings(profile).items():
        if worker in held:
            held[worker] = blocks
    return held


def mapping_bytes(*, before: ExecutionPlan, after: ExecutionPlan, cluster: ClusterState,
                  profile: ModelProfile) -> tuple[int, int]:
    """Bytes (per rank) the stage owners of ``after`` lack, as the plan maps survivors onto
    its stages, and as a naive mapping would: survivors in id order onto the stages in
    pipeline order. What Kuhn-Munkres saves over taking the survivors as they come."""
    holdings = live_holdings(before, cluster=cluster, profile=profile)
    owned = [(stage.worker, after.blocks_of_stage(pi, si, profile))
             for pi, si, stage in after.stage_positions() if stage.worker is not None]
    slots = [blocks for _, blocks in owned]
    chosen = assignment_cost(holdings=holdings, slots=slots, assignment=[w for w, _ in owned], profile=profile)
    naive = assignment_cost(holdings=holdings, slots=slots, assignment=sorted(holdings)[:len(slots)], profile=profile)
    return chosen, naive


def plan_transfers(
    plan: ExecutionPlan,
    *,
    holdings: Mapping[int, Sequence[Block]],
    profile: ModelProfile,
    cluster: ClusterState,
) -> tuple[Transfer, ...]:
    """The transfers that give every live stage owner of ``plan`` the blocks of its stage.

    ``holdings`` is what each live worker holds *before* the plan (``live_holdings`` of the
    plan being left), so a worker that moves to another stage still sends what it held,
    and one that moves in receives everything it lacks. Each source holds its block
    already: the transfers form one phase that can run all at once, with no relays and
    no cycles (``restorer.transfer_check`` verifies that).
    """
    failed = cluster.failed_workers
    owners = [(stage.worker, plan.blocks_of_stage(pi, si, profile))
              for pi, si, stage in plan.stage_positions() if stage.worker is not None and stage.worker not in failed]
    return _shard_transfers(holdings=holdings, slots=[blocks for _, blocks in owners],
                            assignment=[worker for worker, _ in owners], profile=profile, cluster=cluster)


def _shard_transfers(
    *,
    holdings: Mapping[int, Sequence[Block]],
    slots: Sequence[Sequence[Block]],
    assignment: Sequence[int],
    profile: ModelProfile,
    cluster: ClusterState,
) -> tuple[Transfer, ...]:
    """Rank-level moves that fill ``slots`` on ``assignment``'s workers: sources spread
    over holders (``_choose_sources``), TP shard k from TP rank k."""
    moves = _choose_sources(workers=sorted(holdings), holdings=holdings, slots=slots, assignment=assignment,
                            profile=profile, cluster=cluster)
    return tuple(
        Transfer(layer=block, src=src_rank, dst=dst_rank, bytes=nbytes)
        for block, src, dst, nbytes in moves
        for src_rank, dst_rank in zip(_shard_sources(src, cluster), cluster.worker_ranks(dst))
    )


def _shard_sources(src: Optional[int], cluster: ClusterState) -> tuple[Optional[int], ...]:
    """TP rank k of the source sends shard k; a checkpoint read has no source rank."""
    if src is None:
        return (None,) * cluster.tensor_parallel_size
    return cluster.worker_ranks(src)


def _cost_matrix(
    *,
    workers: Sequence[int],
    holdings: Mapping[int, Sequence[Block]],
    slots: Sequence[Sequence[Block]],
    profile: ModelProfile,
) -> np.ndarray:
    """C[i, j] = bytes of slots[j] that workers[i] lacks, as (slot bytes) - (overlap bytes).

    The overlap is one worker x block by block x slot product. The matrix stays float64,
    which linear_sum_assignment wants anyway: BLAS keeps it fast, and byte sums stay far
    below 2**53, where float64 integers are exact.
    """
    blocks = sorted({b for slot in slots for b in slot}, key=block_sort_key)
    column = {b: k for k, b in enumerate(blocks)}
    weight = np.array([profile.block(b).state_bytes for b in blocks], dtype=np.float64)

    held = np.zeros((len(workers), len(blocks)), dtype=np.float64)
    for i, worker in enumerate(workers):
        held[i, [column[b] for b in holdings[worker] if b in column]] = 1.0
    needed = np.zeros((len(slots), len(blocks)), dtype=np.float64)
    for j, slot in enumerate(slots):
        needed[j, [column[b] for b in slot]] = 1.0

    costs = (held * weight) @ needed.T
    np.subtract(needed @ weight, costs, out=costs)
    return costs


def _choose_sources(
    *,
    workers: Sequence[int],
    holdings: Mapping[int, Sequence[Block]],
    slots: Sequence[Sequence[Block]],
    assignment: Sequence[int],
    profile: ModelProfile,
    cluster: ClusterState,
) -> list[tuple[Block, Optional[int], int, int]]:
    """(block, source worker or None, destination worker, bytes) for every missing block.

    Longest-processing-time greedy: largest transfers first and, among equal sizes, the
    blocks with the fewest holders (they have the least choice), each to the holder that
    would finish sending it earliest; ties prefer a same-node sender, then the lowest id.
    Blocks no survivor holds come from the checkpoint (source None).
    """
    wanted = [
        (b, dst, profile.block(b).state_bytes)
        for slot, dst in zip(slots, assignment)
        for b in sorted(set(slot) - set(holdings[dst]), key=block_sort_key)
    ]
    if not wanted:  # a reroute: every owner already holds its stage
        return []
    holder_lists: dict[Block, list[int]] = {}
    for index, worker in enumerate(workers):
        for b in holdings[worker]:
            holder_lists.setdefault(b, []).append(index)
    holders = {b: np.array(indices) for b, indices in holder_lists.items()}
    node = np.array([cluster.node_of_worker(w) for w in workers])
    busy_s = np.zeros(len(workers))
    order = sorted(range(len(wanted)), key=lambda k: (-wanted[k][2], len(holder_lists.get(wanted[k][0], ())), k))
    sources: list[Optional[int]] = [None] * len(wanted)
    for k in order:
        block, dst, nbytes = wanted[k]
        candidates = holders.get(block)
        if candidates is None:
            continue
        near = node[candidates] == cluster.node_of_worker(dst)
        finish = busy_s[candidates] + np.where(
            near, nbytes / profile.bandwidth(True), nbytes / profile.bandwidth(False)
        )
        earliest = finish == finish.min()
        if (earliest & near).any():
            earliest &= near
        pick = earliest.argmax()
        busy_s[candidates[pick]] = finish[pick]
        sources[k] = workers[candidates[pick]]
    return [(block, src, dst, nbytes) for (block, dst, nbytes), src in zip(wanted, sources)]
