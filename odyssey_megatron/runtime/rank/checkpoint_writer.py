"""This rank's part of the periodic disk checkpoints, written in the background.

Every ``odyssey.checkpoint_interval`` steps, as the step starts (its blocks as of the steps
committed before it), the rank copies the blocks it writes (``snapshot.shards.owners``:
each block by one of the workers that train it, spread over the data-parallel replicas;
each TP rank its shard) into host buffers, pinned where a device is present
(``Accelerator.host_buffer``) and kept from one checkpoint to the next. That copy is all
the step waits for: a thread then writes the buffers as the rank's part
(``runtime.checkpoint.write_part``: per-rank files, fsynced, manifest last) and counts the
rank in (``checkpoint_parts_key``), while training goes on. No collective is involved, so
an abort that destroys the generation's groups cannot hang or corrupt a write; a part cut
short (the rank killed, its node lost, a disk error) has no manifest, the step's parts
never hold every block, and the checkpoint before it stays the latest: the owner marks a
checkpoint the latest only once every writer counted in and the parts hold every block
(``runtime.control.checkpoint_following``).

A checkpoint starts only once the previous one is written: it waits for it (the buffers
are the previous write's until then, and a skipped checkpoint would silently stretch the
interval the failure rate chose). At the default interval the write has many steps to
finish in, so the wait is none; a wait is logged with its length.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from odyssey_megatron.config import ModelConfig
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.runtime.checkpoint import part_tensors, write_part
from odyssey_megatron.runtime.protocol.keys import checkpoint_parts_key

__all__ = ["CheckpointWriter"]

log = logging.getLogger(__name__)


class CheckpointWriter:
    """One rank's checkpoint writes across its generations: at most one in flight."""

    def __init__(self, run_dir: Path, *, rank: int, tp_rank: int, tp_size: int, model: ModelConfig,
                 store: dist.Store, host_buffer: Callable[[torch.Tensor], torch.Tensor],
                 synchronize: Callable[[], None]):
        """``store``: a connection of the writer's own (its thread counts in while the
        training thread waits on others); ``host_buffer`` makes a host tensor like a held
        one, ``synchronize`` waits for the copies into it (``hooks.accelerator``)."""
        self.run_dir, self.rank, self.tp_rank, self.tp_size, self.model = run_dir, rank, tp_rank, tp_size, model
        self.store, self.host_buffer, self.synchronize = store, host_buffer, synchronize
        self._buffers: dict[str, torch.Tensor] = {}
        """Checkpoint key -> the host buffer its tensor is copied into."""
        self._thread: Optional[threading.Thread] = None

    def start(self, state: TrainingState, blocks: list, *, step: int, generation: int) -> None:
        """Copy ``blocks`` of ``state`` (each at ``step`` steps) to the host buffers, then
        write them as this rank's part of the checkpoint of ``step`` in the background,
        after the previous write finished."""
        waited = self.wait()
        if waited > 0.01:
            log.warning("rank %d: waited %.2f s for the checkpoint before step %d's to be written", self.rank,
                        waited, step)
        held = part_tensors(state, blocks, tp_rank=self.tp_rank, tp_size=self.tp_size)
        buffers = {}
        for key, tensor in held.items():
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = self.host_buffer(tensor)
            buffers[key] = buffer.copy_(tensor.detach(), non_blocking=True)
        self.synchronize()  # the optimizer step overwrites what the copies read
        self._buffers = buffers  # blocks no longer written let go of their buffers
        self._thread = threading.Thread(target=self._write, args=(buffers, list(blocks), step, generation),
                                        name=f"odyssey-checkpoint-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> float:
        """Wait for the write in flight, if any; the seconds waited."""
        if self._thread is None:
            return 0.0
        started = time.monotonic()
        self._thread.join()
        self._thread = None
        return time.monotonic() - started

    def _write(self, buffers: dict[str, torch.Tensor], blocks: list, step: int, generation: int) -> None:
        started = time.monotonic()
        try:
            write_part(self.run_dir, buffers, blocks, step=step, part=f"rank-{self.rank}-gen{generation}",
                       tp_rank=self.tp_rank, tp_size=self.tp_size, model=self.model)
            self.store.add(checkpoint_parts_key(generation, step), 1)
        except Exception:  # noqa: BLE001 - a failed part leaves the last complete checkpoint the latest
            log.exception("rank %d: the checkpoint of step %d was not written; the one before it stays the latest",
                          self.rank, step)
            return
        log.info("rank %d: wrote its part of the checkpoint of step %d (%s) in %.2f s", self.rank, step,
                 [str(b) for b in blocks], time.monotonic() - started)
