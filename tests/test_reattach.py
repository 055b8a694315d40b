"""A restarted controller takes back the survivors of the lost one only where they can carry
the run on from memory: every block held by a whole reattached worker, one committed step
for all; anyone else is refused (told to exit), and a disagreement sends the run to disk."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import asymmetric_plan
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig, OdysseyConfig, load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.detector import Cause
from odyssey_megatron.runtime.control.reattach import judge_reattachments
from odyssey_megatron.runtime.control.reattaching import LostStart, continuation, lost_start
from odyssey_megatron.runtime.control.run_state import RunState
from odyssey_megatron.runtime.control.snapshot_following import SnapshotFollowing
from odyssey_megatron.schedules.program import publish
from odyssey_megatron.runtime.protocol.messages import ProtocolError, RankReattached

MODEL = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    vocab_size=128, seq_length=16, params_dtype="fp32")
# Two pipelines of two stages; pipeline d's stages on workers 2d and 2d+1, so node 1
# (ranks 2 and 3) holds a whole replica of the model and node 0 the other.
PLAN = replace(asymmetric_plan([(2, 2), (2, 2)], [2, 2], worker_of=lambda d, s: 2 * d + s), generation=3)
CLUSTER = ClusterState(world_size=4, tensor_parallel_size=1, devices_per_node=2)


def reattached(rank: int, *, step: int = 2, epoch: int = 0, generation: int = 3, pid: int | None = None):
    return RankReattached(rank=rank, pid=pid or 1000 + rank, epoch=epoch, generation=generation,
                          committed_step=step)


def idle(rank: int, *, generation: int = 3) -> RankReattached:
    """A survivor idle in the lost plan's generation: it holds no block."""
    return RankReattached(rank=rank, pid=1000 + rank, epoch=0, generation=generation, committed_step=None)


def judge(*reports, plan=PLAN, cluster=CLUSTER, epoch=0):
    return judge_reattachments(reports, plan=plan, epoch=epoch, cluster=cluster, model=MODEL)


def test_a_whole_replica_at_one_step_goes_on_from_memory():
    outcome = judge(reattached(2), reattached(3))
    assert outcome.from_memory and outcome.step == 2
    assert outcome.accepted == (2, 3) and outcome.refused == {}


def test_survivors_at_different_steps_send_the_run_to_disk_and_are_all_refused():
    outcome = judge(reattached(2, step=2), reattached(3, step=3))
    assert not outcome.from_memory and outcome.accepted == ()
    assert "different committed steps (2, 3)" in outcome.why
    assert set(outcome.refused) == {2, 3}


def test_a_stage_no_survivor_holds_sends_the_run_to_disk():
    outcome = judge(reattached(2))  # stage 1's only surviving replica, rank 3, did not come back
    assert not outcome.from_memory and "no whole reattached worker holds" in outcome.why
    assert set(outcome.refused) == {2}


def test_no_survivor_in_the_grace_resumes_from_disk():
    outcome = judge()
    assert not outcome.from_memory and outcome.why == "no survivor reattached" and outcome.refused == {}


@pytest.mark.parametrize("stray, why", [
    (reattached(1, epoch=1), "followed controller start 1, not the lost one (0)"),
    (reattached(1, generation=2), "ran generation 2, not the last plan's (3)"),
])
def test_a_stray_survivor_is_refused_while_the_others_go_on(stray, why):
    outcome = judge(reattached(2), reattached(3), stray)
    assert outcome.from_memory and outcome.accepted == (2, 3)
    assert outcome.refused == {1: why}


def test_a_rank_announced_by_two_processes_is_refused():
    outcome = judge(reattached(2), reattached(3), reattached(3, pid=77))
    assert not outcome.from_memory
    assert outcome.refused[3] == "announced by two processes (pids 77, 1003)"


ONE_PIPELINE = replace(asymmetric_plan([(2, 2)], [4], worker_of=lambda d, s: 2 + s), generation=3)
"""Pipeline 0 left the plan: ranks 0 and 1 idle in generation 3."""


def test_an_idle_survivor_is_taken_back_as_a_joiner_beside_the_others():
    outcome = judge(idle(0), reattached(2), reattached(3), plan=ONE_PIPELINE)
    assert outcome.from_memory and outcome.accepted == (2, 3) and outcome.joiners == (0,)
    assert outcome.refused == {}


def test_a_survivor_whose_blocks_do_not_match_its_part_in_the_plan_is_refused():
    outcome = judge(reattached(0), reattached(2), reattached(3), plan=ONE_PIPELINE)
    assert outcome.from_memory and outcome.refused == {0: "holds blocks, though not in generation 3's plan"}
    outcome = judge(idle(0), reattached(2), idle(3), plan=ONE_PIPELINE)
    assert not outcome.from_memory
    assert outcome.refused[3] == "holds no block of generation 3's plan, which it is in"


def test_idle_survivors_are_refused_with_the_others_where_the_run_resumes_from_disk():
    outcome = judge(idle(0), reattached(2), plan=ONE_PIPELINE)  # stage 1's only holder did not come back
    assert not outcome.from_memory and outcome.joiners == ()
    assert set(outcome.refused) == {0, 2} and outcome.refused[0].startswith("the run resumes from disk")


def test_a_tp_group_counts_only_whole():
    cluster = ClusterState(world_size=8, tensor_parallel_size=2, devices_per_node=4)
    plan = replace(PLAN, tensor_parallel_size=2)
    outcome = judge(reattached(4), reattached(5), reattached(6), cluster=cluster, plan=plan)
    assert not outcome.from_memory and "no whole reattached worker holds" in outcome.why
    outcome = judge(*(reattached(r) for r in (4, 5, 6, 7)), cluster=cluster, plan=plan)
    assert outcome.from_memory and outcome.accepted == (4, 5, 6, 7)


