"""Build one stage of a Llama-style model on Megatron-Core's GPTModel.

A stage is a GPTModel holding its own layer range: ``pre_process`` on the first stage
(embedding), ``post_process`` on the last (final norm and output head), and as many
transformer layers as the plan gives it, so any uneven split works without Megatron's
global pipeline state. Which parameters a stage holds, their shapes and the dimension
TP splits each along are ``blocks``' geometry; this module builds them on Megatron-Core
(``tests/test_blocks.py`` checks the two agree). Parameters are initialised from one
source: every tensor of the *full* model is drawn from a generator seeded by the recipe
seed and the tensor's global name, and each rank keeps its slice (its layers, its TP
shard). The same layer is therefore identical on every pipeline and equal to a
single-process model's. The source can also be a whole-model state dict in global names
(an imported Hugging Face checkpoint, a run's final weights): ``stage_state_dict`` slices
it for a stage and TP rank, and ``merge_stage_state_dicts`` puts the stages' slices back
together.

Tied embeddings: a last stage that is not also the first keeps its own copy of the word
embeddings as ``output_layer.weight``, drawn from the embedding's source; the copies
belong to one sync unit, so their summed gradient is the tied gradient and Adam keeps
them equal.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer import TransformerConfig

from odyssey_megatron.blocks import EMBEDDING_WEIGHT, StageSpec, tensor_parallel_dim
from odyssey_megatron.blocks import OUTPUT_WEIGHT as TIED_OUTPUT
from odyssey_megatron.config import ModelConfig

INIT_STD = 0.02
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")


def transformer_config(model: ModelConfig, *, num_layers: int, tensor_parallel_size: int) -> TransformerConfig:
    """Llama: RMSNorm, SwiGLU, no biases, no dropout; Megatron does no initialisation
    (``init_stage_parameters`` does it from the one source)."""
    dtype = _DTYPES[model.params_dtype]
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.hidden_size // model.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,
        batch_p2p_comm=False,
        batch_p2p_sync=False,
        deallocate_pipeline_outputs=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        cuda_graph_scope=[],  # what the default "full" means, without Megatron's deprecation warning
    )


def build_stage_model(
    model: ModelConfig,
    stage: StageSpec,
    *,
    pg_collection: ProcessGroupCollection,
    seed: Optional[int] = None,
    weights: Optional[Mapping[str, torch.Tensor]] = None,
) -> GPTModel:
    """The GPTModel for ``stage`` with parameters from the one deterministic source:
    ``weights`` (a whole-model state dict in global names) when given, else drawn from ``seed``;
    with neither they are left uninitialised for the caller to load (``hooks.training_state``).
    Built under ``torch.device("meta")`` it only has shapes, and nothing is initialised.

    ``pg_collection.pp`` must be a size-1 group: the stage is a whole model to Megatron;
    the Odyssey executor, not Megatron's globals, moves activations between stages.
    """
    tp = pg_collection.tp.size()
    config = transformer_config(model, num_layers=stage.layers[1] - stage.layers[0], tensor_parallel_size=tp)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=stage.first,
        post_process=stage.last,
        parallel_output=False,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=model.rope_theta,
        pg_collection=pg_collection,
    )
    mark_tensor_parallel_weights(gpt)
    if weights is not None:
        load_stage_parameters(gpt, weights, stage=stage, tp_rank=pg_collection.tp.rank(), tp_size=tp)
    elif seed is not None:
        init_stage_parameters(gpt, stage=stage, seed=seed, tp_rank=pg_collection.tp.rank(), tp_size=tp)
    return gpt


def forget_stage_models() -> None:
    """Drop what Megatron-Core caches of the stage models built so far; call once a stage
    model is dropped. ``RotaryEmbedding.forward`` is an ``lru_cache`` (32 entries) keyed by
    its arguments, the module itself among them: without this each generation's rotary
    embedding, its tensors and its context-parallel group outlive the generation."""
    RotaryEmbedding.forward.cache_clear()


def mark_tensor_parallel_weights(gpt: torch.nn.Module) -> None:
    """Megatron tags a weight as TP-partitioned (and along which dim) only inside its own
    initialisation, which we skip; tag them from the layer types instead."""
    for module in gpt.modules():
        if getattr(module, "weight", None) is None:
            continue  # a tied output layer borrows the embedding's weight
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            set_tensor_model_parallel_attributes(module.weight, True, 0, 1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(module.weight, True, 1, 1)


def is_tied(gpt: torch.nn.Module) -> bool:
    return bool(getattr(gpt, "share_embeddings_and_output_weights", False))


def global_name(local_name: str, layer_offset: int, *, tied: bool = False) -> str:
    """``decoder.layers.3.x`` of a stage starting at layer 8 is ``decoder.layers.11.x``;
    with tied embeddings the last stage's output weight is the embedding."""
    if tied and local_name == TIED_OUTPUT:
        return EMBEDDING_WEIGHT
    return _LAYER_KEY.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", local_name)


def _full_shape(param: torch.nn.Parameter, tp_size: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


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


def init_stage_parameters(gpt: torch.nn.Module, *, stage: StageSpec, seed: int, tp_rank: int, tp_size: int) -> None:
    """Every parameter of ``gpt`` from ``initial_shard``."""
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            if param.is_meta:
                continue
            full_name = global_name(name, stage.layers[0], tied=is_tied(gpt))
            param.copy_(initial_shard(full_name, _full_shape(param, tp_size), seed=seed, tp_rank=tp_rank,
                                      tp_size=tp_size).to(param.dtype))


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


def load_stage_parameters(
    gpt: torch.nn.Module, full: Mapping[str, torch.Tensor], *, stage: StageSpec, tp_rank: int, tp_size: int
) -> None:
    """Copy the stage's slice of ``full`` into ``gpt``; every parameter must be there with its shape."""
    state = stage_state_dict(full, stage=stage, tp_rank=tp_rank, tp_size=tp_size, tied=is_tied(gpt))
    params = dict(gpt.named_parameters())
    if set(state) != set(params):
        missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(f"weights do not fit stage {stage}: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, param in params.items():
            if state[name].shape != param.shape:
                raise ValueError(f"weights: {name} has shape {tuple(state[name].shape)}, the stage needs {tuple(param.shape)}")
            param.copy_(state[name])


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
