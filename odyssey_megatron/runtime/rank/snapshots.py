"""This rank's part of the in-memory snapshots (paper 004), and its part in a rollback.

**Taking one.** Every ``snapshot_interval`` steps, as the step starts, the rank copies its
share of its stage (``snapshot.shards``: whole blocks, weights, fp32 masters, Adam moments
and step) into its slot of the node's keeper memory (``snapshot.keeper``) while the step's
forward and backward run: on an accelerator's side stream into pinned keeper memory, on
CPU on a thread of its own (``snapshot.keeper_copy``). The thread then computes the rank's
parity chunk with its protection group (``snapshot.parity``: XOR across nodes), seals
both buffers and counts the rank into the snapshot; the rank that completes the count
marks it done, and from then on it counts (as a step commits). Only the step's optimizer
step, which overwrites what the copy reads, waits for the copy (``wait_copied``); the
parity may run on through the next steps, and the next snapshot starts once this one is
done (``take``), so a snapshot is done by the time the step of the next one starts,
whatever fails later (``SnapshotFollowing.collect`` looks as far back). Buffers
come in pairs: a snapshot is written into the one that does not hold the last complete
snapshot, so a failure during a write never leaves the run without one; the next
snapshot waits for the previous one to be done, so it never overwrites the only complete
one.

Parity runs on gloo groups whatever the training backend: the shards are in host memory
(and NCCL has no bitwise reduction).

**Restoring.** In a rollback generation (``PlanPublished.restore``) the rank reads the
shards it is named to read from its node's keeper, takes part in the XOR rebuilds of shards
whose node is lost, and ends holding those blocks as of the snapshot's step; the plan's
transfers then move them to the workers that train them.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.distributed as dist

from odyssey_megatron.blocks import Block
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.runtime.protocol.keys import snapshot_done_key, snapshot_parts_key
from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished
from odyssey_megatron.snapshot.keeper import KeeperBuffer, payload_layout, unpack
from odyssey_megatron.snapshot.keeper_copy import KeeperCopier, KeeperCopy
from odyssey_megatron.snapshot.parity import EncodeSpares, StripeLayout, encode, rebuild
from odyssey_megatron.snapshot.restore import Restore, block_from_key
from odyssey_megatron.snapshot.shards import owners, shard_blocks, shard_entries, snapshot_groups

__all__ = ["SnapshotAbandoned", "SnapshotTaker", "protection_group", "restore_snapshot"]

log = logging.getLogger(__name__)


class SnapshotAbandoned(RuntimeError):
    """The generation ended while this rank waited for a snapshot to complete."""


def _shard_layout(model: ModelConfig, owned: dict[Block, int], worker: int, tp_size: int):
    return payload_layout(shard_entries(model, shard_blocks(owned, worker), tp_size=tp_size))


def _sealed(buffer: KeeperBuffer, step: int, generation: int) -> Optional[torch.Tensor]:
    """The payload ``buffer`` holds of the snapshot of ``step`` written in ``generation``, if it holds that
    one as sealed (its CRC checked)."""
    found = buffer.read()
    return found[1] if found is not None and _is_of(found[0], step, generation) else None


def _is_of(meta: Optional[dict], step: int, generation: int) -> bool:
    """Whether a sealed snapshot's ``meta`` is that of ``step`` written in ``generation``."""
    return meta is not None and (meta.get("step"), meta.get("generation")) == (step, generation)


class _Slot:
    """One rank's keeper slot: a pair of data buffers and a pair of parity buffers."""

    def __init__(self, paths: Sequence[str]):
        data0, data1, parity0, parity1 = paths
        self.data = (KeeperBuffer(data0), KeeperBuffer(data1))
        self.parity = (KeeperBuffer(parity0), KeeperBuffer(parity1))

    def holding(self, step: int, generation: int) -> Optional[int]:
        """The buffer pair (by its data buffer) sealed with the snapshot of ``step`` written in
        ``generation``, by its header (the payload's CRC is checked where it is read)."""
        return next((index for index in (0, 1)
                     if _is_of(self.data[index].sealed_meta(), step, generation)), None)

    def close(self) -> None:
        for buffer in (*self.data, *self.parity):
            buffer.close()


