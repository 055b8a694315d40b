"""Profile files: a ModelProfile survives the JSON round trip exactly, ``odyssey.profile``
makes ``plan`` and ``simulate`` price plans with it, and a file measured for another
model, micro-batch size or TP size is refused with one line naming the key."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from odyssey_megatron.cli import main
from odyssey_megatron.config import load_config
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.profile_file import (
    check_output,
    profile_json,
    read_profile,
    recipe_measured_for,
    recipe_profile,
    write_profile,
)
from odyssey_megatron.simulator.scenario import load_scenario
from odyssey_megatron.units import GIB

TINY = "recipes/llama2_7b/tiny_cpu.yaml"


def measured_like(config, *, slower: float = 1.0):
    """The recipe's analytic profile with every compute time scaled and the fields only
    the profiler fills set, as a measured profile has them."""
    base = recipe_profile(config)
    scale = lambda block: replace(block, forward_s=block.forward_s * slower,  # noqa: E731
                                  backward_s=block.backward_s * slower, weight_grad_s=block.backward_s * slower / 3)
    return replace(base, layers=tuple(scale(b) for b in base.layers), embedding=scale(base.embedding),
                   output=scale(base.output), allreduce_bandwidth=3e8, allreduce_latency_s=2e-4, op_overhead_s=3e-5,
                   optimizer_s_per_param_byte=2e-10)


def write(path, profile, config) -> str:
    write_profile(path, profile_json(profile, measured_for=recipe_measured_for(config), source={"device": "test"}))
    return str(path)


def test_a_profile_survives_the_file_exactly(tmp_path):
    config = load_config(TINY)
    profile = measured_like(config, slower=7.0)
    loaded = read_profile(write(tmp_path / "p.json", profile, config), key="odyssey.profile")
    assert loaded.profile == profile
    assert loaded.measured_for == recipe_measured_for(config)
    assert loaded.source == {"device": "test"}


def test_a_version_1_file_still_loads_without_the_newer_terms(tmp_path):
    """Version 1 had no fixed cost per op and no optimizer cost: they load as nil, as its
    estimates assumed, and a version 1 file that names them is refused."""
    config = load_config(TINY)
    profile = measured_like(config)
    data = profile_json(profile, measured_for=recipe_measured_for(config), source={})
    old = {**data, "version": 1, "profile": {k: v for k, v in data["profile"].items()
                                             if k not in ("op_overhead_s", "optimizer_s_per_param_byte")}}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    assert read_profile(path, key="odyssey.profile").profile == replace(profile, op_overhead_s=0.0,
                                                                        optimizer_s_per_param_byte=0.0)
    path.write_text(json.dumps({**old, "profile": {**old["profile"], "op_overhead_s": 1e-5}}))
    with pytest.raises(ConfigError, match="profile.op_overhead_s is not a field of a version 1 profile"):
        read_profile(path, key="odyssey.profile")
    path.write_text(json.dumps({**data, "version": 3}))
    with pytest.raises(ConfigError, match="3 is not supported; this odyssey reads versions 1, 2"):
        read_profile(path, key="odyssey.profile")


def test_plan_and_simulate_price_with_the_file(tmp_path, capsys):
    config = load_config(TINY)
    path = write(tmp_path / "p.json", measured_like(config, slower=10.0), config)
    with_file = load_config(TINY, [f"odyssey.profile={path}"])
    assert recipe_profile(with_file) == read_profile(path, key="k").profile

    steps = {}
    for name, extra in (("analytic", []), ("file", [f"odyssey.profile={path}"])):
        assert main(["plan", "--config", TINY, "--failed", "3", "--json", *extra]) == 0
        steps[name] = json.loads(capsys.readouterr().out)["est_step_time_s"]
    assert steps["file"] > 5 * steps["analytic"]

    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"recipe: {TINY}\nrecipe_overrides: [odyssey.profile={path}]\nwandb_mode: disabled\n")
    assert load_scenario(scenario).profile == recipe_profile(with_file)


def test_the_recipe_memory_budget_replaces_the_file_one(tmp_path):
    config = load_config(TINY)
    path = write(tmp_path / "p.json", measured_like(config), config)
    budgeted = recipe_profile(load_config(TINY, [f"odyssey.profile={path}", "odyssey.memory_budget_gib=3"]))
    assert budgeted.memory_budget_bytes == 3 * GIB


@pytest.mark.parametrize("override, key", [
    ("model.num_layers=4", "model.num_layers"),
    ("model.hidden_size=128", "model.hidden_size"),
    ("training.micro_batch_size=1", "training.micro_batch_size"),
    ("model.params_dtype=bf16", "model.params_dtype"),
])
def test_a_profile_of_another_job_is_refused(tmp_path, override, key):
    config = load_config(TINY)
    path = write(tmp_path / "p.json", measured_like(config), config)
    other = load_config(TINY, [f"odyssey.profile={path}", override])
    with pytest.raises(ConfigError) as info:
        recipe_profile(other)
    assert info.value.key == "odyssey.profile"
    assert f"measured for {key}=" in str(info.value) and "\n" not in str(info.value)


def test_output_checks_refuse_what_they_would_destroy(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {}\n")
    with pytest.raises(ConfigError, match="exists"):
        check_output(recipe, key="--out", force=False)
    with pytest.raises(ConfigError, match="not a profile file"):
        check_output(recipe, key="--out", force=True)
    config = load_config(TINY)
    earlier = write(tmp_path / "p.json", measured_like(config), config)
    assert check_output(earlier, key="--out", force=True) == tmp_path / "p.json"
