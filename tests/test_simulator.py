"""Simulator: determinism, engine accounting, baseline mechanics, scenario errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import symmetric_plan

from odyssey_megatron.cli import main
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import OdysseyConfig, load_config
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.estimator.decoupled import decoupled_pipelines
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner import reroute_plan
from odyssey_megatron.estimator.closed_form import reroute_step_time, symmetric_step_time
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.profile_file import recipe_profile
from odyssey_megatron.settings import Pricing
from odyssey_megatron.simulator.checkpoint import CheckpointRestartSystem
from odyssey_megatron.simulator.restart import best_symmetric_layout
from odyssey_megatron.simulator.engine import Segment, Timeline, run_system
from odyssey_megatron.simulator.events import FAIL, JOIN, ClusterEvent, generate_events
from odyssey_megatron.simulator.odyssey import OdysseySystem, scenario_failure_model
from odyssey_megatron.simulator.recycle import ReCycleSystem
from odyssey_megatron.simulator.replicas import replica_layout
from odyssey_megatron.simulator.run import fault_scaled_ideal, simulate, simulation_context
from odyssey_megatron.simulator.scenario import SYSTEMS, FailureConfig, RepairConfig, load_scenario
from odyssey_megatron.simulator.system import (
    RECOVERING,
    RESTARTING,
    STOPPED,
    TRAINING,
    Outcome,
    SimulationContext,
    initial_layout,
)

SCENARIO = "configs/scenarios/paper_32npu.yaml"


def _context(**overrides) -> SimulationContext:
    fields = dict(
        profile=uniform_profile(num_layers=4, forward_s=1.0, backward_s=2.0), num_layers=4,
        tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=4, num_micro_batches=24,
        devices_per_node=8, restart_s=100.0, checkpoint_interval_s=1000.0, checkpoint_save_s=0.0,
        checkpoint_load_s=50.0, pricing=Pricing(decouple=True, staggered=True),  # the recipes' schedule options
    )
    fields.update(overrides)
    return SimulationContext(**fields)


class _Scripted:
    """A system whose outcomes are given, to check the engine's bookkeeping alone."""

    name = "scripted"

    def __init__(self, rate: float, outcomes: list[Outcome]):
        self.rate, self.outcomes = rate, list(outcomes)

    def start(self, cluster):
        return self.rate

    def on_failure(self, cluster, failed, now_s):
        return self.outcomes.pop(0)

    on_join = on_failure


def test_engine_accounts_pauses_rollbacks_and_overlapping_events():
    cluster = ClusterState(world_size=4, devices_per_node=4)
    events = [ClusterEvent(100.0, FAIL, (1,)), ClusterEvent(130.0, FAIL, (2,)), ClusterEvent(500.0, JOIN, (1,))]
    system = _Scripted(10.0, [
        Outcome(pause_s=50.0, samples_per_s=8.0, lost_s=20.0),  # the next failure comes mid-pause
        Outcome(pause_s=10.0, samples_per_s=6.0, lost_s=5.0, pause_state=RESTARTING),
        Outcome(pause_s=0.0, samples_per_s=9.0),
    ])
    timeline = run_system(system, cluster=cluster, events=events, duration_s=600.0, checkpoint_duty=1.0)
    states = [(s.start_s, s.end_s, s.state, s.samples_per_s, s.active_devices) for s in timeline.segments]
    assert states == [
        (0.0, 100.0, TRAINING, 10.0, 4),
        (100.0, 130.0, RECOVERING, 0.0, 3),
        (130.0, 140.0, RESTARTING, 0.0, 2),
        (140.0, 500.0, TRAINING, 6.0, 2),
        (500.0, 600.0, TRAINING, 9.0, 3),
    ]
    # 20 s at 10/s lost at the first failure; nothing trained since when the second came.
    assert timeline.lost_samples == 200.0
    assert timeline.samples == 100 * 10 + 360 * 6 + 100 * 9 - 200


