"""A stall is blamed on the rank that is behind, never on the one that waited: the wait
graph of a generation (``runtime.control.blame``) over made-up positions, the detector
over made-up heartbeats, and the controller taking a stall report from its inbox.

The plan throughout: two pipelines of two stages (workers 0 -> 2 and 1 -> 3), two
micro-batches each, plain 1F1B: stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1."""

from __future__ import annotations

from dataclasses import replace

import pytest

from control_cases import signed_client, wait_for
from helpers import symmetric_plan
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.runtime.control.blame import WaitGraph
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.detector import Cause, Detector
from odyssey_megatron.runtime.protocol.keys import INBOX, kill_orders_key, node_heartbeat_key
from odyssey_megatron.runtime.protocol.messages import (
    CollectiveStalled,
    KillOrder,
    NodeHeartbeat,
    NodeRegistration,
    RankExit,
    RankRegistration,
)
from odyssey_megatron.settings import PLAIN
from odyssey_megatron.timeouts import Timeouts

pytestmark = pytest.mark.timeout(60)

GENERATION = 0
STEP = 3
HUNG_IN_STAGE_1 = {0: (STEP, 2), 1: (STEP, 4), 2: (STEP, 0), 3: (STEP, 4)}
"""Worker 2 hangs computing its first forward (its input from worker 0 came): worker 0 ran
both forwards and waits for its first backward from 2; pipeline 1 is done with its ops
and waits in the gradient sync."""


def _plan_and_program(tensor_parallel_size: int = 1):
    plan = replace(symmetric_plan(dp=2, pp=2, num_layers=4, micro_batches_per_pipeline=2),
                   tensor_parallel_size=tensor_parallel_size)
    return plan, step_program(plan, uniform_profile(num_layers=4), pricing=PLAIN)


def test_the_ranks_waits_end_at_the_one_that_holds_everyone_up_whoever_reports():
    waits = WaitGraph(*_plan_and_program())
    assert waits.waits_for(0, HUNG_IN_STAGE_1) == {2}  # its backward's input comes from 2
    assert waits.waits_for(1, HUNG_IN_STAGE_1) == {0, 2}  # the step's end waits for every unfinished worker
    assert waits.waits_for(2, HUNG_IN_STAGE_1) == set()  # its forward's input is there: it computes
    for reporter in (0, 1, 3):
        assert waits.behind(reporter, HUNG_IN_STAGE_1) == (2,)


def test_a_reporter_that_waits_for_nobody_the_positions_show_is_named_itself():
    """Worker 2 waits for its forward's input, which worker 0 computed (a broken link, not
    a rank behind): nothing places another rank behind it, so it is named, as before."""
    waits = WaitGraph(*_plan_and_program())
    assert waits.behind(2, HUNG_IN_STAGE_1) == (2,)


def test_a_rank_with_no_position_in_the_generation_is_behind_the_one_waiting_for_it():
    """Worker 3 never began a step of the generation (still entering it, say): worker 1,
    waiting for its first backward from 3, blames 3."""
    waits = WaitGraph(*_plan_and_program())
    positions = {0: (STEP, 4), 1: (STEP, 2), 2: (STEP, 4)}
    assert waits.behind(1, positions) == (3,)
    assert waits.behind(1, {**positions, 3: None}) == (3,)


LATE_TO_COUNT_IN = {0: (STEP, 5), 1: (STEP, 5), 2: (STEP, 5), 3: (STEP, 4)}
"""Every worker is past its four ops; all but worker 3 counted into the step's commit
(one past the ops) and wait for its decision: worker 3 is late between its clipping and
its count-in."""


def test_a_commit_wait_that_ran_out_is_blamed_on_the_worker_not_counted_in():
    """On the code before the count-in position, the waiting worker past its ops saw
    nobody behind (every worker was past its ops) and was named itself."""
    waits = WaitGraph(*_plan_and_program())
    for reporter in (0, 1, 2):
        assert waits.waits_for(reporter, LATE_TO_COUNT_IN) == {3}
        assert waits.behind(reporter, LATE_TO_COUNT_IN) == (3,)
    assert waits.waits_for(3, LATE_TO_COUNT_IN) == set()  # nobody before it: it is the one behind
    still_computing = {**LATE_TO_COUNT_IN, 2: (STEP, 3)}
    assert waits.behind(0, still_computing) == (2,)  # the one short of its ops, wherever the others are


def test_a_worker_behind_is_blamed_with_every_tp_rank_it_has():
    waits = WaitGraph(*_plan_and_program(tensor_parallel_size=2))
    positions = {2 * worker + k: position for worker, position in HUNG_IN_STAGE_1.items() for k in (0, 1)}
    assert waits.behind(0, positions) == (4, 5)
    assert waits.behind(3, positions) == (4, 5)


