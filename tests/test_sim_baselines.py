"""The 2026 baselines in the simulator (replica drop, redistribution, DP scale-in, hot
spares) and checkpoint restart, each on a scripted timeline whose outcome is worked out
by hand.

The job in every test: 4 identical layers (forward 1 s, backward 2 s each), PP 2 x DP 4
on 8 workers (stage s of pipeline d on worker 4s + d), 24 micro-batches of one sample,
plain 1F1B, free links. A pipeline with m micro-batches takes (m + 1) slots of 6 s: with
6 each, 42 s per step, 24 / 42 = 4/7 samples/s; 3 replicas with 6 each: 18 / 42 = 3/7;
3 replicas with 8 each: 24 / 54 = 4/9.
"""

from __future__ import annotations

import pytest

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.settings import PLAIN
from odyssey_megatron.simulator.checkpoint import CheckpointRestartSystem
from odyssey_megatron.simulator.dp_scale_in import DpScaleInSystem
from odyssey_megatron.simulator.engine import run_system
from odyssey_megatron.simulator.events import FAIL, JOIN, ClusterEvent
from odyssey_megatron.simulator.hot_spares import HotSparesSystem, spare_devices_for
from odyssey_megatron.simulator.redistribute import RedistributeSystem
from odyssey_megatron.simulator.replica_drop import ReplicaDropSystem
from odyssey_megatron.simulator.restart import best_symmetric_layout
from odyssey_megatron.simulator.system import (
    NODE_ALIGNED,
    RECOVERING,
    RESTARTING,
    STAGE_MAJOR,
    STOPPED,
    TRAINING,
    VARUNA_LAYOUTS,
    Phase,
    SimulationContext,
)


def _context(**overrides) -> SimulationContext:
    fields = dict(
        profile=uniform_profile(num_layers=4, forward_s=1.0, backward_s=2.0), num_layers=4,
        tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=4, num_micro_batches=24,
        devices_per_node=8, restart_s=100.0, checkpoint_interval_s=1000.0, checkpoint_save_s=0.0,
        checkpoint_load_s=50.0, pricing=PLAIN, replica_placement=STAGE_MAJOR,  # the job's plan's placement
    )
    fields.update(overrides)
    return SimulationContext(**fields)


CLUSTER = ClusterState(world_size=8, devices_per_node=8)
FAIL_5_THEN_REPAIR = [ClusterEvent(100.0, FAIL, (5,)), ClusterEvent(300.0, JOIN, (5,))]
"""Worker 5 (stage 1 of pipeline 1) fails at 100 s and is repaired at 300 s."""


def _run(system, events, duration_s=600.0):
    return run_system(system, cluster=CLUSTER, events=events, duration_s=duration_s, checkpoint_duty=1.0)


def _segments(timeline):
    return [(s.start_s, s.end_s, s.state, pytest.approx(s.samples_per_s), pytest.approx(s.dropped_per_s))
            for s in timeline.segments]


def test_replica_drop_trains_the_survivors_smaller_batch_while_the_lost_replica_heals():
    """At 100 s replica 1 leaves: the step in flight is lost (21 s at 4/7 = 12 samples),
    the survivors pause 5 s detection + 1 s rebuild, then train 3 x 6 = 18 samples per
    42 s (3/7/s), 6 samples short of the batch every step (1/7/s dropped). Repaired at
    300 s, the replica restarts (100 s) and heals (free links: 0 s) while the others go on,
    and joins at 400 s after a 1 s rebuild.
    Samples: 100 * 4/7 + (400 - 106) * 3/7 + (600 - 401) * 4/7 - 12 = 2078/7 - 12.
    Dropped: 294 s * 1/7 = 42. ETTR: (100 + 294 + 199 - 21) / 600."""
    system = ReplicaDropSystem(_context(), detection_s=5.0, reconfigure_s=1.0)
    timeline = _run(system, FAIL_5_THEN_REPAIR)
    assert _segments(timeline) == [
        (0.0, 100.0, TRAINING, 4 / 7, 0.0),
        (100.0, 106.0, RECOVERING, 0.0, 0.0),
        (106.0, 300.0, TRAINING, 3 / 7, 1 / 7),
        (300.0, 400.0, TRAINING, 3 / 7, 1 / 7),
        (400.0, 401.0, RECOVERING, 0.0, 0.0),
        (401.0, 600.0, TRAINING, 4 / 7, 0.0),
    ]
    assert timeline.lost_samples == pytest.approx(12.0) and timeline.lost_time_s == 21.0
    assert timeline.samples == pytest.approx(2078 / 7 - 12)
    assert timeline.dropped_samples == pytest.approx(42.0)


def test_redistribution_keeps_the_batch_and_redoes_only_the_lost_replicas_share():
    """ReCoVer: the 24 micro-batches go 8 each to the 3 survivors (24 per 54 s = 4/9/s,
    nothing dropped); in-step recovery redoes only the failed replica's quarter of the
    interrupted half step: 21 / 4 = 5.25 s at 4/7 = 3 samples.
    Samples: 100 * 4/7 + 294 * 4/9 + 199 * 4/7 - 3 = 299 * 4/7 + 392/3 - 3."""
    system = RedistributeSystem(_context(), detection_s=5.0, reconfigure_s=1.0)
    timeline = _run(system, FAIL_5_THEN_REPAIR)
    assert [s.samples_per_s for s in timeline.segments] == pytest.approx([4 / 7, 0.0, 4 / 9, 4 / 9, 0.0, 4 / 7])
    assert timeline.lost_samples == pytest.approx(3.0) and timeline.dropped_samples == 0.0
    assert timeline.samples == pytest.approx(299 * 4 / 7 + 392 / 3 - 3)


def test_scale_in_loses_the_step_and_stops_the_job_to_heal_a_returning_domain():
    """Links at 10 B/s, 100 B per layer: a returning replica's two workers each receive
    their stage's 2 layers from a peer, 200 B / 10 B/s = 20 s, at once. ReCoVer (like
    torchft) heals while the others train: 100 s restart + 20 s, then the 1 s rebuild;
    MindCluster's scale-out starts the pods in the background (100 s), then stops every
    domain for the rebuild and the copy: 1 + 20 s. A scale-in loses the whole half step."""
    context = _context(profile=uniform_profile(num_layers=4, layer_state_bytes=100, bandwidth=10.0))
    scale_in = DpScaleInSystem(context, detection_s=5.0, reconfigure_s=1.0)
    redistribute = RedistributeSystem(context, detection_s=5.0, reconfigure_s=1.0)
    for system in (scale_in, redistribute):
        system.start(CLUSTER)
        failed = system.on_failure(CLUSTER.fail_ranks([5]), {5}, now_s=100.0)
        assert failed.pause_s == 6.0
    assert scale_in.heal_s(1, 0) == 20.0
    assert failed.lost_s == redistribute.price(frozenset({0, 1, 2, 3}))[0] / 2 / 4
    rate = scale_in.price(frozenset({0, 2, 3}))[1]
    back = scale_in.on_join(CLUSTER, {5}, now_s=300.0)
    assert back.pause_s == 0.0 and back.ramp == (Phase(100.0, rate), Phase(21.0, 0.0))
    back = redistribute.on_join(CLUSTER, {5}, now_s=300.0)
    assert back.ramp == (Phase(120.0, rate), Phase(1.0, 0.0))


def test_with_every_replica_out_training_stops_until_one_restarts_from_the_checkpoint():
    """Workers 0-3 (stage 0 of every replica) fail at 2,350 s: no replica holds a whole
    model, so everything since the checkpoint at 2,000 s is lost and training stops. Worker
    2 is repaired at 2,500 s: replica 2 loads the checkpoint (100 s restart + 50 s load)
    and trains alone, 6 samples per 42 s; replica 0, repaired at 2,600 s, heals from it."""
    system = ReplicaDropSystem(_context(), detection_s=5.0, reconfigure_s=1.0)
    events = [ClusterEvent(2350.0, FAIL, (0, 1, 2, 3)), ClusterEvent(2500.0, JOIN, (2,)),
              ClusterEvent(2600.0, JOIN, (0,))]
    timeline = _run(system, events, duration_s=3000.0)
    assert _segments(timeline) == [
        (0.0, 2350.0, TRAINING, 4 / 7, 0.0),
        (2350.0, 2500.0, STOPPED, 0.0, 0.0),
        (2500.0, 2600.0, RESTARTING, 0.0, 0.0),
        (2600.0, 2650.0, RESTARTING, 0.0, 0.0),  # replica 0's repair does not cut the load short
        (2650.0, 2700.0, TRAINING, 1 / 7, 3 / 7),
        (2700.0, 2701.0, RECOVERING, 0.0, 0.0),
        (2701.0, 3000.0, TRAINING, 2 / 7, 2 / 7),
    ]
    assert timeline.lost_samples == pytest.approx(350 * 4 / 7)


