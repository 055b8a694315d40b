"""Which data-parallel peer keeps which block's optimizer state under the distributed optimizer.

Without it every worker holding a block keeps the block's fp32 master weights and both
Adam moments (12 bytes a parameter beside the 2-4 of the weights and the 4 of the
gradient), which is what lets backup-free recovery take any block from any survivor.
Megatron-Core's ``DistributedOptimizer`` (ZeRO-1) shards exactly that state, the masters
and moments, across the DP group; weights and gradients stay whole on every rank, the
gradients are reduce-scattered and the stepped weights all-gathered.

Here each block's state (its tensors flattened in ``blocks.state_entries`` order, as a
transfer sends them) is cut into one contiguous range per worker holding the block, and
every range has ``REPLICAS`` owners among them (all of them where fewer hold it): range i
is kept by holders i and i+1 (cyclically), so each holder keeps two neighbouring ranges.
Whole blocks as shards would be uneven (34 blocks of Llama-2 7B over 16 peers: five blocks
on some, four on others, 17% above the share), ranges are exact; and the restorer still
thinks in blocks, the unit recovery moves (``restorer``'s ``Transfer``): block b's ranges
and who keeps each.

- gradients are still summed on every holder (``hooks.grad_sync``'s all-reduce, so the
  global norm and clipping are unchanged);
- each owner steps its ranges; both owners compute the identical Adam update from the
  identical gradient and state, so their copies stay equal with no traffic between them;
- the stepped weights go from an owner to the holders that do not own the range: an
  all-gather of the weights over the unit, as Megatron's, which the estimator prices
  (``estimator.communication.param_gather_time``).

A single failure then loses no optimizer state: each of its ranges' other owner
survives and is the source a reroute or reparallelization moves it from; only losing
both owners of a range (two neighbouring holders) falls back to the snapshot, then the disk.

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
survivors and XORs them; from a replica it is one move from the surviving owner.
Replicas it is.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

__all__ = ["REPLICAS", "first_owned_range", "fullest_share", "owned_ranges", "owned_share"]

REPLICAS = 2
"""Owners of each range of a block's optimizer state: one failure loses none of it."""


def owned_share(holders: int) -> float:
    """The share of a block's optimizer state each of its ``holders`` keeps: ``REPLICAS``
    copies spread evenly over them (all of it for one or two holders)."""
    if holders < 1:
        raise ValueError(f"holders must be >= 1; got {holders}")
    return min(REPLICAS, holders) / holders


def owned_ranges(numel: int, holders: Sequence[int]) -> dict[int, tuple[tuple[int, int], ...]]:
    """The [start, end) element ranges of a block's flattened optimizer state (``numel``
    elements) each of ``holders`` keeps: one near-equal range per holder in worker order,
    range i kept by holders i and i+1 (cyclically), so every element has
    ``min(REPLICAS, len(holders))`` owners and every holder about ``owned_share`` of them.
    Every holder computes the same answer from the same plan."""
    workers = sorted(set(holders))
    if not workers:
        raise ValueError("a block needs at least one holder")
    n = len(workers)
    if n <= REPLICAS:
        return {worker: ((0, numel),) for worker in workers}
    bounds = [numel * i // n for i in range(n + 1)]
    return {worker: tuple((bounds[r], bounds[r + 1]) for r in sorted({(i - 1) % n, i}))
            for i, worker in enumerate(workers)}


@lru_cache(maxsize=4096)
def fullest_share(numel: int, holders: int) -> int:
    """Of a block's ``numel`` elements of optimizer state, how many the fullest of its
    ``holders`` keeps (``owned_ranges``): what its memory must hold. Remembered: every
    plan priced asks it again for the same few blocks and holder counts."""
    return max(sum(end - start for start, end in kept) for kept in owned_ranges(numel, range(holders)).values())


def first_owned_range(numel: int, holders: Sequence[int], worker: int) -> tuple[int, int]:
    """With more than ``REPLICAS`` holders, the range ``worker`` is the first owner of
    (range i of holder i, in worker order):
    the part it sends in the weight all-gather and counts in the global gradient norm, so
    each element is sent and counted once."""
    workers = sorted(set(holders))
    i, n = workers.index(worker), len(workers)
    return numel * i // n, numel * (i + 1) // n
