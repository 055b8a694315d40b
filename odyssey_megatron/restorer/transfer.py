"""Weight transfer: which survivor takes which new stage, and who sends it what.

Paper IV-B: moving weights between plans is a bipartite matching between survivors and
the new plan's stages, where pairing worker i with stage j costs the bytes of the blocks
j needs that i does not hold; Kuhn-Munkres finds the cheapest pairing, solved here over
classes of identical workers and of identical slots (thousands of workers, a handful of
classes) with the same optimum as the full matrix. We then pick, per
missing block, the survivor that sends it so that no single sender becomes the
bottleneck, and expand worker-level moves to rank-level TP shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from odyssey_megatron.blocks import Block, block_sort_key
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan, Transfer
from odyssey_megatron.profile import ModelProfile


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

    assignment, cost = _class_assignment(workers=workers, holdings=holdings, slots=slots, profile=profile)
    transfers = _shard_transfers(holdings=holdings, slots=slots, assignment=assignment, profile=profile,
                                 cluster=cluster)
    return TransferPlan(assignment=tuple(assignment), transfers=transfers, cost_bytes=cost)


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


def _class_assignment(
    *,
    workers: Sequence[int],
    holdings: Mapping[int, Sequence[Block]],
    slots: Sequence[Sequence[Block]],
    profile: ModelProfile,
) -> tuple[list[int], int]:
    """(worker per slot, bytes moved): a Kuhn-Munkres optimum, solved over classes.

    The cost of worker i taking slot j depends only on which blocks i holds and which j
    needs, and a layout has a few distinct stages while a cluster has thousands of
    workers; so workers with equal holdings form a class, slots with equal blocks form a
    class, and the assignment is a transportation problem between classes (a min-cost
    flow, ``_transport``) whose optimum equals that of the full worker x slot matrix.
    Within a class, slots in order take the lowest-numbered workers still free.
    """
    worker_classes: dict[frozenset, list[int]] = {}
    for worker in workers:
        worker_classes.setdefault(frozenset(holdings[worker]), []).append(worker)
    slot_classes: dict[frozenset, list[int]] = {}
    for j, slot in enumerate(slots):
        slot_classes.setdefault(frozenset(slot), []).append(j)
    held, needed = list(worker_classes), list(slot_classes)
    costs = [[sum(profile.block(b).state_bytes for b in need - have) for need in needed] for have in held]
    flow = _transport(supply=[len(worker_classes[h]) for h in held], demand=[len(slot_classes[n]) for n in needed],
                      costs=costs)
    free = [iter(worker_classes[h]) for h in held]
    assignment = [0] * len(slots)
    for b, need in enumerate(needed):
        sources = iter([a for a in range(len(held)) for _ in range(flow[a][b])])
        for j in slot_classes[need]:
            assignment[j] = next(free[next(sources)])
    return assignment, sum(flow[a][b] * costs[a][b] for a in range(len(held)) for b in range(len(needed)))


def _transport(*, supply: Sequence[int], demand: Sequence[int], costs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Integer flow ``flow[a][b]`` meeting every ``demand[b]`` from ``supply[a]`` (which may
    be left over) at least total ``costs[a][b]`` per unit: successive shortest paths
    (Bellman-Ford, exact on integer costs). Each path runs supply -> slot class, then back
    along used edges and forward again; it carries as much as its tightest edge allows,
    so the number of paths grows with the number of classes, not of workers."""
    left, wanted = list(supply), list(demand)
    rows, cols = range(len(supply)), range(len(demand))
    flow = [[0] * len(demand) for _ in rows]
    while any(wanted):
        dist_a = [0 if left[a] else None for a in rows]
        dist_b: list = [None] * len(demand)
        via_a: list = [None] * len(demand)  # the worker class a path reaches slot class b from
        via_b: list = [None] * len(supply)  # the slot class a path returns to worker class a from
        changed = True
        while changed:
            changed = False
            for a in rows:
                if dist_a[a] is None:
                    continue
                for b in cols:
                    d = dist_a[a] + costs[a][b]
                    if dist_b[b] is None or d < dist_b[b]:
                        dist_b[b], via_a[b], changed = d, a, True
            for b in cols:
                if dist_b[b] is None:
                    continue
                for a in rows:
                    d = dist_b[b] - costs[a][b]
                    if flow[a][b] and (dist_a[a] is None or d < dist_a[a]):
                        dist_a[a], via_b[a], changed = d, b, True
        end = min((b for b in cols if wanted[b] and dist_b[b] is not None), key=lambda b: (dist_b[b], b))
        path, b = [], end  # (worker class, slot class, +1 forward / -1 undone), back from the end
        while True:
            a = via_a[b]
            path.append((a, b, 1))
            if via_b[a] is None:
                break
            b = via_b[a]
            path.append((a, b, -1))
        amount = min([wanted[end], left[a]] + [flow[x][y] for x, y, sign in path if sign < 0])
        for x, y, sign in path:
            flow[x][y] += sign * amount
        left[a] -= amount
        wanted[end] -= amount
    return flow


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
