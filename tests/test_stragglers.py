"""Stragglers from the step reports' op times (``runtime.control.stragglers``) with made-up
reports, a straggler's removal through the controller's inbox, and the owner removing one
only where the decision center prices removal as paying (``DecisionCenter.on_straggler``).

The plan: two pipelines of two stages (workers 0 -> 2 and 1 -> 3), two micro-batches each."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from control_cases import signed_client
from helpers import symmetric_plan
from test_run_endings import RANKS, _owner
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.console import failure_line
from odyssey_megatron.runtime.control.detector import Cause
from odyssey_megatron.runtime.control.stragglers import REPRICE_SLOWDOWN_GROWTH, StragglerWatch, straggler_line
from odyssey_megatron.runtime.protocol.keys import (
    INBOX,
    applied_key,
    kill_orders_key,
    node_heartbeat_key,
    step_report_key,
)
from odyssey_megatron.runtime.protocol.messages import (
    KillOrder,
    NodeHeartbeat,
    NodeRegistration,
    RankRegistration,
    StepReport,
)
from odyssey_megatron.timeouts import Timeouts

pytestmark = pytest.mark.timeout(60)

PLAN = symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2)
PROFILE = uniform_profile(num_layers=4)


def _reports(seconds_per_op: dict[int, float], *, stage_1_heavier: float = 1.0) -> list[StepReport]:
    """Each rank's step: two forwards and two backwards, each ``seconds_per_op[rank]``
    times what the profile predicts (stage 1's ranks ``stage_1_heavier`` times more)."""
    reports = []
    for rank, scale in seconds_per_op.items():
        stage = 0 if rank in (0, 1) else 1
        times = PROFILE.stage_times(*PLAN.pipelines[0].stages[stage].layers, first=stage == 0, last=stage == 1)
        scale *= stage_1_heavier if stage == 1 else 1.0
        reports.append(StepReport(rank, (), (), (), 2 * scale * times.forward_s, 2, 2 * scale * times.backward_s,
                                  2, 0.0, 0, 0.01, 1e-3))
    return reports


def test_a_rank_twice_as_slow_as_its_dp_peer_is_found_once_after_its_steps_and_a_heavy_stage_is_not():
    watch = StragglerWatch(PROFILE, threshold=1.5, steps=3)
    slow = {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0}
    found = [watch.observe(PLAN, step, _reports(slow, stage_1_heavier=1.8)) for step in range(1, 6)]
    assert [[s.rank for s in f] for f in found] == [[], [], [3], [], []]  # once, after 3 slow steps in a row
    [straggler] = found[2]
    assert straggler.slowdown == pytest.approx(2.0) and (straggler.first_step, straggler.last_step) == (1, 3)
    assert straggler_line(straggler, removed=False) == (
        "straggler: rank 3: its ops took 2.00x its peers' time for 3 committed steps (1..3); "
        "it trains on (odyssey.straggler=report)")


def test_a_slowdown_must_last_its_steps_in_a_row_and_a_rank_fast_again_may_be_found_again():
    watch = StragglerWatch(PROFILE, threshold=1.5, steps=2)
    slow, fast = {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0}, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.1}
    sequence = [slow, fast, slow, slow, slow, fast, slow, slow]
    found = [[s.rank for s in watch.observe(PLAN, step, _reports(r))] for step, r in enumerate(sequence, 1)]
    assert found == [[], [], [], [3], [], [], [], [3]]


