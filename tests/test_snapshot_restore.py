"""Who snapshots which block, and where a rollback reads or rebuilds each one: the tiny
recipe's plans, worked by hand, and random failures checked against what must hold; and
which keepers the run's owner counts lost to a snapshot as nodes go and come back."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.blocks import worker_blocks
from odyssey_megatron.planner import UnrecoverableFailure
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.detector import Cause, Detector, Failure
from odyssey_megatron.runtime.control.run_state import RunState
from odyssey_megatron.runtime.control.snapshot_following import SnapshotFollowing
from odyssey_megatron.runtime.protocol.keys import node_heartbeat_key
from odyssey_megatron.runtime.protocol.messages import NodeHeartbeat, NodeRegistration
from odyssey_megatron.snapshot.restore import (
    Restore,
    SnapshotLost,
    SnapshotRead,
    SnapshotRebuild,
    SnapshotRecord,
    SnapshotSource,
    plan_restore,
)
from odyssey_megatron.snapshot.shards import owners, shard_blocks, snapshot_groups

TINY = Path(__file__).resolve().parents[1] / "recipes" / "llama2_7b" / "tiny_cpu.yaml"


def center(devices_per_node: int, *overrides: str) -> tuple[DecisionCenter, object]:
    config = load_config(TINY, [f"cluster.devices_per_node={devices_per_node}", *overrides])
    return DecisionCenter.from_recipe(config), config


def keepers(center: DecisionCenter, *nodes: int) -> frozenset[int]:
    """The keeper slots nodes ``nodes`` (the cluster's numbering) take along: their ranks."""
    return frozenset(r for n in nodes for r in center.cluster.node_ranks(n))


def record_of(center: DecisionCenter, config, *, step: int = 4) -> SnapshotRecord:
    groups = snapshot_groups(center.plan, cluster=center.cluster, nodes_per_group=config.odyssey.snapshot_parity_nodes)
    return SnapshotRecord(step, center.plan.generation, center.plan, groups)


def test_every_block_is_snapshotted_once_by_a_worker_that_trains_it_and_replicas_share_stages():
    c, config = center(8)
    written = owners(c.plan, config.model)
    every = {b for w in c.plan.workers for b in worker_blocks(c.plan, w, tied=config.model.tie_embeddings)}
    assert set(written) == every
    for block, worker in written.items():
        assert block in worker_blocks(c.plan, worker, tied=config.model.tie_embeddings)
    # DP 2 x PP 4: stage k is workers 2k (pipeline 0) and 2k+1; its two layers (594 kB each)
    # go one to each replica, then the embedding and output blocks (394 kB) to the first of
    # two replicas that hold as much.
    assert [shard_blocks(written, w) for w in range(8)] == [
        ["embedding", 0], [1], [2], [3], [4], [5], [6, "output"], [7]]


def test_killed_replicas_on_a_live_node_are_read_from_its_keeper_by_a_survivor_there():
    """One node of 8 (the tiny recipe): both replicas of stage 1 (workers 2 and 3) die; the
    node's keeper lives, so their shards are read there by survivors, and nothing is rebuilt."""
    c, config = center(8)
    record = record_of(c, config)
    decision = c.on_failure(ranks=[2, 3], in_memory=True,
                            snapshot=SnapshotSource(record, frozenset(), config.model, replayed_steps=1))
    restore = decision.rollback
    assert restore is not None and restore.step == 4 and restore.rebuilds == ()
    readers = {read.owner: read.reader for read in restore.reads}
    assert set(readers) == set(owners(c.plan, config.model).values()) - {2, 3} | {2, 3}
    assert readers[2] not in (2, 3) and readers[3] not in (2, 3)
    plan = decision.chosen.plan
    assert not plan.blocks_from_nowhere and 2 not in plan.workers and 3 not in plan.workers
    _check_every_block_arrives(restore, plan, config)


def test_a_lost_node_s_shards_are_rebuilt_from_parity_across_the_other_nodes():
    """4 nodes of 2: node 1 holds both replicas of stage 1 and is lost; ranks 2 and 3 are
    rebuilt from their protection groups (the i-th rank of every node), each member read
    on its own node by itself."""
    c, config = center(2)
    record = record_of(c, config)
    assert record.groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    decision = c.on_failure(nodes=[1], in_memory=True,
                            snapshot=SnapshotSource(record, keepers(c, 1), config.model, replayed_steps=1))
    restore = decision.rollback
    assert restore.rebuilds == (SnapshotRebuild(2, (0, 2, 4, 6), (0, 4, 6)),
                                SnapshotRebuild(3, (1, 3, 5, 7), (1, 5, 7)))
    assert all(read.reader == read.owner for read in restore.reads)  # every survivor reads its own slot
    _check_every_block_arrives(restore, decision.chosen.plan, config)


def test_a_node_lost_beside_a_dedicated_controller_takes_its_own_keeper_along_not_its_neighbour_s():
    """Under ``cluster.dedicated_controller`` the launcher's node 1 runs ranks 0..3, the
    cluster's node 0 (nodes of 4). Its failure, as the detector reports it, leaves the
    keeper of node 2 (ranks 4..7) to rebuild each of its shards from: rank i's protection
    group is (i, i + 4), read on node 2 by rank i + 4 itself."""
    c, config = center(4, "cluster.dedicated_controller=true")
    record = record_of(c, config)
    assert record.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    detector = Detector(1.0)
    for node, ranks in ((1, (0, 1, 2, 3)), (2, (4, 5, 6, 7))):
        detector.node_joined(NodeRegistration(node, 10 + node, f"h{node}", ranks), now=0.0, wall=1000.0)
    detector.observe({node_heartbeat_key(2): NodeHeartbeat(1, 1001.5, {}, {}, {})}, now=1.5)
    [failure] = detector.check(now=2.0, wall=1002.0)
    assert (failure.node, failure.ranks) == (1, (0, 1, 2, 3))
    decision = c.on_failure(ranks=failure.ranks, in_memory=True,
                            snapshot=SnapshotSource(record, frozenset(failure.node_ranks), config.model,
                                                    replayed_steps=1))
    restore = decision.rollback
    assert restore.rebuilds == tuple(SnapshotRebuild(i, (i, i + 4), (i + 4,)) for i in range(4))
    assert all(read.reader == read.owner for read in restore.reads)  # node 2's ranks read their own slots
    _check_every_block_arrives(restore, decision.chosen.plan, config)


def test_a_lost_keeper_is_one_of_the_ranks_it_served_so_a_survivor_on_its_node_reads_nothing_there():
    """Nodes of 4, the cluster's node 1 lost as the ranks it ran (4..7): none of its shards
    is read from its keeper, even where the cluster still counts its workers alive (a
    replacement node's, whose keeper holds nothing of the snapshot); each is rebuilt on node 0."""
    c, config = center(4)
    restore, _ = plan_restore(record_of(c, config), plan=c.plan, cluster=c.cluster, lost_keepers={4, 5, 6, 7},
                              model=config.model)
    assert [(r.lost, r.readers) for r in restore.rebuilds] == [(i + 4, (i,)) for i in range(4)]
    assert {read.owner for read in restore.reads} == {0, 1, 2, 3}


def test_a_node_with_no_live_worker_left_is_rebuilt_even_though_its_keeper_lives():
    c, config = center(2)
    record = record_of(c, config)
    restore, _ = plan_restore(record, plan=c.on_failure(ranks=[2, 3]).chosen.plan, cluster=c.cluster,
                              lost_keepers=set(), model=config.model)
    assert [r.lost for r in restore.rebuilds] == [2, 3]


def test_two_losses_in_one_protection_group_name_the_ranks_and_leave_the_run_to_the_disk_checkpoint():
    c, config = center(2)
    record = record_of(c, config)
    with pytest.raises(UnrecoverableFailure, match=r"blocks .* were lost on every replica .*, and the snapshot "
                                                   r"shards of ranks \[2, 4\] are all lost, and their protection "
                                                   r"group \(ranks \[0, 2, 4, 6\]\) rebuilds one at most"):
        c.on_failure(nodes=[1, 2], in_memory=True,
                     snapshot=SnapshotSource(record, keepers(c, 1, 2), config.model, replayed_steps=1))


def test_a_shard_with_no_other_node_for_parity_is_lost_with_its_node():
    c, config = center(8)
    record = record_of(c, config)
    assert record.groups == tuple((r,) for r in range(8))
    with pytest.raises(SnapshotLost, match="no parity protects it"):
        plan_restore(record, plan=c.plan, cluster=c.cluster.fail_ranks([2, 3]),
                     lost_keepers=set(keepers(c, 0)), model=config.model)


def test_eq_8_weighs_each_candidate_with_its_restore_and_the_steps_it_trains_again():
    """Every candidate of a rollback pays the same replay in steps, at its own step time, and
    moves every block from where the snapshot is read: a longer replay lowers every score and
    makes the slower candidates fall further behind."""
    scores = {}
    for replayed in (0, 50):
        c, config = center(8)
        c.search_time_s = 0.0  # a measured search time would differ between the two
        decision = c.on_failure(ranks=[2, 3], in_memory=True, interval_s=600.0,
                                snapshot=SnapshotSource(record_of(c, config), frozenset(), config.model,
                                                        replayed_steps=replayed))
        candidates = (decision.chosen, *decision.alternatives)
        for candidate in candidates:
            assert not candidate.plan.blocks_from_nowhere  # every block comes from the snapshot
        scores[replayed] = {cand.layout: (cand.transition_s, cand.estimate.step_time_s) for cand in candidates}
    for layout, (transition, step_s) in scores[50].items():
        assert transition == pytest.approx(scores[0][layout][0] + 50 * step_s)


def test_with_tensor_parallelism_each_tp_rank_reads_and_rebuilds_its_own_shard():
    """TP 2 x PP 2 x DP 2 over 2 nodes of 4 ranks: node 1 holds both workers (TP groups) of
    stage 1. Losing it rebuilds each of its ranks' shards from a partner on node 0 of the
    same TP rank (a group of two nodes mirrors), and every transfer moves TP shard k
    between TP ranks k."""
    c, config = center(4, "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                       "parallel.data_parallel_size=2")
    record = record_of(c, config)
    assert record.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    decision = c.on_failure(nodes=[1], in_memory=True,
                            snapshot=SnapshotSource(record, keepers(c, 1), config.model, replayed_steps=1))
    restore = decision.rollback
    assert [(r.lost, r.readers) for r in restore.rebuilds] == [(4, (0,)), (5, (1,)), (6, (2,)), (7, (3,))]
    assert all(read.reader % 2 == read.owner % 2 for read in restore.reads)
    assert all(t.src % 2 == t.dst % 2 for t in decision.chosen.plan.transfers)
    assert not decision.chosen.plan.blocks_from_nowhere


def test_a_restore_survives_its_json_round_trip():
    c, config = center(2)
    restore, _ = plan_restore(record_of(c, config), plan=c.on_failure(nodes=[1]).chosen.plan, cluster=c.cluster,
                              lost_keepers=set(keepers(c, 1)), model=config.model)
    assert Restore.from_dict(restore.to_dict()) == restore
    assert restore.workers(1) == {0, 1, 4, 5, 6, 7}


@pytest.mark.parametrize("seed", range(20))
def test_random_failures_bring_every_block_of_the_new_plan_back_from_where_it_was_read(seed):
    """Any one lost node, or any ranks killed on live nodes (keepers alive): every block each
    new worker trains is read or rebuilt somewhere and reaches it."""
    rng = random.Random(seed)
    devices_per_node = rng.choice([2, 4, 8])
    c, config = center(devices_per_node)
    record = record_of(c, config)
    nodes = 8 // devices_per_node
    if nodes > 1 and rng.random() < 0.5:
        lost = {rng.randrange(nodes)}
        cluster_ranks = dict(nodes=sorted(lost))
    else:
        lost = set()
        cluster_ranks = dict(ranks=rng.sample(range(8), rng.randint(1, 3)))
    try:
        decision = c.on_failure(**cluster_ranks)
    except UnrecoverableFailure:
        return
    plan = decision.chosen.plan
    try:
        restore, transfers = plan_restore(record, plan=plan, cluster=c.cluster, lost_keepers=set(keepers(c, *lost)),
                                          model=config.model)
    except SnapshotLost:
        assert nodes == 1  # with parity across nodes, one lost node is always rebuilt
        return
    _check_every_block_arrives(restore, replace(plan, transfers=transfers), config)


def _check_every_block_arrives(restore: Restore, plan, config) -> None:
    """Each worker of ``plan`` ends with exactly its blocks: read or rebuilt by itself, or
    transferred from the rank that read or rebuilt it."""
    written = dict(restore.owners)
    held: dict[int, set] = {}
    for read in restore.reads:
        held.setdefault(read.reader, set()).update(shard_blocks(written, read.owner))
    for rebuilt in restore.rebuilds:
        held.setdefault(rebuilt.readers[0], set()).update(shard_blocks(written, rebuilt.lost))
    assert all(isinstance(r, SnapshotRead) for r in restore.reads)
    for transfer in plan.transfers:
        assert transfer.src is not None and transfer.layer in held.get(transfer.src, set()), transfer
    for worker in plan.workers:
        arriving = {t.layer for t in plan.transfers if t.dst == worker}
        assert set(worker_blocks(plan, worker, tied=config.model.tie_embeddings)) <= held.get(worker, set()) | arriving


def test_a_node_registered_again_has_its_old_shards_lost_and_its_new_ones_read_where_its_fresh_keeper_holds_them(
        tmp_path):
    """4 nodes of 2. Node 1 (ranks 2, 3) is lost after the snapshot of step 4 (generation 0):
    its shards stay lost once the node registered again and a generation took it back, until
    a snapshot of that generation completes, written to its fresh keeper. Node 2 (ranks 4, 5)
    lost then rolls back to that one, reading node 1's shards on node 1. On the code before,
    node 1's keeper counted as lost for good: ranks 2 and 4, of one protection group, both
    lost, and the run could not go on."""
    c, config = center(2)
    controller = Controller(host="127.0.0.1", port=0, timeouts=config.odyssey.timeouts, run_dir=tmp_path)
    run = RunState(config=config, controller=controller, center=c, run_dir=tmp_path)
    following = SnapshotFollowing(run)
    run.plan, run.committed = c.plan, 6  # generation 0 runs, past its first step
    following.last = record_of(c, config)
    node_1 = keepers(c, 1)
    following.failed(Failure(Cause.NODE, tuple(node_1), 1, 1.0, 1.0, "lost", node_ranks=tuple(node_1)))
    assert following.source(6).lost_keepers == node_1
    run.plan = replace(c.plan, generation=2)  # node 1 registered again and generation 2 took it back
    assert following.source(6).lost_keepers == node_1  # its fresh keeper holds nothing of step 4
    following.last = SnapshotRecord(8, 2, run.plan, record_of(c, config).groups)
    node_2 = keepers(c, 2)
    following.failed(Failure(Cause.NODE, tuple(node_2), 2, 2.0, 2.0, "lost", node_ranks=tuple(node_2)))
    source = following.source(9)
    assert source.lost_keepers == node_2
    restore = c.on_failure(nodes=[2], in_memory=True, snapshot=source).rollback
    assert [rebuild.lost for rebuild in restore.rebuilds] == [4, 5]
    assert {read.owner: read.reader for read in restore.reads if read.owner in (2, 3)} == {2: 2, 3: 3}
