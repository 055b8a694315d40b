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
no other user could have written (``file_trust``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from odyssey_megatron.config import ModelConfig
from odyssey_megatron.file_trust import check_private
from odyssey_megatron.hooks.model import StageSpec, tensor_parallel_dim
from odyssey_megatron.hooks.training_state import STEP, TrainingState, empty_block, stage_blocks
from odyssey_megatron.run_dir import fsync_directory, write_json

__all__ = ["CHECKPOINTS", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

CHECKPOINTS = "checkpoint"
_LATEST = "latest.json"


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
    directory = Path(run_dir) / CHECKPOINTS / f"step-{step}"
    tensors = {_key(key, block, tp_rank=tp_rank, tp_size=tp_size): tensor
               for block in state.held() for key, tensor in state.export(block).items()}
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory, sync_files=True), process_group=group)
    if dist.get_rank(group) == 0:
        for entries in (directory, directory.parent, Path(run_dir)):
            fsync_directory(entries)
        write_json(directory.parent / _LATEST, {"step": step, "path": directory.name})


def latest_checkpoint(run_dir: Path) -> Optional[tuple[int, Path]]:
    """The last complete checkpoint of ``run_dir``: (committed steps, directory), or None.
    ConfigError if another user could have written it (``file_trust.check_private``)."""
    latest = Path(run_dir) / CHECKPOINTS / _LATEST
    if not latest.is_file():
        return None
    marker = json.loads(latest.read_text())
    directory = latest.parent / marker["path"]
    check_private(directory, root=run_dir)
    return marker["step"], directory


def load_checkpoint(directory: Path, *, model: ModelConfig, stage: StageSpec, tp_rank: int,
                    tp_size: int) -> TrainingState:
    """This rank's blocks of ``stage`` from a checkpoint ``save_checkpoint`` wrote, under
    any stage split (``directory`` as ``latest_checkpoint`` checked it); ValueError naming
    the block if the checkpoint lacks one or holds it in other shapes (another model)."""
    import torch.distributed.checkpoint as dcp

    wanted = {block: empty_block(model, block, tp_size=tp_size, device=torch.device("cpu"))
              for block in stage_blocks(model, stage)}
    tensors = {_key(key, block, tp_rank=tp_rank, tp_size=tp_size): tensor
               for block, held in wanted.items() for key, tensor in held.items()}
    try:
        dcp.load(tensors, checkpoint_id=str(directory), no_dist=True)
    except Exception as exc:  # DCP reports missing keys and shape mismatches its own ways
        raise ValueError(f"checkpoint {directory} does not fit this model's stage {stage.layers}: "
                         f"{str(exc).splitlines()[0][:300]}") from None
    state = TrainingState()
    for block, held in wanted.items():
        state.receive(block, {key: tensors[_key(key, block, tp_rank=tp_rank, tp_size=tp_size)] for key in held})
    return state
