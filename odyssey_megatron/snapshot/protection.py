"""Who protects whose snapshot, and what the protection costs in bytes: the RAID-5
arithmetic of ``snapshot.parity`` with no torch in it, so the estimator and the decision
center use the very groups and sizes the ranks run with.

``protection_groups`` puts ranks on distinct nodes into groups; ``parity_chunk_bytes`` is
the size of one member's parity chunk (and of each chunk its payload is cut into);
``encode_temporary_bytes`` is the host memory one member's ``parity.encode`` allocates
beside the keeper's buffers while it runs.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

__all__ = ["ENCODE_PIECE_BYTES", "ENCODE_WINDOW", "encode_temporary_bytes", "parity_chunk_bytes", "protection_groups",
           "unprotected"]


def protection_groups(ranks_by_node: Mapping[int, Sequence[int]], size: int) -> list[tuple[int, ...]]:
    """Every rank in one group of ranks on pairwise distinct nodes, ``size`` members each
    where the ranks allow.

    Nodes are taken in order and the i-th ranks of all nodes (a column) side by side, so
    consecutive ranks lie on distinct nodes; the columns are cut into groups of ``size``,
    a group ending early where the next rank's node is in it already. A rank left alone
    then joins a group without its node that has room, else takes a partner from a group of
    three or more, else joins any group without its node (only with ``size`` 2: a group of
    three). So no group is larger than ``max(size, 3)``, and the ranks left alone (a group
    of one: unprotected) are as few as possible: all on the one node that holds more ranks
    than every other node together. Members ascend; groups are ordered by their smallest rank.
    """
    if size < 2:
        raise ValueError(f"size must be at least 2 (members per protection group), got {size}")
    node_of: dict[int, int] = {}
    for node in sorted(ranks_by_node):
        for rank in ranks_by_node[node]:
            if rank in node_of:
                raise ValueError(f"rank {rank} is listed twice (nodes {node_of[rank]} and {node})")
            node_of[rank] = node
    columns = [sorted(ranks_by_node[node]) for node in sorted(ranks_by_node)]
    depth = max(map(len, columns), default=0)
    groups: list[list[int]] = []
    for rank in (ranks[i] for i in range(depth) for ranks in columns if i < len(ranks)):
        if groups and len(groups[-1]) < size and all(node_of[r] != node_of[rank] for r in groups[-1]):
            groups[-1].append(rank)
        else:
            groups.append([rank])
    _partner_the_alone(groups, node_of, size)
    return sorted(tuple(sorted(group)) for group in groups)


def _partner_the_alone(groups: list[list[int]], node_of: Mapping[int, int], size: int) -> None:
    """Give each group of one a partner, in place, where one can be had (see ``protection_groups``)."""
    for alone in [group for group in groups if len(group) == 1]:
        if len(alone) != 1:
            continue  # another alone rank joined it
        rank = alone[0]
        others = [group for group in groups if group is not alone]
        apart = [group for group in others if all(node_of[r] != node_of[rank] for r in group)]
        donors = [group for group in others if len(group) > 2]
        roomy = [group for group in apart if len(group) < size]
        if roomy or (apart and not donors):
            groups.remove(alone)
            min(roomy or apart, key=len).append(rank)
        elif donors:
            donor = max(donors, key=len)
            partner = max(r for r in donor if node_of[r] != node_of[rank])
            donor.remove(partner)
            alone.append(partner)


def unprotected(groups: Iterable[Sequence[int]]) -> list[int]:
    """The ranks alone in their group: no parity protects their payloads."""
    return sorted(group[0] for group in groups if len(group) == 1)


def parity_chunk_bytes(sizes: Sequence[int]) -> int:
    """Bytes of one chunk, and of one member's parity, for a group whose members' payloads
    are ``sizes`` bytes (at least 2 members): the largest payload cut into ``members - 1``
    chunks, at least 1 byte (``parity.StripeLayout.chunk_bytes``)."""
    return max(1, -(-max(sizes) // (len(sizes) - 1)))


ENCODE_PIECE_BYTES = 4 * 2**20
"""An encode moves each chunk in pieces of at most this many bytes, so a piece is XORed
while it is still in cache and while the next ones arrive. On this 2-core machine, a group
of 4 with 256 MiB shares in one interleaved run: 0.83, 0.90, 0.86, 0.76, 0.59 and 0.38 GB/s
a rank at 1, 2, 4, 8, 16 and 64 MiB pieces."""

ENCODE_WINDOW = 4
"""Pieces an encode receives into spares ahead of its XOR, at most: what it holds beside
the keeper's buffers, whatever the share (16 MiB at 4 MiB pieces). Windows of 2, 4, 8 and
16 pieces of 4 MiB ran a group of 4 at 0.71, 0.80, 0.61 and 0.66 GB/s a rank in one
interleaved run here, within this machine's noise (32 pieces: slower in every run), so
the smaller memory; 16 MiB in flight is far above a cluster link's bandwidth-delay
product (25 GB/s x 10 us is 250 KB)."""


def encode_temporary_bytes(sizes: Sequence[int], *, piece_bytes: int = ENCODE_PIECE_BYTES) -> int:
    """Host bytes one member's ``parity.encode`` allocates beyond its payload and its parity
    buffer, in a group whose payloads are ``sizes`` bytes: none in a pair (its parity is its
    partner's chunk, received straight into the buffer); in a larger group the spare pieces
    the other senders' pieces arrive in before they are XORed in, ``ENCODE_WINDOW`` of them
    or as many as those senders send, each at most a chunk, kept from one encode to the
    next. gloo's sends and receives use the tensors' own memory. Whoever changes
    ``encode``'s buffers or transport keeps this equal to what it allocates."""
    members = len(sizes)
    if members == 2:
        return 0
    chunk = parity_chunk_bytes(sizes)
    piece = min(piece_bytes, chunk)
    return min(ENCODE_WINDOW, (members - 2) * -(-chunk // piece)) * piece
