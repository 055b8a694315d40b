"""Renamed decisions on symmetric plans: for every single worker and every node of small
Megatron layouts, the representative's priced drafts, renamed by a permutation that
keeps stages and nodes, are valid successors with the representative's exact price.

They are not claimed equal to the cold decision of the same failure: the cold search
breaks ties by worker id, so mirrored failures may get plans a few percent apart.
"""

from __future__ import annotations

import copy
import math

import pytest

from odyssey_megatron import decision_center
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.plan import validate_plan
from odyssey_megatron.planner.policy import sole_holders
from odyssey_megatron.planner.symmetry import rename_drafts, rename_plan, symmetry
from odyssey_megatron.restorer import check_transfers, live_holdings, with_sync


def _center(dp: int, pp: int, tp: int, per_node: int) -> DecisionCenter:
    """Llama-2 7B on H100 in Megatron's layout, two micro-batches per pipeline; as on a
    large cluster, a decision for every worker and node does not fit in
    ``odyssey.prepared_decisions_mib``, so a symmetric plan prepares its representatives."""
    config = load_config(None, [
        "model.spec=llama2-7b", "cluster.device=h100-80gb", f"cluster.devices_per_node={per_node}",
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
        f"parallel.data_parallel_size={dp}", "training.micro_batch_size=1", f"training.global_batch_size={2 * dp}",
        "odyssey.prepared_decisions_mib=0",
    ])
    center = DecisionCenter.from_recipe(config)
    center.search_time_s = 0.0
    return center


def _single_failures(cluster: ClusterState) -> list[frozenset[int]]:
    """Every worker alone, then every node's workers (where a node holds two or more)."""
    on_node: dict[int, set[int]] = {}
    for worker in range(cluster.num_workers):
        on_node.setdefault(cluster.node_of_worker(worker), set()).add(worker)
    return [frozenset([w]) for w in range(cluster.num_workers)] + \
        [frozenset(ws) for ws in on_node.values() if len(ws) > 1]


