"""A straggler priced like a failure (``DecisionCenter.on_straggler``, ``planner.straggler``):
the current plan with the slow rank's ops stretched by its measured slowdown, against the
plan a failure of that rank would get, its transition included, over the same Eq. 8
horizon.

The profile: 8 identical layers (forward 0.1 s, backward 0.2 s), 8 micro-batches per
pipeline; a rerouted stage costs 1 s to restart."""

from __future__ import annotations

import pytest

from helpers import symmetric_plan
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import OdysseyConfig
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import with_sync

PROFILE = uniform_profile(num_layers=8, forward_s=0.1, backward_s=0.2)


def _center(*, dp: int, pp: int, reparallelize_restart_s: float = 1.0, device_mtbf_hours: float = 10.0,
            ) -> DecisionCenter:
    plan = with_sync(symmetric_plan(dp=dp, pp=pp, num_layers=8, micro_batches_per_pipeline=8), PROFILE)
    settings = OdysseyConfig(reroute_restart_s=1.0, reparallelize_restart_s=reparallelize_restart_s,
                             checkpoint_restart_penalty_s=0, device_mtbf_hours=device_mtbf_hours)
    return DecisionCenter(plan=plan, cluster=ClusterState(world_size=dp * pp, devices_per_node=8), profile=PROFILE,
                          settings=settings.decisions, search_time_s=0.0)


def test_a_rank_1_6x_slow_with_spare_dp_peers_over_a_long_horizon_is_removed_and_nothing_is_committed():
    """DP 4 x PP 2, rank 7 (stage 1 of pipeline 3) at 1.6x: kept, every step waits for it
    (10 s -> 15.4 s); without it three pipelines' worth of peers train 12 s steps after a
    second of transition, which the hours to the next failure pay back many times."""
    center = _center(dp=4, pp=2)
    plan, cluster, step_s = center.plan, center.cluster, center.estimate.step_time_s
    decision = center.on_straggler(rank=7, slowdown=1.6)
    assert decision.remove and decision.removal is not None
    prices = decision.prices
    assert prices["kept_step_s"] == pytest.approx(1.536 * step_s)  # its stage is the pipeline's bottleneck
    assert prices["removed_step_s"] < prices["kept_step_s"] and prices["transition_s"] == pytest.approx(1.0)
    assert prices["removed_score"] > prices["kept_score"]
    assert decision.horizon_s == pytest.approx(3600 * 10 / 7)  # the 7 devices left, as on_failure weighs
    assert decision.summary.startswith("removal pays over Eq. 8's 5143 s horizon: kept 15.4 s/step, without it 12 s")
    assert center.plan is plan and center.cluster is cluster  # priced only: the removal is a failure to come
    assert center.failure_model.observed_failures == 0
    removed = center.on_failure(ranks=[7])  # the failure it turns into is the decision it priced
    assert removed.chosen.plan.pipelines == decision.removal.chosen.plan.pipelines


def test_a_rank_only_slightly_slow_is_cheaper_to_keep():
    """1.1x on the same plan: 10.6 s steps kept beat the 12 s of the plan without it."""
    decision = _center(dp=4, pp=2).on_straggler(rank=7, slowdown=1.1)
    assert not decision.remove
    assert decision.prices["kept_step_s"] < decision.prices["removed_step_s"]
    assert decision.summary.startswith("removal does not pay over Eq. 8's")


def test_a_slow_rank_whose_removal_costs_a_long_reparallelize_over_a_short_horizon_is_kept():
    """DP 2 x PP 2 at 1.6x (15.4 s steps kept). Over the hours to the next failure the
    2-minute reparallelize (13.6 s steps) pays; with 5 minutes left in a run without
    repairs it does not, nor does the reroute (19.2 s steps): the rank is kept."""
    center = _center(dp=2, pp=2, reparallelize_restart_s=120.0)
    long = center.on_straggler(rank=3, slowdown=1.6)
    assert long.remove and long.removal.chosen.policy == "reparallelize"
    assert long.prices["transition_s"] == pytest.approx(120.0)
    short = center.on_straggler(rank=3, slowdown=1.6, time_left_s=300.0)
    assert short.horizon_s == 300.0 and not short.remove
    assert short.prices["kept_step_s"] == long.prices["kept_step_s"]
    assert {c.policy for c in (short.removal.chosen, *short.removal.alternatives)} == {"reroute", "reparallelize"}
    assert all(c.score < short.kept.score for c in (short.removal.chosen, *short.removal.alternatives))


def test_a_straggler_with_no_plan_without_it_is_kept_and_says_why():
    """One pipeline of four stages: the slow rank alone holds its layers, and an in-memory
    run with no snapshot has no plan that goes on without them."""
    plan = with_sync(symmetric_plan(dp=1, pp=4, num_layers=8, micro_batches_per_pipeline=8), PROFILE)
    center = DecisionCenter(plan=plan, cluster=ClusterState(world_size=4, devices_per_node=8), profile=PROFILE,
                            settings=OdysseyConfig().decisions, search_time_s=0.0)
    decision = center.on_straggler(rank=2, slowdown=4.0, in_memory=True)
    assert not decision.remove and decision.removal is None
    assert decision.prices["removed_step_s"] is None and decision.prices["kept_step_s"] > center.estimate.step_time_s
    assert decision.summary.startswith("no plan goes on without it (blocks 4, 5 were lost on every replica")
