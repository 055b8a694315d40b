"""Oobleck baseline (paper 002): templates, instantiation, reinstantiation, copying, giving up.

The hand-checked cases use an 8-layer textbook profile (forward 1 s, backward 2 s per
layer, free links for pipeline traffic) where a layer's state is 10 bytes and a device
holds 40: one stage cannot hold 8 layers, two can, so n0 = 2. Eight workers, two per node
(nodes {0,1} {2,3} {4,5} {6,7}); copies run at 100 B/s inside a node and 10 B/s across.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.plan import validate_plan
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.simulator.restart import restart_from_checkpoint
from odyssey_megatron.simulator import oobleck
from odyssey_megatron.simulator.oobleck import OobleckSystem, reinstantiate
from odyssey_megatron.simulator.system import RECOVERING, RESTARTING, SimulationContext

RECONFIGURE_S = 8.0
DETECTION_S = 5.0


def norm_s(workers: int) -> float:
    """The global gradient norm's ring all-reduce each step adds (``estimator.optimizer``):
    one float32 over ``workers`` ranks on two or more nodes, at the 10 B/s inter-node link."""
    return 2 * (workers - 1) / workers * 4 / 10.0


def make_context(*, num_layers: int = 8, num_micro_batches: int = 8, profile=None) -> SimulationContext:
    if profile is None:
        profile = uniform_profile(num_layers=num_layers, layer_state_bytes=10, memory_budget_bytes=40)
        profile = dataclasses.replace(profile, intra_node_bandwidth=100.0, inter_node_bandwidth=10.0)
    return SimulationContext(
        profile=profile, num_layers=num_layers, tensor_parallel_size=1, pipeline_parallel_size=2,
        data_parallel_size=4, num_micro_batches=num_micro_batches, devices_per_node=2, restart_s=100.0,
        checkpoint_interval_s=1000.0, checkpoint_save_s=1.0, checkpoint_load_s=10.0,
    )


def started(*, tolerated_failures: int = 2, context: SimulationContext | None = None,
            workers: int = 8) -> tuple[OobleckSystem, ClusterState]:
    system = OobleckSystem(context or make_context(), tolerated_failures=tolerated_failures,
                           reconfigure_s=RECONFIGURE_S, detection_s=DETECTION_S)
    cluster = ClusterState(world_size=workers, tensor_parallel_size=1, devices_per_node=2)
    system.start(cluster)
    return system, cluster


def fail(system: OobleckSystem, cluster: ClusterState, workers: set[int], now_s: float = 1234.0):
    cluster = cluster.fail_ranks(workers)
    return system.on_failure(cluster, workers, now_s), cluster


def layout(system: OobleckSystem) -> tuple[tuple[int, ...], ...]:
    return tuple(p.workers for p in system.pipelines)


def assert_consistent(system: OobleckSystem, cluster: ClusterState) -> None:
    """Invariants after every event: the batch is whole, nobody idles, throughput is the estimator's."""
    assert sum(system.micro_batches) == system.context.num_micro_batches
    assert min(system.micro_batches) >= 1
    workers = [w for p in system.pipelines for w in p.workers]
    assert sorted(workers) == sorted(cluster.alive_workers)
    assert all(len(p.workers) >= system.min_pipeline_workers for p in system.pipelines)
    plan = system.execution_plan()
    validate_plan(plan, num_micro_batches=system.context.num_micro_batches)
    assert system.samples_per_s == estimate_plan(plan, system.context.profile, cluster).samples_per_s


def test_templates_and_instantiation_on_eight_workers():
    system, cluster = started()
    assert system.min_pipeline_workers == 2
    # Templates n0 .. N - f*n0 = 2 .. 8 - 2*2 (4.1.1). 3 stages: (3,3,2) is the split
    # search's fastest (120 s at 12 micro-batches against 123 s for the others).
    assert system.templates == {2: (4, 4), 3: (3, 3, 2), 4: (2, 2, 2, 2)}
    # Mixes of 8 workers with >= 3 pipelines: (2,2,2,2), (2,2,4), (2,3,3). Eq. 9 with
    # (F+B) = 24/S per stage: four 2-stage pipelines with 2 micro-batches each take
    # (2+2-1)*12 = 36 s; (2,2,4) gets (2,2,4) micro-batches and its 4-stage pipeline
    # takes (4+4-1)*6 = 42 s; (2,3,3) gets (2,3,3) and a (3,3,2) pipeline needs 39 s for
    # 3 micro-batches. So four pipelines of two, on consecutive workers; the step adds the
    # norm's all-reduce over the 8 workers.
    assert layout(system) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert system.micro_batches == (2, 2, 2, 2)
    assert system.step_s == pytest.approx(36.0 + norm_s(8))
    assert system.samples_per_s == pytest.approx(8 / (36.0 + norm_s(8)))
    assert_consistent(system, cluster)


