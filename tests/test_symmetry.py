"""Renamed decisions on symmetric plans: for every single worker and every node of small
Megatron layouts, the representative's priced drafts, renamed by a permutation that
keeps stages and nodes, are valid successors with the representative's exact price.

They are not claimed equal to the cold decision of the same failure: the cold search
breaks ties by worker id, so mirrored failures may get plans a few percent apart.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest

from odyssey_megatron import decision_center
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import PREPARED_BYTES_PER_RANK, DecisionCenter
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.plan import validate_plan
from odyssey_megatron.planner.policy import sole_holders
from odyssey_megatron.planner.symmetry import rename_drafts, rename_plan, symmetry
from odyssey_megatron.restorer import check_transfers, live_holdings, with_sync
from odyssey_megatron.units import MIB


def _center(dp: int, pp: int, tp: int, per_node: int, *overrides: str) -> DecisionCenter:
    """Llama-2 7B on H100 in Megatron's layout, two micro-batches per pipeline; as on a
    large cluster, a decision for every worker and node does not fit in
    ``odyssey.prepared_decisions_mib``, so a symmetric plan prepares its representatives."""
    config = load_config(None, [
        "model.spec=llama2-7b", "cluster.device=h100-80gb", f"cluster.devices_per_node={per_node}",
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
        f"parallel.data_parallel_size={dp}", "training.micro_batch_size=1", f"training.global_batch_size={2 * dp}",
        "odyssey.prepared_decisions_mib=0", *overrides,
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
    cluster = center.cluster
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
        _assert_renamed_drafts_exact(center, prepared[representative], pi, after)


def _assert_renamed_drafts_exact(center: DecisionCenter, drafts, pi: dict[int, int], after: ClusterState) -> None:
    """The representative's ``drafts`` renamed by pi are valid successors of the center's
    plan on ``after`` (the cluster once the renamed failure happened), read from its live
    holdings, with the representative's price, layout and sole holders."""
    plan, profile, settings = center.plan, center.profile, center.settings
    holdings = live_holdings(plan, cluster=after, profile=profile)
    for draft, renamed in zip(drafts.drafts, rename_drafts(drafts, pi).drafts):
        assert (renamed.policy, renamed.layout, renamed.estimate) == (draft.policy, draft.layout, draft.estimate)
        validate_plan(renamed.plan, num_micro_batches=plan.num_micro_batches)
        assert not set(renamed.plan.workers) & after.failed_workers
        assert not {r.worker for r in renamed.plan.reroutes} & after.failed_workers
        check_transfers(renamed.plan, holdings=holdings, profile=profile, cluster=after)
        estimate = estimate_plan(renamed.plan, profile, after, pricing=settings.search.pricing)
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
    center = _center(4, 2, 1, 2, "odyssey.policy=reroute")
    center.on_failure(ranks=[7])  # stage 1 of pipeline 3, rerouted to pipelines 0 and 1
    assert {r.pipeline for r in center.plan.reroutes} == {3}
    assert {r.worker % 4 for r in center.plan.reroutes} <= {0, 1}
    assert symmetry(center.plan, center.cluster) is None  # both groups touched: none eligible
    cases = center.likely_failures()
    assert cases[:len(center.plan.workers)] == [frozenset([w]) for w in center.plan.workers]
    whole = _center(8, 2, 1, 8, "odyssey.policy=reroute")  # a node holds whole stages
    assert whole.symmetry() is not None
    whole.on_failure(ranks=[15])
    assert whole.symmetry() is None


def _after_first_failure(dp: int, pp: int, tp: int, per_node: int) -> DecisionCenter:
    """The center once the last stage of the last pipeline failed and was rerouted."""
    center = _center(dp, pp, tp, per_node, "odyssey.policy=reroute")
    center.on_failure(ranks=[center.cluster.worker_ranks((pp - 1) * dp + dp - 1)[0]])
    assert center.plan.reroutes
    return center