def test_engine_stops_a_system_that_cannot_train():
    cluster = ClusterState(world_size=2, devices_per_node=2)
    system = _Scripted(5.0, [Outcome(pause_s=0.0, samples_per_s=0.0)])
    timeline = run_system(system, cluster=cluster, events=[ClusterEvent(10.0, FAIL, (0,))], duration_s=20.0,
                          checkpoint_duty=1.0)
    assert timeline.segments[-1].state == STOPPED and timeline.samples == 50.0


def test_checkpoint_restart_loses_work_since_the_last_checkpoint():
    context = _context()
    system = CheckpointRestartSystem(context)
    cluster = ClusterState(world_size=8, devices_per_node=8)
    assert system.start(cluster) == estimate_plan(initial_layout(context), context.profile, cluster,
                                                  pricing=context.pricing).samples_per_s  # the job's own plan
    outcome = system.on_failure(cluster.fail_ranks([3]), {3}, now_s=2350.0)
    assert outcome.lost_s == 350.0  # checkpoints at 0, 1000, 2000 s
    assert outcome.pause_s == 150.0 and outcome.pause_state == RESTARTING
    layout = best_symmetric_layout(context, 7)
    assert layout.data_parallel_size * layout.pipeline_parallel_size <= 7
    assert outcome.samples_per_s == layout.samples_per_s


def test_recycle_step_time_follows_the_rerouted_op_lists():
    """One failure in DP4 x PP2 with 6 micro-batches per pipeline: each of the 3 peers
    adopts 2 micro-batches (Eq. 12's N_m / (N_dp - 1)); the estimator's op lists fit them
    within Eq. 12's bound. Healthy, split backwards fill 1F1B's bubbles: 38 slots, where
    Eq. 9 gives 42."""
    context = _context()
    system = ReCycleSystem(context, detection_s=5.0, reroute_s=1.0)
    cluster = ClusterState(world_size=8, devices_per_node=8)
    healthy = system.start(cluster)
    assert symmetric_step_time(num_stages=2, num_micro_batches=6, forward_s=2, backward_s=4) == 42.0
    assert healthy == pytest.approx(24 / 38)
    outcome = system.on_failure(cluster.fail_ranks([5]), {5}, now_s=10.0)
    eq12 = reroute_step_time(num_stages=2, num_micro_batches=6, data_parallel_size=4, failed_per_stage=[0, 1],
                             forward_s=2, backward_s=4)
    assert 24 / eq12 <= outcome.samples_per_s < healthy
    assert outcome.pause_s == 6.0 and outcome.pause_state == RECOVERING
    # Both replicas of stage 0 of a DP2 layout gone: ReCycle must restart from a checkpoint.
    both = system.on_failure(cluster.fail_ranks([0, 1, 2, 3]), {0, 1, 2, 3}, now_s=1500.0)
    assert both.pause_state == RESTARTING and both.lost_s == 500.0


FIG3_PROFILE = uniform_profile(num_layers=4, forward_s=1.0, backward_s=2.0, layer_state_bytes=100, bandwidth=10.0)
"""Paper 003's Fig. 2-3 example: 3 pipelines of 4 stages, 6 micro-batches each, a forward
takes one slot and a backward two; a 1F1B iteration is 27 slots."""


def fig3_norm_s(workers: int) -> float:
    """What the global norm's ring all-reduce adds to a Fig. 3 step: one float32 over
    ``workers`` ranks at 10 B/s; a staggered optimizer step hides it."""
    return 2 * (workers - 1) / workers * 4 / 10.0


def _fig3(failed: set[int], profile=FIG3_PROFILE):
    plan = symmetric_plan(dp=3, pp=4, num_layers=4, micro_batches_per_pipeline=6)  # stage s of pipeline d: 3s + d
    return reroute_plan(plan, failed_workers=failed, profile=profile) if failed else plan


