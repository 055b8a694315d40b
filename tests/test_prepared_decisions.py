"""Decisions prepared in advance: a lookup that decides exactly as a cold decision would.

``DecisionCenter.prepare`` prices the candidates for the likely next failures; a failure
among them is then only weighed by Eq. 8 with the failure rate of that moment. With the
search time fixed (as the simulator does), the prepared decision must equal the cold one.
(Failures equivalent to a prepared one on a symmetric plan get its decision renamed:
tests/test_symmetry.py.)
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from odyssey_megatron import decision_center
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import PREPARED_BYTES_PER_RANK, DecisionCenter
from odyssey_megatron.units import MIB

RECIPE = "recipes/llama2_7b/ascend_910b_32.yaml"  # DP8 x PP4 on four 8-device nodes


def _center() -> DecisionCenter:
    center = DecisionCenter.from_recipe(load_config(RECIPE, []))
    center.search_time_s = 0.0  # a cold decision's own search time would otherwise differ from a lookup's
    return center


def _holding(center: DecisionCenter, cases: int) -> DecisionCenter:
    """``center`` with ``odyssey.prepared_decisions_mib`` holding ``cases`` decisions of its plan."""
    ranks = len(center.plan.workers) * center.plan.tensor_parallel_size
    mib = (cases * PREPARED_BYTES_PER_RANK * ranks + 1) / MIB
    center.settings = replace(center.settings, prepared_decisions_mib=mib)
    return center


def _no_pricing(**_):
    raise AssertionError("a prepared failure was priced again")


@pytest.fixture(scope="module")
def prepared() -> DecisionCenter:
    center = _center()
    cases = [frozenset([w]) for w in (0, 5, 13, 31)] + [frozenset(range(8, 16))]
    assert center.prepare(cases) == 5
    return center


@pytest.mark.parametrize("failed", [{"ranks": [0]}, {"ranks": [5]}, {"ranks": [13]}, {"ranks": [31]},
                                    {"nodes": [1]}])
def test_a_prepared_failure_decides_as_a_cold_one(prepared, failed, monkeypatch):
    """Same chosen plan, score and alternatives; the failure an hour in also updates the
    learned failure rate, which the prepared decision weighs with as the cold one does."""
    cold = _center().on_failure(**failed, at_s=3600.0)
    center = copy.deepcopy(prepared)
    monkeypatch.setattr(decision_center, "draft_candidates", _no_pricing)
    warm = center.on_failure(**failed, at_s=3600.0)
    assert warm.chosen == cold.chosen
    assert warm.alternatives == cold.alternatives
    assert (cold.source, warm.source) == ("cold", "prepared")
    prior = _center().failure_model.expected_interval_s(center.cluster.alive_devices)
    assert warm.expected_interval_s == cold.expected_interval_s != prior


def test_where_every_case_fits_an_unprepared_failure_is_decided_cold_not_renamed(prepared):
    """A small plan prepares each case as itself: worker 1's case is not prepared (yet),
    and although worker 0's is and stands for it on this symmetric plan, its renamed
    decision could differ from the cold one (the search breaks ties by worker id), so
    worker 1's failure is decided cold."""
    assert prepared.symmetry().covers(1)
    decision = copy.deepcopy(prepared).on_failure(ranks=[1])
    assert decision.source == "cold"
    assert decision.chosen == _center().on_failure(ranks=[1]).chosen


def test_a_plan_change_makes_the_prepared_decisions_stale(prepared):
    center = copy.deepcopy(prepared)
    center.on_failure(ranks=[5])
    assert center._prepared_drafts(center.cluster) is None
    assert center.prepare(stop=lambda: len(center._prepared[2]) >= 2) == 2  # stops after two cases
    assert len(center._prepared[2]) == 2


def test_a_stop_inside_a_case_ends_prepare_at_the_next_pricing():
    """A failure while a case is priced must not wait for the whole case (seconds at
    scale): prepare gives way at the next pricing and drops the unfinished case."""
    center = _center()
    asked = []

    def stop() -> bool:  # false between cases, true once asked inside the case
        asked.append(1)
        return len(asked) > 1

    assert center.prepare([frozenset([5]), frozenset([6])], stop=stop) == 0
    assert center._prepared[2] == {}
    assert len(asked) == 2


def test_the_likely_failures_of_a_small_symmetric_plan_are_every_worker_and_every_node():
    """Where ``odyssey.prepared_decisions_mib`` holds every case (150 MiB: 4,096 at 32
    ranks), each is prepared as it would be decided cold; no decision is renamed."""
    center = _center()
    assert center.likely_failures() == [frozenset([w]) for w in center.plan.workers] + \
        [frozenset(range(8 * n, 8 * n + 8)) for n in range(4)]
    assert center.prepare_cap() == 4096


def test_the_likely_failures_of_a_large_symmetric_plan_are_its_representatives():
    """DP8 x PP4 with a node per stage, when not every case fits: each stage's worker in
    pipeline 0 and each node stand for every single-worker and single-node failure
    (``planner.symmetry``)."""
    center = _holding(_center(), 35)  # one short of every worker and node
    assert center.likely_failures() == [frozenset([8 * s]) for s in range(4)] + \
        [frozenset(range(8 * n, 8 * n + 8)) for n in range(4)]


def test_the_likely_failures_of_other_plans_are_every_worker_and_every_node():
    center = _center()
    center.on_failure(ranks=[5])  # rerouted, with a failed worker: no symmetry
    workers = center.plan.workers
    cases = center.likely_failures()
    assert cases[:len(workers)] == [frozenset([w]) for w in workers]
    assert cases[len(workers):] == [frozenset(range(8 * n, 8 * n + 8)) - {5} for n in range(4)]


def test_prepare_keeps_at_most_its_cap():
    """Memory stays bounded at any scale: on a plan without symmetry at most the cases
    ``odyssey.prepared_decisions_mib`` holds are kept, however many are asked for and
    however often prepare runs."""
    center = _center()
    center.on_failure(ranks=[5])  # rerouted, with a failed worker: no symmetry
    _holding(center, 3)
    assert center.prepare_cap() == 3
    assert center.prepare([frozenset([w]) for w in range(6, 12)]) == 3
    assert center.prepare([frozenset([w]) for w in range(12, 18)]) == 0
    assert set(center._prepared[2]) == {frozenset([5, w]) for w in range(6, 9)}


def test_a_symmetric_plan_keeps_every_representative_whatever_the_cap():
    """Its representatives (at most two per stage) cover every single-worker and node failure."""
    center = _holding(_center(), 3)
    assert center.prepare_cap() == len(center.likely_failures()) == 8
