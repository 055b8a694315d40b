"""Megatron-Core's own 1F1B schedule for a pipeline nobody reroutes into.

Each pipeline of such a plan is self-contained, whatever its stage count, layer split or
micro-batch count, so Megatron's ``forward_backward_pipelining_without_interleaving``
runs it over the pipeline's PP group. Its op order is the one ``schedules.ops`` models.
Megatron divides each loss by the pipeline's micro-batch count; the loss function
multiplies by (local / total micro-batches) so every micro-batch still weighs 1 / total,
as under the Odyssey executor, and layer-granular DP sync sums exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
from megatron.core.process_groups_config import ProcessGroupCollection

from odyssey_megatron.hooks.stage_step import MicroBatch, stage_forward


@dataclass
class MegatronPipelineSchedule:
    model: torch.nn.Module
    pipeline_group: dist.ProcessGroup
    stage_collection: ProcessGroupCollection
    """The stage model's groups; the schedule gets a copy with the real PP group."""
    micro_batches: tuple[int, ...]
    """This pipeline's global micro-batch ids, in order."""
    total_micro_batches: int
    seq_length: int
    micro_batch_size: int

    def __post_init__(self) -> None:
        c = self.stage_collection
        self._collection = ProcessGroupCollection(
            tp=c.tp, cp=c.cp, pp=self.pipeline_group, ep=c.ep, expt_dp=c.expt_dp,
            embd=None, pos_embd=None, dp=c.dp, dp_cp=c.dp_cp,
        )
        self._p2p = P2PCommunicator(self.pipeline_group, self.model.config)
        self._first = self.pipeline_group.rank() == 0
        self._last = self.pipeline_group.rank() == self.pipeline_group.size() - 1

    def run(self, *, batches: Callable[[int], MicroBatch]) -> dict[int, float]:
        """One step of this pipeline; returns the loss per micro-batch on the last stage."""
        reads = self._first or self._last
        data = (batches(m) for m in self.micro_batches) if reads else None
        scale = len(self.micro_batches) / self.total_micro_batches
        store = forward_backward_pipelining_without_interleaving(
            forward_step_func=partial(stage_forward, first=self._first, last=self._last, loss_scale=scale),
            data_iterator=data,
            model=self.model,
            num_microbatches=len(self.micro_batches),
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            p2p_communicator=self._p2p,
            pg_collection=self._collection,
        )
        if not self._last:
            return {}
        return {m: float(entry["lm loss"]) for m, entry in zip(self.micro_batches, store)}