def test_recycle_step_on_paper_003_figure_3():
    """W_{1,1} (worker 4) fails. The paper's Adaptive Pipelining takes 36 slots by hand and
    29 with Decoupled BackProp (27 with its MILP and the Staggered Optimizer); our plain
    1F1B list schedule takes 33, with split backwards 28, and staggered 27. Healthy, split
    backwards fill the bubbles: 21 slots (18 of work, 3 to fill the pipeline) where 1F1B
    takes 27. Where a failure sits still matters (stage 0: 28, stage 1: 27, stage 3: 29),
    which normalization exploits."""
    def recycle_step(failed):
        both = Pricing(decouple=True, staggered=True)
        return estimate_plan(_fig3(failed), FIG3_PROFILE, pricing=both).pipeline_time_s

    assert recycle_step(set()) == 21.0
    assert estimate_plan(_fig3(set()), FIG3_PROFILE).pipeline_time_s == 27.0
    assert estimate_plan(_fig3({4}), FIG3_PROFILE).pipeline_time_s == 33.0
    assert estimate_plan(_fig3({4}), FIG3_PROFILE, pricing=Pricing(decouple=True)).pipeline_time_s == 28.0
    assert recycle_step({4}) == 27.0
    assert recycle_step({1}) == 28.0
    assert recycle_step({10}) == 29.0


def test_deferred_weight_gradients_stay_within_memory():
    """A deferred W keeps its micro-batch's activations: with room for 5 micro-batches
    beside the weights a peer defers less (peak 15 against 19), here at no cost."""
    tight = uniform_profile(num_layers=4, forward_s=1.0, backward_s=2.0, layer_state_bytes=10, activation_bytes=1,
                            memory_budget_bytes=15)
    plan = _fig3({4}, tight)
    assert estimate_plan(plan, tight).max_peak_memory_bytes == 15  # plain 1F1B: 5 in flight on a peer
    estimate = estimate_plan(plan, tight, pricing=Pricing(decouple=True, staggered=True))
    assert estimate.max_peak_memory_bytes == 15 and estimate.pipeline_time_s == 27.0
    ample = replace(tight, memory_budget_bytes=100)
    estimate = estimate_plan(plan, ample, pricing=Pricing(decouple=True, staggered=True))
    assert estimate.max_peak_memory_bytes == 19 and estimate.pipeline_time_s == 27.0


@settings(max_examples=15, deadline=None)
@given(dp=st.integers(1, 3), pp=st.sampled_from([1, 2, 4, 8]), micro_batches=st.integers(1, 10))
def test_a_failure_free_step_is_plain_1f1b_or_split_whichever_is_faster(dp, pp, micro_batches):
    """Nothing rerouted (Llama-2 7B on 910B: uneven stages, real links): the estimator
    prices plain 1F1B or the list scheduler's split op lists, never anything slower than
    plain 1F1B."""
    profile = recipe_profile(load_config("recipes/llama2_7b/ascend_910b_32.yaml"))
    plan = symmetric_plan(dp=dp, pp=pp, num_layers=32, micro_batches_per_pipeline=micro_batches)
    cluster = ClusterState(world_size=dp * pp, devices_per_node=8)
    plain = estimate_plan(plan, profile, cluster).pipeline_time_s
    split = decoupled_pipelines(plan, profile, cluster).first.makespan_s
    chosen = estimate_plan(plan, profile, cluster, pricing=Pricing(decouple=True)).pipeline_time_s
    assert chosen <= plain * (1 + 1e-12)
    assert chosen == pytest.approx(plain, rel=1e-12) or chosen == pytest.approx(split, rel=1e-12)


