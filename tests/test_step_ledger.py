"""The commit rules of ``runtime.step_ledger`` over a dict store: every interleaving of
ranks counting into a step and the controller freezing it decides the step once, and every
rank and the controller read the same decision (the race windows of a real run, forced
here in order instead of by timing). A handover asked for at any moment makes the next step
to commit the generation's last, for every reader alike."""

from __future__ import annotations

import datetime
import itertools

import pytest

from odyssey_megatron.runtime.step_ledger import Outcome, StepLedger

WAIT = datetime.timedelta(seconds=1)


class DictStore:
    """The few store calls the ledger makes, over a dict (one thread, so ``wait`` needs
    the key set already)."""

    def __init__(self):
        self.values: dict[str, object] = {}

    def add(self, key, amount):
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]

    def set(self, key, value):
        self.values[key] = value if isinstance(value, bytes) else value.encode()

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)

    def wait(self, keys, timeout):
        if not self.check(keys):
            raise TimeoutError(f"{keys} never set")


def ledger(store, ranks=3):
    return StepLedger(store, generation=4, training_ranks=ranks)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_order_of_counting_in_and_freezing_decides_the_step_once_for_everybody(ranks):
    for freeze_at in range(ranks + 1):  # the controller freezes after this many ranks counted in
        store = DictStore()
        views, frozen_view = {}, None
        for position in range(ranks + 1):
            if position == freeze_at:
                frozen_view = ledger(store, ranks).freeze(7, 9)
            if position < ranks:
                views[position] = ledger(store, ranks).count_in(7)
        committed = freeze_at == ranks
        assert frozen_view == ([7] if committed else [])
        for rank, view in views.items():
            decided = view if view is not None else ledger(store, ranks).wait_decided(7, timeout=WAIT)
            assert decided.committed == committed, (freeze_at, rank)


def test_a_step_every_rank_counted_into_is_committed_by_the_freeze_though_nobody_collected_it():
    """The window of a failure before the owner next collects: the count is at the world
    size, the freeze commits it, and ranks that read the decision apply the step."""
    store = DictStore()
    results = [ledger(store).count_in(3) for _ in range(3)]
    assert results == [None, None, Outcome.COMMITTED]
    assert ledger(store).freeze(3, 9) == [3]
    assert ledger(store).wait_decided(3, timeout=WAIT) is Outcome.COMMITTED


def test_a_controller_two_steps_behind_commits_both_steps_the_ranks_committed():
    store = DictStore()
    for step in (5, 6):
        for _ in range(3):
            ledger(store).count_in(step)
    ledger(store).count_in(7)  # one rank of three reached step 7
    assert ledger(store).freeze(5, 9) == [5, 6]
    assert ledger(store).wait_decided(7, timeout=WAIT) is Outcome.FROZEN
    assert ledger(store).count_in(7) is Outcome.FROZEN  # late ranks see it frozen at once


def test_freezing_again_keeps_a_committed_step_committed():
    store = DictStore()
    for _ in range(3):
        ledger(store).count_in(2)
    assert ledger(store).freeze(2, 4) == [2]
    assert ledger(store).freeze(2, 4) == [2]
    assert ledger(store).wait_decided(2, timeout=WAIT) is Outcome.COMMITTED


def test_nothing_past_the_last_step_is_frozen():
    store = DictStore()
    for _ in range(3):
        ledger(store).count_in(4)
    assert ledger(store).freeze(4, 4) == [4]
    assert not any("/5" in key for key in store.values)


def test_the_control_side_sees_a_step_committed_only_at_the_world_size():
    store = DictStore()
    counted = []
    for rank in range(3):
        counted.append(ledger(store).committed(0))
        ledger(store).count_in(0)
    assert counted == [False, False, False] and ledger(store).committed(0)


def test_all_interleavings_of_two_ranks_and_a_freeze_over_two_steps_agree():
    """Brute force: ranks A and B each count into step 0 then (if it committed) step 1; the
    controller freezes once from step 0. Every order of those operations ends with each
    step decided the same for every reader, and step 1 committed only after step 0."""
    operations = ["A0", "B0", "A1", "B1", "F"]
    for order in itertools.permutations(operations):
        if order.index("A0") > order.index("A1") or order.index("B0") > order.index("B1"):
            continue
        store, seen, frozen = DictStore(), {}, None
        for op in order:
            if op == "F":
                frozen = ledger(store, 2).freeze(0, 1)
                continue
            rank, step = op[0], int(op[1])
            if step == 1 and not (seen.get((rank, 0)) or Outcome.FROZEN).committed:
                continue  # a rank applies step 1 only after step 0 committed for it
            view = ledger(store, 2).count_in(step)
            if view is None and store.check([f"gen4/decided/{step}"]):
                view = ledger(store, 2).wait_decided(step, timeout=WAIT)
            seen[(rank, step)] = view
        for (rank, step), view in seen.items():
            if view is not None:
                assert view.committed == (step in frozen), (order, rank, step)
        assert frozen in ([], [0], [0, 1]), order


def test_a_handover_asked_for_at_any_moment_ends_the_generation_after_one_step_for_every_rank():
    """Ranks A, B and C count into steps 0, 1, 2 in turn (each after the step before it
    committed for it); the controller asks for a handover at every possible moment. The
    first step decided after the request is LAST for every reader, the steps before it
    plain commits, and no rank counts into a step after it (it left the generation)."""
    operations = [(rank, step) for step in range(3) for rank in "ABC"]
    for asked_at in range(len(operations) + 1):
        store, outcomes = DictStore(), {}
        for position, (rank, step) in enumerate(operations):
            if position == asked_at:
                ledger(store).hand_over()
            if any(outcomes.get((r, s)) is Outcome.LAST for r in "ABC" for s in range(step)):
                continue  # every rank left after the last step
            outcomes[(rank, step)] = ledger(store).count_in(step)
        for (rank, step) in outcomes:
            outcomes[(rank, step)] = ledger(store).wait_decided(step, timeout=WAIT)
        by_step = {step: {o for (r, s), o in outcomes.items() if s == step} for step in range(3)}
        last = [step for step, seen in by_step.items() if seen == {Outcome.LAST}]
        expected_last = asked_at // 3  # the first step whose deciding (third) add comes after the request
        assert last == ([expected_last] if expected_last < 3 else []), (asked_at, by_step)
        assert all(seen == {Outcome.COMMITTED} for step, seen in by_step.items() if step < expected_last), asked_at
        assert not any(seen for step, seen in by_step.items() if step > expected_last), asked_at


def test_the_control_side_reads_a_handover_as_a_commit_and_freezes_nothing_past_it():
    store = DictStore()
    ledger(store).hand_over()
    for _ in range(3):
        ledger(store).count_in(5)
    assert ledger(store).committed(5) and ledger(store).decided(5) is Outcome.LAST
    assert ledger(store).freeze(5, 9) == [5]
    assert ledger(store).decided(5) is Outcome.LAST and ledger(store).decided(6) is Outcome.FROZEN
