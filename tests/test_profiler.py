"""``odyssey profile`` measures the tiny recipe's model on this CPU and writes a profile
file that the estimator prices plans with and ``odyssey plan`` accepts. Times on a
shared machine vary, so they are held to their structure (positive, a weight-gradient
part inside the backward); bytes are exact: parameters and gradients are fp32, and
Adam keeps two fp32 moments and a step count per tensor."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from odyssey_megatron.cli import main
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.profile_file import analytic_recipe_profile, read_profile, recipe_measured_for, recipe_profile
from odyssey_megatron.settings import Pricing

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[1]
TINY = "recipes/llama2_7b/tiny_cpu.yaml"


def test_the_profile_of_the_tiny_recipe_prices_plans(tmp_path, capsys):
    # The tiny layer's ops take about a millisecond and its weight-gradient share is what a
    # split backward takes beyond an op's fixed cost, both medians: with 3 repeats a busy
    # machine's noise swallowed the share once (0.0) in four CI runs; 7 keep it at 0.14-0.21.
    out = tmp_path / "tiny.json"
    done = subprocess.run([sys.executable, "-m", "odyssey_megatron.cli", "profile", "--config", TINY, "--out", str(out),
                           "--repeats", "7"], capture_output=True, text=True, timeout=240, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert f"written to {out}" in done.stdout

    config = load_config(TINY)
    measured = read_profile(out, key="--out")
    assert measured.measured_for == recipe_measured_for(config)
    profile, analytic = measured.profile, analytic_recipe_profile(config, device="cpu")
    assert profile.num_layers == 8 and len(set(profile.layers)) == 1
    for block, shape in ((profile.layers[0], analytic.layers[0]), (profile.embedding, analytic.embedding),
                         (profile.output, analytic.output)):
        assert block.param_bytes == shape.param_bytes == block.grad_bytes
        assert 2 * block.param_bytes < block.optimizer_bytes <= 2 * block.param_bytes + 4 * 16
    layer = profile.layers[0]
    assert layer.forward_s > 0 and 0 < layer.weight_grad_s < layer.backward_s
    assert layer.activation_bytes > 0 and profile.embedding.weight_grad_s == 0
    assert profile.op_overhead_s >= 0 and profile.optimizer_s_per_param_byte > 0
    assert profile.p2p_bytes == 64 * 2 * 64 * 4
    assert profile.link_latency_s > 0 and profile.allreduce_latency_s > 0
    assert math.isfinite(profile.intra_node_bandwidth) and profile.allreduce_bandwidth > 0

    with_profile = load_config(TINY, [f"odyssey.profile={out}"])
    assert recipe_profile(with_profile) == profile
    center = DecisionCenter.from_recipe(with_profile)
    estimate = estimate_plan(center.plan, profile, center.cluster, pricing=Pricing(decouple=True))
    per_micro_batch = sum(b.forward_s + b.backward_s for b in (*profile.layers, profile.embedding, profile.output))
    # Each of the 2 pipelines runs 4 micro-batches through 4 stages: at least the work of one.
    assert per_micro_batch <= estimate.step_time_s < math.inf
    assert main(["plan", "--config", TINY, "--failed", "3", f"odyssey.profile={out}"]) == 0
    assert "after failure of ranks [3]" in capsys.readouterr().out
