"""Estimator: the op-list programme against the paper's closed forms, memory, comm, transfers."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import asymmetric_plan, symmetric_plan
from odyssey_megatron.config import load_config
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.estimator.closed_form import reroute_step_time, stage_peak_memory, symmetric_step_time
from odyssey_megatron.estimator.communication import allreduce_time
from odyssey_megatron.estimator.decoupled import decoupled_pipelines
from odyssey_megatron.estimator.distinct import distinct_pipelines
from odyssey_megatron.estimator.memory import peak_memory
from odyssey_megatron.estimator.pipeline import fixed_order_step, lone_pipeline_time, simulate_pipelines
from odyssey_megatron.estimator.replay import ScheduleDeadlock, p2p_time
from odyssey_megatron.estimator.staggered import staggered_period
from odyssey_megatron.estimator.step_schedule import staggers, step_schedule, timed_step_schedule
from odyssey_megatron.schedules.ops import Op, settle_point
from odyssey_megatron.estimator.transition import transfer_time
from odyssey_megatron.plan import ExecutionPlan, Transfer, validate_plan
from odyssey_megatron.planner.initial import initial_plan
from odyssey_megatron.planner.layers import SplitSearch, lone_pipeline_lower_bound, stage_ranges
from odyssey_megatron.planner.reroute import reroute_plan
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.profile_file import recipe_profile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.settings import Pricing


def test_eq9_worked_value():
    # 4 stages, 8 micro-batches, T_f = 1, T_b = 2: (4 + 8 - 1) * 3
    assert symmetric_step_time(num_stages=4, num_micro_batches=8, forward_s=1, backward_s=2) == 33


@settings(max_examples=60, deadline=None)
@given(
    pp=st.integers(1, 6),
    layers_per_stage=st.integers(1, 3),
    dp=st.integers(1, 3),
    micro_batches=st.integers(1, 12),
    forward=st.floats(0.1, 5),
    backward=st.floats(0.1, 10),
)
def test_programme_equals_eq9_on_symmetric_pipelines(pp, layers_per_stage, dp, micro_batches, forward, backward):
    profile = uniform_profile(num_layers=pp * layers_per_stage, forward_s=forward, backward_s=backward)
    plan = symmetric_plan(dp=dp, pp=pp, num_layers=pp * layers_per_stage, micro_batches_per_pipeline=micro_batches)
    expected = symmetric_step_time(
        num_stages=pp,
        num_micro_batches=micro_batches,
        forward_s=forward * layers_per_stage,
        backward_s=backward * layers_per_stage,
    )
    assert simulate_pipelines(plan, profile).makespan_s == pytest.approx(expected, rel=1e-9)


LLAMA_7B_910B = recipe_profile(load_config("recipes/llama2_7b/ascend_910b_32.yaml"))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), num_stages=st.integers(1, 12), micro_batches=st.integers(1, 24))
def test_lone_pipeline_programme_equals_the_general_one(data, num_stages, micro_batches):
    """The planner's fast path prices a split exactly as the estimator does: same time
    (uneven splits, embedding and head, real links) and the same peak memory; its
    pruning bound is never above that time."""
    cuts = sorted(data.draw(st.lists(st.integers(1, 31), min_size=num_stages - 1, max_size=num_stages - 1,
                                     unique=True)))
    split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, 32]))
    profile = LLAMA_7B_910B
    times = [profile.stage_compute(a, b, first=s == 0, last=s == num_stages - 1)
             for s, (a, b) in enumerate(stage_ranges(split))]
    plan = asymmetric_plan([split], [micro_batches])
    general = estimate_plan(plan, profile)
    link_s = p2p_time(profile, same_node=True)
    assert lone_pipeline_time(times, micro_batches, link_s=link_s) == general.pipeline_time_s
    assert lone_pipeline_lower_bound(times, micro_batches, link_s=link_s) <= general.pipeline_time_s * (1 + 1e-12)
    assert SplitSearch(profile, limit=1).pipeline_cost(split, micro_batches) == (
        general.pipeline_time_s, general.max_peak_memory_bytes)


def test_eq12_and_eq13_worked_values():
    # Eq. 12: one failure, DP = 4, N_m = 6 -> 6 / 3 = 2 extra micro-batch slots.
    one = reroute_step_time(
        num_stages=4, num_micro_batches=6, data_parallel_size=4, failed_per_stage=[0, 1, 0, 0], forward_s=1, backward_s=2
    )
    assert one == (4 + 6 - 1 + 2) * 3
    # Eq. 13: failures in two stages add up: 6*1/3 + 6*2/2.
    two = reroute_step_time(
        num_stages=4, num_micro_batches=6, data_parallel_size=4, failed_per_stage=[1, 0, 2, 0], forward_s=1, backward_s=2
    )
    assert two == (4 + 6 - 1 + 2 + 6) * 3
    assert reroute_step_time(
        num_stages=2, num_micro_batches=6, data_parallel_size=2, failed_per_stage=[2, 0], forward_s=1, backward_s=2
    ) is None


@settings(max_examples=60, deadline=None)
@given(
    dp=st.integers(2, 4),
    pp=st.integers(1, 4),
    micro_batches=st.integers(1, 8),
    data=st.data(),
)
def test_rerouted_plans_run_and_cost_between_eq9_and_eq13(dp, pp, micro_batches, data):
    """Every rerouted schedule is deadlock-free, trains each micro-batch once, is no faster
    than the failure-free pipeline and no slower than Eq. 13's serial extra work."""
    profile = uniform_profile(num_layers=pp, forward_s=1.0, backward_s=2.0)
    plan = symmetric_plan(dp=dp, pp=pp, num_layers=pp, micro_batches_per_pipeline=micro_batches)
    failed_per_stage = [data.draw(st.integers(0, dp - 1)) for _ in range(pp)]
    failed = set()
    for stage, count in enumerate(failed_per_stage):
        failed |= {stage * dp + d for d in data.draw(st.permutations(range(dp)))[:count]}
    rerouted = reroute_plan(plan, failed_workers=failed, profile=profile)
    validate_plan(rerouted, num_micro_batches=dp * micro_batches)
    time_s = simulate_pipelines(rerouted, profile).makespan_s
    eq9 = symmetric_step_time(num_stages=pp, num_micro_batches=micro_batches, forward_s=1, backward_s=2)
    eq13 = reroute_step_time(
        num_stages=pp, num_micro_batches=micro_batches, data_parallel_size=dp,
        failed_per_stage=failed_per_stage, forward_s=1, backward_s=2,
    )
    assert eq9 - 1e-9 <= time_s
    # Work is split in whole micro-batches, so a peer may get ceil(N_m F / (N_dp - F)).
    ceil_extra = sum(-(-micro_batches * f // (dp - f)) for f in failed_per_stage if f)
    assert time_s <= (pp + micro_batches - 1 + ceil_extra) * 3 + 1e-9
    assert eq13 is not None


@settings(max_examples=50, deadline=None)
@given(pp=st.integers(1, 6), layers_per_stage=st.integers(1, 3), micro_batches=st.integers(1, 10))
def test_peak_memory_equals_eq14_on_symmetric_pipelines(pp, layers_per_stage, micro_batches):
    layers = pp * layers_per_stage
    profile = uniform_profile(num_layers=layers, layer_state_bytes=100, activation_bytes=7)
    plan = symmetric_plan(dp=1, pp=pp, num_layers=layers, micro_batches_per_pipeline=micro_batches)
    peaks = estimate_plan(plan, profile).peak_memory_bytes[0]
    for stage in range(pp):
        in_flight_stages = min(pp, stage + micro_batches)  # fewer micro-batches than stages cap it
        expected = stage_peak_memory(
            stage=stage, num_stages=in_flight_stages, num_layers=layers_per_stage,
            param_bytes=100, optimizer_bytes=0, grad_bytes=0, activation_bytes=7,
        )
        assert peaks[stage] == expected


def test_rerouting_peer_holds_more_activations():
    profile = uniform_profile(num_layers=4, activation_bytes=1)
    plan = symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=4)
    rerouted = reroute_plan(plan, failed_workers={1}, profile=profile)  # stage 0 of pipeline 1
    before = estimate_plan(plan, profile).peak_memory_bytes
    after = estimate_plan(rerouted, profile).peak_memory_bytes
    assert after[1][0] is None
    assert after[0][0] >= before[0][0]


def test_out_of_order_ops_are_reported_as_deadlock():
    profile = uniform_profile(num_layers=2)
    plan = symmetric_plan(dp=1, pp=2, num_layers=2, micro_batches_per_pipeline=2)
    schedule = simulate_pipelines(plan, profile).schedule
    schedule[0] = list(reversed(schedule[0]))  # backwards before forwards
    with pytest.raises(ScheduleDeadlock):
        fixed_order_step(plan, profile, None, schedule)


def test_asymmetric_pipelines_take_the_slowest():
    """Eq. 10: step time is the slowest pipeline's."""
    profile = uniform_profile(num_layers=6, forward_s=1, backward_s=1)
    plan = asymmetric_plan([(3, 3), (2, 2, 2)], [4, 4])
    timing = simulate_pipelines(plan, profile)
    assert timing.makespan_s == max(timing.pipeline_end_s)
    assert timing.pipeline_end_s[0] == symmetric_step_time(num_stages=2, num_micro_batches=4, forward_s=3, backward_s=3)
    assert timing.pipeline_end_s[1] == symmetric_step_time(num_stages=3, num_micro_batches=4, forward_s=2, backward_s=2)


def test_asymmetric_layout_pays_extra_sync_rounds():
    profile = uniform_profile(num_layers=8, bandwidth=1.0)
    profile = profile.__class__(**{**profile.__dict__, "layers": tuple(
        l.__class__(**{**l.__dict__, "grad_bytes": 10}) for l in profile.layers)})
    symmetric = with_sync(symmetric_plan(dp=2, pp=4, num_layers=8, micro_batches_per_pipeline=2), profile)
    asymmetric = with_sync(asymmetric_plan([(2, 2, 2, 2), (3, 2, 3)], [2, 2]), profile)
    sym, asym = estimate_plan(symmetric, profile), estimate_plan(asymmetric, profile)
    # symmetric: 1 round of 2-layer units: 2 * (2-1)/2 * 20 bytes / 1 B/s = 20 s
    assert sym.sync_time_s == pytest.approx(20.0)
    assert len(asymmetric.comm_rounds) == 2
    assert asym.sync_time_s > sym.sync_time_s


def test_allreduce_time_ring_formula():
    assert allreduce_time(100, group_size=1, bandwidth=10, latency_s=1) == 0
    assert allreduce_time(100, group_size=4, bandwidth=10, latency_s=0.5) == pytest.approx(2 * 3 / 4 * 10 + 6 * 0.5)


def test_transfer_time_is_set_by_the_busiest_link():
    profile = uniform_profile(num_layers=4, bandwidth=10.0)
    cluster = ClusterState(world_size=4, devices_per_node=4)
    transfers = [Transfer(0, 0, 1, 100), Transfer(1, 0, 2, 100), Transfer(2, 3, 2, 50), Transfer(3, None, 1, 40)]
    # rank 0 sends 200 B at 10 B/s = 20 s; rank 2 receives 150 B = 15 s; rank 1 reads 40 B from storage at 4 B/s
    assert transfer_time(transfers, profile=profile, cluster=cluster, storage_bandwidth=4.0) == pytest.approx(20.0)


def test_plan_json_round_trip():
    profile = uniform_profile(num_layers=4)
    plan = with_sync(reroute_plan(symmetric_plan(dp=3, pp=2, num_layers=4, micro_batches_per_pipeline=3),
                                  failed_workers={4}, profile=profile), profile)
    plan = plan.__class__(**{**plan.__dict__, "transfers": (Transfer("embedding", 1, 2, 5), Transfer(3, None, 0, 7))})
    again = ExecutionPlan.from_json(plan.to_json())
    assert again == plan
    stage = plan.to_dict()["pipelines"][1]["stages"][1]
    assert stage == {"worker": None, "layers": (2, 4)}  # workers only: ranks change as the world shrinks


@settings(max_examples=25, deadline=None)
@given(dp=st.integers(1, 3), pp=st.integers(1, 5), micro_batches=st.integers(1, 9), forward=st.floats(0.1, 3),
       backward=st.floats(0.1, 6), link=st.floats(0, 2), decouple=st.booleans(), staggered=st.booleans())
def test_a_failure_free_plan_may_split_like_a_rerouted_one(dp, pp, micro_batches, forward, backward, link, decouple,
                                                           staggered):
    """Every plan gets the same schedule options: with nothing rerouted the decoupled
    scheduler runs each worker's 1F1B list in order with a W after each B, and the step
    chosen is never slower than plain 1F1B's."""
    profile = replace(uniform_profile(num_layers=pp, forward_s=forward, backward_s=backward,
                                      bandwidth=1 / link if link else float("inf")), p2p_bytes=1)
    plan = symmetric_plan(dp=dp, pp=pp, num_layers=pp, micro_batches_per_pipeline=micro_batches)
    plain, split = simulate_pipelines(plan, profile), decoupled_pipelines(plan, profile).first
    for worker, ops in split.schedule.items():
        assert [op for op in ops if op.kind != "W"] == plain.schedule[worker]
        assert [op._replace(kind="B") for op in ops if op.kind == "W"] == [op for op in ops if op.kind == "B"]
    chosen_s = timed_step_schedule(plan, profile, pricing=Pricing(decouple=decouple, staggered=staggered))[1]
    assert chosen_s <= plain.makespan_s * (1 + 1e-12)
    if not decouple:
        assert chosen_s == pytest.approx(plain.makespan_s, rel=1e-12)


@pytest.mark.parametrize("budget, peak", [(14, 14), (15, 15), (100, 19)])
def test_workers_split_backwards_as_memory_allows(budget, peak):
    """Paper 003's Fig. 3 layout (F=1, B=2, 6 micro-batches), worker 10 (stage 3 of
    pipeline 1) failed: plain 1F1B op lists take 36 slots. Every worker splits each
    backward and runs the weight half (1 slot) in bubbles: 30 slots, the peers' 27 slots
    of work plus the 3 before their first input arrives. A deferred W keeps its
    micro-batch's activations, so with room for 4 or 5 beside the weights (10 bytes + 1
    per micro-batch) workers defer less, at no cost here. The failure-free plan splits
    too: 21 slots, 18 of work plus 3."""
    profile = uniform_profile(num_layers=4, forward_s=1.0, backward_s=2.0, layer_state_bytes=10, activation_bytes=1,
                              memory_budget_bytes=budget)
    plan = symmetric_plan(dp=3, pp=4, num_layers=4, micro_batches_per_pipeline=6)
    rerouted = reroute_plan(plan, failed_workers={10}, profile=profile)
    assert step_schedule(rerouted, profile, pricing=Pricing(decouple=False)).makespan_s == 36.0
    timing = step_schedule(rerouted, profile, pricing=Pricing(decouple=True))
    assert timing.makespan_s == 30.0
    assert max(peak_memory(rerouted, profile, timing.schedule).values()) == peak <= budget
    for ops in timing.schedule.values():
        backwards = [op for op in ops if op.kind == "B"]
        weights = [op for op in ops if op.kind == "W"]
        assert [op._replace(kind="B") for op in weights] == backwards
        assert all(ops.index(w) > ops.index(w._replace(kind="B")) for w in weights)
    assert step_schedule(plan, profile, pricing=Pricing(decouple=True)).makespan_s == 21.0


@settings(max_examples=25, deadline=None)
@given(dp=st.integers(1, 3), pp=st.integers(1, 5), micro_batches=st.integers(1, 9), forward=st.floats(0.1, 3),
       backward=st.floats(0.1, 6), link=st.floats(0, 2), iterations=st.integers(2, 5))
def test_staggering_gains_nothing_on_a_fault_free_symmetric_plan(dp, pp, micro_batches, forward, backward, link,
                                                                  iterations):
    """In 1F1B the first stage finishes a step last and starts the next first, so steps
    staggered per DP group follow each other exactly one makespan apart."""
    profile = replace(uniform_profile(num_layers=pp, forward_s=forward, backward_s=backward,
                                      bandwidth=1 / link if link else float("inf")), p2p_bytes=1)
    plan = symmetric_plan(dp=dp, pp=pp, num_layers=pp, micro_batches_per_pipeline=micro_batches)
    timing = simulate_pipelines(plan, profile)
    assert staggered_period(plan, profile, None, timing.schedule, iterations=iterations) == pytest.approx(
        timing.makespan_s, rel=1e-12)


@pytest.mark.parametrize("budget, period", [(14, 30.0), (15, 29.0), (100, 29.0)])
def test_staggered_steps_let_split_peers_finish_into_the_next_step(budget, period):
    """The Fig. 3 case above with staggered optimizer steps: plain op lists still take 36
    slots a step, since the failed last stage's peers end every step. Split op lists with
    room for 5 micro-batches take 29 a step in steady state instead of 30: the first
    stages start the next step while the peers run their last weight gradients. With
    room for 4 the W ops are forced early and there is nothing left to overlap."""
    profile = uniform_profile(num_layers=4, forward_s=1.0, backward_s=2.0, layer_state_bytes=10, activation_bytes=1,
                              memory_budget_bytes=budget)
    rerouted = reroute_plan(symmetric_plan(dp=3, pp=4, num_layers=4, micro_batches_per_pipeline=6),
                            failed_workers={10}, profile=profile)
    plain = step_schedule(rerouted, profile, pricing=Pricing(decouple=False, staggered=True))
    assert staggered_period(rerouted, profile, None, plain.schedule) == 36.0
    split = step_schedule(rerouted, profile, pricing=Pricing(decouple=True, staggered=True))
    assert staggered_period(rerouted, profile, None, split.schedule) == period
    assert estimate_plan(rerouted, profile, pricing=Pricing(decouple=True, staggered=True)).pipeline_time_s == period


def test_a_speculative_step_runs_ahead_up_to_its_settle_point():
    """After a staggered step a worker may compute, but not send a result or write a
    gradient, before the step settles: a first or middle stage stops at its first
    forward's send, a last stage (and a peer adopting last-stage micro-batches) at its
    first backward."""
    stages = [4, 4]
    assert settle_point([Op("F", 0, 0, 0), Op("F", 0, 0, 1)], stages) == 0
    assert settle_point([Op("F", 1, 2, 0), Op("F", 1, 2, 1)], stages) == 0
    assert settle_point([Op("F", 0, 3, 0), Op("B", 0, 3, 0)], stages) == 1
    assert settle_point([Op("F", 0, 3, 0), Op("F", 1, 3, 0), Op("B", 0, 3, 0), Op("W", 0, 3, 0)], stages) == 2


def test_the_next_step_waits_for_the_norm_before_it_sends():
    """Two pipelines of four stages, the second's last stage failed, four micro-batches
    each, split backwards: 54 slots a step. Staggered, 52: the first stages start the
    next step while the peer finishes, but hold their first outputs until every worker
    is done (the norm is in); were they sent at once, the period would be 50."""
    profile = uniform_profile(num_layers=8)
    rerouted = reroute_plan(symmetric_plan(dp=2, pp=4, num_layers=8, micro_batches_per_pipeline=4),
                            failed_workers={7}, profile=profile)
    split = step_schedule(rerouted, profile, pricing=Pricing(decouple=True, staggered=True))
    assert split.makespan_s == 54.0
    assert staggered_period(rerouted, profile, None, split.schedule) == 52.0


def test_staggered_steps_run_the_op_lists_a_staggered_start_orders():
    """Llama-2 7B on 64 910Bs (DP16 x PP4), pipeline 0's stage 1 fails. The list
    scheduler's first step, all stages starting together, orders the split op lists into
    3.3169 s; its second step, started staggered, orders them into lists that take
    3.3154 s even run unstaggered. With staggered steps those are the lists chosen, at a
    steady-state 3.2071 s a step; without, the first step's. The failure-free plan,
    priced with the same options, is faster either way (plain 1F1B: 3.8138 s)."""
    cluster = ClusterState(world_size=64, tensor_parallel_size=1, devices_per_node=8)
    plan = initial_plan(data_parallel_size=16, pipeline_parallel_size=4, tensor_parallel_size=1,
                        num_micro_batches=128, profile=LLAMA_7B_910B, max_layer_splits=256)
    rerouted = reroute_plan(plan, failed_workers={16}, profile=LLAMA_7B_910B)
    unstaggered = step_schedule(rerouted, LLAMA_7B_910B, cluster, pricing=Pricing(decouple=True, staggered=False))
    staggered = step_schedule(rerouted, LLAMA_7B_910B, cluster, pricing=Pricing(decouple=True, staggered=True))
    assert unstaggered.makespan_s == pytest.approx(3.3169, abs=1e-4)
    assert staggered.makespan_s == pytest.approx(3.3154, abs=1e-4)
    both = Pricing(decouple=True, staggered=True)
    assert estimate_plan(rerouted, LLAMA_7B_910B, cluster, pricing=both).pipeline_time_s == (
        pytest.approx(3.2071, abs=1e-4))
    assert estimate_plan(plan, LLAMA_7B_910B, cluster).pipeline_time_s == pytest.approx(3.8138, abs=1e-4)
    for staggered in (False, True):
        pricing = Pricing(decouple=True, staggered=staggered)
        assert estimate_plan(plan, LLAMA_7B_910B, cluster, pricing=pricing).pipeline_time_s < (
            estimate_plan(rerouted, LLAMA_7B_910B, cluster, pricing=pricing).pipeline_time_s)


@pytest.mark.parametrize("copy_s, in_line, period, staggered", [
    (0.5, False, 29.0, True), (20.0, False, 29.0, True), (35.0, False, 30.0, False),
    (0.5, True, 29.0, True), (2.5, True, 29.5, True), (3.0, True, 30.0, False),
])
def test_a_retake_copy_hides_behind_the_step_unless_it_runs_in_line(copy_s, in_line, period, staggered):
    """The Fig. 3 case with split op lists (30 slots a step, 29 staggered for free), now
    with each stage's optimizer state copied to host memory for a staggered step's
    retake. Copied beside compute from the step's start, the copy is free while it is
    shorter than the worker's step (20 slots), and sets the period once it is longer
    than the whole step (35 slots: not staggered). In line (CPU), it delays each
    worker's first op: the stage-3 peers, which set the period, wait 2 slots for their
    first input anyway, so a copy of up to 2 slots is free, 2.5 costs half a slot, and
    3 would cost the whole slot gained."""
    free = uniform_profile(num_layers=4, forward_s=1.0, backward_s=2.0, layer_state_bytes=10, activation_bytes=1,
                           memory_budget_bytes=100)
    profile = replace(free, layers=tuple(replace(layer, optimizer_bytes=1) for layer in free.layers),
                      host_bandwidth=1 / copy_s, host_copy_async=not in_line)
    rerouted = reroute_plan(symmetric_plan(dp=3, pp=4, num_layers=4, micro_batches_per_pipeline=6),
                            failed_workers={10}, profile=profile)
    split = step_schedule(rerouted, profile, pricing=Pricing(decouple=True, staggered=True))
    assert split.makespan_s == 30.0
    assert staggered_period(rerouted, profile, None, split.schedule) == (
        29.0 + max(0.0, copy_s - 2.0) if in_line else max(29.0, copy_s))
    assert staggers(rerouted, profile, None, split) is staggered
    assert estimate_plan(rerouted, profile, pricing=Pricing(decouple=True, staggered=True)).pipeline_time_s == period
    fault_free = symmetric_plan(dp=3, pp=4, num_layers=4, micro_batches_per_pipeline=6)
    assert not staggers(fault_free, profile, None, simulate_pipelines(fault_free, profile))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dp=st.integers(2, 6), pp=st.integers(1, 4), micro_batches=st.integers(1, 5),
       devices_per_node=st.integers(1, 8), decouple=st.booleans(), staggered=st.booleans())