def test_recycle_normalizes_a_failure_to_a_cheaper_stage_and_copies_on_repair():
    context = _context(profile=FIG3_PROFILE, pipeline_parallel_size=4, data_parallel_size=3, num_micro_batches=18)
    cluster = ClusterState(world_size=12, devices_per_node=8)
    system = ReCycleSystem(context, detection_s=5.0, reroute_s=1.0)
    assert system.start(cluster) == pytest.approx(18 / (21 + fig3_norm_s(12)))
    # Worker 1 (stage 0 of pipeline 1) fails: rerouting there costs 28 slots, so worker 4
    # takes stage 0 (copying one layer, 100 B at 10 B/s) and the failure moves to stage 1.
    outcome = system.on_failure(cluster.fail_ranks([1]), {1}, now_s=10.0)
    assert [s.worker for s in system.base.pipelines[1].stages] == [4, 1, 7, 10]
    assert outcome.samples_per_s == 18 / 27 and outcome.pause_s == 5.0 + 1.0 + 10.0
    back = system.on_join(cluster, {1}, now_s=100.0)  # worker 1 returns to stage 1 after a copy
    assert back.samples_per_s == pytest.approx(18 / (21 + fig3_norm_s(12))) and back.pause_s == 1.0 + 10.0
    # ReCycle as paper 001 models it (plain 1F1B): stage 0 is the cheapest place to fail.
    plain = ReCycleSystem(context, detection_s=5.0, reroute_s=1.0, decoupled=False, name="recycle_1f1b")
    plain.start(cluster)
    after = plain.on_failure(cluster.fail_ranks([1]), {1}, now_s=10.0)
    assert after.samples_per_s == pytest.approx(18 / (32 + fig3_norm_s(11)))
    assert [s.worker for s in plain.base.pipelines[1].stages] == [1, 4, 7, 10]


def test_odyssey_prices_reroutes_with_the_schedule_its_runtime_runs():
    """Worker 10 (stage 3 of pipeline 1) fails and Odyssey must reroute. On plain 1F1B op
    lists it moves the failure to stage 0 (32 slots, after a 10 s copy). With decoupled
    weight gradients on every worker, what its runtime runs (21 slots healthy), a swap
    still pays: 28 slots; staggering optimizer steps too (the default), 27, like ReCycle,
    with the global norm's all-reduce hidden."""
    context = _context(profile=FIG3_PROFILE, pipeline_parallel_size=4, data_parallel_size=3, num_micro_batches=18)
    cluster = ClusterState(world_size=12, devices_per_node=12)
    outcomes = {}
    for decoupled, staggered in [(False, False), (True, False), (True, True)]:
        settings = OdysseyConfig(policy="reroute", reroute_restart_s=1.0, decoupled_weight_grads=decoupled,
                                 staggered_optimizer=staggered)
        system = OdysseySystem(context, settings=settings, detection_s=5.0, decision_s=0.0)
        assert system.start(cluster) == pytest.approx(18 / ((21 if decoupled else 27) + fig3_norm_s(12)))
        outcome = system.on_failure(cluster.fail_ranks([10]), {10}, now_s=10.0)
        outcomes[decoupled, staggered] = (round(18 / outcome.samples_per_s, 9), outcome.pause_s)
    norm_s = round(fig3_norm_s(11), 9)
    assert outcomes == {(False, False): (32.0 + norm_s, 5.0 + 10.0 + 1.0), (True, False): (28.0 + norm_s, 5.0 + 10.0 + 1.0),
                        (True, True): (27.0, 5.0 + 10.0 + 1.0)}


def test_failure_process_is_seeded_and_per_unit():
    failures = FailureConfig(rate_per_device_hour=0.5)
    kwargs = dict(failures=failures, repairs=RepairConfig(), num_devices=16, devices_per_node=8, duration_s=36000.0)
    assert generate_events(seed=3, **kwargs) == generate_events(seed=3, **kwargs)
    assert generate_events(seed=3, **kwargs) != generate_events(seed=4, **kwargs)
    assert all(len(e.devices) == 1 and e.kind == FAIL for e in generate_events(seed=3, **kwargs))
    nodes = generate_events(seed=3, **{**kwargs, "failures": FailureConfig(rate_per_device_hour=0.5, unit="node")})
    assert all(len(e.devices) == 8 for e in nodes)
    repaired = generate_events(seed=3, **{**kwargs, "repairs": RepairConfig(enabled=True, mean_hours=0.5)})
    assert any(e.kind == JOIN for e in repaired)


