"""What in-memory snapshots cost (paper 004): the copy of each rank's share to host
memory, the host memory a node keeps, the interval that balances the two against the
failure rate, and what a rollback takes before training again (``restore_time``; the
decision center adds the steps it trains again).

A rank copies its share (the blocks ``snapshot.shards.owners`` gives it to write: the
snapshots' own choice of writers, priced as written) into keeper memory at the rate
``odyssey profile`` measured (``snapshot_copy_bandwidth``; ``host_bandwidth`` in an analytic
profile) and computes its parity chunk across nodes (one share sent and received, XORed
piece by piece beside the transfer at the measured ``parity_xor_bandwidth``, free in an
analytic profile) while its next steps compute, so only what outlasts them would show on
the step time; the interval follows Young's rule, sqrt(2 x snapshot time x mean time
between failures), the snapshot's whole time standing for its cost
(what it costs the step depends on how much of it the step hides). A node keeps two
buffers per rank (the last complete snapshot and the one being written) of its share and
of its parity chunk (1/(group nodes - 1) of the largest share of its group, RAID-5 style).
A share's bytes are its blocks' state as the snapshot holds it (``blocks.block_bytes``:
fp32 masters, Adam moments and the step, one TP shard), not the profile's.
"""

from __future__ import annotations

import math

from collections.abc import Sequence

from odyssey_megatron.blocks import block_bytes
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.estimator.transition import transfer_time
from odyssey_megatron.plan import ExecutionPlan, Transfer
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.snapshot.protection import ENCODE_PIECE_BYTES, parity_chunk_bytes
from odyssey_megatron.snapshot.restore import Restore
from odyssey_megatron.snapshot.shards import owners

__all__ = ["restore_time", "snapshot_time_s", "snapshot_host_bytes", "snapshot_shares", "young_interval_steps"]


def snapshot_shares(plan: ExecutionPlan, model: ModelConfig) -> dict[int, int]:
    """Bytes of each worker's share of a snapshot of ``plan`` (one TP shard of it)."""
    shares = dict.fromkeys(plan.workers, 0)
    for block, worker in owners(plan, model).items():
        shares[worker] += block_bytes(model, block, plan.tensor_parallel_size)
    return shares


def _group_members(nodes_per_group: int, nodes: int) -> int:
    return min(nodes_per_group, nodes)


def snapshot_time_s(plan: ExecutionPlan, profile: ModelProfile, *, model: ModelConfig, nodes_per_group: int,
                    nodes: int) -> float:
    """Seconds the largest share takes to snapshot: its copy into keeper memory, then its
    parity (``parity.encode``: each member sends and receives one share across nodes, in
    pieces, and XORs each piece from all senders but one as it arrives, so the XOR runs
    beside the transfer and only its last piece outlasts it; nothing on a single node)."""
    largest = max(snapshot_shares(plan, model).values(), default=0)
    members = _group_members(nodes_per_group, nodes)
    parity_s = 0.0
    if members > 1:
        transfer_s = largest / profile.inter_node_bandwidth
        xor_s = _xor_s(largest * (members - 2) / (members - 1), profile)
        last_piece = min(ENCODE_PIECE_BYTES, parity_chunk_bytes([largest] * members)) if members > 2 else 0
        parity_s = max(transfer_s, xor_s) + _xor_s(last_piece, profile)
    return largest / (profile.snapshot_copy_bandwidth or profile.host_bandwidth) + parity_s


def _xor_s(nbytes: float, profile: ModelProfile) -> float:
    """Seconds a rank XORs ``nbytes`` of host memory: at the measured rate, none where unmeasured."""
    return nbytes / profile.parity_xor_bandwidth if profile.parity_xor_bandwidth else 0.0


def snapshot_host_bytes(plan: ExecutionPlan, model: ModelConfig, *, nodes_per_group: int, nodes: int) -> int:
    """Host memory one rank's keeper slot holds at most: two buffers of its share and two
    of its parity chunk (the largest share over the group's members less one; none on a
    single node, where no group has a second node)."""
    largest = max(snapshot_shares(plan, model).values(), default=0)
    members = _group_members(nodes_per_group, nodes)
    return 2 * (largest + (parity_chunk_bytes([largest] * members) if members > 1 else 0))


def restore_time(restore: Restore, transfers: Sequence[Transfer], *, model: ModelConfig, profile: ModelProfile,
                 cluster: ClusterState) -> float:
    """Seconds until a rollback's blocks are where the plan trains them: the slowest
    rebuild (``parity.rebuild``'s chain: the lost share crosses each inter-node link once, in
    pieces, and each survivor XORs its part in; reads from a keeper are host memory, counted
    with the rebuild's), then the transfers from where the blocks were read (``transfer_time``)."""
    tp = cluster.tensor_parallel_size
    owned: dict[int, int] = {}
    for block, worker in restore.owners:
        owned[worker] = owned.get(worker, 0) + block_bytes(model, block, tp)
    lost_bytes = [owned.get(cluster.worker_of(r.lost), 0) / tp for r in restore.rebuilds]
    rebuild_s = max((lost / profile.inter_node_bandwidth + _xor_s(lost, profile) for lost in lost_bytes), default=0.0)
    return rebuild_s + transfer_time(transfers, profile=profile, cluster=cluster, storage_bandwidth=float("inf"))


def young_interval_steps(*, copy_s: float, step_s: float, mtbf_s: float) -> int:
    """Steps between snapshots by Young's rule, at least one."""
    return max(1, round(math.sqrt(2 * copy_s * mtbf_s) / step_s)) if step_s > 0 else 1
