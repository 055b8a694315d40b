"""The default disk checkpoint interval: Young's rule on the save the estimator prices (each
block's TP shards once, the busiest node's write at cluster.disk_write_gb_s after the largest
rank's copy to host memory), on worked numbers; 0 still turns checkpoints off, and a given
interval is used as given."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from odyssey_megatron.blocks import block_bytes, model_blocks
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter, checkpoint_interval
from odyssey_megatron.estimator.checkpoint import checkpoint_time_s

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "llama2_7b"
GB = 1e9


def test_the_save_writes_the_model_once_from_the_busiest_node_after_the_largest_copy():
    config = load_config(RECIPES / "ascend_910b_32.yaml")  # TP8 x PP2 x DP2 on 4 nodes of 8
    center = DecisionCenter.from_recipe(config)
    plan, model, tp = center.plan, config.model, center.plan.tensor_parallel_size
    whole_model = sum(block_bytes(model, b, tp) for b in model_blocks(model)) * tp
    at = lambda gb_s: checkpoint_time_s(plan, center.profile, model=model, cluster=center.cluster,  # noqa: E731
                                        disk_write_bytes_s=gb_s * GB)
    copy_s = at(math.inf)
    assert 0 < copy_s < at(2)
    # 4 nodes write the model once between them: a quarter each at best
    assert at(2) - copy_s >= whole_model / 4 / (2 * GB) * (1 - 1e-9)
    assert at(4) - copy_s == pytest.approx((at(2) - copy_s) / 2)  # twice the bandwidth halves the write


def test_one_node_writes_the_whole_model_once_whatever_the_data_parallel_degree():
    config = load_config(RECIPES / "tiny_cpu.yaml")  # DP2 x PP4, one node of 8 CPU ranks
    center = DecisionCenter.from_recipe(config)
    model = config.model
    whole_model = sum(block_bytes(model, b, 1) for b in model_blocks(model))
    write_s = (checkpoint_time_s(center.plan, center.profile, model=model, cluster=center.cluster,
                                 disk_write_bytes_s=GB)
               - checkpoint_time_s(center.plan, center.profile, model=model, cluster=center.cluster,
                                   disk_write_bytes_s=math.inf))
    assert write_s == pytest.approx(whole_model / GB)  # not twice: DP replicas write a block once


def test_the_default_interval_is_young_s_on_worked_numbers():
    config = load_config(RECIPES / "ascend_910b_32.yaml")
    config = replace(config, odyssey=replace(config.odyssey, checkpoint_interval=None))
    center = DecisionCenter.from_recipe(config)
    save_s = checkpoint_time_s(center.plan, center.profile, model=config.model, cluster=center.cluster,
                               disk_write_bytes_s=config.cluster.disk_write_gb_s * GB)
    mtbf_s = 10.0 * 3600 / 32  # odyssey.device_mtbf_hours (10 h) over 32 devices: 1125 s
    assert center.mtbf_s == pytest.approx(mtbf_s)
    expected = round(math.sqrt(2 * save_s * mtbf_s) / center.estimate.step_time_s)
    steps, how = checkpoint_interval(config, center)
    assert steps == expected and steps > 1
    assert how.startswith(f"every {steps} steps (Young: sqrt(2 x save {save_s:.3g} s at 2 GB/s a node x job MTBF "
                          "0.312 h)")


def test_the_tiny_recipe_checkpoints_far_less_often_than_the_tests_train():
    config = load_config(RECIPES / "tiny_cpu.yaml")
    center = DecisionCenter.from_recipe(config)
    assert checkpoint_interval(config, center)[0] == 143  # the end-to-end tests train 5 to 12 steps
    two_per_node = replace(config, cluster=replace(config.cluster, devices_per_node=2))
    assert checkpoint_interval(two_per_node, DecisionCenter.from_recipe(two_per_node))[0] == 79


@pytest.mark.parametrize("given, expected", [(0, (0, "none (odyssey.checkpoint_interval=0)")),
                                             (7, (7, "every 7 steps (odyssey.checkpoint_interval)"))])
def test_zero_turns_checkpoints_off_and_a_given_interval_is_used_as_given(given, expected):
    config = load_config(RECIPES / "tiny_cpu.yaml", [f"odyssey.checkpoint_interval={given}"])
    assert checkpoint_interval(config, DecisionCenter.from_recipe(config)) == expected
