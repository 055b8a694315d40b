"""The node's snapshot memory: host memory that outlives a worker but not its node.

A worker copies its shard of the training state into host memory every few steps; when
it dies (even by SIGKILL) a sibling on the same node reads that copy back to recover. So
the memory must belong to something that outlives the workers and dies with the node:
the node's launcher. ``NodeKeeper`` (launcher side) creates anonymous memory files
(``os.memfd_create``) and holds their fds while it lives. The workers are forked from a
multiprocessing fork server, so they inherit none of those fds; they open a buffer by the
path ``/proc/<launcher pid>/fd/<fd>`` (``KeeperBuffer``), which gives the same file. A
memfd's memory is freed when the last process holding it (by fd or by mapping) exits:
when the node's process group is killed, nothing of it is left on the machine. Opening
such a path needs the launcher alive, the same user, and the launcher dumpable (the
kernel checks ptrace read access).

Each slot (one worker process of the node) has four buffers: two for its data shard and
two for its parity chunk, so that a snapshot being written never overwrites the last
sealed one. A buffer is a file of a fixed header area (``HEADER_BYTES``, which keeps the
payload page-aligned) and the payload after it. A snapshot is written payload first and
header last: ``begin`` clears the header's magic before anything else, ``seal`` writes
the header's JSON and checksum, then the magic. The writer is one process and a reader
reads after it died or finished, so writes in that order suffice: a writer killed before
``seal`` returned leaves ``read()`` returning None, never a torn snapshot. The header
holds the payload's CRC-32 too (``seal`` computes it, one pass over the payload: zlib's
CRC is compute-bound, so fusing it into the copy that fills the payload saves nothing),
and ``read()`` checks it: a payload changed after its seal (a stray write, a flipped bit)
reads as none, as a corrupt header does. ``sealed_meta()`` reads the header alone, for a
writer choosing which buffer to overwrite without a pass over both payloads.

The payload is mapped and handed out as a uint8 tensor (``torch.frombuffer`` over the
map), so packing writes straight into the shared memory. Such a tensor holds a reference
to its ``mmap`` object but does not keep the buffer exported (``mmap.close()`` would
succeed and leave the tensor pointing at unmapped memory), so a buffer never closes a
map: it drops it, and the map is unmapped when its last view goes. The file never
shrinks under a map of this process that a view still holds (touching it would raise
SIGBUS); another process holding views of a buffer must drop them before the buffer is
begun again. ``payload_layout`` places tensors in a payload deterministically, so a
reader (or a parity rebuild) computes the layout from the tensors' names, dtypes and
shapes alone.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import weakref
import zlib
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

__all__ = [
    "ALIGNMENT", "HEADER_BYTES", "KeeperBuffer", "NodeKeeper", "PayloadEntry", "SlotPaths", "pack",
    "payload_layout", "unpack",
]

HEADER_BYTES = 64 * 1024
"""The header area at the start of each buffer; the payload starts after it, page-aligned."""

ALIGNMENT = 64
"""Every tensor of a payload starts at a multiple of this many bytes."""

_MAGIC = b"ODYSNAP2"
_FIXED = struct.Struct("<8sII")
"""Magic, CRC-32 of everything after it (length and JSON), length of the JSON that follows. The JSON
holds the meta, the payload's size and the payload's CRC-32."""
_JSON_LIMIT = HEADER_BYTES - _FIXED.size


@dataclass(frozen=True)
class SlotPaths:
    """One worker slot's buffers: two for its data shard, two for its parity chunk (double buffering)."""

    data: tuple[str, str]
    parity: tuple[str, str]