def test_start_refuses_fewer_than_f_plus_one_minimal_pipelines():
    with pytest.raises(ValueError, match=r"\(f\+1\)\*n0 = 6"):
        started(workers=4)


def test_failure_in_a_minimal_pipeline_merges_when_nobody_can_lend():
    system, cluster = started()
    before = system.samples_per_s
    outcome, cluster = fail(system, cluster, {1})
    # [0] is short of n0 = 2 and every other pipeline has exactly n0: it merges with the
    # first full pipeline [2,3] into a 3-worker pipeline (5.1, Figure 8c).
    assert "merge" in outcome.note
    assert layout(system) == ((4, 5), (6, 7), (0, 2, 3))
    assert [p.num_stages for p in system.pipelines] == [2, 2, 3]
    # Split (3,3,2): worker 0 keeps layers 0-2 (held 0-3), worker 3 keeps 6-7 (held 4-7),
    # worker 2 needs 3-5 and holds 0-3: layers 4 and 5 (20 B) come from worker 3, the first
    # live former holder, on its own node: 20 B / 100 B/s.
    assert outcome.pause_s == pytest.approx(DETECTION_S + RECONFIGURE_S + 0.2)
    assert outcome.lost_s == pytest.approx((36.0 + norm_s(8)) / 2)
    assert outcome.pause_state == RECOVERING
    assert outcome.samples_per_s == system.samples_per_s <= before
    assert_consistent(system, cluster)


def test_failure_borrows_from_a_pipeline_above_n0():
    system, cluster = started()
    fail(system, cluster, {1})
    before = system.step_s - norm_s(7)
    outcome, cluster = fail(system, cluster.fail_ranks({1}), {5})
    # [4] is short; the only pipeline above n0 is [0,2,3]: it lends its last worker, 3
    # (5.1, Figure 8b), and is itself reinstantiated with two.
    assert "borrow" in outcome.note
    assert layout(system) == ((0, 2), (3, 4), (6, 7))
    # New 2-stage pipelines hold layers 0-3 / 4-7. Worker 0 needs layer 3, worker 2 layers
    # 6-7, worker 3 layers 0-3, worker 4 layers 4-7. Worker 4 (node 2) broadcasts layers
    # 0-3 and worker 7 (node 3) layers 4-7, each to another node: 40 B at 10 B/s, and
    # worker 3 and 4 each receive 40 B across nodes: 4 s.
    assert outcome.pause_s == pytest.approx(DETECTION_S + RECONFIGURE_S + 4.0)
    assert system.step_s - norm_s(6) >= before  # no faster, but for the norm's shorter ring
    assert_consistent(system, cluster)


def test_failure_in_a_pipeline_above_n0_takes_the_smaller_template():
    system, cluster = started()
    fail(system, cluster, {1})
    before = system.step_s - norm_s(7)
    outcome, cluster = fail(system, cluster.fail_ranks({1}), {0})
    # [2,3] keeps n0 workers: simple reinstantiation with the 2-worker template (Figure 8a).
    assert "simple" in outcome.note and "borrow" not in outcome.note and "merge" not in outcome.note
    assert layout(system) == ((2, 3), (4, 5), (6, 7))
    # Worker 2 (held 3-5) needs layers 0-2 from worker 4; worker 3 (held 6-7) needs 4-5
    # from worker 5; both across nodes: 30 B and 20 B at 10 B/s, the slower is 3 s.
    assert outcome.pause_s == pytest.approx(DETECTION_S + RECONFIGURE_S + 3.0)
    assert system.step_s - norm_s(6) >= before  # no faster, but for the norm's shorter ring
    assert_consistent(system, cluster)


