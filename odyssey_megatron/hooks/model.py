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
(an imported Hugging Face checkpoint, a run's final weights), sliced for a stage and TP
rank by ``hooks.global_weights``, which also puts the slices back together.

Tied embeddings: a last stage that is not also the first keeps its own copy of the word
embeddings as ``output_layer.weight``, drawn from the embedding's source; the copies
belong to one sync unit, so their summed gradient is the tied gradient and Adam keeps
them equal.
"""

from __future__ import annotations

from typing import Mapping, Optional

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

from odyssey_megatron.blocks import StageSpec
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.hooks.global_weights import global_name, initial_shard, stage_state_dict

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def _full_shape(param: torch.nn.Parameter, tp_size: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


def init_stage_parameters(gpt: torch.nn.Module, *, stage: StageSpec, seed: int, tp_rank: int, tp_size: int) -> None:
    """Every parameter of ``gpt`` from ``initial_shard``."""
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            if param.is_meta:
                continue
            full_name = global_name(name, stage.layers[0], tied=is_tied(gpt))
            param.copy_(initial_shard(full_name, _full_shape(param, tp_size), seed=seed, tp_rank=tp_rank,
                                      tp_size=tp_size).to(param.dtype))


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