def test_a_kept_straggler_is_priced_again_once_slower_by_the_margin_under_a_new_plan_or_profile_and_forgotten_once_fast():
    """Kept at 1.6x: 1.8x (under 1.6 x 1.2) is noise; 1.95x over two steps is slower, priced
    again; kept there, the next generation's plan prices it again, and so does a rescaled
    profile; fast once, it is found afresh, as a first find."""
    assert REPRICE_SLOWDOWN_GROWTH == pytest.approx(0.2)
    watch = StragglerWatch(PROFILE, threshold=1.5, steps=2)
    rank_3_at = lambda x: _reports({0: 1.0, 1: 1.0, 2: 1.0, 3: x})  # noqa: E731
    assert watch.observe(PLAN, 1, rank_3_at(1.6)) == []
    [first] = watch.observe(PLAN, 2, rank_3_at(1.6))
    assert first.priced_slowdown is None and first.repriced is None
    watch.kept(first, generation=0)
    assert [watch.observe(PLAN, step, rank_3_at(1.8)) for step in (3, 4)] == [[], []]
    [slower] = watch.observe(PLAN, 5, rank_3_at(2.1))
    assert (slower.rank, slower.slowdown, slower.priced_slowdown, slower.priced_generation) == (
        3, pytest.approx(1.95), pytest.approx(1.6), 0)
    assert straggler_line(slower, removed=False, why="odyssey.straggler=remove: cheaper to keep") == (
        "straggler: rank 3: its ops took 1.95x its peers' time for 2 committed steps (4..5); priced again: kept at "
        "1.60x in generation 0, slower since; it trains on (odyssey.straggler=remove: cheaper to keep)")
    assert watch.observe(PLAN, 6, rank_3_at(2.1)) == []  # offered once: not kept again, not offered again
    watch.kept(replace(slower, slowdown=2.1), generation=0)
    assert watch.observe(PLAN, 7, rank_3_at(2.1)) == []
    recovered = replace(PLAN, generation=1)
    [new_plan] = watch.observe(recovered, 9, rank_3_at(2.1))  # step 8, the generation's first, is not measured
    assert new_plan.priced_generation == 0 and new_plan.repriced.endswith("a new plan runs")
    watch.kept(new_plan, generation=1)
    watch.profile_rescaled()  # the decision center prices with measured op times now
    [rescaled] = watch.observe(recovered, 10, rank_3_at(2.1))
    assert rescaled.priced_generation == 1 and rescaled.repriced.endswith("the profile was rescaled")
    watch.kept(rescaled, generation=1)
    assert watch.observe(recovered, 11, rank_3_at(2.1)) == []  # priced with this profile already
    assert watch.observe(recovered, 12, rank_3_at(1.1)) == []  # fast again: forgotten
    assert watch.observe(recovered, 13, rank_3_at(3.0)) == []
    [afresh] = watch.observe(recovered, 14, rank_3_at(3.0))
    assert afresh.priced_slowdown is None


def test_a_stage_without_replicas_is_compared_with_every_other_rank():
    """One pipeline of four stages: no stage has a DP peer, so each rank's seconds per
    predicted second is set against the median of every other rank's."""
    plan = symmetric_plan(dp=1, pp=4, num_layers=4, micro_batches_per_pipeline=2)
    watch = StragglerWatch(PROFILE, threshold=1.5, steps=1)
    reports = []
    for rank, scale in {0: 1.0, 1: 1.0, 2: 3.0, 3: 1.0}.items():
        times = PROFILE.stage_times(*plan.pipelines[0].stages[rank].layers, first=rank == 0, last=rank == 3)
        reports.append(StepReport(rank, (), (), (), 2 * scale * times.forward_s, 2, 2 * scale * times.backward_s,
                                  2, 0.0, 0, 0.0, 1e-3))
    assert watch.slowdowns(plan, reports) == pytest.approx({0: 1.0, 1: 1.0, 2: 3.0, 3: 1.0})
    assert [s.rank for s in watch.observe(plan, 1, reports)] == [2]


def test_a_removed_straggler_is_failed_and_killed_by_the_controller_with_its_slowdown(tmp_path):
    slow = Timeouts(heartbeat_interval=0.1, heartbeat_timeout=60.0, collective_timeout=90.0, recovery_timeout=120.0)
    controller = Controller(host="127.0.0.1", port=0, timeouts=slow, run_dir=tmp_path)
    controller.start()
    try:
        client = signed_client(controller.port, tmp_path)
        client.set(node_heartbeat_key(0), NodeHeartbeat(0, 1000.0, {"2": 0, "3": 0}, {}, {"2": 22, "3": 23}).to_json())
        for msg in (NodeRegistration(0, 10, "h", (2, 3)), RankRegistration(2, 22, "h", 0),
                    RankRegistration(3, 23, "h", 0)):
            client.queue_push(INBOX, msg.to_json())
        controller.remove_straggler(3, generation=0, detail="its ops took 2.00x its peers' time for 3 committed "
                                                            "steps (1..3)")
        failure = controller.next_failure(timeout=10)
        assert (failure.cause, failure.ranks) == (Cause.STRAGGLER, (3,))
        assert failure_line(failure).startswith("failure: rank 3 removed as a straggler (its ops took 2.00x its "
                                                "peers' time for 3 committed steps (1..3)); detected from its op times")
        assert KillOrder.from_json(client.queue_pop(kill_orders_key(0), block=False)) == KillOrder(3, 23)
        controller.remove_straggler(3, generation=0, detail="again")  # failed already: no second failure
        assert controller.next_failure(timeout=0.5) is None
    finally:
        controller.stop()