def test_below_f_plus_one_times_n0_workers_oobleck_restarts_from_the_checkpoint():
    system, cluster = started()
    _, cluster = fail(system, cluster, {1})
    _, cluster = fail(system, cluster, {5})
    assert len(cluster.alive_workers) == 6  # (f+1)*n0: still in memory
    outcome, cluster = fail(system, cluster, {6}, now_s=2345.0)
    assert outcome.pause_state == RESTARTING
    assert outcome.lost_s == pytest.approx(345.0)  # since the checkpoint at 2000 s
    assert outcome.pause_s == pytest.approx(100.0 + 10.0)
    assert outcome.samples_per_s == restart_from_checkpoint(system.context, cluster, 2345.0, "").samples_per_s
    assert system.pipelines == ()
    # Back to six workers: restart from the checkpoint into Oobleck's pipelines again.
    cluster = cluster.repair_ranks({6})
    outcome = system.on_join(cluster, {6}, 2400.0)
    assert outcome.pause_state == RESTARTING
    assert layout(system) == ((0, 2), (3, 4), (6, 7))
    assert outcome.samples_per_s == system.samples_per_s
    assert_consistent(system, cluster)


def test_a_layer_without_live_replica_restarts_from_the_checkpoint():
    system, cluster = started(tolerated_failures=1)
    assert layout(system) == ((0, 1), (2, 3), (4, 5), (6, 7))
    # Every holder of layers 0-3 dies at once; four workers remain, (f+1)*n0 = 4.
    outcome, cluster = fail(system, cluster, {0, 2, 4, 6}, now_s=1500.0)
    assert outcome.pause_state == RESTARTING
    assert "no live replica" in outcome.note
    assert outcome.lost_s == pytest.approx(500.0)
    # Restarted into two 2-stage pipelines with 4 micro-batches each: (2+4-1)*12 = 60 s.
    assert layout(system) == ((1, 3), (5, 7))
    assert outcome.samples_per_s == pytest.approx(8 / (60 + norm_s(4)))
    assert_consistent(system, cluster)


def test_repair_reinstantiates_on_all_workers_and_copies_missing_layers():
    system, cluster = started()
    _, cluster = fail(system, cluster, {1})
    cluster = cluster.repair_ranks({1})
    outcome = system.on_join(cluster, {1}, 2000.0)
    assert layout(system) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert outcome.samples_per_s == pytest.approx(8 / (36 + norm_s(8)))
    assert outcome.lost_s == 0.0 and outcome.pause_state == RECOVERING
    # Worker 4 broadcasts layers 0-3 (to 0 and 2), worker 5 layers 4-7 (to 1 and 3), all
    # across nodes: each sends 40 B at 10 B/s; the returning worker 1 receives 40 B.
    assert outcome.pause_s == pytest.approx(RECONFIGURE_S + 4.0)
    assert_consistent(system, cluster)


def costly_sync_profile(*, num_layers: int, memory_budget_bytes: int):
    """Gradients to all-reduce (40 B a layer) and activations to send, at finite bandwidth."""
    base = uniform_profile(num_layers=num_layers, layer_state_bytes=10, memory_budget_bytes=memory_budget_bytes)
    layer = dataclasses.replace(base.layers[0], grad_bytes=40)
    return dataclasses.replace(base, layers=(layer,) * num_layers, p2p_bytes=5, link_latency_s=0.01,
                               intra_node_bandwidth=100.0, inter_node_bandwidth=10.0)


def test_planner_estimate_is_the_estimator_without_placement():
    """Oobleck's placement-blind planner estimate equals estimate_plan without a cluster."""
    profile = costly_sync_profile(num_layers=8, memory_budget_bytes=200)
    system, cluster = started(context=make_context(profile=profile))
    for failed in ({1}, {5}):
        plan = system.execution_plan()
        planned = system.planned_step_time(tuple(p.num_stages for p in system.pipelines))
        assert planned == pytest.approx(estimate_plan(plan, profile).step_time_s)
        assert estimate_plan(plan, profile).sync_time_s > 0
        assert_consistent(system, cluster)
        _, cluster = fail(system, cluster, failed)


