"""Transition time t(S_i -> S_i+1): plan search + weight transfer + restart (paper 001, IV-C).

Only the restorer's whole-block transfers are priced. Under the distributed optimizer a
block moved to a new holder carries its weights and the share of its optimizer state that
holder keeps in the next plan (the planner builds those transfers from
``estimator.memory.held_profile``). A transition would also re-shard: the next plan's
holders of a block keep the ranges ``optimizer_shards.owned_ranges`` gives for the new
holder list, each copied from a surviving owner of that range (about 2/n of a block's
state per survivor on a shrink from n holders), and only ranges whose two owners both
failed come from the snapshot or the disk. Nothing runs that move yet (the live run keeps
a full copy, ``runtime.train.as_trained``), so the re-shard among holders that stay is not
priced.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import Transfer
from odyssey_megatron.profile import ModelProfile


def transfer_time(
    transfers: Sequence[Transfer],
    *,
    profile: ModelProfile,
    cluster: ClusterState,
    storage_bandwidth: float,
) -> float:
    """Seconds until every rank has its new state: each rank sends and receives over its
    own link at once (full duplex), so the busiest sender or receiver sets the time.
    Blocks with no surviving holder are read from storage by their destination."""
    send: dict[int, float] = defaultdict(float)
    receive: dict[int, float] = defaultdict(float)
    for t in transfers:
        if t.src is None:
            receive[t.dst] += t.bytes / storage_bandwidth
            continue
        same = cluster.same_node(cluster.worker_of(t.src), cluster.worker_of(t.dst))
        seconds = t.bytes / profile.bandwidth(same) + profile.link_latency_s
        send[t.src] += seconds
        receive[t.dst] += seconds
    return max([*send.values(), *receive.values()], default=0.0)