@pytest.mark.parametrize(
    "override, key",
    [
        ("failures.process=poisson", "failures.process"),
        ("failures.rate_per_device_hour=-1", "failures.rate_per_device_hour"),
        ("systems=[odyssey,bamboo]", "systems[1]"),
        ("duration_hours=abc", "duration_hours"),
        ("failures.process=trace", "failures.trace"),
        ("costs.checkpoint_save_s=9999", "costs.checkpoint_save_s"),
        ("hot_spares.spares_per_rack=72", "hot_spares.spares_per_rack"),
        ("recipe=nowhere.yaml", "recipe"),
        ("colour=red", "colour"),
    ],
)
def test_bad_scenarios_name_the_key(override, key, capsys):
    with pytest.raises(ConfigError) as info:
        load_scenario(SCENARIO, [override])
    assert info.value.key == key
    assert main(["simulate", "--scenario", SCENARIO, override]) == 2
    assert capsys.readouterr().err.startswith(f"odyssey: error: {key}:")


def test_with_no_failures_every_system_trains_alike():
    """Like for like: every system starts from the same plan and prices its steps with the
    job's one set of schedule options, so in a run without failures all train at the same
    rate, and a ratio measures only how a system handles failures. recycle_1f1b, ReCycle
    as paper 001 models it (plain 1F1B throughout), is an ablation, slower by design. Hot
    spares train at the same rate but pay for 8 idle spares in the job's one 72-device
    rack: 40 devices for 32, so their goodput is 32 / 40 = 0.8 of the others'. The replica
    systems keep the job's placement here (stage_major); node-aligned, they train at their
    own plan's rate (``test_node_aligned_replicas_train_at_their_own_plans_rate``)."""
    scenario = load_scenario(SCENARIO, ["failures.rate_per_device_hour=1e-9", "duration_hours=1",
                                        f"systems=[{','.join(SYSTEMS)}]", "replica_placement=stage_major"])
    result = simulate(scenario)
    assert result.events == []
    rates = {name: summary.avg_throughput for name, summary in result.summaries.items()}
    ablation = rates.pop("recycle_1f1b")
    assert set(rates) == {"odyssey", "oracle", "oobleck", "recycle", "checkpoint", "replica_drop", "redistribute",
                          "dp_scale_in", "hot_spares", "odyssey_shrink"}
    assert max(rates.values()) == pytest.approx(min(rates.values()), rel=1e-9)
    assert ablation < min(rates.values())
    goodput = {name: summary.goodput for name, summary in result.summaries.items()}
    assert goodput["odyssey"] == pytest.approx(rates["odyssey"] * 3600 / 32)
    assert goodput["hot_spares"] / goodput["odyssey"] == pytest.approx(0.8)
    assert result.ratios["hot_spares"] == pytest.approx(1.25) and result.ratios["replica_drop"] == pytest.approx(1)
    assert [s.ettr for s in result.summaries.values()] == [pytest.approx(1 - 20 / 1800)] * 11  # checkpoint saves only
    assert {s.dropped_samples for s in result.summaries.values()} == {0.0}


def test_node_aligned_replicas_train_at_their_own_plans_rate():
    """Placed on whole nodes, a replica's stages talk within a node and its gradients are
    all-reduced across nodes: on 32 910Bs (PP 4, 2 replicas per node) that plan is priced
    as it runs, slower than the stage-major job plan."""
    scenario = load_scenario(SCENARIO, ["failures.rate_per_device_hour=1e-9", "duration_hours=1",
                                        "systems=[replica_drop,checkpoint]"])
    result = simulate(scenario)
    context = simulation_context(scenario)
    cluster = ClusterState(world_size=32, devices_per_node=8)
    own = estimate_plan(replica_layout(context), context.profile, cluster, pricing=context.pricing).samples_per_s
    duty = 1 - 20 / 1800
    assert result.summaries["replica_drop"].avg_throughput == pytest.approx(own * duty, rel=1e-9)
    assert own < result.summaries["checkpoint"].avg_throughput / duty


