"""Config validation and the `odyssey plan` command: one-line errors, exit codes, JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from odyssey_megatron.cli import main
from odyssey_megatron.config import load_config
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.plan import ExecutionPlan, validate_plan

RECIPE = "recipes/llama2_7b/ascend_910b_32.yaml"


@pytest.mark.parametrize(
    "override, key, allowed",
    [
        ("odyssey.polcy=auto", "odyssey.polcy", "unknown key; allowed here: batch_on_failure, checkpoint_interval, checkpoint_restart_penalty_s"),
        ("odyssey.policy=sometimes", "odyssey.policy", "must be one of auto, reroute, reparallelize"),
        ("model.num_layers=many", "model.num_layers", "expected int"),
        ("model.num_layers=-2", "model.num_layers", "must be > 0"),
        ("parallel.world_size=31", "parallel.world_size", "must equal tensor_model_parallel_size"),
        ("parallel.data_parallel_size=3", "training.global_batch_size", "micro_batch_size * parallel.data_parallel_size"),
        ("training.micro_batch_size=3", "training.global_batch_size", "divisible by training.micro_batch_size"),
        ("odyssey.memory_budget_gib=0", "odyssey.memory_budget_gib", "must be > 0"),
        ("parallel.pipeline_model_parallel_size=33", "parallel.pipeline_model_parallel_size", "<= model.num_layers"),
        ("model.spec=gpt5", "model.spec", "must be one of llama2-13b, llama2-70b, llama2-7b"),
        ("cluster.device=tpu", "cluster.device", "must be one of a100-80gb, ascend-910b, cpu, h100-80gb"),
        ("odyssey.learn_failure_rate=perhaps", "odyssey.learn_failure_rate", "expected bool"),
        ("nonsense", "nonsense", "an override must look like section.key=value"),
    ],
)
def test_bad_config_gives_one_line_naming_the_key(override, key, allowed, capsys):
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, [override])
    assert info.value.key == key
    assert allowed in str(info.value)
    assert main(["plan", "--config", RECIPE, override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"odyssey: error: {key}:")


def test_model_spec_fills_fields_and_recipe_values_win(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  spec: llama2-70b\n  num_layers: 40\n"
                      "parallel:\n  pipeline_model_parallel_size: 4\n  data_parallel_size: 1\n")
    config = load_config(recipe)
    assert (config.model.hidden_size, config.model.num_query_groups, config.model.num_layers) == (8192, 8, 40)
    assert load_config(recipe, ["model.num_layers=8"]).model.num_layers == 8


def test_missing_and_malformed_files(tmp_path, capsys):
    assert main(["plan", "--config", str(tmp_path / "absent.yaml")]) == 2
    assert "--config: no such file" in capsys.readouterr().err
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    assert main(["plan", "--config", str(listing)]) == 2
    assert "must hold a mapping" in capsys.readouterr().err


def test_failed_ranks_out_of_range(capsys):
    assert main(["plan", "--config", RECIPE, "--failed", "32"]) == 2
    assert "--failed: ranks must lie in 0..31" in capsys.readouterr().err
    assert main(["plan", "--config", RECIPE, "--failed-nodes", "4"]) == 2
    assert "--failed-nodes: nodes must lie in 0..3" in capsys.readouterr().err


def test_unrecoverable_exits_3(tmp_path, capsys):
    # Every rank but one fails and one device cannot hold Llama-2 7B.
    assert main(["plan", "--config", RECIPE, "--failed", ",".join(map(str, range(1, 32)))]) == 3
    assert capsys.readouterr().err.startswith("odyssey: unrecoverable:")


def test_plan_json_has_the_documented_fields(capsys):
    assert main(["plan", "--config", RECIPE, "--failed-nodes", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("policy", "pipelines", "est_step_time_s", "est_transition_s", "est_peak_memory_bytes",
                "transfers", "comm_rounds", "search_time_s", "candidates"):
        assert key in out
    assert out["policy"] == "reparallelize"  # a whole stage (node 1 = ranks 8-15) is gone: no peers
    stage = out["pipelines"][0]["stages"][0]
    assert set(stage) == {"worker", "layers"} and len(stage["layers"]) == 2
    assert sum(len(p["micro_batches"]) for p in out["pipelines"]) == 64
    assert [len(p["stages"]) for p in out["pipelines"]] == [len(m) for m in out["est_peak_memory_bytes"]]
    assert all(set(t) == {"layer", "src", "dst", "bytes"} for t in out["transfers"])
    assert not {t["dst"] for t in out["transfers"]} & set(range(8, 16))
    assert all(c["policy"] in ("reroute", "reparallelize") for c in out["candidates"])


def test_console_script_prints_a_plan_without_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "odyssey_megatron.cli", "plan", "--config", RECIPE, "--failed", "5"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "after failure of ranks [5]" in done.stdout and "search:" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "odyssey_megatron.cli", "plan", "--config", RECIPE, "odyssey.policy=x"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_plan_json_round_trips_through_execution_plan(capsys):
    from odyssey_megatron.decision_center import DecisionCenter

    center = DecisionCenter.from_recipe(load_config(RECIPE))
    center.on_failure(nodes=[1])
    again = ExecutionPlan.from_json(center.plan.to_json())
    assert again == center.plan
    validate_plan(again, num_micro_batches=64)
    for plan in (center.plan, center.on_failure(ranks=[3, 17]).chosen.plan):  # reroutes, then reparallelized
        columns = json.loads(json.dumps(plan.to_columns()))  # the wire form, as JSON carries it
        assert ExecutionPlan.from_columns(columns) == plan
    with pytest.raises(ValueError, match="cannot be cut"):
        ExecutionPlan.from_columns({**center.plan.to_columns(), "stage_counts": [1]})