def test_the_announcement_is_type_checked():
    assert RankReattached.from_json(reattached(2).to_json()) == reattached(2)
    with pytest.raises(ProtocolError, match="committed_step"):
        RankReattached.from_json('{"kind": "rank_reattached", "rank": 2, "pid": 1, "epoch": 0, '
                                 '"generation": 3, "committed_step": "2"}')


def _write_events(run_dir: Path, events: list[dict]) -> None:
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _lost_run(run_dir: Path, *, ended: bool = False) -> None:
    """A run directory whose first controller start published generations 0 to 3 and was
    lost (unless ``ended``), and whose second start has just begun."""
    (run_dir / "plan-3.json").write_text(json.dumps(publish(PLAN, step_program(PLAN, uniform_profile(num_layers=4)))))
    _write_events(run_dir, [
        {"event": "controller_started", "time": 1.0, "epoch": 0},
        *({"event": "plan", "time": 2.0 + g, "generation": g} for g in range(4)),
        {"event": "step", "time": 9.0, "step": 2},
        *([{"event": "run_end", "time": 9.5, "status": 1}] if ended else []),
        {"event": "controller_started", "time": 20.0, "epoch": 1}])


def test_the_lost_start_is_the_last_before_this_one_with_its_last_plan_and_last_record(tmp_path):
    _lost_run(tmp_path)
    lost = lost_start(tmp_path, epoch=1)
    assert (lost.epoch, lost.plan, lost.last_record_at) == (0, PLAN, 9.0)
    assert lost_start(tmp_path, epoch=0) is None  # a first start follows nobody


def test_a_start_that_ended_or_left_no_plan_on_disk_was_not_lost(tmp_path):
    _lost_run(tmp_path, ended=True)
    assert lost_start(tmp_path, epoch=1) is None
    _lost_run(tmp_path)
    (tmp_path / "plan-3.json").unlink()  # lost before it wrote its last plan: its survivors ran one not on disk
    assert lost_start(tmp_path, epoch=1) is None


def _continued(accepted: tuple[int, ...]):
    center = DecisionCenter(plan=PLAN, cluster=CLUSTER, profile=uniform_profile(num_layers=4),
                            settings=OdysseyConfig().decisions, settles_at_once=False, model=MODEL)
    center.settle(replace(PLAN, generation=0))  # the restarted controller's own starting plan, replaced
    outcome = judge(*(reattached(r) for r in accepted))
    lost = LostStart(0, PLAN, 9.0)
    return center, continuation(lost, outcome, center, node=0, here=(0, 1))


def test_the_run_goes_on_from_the_lost_plan_and_node_0s_ranks_fail_with_its_process():
    center, continuing = _continued((2, 3))
    assert continuing.plan == PLAN and center.settled == PLAN
    lost = continuing.lost
    assert (lost.cause, lost.ranks, lost.node, lost.node_ranks, lost.failed_at) == (Cause.NODE, (0, 1), 0, (0, 1), 9.0)
    assert center.cluster.failed_ranks == frozenset()  # failed by the recovery's decision, not beforehand


def test_where_every_rank_of_the_lost_plan_came_back_nothing_fails():
    center, continuing = _continued((0, 1, 2, 3))
    assert continuing.lost is None and center.settled == PLAN


def test_an_idle_survivor_taken_back_is_failed_until_the_run_offers_it_back():
    """The decision center counts a joiner out (``continue_from``'s ``away``): being alive, it
    is then offered back at the next take-back (``GrowingBack``), as a returning worker is."""
    center = DecisionCenter(plan=PLAN, cluster=CLUSTER, profile=uniform_profile(num_layers=4),
                            settings=OdysseyConfig().decisions, settles_at_once=False, model=MODEL)
    outcome = judge(idle(0), idle(1), reattached(2), reattached(3), plan=ONE_PIPELINE)
    continuing = continuation(LostStart(0, ONE_PIPELINE, 9.0), outcome, center, node=0, here=())
    assert continuing.lost is None and center.settled == ONE_PIPELINE
    assert center.cluster.failed_workers == frozenset({0, 1})


@pytest.mark.parametrize("saved", [True, False])
def test_a_stage_lost_before_the_first_snapshot_after_a_reattach_rolls_back_to_the_survivors_save(tmp_path, saved):
    """Survivors taken back at step 3 train on to step 5, and a stage is lost before any
    snapshot: where their save of step 3 is a complete checkpoint (``Continuation.saved``),
    the run rolls back to it, and the next plan has every rank load it (fresh); where it is
    not, nothing can rebuild step 3 and the failure has no start to roll back to."""
    config = load_config(Path(__file__).resolve().parents[1] / "recipes/llama2_7b/tiny_cpu.yaml",
                         ["cluster.devices_per_node=2"])
    center = DecisionCenter.from_recipe(config)
    controller = Controller(host="127.0.0.1", port=0, timeouts=config.odyssey.timeouts, run_dir=tmp_path)
    run = RunState(config=config, controller=controller, center=center, run_dir=tmp_path, start_step=3,
                   in_memory=True, start_rebuildable=saved)
    following = SnapshotFollowing(run)
    assert not run.fresh  # the survivors' memory holds step 3
    run.plan, run.committed = center.plan, 5
    assert following.start_replay_steps(5) == (2 if saved else None)
    if saved:
        following.roll_back_to_start()
        assert run.committed == 3 and run.fresh
