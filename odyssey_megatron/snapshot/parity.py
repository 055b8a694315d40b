"""RAID-5-style XOR parity across nodes, so a node's in-memory snapshot survives its loss.

Every rank snapshots a shard of its state (a flat uint8 payload) into host memory on its
node; a node that dies takes those payloads with it. REFT's RAIM5 (paper 004) protects them
like RAID 5 protects disks: ranks on distinct nodes form a *protection group*, each member
cuts its payload into ``members - 1`` chunks, and stripe ``s`` holds one chunk of every
member but ``s``, whose XOR (the parity) member ``s`` keeps. Parity rotates, so each member
stores ``1 / (members - 1)`` of a payload more, and any ONE lost member's payload is the
XOR of the survivors' chunks and parities; two lost members in one group are beyond it.

``encode`` sends each chunk straight to the member keeping its stripe's parity, in pieces
XORed as they arrive; ``rebuild`` is a chain of sends and receives over the survivors,
XORing in threads (``xor_into``); ``parity_of`` and
``rebuilt_from`` do the same arithmetic in one place, with no collective (the tests'
reference). Who forms a group and the byte counts (chunks, encode's temporaries) are
``snapshot.protection``'s, with no torch.
"""

from __future__ import annotations

import collections
import concurrent.futures
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from odyssey_megatron.snapshot.protection import (ENCODE_PIECE_BYTES, ENCODE_WINDOW, encode_temporary_bytes,
                                                  parity_chunk_bytes, protection_groups, unprotected)

__all__ = ["ENCODE_PIECE_BYTES", "ENCODE_WINDOW", "EncodeSpares", "StripeLayout", "encode", "encode_temporary_bytes",
           "parity_of", "protection_groups", "rebuild", "rebuild_temporary_bytes", "rebuilt_from", "unprotected",
           "xor_into"]


@dataclass(frozen=True)
class StripeLayout:
    """How one protection group's payloads are cut into chunks and laid out in stripes.

    Member ``m``'s payload, zero padded to ``(members - 1) * chunk_bytes``, is cut into
    ``members - 1`` chunks placed in stripes ``0 .. members-1`` skipping stripe ``m``: that
    stripe holds the parity member ``m`` keeps.
    """

    sizes: tuple[int, ...]
    """Payload bytes of each member, in group order."""

    def __post_init__(self):
        object.__setattr__(self, "sizes", tuple(self.sizes))
        if len(self.sizes) < 2:
            raise ValueError(f"a stripe layout needs at least 2 members, got sizes {self.sizes}")
        if any(size < 0 for size in self.sizes):
            raise ValueError(f"payload sizes must be at least 0 bytes, got {self.sizes}")

    @property
    def members(self) -> int:
        return len(self.sizes)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk, and of one member's parity (at least 1)."""
        return parity_chunk_bytes(self.sizes)

    def chunk_index(self, member: int, stripe: int) -> int:
        """Which of ``member``'s chunks lies in ``stripe`` (any stripe but its own)."""
        if stripe == member:
            raise ValueError(f"stripe {stripe} holds member {member}'s parity, none of its chunks")
        return stripe if stripe < member else stripe - 1

    def stripes(self, member: int, payload: torch.Tensor) -> torch.Tensor:
        """``member``'s chunks at their stripes and zeros at its own: ``members * chunk_bytes``
        bytes: its part of the group's XOR laid out whole (``parity_of`` adds these up;
        ``encode`` sends the chunks where they lie, without laying them out)."""
        return _place(self, member, payload, parity=None, out=torch.empty(self.members * self.chunk_bytes,
                                                                          dtype=torch.uint8))


def rebuild_temporary_bytes(sizes: Sequence[int], lost: int) -> int:
    """Host bytes a process of ``rebuild`` allocates at its peak beyond the survivors' payloads
    and parities: the lost payload at ``dst`` (which it returns), two pieces elsewhere."""
    layout = StripeLayout(tuple(sizes))
    return max(layout.sizes[lost], 2 * min(PIECE_BYTES, layout.chunk_bytes))


