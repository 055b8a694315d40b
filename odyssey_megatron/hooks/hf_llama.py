"""Hugging Face Llama <-> the Megatron-Core stages of ``hooks/model.py``.

The Megatron side is the whole-model state dict in global names with full (unsharded)
tensors, the form ``build_stage_model(weights=...)`` slices for any stage and TP rank and
``merge_stage_state_dicts`` rebuilds, so an import or export works for any plan. Names:

    model.embed_tokens                    embedding.word_embeddings
    model.layers.N.input_layernorm        decoder.layers.N.input_layernorm
    model.layers.N.self_attn.{q,k,v}_proj decoder.layers.N.self_attention.linear_qkv
    model.layers.N.self_attn.o_proj       decoder.layers.N.self_attention.linear_proj
    model.layers.N.post_attention_layernorm  decoder.layers.N.pre_mlp_layernorm
    model.layers.N.mlp.{gate,up}_proj     decoder.layers.N.mlp.linear_fc1 ([gate; up])
    model.layers.N.mlp.down_proj          decoder.layers.N.mlp.linear_fc2
    model.norm                            decoder.final_layernorm
    lm_head                               output_layer (absent when embeddings are tied)

Megatron's fused QKV is grouped by key/value head: for each of the ``num_query_groups``
groups, that group's query heads, then its key head, then its value head. TP then splits
whole groups, so a shard is a plain chunk. Both sides rotate with ``rotate_half`` over
the two halves of each head (HF Llama, Megatron's non-interleaved RoPE), so no query or key
permutation is needed; ``tests/test_hf_llama.py`` checks it on logits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from odyssey_megatron.config import ModelConfig
from odyssey_megatron.blocks import EMBEDDING_WEIGHT, FINAL_NORM
from odyssey_megatron.blocks import OUTPUT_WEIGHT as TIED_OUTPUT
from odyssey_megatron.specs.hf_config import HF_NAMES, read_model_fields

__all__ = ["hf_state_dict", "llama_config", "load_hf_checkpoint", "megatron_state_dict", "save_hf_checkpoint"]

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Per-layer tensors that map one to one.
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": EMBEDDING_WEIGHT, "model.norm.weight": FINAL_NORM,
                 "lm_head.weight": TIED_OUTPUT}


def llama_config(model: ModelConfig) -> Any:
    """The transformers ``LlamaConfig`` of ``model`` (the inverse of ``specs.hf_config.model_fields``)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **{theirs: getattr(model, ours) for ours, theirs in HF_NAMES.items()},
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        hidden_act="silu",
        dtype=_DTYPE_NAMES[model.params_dtype],
        architectures=["LlamaForCausalLM"],
    )


def _head_split(model: ModelConfig) -> tuple[int, int, int]:
    """(key/value groups, query heads per group, head dim)."""
    groups = model.num_query_groups
    return groups, model.num_attention_heads // groups, model.hidden_size // model.num_attention_heads


def megatron_state_dict(hf: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Llama weights -> the whole-model Megatron state dict in global names."""
    groups, per_group, head_dim = _head_split(model)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        if name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = tensor
            continue
        match = _HF_LAYER.match(name)
        if match is None:
            raise ValueError(f"unexpected Hugging Face weight {name!r}")
        layer, rest = match.groups()
        prefix = f"decoder.layers.{layer}."
        if rest in _LAYER_NAMES:
            out[prefix + _LAYER_NAMES[rest]] = tensor
        elif rest == "self_attn.q_proj.weight":
            hidden = tensor.shape[1]
            q = tensor.reshape(groups, per_group, head_dim, hidden)
            k = hf[f"model.layers.{layer}.self_attn.k_proj.weight"].reshape(groups, 1, head_dim, hidden)
            v = hf[f"model.layers.{layer}.self_attn.v_proj.weight"].reshape(groups, 1, head_dim, hidden)
            out[prefix + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, hidden)
        elif rest == "mlp.gate_proj.weight":
            up = hf[f"model.layers.{layer}.mlp.up_proj.weight"]
            out[prefix + "mlp.linear_fc1.weight"] = torch.cat([tensor, up], dim=0)
        elif rest not in ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight"):
            raise ValueError(f"unexpected Hugging Face weight {name!r}")
    if model.tie_embeddings:
        out.pop(TIED_OUTPUT, None)
    return out


def hf_state_dict(state: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole-model Megatron state dict in global names -> HF Llama weights."""
    groups, per_group, head_dim = _head_split(model)
    inverse_globals = {mg: hf for hf, mg in _GLOBAL_NAMES.items()}
    inverse_layers = {mg: hf for hf, mg in _LAYER_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in inverse_globals:
            out[inverse_globals[name]] = tensor
            continue
        match = _MG_LAYER.match(name)
        if match is None:
            raise ValueError(f"unexpected Megatron weight {name!r}")
        layer, rest = match.groups()
        prefix = f"model.layers.{layer}."
        if rest in inverse_layers:
            out[prefix + inverse_layers[rest]] = tensor
        elif rest == "self_attention.linear_qkv.weight":
            hidden = tensor.shape[1]
            q, k, v = tensor.reshape(groups, per_group + 2, head_dim, hidden).split([per_group, 1, 1], dim=1)
            out[prefix + "self_attn.q_proj.weight"] = q.reshape(-1, hidden).contiguous()
            out[prefix + "self_attn.k_proj.weight"] = k.reshape(-1, hidden).contiguous()
            out[prefix + "self_attn.v_proj.weight"] = v.reshape(-1, hidden).contiguous()
        elif rest == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2, dim=0)
            out[prefix + "mlp.gate_proj.weight"] = gate.contiguous()
            out[prefix + "mlp.up_proj.weight"] = up.contiguous()
        else:
            raise ValueError(f"unexpected Megatron weight {name!r}")
    return out


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = directory / WEIGHTS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    else:
        raise ValueError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX} in {directory}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(directory / file)))
    return weights


def load_hf_checkpoint(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A Hugging Face Llama checkpoint directory (config.json + safetensors) as a
    ``ModelConfig`` and the whole-model Megatron state dict, for ``build_stage_model(weights=...)``."""
    directory = Path(directory)
    weights = _read_safetensors(directory)
    dtypes = {tensor.dtype for tensor in weights.values()}
    dtype = next((name for name, value in _DTYPE_NAMES.items() if {getattr(torch, value)} == dtypes), "fp32")
    model = ModelConfig(**read_model_fields(directory), params_dtype=dtype)
    return model, megatron_state_dict(weights, model)


def save_hf_checkpoint(directory: str | Path, model: ModelConfig, state: Mapping[str, torch.Tensor]) -> Path:
    """Write ``state`` (the whole-model Megatron state dict in global names, e.g. a run's
    final weights) as a Hugging Face Llama checkpoint: config.json + model.safetensors,
    loadable with ``LlamaForCausalLM.from_pretrained(directory)``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    llama_config(model).save_pretrained(str(directory))
    hf = {name: tensor.detach().contiguous() for name, tensor in hf_state_dict(state, model).items()}
    save_file(hf, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory
