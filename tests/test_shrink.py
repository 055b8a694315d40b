"""``odyssey.batch_on_failure: shrink``: after a failure Eq. 8 may drop the broken
pipelines' micro-batches (``planner.shrink``), charged for the samples it drops, weighed
over how long a smaller batch lasts, and the recipe's batch stays the target."""

from __future__ import annotations

import json

import pytest

from helpers import decide, symmetric_plan
from odyssey_megatron.cli import main
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import OdysseyConfig, load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.plan import validate_plan
from odyssey_megatron.planner import FailureRateModel
from odyssey_megatron.planner.shrink import batch_horizon_s, shrunk_plan
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.runtime.control.decision_record import decision_record
from odyssey_megatron.simulator.engine import run_system
from odyssey_megatron.simulator.events import FAIL, JOIN, ClusterEvent
from odyssey_megatron.simulator.odyssey import OdysseySystem
from odyssey_megatron.simulator.system import SimulationContext


def _job(*, dp: int, pp: int, layers: int, per_pipeline: int):
    profile = uniform_profile(num_layers=layers)
    return profile, with_sync(symmetric_plan(dp=dp, pp=pp, num_layers=layers,
                                             micro_batches_per_pipeline=per_pipeline), profile)


def _center(plan, profile, *, world_size: int, mode: str) -> DecisionCenter:
    return DecisionCenter(plan=plan, cluster=ClusterState(world_size=world_size, devices_per_node=2),
                          profile=profile, settings=OdysseyConfig(batch_on_failure=mode).decisions,
                          search_time_s=0.0)


def test_the_shrunk_plan_is_the_whole_pipelines_with_their_own_micro_batches_and_the_broken_ones_idle():
    profile, plan = _job(dp=4, pp=2, layers=8, per_pipeline=3)
    shrunk = shrunk_plan(plan, failed_workers={5})  # stage 1 of pipeline 1
    assert shrunk.policy == "shrink" and shrunk.generation == plan.generation + 1
    assert [p.stages for p in shrunk.pipelines] == [plan.pipelines[i].stages for i in (0, 2, 3)]
    assert shrunk.reroutes == () and shrunk.transfers == () and 1 not in shrunk.workers
    validate_plan(shrunk, num_micro_batches=9)  # the first 9 of the 12: the rest of each step is dropped
    assert shrunk_plan(plan, failed_workers=set()) is None  # nothing broken
    assert shrunk_plan(plan, failed_workers={4, 5, 6, 7}) is None  # nothing whole


def test_with_shrink_a_failure_where_dropping_beats_rerouting_drops_the_broken_pipelines_batch():
    """DP8 x PP2, 2 micro-batches a pipeline: a reroute gives one peer a stage's two
    micro-batches (36 s a step, 16 micro-batches: 0.444 a second), dropping them trains 14
    in the failure-free 28 s (0.5), and no reparallelized layout of 15 workers beats it."""
    profile, plan = _job(dp=8, pp=2, layers=8, per_pipeline=2)
    cluster = ClusterState(world_size=16, devices_per_node=2).fail_ranks([1])
    kept = decide(current=plan, cluster=cluster, profile=profile, settings=OdysseyConfig(), interval_s=1e5)
    shrunk = decide(current=plan, cluster=cluster, profile=profile,
                    settings=OdysseyConfig(batch_on_failure="shrink"), interval_s=1e5, search_time_s=0.0)
    assert kept.chosen.policy == "reroute"
    assert all(c.policy != "shrink" and c.dropped_micro_batches == 0 and c.batch_score is None
               for c in (kept.chosen, *kept.alternatives)) and kept.batch_horizon_s == 0.0
    chosen = shrunk.chosen
    assert chosen.policy == "shrink" and chosen.plan.num_micro_batches == 14 and chosen.transition_s == 1.0
    assert chosen.dropped_micro_batches == 2 and chosen.dropped_samples_per_step == 2 * profile.samples_per_micro_batch
    assert chosen.estimate.samples_per_s == pytest.approx(0.5) and chosen.estimate.step_time_s == 28.0
    reroute = next(c for c in shrunk.alternatives if c.policy == "reroute")
    assert chosen.batch_score > reroute.batch_score and shrunk.batch_horizon_s == 1e5


