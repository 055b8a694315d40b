"""Recipes a Megatron user already has (issue 17): Megatron-Bridge's ConfigContainer layout
with an ``odyssey:`` section plans unchanged, and as the odyssey-layout recipe it mirrors;
the data-parallel size comes from the world size; fixed choices are enums; and
``--print-config`` shows the resolved recipe.

Errors in a Bridge recipe must name the key as the user wrote it, so every mapped key is
tried with a bad value and the error's key must be the Bridge key, never ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from odyssey_megatron.bridge_recipe import KEYS
from odyssey_megatron.cli import main
from odyssey_megatron.config import (
    Device,
    DType,
    LengthSweep,
    ModelConfig,
    OdysseyConfig,
    Policy,
    load_config,
    load_recipe,
)
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.profile_file import optimizer_bytes_per_rank
from odyssey_megatron.simulator.scenario import FailureProcess, ScenarioConfig, System, WandbMode

REPO = Path(__file__).resolve().parents[1]
BRIDGE = REPO / "recipes/llama2_7b/bridge_tiny.yaml"
TINY = REPO / "recipes/llama2_7b/tiny_cpu.yaml"
IGNORED_SECTIONS = "sections checkpoint"


@pytest.fixture(autouse=True)
def no_launcher_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def plan_of(argv: list[str], capsys) -> dict:
    code, out, err = run(["plan", *argv, "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    return {key: plan[key] for key in ("policy", "pipelines", "reroutes", "transfers", "sync_units", "est_step_time_s")}


def bridge_recipe(tmp_path: Path, drop: tuple[str, ...] = (), **sections) -> Path:
    """bridge_tiny.yaml without the ``drop`` keys ("section.key") and with ``sections`` merged in."""
    recipe = yaml.safe_load(BRIDGE.read_text())
    for key in drop:
        section, _, name = key.partition(".")
        del recipe[section][name]
    for section, body in sections.items():
        recipe.setdefault(section, {}).update(body)
    path = tmp_path / "bridge.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_bridge_recipe_is_its_native_twin_and_plans_the_same(capsys):
    native = load_config(TINY, ["cluster.num_nodes=1", "logger.wandb_exp_name=bridge-tiny"])
    assert load_config(BRIDGE) == native
    assert native.parallel.data_parallel_size == 2 and native.model.params_dtype == DType.fp32
    for failed in (["--failed", "3"], ["--failed", "0,5"], []):
        assert plan_of(["--config", BRIDGE, *failed], capsys) == plan_of(["--config", TINY, *failed], capsys)


def test_overrides_use_the_files_layout(capsys):
    assert load_config(BRIDGE, ["train.micro_batch_size=1", "model.pipeline_model_parallel_size=2"]) == load_config(
        TINY, ["cluster.num_nodes=1", "logger.wandb_exp_name=bridge-tiny", "training.micro_batch_size=1",
               "parallel.pipeline_model_parallel_size=2", "parallel.data_parallel_size=4"])
    code, _, err = run(["plan", "--config", BRIDGE, "training.micro_batch_size=1"], capsys)
    assert code == 2 and err.startswith("odyssey: error: training: is the odyssey layout's section")


def _notes(path, overrides=()) -> list[str]:
    """The lines ``odyssey`` prints for a recipe it reads (none for the plugin's own layout)."""
    config, bridge = load_recipe(path, overrides)
    return [] if bridge is None else bridge.notes(optimizer_bytes_per_rank(config))


def test_the_ignored_sections_are_named_in_one_line(tmp_path):
    notes = _notes(BRIDGE) + _notes(TINY)
    assert len(notes) == 1
    assert IGNORED_SECTIONS in notes[0]
    # Named where they differ from Bridge's defaults; train.eval_interval is at its default.
    assert "keys dataset.num_workers, ddp.grad_reduce_in_fp32" in notes[0]
    assert "scheduler" not in notes[0] and "min_lr" not in notes[0]  # the learning-rate schedule is read
    assert notes[0].endswith("; 1 more field at its default")
    (note,) = _notes(bridge_recipe(tmp_path), ["ddp.grad_reduce_in_fp32=false", "profiling.use_nsys_profiler=false",
                                               "checkpoint.save=x"])
    assert "profiling" in note and note.count("checkpoint") == 1  # the file's and the overrides' sections, each once
    assert "ddp.grad_reduce_in_fp32" not in note  # the override put it back at its default


def test_a_process_prints_the_note_once_on_stderr_and_the_plan_on_stdout():
    done = subprocess.run([sys.executable, "-m", "odyssey_megatron.cli", "plan", "--config", str(BRIDGE), "--failed", "3"],
                          capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("\n") == 1 and IGNORED_SECTIONS in done.stderr
    assert done.stdout.startswith("after failure of ranks [3]:")


BAD_VALUES = {
    "model.tensor_model_parallel_size": "0", "model.pipeline_model_parallel_size": "-1", "model.num_layers": "0",
    "model.hidden_size": "65", "model.ffn_hidden_size": "0", "model.num_attention_heads": "0",
    "model.num_query_groups": "3", "model.vocab_size": "0", "model.seq_length": "0",
    "model.share_embeddings_and_output_weights": "maybe", "model.rotary_base": "0", "model.layernorm_epsilon": "-1",
    "train.global_batch_size": "15", "train.micro_batch_size": "0",
    "train.train_iters": "0", "optimizer.lr": "0", "optimizer.clip_grad": "-1",
    "optimizer.weight_decay": "-0.1", "optimizer.adam_beta1": "1", "optimizer.adam_beta2": "-0.5",
    "optimizer.adam_eps": "0", "rng.seed": "-1",
    "dataset.seq_length": "0", "dataset.sequence_length": "0", "dataset.data_path": "no/such/corpus",
    "dataset.path_to_cache": "[1]", "tokenizer.tokenizer_model": "no/such/tokenizer", "logger.wandb_project": "a/b",
    "logger.wandb_exp_name": "' '", "logger.wandb_entity": "[1]", "logger.wandb_save_dir": "' '",
    "logger.log_interval": "0",
    "model.spec": "gpt5", "optimizer.min_lr": "0.01", "scheduler.lr_warmup_iters": "-1",
    "scheduler.lr_warmup_fraction": "0.5", "scheduler.lr_warmup_init": "1", "scheduler.lr_decay_style": "exp",
    "scheduler.lr_decay_iters": "0", "scheduler.lr_wsd_decay_style": "step", "scheduler.lr_wsd_decay_iters": "0",
    "scheduler.start_weight_decay": "-1", "scheduler.end_weight_decay": "0.001",
    "scheduler.weight_decay_incr_style": "square",
}


def test_every_mapped_key_has_a_bad_value_case():
    assert set(BAD_VALUES) == set(KEYS)


@pytest.mark.parametrize("bridge_key", sorted(KEYS))
def test_an_error_names_the_bridge_key(bridge_key, tmp_path):
    drop = ("model.seq_length", "dataset.seq_length") if "seq" in bridge_key else ()
    with pytest.raises(ConfigError) as info:
        load_config(bridge_recipe(tmp_path, drop), [f"{bridge_key}={BAD_VALUES[bridge_key]}"])
    assert info.value.key == bridge_key, str(info.value)
    ours = KEYS[bridge_key]
    assert ours == bridge_key or ours not in str(info.value), str(info.value)


def test_errors_about_other_keys_use_bridge_names_too():
    with pytest.raises(ConfigError) as info:
        load_config(BRIDGE, ["train.micro_batch_size=3"])
    assert str(info.value) == "train.global_batch_size: must be divisible by train.micro_batch_size (3); got 16"


@pytest.mark.parametrize("override, message", [
    ("model.context_parallel_size=2", "model.context_parallel_size: must be 1 (Odyssey plans over TP x PP x DP); got 2"),
    ("model.sequence_parallel=true", "model.sequence_parallel: must be false"),
    ("model.normalization=LayerNorm", "model.normalization: must be RMSNorm"),
    ("optimizer.optimizer=sgd", "optimizer.optimizer: must be adam"),
    ("tokenizer.tokenizer_type=Llama2Tokenizer", "tokenizer.tokenizer_type: must be HuggingFaceTokenizer or NullTokenizer"),
    ("train.micro_batch_sise=2", "train.micro_batch_sise: unknown key: not fields of Megatron-Core"),
    ("model.tie_embeddings=true", "model.tie_embeddings: unknown key"),
    ("schedular.lr_warmup_iters=2", "schedular: unknown key"),
    ("odyssey.polcy=auto", "odyssey.polcy: unknown key; allowed here: batch_on_failure, checkpoint_interval, checkpoint_restart_penalty_s"),
    ("cluster.devices_per_nodes=8", "cluster.devices_per_nodes: unknown key"),
    ("dataset.seq_length=128", "dataset.seq_length: must agree with model.seq_length (64), which sets the same; got 128"),
    ("model.bf16=true", "model.bf16: must agree with model.params_dtype ('fp32')"),
    ("model.params_dtype=torch.float8_e4m3fn", "model.params_dtype: must be one of bf16, fp16, fp32 (Bridge writes"),
    ("model.seq_length=???", "model.seq_length: ??? is not a value"),
    ("train=3", "train: is a section and must be a mapping of its keys; got 3"),
])
def test_bridge_keys_the_plugin_cannot_run_or_does_not_know_are_errors(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(BRIDGE, [override])
    assert str(info.value).startswith(message), str(info.value)


def test_a_recipe_mixing_both_layouts_is_refused(tmp_path):
    path = tmp_path / "mixed.yaml"
    path.write_text("model:\n  tensor_model_parallel_size: 2\nparallel:\n  pipeline_model_parallel_size: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith("parallel: is the odyssey layout's section, but this recipe is Megatron-Bridge's "
                                      "(it has model.tensor_model_parallel_size)")


@pytest.mark.parametrize("precision, dtype", [
    ({"params_dtype": "torch.bfloat16"}, DType.bf16), ({"params_dtype": "bfloat16"}, DType.bf16),
    ({"params_dtype": {"_target_": "torch.bfloat16", "_call_": False}}, DType.bf16), ({"bf16": True}, DType.bf16),
    ({"params_dtype": "bf16", "bf16": True}, DType.bf16), ({"bf16": False}, DType.fp32),
])
def test_bridge_precision_spellings(precision, dtype, tmp_path):
    path = bridge_recipe(tmp_path, ("model.params_dtype",), model=precision)
    assert load_config(path).model.params_dtype is dtype


def test_both_precision_flags_on_is_an_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(bridge_recipe(tmp_path, ("model.params_dtype",), model={"bf16": True, "fp16": True}))
    assert info.value.key == "model.fp16" and "model.bf16" in str(info.value)


# The data-parallel size from the world size --------------------------------------------------

def test_dp_is_derived_from_the_world_size_as_megatron_does(monkeypatch):
    no_dp = ["parallel.data_parallel_size=null"]
    assert load_config(TINY, no_dp + ["cluster.num_nodes=2"]).parallel.data_parallel_size == 4
    assert load_config(TINY, no_dp + ["parallel.world_size=24", "training.global_batch_size=48"]
                       ).parallel.data_parallel_size == 6
    assert load_config(None).parallel.data_parallel_size == 1  # no world size: one process, as in Megatron
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert load_config(TINY, no_dp).parallel.data_parallel_size == 4
    assert load_config(TINY).parallel.data_parallel_size == 2  # given: the environment does not override it
    assert load_config(BRIDGE, ["cluster.num_nodes=null"]).parallel.data_parallel_size == 4


@pytest.mark.parametrize("overrides, env, message", [
    (["cluster.num_nodes=null"], None, "cluster.num_nodes: must be given to derive the data-parallel size"),
    (["model.pipeline_model_parallel_size=3"], None,
     "cluster.num_nodes: gives a world size of 8, which must be divisible by tensor_model_parallel_size * "
     "pipeline_model_parallel_size = 3"),
    (["cluster.num_nodes=null"], "6", "WORLD_SIZE: gives a world size of 6, which must be divisible"),
    (["cluster.num_nodes=null"], "eight", "WORLD_SIZE: must be a positive integer; got 'eight'"),
    (["cluster.num_nodes=null"], "0", "WORLD_SIZE: must be a positive integer; got '0'"),
])
def test_a_world_size_that_does_not_give_dp_is_one_line(overrides, env, message, monkeypatch):
    if env is not None:
        monkeypatch.setenv("WORLD_SIZE", env)
    with pytest.raises(ConfigError) as info:
        load_config(BRIDGE, overrides)
    assert str(info.value).startswith(message), str(info.value)


def test_a_given_dp_must_match_the_clusters_world_size():
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["cluster.num_nodes=2"])
    assert str(info.value).startswith("cluster.num_nodes: gives a world size of 16 (num_nodes * devices_per_node), "
                                      "but the layout")


# Enum fields -------------------------------------------------------------------------------------

def test_fixed_choices_are_enums_that_read_as_their_strings():
    config = load_config(TINY, ["odyssey.policy=reroute", "odyssey.length_sweep=never"])
    assert config.odyssey.policy is Policy.reroute and config.odyssey.length_sweep is LengthSweep.never
    assert config.cluster.device is Device["cpu"] and config.model.params_dtype is DType.fp32
    assert config.odyssey.policy == "reroute" and f"{config.odyssey.policy:>8}" == " reroute"
    assert json.dumps({config.odyssey.policy: config.cluster.device}) == '{"reroute": "cpu"}'
    assert ModelConfig(params_dtype="fp16").params_dtype is DType.fp16  # built in Python from a plain string
    assert ModelConfig(params_dtype="fp16").dtype_bytes == 2


def test_scenario_choices_are_enums():
    config = ScenarioConfig(systems=["odyssey", "checkpoint"], wandb_mode="disabled")
    assert config.systems == [System["odyssey"], System["checkpoint"]] and config.wandb_mode is WandbMode.disabled
    assert config.failures.process is FailureProcess.exponential


@pytest.mark.parametrize("build, message", [
    (lambda: OdysseyConfig(policy="sometimes"), "odyssey.policy: must be one of auto, reroute, reparallelize; got 'sometimes'"),
    (lambda: OdysseyConfig(length_sweep="often"), "odyssey.length_sweep: must be one of joins, always, never; got 'often'"),
    (lambda: OdysseyConfig(batch_on_failure="halve"), "odyssey.batch_on_failure: must be one of keep, shrink; got 'halve'"),
    (lambda: ModelConfig(params_dtype="fp8"), "model.params_dtype: must be one of bf16, fp16, fp32; got 'fp8'"),
    (lambda: ScenarioConfig(systems=["bamboo"]), "systems: must be one of odyssey, oobleck, recycle"),
])
def test_a_bad_choice_built_in_python_names_the_key_and_the_values(build, message):
    with pytest.raises(ConfigError) as info:
        build()
    assert str(info.value).startswith(message)


# --print-config ------------------------------------------------------------------------------------

def test_print_config_prints_the_resolved_recipe_which_loads_back_the_same(capsys, tmp_path):
    code, out, err = run(["plan", "--config", BRIDGE, "--print-config", "train.micro_batch_size=1"], capsys)
    assert code == 0 and err == ""
    printed = yaml.safe_load(out)
    assert printed["parallel"]["data_parallel_size"] == 2 and printed["training"]["micro_batch_size"] == 1
    assert printed["model"]["params_dtype"] == "fp32" and printed["odyssey"]["policy"] == "auto"
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(out)
    assert load_config(resolved) == load_config(BRIDGE, ["train.micro_batch_size=1"])


def test_print_config_on_simulate_prints_scenario_and_recipe_and_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(f"recipe: {BRIDGE}\nsystems: [odyssey, checkpoint]\nwandb_mode: disabled\n")
    code, out, _ = run(["simulate", "--scenario", "s.yaml", "--seed", "7", "--print-config"], capsys)
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["scenario"]["seed"] == 7 and printed["scenario"]["systems"] == ["odyssey", "checkpoint"]
    assert printed["recipe"]["parallel"]["data_parallel_size"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]


# Bridge's own output: ConfigContainer.to_yaml() dumps, both model layouts -------------------------

DUMPS = REPO / "tests/data/bridge"
FLAT, NESTED = DUMPS / "llama2_7b_pretrain.yaml", DUMPS / "llama2_7b_pretrain_nested.yaml"
HF_LLAMA2_7B = DUMPS / "llama2_7b_hf"
LAYOUTS = {FLAT: "model.", NESTED: "model.transformer."}
"""Each dump -> how it spells a TransformerConfig field."""


@pytest.mark.parametrize("dump", LAYOUTS, ids=["flat", "nested"])
def test_a_bridge_dump_of_llama2_7b_plans_with_its_shape(dump, capsys):
    config = load_config(dump)
    model = config.model
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads,
            model.num_query_groups, model.vocab_size, model.seq_length) == (32, 4096, 11008, 32, 32, 32000, 4096)
    assert not model.tie_embeddings and model.params_dtype is DType.bf16  # mixed_precision: bf16_mixed wins
    assert (config.training.adam_beta2, config.training.weight_decay) == (0.95, 0.1)  # Bridge's, not ours
    # DP from the world size: 4 nodes x 8 / (TP 2 x PP 1), then 2 nodes.
    assert (config.parallel.tensor_model_parallel_size, config.parallel.data_parallel_size) == (2, 16)
    assert load_config(dump, ["cluster.num_nodes=2"]).parallel.data_parallel_size == 8
    plan = plan_of(["--config", dump], capsys)
    assert plan["policy"] == "initial" and len(plan["pipelines"]) == 16


@pytest.mark.parametrize("dump", LAYOUTS, ids=["flat", "nested"])
@pytest.mark.parametrize("field, value, why", [
    ("num_moe_experts", "8", "mixture of experts"), ("moe_router_topk", "4", "mixture of experts"),
    ("fp8", "hybrid", "FP8/FP4 training"), ("fp8_param", "true", "FP8/FP4 training"),
    ("recompute_granularity", "full", "activation recomputation"), ("qk_layernorm", "true", "changes the layer"),
])
def test_a_dump_with_a_field_that_changes_what_runs_is_refused_naming_it(dump, field, value, why):
    key = f"{LAYOUTS[dump]}{field}"
    with pytest.raises(ConfigError) as info:
        load_config(dump, [f"{key}={value}"])
    assert info.value.key == key and why in info.value.problem, str(info.value)
    assert "leave it at Megatron-Core's default" in info.value.problem


def test_rope_scaling_and_a_head_size_that_is_not_llamas_are_refused():
    with pytest.raises(ConfigError, match=r"^model.rope_scaling: changes what runs .*a RoPE variant"):
        load_config(FLAT, ["model.rope_scaling=true"])
    with pytest.raises(ConfigError, match=r"^model.transformer.kv_channels: must be null or hidden_size / "
                                          r"num_attention_heads = 128"):
        load_config(NESTED, ["model.transformer.kv_channels=64"])


def test_all_unknown_keys_come_in_one_message():
    with pytest.raises(ConfigError) as info:
        load_config(NESTED, ["model.transformer.num_layer=3", "optimizer.adam_beta3=0.5", "schedular.x=1"])
    assert info.value.key == "schedular, model.transformer.num_layer, optimizer.adam_beta3"
    assert "did you mean: scheduler for schedular; model.num_layers for model.transformer.num_layer" in str(info.value)


OVERRIDE = {  # the shape of Bridge's Llama-3.2-1B tutorial override: no architecture, the Python recipe has it
    "dataset": {"seq_length": 4096}, "train": {"train_iters": 100, "global_batch_size": 8, "micro_batch_size": 1},
    "optimizer": {"lr": 3e-4, "min_lr": 3e-5}, "scheduler": {"lr_warmup_iters": 20},
    "model": {"seq_length": 4096, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 4,
              "context_parallel_size": 1},
    "rng": {"seed": 1234}, "cluster": {"device": "h100-80gb", "num_nodes": 1}, "odyssey": {"policy": "auto"},
}


def write(tmp_path: Path, recipe: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_an_override_file_without_architecture_is_refused_naming_what_is_missing(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, {**OVERRIDE, "mixed_precision": "bf16_mixed"}))
    assert info.value.key == ("model.num_layers, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads, "
                              "model.vocab_size, model.share_embeddings_and_output_weights")
    assert info.value.problem.startswith("missing: a Bridge YAML file alone does not carry")
    with pytest.raises(ConfigError, match=r"^mixed_precision: missing: Bridge's Python recipe sets it"):
        load_config(write(tmp_path, {**OVERRIDE, "model": {**OVERRIDE["model"], "hf_model_id": str(HF_LLAMA2_7B)}}))


@pytest.mark.parametrize("reference", [
    {"hf_model_id": str(HF_LLAMA2_7B)}, {"extra_checkpoint_metadata": {"hf_model_id": str(HF_LLAMA2_7B)}},
    {"spec": str(HF_LLAMA2_7B / "config.json")},
], ids=["hf_model_id", "extra_checkpoint_metadata", "spec"])
def test_an_override_file_with_a_hugging_face_config_plans_that_model(reference, tmp_path, capsys):
    path = write(tmp_path, {**OVERRIDE, "mixed_precision": "bf16_mixed", "model": {**OVERRIDE["model"], **reference}})
    model = load_config(path).model
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size, model.vocab_size) == (32, 4096, 11008, 32000)
    assert plan_of(["--config", path], capsys)["policy"] == "initial"


