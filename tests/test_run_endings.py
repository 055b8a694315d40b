"""How the run's owner ends a run it cannot go on with, in one process: the real
``Controller``, ``DecisionCenter`` and ``TrainingRun`` of the tiny recipe, with the test
playing the eight ranks through the store as the protocol has them (registrations in the
inbox, one node heartbeat, step reports and counts, the stop order's parts). A failed
owner still leaves the last committed step on disk, written once per block; ranks that
beat but never enter a generation are failed as late, and the run decides again without
them instead of failing."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from control_cases import signed_client
from odyssey_megatron.blocks import StageSpec
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.hooks.training_state import TrainingState
from odyssey_megatron.run_dir import private_directory
from odyssey_megatron.runtime.checkpoint import load_checkpoint, save_part
from odyssey_megatron.runtime.checkpoint_index import latest_checkpoint
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.detector import Cause
from odyssey_megatron.runtime.control.training_run import TrainingRun
from odyssey_megatron.runtime.protocol.auth import SignedStore
from odyssey_megatron.runtime.protocol.keys import (
    INBOX,
    RUN_STOP,
    applied_key,
    node_heartbeat_key,
    ready_key,
    step_report_key,
    stopped_key,
)
from odyssey_megatron.runtime.protocol.messages import (
    NodeHeartbeat,
    NodeRegistration,
    RankRegistration,
    StepReport,
    StopOrder,
)
from odyssey_megatron.runtime.train import _own_run

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "llama2_7b" / "tiny_cpu.yaml"
RANKS = 8
WAIT_S = 30

pytestmark = pytest.mark.timeout(120)


def _owner(run_dir: Path, *overrides: str, run_class=TrainingRun):
    """The tiny recipe's controller and run, its eight ranks registered on node 0 (in the
    controller's own process, so never found silent), and a client store for the test."""
    private_directory(run_dir)
    config = load_config(RECIPE, ["odyssey.online_profile=false", "odyssey.snapshot_interval=0", *overrides])
    controller = Controller(host="127.0.0.1", port=0, timeouts=config.odyssey.timeouts, run_dir=run_dir)
    controller.start()
    client = signed_client(controller.port, run_dir, timeout_s=WAIT_S)
    host, pid = socket.gethostname(), os.getpid()
    client.queue_push(INBOX, NodeRegistration(0, pid, host, tuple(range(RANKS))).to_json())
    for rank in range(RANKS):
        client.queue_push(INBOX, RankRegistration(rank, 100 + rank, host, 0).to_json())
    center = DecisionCenter.from_recipe(config, settles_at_once=False)
    run = run_class(config=config, controller=controller, center=center, run_dir=run_dir)
    _wait(lambda: len(controller.detector.alive_ranks()) == RANKS, "the ranks registered")
    return config, controller, client, run


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {WAIT_S} s: {what}")
        time.sleep(0.02)


def _commit(client: SignedStore, config, *, generation: int, step: int) -> None:
    """Every rank counted into ``step`` with its micro-batches reported (one report for all)."""
    train = config.training
    micro_batches = tuple(range(train.num_micro_batches))
    samples = tuple(range(step * train.global_batch_size, (step + 1) * train.global_batch_size))
    report = StepReport(0, micro_batches, tuple(1.0 for _ in micro_batches), samples, 0.0, 0, 0.0, 0, 0.0, 0, 0.0, 1e-3)
    client.append(step_report_key(generation, step), report.to_json() + "\n")
    client.add(applied_key(generation, step), RANKS)


class _OwnerWithABug(TrainingRun):
    """The owner, failing with an error of its own once step 1 is recorded (a bug)."""

    def _after_commit(self, generation, step, reports):
        super()._after_commit(generation, step, reports)
        if step == 1:
            raise KeyError("a bug in the owner")


