"""RAID-5-style XOR parity across nodes, so a node's in-memory snapshot survives its loss.

Every rank snapshots a shard of its state (a flat uint8 payload) into host memory on its
node; a node that dies takes those payloads with it. REFT's RAIM5 (paper 004) protects them
like RAID 5 protects disks: ranks on distinct nodes form a *protection group*, each member
cuts its payload into ``members - 1`` chunks, and stripe ``s`` holds one chunk of every
member but ``s``, whose XOR (the parity) member ``s`` keeps. Parity rotates, so each member
stores ``1 / (members - 1)`` of a payload more, and any ONE lost member's payload is the
XOR of the survivors' chunks and parities; two lost members in one group are beyond it.

``encode`` is one ``reduce_scatter`` with BXOR over the group, ``rebuild`` one BXOR
``reduce`` over the survivors; ``parity_of`` and ``rebuilt_from`` do the same arithmetic
without collectives (the tests' reference), through the same helpers. Who forms a group
and the byte counts (chunks, encode's temporaries) are ``snapshot.protection``'s, with no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from odyssey_megatron.snapshot.protection import parity_chunk_bytes, protection_groups, unprotected

__all__ = ["StripeLayout", "encode", "parity_of", "protection_groups", "rebuild", "rebuilt_from", "unprotected"]


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
        bytes, what it gives to ``encode``'s reduce-scatter."""
        return _place(self, member, payload, parity=None, out=torch.empty(self.members * self.chunk_bytes,
                                                                          dtype=torch.uint8))


def encode(payload: torch.Tensor, *, member: int, layout: StripeLayout, group: dist.ProcessGroup,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``member``'s parity chunk: the XOR of the other members' chunks in stripe ``member``.

    A collective: every process of ``group`` (group rank i is member i) calls it with its
    own payload. ``out`` (uint8, ``chunk_bytes``, contiguous), where given, receives the
    parity, e.g. a view into the snapshot's host buffer; it is returned either way.
    """
    if dist.get_world_size(group) != layout.members:
        raise ValueError(f"the group has {dist.get_world_size(group)} processes, the layout {layout.members} members")
    if out is None:
        out = torch.empty(layout.chunk_bytes, dtype=torch.uint8)
    else:
        _check_bytes("out", out, layout.chunk_bytes)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous: the reduce-scatter writes it whole")
    dist.reduce_scatter_tensor(out, layout.stripes(member, payload), op=dist.ReduceOp.BXOR, group=group)
    return out


def rebuild(*, lost: int, member: int | None, payload: torch.Tensor | None, parity: torch.Tensor | None,
            layout: StripeLayout, group: dist.ProcessGroup, dst: int) -> torch.Tensor | None:
    """Member ``lost``'s payload, returned at group rank ``dst`` (None elsewhere).

    A collective over every surviving member (its ``member``, ``payload`` and ``parity``
    from ``encode``); the group may hold processes with nothing of this group as well
    (``member``, ``payload``, ``parity`` all None), such as the lost member's replacement
    waiting at ``dst``, which give zeros. A survivor gives its chunks at their stripes and its
    parity at its own; a BXOR reduce of these to ``dst`` is the lost member's ``stripes``.
    """
    if not 0 <= lost < layout.members:
        raise ValueError(f"lost member {lost} is not in a group of {layout.members}")
    if member is None:
        if payload is not None or parity is not None:
            raise ValueError("a process with no member gives no payload or parity")
        share = torch.zeros(layout.members * layout.chunk_bytes, dtype=torch.uint8)
    else:
        if member == lost or payload is None or parity is None:
            raise ValueError(f"member {member} must be a survivor of lost member {lost}, with payload and parity")
        share = _share(layout, member, payload, parity)
    dist.reduce(share, dst=dist.get_global_rank(group, dst), op=dist.ReduceOp.BXOR, group=group)
    return _unplace(layout, lost, share) if dist.get_rank(group) == dst else None


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
