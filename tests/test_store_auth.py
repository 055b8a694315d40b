"""Store values are authenticated (``runtime.protocol.auth``): a client that reaches a
store but lacks the run's secret writes what it likes, and the run acts on none of it: a
forged step decision, plan, stop order or failure report is refused, and the run goes on
with the real one. On the code before, each forgery below was acted on (a wait ended on
the forged decision, the worker took the forged plan or stop, the controller failed a
healthy rank). The secret is a 0600 file of the run directory, made once and reused on
``--resume``; a launcher with neither it nor ``ODYSSEY_RUN_SECRET`` stops at start."""

from __future__ import annotations

import datetime
import logging
import os
import stat
import threading
import time

import pytest
import torch.distributed as dist

from odyssey_megatron.config import OdysseyConfig
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.run_dir import private_directory
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.protocol.auth import (
    SECRET_ENV,
    SECRET_FILE,
    ForgedValue,
    SignedStore,
    Signer,
    controller_secret,
    launcher_secret,
)
from odyssey_megatron.runtime.protocol.keys import (
    INBOX,
    RUN_STOP,
    decided_key,
    node_heartbeat_key,
    plan_ops_key,
    successor_key,
)
from odyssey_megatron.runtime.protocol.launch import WorkerLaunch
from odyssey_megatron.runtime.protocol.messages import (
    NodeHeartbeat,
    NodeRegistration,
    RankFailureReport,
    RankRegistration,
    StopOrder,
)
from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished
from odyssey_megatron.runtime.rank.controller_link import ControllerLink
from odyssey_megatron.runtime.step_ledger import Outcome, StepLedger
from odyssey_megatron.timeouts import Timeouts

pytestmark = pytest.mark.timeout(60)
TIMEOUTS = OdysseyConfig().timeouts
WAIT = datetime.timedelta(seconds=10)
SECRET = bytes(range(32))


def _master() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=WAIT)


def _forger(port: int) -> dist.TCPStore:
    """A client that reaches the store and lacks the secret."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=WAIT)


def _in_thread(call) -> list:
    """Start ``call`` in a thread; the list gets its result (or what it raised)."""
    result: list = []

    def run():
        try:
            result.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result.append(exc)

    threading.Thread(target=run, daemon=True).start()
    return result


def _wait_for(result: list) -> object:
    deadline = time.monotonic() + WAIT.total_seconds()
    while not result and time.monotonic() < deadline:
        time.sleep(0.01)
    assert result, "no result within the wait"
    return result[0]


def test_a_forged_step_decision_ends_no_wait_and_the_ranks_take_the_controllers_freeze():
    master = _master()
    signed = SignedStore(master, Signer(SECRET))
    rank = StepLedger(signed.clone(), generation=3, training_ranks=2)
    assert rank.count_in(5) is None  # the other rank never counts in
    waiting = _in_thread(lambda: rank.wait_decided(5, timeout=WAIT))
    _forger(master.port).set(decided_key(3, 5), Outcome.COMMITTED.value)  # apply a step that never committed
    time.sleep(0.3)
    assert waiting == [] and rank.decided(5) is None, "the forged decision is no decision"
    assert StepLedger(signed.clone(), generation=3, training_ranks=2).freeze(5, 5) == []
    assert _wait_for(waiting) is Outcome.FROZEN and rank.decided(5) is Outcome.FROZEN


def _plan(generation: int) -> tuple[ExecutionPlan, object]:
    plan = ExecutionPlan(generation=generation, policy="initial", num_layers=2, tensor_parallel_size=1,
                         pipelines=(PipelinePlan((StagePlan(0, (0, 2)),), (0,)),))
    return plan, step_program(plan, uniform_profile(num_layers=2))


def _link(controller: Controller) -> ControllerLink:
    """Worker 0's link to ``controller``, not started: no registration, no heartbeat thread."""
    return ControllerLink(WorkerLaunch(rank=0, local_rank=0, node=0, world_size=1, store_host="127.0.0.1",
                                       store_port=controller.port, node_store_port=0, node_ranks=(0,),
                                       launcher_pid=os.getpid(), timeouts=TIMEOUTS, secret=controller.secret))


def test_a_forged_plan_is_not_taken_and_the_worker_takes_the_plan_the_controller_publishes(tmp_path):
    controller = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path)
    link = _link(controller)
    waiting = _in_thread(lambda: link.wait_plan(newer_than=-1))
    forger = _forger(controller.port)
    forged = PlanPublished(*_plan(0), time.time(), start_step=7)  # start past steps that never ran
    forger.set(plan_ops_key(0, 0), forged.op_lists()[plan_ops_key(0, 0)])
    forger.set(successor_key(-1), forged.frame())
    time.sleep(0.3)
    assert waiting == [], "the forged plan ends no wait"
    controller.publish_plan(*_plan(0), start_step=0)
    taken = _wait_for(waiting)
    assert isinstance(taken, PlanPublished) and taken.start_step == 0 and taken.plan == _plan(0)[0]


def test_a_forged_stop_order_is_not_carried_out_and_the_worker_takes_the_controllers(tmp_path):
    controller = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path)
    controller.publish_plan(*_plan(0))
    link = _link(controller)
    forger = _forger(controller.port)
    forger.set(RUN_STOP, StopOrder(99, "forged", {"embedding": 0}).to_json())
    forger.set(successor_key(0), RUN_STOP)  # "the run stops after generation 0"
    assert not link.store.check([RUN_STOP, successor_key(0)])
    waiting = _in_thread(lambda: link.next_after(0))
    time.sleep(0.3)
    assert waiting == [], "the forged stop ends no wait"
    controller.end_run(RUN_STOP, StopOrder(3, "SIGTERM on node 0", {"embedding": 0}).to_json())
    assert _wait_for(waiting) == RUN_STOP
    assert StopOrder.from_json(link.store.get(RUN_STOP)) == StopOrder(3, "SIGTERM on node 0", {"embedding": 0})


