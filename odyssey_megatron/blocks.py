"""Block geometry: which blocks of the model a stage holds, which parameters each block
has and what one block's state weighs, from the model config alone.

A *block* is a unit of parameters that moves and syncs as a whole: transformer layer
``i`` (an int), the input ``"embedding"`` and the ``"output"`` block (final norm and
output projection). Blocks are keys in checkpoints, snapshots, transfers and the wire
protocol. A stage holds the embedding if it is first, its layers, and the output block if
it is last; with tied embeddings a last stage also holds the embedding (its output
projection is a copy of the word embeddings, in the same sync unit).

Everything here is arithmetic on names and shapes, with no torch and no Megatron, so the
planner, the estimator, the restorer and the snapshots' shares use the very geometry the
Megatron stages are built with (``hooks.model.build_stage_model``; its parameters are
these, ``tests/test_blocks.py`` checks it on real stages).

A block's state, as a transfer sends it or a snapshot or checkpoint holds it
(``hooks.training_state``): per parameter its fp32 weights (``param/<global name>``) and
Adam's two fp32 moments (``exp_avg/``, ``exp_avg_sq/``), each one TP shard, and one int64
``step``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Union

from odyssey_megatron.config import ModelConfig

__all__ = [
    "Block", "EMBEDDING", "OUTPUT", "StageSpec", "block_bytes", "block_of_parameter", "block_sort_key",
    "model_blocks", "shard_shapes", "stage_blocks", "stage_parameter_shapes", "state_entries",
    "tensor_parallel_dim", "worker_blocks",
]

Block = Union[int, str]
EMBEDDING = "embedding"
OUTPUT = "output"

EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_WEIGHT = "output_layer.weight"
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.")

# The dimension Megatron's parallel layers split across TP ranks, by parameter name suffix:
# ColumnParallelLinear and VocabParallelEmbedding split outputs (0), RowParallelLinear
# inputs (1); norms are replicated.
_TP_DIM = {
    "word_embeddings.weight": 0,
    "linear_qkv.weight": 0,
    "linear_fc1.weight": 0,
    "output_layer.weight": 0,
    "linear_proj.weight": 1,
    "linear_fc2.weight": 1,
}

PARAM, EXP_AVG, EXP_AVG_SQ, STEP = "param", "exp_avg", "exp_avg_sq", "step"
STATE_KINDS = (PARAM, EXP_AVG, EXP_AVG_SQ)
"""The fp32 tensors a block's state holds per parameter."""
_ITEM_BYTES = {"float32": 4, "int64": 8}