def test_pipelines_that_time_alike_are_simulated_once(data, dp, pp, micro_batches, devices_per_node, decouple,
                                                      staggered):
    """``estimate_plan`` keeps one pipeline of each class of untouched ones (same layers,
    micro-batch count and links); its pipeline time and every stage's peak memory equal
    those of the op lists over all pipelines, which the runtime runs."""
    profile = replace(uniform_profile(num_layers=2 * pp, forward_s=1.0, backward_s=2.0, layer_state_bytes=10,
                                      activation_bytes=1), p2p_bytes=1, intra_node_bandwidth=4.0,
                      inter_node_bandwidth=1.0)
    splits = [(2,) * pp, (1, *([2] * (pp - 2)), 3) if pp > 1 else (2,)]
    plan = asymmetric_plan([data.draw(st.sampled_from(splits)) for _ in range(dp)],
                           [micro_batches + data.draw(st.integers(0, 1)) for _ in range(dp)])
    cluster = ClusterState(world_size=dp * pp, devices_per_node=devices_per_node)
    failed = data.draw(st.sets(st.sampled_from(plan.workers), max_size=2))
    rerouted = reroute_plan(plan, failed_workers=failed, profile=profile) if failed else plan
    if rerouted is None:
        return
    estimate = estimate_plan(rerouted, profile, cluster, pricing=Pricing(decouple=decouple, staggered=staggered))
    timing, pipeline_s = timed_step_schedule(rerouted, profile, cluster,
                                             pricing=Pricing(decouple=decouple, staggered=staggered))
    peaks = peak_memory(rerouted, profile, timing.schedule)
    assert estimate.pipeline_time_s == pytest.approx(pipeline_s, rel=1e-12)
    assert estimate.peak_memory_bytes == tuple(
        tuple(None if stage.worker is None else peaks[stage.worker] for stage in pipeline.stages)
        for pipeline in rerouted.pipelines)