def encode(payload: torch.Tensor, *, member: int, layout: StripeLayout, group: dist.ProcessGroup,
           out: torch.Tensor | None = None, piece_bytes: int = ENCODE_PIECE_BYTES,
           spares: Optional[EncodeSpares] = None) -> torch.Tensor:
    """``member``'s parity chunk: the XOR of the other members' chunks in stripe ``member``.

    A collective: every process of ``group`` (group rank i is member i) calls it with its
    own payload. ``out`` (uint8, ``chunk_bytes``, contiguous), where given, receives the
    parity, e.g. a view into the snapshot's host buffer; it is returned either way.
    ``spares``: the caller's spare pieces, kept from one encode to the next (a snapshot
    taker's); None: fresh ones for this call.

    Each member sends each of its chunks straight to the member that keeps the parity of
    its stripe, and receives the others' chunks of its own stripe, in pieces of
    ``piece_bytes`` (``_receive_pieces``): each sends and receives one share, no member
    waits for another's XOR, and it XORs a piece that has just arrived (still in cache)
    while the next ones arrive, so the XOR hides behind the transfer. It replaced a ring
    reduce-scatter of whole chunks, whose rounds waited on each other's XOR and which
    allocated a fresh chunk each call (87k page faults an encode in a group of 4 at 256 MiB
    shares, against 44-509 now, its spares kept); that ring ran about 5x gloo's BXOR
    ``reduce_scatter_tensor``. A pair, which XORs nothing, sends its chunk as one message.
    Beside the payload and ``out`` it holds at most ``ENCODE_WINDOW`` pieces
    (``encode_temporary_bytes``); sends read the payload in place.
    """
    members = layout.members
    if not 0 <= member < members:
        raise ValueError(f"member {member} is not in a group of {members}")
    if dist.get_world_size(group) != members:
        raise ValueError(f"the group has {dist.get_world_size(group)} processes, the layout {members} members")
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be at least 1, got {piece_bytes}")
    _check_bytes("payload", payload, layout.sizes[member])
    if out is None:
        out = torch.empty(layout.chunk_bytes, dtype=torch.uint8)
    else:
        _check_bytes("out", out, layout.chunk_bytes)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous: its pieces are received in place")
    if members == 2:
        piece_bytes = layout.chunk_bytes  # a pair XORs nothing: its parity is its partner's chunk, one message
    sends = []
    for index, start in enumerate(range(0, layout.chunk_bytes, piece_bytes)):
        for keeper in _others(member, members):
            piece = _chunk_of(layout, member, keeper, payload)[start:start + piece_bytes]
            if piece.numel():
                sends.append(dist.isend(piece, dist.get_global_rank(group, keeper), group=group, tag=index))
    _receive_pieces(out, member=member, layout=layout, group=group, piece_bytes=piece_bytes,
                    spares=EncodeSpares() if spares is None else spares)
    _wait_all(sends)
    return out


def _others(member: int, members: int) -> list[int]:
    """The other members, nearest after ``member`` first: each member starts on a different
    peer, so no member is everyone's first."""
    return [(member + step) % members for step in range(1, members)]


def _receive_pieces(out: torch.Tensor, *, member: int, layout: StripeLayout, group: dist.ProcessGroup,
                    piece_bytes: int, spares: EncodeSpares) -> None:
    """Receive the other members' chunks of stripe ``member`` and XOR them into ``out``.

    The first sender's pieces arrive straight in ``out`` (past its chunk's end ``out`` is
    zeroed); every other sender's go into one of ``encode_temporary_bytes`` worth of spare
    pieces, are XORed into ``out`` where the first sender's same piece arrived, and free
    the spare for a piece further on. Receives are posted as far ahead as spares allow and
    waited on in order, piece by piece across the senders.
    """
    first, *rest = [(member - step) % layout.members for step in range(1, layout.members)]
    expected = {sender: _chunk_bytes_held(layout, sender, member) for sender in (first, *rest)}
    out[expected[first]:].zero_()
    wanted = [(sender, index, start, min(piece_bytes, expected[sender] - start))
              for index, start in enumerate(range(0, layout.chunk_bytes, piece_bytes))
              for sender in (first, *rest) if start < expected[sender]]
    spare_bytes = min(piece_bytes, layout.chunk_bytes)
    memory = spares.take(encode_temporary_bytes(layout.sizes, piece_bytes=piece_bytes))
    free = list(memory.split(spare_bytes)) if memory.numel() else []
    posted: collections.deque = collections.deque()
    upcoming = iter(wanted)
    waiting = next(upcoming, None)
    while waiting is not None or posted:
        while waiting is not None and (waiting[0] == first or free):
            sender, index, start, nbytes = waiting
            spare = None if sender == first else free.pop()
            target = out[start:start + nbytes] if spare is None else spare[:nbytes]
            posted.append((dist.irecv(target, dist.get_global_rank(group, sender), group=group, tag=index),
                           start, nbytes, spare))
            waiting = next(upcoming, None)
        work, start, nbytes, spare = posted.popleft()
        work.wait()
        if spare is not None:
            xor_into(out[start:start + nbytes], spare[:nbytes])
            free.append(spare)
    spares.keep(memory)  # only after every receive ended: a failed one may still write into it


