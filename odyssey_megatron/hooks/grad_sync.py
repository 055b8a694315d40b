"""Layer-granular data-parallel gradient sync and the global gradient norm.

Every micro-batch's loss is scaled by 1 / (micro-batches in the whole step), so summing
a block's gradient over the workers that hold it gives exactly the single-process
gradient, whichever pipeline, stage or rerouting peer ran each micro-batch. Blocks held
by the same workers form a sync unit: one flattened SUM all-reduce per unit, in the
restorer's coloured rounds (a worker is in at most one unit per round, so the order of
collectives is the same on every member).
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch
import torch.distributed as dist

from odyssey_megatron.hooks.model import EMBEDDING_WEIGHT, StageSpec, global_name, is_tied
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import EMBEDDING, OUTPUT, Block

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def block_of(name: str, stage: StageSpec, *, tied: bool = False) -> Block:
    """The block a stage parameter belongs to (a tied output copy is the embedding)."""
    match = _LOCAL_LAYER.match(name)
    if match:
        return stage.layers[0] + int(match.group(1))
    if name.startswith("embedding.") or global_name(name, 0, tied=tied) == EMBEDDING_WEIGHT:
        return EMBEDDING
    if name.startswith("output_layer.") or name.startswith("decoder.final_layernorm."):
        return OUTPUT
    raise ValueError(f"parameter {name} belongs to no known block")


def parameters_by_block(model: torch.nn.Module, stage: StageSpec) -> dict[Block, list[torch.nn.Parameter]]:
    blocks: dict[Block, list[torch.nn.Parameter]] = defaultdict(list)
    for name, param in model.named_parameters():
        blocks[block_of(name, stage, tied=is_tied(model))].append(param)
    return dict(blocks)


class LayerGradSync:
    """All-reduces this rank's gradients unit by unit, round by round."""

    def __init__(
        self,
        *,
        plan: ExecutionPlan,
        worker: int,
        params: dict[Block, list[torch.nn.Parameter]],
        unit_groups: dict[int, dist.ProcessGroup],
    ):
        self._steps: list[tuple[dist.ProcessGroup, list[torch.nn.Parameter]]] = []
        for round_ in plan.comm_rounds:
            for index in round_:
                unit = plan.sync_units[index]
                if worker in unit.workers:
                    self._steps.append((unit_groups[index], [p for b in unit.blocks for p in params.get(b, [])]))

    def sync(self) -> None:
        """Call once per step, after the last backward and before the optimizer step."""
        for group, params in self._steps:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            offset = 0
            for param, grad in zip(params, grads):
                n = grad.numel()
                param.grad = flat[offset : offset + n].view_as(grad).clone()
                offset += n


def clip_grad_norm(
    *,
    plan: ExecutionPlan,
    worker: int,
    params: dict[Block, list[torch.nn.Parameter]],
    tp_rank: int,
    max_norm: float,
) -> float:
    """Clip every gradient by the global norm, counting each block once: the lowest worker
    holding a block contributes it, TP-sharded tensors from every TP rank, replicated ones
    (norms) from TP rank 0. Collective over the world; returns the norm before clipping."""
    owners = {b: min(unit.workers) for unit in plan.sync_units for b in unit.blocks}
    square = torch.zeros((), dtype=torch.float64)
    for block, tensors in params.items():
        if owners.get(block) != worker:
            continue
        for p in tensors:
            if p.grad is not None and (tp_rank == 0 or getattr(p, "tensor_model_parallel", False)):
                square += p.grad.double().pow(2).sum()
    dist.all_reduce(square, op=dist.ReduceOp.SUM)
    norm = float(square.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for tensors in params.values():
            for p in tensors:
                if p.grad is not None:
                    p.grad.mul_(scale)
    return norm
