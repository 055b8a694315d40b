"""``final.pt``: the whole trained model as one unsharded state dict in global parameter
names, so two runs (one that lost ranks, one that did not) compare tensor by tensor.

At the end of a run each training rank writes its part under ``RUN_DIR/final/``: its TP
shard of the blocks of its stage that no worker before it in the plan holds, so each
replicated block is written once. The controller merges the parts of the last
generation's ranks into ``final.pt`` and removes them. Both are written whole or not at
all (``run_dir.write_atomically``): a crash leaves the earlier file or none, never half.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable

import torch

from odyssey_megatron.config import ModelConfig
from odyssey_megatron.blocks import StageSpec, stage_blocks
from odyssey_megatron.hooks.global_weights import StageShard, merge_stage_state_dicts
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.run_dir import write_atomically

__all__ = ["FINAL_MODEL", "merge_final_parts", "write_final_part"]

FINAL_MODEL = "final.pt"
_PARTS = "final"
_GLOBAL = StageSpec((0, 0), first=True, last=True)
"""Global names are the local names of a stage at layer offset 0."""


def _part_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / _PARTS / f"rank{rank}.pt"


def write_final_part(run_dir: Path, *, plan: ExecutionPlan, model: ModelConfig, worker: int, tp_rank: int,
                     state: TrainingState, rank: int) -> None:
    """Write this rank's part of ``final.pt``: the blocks its stage is first in the plan to hold."""
    earlier: set = set()
    for other in plan.workers:
        if other == worker:
            break
        earlier.update(stage_blocks(StageSpec.of_worker(plan, other), tied=model.tie_embeddings))
    params = {name: tensor.detach().cpu() for block, held in state.blocks.items() if block not in earlier
              for name, tensor in held.params.items()}
    path = _part_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = {"tp_rank": tp_rank, "tp_size": plan.tensor_parallel_size, "params": params}
    write_atomically(path, lambda out: torch.save(part, out))


def merge_final_parts(run_dir: Path, *, ranks: Iterable[int], tied: bool) -> Path:
    """Merge the parts ``ranks`` wrote into ``RUN_DIR/final.pt``; returns its path.
    ValueError if a part or a TP shard is missing."""
    shards = []
    for rank in ranks:
        path = _part_path(run_dir, rank)
        if not path.is_file():
            raise ValueError(f"rank {rank} wrote no part of the final model ({path})")
        part = torch.load(path, weights_only=True)
        shards.append(StageShard(_GLOBAL, part["tp_rank"], part["tp_size"], part["params"]))
    target = Path(run_dir) / FINAL_MODEL
    merged = merge_stage_state_dicts(shards, tied=tied)
    write_atomically(target, lambda out: torch.save(merged, out))
    shutil.rmtree(Path(run_dir) / _PARTS)
    return target
