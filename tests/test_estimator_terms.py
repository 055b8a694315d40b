"""The estimator's terms beyond the pipeline recurrence, on worked examples: the optimizer
step scales with the parameter bytes of the rank that holds the most, the global norm's
all-reduce spans every training rank (and hides behind a staggered step), a fixed cost
per op is paid by every op (twice by a split backward), all-reduces use the profiler's
fit, a measured weight-gradient share moves work from B to W, and the distributed
optimizer keeps its share of the state and all-gathers the stepped weights."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers import asymmetric_plan, lost_last_pipeline, symmetric_plan
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.estimator.communication import param_gather_time, sync_time
from odyssey_megatron.estimator.optimizer import norm_allreduce_time, optimizer_time
from odyssey_megatron.estimator.replay import op_graph
from odyssey_megatron.profile import BlockCost, analytic_profile, uniform_profile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.settings import Pricing
from odyssey_megatron.schedules.ops import BACKWARD, FORWARD, WEIGHT_GRAD, Op
from odyssey_megatron.specs.devices import device_spec


def profile_of(num_layers: int, **fields):
    """Layers F=1 s, B=2 s, 100 parameter bytes and 40 gradient bytes each, free edges and links."""
    base = uniform_profile(num_layers=num_layers, layer_state_bytes=100)
    layer = replace(base.layers[0], grad_bytes=40)
    return replace(base, layers=(layer,) * num_layers, **fields)


def test_the_optimizer_step_scales_with_the_fullest_ranks_parameter_bytes():
    profile = profile_of(6, optimizer_s_per_param_byte=1e-3, link_latency_s=0.01)
    even = asymmetric_plan([(3, 3)], [4])
    uneven = asymmetric_plan([(5, 1)], [4])
    # 3 layers = 300 bytes = 0.3 s on each rank; the norm's ring all-reduce over 2 ranks:
    # 2 latency steps (4 bytes over free links)
    assert optimizer_time(even, profile, None, staggered=False) == pytest.approx(0.3 + 2 * 0.01)
    assert optimizer_time(uneven, profile, None, staggered=False) == pytest.approx(0.5 + 2 * 0.01)
    assert optimizer_time(uneven, profile, None, staggered=True) == pytest.approx(0.5)
    estimate = estimate_plan(even, profile)
    plain = estimate_plan(even, replace(profile, optimizer_s_per_param_byte=0.0))
    assert estimate.optimizer_time_s == pytest.approx(0.32)
    assert estimate.step_time_s == pytest.approx(plain.step_time_s + 0.3)


def test_the_norm_all_reduce_spans_every_training_rank():
    profile = profile_of(4, link_latency_s=0.01, intra_node_bandwidth=800.0, inter_node_bandwidth=80.0)
    plan = symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2)
    # 4 ranks: 6 steps of latency and 2 * 3/4 of 4 bytes (one float32)
    one_node = ClusterState(world_size=4, devices_per_node=4)
    assert norm_allreduce_time(plan, profile, one_node) == pytest.approx(6 * 0.01 + 1.5 * 4 / 800)
    two_nodes = ClusterState(world_size=4, devices_per_node=2)
    assert norm_allreduce_time(plan, profile, two_nodes) == pytest.approx(6 * 0.01 + 1.5 * 4 / 80)
    fitted = replace(profile, allreduce_bandwidth=400.0, allreduce_latency_s=0.002)
    assert norm_allreduce_time(plan, fitted, one_node) == pytest.approx(6 * 0.002 + 1.5 * 4 / 400)


def test_sync_uses_the_profilers_all_reduce_fit_within_a_node():
    profile = profile_of(2, intra_node_bandwidth=100.0, inter_node_bandwidth=10.0, link_latency_s=0.5)
    plan = with_sync(symmetric_plan(dp=2, pp=1, num_layers=2, micro_batches_per_pipeline=1), profile)
    node = ClusterState(world_size=2, devices_per_node=2)
    # one unit of 80 gradient bytes over 2 ranks: 2 latencies and 80 bytes over the bandwidth
    assert sync_time(plan, profile, node) == pytest.approx(2 * 0.5 + 80 / 100)
    fitted = replace(profile, allreduce_bandwidth=40.0, allreduce_latency_s=0.1)
    assert sync_time(plan, fitted, node) == pytest.approx(2 * 0.1 + 80 / 40)
    apart = ClusterState(world_size=2, devices_per_node=1)  # no faster than the inter-node link
    assert sync_time(plan, fitted, apart) == pytest.approx(2 * 0.1 + 80 / 10)


def test_the_distributed_optimizer_keeps_its_share_of_the_state_and_all_gathers_the_weights():
    profile = profile_of(2, intra_node_bandwidth=100.0, inter_node_bandwidth=100.0, link_latency_s=0.5)
    profile = replace(profile, layers=tuple(replace(layer, optimizer_bytes=120) for layer in profile.layers))
    plan = with_sync(symmetric_plan(dp=4, pp=1, num_layers=2, micro_batches_per_pipeline=1), profile)
    # 200 parameter bytes over 4 ranks: each receives 3/4 of them, after 3 latencies
    assert param_gather_time(plan, profile) == pytest.approx(3 * 0.5 + 150 / 100)
    full = estimate_plan(plan, profile)
    sharded = estimate_plan(plan, profile, pricing=Pricing(distributed_optimizer=True))
    assert sharded.param_gather_time_s == pytest.approx(3 * 0.5 + 150 / 100) and full.param_gather_time_s == 0
    assert sharded.step_time_s == pytest.approx(full.step_time_s + sharded.param_gather_time_s)
    # two layers of 120 optimizer bytes, each of the 4 ranks keeping half: 120 fewer bytes a rank
    assert [m - 120 for m in full.peak_memory_bytes[0]] == list(sharded.peak_memory_bytes[0])
    assert all(peak == sharded.peak_memory_bytes[0][0] for stages in sharded.peak_memory_bytes for peak in stages)


def test_the_distributed_optimizer_steps_each_ranks_owned_share_at_the_plans_holder_count():
    profile = profile_of(2, optimizer_s_per_param_byte=1e-3)
    plan = symmetric_plan(dp=4, pp=1, num_layers=2, micro_batches_per_pipeline=1)
    # 200 parameter bytes a rank = 0.2 s of Adam; sharded over 4 holders each steps 2/4 of it
    assert optimizer_time(plan, profile, None, staggered=True) == pytest.approx(0.2)
    assert optimizer_time(plan, profile, None, staggered=True, sharded=True) == pytest.approx(0.1)
    # after a failure the blocks have 3 holders: each survivor steps 2/3 of them
    after = optimizer_time(lost_last_pipeline(plan), profile, None, staggered=True, sharded=True)
    assert after == pytest.approx(0.2 * 2 / 3)
    full = estimate_plan(plan, profile)
    sharded = estimate_plan(plan, profile, pricing=Pricing(distributed_optimizer=True))
    assert full.optimizer_time_s - sharded.optimizer_time_s == pytest.approx(0.1)


def test_every_op_pays_the_fixed_cost_and_a_split_backward_pays_it_twice():
    plan = asymmetric_plan([(2,)], [1])
    graph = op_graph(plan, profile_of(2, op_overhead_s=0.25), None)
    seconds = {op: (whole, split) for op, whole, split in zip(graph.ops, graph.whole_s, graph.split_s)}
    # two layers: F 2 s, B 4 s, half of it the weight gradients
    assert seconds[Op(FORWARD, 0, 0, 0)] == (2.25, 2.25)
    assert seconds[Op(BACKWARD, 0, 0, 0)] == (4.25, 2.25)
    assert seconds[Op(WEIGHT_GRAD, 0, 0, 0)] == (2.25, 2.25)
    one = estimate_plan(asymmetric_plan([(1, 1)], [3]), profile_of(2, op_overhead_s=0.25))
    # Eq. 9 with every F and B 0.25 s longer: (2 + 3 - 1)(1.25 + 2.25)
    assert one.pipeline_time_s == pytest.approx(4 * 3.5)


def test_a_measured_weight_gradient_share_moves_work_from_b_to_w():
    plan = asymmetric_plan([(1, 1)], [2])
    assumed = profile_of(2)
    measured = replace(assumed, layers=tuple(replace(b, weight_grad_s=0.5) for b in assumed.layers))
    for profile, b_s, w_s in ((assumed, 1.0, 1.0), (measured, 1.5, 0.5)):
        graph = op_graph(plan, profile, None)
        split = dict(zip(graph.ops, graph.split_s))
        assert split[Op(BACKWARD, 0, 1, 0)] == b_s and split[Op(WEIGHT_GRAD, 0, 1, 0)] == w_s
        assert dict(zip(graph.ops, graph.whole_s))[Op(BACKWARD, 0, 1, 0)] == 2.0
    # The embedding and head add their own measured halves: 1 s of backward, 0.25 s of it W.
    edges = replace(measured, output=BlockCost(0.5, 1.0, 0, 0, 0, 0, weight_grad_s=0.25))
    times = edges.stage_times(1, 2, first=False, last=True)
    assert (times.backward_s, times.input_grad_s, times.weight_grad_s) == (3.0, 2.25, 0.75)


def test_the_analytic_optimizer_step_streams_adams_traffic_through_memory():
    model = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=172, num_attention_heads=4, num_query_groups=4,
                        vocab_size=512, seq_length=64, tie_embeddings=False, params_dtype="bf16")
    profile = analytic_profile(model, micro_batch_size=1, tensor_parallel_size=1, device=device_spec("h100-80gb"))
    # 28 bytes of traffic per parameter, 2 bytes per bf16 parameter, 3350 GB/s
    assert profile.optimizer_s_per_param_byte == pytest.approx(14 / 3350e9)
    assert profile.op_overhead_s == 0.0