def test_untouched_pipelines_collapse_by_layers_micro_batches_and_links():
    """Eight two-stage pipelines on 3-device nodes, one failure: the failed pipeline and
    its peer are kept; the rest fall in two classes, pipelines within a node and across."""
    profile = uniform_profile(num_layers=4, forward_s=1.0, backward_s=2.0)
    plan = asymmetric_plan([(2, 2)] * 6 + [(1, 3)] * 2, [4] * 8)  # workers pipeline-major
    rerouted = reroute_plan(plan, failed_workers={13}, profile=profile)  # pipeline 6, stage 1: (1, 3) peers
    distinct, stands_for = distinct_pipelines(rerouted, ClusterState(world_size=16, devices_per_node=3))
    assert stands_for == (0, 1, 0, 0, 1, 0, 2, 3)  # pipelines 1 and 4 span two nodes
    assert [p.layer_counts for p in distinct.pipelines] == [(2, 2), (2, 2), (1, 3), (1, 3)]


@settings(max_examples=30, deadline=None)
@given(data=st.data(), dp=st.integers(2, 4), pp=st.integers(1, 3), micro_batches=st.integers(1, 4),
       decouple=st.booleans(), staggered=st.booleans())
def test_a_worker_at_slowdown_one_is_priced_exactly_as_without_slowdowns(data, dp, pp, micro_batches, decouple,
                                                                          staggered):
    """The straggler pricing (``slowdowns``) changes nothing at a factor of 1, on every
    kind of plan and pricing: a straggler kept is priced against what every decision prices."""
    profile = replace(uniform_profile(num_layers=2 * pp, forward_s=1.0, backward_s=2.0, layer_state_bytes=10,
                                      activation_bytes=1), p2p_bytes=1)
    plan = symmetric_plan(dp=dp, pp=pp, num_layers=2 * pp, micro_batches_per_pipeline=micro_batches)
    failed = data.draw(st.sets(st.sampled_from(plan.workers), max_size=1))
    plan = reroute_plan(plan, failed_workers=failed, profile=profile) if failed else plan
    worker = data.draw(st.sampled_from(sorted(set(plan.workers) - failed)))
    cluster = ClusterState(world_size=dp * pp, devices_per_node=2)
    pricing = Pricing(decouple=decouple, staggered=staggered)
    assert estimate_plan(plan, profile, cluster, pricing=pricing, slowdowns={worker: 1.0}) == estimate_plan(
        plan, profile, cluster, pricing=pricing)


@pytest.mark.parametrize("failed", [(), (3,)], ids=["failure-free", "rerouted"])
def test_the_priced_step_rises_with_a_workers_slowdown_and_only_its_pipeline_splits_off(failed):
    """DP 2 x PP 2 (workers 0 -> 2 and 1 -> 3), worker 2 slowed: every step waits for its
    ops, so the step gets slower with each factor; the pipelines no longer time alike."""
    profile = uniform_profile(num_layers=4, forward_s=1.0, backward_s=2.0)
    plan = symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=4)
    plan = reroute_plan(plan, failed_workers=set(failed), profile=profile) if failed else plan
    cluster = ClusterState(world_size=4, devices_per_node=8)
    steps = [estimate_plan(plan, profile, cluster, slowdowns={2: factor}).step_time_s
             for factor in (1.0, 1.2, 2.0, 4.0)]
    assert steps == sorted(set(steps)), steps  # strictly rising
    assert steps[-1] > 2 * steps[0]
    assert len(distinct_pipelines(plan, cluster, slowdowns={2: 2.0})[0].pipelines) == 2
    assert len(distinct_pipelines(plan, cluster, slowdowns={2: 1.0})[0].pipelines) == (2 if failed else 1)