def test_odyssey_starts_on_the_placement_that_trains_more_through_its_first_failure():
    """Llama-2 7B on 1,024 910Bs at Llama 3's failure rate for a week: node-aligned
    pipelines train faster without failures (548.6 against 548.0 samples/s) and lose whole
    pipelines to a node failure, where a shrinking Odyssey drops what replica drop drops;
    so Odyssey with ``batch_on_failure: shrink`` starts there, on the plan replica drop
    starts on. Odyssey keeping the batch under device failures reroutes, which crosses
    nodes from node-aligned pipelines (518 against 538 samples/s after one failure): it
    keeps Megatron's rank order. On main both started on Megatron's order."""
    def started(unit: str, mode: str) -> tuple[ExecutionPlan, SimulationContext]:
        scenario = load_scenario(SCENARIO, [
            "recipe_overrides=[parallel.data_parallel_size=256,training.global_batch_size=2048]",
            "failures.rate_per_device_hour=1.97e-5", f"failures.unit={unit}", "duration_hours=168"])
        context = simulation_context(scenario)
        system = OdysseySystem(context, settings=replace(scenario.recipe.odyssey, batch_on_failure=mode),
                               detection_s=5.0, decision_s=0.0, horizon_s=168 * 3600.0, repairs=False,
                               failure_model=scenario_failure_model(scenario.config.failures, learn=False),
                               failure_unit=unit)
        system.start(ClusterState(world_size=1024, devices_per_node=8))
        return system.center.plan, context

    shrinking, context = started("node", "shrink")
    assert [s.worker for p in shrinking.pipelines for s in p.stages] == \
        [s.worker for p in replica_layout(context).pipelines for s in p.stages]
    keeping, context = started("device", "keep")
    assert [s.worker for p in keeping.pipelines for s in p.stages] == \
        [s.worker for p in initial_layout(context).pipelines for s in p.stages]


def test_the_fault_scaled_ideal_bounds_every_system():
    """The ideal trains without pauses at the fault-free rate times the healthy share, or
    at a system's rate where that is higher (a worker lost from a pipeline with bubbles
    costs less than its share): 4 devices, one lost halfway through 100 s, fault-free 10
    samples/s; a system pauses 10 s, then trains at 9 > 7.5."""
    cluster = ClusterState(world_size=4, tensor_parallel_size=1, devices_per_node=4)
    events = [ClusterEvent(50.0, FAIL, (3,))]
    timeline = Timeline("fast", [Segment(0, 50, TRAINING, 10.0, 4), Segment(50, 60, RECOVERING, 0.0, 3),
                                 Segment(60, 100, TRAINING, 9.0, 3)])
    assert fault_scaled_ideal(10.0, cluster, events, [], 100.0) == pytest.approx(8.75)
    assert fault_scaled_ideal(10.0, cluster, events, [timeline], 100.0) == pytest.approx(9.35)