@pytest.mark.parametrize("max_sizes", [None, 2])
def test_instantiation_finds_the_fastest_mix(monkeypatch, max_sizes):
    """Branch and bound returns the brute-force optimum over every mix (the paper's list),
    or over the mixes of at most two sizes once the list is too long to enumerate."""
    # 16 layers of 50 B (weights and gradients) in 300 B stages: n0 = 3; f = 1 on 16
    # workers gives templates 3 .. 13.
    context = make_context(num_layers=16, profile=costly_sync_profile(num_layers=16, memory_budget_bytes=300))
    if max_sizes is not None:
        monkeypatch.setattr(oobleck, "MAX_ENUMERATED_MIXES", 0)
    system, _ = started(tolerated_failures=1, context=context, workers=16)
    assert sorted(system.templates) == list(range(3, 14))
    mixes = [
        mix
        for count in range(2, 6)
        for mix in itertools.combinations_with_replacement(sorted(system.templates), count)
        if sum(mix) == 16 and len(set(mix)) <= (max_sizes or count)
    ]
    chosen = tuple(p.num_stages for p in system.pipelines)
    assert chosen in mixes
    assert system.planned_step_time(chosen) == min(system.planned_step_time(mix) for mix in mixes)


def test_a_mix_of_thousands_of_pipelines_is_listed_past_the_recursion_limit():
    """16,384 workers hold thousands of pipelines: the mixes are listed on a stack (the
    recursive listing raised RecursionError on a repair at that scale)."""
    system, _ = started(context=make_context(num_micro_batches=4096))  # templates 2, 3, 4
    mixes = system._mixes(3000)
    assert next(mixes) == (2,) * 1500
    assert next(mixes) == (2,) * 1498 + (4,)


def test_workers_beyond_the_largest_template_idle_and_may_fail_for_free():
    # One 10 B layer per 10 B device: n0 = 4 = the layer count, so 4 is the only template
    # (no pipeline has more stages than layers). f = 1 on 12 workers: three pipelines.
    context = make_context(num_layers=4, profile=uniform_profile(num_layers=4, layer_state_bytes=10,
                                                                 memory_budget_bytes=10))
    system, cluster = started(tolerated_failures=1, context=context, workers=12)
    assert system.templates == {4: (1, 1, 1, 1)}
    assert layout(system) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    # [0,2,3] merges with [4..7]: seven workers run the 4-stage template, three idle.
    outcome, cluster = fail(system, cluster, {1})
    assert "merge" in outcome.note
    assert layout(system) == ((8, 9, 10, 11), (0, 2, 3, 4, 5, 6, 7))
    assert [p.stage_workers for p in system.pipelines] == [(8, 9, 10, 11), (0, 2, 3, 4)]
    assert_consistent(system, cluster)
    rate = system.samples_per_s
    outcome, cluster = fail(system, cluster, {7})
    assert (outcome.pause_s, outcome.lost_s, outcome.samples_per_s) == (0.0, 0.0, rate)
    assert layout(system) == ((8, 9, 10, 11), (0, 2, 3, 4, 5, 6))
    assert_consistent(system, cluster)


def test_random_failures_and_repairs_keep_the_invariants_and_are_deterministic():
    def run() -> list:
        context = make_context(num_layers=16, num_micro_batches=12,
                               profile=uniform_profile(num_layers=16, layer_state_bytes=10, memory_budget_bytes=60))
        system, cluster = started(context=context, workers=16)
        assert system.min_pipeline_workers == 3  # 16 layers of 10 B in 60 B stages
        rng = random.Random(1)
        history = []
        for step in range(40):
            now = 100.0 * step
            if rng.random() < len(cluster.failed_workers) / 9:  # repairs catch up as failures pile up
                worker = rng.choice(sorted(cluster.failed_workers))
                cluster = cluster.repair_ranks({worker})
                outcome = system.on_join(cluster, {worker}, now)
            else:
                worker = rng.choice(cluster.alive_workers)
                cluster = cluster.fail_ranks({worker})
                outcome = system.on_failure(cluster, {worker}, now)
            if system.pipelines:
                assert_consistent(system, cluster)
            history.append((layout(system), system.micro_batches, outcome))
        return history

    history = run()
    notes = " ".join(outcome.note for *_, outcome in history)
    for path in ("simple", "borrow", "merge", "fewer than", "restarted into", "rejoined: instantiated"):
        assert path in notes
    assert history == run()


def test_reinstantiate_merges_short_pipelines_together_before_taking_a_full_one():
    groups, steps = reinstantiate([[0, 1], [2, 3], [4, 5], [6, 7]], failed={1, 3}, min_workers=2)
    assert steps == ("merge",)
    assert groups == [[0, 2], [4, 5], [6, 7]]  # ordered by (size, first worker)
