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
from odyssey_megatron.profiler import _weight_grad_share
from odyssey_megatron.profiler.stages import StageMeasurement
from odyssey_megatron.profile_file import analytic_recipe_profile, read_profile, recipe_measured_for, recipe_profile
from odyssey_megatron.settings import Pricing

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[1]
TINY = "recipes/llama2_7b/tiny_cpu.yaml"


def _halves(input_grad_s: float, weight_grad_s: float) -> StageMeasurement:
    return StageMeasurement(forward_s=1.0, backward_s=input_grad_s + weight_grad_s, input_grad_s=input_grad_s,
                            weight_grad_s=weight_grad_s, activation_bytes=0, blocks={}, optimizer_s=0.0)


def test_the_weight_gradient_share_is_the_added_layers_and_stays_positive_when_noise_swallows_the_difference():
    # Two layers against one: the added layer's halves (3 ms input, 1 ms weight) give 1/4,
    # free of the 1 ms each op pays whatever its size.
    assert _weight_grad_share(_halves(7e-3, 3e-3), _halves(4e-3, 2e-3)) == pytest.approx(0.25)
    # Noise left the two-layer stage's weight half no longer than the one-layer one's (CI
    # once measured a share of 0): the middle stage's own halves give it instead.
    assert _weight_grad_share(_halves(7e-3, 2e-3), _halves(4e-3, 2e-3)) == pytest.approx(2 / 9)
    assert _weight_grad_share(_halves(3e-3, 3e-3), _halves(4e-3, 2e-3)) == pytest.approx(0.5)
    assert _weight_grad_share(_halves(6e-3, 2e-3), None) == pytest.approx(0.25)


def test_the_profile_of_the_tiny_recipe_prices_plans(tmp_path, capsys):
    # The tiny layer's ops take about a millisecond; 7 repeats keep their medians steady
    # (the share's fallback below keeps it positive when they are not).
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
    # the snapshot's copy into a keeper and its parity XOR, measured here, for the snapshot pricing
    assert profile.snapshot_copy_bandwidth > 0 and profile.parity_xor_bandwidth > 0

    with_profile = load_config(TINY, [f"odyssey.profile={out}"])
    assert recipe_profile(with_profile) == profile
    center = DecisionCenter.from_recipe(with_profile)
    estimate = estimate_plan(center.plan, profile, center.cluster, pricing=Pricing(decouple=True))
    per_micro_batch = sum(b.forward_s + b.backward_s for b in (*profile.layers, profile.embedding, profile.output))
    # Each of the 2 pipelines runs 4 micro-batches through 4 stages: at least the work of one.
    assert per_micro_batch <= estimate.step_time_s < math.inf
    assert main(["plan", "--config", TINY, "--failed", "3", f"odyssey.profile={out}"]) == 0
    assert "after failure of ranks [3]" in capsys.readouterr().out