def test_a_hub_id_outside_the_local_cache_is_refused_since_nothing_is_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    path = write(tmp_path, {**OVERRIDE, "mixed_precision": "bf16_mixed",
                            "model": {**OVERRIDE["model"], "hf_model_id": "meta-llama/Llama-3.2-1B"}})
    with pytest.raises(ConfigError, match=r"^model.hf_model_id: meta-llama/Llama-3.2-1B is neither a local path nor"):
        load_config(path)


@pytest.mark.parametrize("precision, dtype", [("bf16_mixed", DType.bf16), ("bf16-mixed", DType.bf16), (None, DType.fp32)])
def test_mixed_precision_is_honoured(precision, dtype, tmp_path):
    recipe = yaml.safe_load(BRIDGE.read_text())
    del recipe["model"]["params_dtype"]
    config = load_config(write(tmp_path, {**recipe, "mixed_precision": precision}))
    assert config.model.params_dtype is dtype and config.model.dtype_bytes == (4 if dtype is DType.fp32 else 2)


@pytest.mark.parametrize("overrides, key", [
    (["mixed_precision=fp16_mixed"], "mixed_precision"),
    (["mixed_precision=null"], "model.fp16"),  # the dump's own model fields (fp16: true) decide then, as in Bridge
])
def test_fp16_is_refused_in_one_line_saying_why(overrides, key, capsys):
    code, out, err = run(["plan", "--config", FLAT, *overrides], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == f"odyssey: error: {key}: is fp16: fp16 training needs a loss scaler " \
        "(Megatron's DynamicGradScaler), which the plugin's training loop does not apply, so small gradients would " \
        "vanish; use bf16_mixed, or null for fp32"
    with pytest.raises(ConfigError, match=r"^mixed_precision: bf16_with_fp8_delayed_scaling_mixed trains with FP8"):
        load_config(FLAT, ["mixed_precision=bf16_with_fp8_delayed_scaling_mixed"])


NO_DISTRIBUTED_OPTIMIZER = ["optimizer.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=false"]


def test_bridges_distributed_optimizer_turns_on_the_sharded_state_and_agrees_with_the_odyssey_key():
    assert load_config(FLAT).odyssey.distributed_optimizer is True
    assert load_config(FLAT, NO_DISTRIBUTED_OPTIMIZER).odyssey.distributed_optimizer is False
    assert load_config(FLAT, ["odyssey.distributed_optimizer=true"]).odyssey.distributed_optimizer is True
    with pytest.raises(ConfigError, match=r"^odyssey.distributed_optimizer: must agree with "
                                          r"optimizer.use_distributed_optimizer \(true\), which sets the same"):
        load_config(FLAT, ["odyssey.distributed_optimizer=false"])


def test_the_live_run_keeps_a_full_optimizer_copy_and_says_so(caplog):
    from odyssey_megatron.runtime.train import as_trained

    with caplog.at_level("WARNING", logger="odyssey_megatron.runtime.train"):
        trained = as_trained(load_config(FLAT))
    assert trained.odyssey.distributed_optimizer is False and not trained.odyssey.staggered_optimizer
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.levelname == "WARNING"] == [
        "odyssey train: every rank keeps a full copy of its optimizer state"]


