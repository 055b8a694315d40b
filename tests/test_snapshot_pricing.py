"""What the estimator says snapshots cost: shares, host memory, Young's interval."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from odyssey_megatron.blocks import block_bytes
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.estimator.snapshot import (
    snapshot_host_bytes,
    snapshot_shares,
    snapshot_time_s,
    young_interval_steps,
)
from odyssey_megatron.snapshot.protection import ENCODE_PIECE_BYTES, parity_chunk_bytes

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "llama2_7b"


@pytest.mark.parametrize("recipe", ["tiny_cpu.yaml", "ascend_910b_32.yaml", "gpu_h100_8.yaml"])
def test_shares_cover_the_model_once_and_split_each_stage_among_its_replicas(recipe):
    config = load_config(RECIPES / recipe)
    center = DecisionCenter.from_recipe(config)
    plan, profile, model = center.plan, center.profile, config.model
    size = lambda block: block_bytes(model, block, plan.tensor_parallel_size)  # noqa: E731
    shares = snapshot_shares(plan, model)
    blocks = {b for blocks in plan.holdings(profile).values() for b in blocks}
    assert sum(shares.values()) == sum(size(b) for b in blocks)  # masters, moments and steps, once
    for pipeline_stages in zip(*(p.stages for p in plan.pipelines)):  # one stage's replicas
        replicas = [s.worker for s in pipeline_stages]
        stage = sum(shares[w] for w in replicas)
        largest = max(size(b) for b in plan.holdings(profile)[replicas[0]])
        assert max(shares[w] for w in replicas) <= stage / len(replicas) + largest  # greedy: within one block
    copy_s = max(shares.values()) / profile.host_bandwidth
    assert snapshot_time_s(plan, profile, model=model, nodes_per_group=4, nodes=1) == copy_s  # one node: no parity
    # four nodes: parity.encode sends and receives one share across nodes (an analytic profile
    # takes its XOR as free)
    largest = max(shares.values())
    assert snapshot_time_s(plan, profile, model=model, nodes_per_group=4, nodes=4) == pytest.approx(
        copy_s + largest / profile.inter_node_bandwidth)
    # a measured profile prices the copy into the keeper at its rate; the XOR of two chunks of three
    # runs beside the transfer, only its last piece after it, or the transfer beside a slower XOR
    for xor_rate in (100 * profile.inter_node_bandwidth, 0.1 * profile.inter_node_bandwidth):
        measured = replace(profile, snapshot_copy_bandwidth=2e9, parity_xor_bandwidth=xor_rate)
        overlapped = max(largest / profile.inter_node_bandwidth, largest * 2 / 3 / xor_rate)
        assert snapshot_time_s(plan, measured, model=model, nodes_per_group=4, nodes=4) == pytest.approx(
            largest / 2e9 + overlapped + min(ENCODE_PIECE_BYTES, parity_chunk_bytes([largest] * 4)) / xor_rate)


def test_host_memory_is_two_buffers_of_the_share_and_of_its_parity_chunk():
    config = load_config(RECIPES / "tiny_cpu.yaml")
    center = DecisionCenter.from_recipe(config)
    largest = max(snapshot_shares(center.plan, config.model).values())
    one_node = snapshot_host_bytes(center.plan, config.model, nodes_per_group=4, nodes=1)
    four_nodes = snapshot_host_bytes(center.plan, config.model, nodes_per_group=4, nodes=4)
    two_nodes = snapshot_host_bytes(center.plan, config.model, nodes_per_group=4, nodes=2)
    assert one_node == 2 * largest  # no second node: no parity
    assert four_nodes == 2 * (largest + math.ceil(largest / 3))
    assert two_nodes == 4 * largest  # a group of two mirrors


def test_young_interval_by_hand():
    # sqrt(2 x 0.5 s x 3600 s) = 60 s = 6 steps of 10 s
    assert young_interval_steps(copy_s=0.5, step_s=10.0, mtbf_s=3600.0) == 6
    assert young_interval_steps(copy_s=1e-6, step_s=10.0, mtbf_s=3600.0) == 1  # at least every step
    config = load_config(RECIPES / "ascend_910b_32.yaml")
    center = DecisionCenter.from_recipe(config)
    seconds = snapshot_time_s(center.plan, center.profile, model=config.model, nodes_per_group=4,
                              nodes=4)  # 32 NPUs: 4 nodes of 8
    expected = math.sqrt(2 * seconds * center.failure_model.expected_interval_s(32)) / center.estimate.step_time_s
    assert center.snapshot_interval(nodes_per_group=4) == max(1, round(expected))


def test_the_profiler_measures_the_copy_into_a_keeper_and_the_parity_xor(monkeypatch):
    import odyssey_megatron.profiler.snapshot_rates as rates
    from odyssey_megatron.hooks.accelerator import select_accelerator

    monkeypatch.setattr(rates, "SNAPSHOT_SAMPLE_BYTES", 4 * 2**20)
    copy, xor = rates.measure_snapshot_rates(select_accelerator("cpu"), repeats=1)
    assert 1e7 < copy < 1e12 and 1e7 < xor < 1e12  # bytes/s: a real copy and XOR ran, neither free
