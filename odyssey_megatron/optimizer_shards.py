"""Which data-parallel peer keeps which block's optimizer state under the distributed optimizer.

Without it every worker holding a block keeps the block's fp32 master weights and both
Adam moments (12 bytes a parameter beside the 2-4 of the weights and the 4 of the
gradient), which is what lets backup-free recovery take any block from any survivor.
Megatron-Core's ``DistributedOptimizer`` (ZeRO-1) shards exactly that state, the masters
and moments, across the DP group; weights and gradients stay whole on every rank, the
gradients are reduce-scattered and the stepped weights all-gathered.

Here the state is sharded by block, the unit recovery already moves (``restorer``'s
``Transfer``), and every block's state has ``REPLICAS`` owners among the workers holding
it (all of them where fewer hold it):

- gradients are still summed on every holder (``hooks.grad_sync``'s all-reduce, so the
  global norm and clipping are unchanged);
- each owner steps its blocks; both owners compute the identical Adam update from the
  identical gradient and state, so their copies stay equal with no traffic between them;
- the stepped weights go from an owner to the holders that do not own the block: an
  all-gather of the weights over the unit, as Megatron's, which the estimator prices
  (``estimator.communication.param_gather_time``).

A single failure then loses no optimizer state: every block's second owner survives
and becomes the source a reroute or reparallelization moves it from; only losing both
owners of a block falls back to the snapshot, then the disk.

Why replicas, not parity (REFT, paper 004, ``snapshot.parity``), by bytes for P
parameters of a stage and a DP group of n: two replicas keep 12 P (2 / n) bytes of
state per rank; RAID-5-style XOR parity (n - 1 data chunks and one parity chunk per
stripe, rotated) keeps 12 P / (n - 1). For n = 8 that is 3.0 P against 1.7 P bytes, on
top of the 6 P of bf16 weights and fp32 gradients every rank holds: parity saves about
15% of the static memory. But the state changes every step, so parity must be
re-encoded every step: an XOR reduction of the fp32 state, about 12 P (n - 2) / (n - 1)
bytes of traffic per rank (10.3 P for n = 8), five times the 2 P of the bf16 weight
all-gather the sharding needs anyway, while the second owner of a replica computes its
copy for free from the gradient it already has. A recovery from parity also reads n - 1
survivors and XORs them; from a replica it is one block move. Replicas it is.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence, TypeVar

__all__ = ["REPLICAS", "owned_share", "shard_owners"]

REPLICAS = 2
"""Owners of each block's optimizer state: one failure loses none of it."""

Block = TypeVar("Block", bound=Hashable)
"""A ``blocks.Block``; this module stands below the block geometry (the recipe's keys read it)."""


def owned_share(holders: int) -> float:
    """The share of their blocks' optimizer state each of ``holders`` workers keeps on
    average: ``REPLICAS`` copies spread over them (all of it for one or two holders)."""
    if holders < 1:
        raise ValueError(f"holders must be >= 1; got {holders}")
    return min(REPLICAS, holders) / holders


def shard_owners(state_bytes: Mapping[Block, int], holders: Sequence[int]) -> dict[Block, tuple[int, ...]]:
    """The owners of each block's optimizer state among ``holders`` (the workers that hold
    every block of ``state_bytes``, its optimizer bytes, in model order): the largest blocks
    first (model order among equals), each to the ``min(REPLICAS, len(holders))``
    least-loaded holders (the lower worker on a tie), so every holder keeps about
    ``owned_share`` of the bytes. Every holder computes the same answer from the same plan."""
    workers = sorted(set(holders))
    if not workers:
        raise ValueError("a block needs at least one holder")
    load = {worker: 0 for worker in workers}
    owners: dict[Block, tuple[int, ...]] = {}
    for block in sorted(state_bytes, key=lambda b: -state_bytes[b]):  # stable: model order among equals
        chosen = sorted(workers, key=lambda w: (load[w], w))[:REPLICAS]
        for worker in chosen:
            load[worker] += state_bytes[block]
        owners[block] = tuple(sorted(chosen))
    return owners