def rebuild(*, lost: int, member: int | None, payload: torch.Tensor | None, parity: torch.Tensor | None,
            layout: StripeLayout, group: dist.ProcessGroup, dst: int) -> torch.Tensor | None:
    """Member ``lost``'s payload, returned at group rank ``dst`` (None elsewhere).

    A collective over every surviving member (its ``member``, ``payload`` and ``parity``
    from ``encode``); the group may hold processes with nothing of this group as well
    (``member``, ``payload``, ``parity`` all None), such as the lost member's replacement
    waiting at ``dst``, which add nothing. At every stripe but the lost member's, the
    survivors' contributions (their chunk there, or their parity at their own stripe) XOR
    to the lost member's chunk there (``_share`` says why). The group's processes form a
    chain ending at ``dst``, in ``PIECE_BYTES`` pieces of the lost payload: each receives a
    piece's partial XOR from the one before, XORs its contribution in and sends it on while
    the next piece arrives, so each link carries the lost payload once.
    """
    if not 0 <= lost < layout.members:
        raise ValueError(f"lost member {lost} is not in a group of {layout.members}")
    if member is None:
        if payload is not None or parity is not None:
            raise ValueError("a process with no member gives no payload or parity")
    else:
        if member == lost or payload is None or parity is None:
            raise ValueError(f"member {member} must be a survivor of lost member {lost}, with payload and parity")
        _check_bytes("payload", payload, layout.sizes[member])
        _check_bytes("parity", parity, layout.chunk_bytes)
    me, size = dist.get_rank(group), dist.get_world_size(group)
    chain = [r for r in range(size) if r != dst] + [dst]
    place = chain.index(me)
    previous = chain[place - 1] if place > 0 else None
    following = chain[place + 1] if place + 1 < size else None
    result = torch.empty(layout.sizes[lost], dtype=torch.uint8) if following is None else None
    spares = [torch.empty(min(PIECE_BYTES, layout.chunk_bytes), dtype=torch.uint8) for _ in range(2)]
    in_flight: list[dist.Work] = []
    for index, (stripe, start, end) in enumerate(_pieces(layout, lost)):
        mine = None if member is None else _contribution(layout, member, stripe, payload, parity)[start:end]
        nbytes = end - start
        if result is not None:
            partial = result[stripe_offset(layout, lost, stripe) + start:][:nbytes]
        else:
            partial = spares[index % 2][:nbytes]
            _wait_all(in_flight[:-1])  # this spare's last send is done before it is refilled
            in_flight = in_flight[-1:]
        if previous is None:
            partial.zero_()
        else:
            dist.recv(partial, dist.get_global_rank(group, previous), group=group)
        if mine is not None:
            xor_into(partial, mine)
        if following is not None:
            in_flight.append(dist.isend(partial, dist.get_global_rank(group, following), group=group))
    _wait_all(in_flight)
    return result


