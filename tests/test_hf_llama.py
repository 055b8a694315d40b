"""Hugging Face Llama <-> Megatron-Core stages: shapes, weights, logits.

The logits invariant: a tiny random LlamaForCausalLM (fp32, GQA, non-default RoPE base
and RMSNorm epsilon, every weight and norm redrawn so a swapped tensor shows) and the
Megatron stages built from its checkpoint give the same logits on the same tokens, as one
full model, as an uneven two-stage chain and as TP=2 shards. Held to atol = rtol = 1e-4
on logits of mean magnitude ~1.3 (measured: at most 1.1e-5 apart, 7e-6 with TP=2): the two
sides sum in different orders (fused QKV and [gate; up] GEMMs, TP all-gathers), so they
agree to fp32 rounding, not bitwise; a wrong head order or RoPE convention is off by O(1).
Weight round trips are exact (torch.equal).
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from odyssey_megatron.config import ModelConfig, load_config
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.hooks.hf_llama import (
    hf_state_dict,
    load_hf_checkpoint,
    megatron_state_dict,
    save_hf_checkpoint,
)
from odyssey_megatron.blocks import StageSpec
from odyssey_megatron.hooks.global_weights import StageShard, merge_stage_state_dicts, stage_state_dict
from odyssey_megatron.testing.local_world import run_world
from odyssey_megatron.specs import MODEL_SPECS

pytestmark = pytest.mark.timeout(300)

LLAMA2_7B_PARAMETERS = 6_738_415_616
TOKENS = torch.tensor([[5, 17, 99, 3, 64, 127, 0, 42, 8, 8, 77, 31, 2, 90, 15, 60],
                       [1, 2, 3, 4, 5, 6, 7, 8, 120, 110, 100, 90, 80, 70, 60, 50]])
ATOL = RTOL = 1e-4


def tiny_llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama()


@pytest.fixture(scope="module")
def checkpoint(hf_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_tiny")
    hf_model.save_pretrained(directory)
    return directory


def _megatron_logits(rank: int, world_size: int, fields: dict, numpy_weights: dict) -> dict:
    """Rank 0: the 7B shape on the meta device, the full model, a [1, 2]-layer chain.
    Both ranks: the full model as TP=2 shards. The checkpoint is read once, by the parent
    (a rank reading it would import transformers only for that)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from odyssey_megatron.blocks import tensor_parallel_dim
    from odyssey_megatron.hooks.model import build_stage_model

    def groups(tp):
        own = singles[rank]
        return ProcessGroupCollection(tp=tp, cp=own, pp=own, ep=own, expt_dp=own, embd=None, pos_embd=None,
                                      dp=own, dp_cp=own)

    singles = [dist.new_group([r]) for r in range(world_size)]
    pair = dist.new_group(list(range(world_size)))
    model = ModelConfig(**fields)
    weights = {name: torch.from_numpy(array) for name, array in numpy_weights.items()}
    positions = torch.arange(TOKENS.shape[1]).unsqueeze(0).expand_as(TOKENS)
    n = model.num_layers
    out = {}
    with torch.no_grad():
        sharded = build_stage_model(model, StageSpec((0, n), True, True), pg_collection=groups(pair), seed=0,
                                    weights=weights)
        out["tp2"] = sharded(TOKENS, positions, None)
        out["tp_dims"] = {name: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None,
                                 tensor_parallel_dim(name)) for name, p in sharded.named_parameters()}
        if rank == 0:
            seven_b = ModelConfig(**MODEL_SPECS["llama2-7b"])
            with torch.device("meta"):
                meta = build_stage_model(seven_b, StageSpec((0, seven_b.num_layers), True, True),
                                         pg_collection=groups(singles[0]), seed=0)
            out["7b_parameters"] = sum(p.numel() for p in meta.parameters())
            out["7b_devices"] = sorted({p.device.type for p in meta.parameters()})
            full = build_stage_model(model, StageSpec((0, n), True, True), pg_collection=groups(singles[0]),
                                     seed=0, weights=weights)
            out["full"] = full(TOKENS, positions, None)
            first = build_stage_model(model, StageSpec((0, 1), True, False), pg_collection=groups(singles[0]),
                                      seed=0, weights=weights)
            last = build_stage_model(model, StageSpec((1, n), False, True), pg_collection=groups(singles[0]),
                                     seed=0, weights=weights)
            last.set_input_tensor(first(TOKENS, positions, None))
            out["chain"] = last(None, positions, None)
    return out


@pytest.fixture(scope="module")
def megatron_outputs(checkpoint):
    model, weights = load_hf_checkpoint(checkpoint)
    return run_world(_megatron_logits, 2, asdict(model), {name: t.numpy() for name, t in weights.items()})


