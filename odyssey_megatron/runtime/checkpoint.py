"""Full training checkpoints that load under any layout, for the run that cannot go on in
memory: when every replica of a block is lost, the run exits 3 and ``odyssey train
--resume RUN_DIR`` continues from the last one.

Every ``odyssey.checkpoint_interval`` committed steps the training ranks save their blocks
together with ``torch.distributed.checkpoint`` into ``RUN_DIR/checkpoint/step-<n>/``,
keyed by global parameter name (``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``,
``step/<block>``), so data-parallel replicas are written once and any stage split or
data-parallel degree reads back exactly the blocks it needs. A TP shard's key carries its
TP rank (``.../tp<k>of<n>``): a resume keeps the TP degree. ``latest.json``, written by
the save's coordinator once the step's files are complete and durable (DCP fsyncs each
file it writes; the coordinator fsyncs the directories that list them), names the
checkpoint to resume from, so a save cut short by a failure or a power cut is never read.
DCP unpickles a checkpoint's metadata, so ``latest_checkpoint`` hands out only one that
no other user could have written (``file_trust``), and ``load_checkpoint``, in every
worker, checks it again before reading it.

A run that stops on purpose (a signal, a failed owner) saves what is committed without a
collective, since its groups may be gone: each worker writes the blocks the controller
assigned it (``save_part``) into ``step-<n>/rank-<r>/`` with a ``rank-<r>.json`` beside it
naming them, and the controller marks the step the latest once the parts hold every block
(``parts_complete``). ``load_checkpoint`` reads either layout; where a step has both (a stop
or a lost controller right after a save), the collective save, which holds every block. Which checkpoints exist
and which is complete is ``runtime.checkpoint_index``'s business (no torch needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from odyssey_megatron.config import ModelConfig
from odyssey_megatron.file_trust import check_private
from odyssey_megatron.blocks import StageSpec, stage_blocks, tensor_parallel_dim
from odyssey_megatron.hooks.training_state import STEP, TrainingState, empty_block
from odyssey_megatron.run_dir import fsync_directory, write_json
from odyssey_megatron.runtime.checkpoint_index import (
    checkpoint_directory,
    checkpoint_parts,
    holds_collective_save,
    mark_latest,
)

__all__ = ["load_checkpoint", "save_checkpoint", "save_part"]

def _key(tensor_key: str, block, *, tp_rank: int, tp_size: int) -> str:
    """The checkpoint key of one of a block's tensors (``export``'s key)."""
    if tensor_key == STEP:
        return f"{STEP}/{block}"
    name = tensor_key.partition("/")[2]
    sharded = tp_size > 1 and tensor_parallel_dim(name) is not None
    return f"{tensor_key}/tp{tp_rank}of{tp_size}" if sharded else tensor_key


def save_checkpoint(run_dir: Path, state: TrainingState, *, step: int, tp_rank: int, tp_size: int,
                    group: Optional[dist.ProcessGroup]) -> None:
    """Save this rank's blocks after ``step`` committed steps; collective over ``group``
    (every training rank). The group's first rank then marks it the latest."""
    directory = checkpoint_directory(run_dir, step)
    tensors = {_key(key, block, tp_rank=tp_rank, tp_size=tp_size): tensor
               for block in state.held() for key, tensor in state.export(block).items()}
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory, sync_files=True), process_group=group)
    if dist.get_rank(group) == 0:
        mark_latest(run_dir, step)


def save_part(run_dir: Path, state: TrainingState, blocks: list, *, step: int, rank: int, tp_rank: int,
              tp_size: int, model: ModelConfig) -> None:
    """Write ``blocks`` of this rank's ``state`` (each at ``step`` steps) as its part of the
    checkpoint of ``step``; no collective. The part's manifest comes last, so a part cut
    short is never read; it names the model's blocks too, so that whether the parts hold
    them all can be told without the recipe (``latest_checkpoint``)."""
    directory = checkpoint_directory(run_dir, step)
    tensors = {_key(key, block, tp_rank=tp_rank, tp_size=tp_size): tensor.detach().cpu()
               for block in blocks for key, tensor in state.export(block).items()}
    import torch.distributed.checkpoint as dcp

    part = directory / f"rank-{rank}"
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(part, sync_files=True), no_dist=True)
    fsync_directory(part)
    everything = stage_blocks(StageSpec((0, model.num_layers), first=True, last=True), tied=model.tie_embeddings)
    write_json(directory / f"rank-{rank}.json", {"step": step, "blocks": [str(b) for b in blocks],
                                                  "tp_rank": tp_rank, "tp_size": tp_size,
                                                  "model_blocks": [str(b) for b in everything]})


def load_checkpoint(directory: Path, *, run_dir: Path, model: ModelConfig, stage: StageSpec, tp_rank: int,
                    tp_size: int) -> TrainingState:
    """This rank's blocks of ``stage`` from a checkpoint ``save_checkpoint`` wrote, under
    any stage split; ValueError naming the block if the checkpoint lacks one or holds it in
    other shapes (another model). ``directory`` is checked first, up to ``run_dir``, as
    ``latest_checkpoint`` checks it (ConfigError from ``file_trust.check_private``): DCP
    unpickles what it reads, and the files may have changed since the controller looked."""
    check_private(directory, root=run_dir)
    import torch.distributed.checkpoint as dcp

    wanted = {block: empty_block(model, block, tp_size=tp_size, device=torch.device("cpu"))
              for block in stage_blocks(stage, tied=model.tie_embeddings)}
    tensors = {_key(key, block, tp_rank=tp_rank, tp_size=tp_size): tensor
               for block, held in wanted.items() for key, tensor in held.items()}
    sources = {directory: list(wanted)}
    parts = [] if holds_collective_save(directory) else checkpoint_parts(directory)
    if parts:  # a stopped run's parts: each block from the first part that holds it
        sources = {}
        for block in wanted:
            source = next((path for path, part in parts if str(block) in part["blocks"]
                           and part["tp_rank"] == tp_rank and part["tp_size"] == tp_size), None)
            if source is None:
                raise ValueError(f"checkpoint {directory} holds no part with block {block} (TP rank {tp_rank} of "
                                 f"{tp_size})")
            sources.setdefault(source, []).append(block)
    for source, blocks in sources.items():
        subset = {_key(key, block, tp_rank=tp_rank, tp_size=tp_size): wanted[block][key]
                  for block in blocks for key in wanted[block]}
        try:
            dcp.load(subset, checkpoint_id=str(source), no_dist=True)
        except Exception as exc:  # DCP reports missing keys and shape mismatches its own ways
            raise ValueError(f"checkpoint {directory} does not fit this model's stage {stage.layers}: "
                             f"{str(exc).splitlines()[0][:300]}") from None
    state = TrainingState()
    for block, held in wanted.items():
        state.receive(block, {key: tensors[_key(key, block, tp_rank=tp_rank, tp_size=tp_size)] for key in held})
    return state
