"""Plans the runtime can trust: every transfer comes from a real holder, and a reroute is
never priced faster than the failure-free plan it degrades.

The runtime will execute these transfers and act on these estimates, so both are
checked on the paper-style worked cases that once went wrong and on random clusters,
layouts and failure sequences (cascading, one to three workers at once, repairs, TP 1
and 2, tied embeddings), where brute force over small cases finds what worked examples
miss.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import asymmetric_plan, costly_edges_profile, decide, layouts, symmetric_plan
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import OdysseyConfig, load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.estimator.optimizer import optimizer_time
from odyssey_megatron.plan import Transfer, validate_plan
from odyssey_megatron.planner import FailureRateModel, UnrecoverableFailure, initial_plan, reroute_plan
from odyssey_megatron.planner.normalize import normalize_failures
from odyssey_megatron.planner.reparallelize import ReparallelizeSearch
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import TransferError, check_transfers, live_holdings, plan_transfers
from odyssey_megatron.settings import PLAIN, Pricing

OPTIONS = [PLAIN, Pricing(decouple=True), Pricing(decouple=True, staggered=True)]
"""Every combination of schedule options a plan may be priced and run with."""


def _decide(current, cluster, profile, policy, **settings):
    return decide(current=current, cluster=cluster, profile=profile,
                  settings=OdysseyConfig(policy=policy, **settings),
                  failure_model=FailureRateModel(device_mtbf_hours=10), search_time_s=0.0)


def _assert_trustworthy(decision, current, cluster, profile, num_micro_batches):
    holdings = live_holdings(current, cluster=cluster, profile=profile)
    for candidate in (decision.chosen, *decision.alternatives):
        plan = candidate.plan
        validate_plan(plan, num_micro_batches=num_micro_batches)
        assert not set(plan.workers) & cluster.failed_workers
        if plan is not current:
            check_transfers(plan, holdings=holdings, profile=profile, cluster=cluster)


# -- the validator itself -------------------------------------------------------------


def test_the_validator_refuses_a_copy_between_two_workers_that_hold_nothing():
    """The stale-layout bug: 7 layers, DP3 x PP3 (2, 2, 3), workers 6 and 8 (stage 2 of
    pipelines 0 and 2) fail, normalization moves workers 3 and 5 into stage 2, and the old
    code sent layers 4-6 and the head 5 -> 3 and 3 -> 5: neither holds them, worker 7
    does. The validator refuses that list and accepts the one planned now, where worker
    7, the only holder, sends both copies."""
    profile = costly_edges_profile(7)
    layout = asymmetric_plan([(2, 2, 3)] * 3, [1, 1, 1], worker_of=lambda d, s: 3 * s + d)
    cluster = ClusterState(world_size=9, devices_per_node=9).fail_ranks([6, 8])
    holdings = live_holdings(layout, cluster=cluster, profile=profile)
    moved = asymmetric_plan([(2, 2, 3)] * 3, [1, 1, 1], worker_of=lambda d, s: [[0, 6, 3], [1, 4, 7], [2, 8, 5]][d][s])
    rerouted = reroute_plan(moved, failed_workers={6, 8}, profile=profile)
    stage_2 = [4, 5, 6, "output"]
    cycle = tuple(Transfer(b, src, dst, profile.block(b).state_bytes) for src, dst in ((5, 3), (3, 5)) for b in stage_2)
    with pytest.raises(TransferError, match="rank 5 sends block 4 to rank 3 but does not hold it"):
        check_transfers(replace(rerouted, transfers=cycle), holdings=holdings, profile=profile, cluster=cluster)
    planned = plan_transfers(rerouted, holdings=holdings, profile=profile, cluster=cluster)
    assert {(t.layer, t.src, t.dst) for t in planned} == {(b, 7, dst) for b in stage_2 for dst in (3, 5)}
    check_transfers(replace(rerouted, transfers=planned), holdings=holdings, profile=profile, cluster=cluster)


def test_the_validator_names_each_way_a_transfer_list_can_be_wrong():
    profile = costly_edges_profile(4)
    layout = symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2)  # stage s of pipeline d: 2s + d
    cluster = ClusterState(world_size=6, devices_per_node=6).fail_ranks([1])
    holdings = live_holdings(layout, cluster=cluster, profile=profile)  # worker 4 idle, holds nothing
    filled = asymmetric_plan([(2, 2)] * 2, [2, 2], worker_of=lambda d, s: [[0, 2], [4, 3]][d][s])
    good = plan_transfers(filled, holdings=holdings, profile=profile, cluster=cluster)
    assert {(t.layer, t.src, t.dst) for t in good} == {("embedding", 0, 4), (0, 0, 4), (1, 0, 4)}

    def refused(transfers, match):
        with pytest.raises(TransferError, match=match):
            check_transfers(replace(filled, transfers=tuple(transfers)), holdings=holdings, profile=profile,
                            cluster=cluster)

    refused(good[1:], "rank 4 .* receives block 'embedding' 0 times")
    refused([*good, good[0]], "receives block 'embedding' 2 times")
    refused([replace(good[0], src=None), *good[1:]], "read from the checkpoint though worker 0 holds it")
    refused([*good, Transfer(2, 2, 3, 100)], "rank 3 receives block 2, which its worker already holds")
    refused([*good, Transfer(2, 2, 0, 100)], "rank 0 receives block 2, which its stage does not hold")
    refused([replace(good[0], bytes=1), *good[1:]], "moves 1 bytes")
    refused([*good, Transfer(2, 2, 1, 100)], "rank 1, which is not alive")
    check_transfers(replace(filled, transfers=good), holdings=holdings, profile=profile, cluster=cluster)


def test_the_validator_refuses_a_rerouting_peer_of_another_stage():
    """A failed stage's micro-batches may only go to a worker holding that stage's blocks."""
    profile = costly_edges_profile(4)
    plan = symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2)
    cluster = ClusterState(world_size=4, devices_per_node=4).fail_ranks([1])
    rerouted = reroute_plan(plan, failed_workers={1}, profile=profile)
    holdings = live_holdings(plan, cluster=cluster, profile=profile)
    check_transfers(rerouted, holdings=holdings, profile=profile, cluster=cluster)
    wrong = replace(rerouted, reroutes=tuple(replace(r, worker=2) for r in rerouted.reroutes))
    with pytest.raises(TransferError, match="worker 2 runs stage 0 of pipeline 1 but does not hold"):
        check_transfers(wrong, holdings=holdings, profile=profile, cluster=cluster)


def test_tensor_parallel_shards_go_rank_k_to_rank_k():
    profile = costly_edges_profile(4)
    layout = replace(symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2), tensor_parallel_size=2)
    cluster = ClusterState(world_size=10, tensor_parallel_size=2, devices_per_node=10).fail_ranks([2])  # worker 1
    holdings = live_holdings(layout, cluster=cluster, profile=profile)
    filled = replace(asymmetric_plan([(2, 2)] * 2, [2, 2], worker_of=lambda d, s: [[0, 2], [4, 3]][d][s]),
                     tensor_parallel_size=2)
    good = plan_transfers(filled, holdings=holdings, profile=profile, cluster=cluster)
    assert {(t.src, t.dst) for t in good} == {(0, 8), (1, 9)}
    crossed = [replace(t, src=1 - t.src) for t in good]
    with pytest.raises(TransferError, match="TP rank 1 .* sends to TP rank 0"):
        check_transfers(replace(filled, transfers=tuple(crossed)), holdings=holdings, profile=profile,
                        cluster=cluster)


# -- the worked cases that went wrong ---------------------------------------------------


def test_normalized_reroute_copies_from_the_only_real_holder():
    """7 layers, DP3 x PP3 (2, 2, 3), one micro-batch per pipeline, workers 6 and 8 fail,
    ``odyssey.policy=reroute``: worker 7 is the only live holder of stage 2, so whatever
    the survivors swap, every copy of stage 2 comes from it."""
    profile = costly_edges_profile(7)
    plan = asymmetric_plan([(2, 2, 3)] * 3, [1, 1, 1], worker_of=lambda d, s: 3 * s + d)
    cluster = ClusterState(world_size=9, devices_per_node=9).fail_ranks([6, 8])
    decision = _decide(plan, cluster, profile, "reroute")
    _assert_trustworthy(decision, plan, cluster, profile, 3)
    chosen = decision.chosen.plan
    assert {t.src for t in chosen.transfers if t.layer in (4, 5, 6, "output")} <= {7}


def test_a_survivor_moved_away_still_sends_what_it_held():
    """13 layers, DP2 x PP4 (4, 3, 3, 3), ranks 2 and 7 fail, reroute. Whatever worker
    takes over a stage receives it from a worker that held it before the swaps, also
    when that holder itself moved to another stage."""
    profile = costly_edges_profile(13)
    plan = asymmetric_plan([(4, 3, 3, 3)] * 2, [1, 1], worker_of=lambda d, s: 2 * s + d)
    cluster = ClusterState(world_size=8, devices_per_node=8).fail_ranks([2, 7])
    for options in ({}, {"decoupled_weight_grads": False, "staggered_optimizer": False}):
        decision = _decide(plan, cluster, profile, "reroute", **options)
        _assert_trustworthy(decision, plan, cluster, profile, 2)


def test_the_tiny_recipe_with_eleven_layers_plans_copies_from_real_holders():
    """The 11-layer DP3 x PP3 tiny model with ranks 1 and 2 failed chose a plan in which
    workers 5 and 7 copied stage 0 from each other."""
    config = load_config("recipes/llama2_7b/tiny_cpu.yaml", [
        "model.num_layers=11", "parallel.data_parallel_size=3", "parallel.pipeline_model_parallel_size=3",
        "training.global_batch_size=12", "training.micro_batch_size=2"])
    center = DecisionCenter.from_recipe(config)
    before = center.plan
    decision = center.on_failure(ranks=[1, 2])
    _assert_trustworthy(decision, before, center.cluster, center.profile, before.num_micro_batches)


def test_a_reroute_is_never_priced_faster_than_the_failure_free_plan():
    """DP2 x PP4, one layer per stage, F=1, B=2, one micro-batch per pipeline. Plain 1F1B:
    12 slots failure-free (Eq. 9), 14 with workers 2 and 4 rerouted. When only the
    rerouting peers split their backwards the reroute was priced at 11, faster than the
    failure-free plan; now both split: 9 failure-free, 10 rerouted."""
    profile = uniform_profile(num_layers=4)
    plan = symmetric_plan(dp=2, pp=4, num_layers=4, micro_batches_per_pipeline=1)
    rerouted = reroute_plan(plan, failed_workers={2, 4}, profile=profile)
    expected = {PLAIN: (12.0, 14.0), OPTIONS[1]: (9.0, 10.0), OPTIONS[2]: (9.0, 10.0)}
    for pricing in OPTIONS:
        times = tuple(estimate_plan(p, profile, pricing=pricing).step_time_s for p in (plan, rerouted))
        assert times == expected[pricing]


def test_repaired_workers_are_put_back_to_work():
    """A 30-layer Llama on 30 A100s (DP6 x PP5). With split backwards priced for the
    rerouting peers only, three failures gave a reroute (3.140 s) faster than the
    failure-free plan (3.174 s), and once the three were repaired the decision center
    kept the reroute and left them idle. Priced alike, the reroute is slower than the
    failure-free plan and the repaired workers train again."""
    config = load_config("recipes/llama2_7b/gpu_a100_32.yaml", [
        "model.num_layers=30", "parallel.data_parallel_size=6", "parallel.pipeline_model_parallel_size=5",
        "training.global_batch_size=48"])
    center = DecisionCenter.from_recipe(config)
    settings = config.odyssey
    fault_free = estimate_plan(center.plan, center.profile, center.cluster, pricing=settings.pricing).step_time_s
    failed = center.on_failure(ranks=[3, 10, 17])
    assert failed.chosen.policy == "reroute" and failed.chosen.estimate.step_time_s > fault_free
    before = center.plan
    repaired = center.on_join(ranks=[3, 10, 17])
    _assert_trustworthy(repaired, before, center.cluster, center.profile, before.num_micro_batches)
    assert len(center.plan.workers) == 30
    assert repaired.chosen.estimate.step_time_s <= fault_free


# -- properties on random clusters ----------------------------------------------------


@pytest.mark.parametrize("profile", [uniform_profile(num_layers=4), costly_edges_profile(4)], ids=["textbook", "costly-edges"])
def test_no_small_symmetric_reroute_beats_its_failure_free_plan(profile):
    """Brute force over DP2-3 x PP2-4 (one layer per stage on the textbook profile, its
    share of four on the other), one to three micro-batches per pipeline, every pair of
    failed workers and every combination of schedule options."""
    for dp, pp, per_pipeline in itertools.product((2, 3), (2, 3, 4), (1, 2, 3)):
        plan = symmetric_plan(dp=dp, pp=pp, num_layers=4, micro_batches_per_pipeline=per_pipeline)
        fault_free = [estimate_plan(plan, profile, pricing=pricing).step_time_s for pricing in OPTIONS]
        for failed in itertools.combinations(plan.workers, 2):
            rerouted = reroute_plan(plan, failed_workers=set(failed), profile=profile)
            if rerouted is None:
                continue
            for pricing, bound in zip(OPTIONS, fault_free):
                assert estimate_plan(rerouted, profile, pricing=pricing).step_time_s >= bound, (dp, pp, failed, pricing)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=layouts(), data=st.data())
def test_a_reroute_is_never_faster_than_its_failure_free_layout(case, data):
    """Removing workers can only add work to the survivors: however the failures fall, and
    wherever normalization moves them, the rerouted pipelines, DP sync and Adam step are
    priced no faster than the layout with every worker alive, under every combination of
    schedule options. (The global norm's all-reduce alone gets cheaper: its ring is shorter.)"""
    plan, cluster, profile = case
    failed = data.draw(st.sets(st.sampled_from(plan.workers), min_size=1, max_size=3))
    cluster = cluster.fail_ranks(r for w in failed for r in cluster.worker_ranks(w))

    def work_s(layout, options):
        estimate = estimate_plan(layout, profile, cluster, pricing=options)
        adam_s = optimizer_time(layout, profile, cluster, staggered=True)  # without the norm
        return estimate.pipeline_time_s + estimate.sync_time_s + adam_s

    for options in OPTIONS:
        fault_free = work_s(plan, options)
        normalized = normalize_failures(plan, new_failures=failed, cluster=cluster, profile=profile,
                                        cost=lambda p: estimate_plan(p, profile, cluster, pricing=options).step_time_s)
        for layout in {plan, normalized}:
            rerouted = reroute_plan(layout, failed_workers=failed, profile=profile)
            if rerouted is not None:
                assert work_s(rerouted, options) >= fault_free * (1 - 1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=layouts(), data=st.data())
def test_every_plan_through_a_failure_sequence_delivers_every_block(case, data):
    """Cascading failures of one to three workers at once, and repairs, under each policy:
    every plan the decision center returns is a valid plan whose transfers deliver every
    block its owners lack from a worker that holds it before the plan starts."""
    plan, cluster, profile = case
    if plan.num_micro_batches < len(plan.pipelines):
        return
    validate_plan(plan, num_micro_batches=plan.num_micro_batches)
    search = ReparallelizeSearch(profile, max_layer_splits=64)
    for _ in range(data.draw(st.integers(1, 3))):
        policy = data.draw(st.sampled_from(["auto", "reroute", "reparallelize"]))
        failed = sorted(cluster.failed_workers)
        if failed and data.draw(st.booleans()):
            back = data.draw(st.sets(st.sampled_from(failed), min_size=1))
            cluster = cluster.repair_ranks(r for w in back for r in cluster.worker_ranks(w))
        else:
            alive = cluster.alive_workers
            if len(alive) < 2:
                return
            down = data.draw(st.sets(st.sampled_from(alive), min_size=1, max_size=min(3, len(alive) - 1)))
            cluster = cluster.fail_ranks(r for w in down for r in cluster.worker_ranks(w))
        try:
            decision = decide(current=plan, cluster=cluster, profile=profile, search=search,
                              settings=OdysseyConfig(policy=policy, max_layer_splits=64),
                              failure_model=FailureRateModel(device_mtbf_hours=10), search_time_s=0.0)
        except UnrecoverableFailure:
            return
        _assert_trustworthy(decision, plan, cluster, profile, plan.num_micro_batches)
        plan = decision.chosen.plan


@settings(max_examples=40, deadline=None)
@given(case=layouts(), data=st.data())
def test_failure_free_plans_from_a_recipe_start_trustworthy(case, data):
    """``initial_plan`` then one failure, through ``DecisionCenter``-shaped calls: the
    plan after it passes the validator (the symmetric starting point of every recipe)."""
    _, cluster, profile = case
    dp, pp = data.draw(st.integers(1, 3)), data.draw(st.integers(1, min(3, profile.num_layers)))
    tp = cluster.tensor_parallel_size
    cluster = ClusterState(world_size=dp * pp * tp, tensor_parallel_size=tp, devices_per_node=cluster.devices_per_node)
    plan = initial_plan(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                        num_micro_batches=2 * dp, profile=profile, max_layer_splits=64)
    down = data.draw(st.sets(st.sampled_from(plan.workers), min_size=1, max_size=min(3, len(plan.workers))))
    cluster = cluster.fail_ranks(r for w in down for r in cluster.worker_ranks(w))
    try:
        decision = _decide(plan, cluster, profile, data.draw(st.sampled_from(["auto", "reroute", "reparallelize"])),
                           max_layer_splits=64)
    except UnrecoverableFailure:
        return
    _assert_trustworthy(decision, plan, cluster, profile, plan.num_micro_batches)
