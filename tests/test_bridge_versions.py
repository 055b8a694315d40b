"""Every field Bridge writes (issue 44): the ``to_yaml()`` dump of each Bridge version's Llama
pretraining recipe plans as written, each checked against the fields of that version's config
classes, and an unknown key names the version it was checked against.

The dumps are ``tests/data/bridge/`` (its README says how each was written from Bridge's
source). Bridge 0.6.0's dataset section carries fields Bridge's ``GPTDatasetConfig`` and
``DataloaderConfig`` add to Megatron-Core's (``drop_last``, ``per_dataset_sequences_path``, ...),
which a table of Bridge 0.3.1's names called unknown keys.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from odyssey_megatron.bridge_fields import closest_version
from odyssey_megatron.cli import main
from odyssey_megatron.config import DType, load_config, load_recipe
from odyssey_megatron.errors import ConfigError

DUMPS = Path(__file__).resolve().parent / "data/bridge"
LLAMA2_7B = {"0.3.1": DUMPS / "llama2_7b_pretrain.yaml", "0.6.0": DUMPS / "llama2_7b_pretrain_2gpu_h100_bf16.yaml"}
"""Bridge version -> its Llama-2 7B pretraining recipe's dump (0.6.0: recipes/llama/h100/)."""


@pytest.fixture(autouse=True)
def no_launcher_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("version", LLAMA2_7B)
def test_each_versions_llama2_7b_dump_plans_as_written_read_as_that_version(version, capsys):
    config, bridge = load_recipe(LLAMA2_7B[version])
    assert bridge is not None and bridge.bridge_version == version
    model = config.model
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads, model.vocab_size,
            model.seq_length, model.params_dtype) == (32, 4096, 11008, 32, 32000, 4096, DType.bf16)
    assert (config.parallel.tensor_model_parallel_size, config.parallel.data_parallel_size) == (2, 16)
    assert main(["plan", "--config", str(LLAMA2_7B[version])]) == 0
    out, _ = capsys.readouterr()
    assert "layout [32]x16" in out


def test_the_060_dump_carries_the_dataset_fields_bridge_adds_to_megatron_cores():
    dataset = yaml.safe_load(LLAMA2_7B["0.6.0"].read_text())["dataset"]
    assert {"drop_last", "per_dataset_sequences_path", "seq_length", "data_path"} <= set(dataset)
    assert "sequence_length" not in dataset  # 0.6.0's GPTDatasetConfig.to_cfg_dict leaves Megatron-Core's copy out


@pytest.mark.parametrize("version, override", [
    ("0.3.1", "dataset.drop_lst=true"), ("0.6.0", "dataset.drop_lst=true"),
    ("0.6.0", "validation.eval_iterz=3"), ("0.3.1", "checkpoint.sav=x"),
])
def test_an_unknown_key_names_the_bridge_version_it_was_checked_against(version, override):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config(LLAMA2_7B[version], [override])
    assert info.value.key == key
    assert f"nor of Megatron-Bridge {version}'s config classes" in info.value.problem
    assert "\n" not in str(info.value)


def test_a_field_of_a_later_bridge_is_unknown_in_a_recipe_of_an_earlier_one():
    # DataloaderConfig.drop_last came with Bridge 0.4: the rest of this dump is 0.3.1's, so it is read as 0.3.1.
    with pytest.raises(ConfigError, match=r"^dataset.drop_last: unknown key: .* Megatron-Bridge 0\.3\.1's config"):
        load_config(LLAMA2_7B["0.3.1"], ["dataset.drop_last=true"])
    assert load_config(LLAMA2_7B["0.6.0"], ["dataset.drop_last=false"]).model.num_layers == 32


def test_keys_of_the_sections_the_plugin_does_not_use_are_checked_too():
    with pytest.raises(ConfigError) as info:
        load_config(LLAMA2_7B["0.6.0"], ["checkpoint.save_intervl=5", "profiling.use_nsys_profiler=true"])
    assert info.value.key == "checkpoint.save_intervl"
    assert "did you mean: checkpoint.save_interval for checkpoint.save_intervl" in info.value.problem


@pytest.mark.parametrize("override, message", [
    ("model.context_parallel_size=2", r"^model.context_parallel_size: must be 1 \(Odyssey plans over TP x PP x DP\)"),
    ("model.virtual_pipeline_model_parallel_size=5", r"^model.virtual_pipeline_model_parallel_size: must be null"),
    ("model.rope_scaling=true", r"^model.rope_scaling: changes what runs .*a RoPE variant"),
    ("mixed_precision=bf16_with_fp8_current_scaling_mixed", r"^mixed_precision: .* trains with FP8/FP4"),
], ids=["llama3-8b context parallel", "llama3-70b interleaved", "llama3.1/3.2 rope scaling", "llama3-8b fp8"])
def test_what_bridges_other_llama_pretraining_recipes_set_is_refused_naming_the_field(override, message):
    # Each is one setting of a Llama-3 recipe of 0.6.0's recipes/llama/h100/llama3.py, put on the Llama-2 dump.
    with pytest.raises(ConfigError, match=message):
        load_config(LLAMA2_7B["0.6.0"], [override])


def test_a_recipe_is_read_as_the_oldest_version_that_knows_all_its_keys_else_the_one_knowing_most():
    assert closest_version(["train.train_iters", "rng.seed", "dataset.num_workers"]) == ("0.3.1", [])
    assert closest_version(["dataset.drop_last", "validation.eval_iters"]) == ("0.6.0", [])
    assert closest_version(["tokenizer.legacy_tokenizer", "dist.lazy_init", "train.eval_itrs"]) == (
        "0.3.1", ["train.eval_itrs"])
    # One unknown key each way: the newer version is named.
    assert closest_version(["dataset.drop_last", "dist.lazy_init"]) == ("0.6.0", ["dist.lazy_init"])


def test_a_mixed_precision_config_written_out_is_read_and_its_keys_checked(tmp_path):
    # A recipe that set a MixedPrecisionConfig (the low-precision ones do) dumps it field by field.
    recipe = yaml.safe_load(LLAMA2_7B["0.6.0"].read_text())
    recipe["mixed_precision"] = {"_target_": "megatron.bridge.training.mixed_precision.MixedPrecisionConfig",
                                 "bf16": True, "fp4_param_gather": False, "grad_reduce_in_fp32": True}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert load_config(path).model.params_dtype is DType.bf16
    with pytest.raises(ConfigError, match=r"^mixed_precision.fp8_recpe: unknown key: .* Megatron-Bridge 0\.6\.0's"):
        load_config(path, ["mixed_precision.fp8_recpe=tensorwise"])
