"""Restorer: KM weight transfer (paper Fig. 3) and DP sync colouring (paper Fig. 4)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

from odyssey_megatron.blocks import EMBEDDING, OUTPUT
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, Reroute, StagePlan, SyncUnit
from odyssey_megatron.profile import ModelProfile, uniform_profile
from odyssey_megatron.restorer import (
    assignment_cost,
    color_rounds,
    is_valid_coloring,
    plan_weight_transfer,
    with_sync,
)

PROPERTY = settings(max_examples=50, deadline=None)


# -- helpers -----------------------------------------------------------------------------


def stage_ranges(counts):
    starts = np.cumsum([0, *counts])
    return [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def layout_blocks(profile: ModelProfile, pipelines):
    """Blocks of every stage, pipeline-major: worker w of the old plan holds entry w."""
    return [
        profile.stage_blocks(start, end, first=i == 0, last=i == len(counts) - 1)
        for counts in pipelines
        for i, (start, end) in enumerate(stage_ranges(counts))
    ]


def make_plan(num_layers, pipelines, *, failed=()):
    """Workers numbered pipeline-major; a failed worker's stage is rerouted to its peer
    in the next pipeline (tests only look at holdings)."""
    stages, reroutes, worker = [], [], 0
    for pi, counts in enumerate(pipelines):
        row = []
        for si, layers in enumerate(stage_ranges(counts)):
            row.append(StagePlan(None if worker in failed else worker, layers))
            if worker in failed:
                reroutes.append(Reroute(pi, si, worker=-1, micro_batches=(pi,)))
            worker += 1
        stages.append(PipelinePlan(stages=tuple(row), micro_batches=(pi,)))
    symmetric = len(set(map(tuple, pipelines))) == 1
    policy = "reroute" if failed else "initial" if symmetric else "reparallelize"
    return ExecutionPlan(
        generation=0,
        policy=policy,
        num_layers=num_layers,
        tensor_parallel_size=1,
        pipelines=tuple(stages),
        reroutes=tuple(reroutes),
    )


def brute_force_cost(holdings, slots, profile):
    workers = sorted(holdings)
    pair = np.array([
        [assignment_cost(holdings=holdings, slots=[s], assignment=[w], profile=profile) for s in slots]
        for w in workers
    ])
    perms = np.array(list(itertools.permutations(range(len(workers)), len(slots))))
    return int(pair[perms, np.arange(len(slots))].sum(axis=1).min())


def layer_units(units):
    return [u for u in units if any(isinstance(b, int) for b in u.blocks)]


def conflict_graph(units):
    vertices = [i for i, u in enumerate(units) if len(u.workers) >= 2]
    edges = {
        (a, b) for a, b in itertools.combinations(range(len(vertices)), 2)
        if set(units[vertices[a]].workers) & set(units[vertices[b]].workers)
    }
    return len(vertices), edges


def chromatic_number(n, edges):
    """Brute force over all set partitions (restricted growth strings)."""
    best = n

    def extend(v, classes):
        nonlocal best
        if len(classes) >= best:
            return
        if v == n:
            best = len(classes)
            return
        for c in classes:
            if not any((min(u, v), max(u, v)) in edges for u in c):
                c.append(v)
                extend(v + 1, classes)
                c.pop()
        classes.append([v])
        extend(v + 1, classes)
        classes.pop()

    extend(0, [])
    return best


def worker_clique(units):
    return max(Counter(w for u in units if len(u.workers) >= 2 for w in u.workers).values(), default=0)


# -- strategies --------------------------------------------------------------------------


@st.composite
def layer_counts(draw, num_layers, max_stages):
    k = draw(st.integers(1, min(num_layers, max_stages)))
    cuts = sorted(draw(st.lists(st.integers(1, num_layers - 1), min_size=k - 1, max_size=k - 1, unique=True)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, num_layers])]


@st.composite
def old_layouts(draw, num_layers):
    pipelines = draw(st.integers(1, 3))
    first = draw(layer_counts(num_layers, 4))
    if draw(st.booleans()):
        return [first] * pipelines
    return [first] + [draw(layer_counts(num_layers, 4)) for _ in range(pipelines - 1)]


@st.composite
def restarts(draw):
    """(holdings, slots, profile, cluster): a random old layout, some failures, maybe a
    rejoined empty worker, and a random new layout over the survivors."""
    num_layers = draw(st.integers(2, 8))
    profile = dataclasses.replace(
        uniform_profile(num_layers=num_layers, layer_state_bytes=draw(st.integers(1, 3))),
        intra_node_bandwidth=4.0,
        inter_node_bandwidth=1.0,
    )
    old = layout_blocks(profile, draw(old_layouts(num_layers)))
    failed = draw(st.sets(st.sampled_from(range(len(old))), max_size=len(old) - 1))
    holdings = {w: blocks for w, blocks in enumerate(old) if w not in failed}
    if draw(st.booleans()):
        holdings[len(old)] = []
    new = []
    while len(holdings) - sum(map(len, new)) >= 1 and (not new or draw(st.booleans())):
        new.append(draw(layer_counts(num_layers, len(holdings) - sum(map(len, new)))))
    cluster = ClusterState(world_size=len(old) + 1, devices_per_node=draw(st.sampled_from([1, 2, 4])))
    return holdings, layout_blocks(profile, new), profile, cluster


@st.composite
def random_units(draw):
    """Arbitrary holder sets, so the conflict graph need not be an interval graph."""
    workers = draw(st.integers(2, 6))
    sets = draw(st.lists(st.sets(st.integers(0, workers - 1), min_size=1), min_size=1, max_size=9))
    return [SyncUnit(blocks=(i,), workers=tuple(sorted(s))) for i, s in enumerate(sets)]


# -- weight transfer: paper Fig. 3 -------------------------------------------------------

FIG3_PROFILE = uniform_profile(num_layers=9, layer_state_bytes=1)
FIG3_OLD = layout_blocks(FIG3_PROFILE, [[3, 3, 3]] * 3)
FIG3_SLOTS = layout_blocks(FIG3_PROFILE, [[2, 2, 2, 3]] * 2)


@pytest.mark.parametrize("failed", range(9))
def test_fig3_km_matches_brute_force_and_hand_count(failed):
    # By hand, with A=[0,1] B=[2,3] C=[4,5] D=[6,7,8] twice each: the two D slots and the
    # two C slots go free to stage-2 and stage-1 holders; the A slots to stage-0 holders;
    # then the B slots cost 1 from a stage-0 or stage-1 holder, 2 from a stage-2 holder.
    # Losing stage 1 leaves one stage-0 and one stage-2 spare for B: 1 + 2 = 3.
    # Losing stage 0 leaves one stage-1 and one stage-2 spare: 1 + 2 = 3.
    # Losing stage 2 leaves one stage-0 and one stage-1 spare: 1 + 1 = 2.
    expected = {0: 3, 1: 3, 2: 2}[failed % 3]
    holdings = {w: blocks for w, blocks in enumerate(FIG3_OLD) if w != failed}
    result = plan_weight_transfer(
        holdings=holdings, slots=FIG3_SLOTS, profile=FIG3_PROFILE, cluster=ClusterState(world_size=9)
    )
    assert result.cost_bytes == expected
    assert result.cost_bytes == brute_force_cost(holdings, FIG3_SLOTS, FIG3_PROFILE)
    assert result.cost_bytes == assignment_cost(
        holdings=holdings, slots=FIG3_SLOTS, assignment=result.assignment, profile=FIG3_PROFILE
    )
    assert len(set(result.assignment)) == len(FIG3_SLOTS)
    assert sum(t.bytes for t in result.transfers) == expected


def test_fig3_paper_pairings():
    # The first node of the second old DP group holds [0,1,2] (the paper's [1,2,3]).
    # Becoming the first node of the second new DP group keeps [0,1] and drops 2: cost 0.
    # Becoming its second node needs [2,3]: 2 is kept, 3 must arrive: cost 1.
    first_of_dp2 = 3
    holdings = {first_of_dp2: FIG3_OLD[first_of_dp2]}
    slot_a, slot_b = FIG3_SLOTS[4], FIG3_SLOTS[5]
    assert [b for b in slot_a if isinstance(b, int)] == [0, 1]
    assert [b for b in slot_b if isinstance(b, int)] == [2, 3]
    cost = lambda slot: assignment_cost(  # noqa: E731
        holdings=holdings, slots=[slot], assignment=[first_of_dp2], profile=FIG3_PROFILE
    )
    assert cost(slot_a) == 0
    assert cost(slot_b) == 1


def test_more_slots_than_survivors_is_rejected():
    with pytest.raises(ValueError):
        plan_weight_transfer(
            holdings={0: FIG3_OLD[0]}, slots=FIG3_SLOTS[:2], profile=FIG3_PROFILE, cluster=ClusterState(world_size=9)
        )


@PROPERTY
@given(restarts())
def test_km_transfer_properties(case):
    holdings, slots, profile, cluster = case
    result = plan_weight_transfer(holdings=holdings, slots=slots, profile=profile, cluster=cluster)

    naive = sorted(holdings)[: len(slots)]
    assert result.cost_bytes == assignment_cost(
        holdings=holdings, slots=slots, assignment=result.assignment, profile=profile
    )
    assert result.cost_bytes <= assignment_cost(holdings=holdings, slots=slots, assignment=naive, profile=profile)
    if len(holdings) <= 7:
        assert result.cost_bytes == brute_force_cost(holdings, slots, profile)
    assert len(set(result.assignment)) == len(slots) and set(result.assignment) <= set(holdings)
    assert sum(t.bytes for t in result.transfers) == result.cost_bytes

    holders = {b: sorted(w for w in holdings if b in holdings[w]) for blocks in slots for b in blocks}
    for t in result.transfers:
        if t.src is None:
            assert not holders[t.layer]
        else:
            assert t.layer in holdings[cluster.worker_of(t.src)]
    for worker, slot in zip(result.assignment, slots):
        arrived = {t.layer for t in result.transfers if cluster.worker_of(t.dst) == worker}
        assert set(slot) <= set(holdings[worker]) | arrived

    def max_sending_s(pick):
        sent = Counter()
        for t in result.transfers:
            if t.src is not None:
                src = pick(t)
                sent[src] += t.bytes / profile.bandwidth(cluster.same_node(src, cluster.worker_of(t.dst)))
        return max(sent.values(), default=0.0)

    lowest_holder = max_sending_s(lambda t: holders[t.layer][0])
    assert max_sending_s(lambda t: cluster.worker_of(t.src)) <= lowest_holder


def full_matrix_cost(holdings, slots, profile):
    """The optimum of Kuhn-Munkres on the whole worker x slot matrix (the solver before
    workers and slots were grouped into classes)."""
    workers = sorted(holdings)
    matrix = np.array([[sum(profile.block(b).state_bytes for b in set(s) - set(holdings[w])) for s in slots]
                       for w in workers])
    rows, cols = linear_sum_assignment(matrix)
    return int(matrix[rows, cols].sum())


@st.composite
def crowds(draw):
    """(holdings, slots, profile): up to 40 workers holding arbitrary block sets drawn
    from a few kinds, and slots from a few kinds, with unequal block sizes, so classes
    are large and paths between them cross used edges."""
    num_layers = draw(st.integers(2, 8))
    sizes = draw(st.lists(st.integers(1, 9), min_size=num_layers, max_size=num_layers))
    profile = uniform_profile(num_layers=num_layers, layer_state_bytes=1)
    profile = dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, param_bytes=size, optimizer_bytes=0, grad_bytes=0)
        for layer, size in zip(profile.layers, sizes)))
    block_sets = st.lists(st.sampled_from(range(num_layers)), unique=True, max_size=num_layers)
    kinds = draw(st.lists(block_sets, min_size=1, max_size=5))
    holdings = dict(enumerate(draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=40))))
    slot_kinds = draw(st.lists(block_sets, min_size=1, max_size=5))
    slots = draw(st.lists(st.sampled_from(slot_kinds), min_size=1, max_size=len(holdings)))
    return holdings, slots, profile


@PROPERTY
@given(crowds())
def test_placement_by_class_costs_what_the_full_matrix_does(case):
    holdings, slots, profile = case
    result = plan_weight_transfer(holdings=holdings, slots=slots, profile=profile,
                                  cluster=ClusterState(world_size=len(holdings)))
    assert result.cost_bytes == full_matrix_cost(holdings, slots, profile)
    assert result.cost_bytes == assignment_cost(holdings=holdings, slots=slots, assignment=result.assignment,
                                                profile=profile)
    assert len(set(result.assignment)) == len(slots)


def test_tensor_parallel_expansion_pairs_equal_tp_ranks():
    profile = uniform_profile(num_layers=4, layer_state_bytes=5)
    old = layout_blocks(profile, [[2, 2]] * 2)  # workers 0..3, two TP ranks each
    cluster = ClusterState(world_size=8, tensor_parallel_size=2, devices_per_node=4)
    # Worker 3 rejoins empty; the same layout needs its [2, 3] + output from worker 1.
    holdings = {0: old[0], 1: old[1], 2: old[2], 3: []}
    result = plan_weight_transfer(holdings=holdings, slots=old, profile=profile, cluster=cluster)
    assert result.assignment == (0, 1, 2, 3)
    # TP rank k of worker 1 (ranks 2, 3) sends to TP rank k of worker 3 (ranks 6, 7).
    assert Counter((t.layer, t.src, t.dst) for t in result.transfers) == {
        (b, src, dst): 1 for b in (2, 3, OUTPUT) for src, dst in ((2, 6), (3, 7))
    }
    assert all(t.bytes == profile.block(t.layer).state_bytes for t in result.transfers)
    assert result.cost_bytes == 2 * 5


def test_blocks_no_survivor_holds_come_from_the_checkpoint_on_every_rank():
    profile = uniform_profile(num_layers=4, layer_state_bytes=5)
    old = layout_blocks(profile, [[2, 2]] * 2)
    cluster = ClusterState(world_size=8, tensor_parallel_size=2, devices_per_node=4)
    result = plan_weight_transfer(
        holdings={0: old[0]}, slots=layout_blocks(profile, [[4]]), profile=profile, cluster=cluster
    )
    assert result.assignment == (0,)
    assert Counter((t.layer, t.src, t.dst) for t in result.transfers) == {
        (b, None, rank): 1 for b in (2, 3, OUTPUT) for rank in (0, 1)
    }


# -- DP sync colouring: paper Fig. 4 ----------------------------------------------------


def test_fig4_symmetric_is_one_round_of_four():
    profile = uniform_profile(num_layers=8)
    plan = with_sync(make_plan(8, [[2, 2, 2, 2]] * 2), profile)
    # The embedding shares holders with layers 0-1 and the output with 6-7: no extra units.
    assert plan.sync_units == (
        SyncUnit((EMBEDDING, 0, 1), (0, 4)),
        SyncUnit((2, 3), (1, 5)),
        SyncUnit((4, 5), (2, 6)),
        SyncUnit((6, 7, OUTPUT), (3, 7)),
    )
    assert len(layer_units(plan.sync_units)) == 4
    assert plan.comm_rounds == ((0, 1, 2, 3),)


def test_fig4_asymmetric_is_six_units_in_two_rounds():
    profile = uniform_profile(num_layers=8)
    plan = with_sync(make_plan(8, [[2, 2, 2, 2], [3, 2, 3]]), profile)
    assert [u.workers for u in layer_units(plan.sync_units)] == [(0, 4), (1, 4), (1, 5), (2, 5), (2, 6), (3, 6)]
    assert plan.sync_units[1].blocks == (2,)
    assert plan.comm_rounds == ((0, 2, 4), (1, 3, 5))
    assert is_valid_coloring(plan.sync_units, plan.comm_rounds)


def test_failed_stage_leaves_a_single_worker_unit_out_of_the_rounds():
    profile = uniform_profile(num_layers=8)
    plan = with_sync(make_plan(8, [[2, 2, 2, 2]] * 2, failed={6}), profile)
    assert SyncUnit((4, 5), (2,)) in plan.sync_units
    lone = plan.sync_units.index(SyncUnit((4, 5), (2,)))
    assert all(lone not in r for r in plan.comm_rounds)
    assert is_valid_coloring(plan.sync_units, plan.comm_rounds)


def test_odd_cycle_needs_three_rounds_beyond_the_clique_bound():
    units = [SyncUnit((i,), (i, (i + 1) % 5)) for i in range(5)]
    rounds = color_rounds(units)
    assert worker_clique(units) == 2
    assert len(rounds) == 3 and is_valid_coloring(units, rounds)


def test_grotzsch_graph_needs_four_rounds():
    # Triangle-free with chromatic number 4: DSATUR's clique bound (2) never closes the
    # gap, so optimality needs the full branch and bound.
    outer = [(i, (i + 1) % 5) for i in range(5)]
    spokes = [(5 + i, j) for i in range(5) for j in ((i - 1) % 5, (i + 1) % 5)]
    hub = [(10, 5 + i) for i in range(5)]
    edges = outer + spokes + hub
    units = [SyncUnit((v,), tuple(e for e, edge in enumerate(edges) if v in edge)) for v in range(11)]
    rounds = color_rounds(units)
    assert len(rounds) == 4 and is_valid_coloring(units, rounds)
    assert color_rounds(units) == rounds


def test_node_limit_still_returns_a_valid_coloring():
    units = [SyncUnit((i,), (i, (i + 1) % 5)) for i in range(5)]
    rounds = color_rounds(units, node_limit=0)
    assert is_valid_coloring(units, rounds)


def test_is_valid_coloring_rejects_bad_schedules():
    units = [SyncUnit((0,), (0, 1)), SyncUnit((1,), (1, 2)), SyncUnit((2,), (3,))]
    assert is_valid_coloring(units, ((0,), (1,)))
    assert not is_valid_coloring(units, ((0, 1),))  # share worker 1
    assert not is_valid_coloring(units, ((0,),))  # unit 1 unscheduled
    assert not is_valid_coloring(units, ((0,), (1,), (1,)))  # unit 1 twice
    assert not is_valid_coloring(units, ((0,), (1,), (2,)))  # single-worker unit scheduled


@PROPERTY
@given(st.data())
def test_plan_colorings_are_valid_and_minimum(data):
    num_layers = data.draw(st.integers(2, 10))
    pipelines = data.draw(old_layouts(num_layers))
    workers = sum(map(len, pipelines))
    failed = data.draw(st.sets(st.integers(0, workers - 1), max_size=workers // 2))
    profile = dataclasses.replace(uniform_profile(num_layers=num_layers), tie_embeddings=data.draw(st.booleans()))
    plan = with_sync(make_plan(num_layers, pipelines, failed=failed), profile)

    units, rounds = plan.sync_units, plan.comm_rounds
    assert is_valid_coloring(units, rounds)
    synced = [b for u in units for b in u.blocks]
    assert len(synced) == len(set(synced))
    assert set(synced) == {b for blocks in plan.holdings(profile).values() for b in blocks}
    assert worker_clique(units) <= len(rounds)
    n, edges = conflict_graph(units)
    if n <= 8:
        assert len(rounds) == chromatic_number(n, edges)


@PROPERTY
@given(random_units())
def test_arbitrary_colorings_are_valid_and_minimum(units):
    rounds = color_rounds(units)
    assert is_valid_coloring(units, rounds)
    assert list(rounds) == sorted(rounds, key=lambda r: r[0])
    assert all(list(r) == sorted(r) for r in rounds)
    assert worker_clique(units) <= len(rounds) == chromatic_number(*conflict_graph(units))