def test_the_sharded_optimizer_state_is_named_with_its_size_and_plans_a_layout_a_full_copy_does_not_fit(capsys):
    assert _notes(NESTED)[-1] == (
        "optimizer.use_distributed_optimizer: true shards the optimizer state (fp32 master weights and Adam moments) "
        "over the data-parallel peers, every part on 2 of them: 4.7 GiB per rank here instead of 37.7 GiB; plan "
        "and simulate price it, odyssey train does not run it yet")
    one_tp = ["plan", "--config", NESTED, "model.transformer.tensor_model_parallel_size=1"]
    code, _, err = run([*one_tp, *NO_DISTRIBUTED_OPTIMIZER], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "odyssey: error: model.transformer.pipeline_model_parallel_size: no split of 32 layers over 1 stages fits the "
        "memory budget of 76.0 GiB per device; each rank holds a full copy of the optimizer state (75.3 GiB; "
        "optimizer.use_distributed_optimizer: true would shard it); raise "
        "model.transformer.pipeline_model_parallel_size or model.transformer.tensor_model_parallel_size, or use "
        "devices with more memory")
    code, _, err = run([*one_tp, "odyssey.memory_budget_gib=40"], capsys)
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        "fits the memory budget of 40.0 GiB per device; each rank holds 4.7 GiB of optimizer state, sharded by "
        "optimizer.use_distributed_optimizer; raise model.transformer.pipeline_model_parallel_size or "
        "model.transformer.tensor_model_parallel_size, or use devices with more memory")
    code, out, err = run([*one_tp, "--json"], capsys)  # 32 DP peers keep 2/32 of it each: Bridge's layout fits
    assert code == 0, err
    plan = json.loads(out)
    peaks = [peak for stages in plan["est_peak_memory_bytes"] for peak in stages]
    assert len(peaks) == 32 and max(peaks) <= plan["memory_budget_bytes"]
    assert plan["est_param_gather_time_s"] > 0