def protection_group(plan: ExecutionPlan, *, rank: int, cluster: ClusterState, nodes_per_group: int,
                     rank_in_generation: Callable[[int], int],
                     timeout: datetime.timedelta) -> Optional[tuple[tuple[int, ...], dist.ProcessGroup]]:
    """This rank's protection group (its members in launch ranks, and its gloo group), or
    None where it has none (it trains nothing, or is alone on the only node). Collective:
    every rank of the generation calls it, in the same place among its ``new_group``
    calls (torch names a group by its ranks and the groups a process holds, so groups
    built by their members alone come out under different names where the members hold
    different numbers of groups)."""
    mine = None
    for members in snapshot_groups(plan, cluster=cluster, nodes_per_group=nodes_per_group):
        if len(members) < 2:
            continue
        group = dist.new_group([rank_in_generation(m) for m in members], timeout=timeout, backend="gloo")
        if rank in members:
            mine = members, group
    return mine


class SnapshotTaker:
    """One generation's snapshots on this rank (``PlanPublished.snapshot_interval``)."""

    def __init__(self, *, slot: Sequence[str], rank: int, cluster: ClusterState, model: ModelConfig,
                 published: PlanPublished, protection: Optional[tuple[tuple[int, ...], dist.ProcessGroup]],
                 store: dist.Store, ended: Callable[[], bool], poll_s: float):
        """``protection``: this rank's protection group (``protection_group``), if any."""
        plan = published.plan
        self.rank, self.store = rank, store
        self.ended, self.poll_s = ended, poll_s
        self.interval, self.start_step = published.snapshot_interval, published.start_step
        self.generation = plan.generation
        self.training_ranks = len(plan.workers) * plan.tensor_parallel_size
        self.kept = published.snapshot
        """(step, generation) of the last complete snapshot, which no write may touch."""
        tp = cluster.tensor_parallel_size
        self.worker = cluster.worker_of(rank)
        self.owned = owners(plan, model)
        self.entries, self.total = _shard_layout(model, self.owned, self.worker, tp)
        self.group: Optional[dist.ProcessGroup] = None
        self.member, self.stripes = 0, None
        if protection is not None:
            members, self.group = protection
            self.member = members.index(rank)
            self.stripes = StripeLayout(tuple(_shard_layout(model, self.owned, cluster.worker_of(m), tp)[1]
                                              for m in members))
        self.slot = _Slot(slot)
        self.copier = KeeperCopier()
        self.spares = EncodeSpares()
        """The parity encode's spare pieces, kept from one snapshot to the next."""
        self._copy: Optional[KeeperCopy] = None
        """The copy of the snapshot in flight, until the optimizer step waited for it."""
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._pending: Optional[int] = None
        """The step of the snapshot this rank wrote last, until it is known done."""

    def due(self, step: int) -> bool:
        """Whether a snapshot is taken as ``step`` starts (after ``step`` committed steps)."""
        return bool(self.interval) and step > self.start_step and step % self.interval == 0

    def take(self, step: int, state: TrainingState) -> None:
        """Start writing ``state``'s share as of ``step`` committed steps; returns at once,
        once the previous snapshot is done (every rank's part in): it is then the one kept."""
        self.wait_done()
        if self.ended():  # the controller picks the snapshot to restore after the abort: keep what it sees
            raise SnapshotAbandoned(f"the generation ended before the snapshot of step {step} started")
        found = self.slot.holding(*self.kept) if self.kept else None
        index = 0 if found is None else 1 - found
        tensors = {f"{block}/{key}": tensor for block in shard_blocks(self.owned, self.worker)
                   for key, tensor in state.export(block).items()}
        payload = self.slot.data[index].begin(self.total)
        self._copy = self.copier.start(tensors, self.entries, payload)
        self._pending = step
        self._thread = threading.Thread(target=self._write, args=(step, index, self._copy, payload), daemon=True,
                                        name="odyssey-snapshot")
        self._thread.start()

    def wait_copied(self) -> None:
        """Before the step's optimizer step, which overwrites what the snapshot copies: the
        copy into keeper memory is over (on an accelerator the training stream waits for it,
        the host goes on). The parity and the count-in may run on; an error of the thread is
        raised here where it came by then (a failed copy always has), else by the next ``take``."""
        if self._copy is not None:
            self._copy.wait_on_device()
            self._copy = None
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def wait_done(self) -> None:
        """Until the snapshot this rank wrote last is done: its own part in (the thread
        ended; its error raised) and every other rank's (the done key)."""
        if self._pending is None:
            return
        self.wait_copied()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_error()
        done = snapshot_done_key(self.generation, self._pending)
        while not self.store.check([done]):
            if self.ended():
                raise SnapshotAbandoned(f"the generation ended before the snapshot of step {self._pending} completed")
            time.sleep(self.poll_s)
        self.kept, self._pending = (self._pending, self.generation), None

    def abandon(self) -> None:
        """Leaving the generation: let the write in flight end (its collective fails with the group)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._copy = None
        self.copier.close()
        self.slot.close()

    def _write(self, step: int, index: int, copy: KeeperCopy, payload: torch.Tensor) -> None:
        try:
            copy.run()
            copy.wait_on_host()
            del copy
            meta = {"step": step, "generation": self.generation, "rank": self.rank}
            if self.group is not None:
                parity = self.slot.parity[index].begin(self.stripes.chunk_bytes)
                encode(payload, member=self.member, layout=self.stripes, group=self.group, out=parity,
                       spares=self.spares)
                del parity
                self.slot.parity[index].seal({**meta, "member": self.member})
            del payload
            self.slot.data[index].seal(meta)
            if self.store.add(snapshot_parts_key(self.generation, step), 1) == self.training_ranks:
                self.store.set(snapshot_done_key(self.generation, step), "1")
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc


def restore_snapshot(restore: Restore, *, rank: int, node_first_rank: int, slots: Sequence[Sequence[str]],
                     model: ModelConfig, cluster: ClusterState, rank_in_generation: Callable[[int], int],
                     timeout: datetime.timedelta, track: Callable[[list], None],
                     device: torch.device) -> TrainingState:
    """This rank's blocks as of ``restore.step``, on ``device`` (the rank's: the plan's
    transfers send them next): the shards it reads from its node's keeper and the ones it
    rebuilds (in host memory, over gloo). Collective: every rank of the generation builds
    every rebuild's process group, in order (``protection_group`` says why); ``track`` gets
    the groups this rank is in (the collective guard keeps them)."""
    owned = dict(restore.owners)
    state = TrainingState()

    def slot_of(owner_rank: int) -> _Slot:
        return _Slot(slots[owner_rank - node_first_rank])

    def receive(payload: torch.Tensor, owner_rank: int, *, copy: bool) -> None:
        """Hold the blocks of ``owner_rank``'s shard from ``payload``: copied out of keeper
        memory, or as views of a rebuilt payload this rank owns (``copy=False``)."""
        entries, _ = _shard_layout(model, owned, cluster.worker_of(owner_rank), cluster.tensor_parallel_size)
        by_block: dict[Block, dict[str, torch.Tensor]] = {}
        for key, tensor in unpack(payload, entries, copy=copy).items():
            by_block.setdefault(block_from_key(key), {})[key.partition("/")[2]] = tensor
        for block, tensors in by_block.items():
            state.receive_on(device, block, tensors)

    def snapshot_of(owner_rank: int, *, parity: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        slot = slot_of(owner_rank)
        index = slot.holding(restore.step, restore.generation)
        if index is None:
            raise RuntimeError(f"rank {owner_rank}'s keeper slot holds no snapshot of step {restore.step} "
                               f"(generation {restore.generation})")
        payload = _sealed(slot.data[index], restore.step, restore.generation)
        if payload is None:
            raise RuntimeError(f"rank {owner_rank}'s keeper slot holds the snapshot of step {restore.step} "
                               f"(generation {restore.generation}) with a payload not the one sealed (its CRC differs)")
        chunk = None
        if parity:
            chunk = _sealed(slot.parity[index], restore.step, restore.generation)
            if chunk is None:
                raise RuntimeError(f"rank {owner_rank}'s keeper slot holds no parity of step {restore.step} "
                                   "(none sealed, or not the one sealed)")
        slot.close()  # the views keep their memory mapped; nothing writes it while the rollback reads
        return payload, chunk

    for read in restore.reads:
        if read.reader == rank:
            receive(snapshot_of(read.owner, parity=False)[0], read.owner, copy=True)
            log.info("rank %d: read rank %d's snapshot shard of step %d from the node's keeper", rank, read.owner,
                     restore.step)
    for rebuilt in restore.rebuilds:
        members = [m for m in rebuilt.group if m != rebuilt.lost]
        group = dist.new_group([rank_in_generation(r) for r in rebuilt.readers], timeout=timeout, backend="gloo")
        if rank not in rebuilt.readers:
            continue
        track([group])
        member = members[rebuilt.readers.index(rank)]
        payload, chunk = snapshot_of(member, parity=True)
        stripes = StripeLayout(tuple(_shard_layout(model, owned, cluster.worker_of(m), cluster.tensor_parallel_size)[1]
                                     for m in rebuilt.group))
        lost = rebuild(lost=rebuilt.group.index(rebuilt.lost), member=rebuilt.group.index(member), payload=payload,
                       parity=chunk, layout=stripes, group=group, dst=0)
        if lost is not None:
            receive(lost, rebuilt.lost, copy=False)
            log.info("rank %d: rebuilt rank %d's snapshot shard of step %d from parity (group %s)", rank,
                     rebuilt.lost, restore.step, list(rebuilt.group))
    return state