def test_a_failed_owner_has_the_last_committed_step_saved_once_per_block_and_names_the_resume(tmp_path):
    """Steps 0 and 1 commit, then the owner fails on a bug: it ends the generation, orders
    the save of step 2 as a stop does, each block written by one of the two replicas that
    hold it (every worker writes some), marks the parts the checkpoint once they are in,
    and ends with status 1 naming the checkpoint and the command that resumes from it. The
    checkpoint loads every stage back. (Before: status 1, nothing saved, no resume.)"""
    run_dir = tmp_path / "run"
    config, controller, client, run = _owner(run_dir, run_class=_OwnerWithABug)
    outcome = []
    owner = threading.Thread(target=_own_run, args=(run, outcome), daemon=True)
    owner.start()
    try:
        _wait(lambda: controller.published_generation == 0, "generation 0 published")
        for step in (0, 1):
            _commit(client, config, generation=0, step=step)
        _wait(lambda: client.check([RUN_STOP]) or not owner.is_alive(), "a stop order")
        assert client.check([RUN_STOP]), outcome
        order = StopOrder.from_json(client.get(RUN_STOP))
        assert order.step == 2 and "the run failed: KeyError" in order.reason
        assert sorted(set(order.writers.values())) == list(range(RANKS))  # both replicas of each stage write
        model = config.model
        for worker in range(RANKS):
            stage = StageSpec.of_worker(run.center.settled, worker)
            state = TrainingState.initial(model, stage, seed=config.training.seed, tp_rank=0, tp_size=1)
            for block in state.blocks.values():
                block.step = order.step
            mine = [b for b in state.held() if order.writers[str(b)] == worker]
            save_part(run_dir, state, mine, step=order.step, rank=worker, tp_rank=0, tp_size=1, model=model)
            client.set(stopped_key(worker), "1")
        owner.join(timeout=WAIT_S)
    finally:
        controller.stop()
    (result,) = outcome
    assert result.status == 1
    assert result.message.startswith("KeyError: 'a bug in the owner'; after 2 committed steps, saved as "
                                     "checkpoint/step-2; resume from the checkpoint of step 2 with: odyssey train "
                                     f"--resume {run_dir}"), result.message
    assert result.resume == f"odyssey train --resume {run_dir}"
    step, directory = latest_checkpoint(run_dir)
    assert step == 2
    for worker in (0, 2, 4, 6):  # one replica of each stage reads its stage back
        stage = StageSpec.of_worker(run.center.settled, worker)
        loaded = load_checkpoint(directory, run_dir=run_dir, model=config.model, stage=stage, tp_rank=0, tp_size=1,
                                 device=torch.device("cpu"))
        assert {b.step for b in loaded.blocks.values()} == {2}


def test_ranks_that_beat_but_never_enter_a_generation_are_failed_as_late_and_decided_without(tmp_path):
    """Generation 0 published; seven ranks enter it (counted in, beating with it), rank 5
    beats without ever entering. At the recovery timeout rank 5 is failed as late (killed
    by its launcher, like a hung rank), and the recovery decides without it: generation
    1 leaves worker 5 out. (Before: RunFailed, the run ended.)"""
    run_dir = tmp_path / "run"
    config, controller, client, run = _owner(run_dir, "odyssey.heartbeat_timeout=0.5",
                                             "odyssey.collective_timeout=1.0", "odyssey.recovery_timeout=2.0")
    try:
        run.publish(run.center.plan, run.center.estimate.step_time_s, snapshot=None, snapshot_interval=0)
        entered = [r for r in range(RANKS) if r != 5]
        client.set(node_heartbeat_key(0), NodeHeartbeat(1, time.time(), {str(r): 1 for r in range(RANKS)},
                                                        {str(r): 0 for r in entered},
                                                        {str(r): 100 + r for r in range(RANKS)}).to_json())
        client.add(ready_key(0), len(entered))
        started = time.monotonic()
        late = run.wait_ready(check_stop=lambda: None)
        assert time.monotonic() - started >= 2.0
        assert (late.cause, late.ranks) == (Cause.LATE, (5,)), late
        assert "not in generation 0 within the recovery timeout (2.0 s)" in late.detail
        assert 5 not in controller.detector.live_ranks()
        recovering = threading.Thread(target=run.recovery.recover, args=(late,), daemon=True)
        recovering.start()
        _wait(lambda: controller.published_generation == 1, "generation 1 published")
        assert 5 not in run.plan.workers and 5 in run.center.cluster.failed_ranks
        client.add(ready_key(1), len(run.plan.participants))
        recovering.join(timeout=WAIT_S)
        assert not recovering.is_alive()
    finally:
        run.stop_preparing()
        controller.stop()