@pytest.mark.parametrize("slowdown, removed", [(1.5, False), (4.0, True)])
def test_the_owner_removes_a_straggler_only_where_removal_pays_and_says_why_with_both_prices(tmp_path, slowdown,
                                                                                            removed):
    """The tiny recipe's owner (DP 2 x PP 4) with odyssey.straggler=remove: rank 3 (stage 1)
    at 1.5x leaves a step of bubbles about 11 % slower, less than the 18 % of the plan
    without it: kept, and it says so. At 4x its steps take 2.7x as long: removed, failed
    through the controller as a straggler."""
    config, controller, client, run = _owner(tmp_path / "run", "odyssey.straggler=remove",
                                             "odyssey.straggler_steps=2", "odyssey.straggler_slowdown=1.2")
    try:
        [event] = _straggler_events(tmp_path / "run", config, controller, client, run, [slowdown] * 3)
        assert (event["rank"], event["action"], event["removed"]) == (3, "remove", removed), event
        assert event["slowdown"] == pytest.approx(slowdown) and event["priced_slowdown"] is None
        assert (event["kept_step_s"] > event["removed_step_s"]) == removed
        assert event["transition_s"] > 0 and event["horizon_s"] > 3600 and event["removal_policy"]
        failure = controller.next_failure(timeout=2.0 if removed else 0.5)
        assert (failure is not None and (failure.cause, failure.ranks)) == (removed and (Cause.STRAGGLER, (3,)))
    finally:
        run.stop_preparing()
        controller.stop()


def test_the_owner_prices_a_kept_straggler_again_once_it_slows_further_and_removes_it_where_that_now_pays(tmp_path):
    """Rank 3 of the tiny recipe's owner at 1.5x is kept (as above); at 1.6x, under the
    margin over 1.5x, it is not priced again; at 4x it is, and removed."""
    config, controller, client, run = _owner(tmp_path / "run", "odyssey.straggler=remove",
                                             "odyssey.straggler_steps=2", "odyssey.straggler_slowdown=1.2")
    try:
        kept, again = _straggler_events(tmp_path / "run", config, controller, client, run,
                                        [1.5, 1.5, 1.5, 1.6, 1.6, 4.0, 4.0])
        assert (kept["removed"], kept["last_step"], kept["priced_slowdown"]) == (False, 2, None)
        assert (again["removed"], again["last_step"], again["priced_slowdown"]) == (True, 5, pytest.approx(1.5))
        assert again["slowdown"] == pytest.approx(2.8) and again["priced_generation"] == 0
        failure = controller.next_failure(timeout=2.0)
        assert (failure.cause, failure.ranks) == (Cause.STRAGGLER, (3,))
    finally:
        run.stop_preparing()


def _straggler_events(run_dir, config, controller, client, run, rank_3_slowdowns: list[float]) -> list[dict]:
    """Generation 0 published and its steps committed, rank 3 slowed by
    ``rank_3_slowdowns[step]`` (the first step is not measured); the ``straggler`` events."""
    run.publish(run.center.plan, run.center.estimate.step_time_s, snapshot=None, snapshot_interval=0)
    stages = {stage.worker: (si, stage) for _, si, stage in run.plan.stage_positions()}
    micro_batches = tuple(range(config.training.num_micro_batches))
    size = config.training.micro_batch_size
    for step, slowdown in enumerate(rank_3_slowdowns):
        for rank in range(RANKS):
            si, stage = stages[rank]
            times = run.center.profile.stage_times(*stage.layers, first=si == 0, last=si == 3)
            scale = slowdown if rank == 3 else 1.0
            mine = micro_batches if rank == 0 else ()  # one report carries every micro-batch
            samples = tuple(range(step * config.training.global_batch_size,
                                  step * config.training.global_batch_size + size * len(mine)))
            report = StepReport(rank, mine, tuple(1.0 for _ in mine), samples, 4 * scale * times.forward_s, 4,
                                4 * scale * times.backward_s, 4, 0.0, 0, 0.0, 1e-3)
            client.append(step_report_key(0, step), report.to_json() + "\n")
        client.add(applied_key(0, step), RANKS)
        run.collect_commits()
    controller.record.flush()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"] == "straggler"]
