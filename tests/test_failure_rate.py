"""Eq. 8's horizon from evidence: the failure rate the run has seen replaces the prior at
the first failure, and where no worker comes back the horizon ends with the run."""

from __future__ import annotations

import json

import pytest

from helpers import symmetric_plan
from odyssey_megatron.cli import main
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import OdysseyConfig, load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.planner import FailureRateModel, eq8_horizon_s
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.runtime.control.decision_record import decision_record
from odyssey_megatron.simulator.odyssey import scenario_failure_model
from odyssey_megatron.simulator.scenario import FailureConfig

PROFILE = uniform_profile(num_layers=8, forward_s=0.1, backward_s=0.2)
PLAN = with_sync(symmetric_plan(dp=2, pp=4, num_layers=8, micro_batches_per_pipeline=8), PROFILE)
"""DP 2 x PP 4 on 8 workers: after worker 1 fails, a reroute costs 1 s and trains 1.67
samples/s; a 30 s reparallelize trains 2.5. Eq. 8 reparallelizes once the horizon is
over about 88 s."""


def _center(device_mtbf_hours: float) -> DecisionCenter:
    settings = OdysseyConfig(reparallelize_restart_s=30, checkpoint_restart_penalty_s=0,
                             device_mtbf_hours=device_mtbf_hours)
    return DecisionCenter(plan=PLAN, cluster=ClusterState(world_size=8, devices_per_node=8), profile=PROFILE,
                          settings=settings.decisions, search_time_s=0.0)


def test_the_prior_holds_until_the_first_failure_then_the_failures_seen_over_the_exposure_alone():
    model = FailureRateModel(device_mtbf_hours=10)
    model.observe(failures=0, device_hours=1000)  # failure-free hours: still no failure to rate by
    assert model.rate_per_device_hour == 0.1 and model.source == "the prior odyssey.device_mtbf_hours=10"
    model.observe(failures=1, device_hours=49_000)  # Llama 3's rate: a failure per ~50,000 device-hours
    assert model.rate_per_device_hour == pytest.approx(1 / 50_000)  # the hours before it count as evidence
    assert model.expected_interval_s(1024) == pytest.approx(50_000 / 1024 * 3600)  # ~49 h, not the prior's 35 s
    assert model.source == "1 failure(s) seen over 5e+04 device-hours"
    fixed = FailureRateModel(device_mtbf_hours=2e5, learn=False, given_by="the scenario's rate")
    fixed.observe(failures=3, device_hours=10)
    assert fixed.rate_per_device_hour == 1 / 2e5 and fixed.source == "the scenario's rate"


def test_the_horizon_is_the_interval_cut_at_the_runs_end_where_no_worker_comes_back():
    assert eq8_horizon_s(interval_s=100.0, time_left_s=None) == 100.0  # repairs: the interval
    assert eq8_horizon_s(interval_s=100.0, time_left_s=40.0) == 40.0
    assert eq8_horizon_s(interval_s=100.0, time_left_s=400.0) == 100.0
    assert eq8_horizon_s(interval_s=100.0, time_left_s=0.0) == 100.0  # past a live run's estimated end


def test_the_failures_seen_flip_eq8_from_reroute_to_reparallelize():
    """The prior, a failure per device every 6 minutes, gives 51 s to the next failure among
    7 survivors: the 30 s reparallelize does not pay back. The first failure coming only
    after 90 s on 8 devices says 103 s: it does. (A prior worth one failure, blended in,
    said 77 s: reroute.)"""
    prior = _center(device_mtbf_hours=0.1).on_failure(ranks=[1])
    assert prior.chosen.policy == "reroute" and prior.interval_source == "the prior odyssey.device_mtbf_hours=0.1"
    seen = _center(device_mtbf_hours=0.1).on_failure(ranks=[1], at_s=90.0)
    assert seen.chosen.policy == "reparallelize"
    assert seen.expected_interval_s == seen.horizon_s == pytest.approx(8 * 90 / 7)
    assert seen.interval_source == "1 failure(s) seen over 0.2 device-hours"


def test_a_straggler_removed_alive_is_no_failure_for_the_rate_only_exposure():
    """A rank taken out for being slow did not fail: counted as a failure 90 s into a run,
    it would set the rate at one per 0.2 device-hours and cut every later horizon (a live
    run's recovery after a removal saw 2.1 s). Its device-hours still count."""
    center = _center(device_mtbf_hours=0.1)
    removal = center.on_failure(ranks=[1], at_s=90.0, removed=True)
    assert removal.interval_source == "the prior odyssey.device_mtbf_hours=0.1"
    later = center.on_failure(ranks=[2], at_s=180.0)
    assert later.interval_source == "1 failure(s) seen over 0.375 device-hours"


def test_a_run_ending_before_a_reparallelize_pays_back_reroutes():
    """Failures rare (10,000 h a device): reparallelize, over the interval; with a minute
    left and no repairs, Eq. 8 weighs over that minute and reroutes."""
    rare = _center(device_mtbf_hours=1e4).on_failure(ranks=[1])
    ending = _center(device_mtbf_hours=1e4).on_failure(ranks=[1], time_left_s=60.0)
    assert rare.chosen.policy == "reparallelize" and rare.horizon_s == rare.expected_interval_s
    assert ending.chosen.policy == "reroute"
    assert ending.horizon_s == 60.0 and ending.expected_interval_s == rare.expected_interval_s
    by_policy = {c.policy: c for c in (ending.chosen, *ending.alternatives)}
    assert by_policy["reroute"].score > by_policy["reparallelize"].score


def test_the_simulator_weighs_by_the_scenarios_rate_unless_it_asks_to_learn():
    model = scenario_failure_model(FailureConfig(rate_per_device_hour=0.002, unit="node"), learn=False)
    assert model.rate_per_device_hour == pytest.approx(0.002) and not model.learn
    assert model.source == "the scenario's failures.rate_per_device_hour=0.002"
    assert scenario_failure_model(FailureConfig(), learn=True) is None  # the recipe's prior, learned
    traced = FailureConfig(process="trace", trace="failures.csv")
    assert scenario_failure_model(traced, learn=False) is None  # a trace has no rate to take


def test_plan_json_reports_the_horizon_and_where_its_rate_came_from(capsys):
    assert main(["plan", "--config", "recipes/llama2_7b/ascend_910b_32.yaml", "--json"]) == 0
    decision = json.loads(capsys.readouterr().out)
    assert decision["expected_interval_source"] == "the prior odyssey.device_mtbf_hours=10"
    assert decision["horizon_s"] == decision["expected_interval_s"] == pytest.approx(10 * 3600 / 32)


def test_the_live_runs_decision_events_say_the_horizon_and_where_its_rate_came_from():
    center = DecisionCenter.from_recipe(load_config("recipes/llama2_7b/ascend_910b_32.yaml"))
    decision = center.on_failure(ranks=[5], at_s=3600.0)
    record = decision_record(decision, center, start_step=10, committed=10)
    assert record["interval_source"] == "1 failure(s) seen over 32 device-hours"
    assert record["expected_interval_s"] == record["horizon_s"] == pytest.approx(32 * 3600 / 31)