def block_sort_key(block: Block) -> tuple[int, int]:
    """Model order: embedding, layers 0..L-1, output."""
    if block == EMBEDDING:
        return (0, 0)
    if block == OUTPUT:
        return (2, 0)
    return (1, int(block))


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model a rank builds."""

    layers: tuple[int, int]
    """[start, end) of the transformer layers."""
    first: bool
    last: bool

    @classmethod
    def of_worker(cls, plan, worker: int) -> "StageSpec":
        """The stage ``worker`` runs under ``plan`` (an ``ExecutionPlan``); ValueError if it runs none."""
        for pi, si, stage in plan.stage_positions():
            if stage.worker == worker:
                return cls(stage.layers, first=si == 0, last=si == plan.pipelines[pi].num_stages - 1)
        raise ValueError(f"worker {worker} owns no stage in plan generation {plan.generation}")


def stage_blocks(stage: StageSpec, *, tied: bool) -> list[Block]:
    """The blocks a rank of ``stage`` holds, in model order (a tied last stage holds the embedding)."""
    blocks: list[Block] = []
    if stage.first or (stage.last and tied):
        blocks.append(EMBEDDING)
    blocks.extend(range(*stage.layers))
    if stage.last:
        blocks.append(OUTPUT)
    return blocks


def model_blocks(model) -> list[Block]:
    """Every block of ``model`` (a ``ModelConfig``), in model order: what a complete checkpoint holds."""
    return stage_blocks(StageSpec((0, model.num_layers), first=True, last=True), tied=model.tie_embeddings)


def worker_blocks(plan, worker: int, *, tied: bool) -> list[Block]:
    """The blocks ``worker`` trains under ``plan`` (an ``ExecutionPlan``): its stage's, or
    none if it runs no stage."""
    return stage_blocks(StageSpec.of_worker(plan, worker), tied=tied) if worker in plan.workers else []


def _block_parameter_shapes(model: ModelConfig, block: Block) -> dict[str, tuple[int, ...]]:
    """Global name -> full (unsharded) shape of ``block``'s parameters (Llama on Megatron's
    local spec: RMSNorm weights, fused QKV, SwiGLU's [gate; up], no biases); empty if
    ``block`` is no block of the model."""
    hidden = model.hidden_size
    if block == EMBEDDING:
        return {EMBEDDING_WEIGHT: (model.vocab_size, hidden)}
    if block == OUTPUT:
        return {FINAL_NORM: (hidden,), **({} if model.tie_embeddings else {OUTPUT_WEIGHT: (model.vocab_size, hidden)})}
    if not isinstance(block, int) or not 0 <= block < model.num_layers:
        return {}
    heads, groups = model.num_attention_heads, model.num_query_groups
    head_dim = hidden // heads
    layer = {
        "input_layernorm.weight": (hidden,),
        "self_attention.linear_qkv.weight": ((heads + 2 * groups) * head_dim, hidden),
        "self_attention.linear_proj.weight": (hidden, heads * head_dim),
        "pre_mlp_layernorm.weight": (hidden,),
        "mlp.linear_fc1.weight": (2 * model.ffn_hidden_size, hidden),
        "mlp.linear_fc2.weight": (hidden, model.ffn_hidden_size),
    }
    return {f"decoder.layers.{block}.{name}": shape for name, shape in layer.items()}


def stage_parameter_shapes(model: ModelConfig, stage: StageSpec) -> dict[str, tuple[int, ...]]:
    """Global name -> full (unsharded) shape of every parameter ``stage`` holds: its
    blocks' (a tied copy of the embedding is the embedding)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for block in stage_blocks(stage, tied=model.tie_embeddings):
        shapes.update(_block_parameter_shapes(model, block))
    return shapes


def block_of_parameter(name: str) -> Block:
    """The block a parameter belongs to, by its global name."""
    layer = _LAYER_NAME.match(name)
    if layer:
        return int(layer.group(1))
    if name.startswith("embedding."):
        return EMBEDDING
    if name.startswith("output_layer.") or name.startswith("decoder.final_layernorm."):
        return OUTPUT
    raise ValueError(f"parameter {name} belongs to no known block")


def tensor_parallel_dim(name: str) -> Optional[int]:
    """The dimension TP splits the parameter called ``name`` along; None if replicated."""
    return next((dim for suffix, dim in _TP_DIM.items() if name.endswith(suffix)), None)


def shard_shapes(model: ModelConfig, block: Block, *, tp_size: int) -> dict[str, tuple[int, ...]]:
    """Global name -> shape of one TP shard of each of ``block``'s parameters (every TP
    rank's shard has the same shape), by name. ValueError if ``block`` is no block of the
    model or ``tp_size`` does not divide a split dimension."""
    shapes = {}
    for name, full in sorted(_block_parameter_shapes(model, block).items()):
        shape, dim = list(full), tensor_parallel_dim(name)
        if dim is not None:
            if shape[dim] % tp_size:
                raise ValueError(f"tp_size {tp_size}: does not divide dim {dim} ({shape[dim]}) of {name}")
            shape[dim] //= tp_size
        shapes[name] = tuple(shape)
    if not shapes:
        raise ValueError(f"block {block!r} is not a block of a {model.num_layers}-layer model")
    return shapes


def state_entries(model: ModelConfig, block: Block, *, tp_size: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, dtype name, shape) of every tensor of one TP shard of ``block``'s state, in one
    fixed order: kinds, then parameter names, then the step. Senders and receivers of a
    transfer, snapshot writers and readers all lay a block out by it."""
    shapes = shard_shapes(model, block, tp_size=tp_size)
    entries = [(f"{kind}/{name}", "float32", shape) for kind in STATE_KINDS for name, shape in shapes.items()]
    return [*entries, (STEP, "int64", ())]


def block_bytes(model: ModelConfig, block: Block, tp_size: int) -> int:
    """Bytes of one TP shard of ``block``'s state as a transfer sends it and a snapshot holds it."""
    return sum(math.prod(shape) * _ITEM_BYTES[dtype] for _, dtype, shape in state_entries(model, block, tp_size=tp_size))