class NodeKeeper:
    """Launcher side: creates 4 memfds per slot (one slot per worker process the node starts), holds them while
    it lives."""

    def __init__(self, slots: int, *, name: str = "odyssey-snapshot"):
        if slots < 1:
            raise ValueError(f"a node keeper needs at least one slot, got {slots}")
        self._pid = os.getpid()
        self._fds: list[int] = []
        try:
            self._paths = tuple(
                SlotPaths(data=(self._create(f"{name}-{slot}-data0"), self._create(f"{name}-{slot}-data1")),
                          parity=(self._create(f"{name}-{slot}-parity0"), self._create(f"{name}-{slot}-parity1")))
                for slot in range(slots))
        except BaseException:
            self.close()
            raise

    def _create(self, name: str) -> str:
        self._fds.append(os.memfd_create(name, os.MFD_CLOEXEC))
        return f"/proc/{self._pid}/fd/{self._fds[-1]}"

    @property
    def paths(self) -> tuple[SlotPaths, ...]:
        """Each slot's buffer paths, plain data to hand to the worker that takes the slot."""
        return self._paths

    def close(self) -> None:
        """Close every fd; the memory goes once no worker holds it either (idempotent)."""
        while self._fds:
            os.close(self._fds.pop())


class KeeperBuffer:
    """Worker side: one buffer by path. A snapshot is written payload first, header last, so a reader never
    sees a torn snapshot.

    A view from ``begin`` or ``read`` keeps its memory mapped as long as it is referenced, but it shows the
    buffer's current contents: the next ``begin`` (here or in another process) overwrites them."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self._map: mmap.mmap | None = None  # the payload's map, while its size is the payload's
        self._dropped: list[weakref.ref[mmap.mmap]] = []  # maps let go of: alive while a view holds them
        self._pending: int | None = None  # the size of the snapshot begun and not sealed yet

    def begin(self, nbytes: int) -> torch.Tensor:
        """Start a snapshot of ``nbytes``: invalidate the last one (``read`` returns None from now on), size the
        buffer, and return the payload as a uint8 tensor to write into."""
        if nbytes < 0:
            raise ValueError(f"a snapshot's size is at least 0 bytes, got {nbytes}")
        os.pwrite(self._fd, bytes(len(_MAGIC)), 0)
        self._pending = nbytes
        self._let_go(nbytes)
        os.ftruncate(self._fd, max(HEADER_BYTES + nbytes, self._held_end()))
        return self._payload(nbytes)

    def seal(self, meta: dict) -> None:
        """Finish the snapshot ``begin`` started: write its header (``meta``, any JSON-able dict, and the
        payload's size), the magic last; ``read`` returns it from now on."""
        if self._pending is None:
            raise RuntimeError("seal() needs a begin() first")
        payload_crc = zlib.crc32(self._payload(self._pending).numpy())
        body = json.dumps({"meta": meta, "nbytes": self._pending, "crc": payload_crc}).encode()
        if len(body) > _JSON_LIMIT:
            raise ValueError(f"a snapshot's meta takes {len(body)} bytes of JSON; the header holds at most "
                             f"{_JSON_LIMIT} (HEADER_BYTES={HEADER_BYTES} less {_FIXED.size})")
        tail = struct.pack("<I", len(body)) + body
        os.pwrite(self._fd, struct.pack("<I", zlib.crc32(tail)) + tail, len(_MAGIC))
        os.pwrite(self._fd, _MAGIC, 0)
        self._pending = None

    def read(self) -> tuple[dict, torch.Tensor] | None:
        """The sealed snapshot's meta and a uint8 view of its payload; None if there is none (never written,
        begun again, the header corrupt, or the payload not the one sealed)."""
        header = self._header()
        if header is None:
            return None
        payload = self._payload(header["nbytes"])
        if zlib.crc32(payload.numpy()) != header["crc"]:
            return None
        return header["meta"], payload

    def sealed_meta(self) -> dict | None:
        """The sealed snapshot's meta from its header alone, its payload unchecked; None where ``read``
        finds no header."""
        header = self._header()
        return None if header is None else header["meta"]

    def _header(self) -> dict | None:
        """The sealed header's JSON (meta, payload size and CRC), or None where none is sealed or it is
        corrupt, or the file is shorter than its payload."""
        header = os.pread(self._fd, HEADER_BYTES, 0)
        if len(header) < _FIXED.size:
            return None
        magic, crc, length = _FIXED.unpack_from(header)
        tail = header[len(_MAGIC) + 4:_FIXED.size + length]
        if magic != _MAGIC or length > _JSON_LIMIT or len(tail) != 4 + length or zlib.crc32(tail) != crc:
            return None
        doc = json.loads(tail[4:])
        if HEADER_BYTES + doc["nbytes"] > os.fstat(self._fd).st_size:
            return None
        return doc

    def close(self) -> None:
        """Let go of the file; views handed out keep their memory until they go (idempotent)."""
        self._map, self._dropped = None, []
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _payload(self, nbytes: int) -> torch.Tensor:
        self._let_go(nbytes)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if self._map is None:
            self._map = mmap.mmap(self._fd, nbytes, offset=HEADER_BYTES)
        return torch.frombuffer(self._map, dtype=torch.uint8)

    def _let_go(self, nbytes: int) -> None:
        """Drop the map unless it maps ``nbytes`` of payload; views of it keep it mapped while they live."""
        if self._map is not None and len(self._map) != nbytes:
            self._dropped.append(weakref.ref(self._map))
            self._map = None

    def _held_end(self) -> int:
        """Where the furthest map that a view still holds ends in the file (0 if none): the file may not
        shrink below it."""
        held = [held_map for ref in self._dropped if (held_map := ref()) is not None]
        self._dropped = [weakref.ref(held_map) for held_map in held]
        return max((HEADER_BYTES + len(held_map) for held_map in held), default=0)


@dataclass(frozen=True)
class PayloadEntry:
    """Where one tensor lies in a payload."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def payload_layout(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[PayloadEntry], int]:
    """Place ``(key, dtype, shape)`` tensors in a payload, in the given order, each at a multiple of
    ``ALIGNMENT``; the entries and the payload's size in bytes."""
    entries: list[PayloadEntry] = []
    end = 0
    for key, dtype, shape in tensors:
        if any(entry.key == key for entry in entries):
            raise ValueError(f"tensor {key!r} is placed twice in one payload")
        entries.append(PayloadEntry(key, dtype, tuple(int(size) for size in shape), -(-end // ALIGNMENT) * ALIGNMENT))
        end = entries[-1].offset + entries[-1].nbytes
    return entries, end


def pack(tensors: Mapping[str, torch.Tensor], entries: Sequence[PayloadEntry], out: torch.Tensor, *,
         non_blocking: bool = False) -> None:
    """Copy each of ``tensors`` (contiguous or not, on any device) into its place in the uint8 tensor ``out``;
    ``non_blocking``: a device's copies are queued on its current stream (``snapshot.keeper_copy``)."""
    if set(tensors) != {entry.key for entry in entries}:
        raise ValueError(f"the tensors ({sorted(tensors)}) are not the layout's ({sorted(e.key for e in entries)})")
    for entry in entries:
        tensor = tensors[entry.key]
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise ValueError(f"tensor {entry.key!r} is {tensor.dtype} {tuple(tensor.shape)}; the layout has "
                             f"{entry.dtype} {entry.shape}")
        _placed(out, entry).copy_(tensor, non_blocking=non_blocking)


def unpack(payload: torch.Tensor, entries: Sequence[PayloadEntry], *, copy: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of ``entries`` read from the uint8 ``payload``: copies by default, since the next snapshot
    overwrites the payload's memory; views of it with ``copy=False``."""
    return {entry.key: _placed(payload, entry).clone() if copy else _placed(payload, entry) for entry in entries}


def _placed(payload: torch.Tensor, entry: PayloadEntry) -> torch.Tensor:
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() < entry.offset + entry.nbytes:
        raise ValueError(f"tensor {entry.key!r} needs a 1-D uint8 payload of at least "
                         f"{entry.offset + entry.nbytes} bytes, got {payload.dtype} {tuple(payload.shape)}")
    return payload[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
