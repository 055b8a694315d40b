"""Full training checkpoints that load under any layout, for the run that cannot go on in
memory: when every replica of a block is lost, the run exits 3 and ``odyssey train
--resume RUN_DIR`` continues from the last one.

Every ``odyssey.checkpoint_interval`` committed steps the training ranks save their blocks
together with ``torch.distributed.checkpoint`` into ``RUN_DIR/checkpoint/step-<n>/``,
keyed by global parameter name (``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``,
``step/<block>``), so data-parallel replicas are written once and any stage split or
data-parallel degree reads back exactly the blocks it needs. A TP shard's key carries its
TP rank (``.../tp<k>of<n>``): a resume keeps the TP degree. ``latest.json``, written by
the save's coordinator once the step's files are complete, names the checkpoint to
resume from, so a save cut short by a failure is never read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from odyssey_megatron.config import ModelConfig
from odyssey_megatron.hooks.model import StageSpec, tensor_parallel_dim
from odyssey_megatron.hooks.training_state import STEP, TrainingState, empty_block, stage_blocks

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

    dcp.save(tensors, checkpoint_id=str(directory), process_group=group)
    if dist.get_rank(group) == 0:
        latest = Path(run_dir) / CHECKPOINTS / _LATEST
        partial = latest.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"step": step, "path": directory.name}))
        os.replace(partial, latest)


def latest_checkpoint(run_dir: Path) -> Optional[tuple[int, Path]]:
    """The last complete checkpoint of ``run_dir``: (committed steps, directory), or None."""
    latest = Path(run_dir) / CHECKPOINTS / _LATEST
    if not latest.is_file():
        return None
    marker = json.loads(latest.read_text())
    return marker["step"], latest.parent / marker["path"]


def load_checkpoint(directory: Path, *, model: ModelConfig, stage: StageSpec, tp_rank: int,
                    tp_size: int) -> TrainingState:
    """This rank's blocks of ``stage`` from a checkpoint ``save_checkpoint`` wrote, under
    any stage split; ValueError naming the block if the checkpoint lacks one or holds it
    in other shapes (another model)."""
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
