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

A run that stops on purpose (a signal, a failed owner) saves what is committed without a
collective, since its groups may be gone: each worker writes the blocks the controller
assigned it (``save_part``) into ``step-<n>/rank-<r>/`` with a ``rank-<r>.json`` beside it
naming them, and the controller marks the step the latest once the parts hold every block
(``parts_complete``). ``load_checkpoint`` reads either layout.
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

__all__ = ["CHECKPOINTS", "checkpoint_directory", "latest_checkpoint", "load_checkpoint", "mark_latest",
           "parts_complete", "save_checkpoint", "save_part"]

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
        mark_latest(run_dir, step)


def checkpoint_directory(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step}"


def mark_latest(run_dir: Path, step: int) -> None:
    """Name the checkpoint of ``step`` the one to resume from, once its files are durable."""
    directory = checkpoint_directory(run_dir, step)
    for entries in (directory, directory.parent, Path(run_dir)):
        fsync_directory(entries)
    write_json(directory.parent / _LATEST, {"step": step, "path": directory.name})


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
    everything = stage_blocks(model, StageSpec((0, model.num_layers), first=True, last=True))
    write_json(directory / f"rank-{rank}.json", {"step": step, "blocks": [str(b) for b in blocks],
                                                  "tp_rank": tp_rank, "tp_size": tp_size,
                                                  "model_blocks": [str(b) for b in everything]})


def _parts(directory: Path) -> list[tuple[Path, dict]]:
    """(part directory, manifest) of every part written under a checkpoint ``directory``."""
    return [(manifest.with_suffix(""), json.loads(manifest.read_text()))
            for manifest in sorted(directory.glob("rank-*.json"))]


def parts_complete(directory: Path, blocks: list, *, tp_size: int) -> list:
    """The blocks of ``blocks`` that no part under ``directory`` holds for some TP rank."""
    held = {(name, part["tp_rank"]) for _, part in _parts(directory) for name in part["blocks"]}
    return [b for b in blocks if any((str(b), k) not in held for k in range(tp_size))]


def latest_checkpoint(run_dir: Path) -> Optional[tuple[int, Path]]:
    """The last complete checkpoint of ``run_dir``: (committed steps, directory), or None:
    the one ``latest.json`` names, or a newer one whose parts hold every block (written by
    workers that lost the controller, which no one marked). ConfigError if another user
    could have written it (``file_trust.check_private``)."""
    found = []
    latest = Path(run_dir) / CHECKPOINTS / _LATEST
    if latest.is_file():
        marker = json.loads(latest.read_text())
        found.append((marker["step"], latest.parent / marker["path"]))
    for directory in sorted((Path(run_dir) / CHECKPOINTS).glob("step-*")):
        parts = [part for _, part in _parts(directory)]
        if parts and all("model_blocks" in part for part in parts):
            model_blocks = sorted({b for part in parts for b in part["model_blocks"]})
            if not parts_complete(directory, model_blocks, tp_size=parts[0]["tp_size"]):
                found.append((parts[0]["step"], directory))
    if not found:
        return None
    step, directory = max(found, key=lambda candidate: candidate[0])
    check_private(directory, root=run_dir)
    return step, directory


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
    sources = {directory: list(wanted)}
    parts = _parts(directory)
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