def test_plan_on_a_dump_prints_its_answer_with_no_warning_lines_above_it():
    done = subprocess.run([sys.executable, "-m", "odyssey_megatron.cli", "plan", "--config", str(FLAT), "--failed", "3"],
                          capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert [line.split(":")[0] for line in lines] == ["Megatron-Bridge recipe", "optimizer.use_distributed_optimizer"]
    assert done.stdout.startswith("after failure of ranks [3]:")


def test_bridges_scheduler_section_and_min_lr_are_the_schedule_megatron_runs():
    """Bridge's Llama-2 7B dump: linear warmup over 2000 iterations from 0, cosine decay to
    optimizer.min_lr at train_iters, and the scheduler's weight decay (0.033), not the
    optimizer's (0.1), as Megatron's scheduler sets it every step."""
    for dump in (FLAT, NESTED):
        training = load_config(dump).training
        assert (training.lr, training.min_lr, training.lr_warmup_iters, training.lr_warmup_init) == (3e-4, 3e-5, 2000, 0.0)
        assert training.lr_decay_style == "cosine" and training.decay_iters == training.train_iters == 1168251
        assert training.weight_decay_range == (0.033, 0.033) and training.weight_decay_incr_style == "constant"


def test_a_scheduler_section_without_a_decay_style_decays_linearly_as_bridges_default(tmp_path):
    assert load_config(bridge_recipe(tmp_path, drop=("scheduler.lr_decay_style",))).training.lr_decay_style == "linear"
    assert load_config(TINY, ["training.lr_decay_style=constant"]).training.lr_decay_style == "constant"


def test_a_bad_scheduler_key_is_named_as_bridge_writes_it(tmp_path):
    with pytest.raises(ConfigError, match=r"^scheduler.lr_decay_style: must be one of constant, linear, cosine"):
        load_config(BRIDGE, ["scheduler.lr_decay_style=exp"])
    with pytest.raises(ConfigError, match=r"^scheduler.lr_warmup_iters: must be below scheduler.lr_decay_iters \(20"):
        load_config(BRIDGE, ["scheduler.lr_warmup_iters=20"])
    with pytest.raises(ConfigError, match=r"^scheduler.no_weight_decay_cond_type: changes what runs"):
        load_config(BRIDGE, ["scheduler.no_weight_decay_cond_type=apply_wd_to_qk_layernorm"])