def test_a_trace_file_drives_the_events(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,device,event\n600,3,fail\n600,4,fail\n1800,3,join\n")
    scenario = load_scenario(SCENARIO, ["failures.process=trace", f"failures.trace={trace}", "duration_hours=1",
                                        "systems=[odyssey,recycle]"])
    result = simulate(scenario)
    assert [(e.time_s, e.kind, e.devices) for e in result.events] == [(600.0, FAIL, (3, 4)), (1800.0, JOIN, (3,))]
    bad = tmp_path / "bad.csv"
    bad.write_text("time_s,device,event\n10,99,fail\n")
    with pytest.raises(ConfigError, match="device must lie in 0..31"):
        simulate(load_scenario(SCENARIO, ["failures.process=trace", f"failures.trace={bad}"]))


def test_every_system_pauses_at_least_the_detection_time_after_a_failure(tmp_path):
    """Detection is charged alike: with a 1,000 s detection no system trains between a
    failure at 600 s and 1,600 s, checkpoint restart included."""
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,device,event\n600,3,fail\n")
    scenario = load_scenario(SCENARIO, ["failures.process=trace", f"failures.trace={trace}", "duration_hours=1",
                                        "costs.detection_s=1000", f"systems=[{','.join(SYSTEMS)}]"])
    result = simulate(scenario)
    for name, timeline in result.timelines.items():
        trained = [s for s in timeline.segments if s.samples_per_s > 0 and s.end_s > 600.0 and s.start_s < 1600.0]
        assert trained == [], name


def test_same_seed_same_result_and_json_shape(tmp_path, capsys):
    args = ["simulate", "--scenario", SCENARIO, "--json", "--out", str(tmp_path), "duration_hours=2",
            "systems=[odyssey,recycle,checkpoint]", "wandb_mode=disabled", "failures.rate_per_device_hour=0.2"]
    assert main(args + ["--seed", "5"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args + ["--seed", "5"]) == 2  # the run directory is taken
    assert main(args + ["--seed", "5", "--force"]) == 0
    assert json.loads(capsys.readouterr().out) == first
    for name in ("odyssey", "recycle", "checkpoint"):
        assert set(first["systems"][name]) >= {"avg_throughput", "transition_time_s", "fraction_of_ideal", "goodput",
                                               "ettr", "dropped_samples", "paid_devices"}
        assert 0 < first["systems"][name]["fraction_of_ideal"] <= 1 + 1e-12
    assert set(first["ratios"]) == {"recycle", "checkpoint"}
    assert (tmp_path / "throughput.png").stat().st_size > 0 and (tmp_path / "series.json").exists()
    # Each Eq. 8 decision's horizon and where its rate came from: the scenario's rate, the
    # truth its failures are drawn from, over at most the 2 h left (no repairs); the other
    # systems decide without one.
    horizons = first["systems"]["odyssey"]["horizons"]
    assert len(horizons) >= 2 and all(h["expected_interval_s"] > 0 for h in horizons)
    assert all(h["source"] == "the scenario's failures.rate_per_device_hour=0.2" for h in horizons)
    assert all(h["horizon_s"] == pytest.approx(min(h["expected_interval_s"], 7200 - h["time_s"])) for h in horizons)
    assert [h["time_s"] for h in horizons] == sorted(h["time_s"] for h in horizons)
    assert first["systems"]["recycle"]["horizons"] == first["systems"]["checkpoint"]["horizons"] == []
    # Asked to learn, as a live run does: the failures seen, the one it answers included.
    assert main(args + ["--seed", "5", "--force", "odyssey_learns_failure_rate=true"]) == 0
    learned = json.loads(capsys.readouterr().out)["systems"]["odyssey"]["horizons"]
    assert [h["source"].split(" seen over ")[0] for h in learned] == [f"{n} failure(s)" for n in range(1, len(learned) + 1)]


def test_oobleck_that_cannot_start_is_a_scenario_error(capsys):
    # Llama-2 7B needs n0 = 3 workers per pipeline on a 910B; f = 2 on 8 devices needs 9.
    args = ["simulate", "--scenario", SCENARIO, "--json", "wandb_mode=disabled", "systems=[oobleck]",
            "recipe_overrides=[parallel.data_parallel_size=2,training.global_batch_size=16]"]
    assert main(args) == 2
    assert capsys.readouterr().err.startswith("odyssey: error: oobleck_tolerated_failures: oobleck cannot run")


def test_a_wandb_failure_after_the_run_keeps_the_results(tmp_path, monkeypatch, capsys):
    """W&B can fail while logging (a full disk, a killed service) after the simulation ran:
    the results stay on disk and the failure is one line, exit 4."""
    from odyssey_megatron.simulator import report

    def broken(*args, **kwargs):
        raise OSError("No space left on device\nand a second line")

    monkeypatch.setattr(report, "log_to_wandb", broken)
    out = tmp_path / "run"
    code = main(["simulate", "--scenario", SCENARIO, "--out", str(out), "duration_hours=0.5", "systems=[odyssey]",
                 "wandb_mode=offline"])
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("odyssey:")]  # not W&B or tqdm
    assert code == 4 and len(ours) == 1 and "W&B logging failed (OSError: No space left on device)" in ours[0]
    assert json.loads((out / "summary.json").read_text())["systems"]["odyssey"]["avg_throughput"] > 0
