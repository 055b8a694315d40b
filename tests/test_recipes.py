"""The shipped Llama-2 7B recipes: each is the layout it says, fits the memory estimator on
its devices, and has a plan for a failure; the NPU extra pins the torch_npu built for the
pinned torch."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.estimator import estimate_plan

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {  # file: (device, TP, PP, DP)
    "gpu_h100_8.yaml": ("h100-80gb", 1, 2, 4),
    "gpu_a100_32.yaml": ("a100-80gb", 1, 4, 8),
    "ascend_910b_8.yaml": ("ascend-910b", 1, 4, 2),  # the paper's 8-NPU layout (PP, DP, TP) = (4, 2, 1)
    "ascend_910b_32.yaml": ("ascend-910b", 1, 4, 8),
    "ascend_910b_32_tp8.yaml": ("ascend-910b", 8, 2, 2),  # the paper's 32-NPU layout (2, 2, 8)
}


def test_every_7b_recipe_is_listed():
    shipped = {p.name for p in (ROOT / "recipes" / "llama2_7b").glob("*.yaml")}
    assert shipped - {"tiny_cpu.yaml", "bridge_tiny.yaml"} == set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_7b_recipe_fits_its_devices_and_survives_a_failure(name):
    config = load_config(ROOT / "recipes" / "llama2_7b" / name, [])
    device, tp, pp, dp = RECIPES[name]
    par = config.parallel
    assert (config.cluster.device, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
            par.data_parallel_size) == (device, tp, pp, dp)
    assert config.model.num_layers == 32 and config.model.vocab_size == 32000
    assert par.num_ranks % config.cluster.devices_per_node == 0
    center = DecisionCenter.from_recipe(config)
    estimate = estimate_plan(center.plan, center.profile, center.cluster)
    assert estimate.fits_memory, (estimate.max_peak_memory_bytes, estimate.memory_budget_bytes)
    decision = center.on_failure(ranks=[par.num_ranks // 2 - 1])
    assert decision.chosen.estimate.fits_memory


def test_the_npu_extra_pins_the_torch_npu_built_for_the_torch_setup_installs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = re.search(r'"torch==([0-9.]+)"', (ROOT / "scripts" / "setup.sh").read_text()).group(1)
    assert project["optional-dependencies"]["npu"] == [f"torch=={version}", f"torch_npu=={version}"]