def _fixed_workers(center: DecisionCenter, group: int) -> set[int]:
    """Workers pi must fix, read off the plan: every worker of a group of ``group``
    pipelines of which one is a reroute's source, holds a reroute's adopter or a failed
    worker, or has a stage off its Megatron worker; and every failed worker."""
    plan, failed = center.plan, center.cluster.failed_workers
    dp = len(plan.pipelines)
    adopters = {r.worker for r in plan.reroutes}
    touched = {r.pipeline for r in plan.reroutes} | {
        d for d, pipeline in enumerate(plan.pipelines)
        if any(stage.worker != s * dp + d or stage.worker in adopters | failed for s, stage in enumerate(pipeline.stages))}
    groups = {d // group for d in touched}
    return {w for w in range(center.cluster.num_workers) if w % dp // group in groups} | set(failed)


@pytest.mark.parametrize("dp,pp,tp,per_node", [
    (8, 2, 1, 2),  # four groups of two pipelines: the reroute touches the first and last
    (8, 4, 1, 2),
    (8, 2, 2, 4),  # TP 2, two workers per node
    (6, 2, 1, 2),  # one eligible group left
    (6, 3, 2, 4),
    (8, 2, 2, 2),  # a worker fills a node: groups of one pipeline
    (4, 2, 2, 2),
])
def test_after_a_reroute_every_failure_of_an_untouched_group_is_a_renamed_representative(dp, pp, tp, per_node):
    """The second failure anywhere in the groups the first recovery left alone is its
    representative's decision, renamed around the reroute, failed worker and moved stages,
    exact as on a failure-free plan."""
    center = _after_first_failure(dp, pp, tp, per_node)
    cluster, before = center.cluster, center.cluster.failed_workers
    sym = center.symmetry()
    assert sym is not None and sym.eligible
    fixed = _fixed_workers(center, sym.group)
    assert set(sym.eligible) == {b for b in range(0, dp, sym.group) if b not in {w % dp for w in fixed}}
    representatives = sym.representatives()
    cases = center.likely_failures()
    assert cases[:len(representatives)] == representatives
    uncovered = cases[len(representatives):]
    assert uncovered and all(case & fixed for case in uncovered)
    center.prepare()
    prepared = center._prepared[2]
    assert {r | before for r in representatives} <= set(prepared)
    covered = [f for f in _single_failures(cluster) if not f & fixed]
    assert covered
    for failed in covered:
        representative, pi = sym.relabelling(failed)
        assert representative in representatives
        full = _assert_keeps_stages_and_nodes(pi, cluster, dp)
        assert {full[w] for w in representative} == failed
        assert all(full[w] == w for w in fixed)
        after = cluster.fail_ranks(r for w in failed for r in cluster.worker_ranks(w))
        assert after.failed_workers == failed | before
        _assert_renamed_drafts_exact(center, prepared[representative | before], pi, after)
    for worker in fixed - before:  # a worker the first recovery touched has no equivalent
        assert sym.relabelling(frozenset([worker])) is None


def test_after_a_reroute_a_renamed_failure_decides_without_pricing_and_a_touched_one_cold_or_prepared(monkeypatch):
    """Worker 13 (stage 1 of pipeline 5) after worker 15 failed: its representative's
    decision (worker 12, first eligible group 4-5), renamed. Worker 8, which adopted
    pipeline 7's micro-batches, is decided cold, or from its own prepared case where the
    memory budget holds one more than the representatives."""
    warm, cold = _after_first_failure(8, 2, 1, 2), _after_first_failure(8, 2, 1, 2)
    warm.prepare()
    sym = warm.symmetry()
    assert sym.eligible == (2, 4) and sym.representatives()[1] == frozenset([10])
    expected = copy.copy(cold).on_failure(ranks=[10], at_s=3600.0)
    representative, pi = sym.relabelling(frozenset([13]))
    assert representative == frozenset([10])
    assert set(pi) == {2, 3, 4, 5, 10, 11, 12, 13}  # groups 2-3 and 4-5 swapped, then 2 and 3 transposed

    def no_pricing(**_):
        raise AssertionError("a renamed failure was priced")

    with monkeypatch.context() as patched:
        patched.setattr(decision_center, "draft_candidates", no_pricing)
        decision = copy.copy(warm).on_failure(ranks=[13], at_s=3600.0)
    assert (expected.source, decision.source) == ("cold", "renamed")
    assert decision.chosen.score == expected.chosen.score
    assert decision.chosen.plan == rename_plan(expected.chosen.plan, pi)

    assert sym.relabelling(frozenset([8])) is None
    assert copy.copy(warm).on_failure(ranks=[8], at_s=3600.0).source == "cold"
    roomy = _after_first_failure(8, 2, 1, 2)
    ranks = len(roomy.plan.workers) * roomy.plan.tensor_parallel_size
    cases = len(sym.representatives()) + 1
    roomy.settings = replace(roomy.settings,
                             prepared_decisions_mib=(cases * PREPARED_BYTES_PER_RANK * ranks + 1) / MIB)
    roomy.prepare()
    first_uncovered = roomy.likely_failures()[cases - 1]
    assert len(roomy._prepared[2]) == cases and first_uncovered | {15} in roomy._prepared[2]
    (worker,) = first_uncovered
    cold_decision = _after_first_failure(8, 2, 1, 2).on_failure(ranks=[worker], at_s=3600.0)
    with monkeypatch.context() as patched:
        patched.setattr(decision_center, "draft_candidates", no_pricing)
        prepared_decision = copy.copy(roomy).on_failure(ranks=[worker], at_s=3600.0)
    assert prepared_decision.source == "prepared"
    assert prepared_decision.chosen == cold_decision.chosen


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
