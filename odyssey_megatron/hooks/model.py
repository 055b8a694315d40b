"""Build one stage of a Llama-style model on Megatron-Core's GPTModel.

A stage is a GPTModel holding its own layer range: ``pre_process`` on the first stage
(embedding), ``post_process`` on the last (final norm and output head), and as many
transformer layers as the plan gives it, so any uneven split works without Megatron's
global pipeline state. Parameters are initialised from one source: every tensor of the
*full* model is drawn from a generator seeded by the recipe seed and the tensor's
global name, and each rank keeps its slice (its layers, its TP shard). The same layer is
therefore identical on every pipeline and equal to a single-process model's.

Tied embeddings: a last stage that is not also the first keeps its own copy of the word
embeddings as ``output_layer.weight``, drawn from the embedding's source; the copies
belong to one sync unit, so their summed gradient is the tied gradient and Adam keeps
them equal.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import torch
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

from odyssey_megatron.config import ModelConfig

INIT_STD = 0.02
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model a rank builds."""

    layers: tuple[int, int]
    """[start, end) of the transformer layers."""
    first: bool
    last: bool


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
    )


def build_stage_model(
    model: ModelConfig,
    stage: StageSpec,
    *,
    pg_collection: ProcessGroupCollection,
    seed: int,
) -> GPTModel:
    """The GPTModel for ``stage`` with parameters from the one deterministic source.

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
        pg_collection=pg_collection,
    )
    mark_tensor_parallel_weights(gpt)
    init_stage_parameters(gpt, stage=stage, seed=seed, tp_rank=pg_collection.tp.rank(), tp_size=tp)
    return gpt


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


TIED_OUTPUT = "output_layer.weight"
EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"


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


def _shard(full: torch.Tensor, param: torch.nn.Parameter, name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):
        # SwiGLU: the full weight is [gate; up]; each rank holds [gate shard; up shard].
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp_size, dim=dim)[tp_rank], up.chunk(tp_size, dim=dim)[tp_rank]], dim=dim)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def init_stage_parameters(gpt: torch.nn.Module, *, stage: StageSpec, seed: int, tp_rank: int, tp_size: int) -> None:
    """Norm weights 1; every other tensor N(0, INIT_STD) drawn for the full model from a
    generator seeded by (seed, global name), then sliced to this rank's shard."""
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            full_name = global_name(name, stage.layers[0], tied=is_tied(gpt))
            if "norm" in full_name and param.dim() == 1:
                param.fill_(1.0)
                continue
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{full_name}".encode()))
            full = torch.empty(_full_shape(param, tp_size), dtype=torch.float32)
            full.normal_(0.0, INIT_STD, generator=generator)
            param.copy_(_shard(full, param, name, tp_rank, tp_size).to(param.dtype))