def test_a_smaller_batch_is_charged_for_the_samples_it_drops_not_chosen_for_its_shorter_step():
    """DP4 x PP4, 2 micro-batches a pipeline: the shrunk plan's step is the shorter (44 s
    against the reroute's 48 s), but it trains 6 micro-batches where the reroute trains 8."""
    profile, plan = _job(dp=4, pp=4, layers=16, per_pipeline=2)
    cluster = ClusterState(world_size=16, devices_per_node=2).fail_ranks([1])
    decision = decide(current=plan, cluster=cluster, profile=profile,
                      settings=OdysseyConfig(batch_on_failure="shrink"), interval_s=1e5)
    shrink = next(c for c in decision.alternatives if c.policy == "shrink")
    assert shrink.estimate.step_time_s < decision.chosen.estimate.step_time_s
    assert shrink.estimate.samples_per_s < decision.chosen.estimate.samples_per_s
    assert decision.chosen.dropped_micro_batches == 0


def test_a_smaller_batch_is_weighed_over_the_rest_of_a_run_without_repairs_so_it_does_not_lock_in():
    """Built like issue 45's 7B node cell at toy scale: DP4 x PP2, 4 micro-batches a
    pipeline, one worker fails, 80 s to the next failure. Reparallelizing trains 0.25
    samples a second after an 8 s transition, dropping a pipeline 0.231 after 1 s: over
    80 s dropping scores the higher (0.228 against 0.225), over the run's rest the whole
    batch does. Without repairs nothing ends the smaller batch but a later transition, so
    it is weighed over the run's rest; with repairs a join ends it, and the 80 s decide."""
    profile, plan = _job(dp=4, pp=2, layers=8, per_pipeline=4)
    cluster = ClusterState(world_size=8, devices_per_node=2).fail_ranks([1])
    without_repairs = _center(plan, profile, world_size=8, mode="shrink").on_failure(
        workers=[1], interval_s=80.0, time_left_s=1e5)
    with_repairs = _center(plan, profile, world_size=8, mode="shrink").on_failure(workers=[1], interval_s=80.0)
    assert without_repairs.chosen.policy == "reparallelize" and without_repairs.chosen.plan.num_micro_batches == 16
    assert without_repairs.horizon_s == 80.0 and without_repairs.batch_horizon_s == 1e5
    shrink = next(c for c in without_repairs.alternatives if c.policy == "shrink")
    assert shrink.score > without_repairs.chosen.score  # the next failure alone would have kept it
    assert with_repairs.chosen.policy == "shrink" and with_repairs.batch_horizon_s == 80.0
    kept = decide(current=plan, cluster=cluster, profile=profile, settings=OdysseyConfig(), interval_s=80.0,
                  search_time_s=0.0)
    assert kept.chosen.policy == without_repairs.chosen.policy == "reparallelize"


def test_the_recipes_batch_stays_the_target_after_a_shrink_and_a_join_goes_back_to_it():
    """After the shrink of the DP8 x PP2 job, every reparallelized candidate trains the 16
    micro-batches, and the repaired worker's join goes back to them (0.667 samples a second
    on all 16 workers, where the shrunk plan trains 0.5)."""
    profile, plan = _job(dp=8, pp=2, layers=8, per_pipeline=2)
    center = _center(plan, profile, world_size=16, mode="shrink")
    assert center.on_failure(workers=[1], interval_s=1e5).chosen.policy == "shrink"
    assert center.plan.num_micro_batches == 14 and center.batch_target.micro_batches == 16
    joined = center.on_join(workers=[1], interval_s=1e5)
    assert all(c.plan.num_micro_batches == 16 for c in (joined.chosen, *joined.alternatives)
               if c.policy == "reparallelize")
    assert joined.chosen.policy == "reparallelize" and joined.chosen.dropped_micro_batches == 0
    validate_plan(center.plan, num_micro_batches=16)
    kept = next(c for c in joined.alternatives if c.dropped_micro_batches)
    assert kept.plan is joined.replaced and kept.batch_score < joined.chosen.batch_score


def test_a_failure_after_a_shrink_weighs_whole_pipelines_re_formed_from_every_survivor_against_the_whole_batch():
    """A second failure of the shrunk DP8 x PP2 job leaves 14 workers: dropping the second
    broken pipeline too trains 12 micro-batches on 12 of them; 7 pipelines re-formed from all
    14, each with the job's share of 2 (what replica drop trains on them), train 14 after the
    broken pipelines' survivors take the stages they lost (0.5 a second); the best plan of
    the whole batch, 16 on 14 workers, trains 0.444."""
    profile, plan = _job(dp=8, pp=2, layers=8, per_pipeline=2)
    center = _center(plan, profile, world_size=16, mode="shrink")
    center.on_failure(workers=[1], interval_s=1e5)
    after = center.on_failure(workers=[2], interval_s=1e5)
    chosen = after.chosen
    assert chosen.policy == "shrink" and chosen.plan.num_micro_batches == 14 and len(chosen.plan.pipelines) == 7
    assert sorted(chosen.plan.workers) == sorted(center.cluster.alive_workers) and chosen.plan.transfers
    assert chosen.estimate.samples_per_s == pytest.approx(0.5)
    whole = [c for c in after.alternatives if c.policy == "reparallelize"]
    assert whole and all(c.plan.num_micro_batches == 16 and c.estimate.samples_per_s < 0.5 for c in whole)
    weighed = [c for c in after.alternatives if c.batch_score is not None]
    assert {c.dropped_micro_batches for c in weighed} >= {0, 4} and all(
        c.batch_score < chosen.batch_score for c in weighed)