def _node_beat(seq: int, positions: dict[int, tuple[int, int]]) -> dict[str, NodeHeartbeat]:
    ranks = {str(rank): seq for rank in positions}
    beat = NodeHeartbeat(seq, 1000.0 + seq, ranks, {r: GENERATION for r in ranks}, {r: 20 + int(r) for r in ranks},
                         steps={str(r): p[0] for r, p in positions.items()},
                         ops_done={str(r): p[1] for r, p in positions.items()})
    return {node_heartbeat_key(0): beat}


def _detector() -> Detector:
    detector = Detector(1.0)
    detector.node_joined(NodeRegistration(0, 10, "h", (0, 1, 2, 3)), now=0.0, wall=1000.0)
    for rank in range(4):
        detector.rank_joined(RankRegistration(rank, 20 + rank, "h", 0), now=0.0)
    return detector


def test_the_detector_fails_the_rank_behind_from_the_generations_beats_and_keeps_the_one_that_waited():
    detector = _detector()
    detector.observe(_node_beat(1, HUNG_IN_STAGE_1), now=0.1)
    stall = CollectiveStalled(0, GENERATION, "a collective waited over the collective timeout (30.0 s)", 5.0,
                              *HUNG_IN_STAGE_1[0])
    failure = detector.rank_stalled(stall, wall=6.0, waits=WaitGraph(*_plan_and_program()))
    assert (failure.cause, failure.ranks, failure.failed_at) == (Cause.STALL, (2,), 5.0)
    assert failure.detail == ("rank 2 behind (step 3, 0 op(s) done) while rank 0 waited (step 3, 2 op(s) done): "
                              "a collective waited over the collective timeout (30.0 s)")
    states = {rank: row["state"] for rank, row in detector.workers().items()}
    assert states == {0: "alive", 1: "alive", 2: "failed", 3: "alive"}


def test_the_detector_fails_the_rank_late_to_count_in_when_a_commit_wait_runs_out():
    detector = _detector()
    detector.observe(_node_beat(1, LATE_TO_COUNT_IN), now=0.1)
    stall = CollectiveStalled(1, GENERATION, "step 3: no decision within the collective timeout", 5.0,
                              *LATE_TO_COUNT_IN[1])
    failure = detector.rank_stalled(stall, wall=6.0, waits=WaitGraph(*_plan_and_program()))
    assert (failure.cause, failure.ranks) == (Cause.STALL, (3,))
    assert detector.workers()[1]["state"] == "alive"


def test_a_stall_blamed_on_a_rank_already_failed_fails_nobody_more():
    """Rank 2 died (its exit is the failure that ends the generation); the stall of the
    rank that waited for it fails no one else."""
    detector = _detector()
    detector.observe(_node_beat(1, HUNG_IN_STAGE_1), now=0.1)
    detector.rank_exited(RankExit(2, 0, -9, 4.0), wall=4.5)
    stall = CollectiveStalled(0, GENERATION, "timed out", 5.0, *HUNG_IN_STAGE_1[0])
    assert detector.rank_stalled(stall, wall=6.0, waits=WaitGraph(*_plan_and_program())) is None
    assert detector.workers()[0]["state"] == "alive"


def test_the_controller_takes_out_the_rank_a_stall_report_waited_for_not_the_reporter(tmp_path):
    """Through the inbox, as a worker reports: on the code before the blame rule, the
    reporter (rank 0, healthy) was failed and killed."""
    slow = Timeouts(heartbeat_interval=0.1, heartbeat_timeout=60.0, collective_timeout=90.0, recovery_timeout=120.0)
    controller = Controller(host="127.0.0.1", port=0, timeouts=slow, run_dir=tmp_path)
    controller.publish_plan(*_plan_and_program())
    controller.start()
    try:
        client = signed_client(controller.port, tmp_path)
        [beat] = _node_beat(1, HUNG_IN_STAGE_1).values()
        client.queue_push(INBOX, NodeRegistration(0, 10, "h", (0, 1, 2, 3)).to_json())
        for rank in range(4):
            client.queue_push(INBOX, RankRegistration(rank, 20 + rank, "h", 0).to_json())
        wait_for(lambda: sorted(controller.detector.alive_ranks()) == [0, 1, 2, 3] or None, timeout=10,
                 what="the ranks registered")
        client.set(node_heartbeat_key(0), beat.to_json())  # read once, at the next poll: after they registered
        wait_for(lambda: [row["generation"] for row in controller.detector.workers().values()] == [GENERATION] * 4,
                 timeout=10, what="the ranks' beats read")
        client.queue_push(INBOX, CollectiveStalled(0, GENERATION, "timed out", 5.0, *HUNG_IN_STAGE_1[0]).to_json())
        failure = controller.next_failure(timeout=10)
        assert (failure.cause, failure.ranks) == (Cause.STALL, (2,))
        assert KillOrder.from_json(client.queue_pop(kill_orders_key(0), block=False)) == KillOrder(2, 22)
    finally:
        controller.stop()