def _assert_keeps_stages_and_nodes(pi: dict[int, int], cluster: ClusterState, dp: int) -> dict[int, int]:
    """pi extended by the identity is a permutation of the workers that maps each to one
    of the same stage and each node's workers onto one node's workers."""
    full = {w: pi.get(w, w) for w in range(cluster.num_workers)}
    assert sorted(full.values()) == list(full)
    assert all(full[w] // dp == w // dp for w in full)
    nodes: dict[int, set[int]] = {}
    for w in full:
        nodes.setdefault(cluster.node_of_worker(w), set()).add(w)
    node_sets = {frozenset(ws) for ws in nodes.values()}
    assert {frozenset(full[w] for w in ws) for ws in node_sets} == node_sets
    return full


@pytest.mark.parametrize("dp,pp,tp,per_node", [
    (4, 2, 1, 2),  # nodes hold two pipelines of one stage
    (8, 4, 1, 8),  # a node holds one stage of every pipeline
    (8, 2, 2, 4),  # TP 2: two workers per node, four groups of pipelines
    (4, 4, 2, 8),  # TP 2, four workers per node: one stage of every pipeline
    (2, 4, 1, 8),  # a node holds the whole job: its failure is unrecoverable
    (2, 2, 2, 2),  # a worker fills a node
    (6, 3, 1, 2),
])
def test_every_single_worker_and_node_failure_is_a_renamed_representative(dp, pp, tp, per_node):
    center = _center(dp, pp, tp, per_node)
    plan, cluster, profile, settings = center.plan, center.cluster, center.profile, center.settings
    sym = center.symmetry()
    assert sym is not None
    representatives = center.likely_failures()
    assert len(representatives) <= 2 * pp
    center.prepare()
    prepared = center._prepared[2]
    for failed in _single_failures(cluster):
        representative, pi = sym.relabelling(failed)
        assert representative in representatives
        full = _assert_keeps_stages_and_nodes(pi, cluster, dp)
        assert {full[w] for w in representative} == failed
        after = cluster.fail_ranks(r for w in failed for r in cluster.worker_ranks(w))
        if representative not in prepared:  # nothing survives to take over: decided cold, and refused
            assert not after.alive_workers
            continue
        drafts = prepared[representative]
        holdings = live_holdings(plan, cluster=after, profile=profile)
        for draft, renamed in zip(drafts.drafts, rename_drafts(drafts, pi).drafts):
            assert (renamed.policy, renamed.layout, renamed.estimate) == (draft.policy, draft.layout, draft.estimate)
            validate_plan(renamed.plan, num_micro_batches=plan.num_micro_batches)
            assert not set(renamed.plan.workers) & failed
            check_transfers(renamed.plan, holdings=holdings, profile=profile, cluster=after)
            estimate = estimate_plan(renamed.plan, profile, after, decouple=settings.decoupled_weight_grads,
                                     staggered=settings.staggered_optimizer)
            for term in ("pipeline_time_s", "sync_time_s", "optimizer_time_s"):
                assert math.isclose(getattr(estimate, term), getattr(draft.estimate, term), rel_tol=1e-9)
            assert estimate.peak_memory_bytes == draft.estimate.peak_memory_bytes
            assert sole_holders(renamed.plan.holdings(profile)) == draft.sole_holders
            resynced = with_sync(renamed.plan, profile)  # the sync the renamed plan would get built afresh
            assert (resynced.sync_units, resynced.comm_rounds) == (renamed.plan.sync_units, renamed.plan.comm_rounds)


def test_renaming_shares_what_names_no_moved_worker():
    center = _center(8, 2, 1, 2)
    sym = center.symmetry()
    representative, pi = sym.relabelling(frozenset([8 + 5]))  # stage 1 of pipeline 5
    assert representative == frozenset([8]) and set(pi) == {4, 5, 12, 13} | {0, 1, 8, 9}
    renamed = rename_plan(center.plan, pi)
    moved = {p for p, pipeline in enumerate(center.plan.pipelines) if any(s.worker in pi for s in pipeline.stages)}
    assert moved == {0, 1, 4, 5}
    for p, (old, new) in enumerate(zip(center.plan.pipelines, renamed.pipelines)):
        assert (old is new) == (p not in moved)
        assert new.micro_batches is old.micro_batches
    assert renamed.sync_units == center.plan.sync_units  # each unit lists every pipeline: only reordered


def test_a_failure_that_is_no_single_worker_or_node_has_no_representative():
    sym = _center(4, 2, 1, 2).symmetry()
    assert sym.relabelling(frozenset([0, 5])) is None  # two workers on different nodes
    assert sym.relabelling(frozenset([1, 2])) is None  # two workers, neither a whole node
    assert sym.relabelling(frozenset()) is None


def test_plans_without_the_symmetry_fall_back_to_every_worker_and_node():
    assert _center(3, 2, 1, 2).symmetry() is None  # a node straddles two stages' pipelines unevenly
    center = _center(4, 2, 1, 2)
    center.on_failure(ranks=[3])
    assert symmetry(center.plan, center.cluster) is None  # a failed worker in the cluster (and reroutes)
    cases = center.likely_failures()
    assert cases[:len(center.plan.workers)] == [frozenset([w]) for w in center.plan.workers]


def test_on_failure_renames_the_representatives_decision_without_pricing(monkeypatch):
    """Worker 13 (stage 1 of pipeline 5) decides as its representative, worker 8, would,
    renamed: same score and estimate, the renamed plan, and nothing priced."""
    warm, cold = _center(8, 2, 1, 2), _center(8, 2, 1, 2)
    warm.prepare()
    expected = cold.on_failure(ranks=[8], at_s=3600.0)
    _, pi = warm.symmetry().relabelling(frozenset([13]))

    def no_pricing(**_):
        raise AssertionError("a renamed failure was priced")

    monkeypatch.setattr(decision_center, "draft_candidates", no_pricing)
    decision = copy.copy(warm).on_failure(ranks=[13], at_s=3600.0)
    assert (expected.source, decision.source) == ("cold", "renamed")
    assert decision.chosen.score == expected.chosen.score
    assert decision.chosen.estimate == expected.chosen.estimate
    assert decision.chosen.plan == rename_plan(expected.chosen.plan, pi)
    assert [c.plan for c in decision.alternatives] == [rename_plan(c.plan, pi) for c in expected.alternatives]


def test_a_representative_not_yet_prepared_is_decided_cold(monkeypatch):
    center = _center(8, 2, 1, 2)
    center.prepare([frozenset([0])])  # stage 0's representative only
    priced = []
    original = decision_center.draft_candidates
    monkeypatch.setattr(decision_center, "draft_candidates", lambda **kw: priced.append(1) or original(**kw))
    copy.copy(center).on_failure(ranks=[5])  # stage 0: renamed
    assert not priced
    copy.copy(center).on_failure(ranks=[13])  # stage 1: its representative was not prepared
    assert priced == [1]
