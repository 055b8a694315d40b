"""A model's weights in global names (a whole model's, at layer offset 0) and their parts:
which stage and TP rank holds which slice of which tensor, each tensor's one initial value,
and a whole state dict cut into a stage's slice (``stage_state_dict``) and put back
together from every slice (``merge_stage_state_dicts``). Plain torch on ``blocks``'
geometry, no Megatron-Core: node 0's process merges the final model with it, and never
imports Megatron-Core (seconds of CPU on every start)."""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import torch

from odyssey_megatron.blocks import EMBEDDING_WEIGHT, StageSpec, tensor_parallel_dim
from odyssey_megatron.blocks import OUTPUT_WEIGHT as TIED_OUTPUT

__all__ = ["INIT_STD", "StageShard", "global_name", "initial_shard", "merge_stage_state_dicts", "stage_state_dict"]

INIT_STD = 0.02
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_name(local_name: str, layer_offset: int, *, tied: bool = False) -> str:
    """``decoder.layers.3.x`` of a stage starting at layer 8 is ``decoder.layers.11.x``;
    with tied embeddings the last stage's output weight is the embedding."""
    if tied and local_name == TIED_OUTPUT:
        return EMBEDDING_WEIGHT
    return _LAYER_KEY.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", local_name)


def _shard(full: torch.Tensor, name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    dim = tensor_parallel_dim(name)
    if dim is None or tp_size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        # SwiGLU: the full weight is [gate; up]; each rank holds [gate shard; up shard].
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp_size, dim=dim)[tp_rank], up.chunk(tp_size, dim=dim)[tp_rank]], dim=dim)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def _unshard(shards: list[torch.Tensor], name: str) -> torch.Tensor:
    """The inverse of ``_shard`` over every TP rank's shard, in TP rank order."""
    dim = tensor_parallel_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [shard.chunk(2, dim=dim) for shard in shards]
        return torch.cat([torch.cat([g for g, _ in halves], dim=dim), torch.cat([u for _, u in halves], dim=dim)], dim=dim)
    return torch.cat(shards, dim=dim)


def initial_shard(full_name: str, full_shape: Sequence[int], *, seed: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The one source's initial value of a parameter, in fp32, sliced to a TP rank's shard:
    norm weights 1; every other tensor N(0, INIT_STD) drawn for the full model from a
    generator seeded by (seed, global name)."""
    if "norm" in full_name and len(full_shape) == 1:
        return torch.ones(tuple(full_shape), dtype=torch.float32)
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{full_name}".encode()))
    full = torch.empty(tuple(full_shape), dtype=torch.float32)
    full.normal_(0.0, INIT_STD, generator=generator)
    return _shard(full, full_name, tp_rank, tp_size)


def _local_name(full_name: str, stage: StageSpec) -> Optional[str]:
    """The stage's own name for a global parameter, or None if the stage does not hold it."""
    layer = _LAYER_KEY.match(full_name)
    if layer is not None:
        index = int(layer.group(1))
        if not stage.layers[0] <= index < stage.layers[1]:
            return None
        return _LAYER_KEY.sub(f"decoder.layers.{index - stage.layers[0]}.", full_name)
    if full_name.startswith("embedding."):
        return full_name if stage.first else None
    return full_name if stage.last else None


def stage_state_dict(
    full: Mapping[str, torch.Tensor], *, stage: StageSpec, tp_rank: int, tp_size: int, tied: bool
) -> dict[str, torch.Tensor]:
    """``stage``'s parameters (its names, this TP rank's shards) out of a whole-model state
    dict in global names. With tied embeddings a last stage that is not the first gets the
    embedding as its ``output_layer.weight``."""
    local = {}
    for full_name, tensor in full.items():
        name = _local_name(full_name, stage)
        if name is not None:
            local[name] = _shard(tensor, name, tp_rank, tp_size)
    if tied and stage.last and not stage.first:
        local[TIED_OUTPUT] = _shard(full[EMBEDDING_WEIGHT], TIED_OUTPUT, tp_rank, tp_size)
    return local


@dataclass(frozen=True)
class StageShard:
    """One rank's parameters: its stage, its TP rank, and its state dict in the stage's own names."""

    stage: StageSpec
    tp_rank: int
    tp_size: int
    state: Mapping[str, torch.Tensor]


def merge_stage_state_dicts(shards: Iterable[StageShard], *, tied: bool) -> dict[str, torch.Tensor]:
    """The whole-model state dict in global names from every stage's shards (the inverse of
    ``stage_state_dict``). Replicas (DP peers, a tied output copy) hold equal tensors; the
    first one seen is kept. Raises ValueError if a tensor lacks a TP rank's shard."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    sizes: dict[str, int] = {}
    for shard in shards:
        for name, tensor in shard.state.items():
            full_name = global_name(name, shard.stage.layers[0], tied=tied)
            pieces.setdefault(full_name, {}).setdefault(shard.tp_rank, tensor)
            sizes[full_name] = shard.tp_size if tensor_parallel_dim(full_name) is not None else 1
    full = {}
    for name, by_rank in pieces.items():
        if sizes[name] == 1:
            full[name] = by_rank[min(by_rank)]
            continue
        if sorted(by_rank) != list(range(sizes[name])):
            raise ValueError(f"{name}: shards of TP ranks {sorted(by_rank)}, need 0..{sizes[name] - 1}")
        full[name] = _unshard([by_rank[r] for r in range(sizes[name])], name)
    return full