def test_the_batch_horizon_is_the_runs_rest_without_repairs_and_never_shorter_than_eq8s():
    assert batch_horizon_s(horizon_s=80.0, time_left_s=1e5) == 1e5
    assert batch_horizon_s(horizon_s=80.0, time_left_s=None) == 80.0
    assert batch_horizon_s(horizon_s=80.0, time_left_s=0.0) == 80.0  # a live run past its end
    assert batch_horizon_s(horizon_s=80.0, time_left_s=30.0) == 80.0


def test_plan_json_and_the_decision_events_say_what_a_plan_drops(capsys):
    recipe = "recipes/llama2_7b/ascend_910b_32.yaml"
    assert main(["plan", "--config", recipe, "--failed", "5", "odyssey.batch_on_failure=shrink", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dropped_micro_batches"] == 0 and out["batch_horizon_s"] == out["horizon_s"] > 0
    shrink = next(c for c in out["candidates"] if c["policy"] == "shrink")
    assert shrink["dropped_micro_batches"] == 8 and shrink["layout"] == "[8,8,8,8]x7"
    assert shrink["dropped_samples_per_step"] == 8 * load_config(recipe).training.micro_batch_size
    center = DecisionCenter.from_recipe(load_config(recipe, ["odyssey.batch_on_failure=shrink"]))
    record = decision_record(center.on_failure(ranks=[5]), center, start_step=0, committed=0)
    assert record["batch_horizon_s"] == record["horizon_s"]
    assert [c["dropped_samples_per_step"] for c in record["alternatives"] if c["policy"] == "shrink"] == \
        [shrink["dropped_samples_per_step"]]


def test_odyssey_shrink_in_the_simulator_counts_the_samples_it_drops_until_a_join_restores_the_batch():
    """The DP8 x PP2 job of the tests above in the simulator: Odyssey with shrink drops the
    broken pipeline's 2 micro-batches a step from the failure at 100 s to the join at 1,100 s
    (counted as replica drop's are), and goes back to the whole batch there; Odyssey that
    keeps the batch reroutes and drops nothing."""
    profile = uniform_profile(num_layers=8)
    context = SimulationContext(
        profile=profile, num_layers=8, tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=8,
        num_micro_batches=16, devices_per_node=2, restart_s=100.0, checkpoint_interval_s=1000.0,
        checkpoint_save_s=0.0, checkpoint_load_s=50.0, pricing=OdysseyConfig().pricing)
    cluster = ClusterState(world_size=16, devices_per_node=2)
    events = [ClusterEvent(100.0, FAIL, (1,)), ClusterEvent(1100.0, JOIN, (1,))]
    timelines = {}
    for mode in ("keep", "shrink"):
        system = OdysseySystem(context, settings=OdysseyConfig(batch_on_failure=mode), detection_s=5.0,
                               decision_s=0.0, failure_model=FailureRateModel(device_mtbf_hours=1e3, learn=False))
        timelines[mode] = run_system(system, cluster=cluster, events=events, duration_s=2000.0,
                                     checkpoint_duty=1.0)
    assert timelines["keep"].dropped_samples == 0.0
    shrunk = [s for s in timelines["shrink"].segments if s.dropped_per_s > 0]
    assert [(s.start_s, s.end_s) for s in shrunk] == [(100.0 + 5.0 + 1.0, 1100.0)]
    assert shrunk[0].samples_per_s == pytest.approx(14 * profile.samples_per_micro_batch / 28.0)
    assert timelines["shrink"].dropped_samples == pytest.approx(2 * profile.samples_per_micro_batch / 28.0 * 994.0)
    assert timelines["shrink"].segments[-1].samples_per_s > shrunk[0].samples_per_s
    assert timelines["shrink"].segments[-1].dropped_per_s == 0.0