class EncodeSpares:
    """An encoder's spare pieces, kept from one encode to the next (its owner: the rank's
    ``SnapshotTaker``): fresh pages cost a page fault each on first touch, which made a group
    of 4 encode about a fifth slower here (0.69 against 0.89 GB/s a rank, one interleaved
    run, 256 MiB shares). It holds what ``encode_temporary_bytes`` counts, between encodes
    too. An encode takes the memory and puts it back once it succeeded, so two at once
    would each get their own."""

    def __init__(self):
        self._kept: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        kept, self._kept = self._kept, None
        return kept if kept is not None and kept.numel() == nbytes else torch.empty(nbytes, dtype=torch.uint8)

    def keep(self, memory: torch.Tensor) -> None:
        self._kept = memory



PIECE_BYTES = 64 * 1024 * 1024
"""A rebuild moves the lost payload down its chain in pieces of at most this many bytes, so
the links work at once; large enough that per-message costs vanish."""

XOR_THREADS = 4
"""Threads an XOR of a large buffer is cut across (torch's bitwise XOR lets go of the GIL),
so it runs beside the training thread and on every core a host gives the snapshot."""

_XOR_MIN_SLICE = 16 * 1024 * 1024


def xor_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target[:n] ^= source`` for the ``n`` bytes ``source`` holds (the rest of ``target`` is
    XORed with zeros: unchanged), over int64 words where both align, in ``XOR_THREADS``
    threads for a large buffer."""
    count = source.numel()
    if count == 0:
        return
    slices = min(XOR_THREADS, max(1, count // _XOR_MIN_SLICE))
    bounds = [count * i // slices // 8 * 8 for i in range(slices)] + [count]

    def one(i: int) -> None:
        _xor_words(target[bounds[i]:bounds[i + 1]], source[bounds[i]:bounds[i + 1]])

    if slices == 1:
        one(0)
        return
    with _xor_pool() as pool:
        list(pool.map(one, range(slices)))


def _xor_words(target: torch.Tensor, source: torch.Tensor) -> None:
    words = target.numel() // 8 * 8
    if words and target.data_ptr() % 8 == 0 and source.data_ptr() % 8 == 0:
        target[:words].view(torch.int64).bitwise_xor_(source[:words].view(torch.int64))
        target, source = target[words:], source[words:]
    target.bitwise_xor_(source)


def _xor_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(XOR_THREADS, thread_name_prefix="odyssey-xor")


def _wait_all(works: Iterable[dist.Work]) -> None:
    for work in works:
        work.wait()


def _chunk_of(layout: StripeLayout, member: int, stripe: int, payload: torch.Tensor) -> torch.Tensor:
    """``member``'s chunk in ``stripe`` as far as its payload holds it (its bytes past the
    payload's end are zeros): a view of ``payload``."""
    return payload[slice(*_chunk_bounds(layout, member, stripe))]


def _chunk_bytes_held(layout: StripeLayout, member: int, stripe: int) -> int:
    """How many bytes of ``member``'s chunk in ``stripe`` its payload holds: what a receiver
    of that chunk expects from it."""
    start, end = _chunk_bounds(layout, member, stripe)
    return end - start


def _chunk_bounds(layout: StripeLayout, member: int, stripe: int) -> tuple[int, int]:
    index = layout.chunk_index(member, stripe)
    start = min(layout.sizes[member], index * layout.chunk_bytes)
    return start, min(layout.sizes[member], start + layout.chunk_bytes)


def _contribution(layout: StripeLayout, member: int, stripe: int, payload: torch.Tensor,
                  parity: torch.Tensor) -> torch.Tensor:
    """What ``member`` adds to stripe ``stripe`` in a rebuild: its parity at its own stripe,
    else its chunk there (as far as its payload holds it)."""
    return parity if stripe == member else _chunk_of(layout, member, stripe, payload)


def stripe_offset(layout: StripeLayout, member: int, stripe: int) -> int:
    """Where ``member``'s chunk in ``stripe`` starts in its payload."""
    return layout.chunk_index(member, stripe) * layout.chunk_bytes


