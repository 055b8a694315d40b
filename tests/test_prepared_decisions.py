"""Decisions prepared in advance: a lookup that decides exactly as a cold decision would.

``DecisionCenter.prepare`` prices the candidates for the likely next failures; a failure
among them is then only weighed by Eq. 8 with the failure rate of that moment. With the
search time fixed (as the simulator does), the prepared decision must equal the cold one.
"""

from __future__ import annotations

import copy

import pytest

from odyssey_megatron import decision_center
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter

RECIPE = "recipes/llama2_7b/ascend_910b_32.yaml"  # DP4 x PP8 on four 8-device nodes


def _center() -> DecisionCenter:
    center = DecisionCenter.from_recipe(load_config(RECIPE, []))
    center.search_time_s = 0.0  # a cold decision's own search time would otherwise differ from a lookup's
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
    prior = _center().failure_model.expected_interval_s(center.cluster.alive_devices)
    assert warm.expected_interval_s == cold.expected_interval_s != prior


def test_a_plan_change_makes_the_prepared_decisions_stale(prepared):
    center = copy.deepcopy(prepared)
    center.on_failure(ranks=[5])
    assert center._prepared_drafts(center.cluster) is None
    calls = []
    center.prepare(stop=lambda: len(calls) >= 2 or calls.append(1))  # stops after two cases
    assert len(center._prepared[2]) == 2


def test_the_likely_failures_are_every_worker_and_every_node():
    center = _center()
    cases = center.likely_failures()
    assert cases[:32] == [frozenset([w]) for w in center.plan.workers]
    assert cases[32:] == [frozenset(range(8 * n, 8 * n + 8)) for n in range(4)]


def test_prepare_keeps_at_most_its_cap(monkeypatch):
    """Memory stays bounded at any scale: at most PREPARED_RANK_CASES / ranks cases are
    kept, however many are asked for and however often prepare runs."""
    center = _center()
    monkeypatch.setattr(decision_center, "PREPARED_RANK_CASES", 3 * 32 + 5)  # 32 ranks (TP1): a cap of 3
    assert center.prepare_cap() == 3
    assert center.prepare([frozenset([w]) for w in range(6)]) == 3
    assert center.prepare([frozenset([w]) for w in range(6, 12)]) == 0
    assert set(center._prepared[2]) == {frozenset([w]) for w in range(3)}