def test_a_forged_failure_report_fails_no_rank_and_a_real_one_does(tmp_path, caplog):
    slow = Timeouts(heartbeat_interval=0.1, heartbeat_timeout=60.0, collective_timeout=90.0, recovery_timeout=120.0)
    controller = Controller(host="127.0.0.1", port=0, timeouts=slow, run_dir=tmp_path)
    controller.start()
    try:
        client = SignedStore(_forger(controller.port), Signer(controller.secret))
        client.set(node_heartbeat_key(0), NodeHeartbeat(0, 1000.0, {"0": 0, "1": 0}, {}, {"0": 20, "1": 21}).to_json())
        for msg in (NodeRegistration(0, 10, "h", (0, 1)), RankRegistration(0, 20, "h", 0),
                    RankRegistration(1, 21, "h", 0)):
            client.queue_push(INBOX, msg.to_json())
        forger = _forger(controller.port)
        for _ in range(2):
            forger.queue_push(INBOX, RankFailureReport(1, None, "forged", 5.0).to_json())
        assert controller.next_failure(timeout=1.0) is None, "no rank failed on a forged report"
        client.queue_push(INBOX, RankFailureReport(1, None, "boom", 5.0).to_json())
        failure = controller.next_failure(timeout=10)
        assert (failure.ranks, failure.detail) == ((1,), "boom")
    finally:
        controller.stop()
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and INBOX in refusals[0].getMessage(), "logged once for the key, in one line"


def test_a_signed_value_copied_to_another_key_or_a_forged_line_among_appended_ones_is_refused():
    master = _master()
    signed = SignedStore(master, Signer(SECRET))
    signed.set(decided_key(3, 4), Outcome.COMMITTED.value)
    master.set(decided_key(3, 5), master.get(decided_key(3, 4)))  # a replay under step 5's key
    assert signed.check([decided_key(3, 4)]) and not signed.check([decided_key(3, 5)])
    assert signed.multi_get([decided_key(3, 4), decided_key(3, 5)]) == [Outcome.COMMITTED.value, None]
    signed.append("report", '{"rank": 0}\n')
    master.append("report", b'A' + b'0' * 64 + b'{"rank": 9}\n')
    signed.append("report", '{"rank": 1}\n{"rank": 2}\n')
    assert signed.get("report") == b'{"rank": 0}\n{"rank": 1}\n{"rank": 2}\n'
    master.queue_push("queue", b"forged")
    with pytest.raises(ForgedValue):
        signed.queue_pop("queue", block=False)
    assert signed.compare_set(decided_key(3, 5), "", Outcome.FROZEN.value) == Outcome.FROZEN.value, \
        "a forged value where none should be is replaced"
    assert signed.unsigned is master and Signer(bytes(32)).open(decided_key(3, 4), master.get(decided_key(3, 4))) \
        is None, "another run's secret refuses it too"


def test_the_secret_is_a_file_only_its_owner_reads_made_at_the_first_start_and_reused_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    private_directory(run_dir)
    first = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=run_dir).secret
    assert stat.S_IMODE(os.stat(run_dir / SECRET_FILE).st_mode) == 0o600 and len(first) == 32
    assert controller_secret(run_dir) == first, "a resume signs with the secret the run's launchers hold"
    private_directory(tmp_path / "other")
    assert controller_secret(tmp_path / "other") != first
    os.chmod(run_dir / SECRET_FILE, 0o640)
    with pytest.raises(ConfigError, match="readable by you alone.*chmod 600"):
        controller_secret(run_dir)


def test_a_launcher_reads_the_run_dirs_secret_or_the_environments_and_without_either_fails_at_start(tmp_path):
    private_directory(tmp_path / "run")
    secret = controller_secret(tmp_path / "run")
    assert launcher_secret(tmp_path / "run", {}, wait_s=0) == secret
    assert launcher_secret(tmp_path / "elsewhere", {SECRET_ENV: secret.hex()}, wait_s=0) == secret
    with pytest.raises(ConfigError) as refused:
        launcher_secret(tmp_path / "elsewhere", {}, wait_s=0.2)
    message = str(refused.value)
    assert "\n" not in message and SECRET_FILE in message and SECRET_ENV in message and "--run-dir" in message
    with pytest.raises(ConfigError, match=f"{SECRET_ENV}: must be 64 hex digits"):
        launcher_secret(tmp_path / "elsewhere", {SECRET_ENV: "not hex"}, wait_s=0)


def test_a_worker_launch_never_shows_the_secret():
    launch = WorkerLaunch(rank=0, local_rank=0, node=0, world_size=1, store_host="h", store_port=1,
                          node_store_port=2, node_ranks=(0,), launcher_pid=1, timeouts=TIMEOUTS, secret=SECRET)
    assert SECRET.hex() not in repr(launch) and repr(SECRET) not in repr(launch)


def test_refusals_are_logged_once_per_key(caplog):
    caplog.set_level(logging.WARNING)
    master = _master()
    signed = SignedStore(master, Signer(SECRET))
    for key in ("a", "a", "b"):
        master.set(key, b"forged")
        assert not signed.check([key])
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["store key a", "store key b"]