def test_hot_spares_swap_in_a_spare_and_restart_smaller_once_none_is_left():
    """Nodes of 2 devices; one spare node. At 100 s worker 5 fails: its node takes the
    spare, 5 s detection + 30 s in-job restart, the half step lost (21 s at 4/7 = 12).
    At 200 s worker 2 fails, no spare is left: a checkpoint restart (100 + 50 s; the 65 s
    trained since 135 s are lost, 65 * 4/7) on 6 workers, whose best symmetric layout is
    DP 6 x PP 1: 4 micro-batches of 12 s, 24 per 48 s = 1/2. At 500 s worker 5's node is
    repaired and its freed spare covers worker 2's node: back onto the job's plan with a
    checkpoint restart (150 s trained at 1/2 since 350 s are lost).
    Samples: (100 + 65 + 350) * 4/7 + 150 * 1/2 - 12 - 65 * 4/7 - 75 = 450 * 4/7 - 12."""
    context = _context(devices_per_node=2)
    cluster = ClusterState(world_size=8, devices_per_node=2)
    system = HotSparesSystem(context, detection_s=5.0, restart_s=30.0, spare_devices=2)
    events = [ClusterEvent(100.0, FAIL, (5,)), ClusterEvent(200.0, FAIL, (2,)), ClusterEvent(500.0, JOIN, (5,))]
    timeline = run_system(system, cluster=cluster, events=events, duration_s=1000.0, checkpoint_duty=1.0)
    assert _segments(timeline) == [
        (0.0, 100.0, TRAINING, 4 / 7, 0.0),
        (100.0, 135.0, RECOVERING, 0.0, 0.0),
        (135.0, 200.0, TRAINING, 4 / 7, 0.0),
        (200.0, 350.0, RESTARTING, 0.0, 0.0),
        (350.0, 500.0, TRAINING, 1 / 2, 0.0),
        (500.0, 650.0, RESTARTING, 0.0, 0.0),
        (650.0, 1000.0, TRAINING, 4 / 7, 0.0),
    ]
    assert timeline.samples == pytest.approx(450 * 4 / 7 - 12)
    assert system.spare_devices == 2 and system.missing == set()


def test_spares_are_whole_nodes_held_per_rack_the_job_fills():
    """8 spares in every 72-device rack: a job of 1,024 devices fills 1,024 / 64 = 16 racks
    and holds 128 spares, 12.5 % more devices paid (its goodput without failures is
    1,024 / 1,152 = 0.889 of a spare-less system's); 32 devices fill one rack: 8 spares."""
    assert spare_devices_for(1024, rack_devices=72, spares_per_rack=8, devices_per_node=8) == 128
    assert spare_devices_for(32, rack_devices=72, spares_per_rack=8, devices_per_node=8) == 8
    assert spare_devices_for(32, rack_devices=72, spares_per_rack=8, devices_per_node=16) == 16  # whole nodes


def test_a_checkpoint_restart_resumes_on_a_layout_stock_megatron_runs():
    """On 7 survivors the fastest symmetric layout is DP 7 x PP 1 (24 micro-batches as
    4 of 3 and 3 of 4: a step of 4 * 12 s), which Megatron refuses (7 does not divide 24):
    a restart resumes on DP 6 x PP 1 (4 each, also 48 s), the same rate on fewer workers.
    Varuna-style uneven layouts stay a named option."""
    megatron = best_symmetric_layout(_context(), 7)
    assert 24 % megatron.data_parallel_size == 0
    assert (megatron.data_parallel_size, megatron.pipeline_parallel_size) == (6, 1)
    varuna = best_symmetric_layout(_context(restart_layouts=VARUNA_LAYOUTS), 7)
    assert (varuna.data_parallel_size, varuna.pipeline_parallel_size) == (7, 1)
    assert megatron.samples_per_s == pytest.approx(varuna.samples_per_s) == pytest.approx(1 / 2)
    on_5 = best_symmetric_layout(_context(), 5)  # DP 4 x PP 1 (6 each, 72 s) over DP 5's uneven 5,5,5,5,4
    assert (on_5.data_parallel_size, on_5.samples_per_s) == (4, pytest.approx(1 / 3))
    assert best_symmetric_layout(_context(restart_layouts=VARUNA_LAYOUTS), 5).samples_per_s > on_5.samples_per_s


def test_a_checkpoint_restart_after_a_failure_waits_for_its_detection():
    """Detection (5 s) comes before the restart (100 s) and the load (50 s) after a
    failure, as before every in-memory recovery; a repair is known when it happens."""
    context = _context(detection_s=5.0)
    system = CheckpointRestartSystem(context)
    system.start(CLUSTER)
    failed = CLUSTER.fail_ranks([5])
    assert system.on_failure(failed, {5}, now_s=100.0).pause_s == 155.0
    assert system.on_join(CLUSTER, {5}, now_s=300.0).pause_s == 150.0


@pytest.mark.parametrize("placement, replicas_out", [(NODE_ALIGNED, 1), (STAGE_MAJOR, 2)])
def test_a_node_failure_evicts_the_replicas_on_that_node(placement, replicas_out):
    """Nodes of 2 devices: node-aligned, replica d sits on node d (workers 2d, 2d + 1), so
    node 1 failing takes one replica out and replica drop trains 3 x 6 micro-batches per
    42 s; stage-major, node 1 holds stage 0 of replicas 2 and 3: two out, 2 x 6 per 42 s."""
    context = _context(devices_per_node=2, replica_placement=placement)
    cluster = ClusterState(world_size=8, devices_per_node=2)
    system = ReplicaDropSystem(context, detection_s=5.0, reconfigure_s=1.0)
    assert system.start(cluster) == pytest.approx(4 / 7)
    outcome = system.on_failure(cluster.fail_nodes([1]), {2, 3}, now_s=100.0)
    assert len(system.out) == replicas_out
    assert outcome.samples_per_s == pytest.approx((4 - replicas_out) * 6 / 42)
    assert outcome.dropped_per_s == pytest.approx(replicas_out * 6 / 42)