def _pieces(layout: StripeLayout, lost: int) -> list[tuple[int, int, int]]:
    """(stripe, start, end) of each piece of the lost payload, in payload order: bytes
    ``start:end`` of its chunk in ``stripe``, at most ``PIECE_BYTES`` each."""
    pieces = []
    for stripe in range(layout.members):
        if stripe == lost:
            continue
        held = min(layout.chunk_bytes, max(0, layout.sizes[lost] - stripe_offset(layout, lost, stripe)))
        pieces += [(stripe, start, min(held, start + PIECE_BYTES)) for start in range(0, held, PIECE_BYTES)]
    return pieces


def parity_of(payloads: Sequence[torch.Tensor], layout: StripeLayout) -> list[torch.Tensor]:
    """Each member's parity chunk, computed in one place: what ``encode`` returns to each."""
    _check_count("payloads", payloads, layout)
    total = _xor_all(layout.stripes(member, payload) for member, payload in enumerate(payloads))
    return list(total.view(layout.members, layout.chunk_bytes).unbind(0))


def rebuilt_from(payloads: Sequence[torch.Tensor], parities: Sequence[torch.Tensor], lost: int,
                 layout: StripeLayout) -> torch.Tensor:
    """Member ``lost``'s payload from the others' payloads and parities (``payloads[lost]``
    and ``parities[lost]`` are not read): what ``rebuild`` returns at ``dst``."""
    _check_count("payloads", payloads, layout)
    _check_count("parities", parities, layout)
    total = _xor_all(_share(layout, member, payloads[member], parities[member])
                     for member in range(layout.members) if member != lost)
    return _unplace(layout, lost, total)


def _share(layout: StripeLayout, member: int, payload: torch.Tensor, parity: torch.Tensor) -> torch.Tensor:
    """A survivor's part of a rebuild: its chunks at their stripes, its parity at its own.

    At every stripe ``s`` but the lost member's, the survivors' shares XOR to the lost
    member's chunk there: parity ``s`` (on member ``s``) cancels every survivor's chunk in
    ``s`` and leaves the lost one's. (At the lost member's stripe they XOR to its parity.)
    """
    _check_bytes("parity", parity, layout.chunk_bytes)
    return _place(layout, member, payload, parity=parity,
                  out=torch.empty(layout.members * layout.chunk_bytes, dtype=torch.uint8))


def _place(layout: StripeLayout, member: int, payload: torch.Tensor, *, parity: torch.Tensor | None,
           out: torch.Tensor) -> torch.Tensor:
    """Write ``member``'s chunks at their stripes into ``out`` and ``parity`` (zeros if None)
    at its own stripe: the chunks before it are the payload's head, the ones after its tail,
    so two copies place them all."""
    if not 0 <= member < layout.members:
        raise ValueError(f"member {member} is not in a group of {layout.members}")
    _check_bytes("payload", payload, layout.sizes[member])
    chunk = layout.chunk_bytes
    own, after = member * chunk, (member + 1) * chunk
    head = min(payload.numel(), own)
    end = after + payload.numel() - head
    out[:head].copy_(payload[:head])
    out[head:own].zero_()
    if parity is None:
        out[own:after].zero_()
    else:
        out[own:after].copy_(parity)
    out[after:end].copy_(payload[head:])
    out[end:].zero_()
    return out


def _unplace(layout: StripeLayout, member: int, stripes: torch.Tensor) -> torch.Tensor:
    """``member``'s payload read back from its chunks in ``stripes`` (``_place``'s inverse)."""
    size, own, after = layout.sizes[member], member * layout.chunk_bytes, (member + 1) * layout.chunk_bytes
    if size <= own:
        return stripes[:size]
    return torch.cat((stripes[:own], stripes[after:after + size - own]))


def _xor_all(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    tensors = iter(tensors)
    total = next(tensors)
    for tensor in tensors:
        total.bitwise_xor_(tensor)
    return total


def _check_bytes(name: str, tensor: torch.Tensor, size: int) -> None:
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() != size:
        raise ValueError(f"{name} must be a 1-D uint8 tensor of {size} bytes, "
                         f"got {tensor.dtype} of shape {tuple(tensor.shape)}")


def _check_count(name: str, tensors: Sequence[torch.Tensor], layout: StripeLayout) -> None:
    if len(tensors) != layout.members:
        raise ValueError(f"{len(tensors)} {name} for a group of {layout.members} members")