def test_llama2_7b_builds_on_the_meta_device_with_the_published_parameter_count(megatron_outputs):
    assert megatron_outputs[0]["7b_parameters"] == LLAMA2_7B_PARAMETERS
    assert megatron_outputs[0]["7b_devices"] == ["meta"]


@pytest.mark.parametrize("layout", ["full", "chain", "tp2"])
def test_megatron_logits_equal_hugging_face_logits(hf_model, megatron_outputs, layout):
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
    assert expected.abs().mean() > 0.3, "logits large enough for the tolerance to mean something"
    ranks = megatron_outputs if layout == "tp2" else megatron_outputs[:1]
    for result in ranks:
        torch.testing.assert_close(torch.from_numpy(result[layout]), expected, atol=ATOL, rtol=RTOL)


def test_tensor_parallel_dims_by_name_match_megatron_layers(megatron_outputs):
    for name, (megatron_dim, by_name) in megatron_outputs[0]["tp_dims"].items():
        assert megatron_dim == by_name, name


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("splits, tp_size", [([(0, 3)], 1), ([(0, 1), (1, 3)], 2), ([(0, 2), (2, 3)], 2)])
def test_weights_round_trip_through_stage_shards_exactly(splits, tp_size, tie):
    hf = tiny_llama(tie).state_dict()
    model = ModelConfig(num_layers=3, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        vocab_size=128, seq_length=64, tie_embeddings=tie, params_dtype="fp32")
    full = megatron_state_dict(hf, model)
    shards = []
    for start, end in splits:
        stage = StageSpec((start, end), start == 0, end == model.num_layers)
        for tp_rank in range(tp_size):
            state = stage_state_dict(full, stage=stage, tp_rank=tp_rank, tp_size=tp_size, tied=tie)
            if tp_size > 1 and stage.first:
                assert state["embedding.word_embeddings.weight"].shape == (128 // tp_size, 32)
            shards.append(StageShard(stage, tp_rank, tp_size, state))
    back = hf_state_dict(merge_stage_state_dicts(shards, tied=tie), model)
    if tie:
        del hf["lm_head.weight"]  # transformers' state dict names the tied embedding twice
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_a_missing_tensor_parallel_shard_is_named():
    model = ModelConfig(num_layers=3, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        vocab_size=128, seq_length=64, params_dtype="fp32")
    full = megatron_state_dict(tiny_llama().state_dict(), model)
    stage = StageSpec((0, 3), True, True)
    only_rank_0 = [StageShard(stage, 0, 2, stage_state_dict(full, stage=stage, tp_rank=0, tp_size=2, tied=False))]
    with pytest.raises(ValueError, match=r"shards of TP ranks \[0\], need 0..1"):
        merge_stage_state_dicts(only_rank_0, tied=False)


def test_export_writes_a_checkpoint_transformers_loads(hf_model, checkpoint, tmp_path):
    from transformers import LlamaForCausalLM

    model, weights = load_hf_checkpoint(checkpoint)
    exported = LlamaForCausalLM.from_pretrained(save_hf_checkpoint(tmp_path / "export", model, weights)).eval()
    assert exported.config.rope_parameters["rope_theta"] == 500.0 and exported.config.rms_norm_eps == 1e-6
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    with torch.no_grad():
        assert torch.equal(exported(TOKENS).logits, hf_model(TOKENS).logits)


def test_recipe_model_spec_can_name_a_hugging_face_config(checkpoint, tmp_path):
    config = load_config(None, [f"model.spec={checkpoint}", "model.seq_length=16"]).model
    assert (config.num_layers, config.hidden_size, config.num_query_groups, config.seq_length) == (3, 32, 2, 16)
    assert (config.rope_theta, config.norm_epsilon, config.tie_embeddings) == (500.0, 1e-6, False)
    gpt2 = tmp_path / "config.json"
    gpt2.write_text(json.dumps({"model_type": "llama", "hidden_act": "gelu", "hidden_size": 64,
                                "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match=r"^model.spec: not a Llama the stage can build: hidden_act is 'gelu'"):
        load_config(None, [f"model.spec={gpt2}"])


def test_query_groups_default_to_the_head_count():
    model = load_config(None, ["model.num_attention_heads=40", "model.hidden_size=5120"]).model
    assert model.num_query_groups == 40
    assert load_config(None, ["model.spec=llama2-13b"]).model.num_query_groups == 40


def test_the_published_llama2_7b_config_maps_to_the_shipped_spec(tmp_path):
    from odyssey_megatron.specs.hf_config import read_model_fields

    # The config.json of meta-llama/Llama-2-7b-hf (transformers 4.31 era: top-level rope keys).
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
        "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 32000,
    }))
    assert read_model_fields(tmp_path) == MODEL_SPECS["llama2-7b"]
