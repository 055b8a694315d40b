"""Full training checkpoints that load under any layout, for the run that cannot go on in
memory: when every replica of a block is lost, the run exits 3 and ``odyssey train
--resume RUN_DIR`` continues from the last one.

A checkpoint of step ``n`` is a set of parts in ``RUN_DIR/checkpoint/step-<n>/``, written
without a collective (the run's groups may be gone, or rebuilt, while one is written):
each is one worker's blocks, its TP shard, in a directory of its own written by
``torch.distributed.checkpoint`` (``no_dist``, each file fsynced), keyed by global
parameter name (``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``,
``step/<block>``), with a manifest beside it naming them, written last: a part cut short
has no manifest and is never read. A TP shard's key carries its TP rank
(``.../tp<k>of<n>``): a resume keeps the TP degree. The checkpoint is complete once its
parts hold every block (``parts_complete``); the controller then names it in
``latest.json``. Periodic checkpoints are written so by every ``odyssey.checkpoint_interval``
steps (``runtime.rank.checkpoint_writer``, in the background); a run that stops on purpose
(a signal, a failed owner) writes the blocks the controller assigned each worker.
``load_checkpoint`` also reads a single ``torch.distributed.checkpoint`` save of the whole
step directory (what earlier runs wrote). DCP unpickles a checkpoint's metadata, so
``latest_checkpoint`` hands out only one that no other user could have written
(``file_trust``), and ``load_checkpoint``, in every worker, checks it again before
reading it. Which checkpoints exist and which is complete is
``runtime.checkpoint_index``'s business (no torch needed).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from odyssey_megatron.config import ModelConfig
from odyssey_megatron.blocks import StageSpec, model_blocks, stage_blocks, tensor_parallel_dim
from odyssey_megatron.file_trust import check_private
from odyssey_megatron.hooks.training_state import STEP, TrainingState, empty_block
from odyssey_megatron.run_dir import fsync_directory, write_json
from odyssey_megatron.runtime.checkpoint_index import checkpoint_directory, checkpoint_parts, holds_collective_save

__all__ = ["load_checkpoint", "part_tensors", "save_part", "write_part", "write_tensors"]

def _key(tensor_key: str, block, *, tp_rank: int, tp_size: int) -> str:
    """The checkpoint key of one of a block's tensors (``export``'s key)."""
    if tensor_key == STEP:
        return f"{STEP}/{block}"
    name = tensor_key.partition("/")[2]
    sharded = tp_size > 1 and tensor_parallel_dim(name) is not None
    return f"{tensor_key}/tp{tp_rank}of{tp_size}" if sharded else tensor_key


def part_tensors(state: TrainingState, blocks: list, *, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """``blocks`` of ``state`` under their checkpoint keys: the held tensors themselves, not copies."""
    return {_key(key, block, tp_rank=tp_rank, tp_size=tp_size): tensor
            for block in blocks for key, tensor in state.export(block).items()}


def write_tensors(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Write ``tensors`` into ``directory`` with ``torch.distributed.checkpoint``, without a
    process group, each file and then the directory fsynced."""
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory, sync_files=True), no_dist=True)
    fsync_directory(directory)


def write_part(run_dir: Path, tensors: dict[str, torch.Tensor], blocks: list, *, step: int, part: str,
               tp_rank: int, tp_size: int, model: ModelConfig) -> None:
    """Write ``tensors`` (``part_tensors`` of ``blocks``, each at ``step`` steps, on the host)
    as the part named ``part`` of the checkpoint of ``step``; no collective. The manifest
    comes last, so a part cut short is never read, and goes first when a part of that name
    is written again (a resumed run reaching a step the run before it did not finish); it
    names the model's blocks too, so that whether the parts hold them all can be told
    without the recipe (``latest_checkpoint``)."""
    directory = checkpoint_directory(run_dir, step)
    manifest = directory / f"{part}.json"
    if manifest.exists():
        manifest.unlink()
        fsync_directory(directory)
    shutil.rmtree(directory / part, ignore_errors=True)
    write_tensors(tensors, directory / part)
    write_json(manifest, {"step": step, "blocks": [str(b) for b in blocks], "tp_rank": tp_rank, "tp_size": tp_size,
                          "model_blocks": [str(b) for b in model_blocks(model)]})


def save_part(run_dir: Path, state: TrainingState, blocks: list, *, step: int, rank: int, tp_rank: int,
              tp_size: int, model: ModelConfig, part: str | None = None) -> None:
    """Write ``blocks`` of this rank's ``state`` (each at ``step`` steps) as its part
    ``rank-<rank>`` (or ``part``, which must start so) of the checkpoint of ``step``, now (``write_part``)."""
    tensors = {key: tensor.detach().cpu() for key, tensor in
               part_tensors(state, blocks, tp_rank=tp_rank, tp_size=tp_size).items()}
    write_part(run_dir, tensors, blocks, step=step, part=part or f"rank-{rank}", tp_rank=tp_rank, tp_size=tp_size,
               model=model)


def load_checkpoint(directory: Path, *, run_dir: Path, model: ModelConfig, stage: StageSpec, tp_rank: int,
                    tp_size: int, device: torch.device) -> TrainingState:
    """This rank's blocks of ``stage`` from a checkpoint (its parts, or one DCP save: where a
    step holds both, the save, which holds every block), under any stage split, read into
    host memory and held on ``device`` (the rank's: a transfer may send them); ValueError
    naming the block if the checkpoint lacks one or holds it in other shapes (another
    model). ``directory`` is checked first, up to ``run_dir``, as ``latest_checkpoint``
    checks it (ConfigError from ``file_trust.check_private``): DCP unpickles what it reads,
    and the files may have changed since the controller looked."""
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
        state.receive_on(device, block, {key: tensors[_key(key, block, tp_rank=tp_rank, tp_size=tp_size)]
                                         for key in held})
    return state
