"""The control side of the live runtime (issue 16): launcher, controller, fault detector and
the protocol they share with workers.

With real processes (a controller, launchers, workers that register, heartbeat and adopt
the published plan) the invariants are: a failure is reported once, with the right ranks
and the way it was seen, and within its bound (an exit at once, a hang or a lost node
within the heartbeat timeout plus polling slack); survivors are never touched; and nothing
outlives a lost controller or launcher. The detector's rules are also checked alone with
made-up times. Latencies use the recipe's default timeouts (100 ms beats, 1 s timeout).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import replace

import pytest
import torch.distributed as dist

from control_cases import ABORT_REQUEST, LocalCluster, alive, process_state, signed_client, wait_for
from helpers import symmetric_plan
from odyssey_megatron.config import OdysseyConfig
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.estimator.program import step_program
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan, Transfer
from odyssey_megatron.planner import reroute_plan
from odyssey_megatron.profile import uniform_profile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.run_dir import read_jsonl
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.detector import Cause, Detector
from odyssey_megatron.runtime.control.launch_config import LaunchConfig, first_host
from odyssey_megatron.runtime.control.launcher import NodeLauncher
from odyssey_megatron.runtime.protocol.auth import SignedStore, Signer
from odyssey_megatron.runtime.protocol.keys import (
    INBOX,
    NODE_VIEW,
    RUN_DONE,
    RUN_SPEC,
    RUN_STOP,
    kill_orders_key,
    launcher_key,
    node_heartbeat_key,
    plan_key,
    plan_ops_key,
    rank_heartbeat_key,
    reattach_verdict_key,
    successor_key,
)
from odyssey_megatron.runtime.protocol.launch import EXIT_CONTROLLER_LOST, EXIT_REPLACED, WorkerLaunch
from odyssey_megatron.runtime.protocol.messages import (
    CollectiveStalled,
    Heartbeat,
    KillOrder,
    NodeHeartbeat,
    NodeLeft,
    NodeRegistration,
    NodeView,
    parse_inbox,
    ProtocolError,
    RankExit,
    RankFailureReport,
    RankReattached,
    RankRegistration,
    ReattachVerdict,
    StaleGenerationError,
    StopOrder,
)
from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished, read_plan, write_plan
from odyssey_megatron.runtime.rank.controller_link import ControllerLink
from odyssey_megatron.schedules.ops import WEIGHT_GRAD, Op
from odyssey_megatron.schedules.program import StepProgram, read_published
from odyssey_megatron.settings import PLAIN
from odyssey_megatron.timeouts import Timeouts

TIMEOUTS = OdysseyConfig().timeouts
SECRET = bytes(range(32))
"""The run's secret where a test makes no controller (``protocol.auth``)."""
SLACK_S = 1.0
"""Polling (half a beat each at the controller and the launcher) plus scheduling on a
loaded 2-core machine."""
_SILENCE_NOTICED = TIMEOUTS.heartbeat_timeout - TIMEOUTS.heartbeat_interval
"""The earliest a silence can be noticed after a failure: the timeout runs from the last
beat seen, which may precede the failure by up to one interval."""


def _plan(generation: int) -> ExecutionPlan:
    return ExecutionPlan(generation=generation, policy="initial", num_layers=2, tensor_parallel_size=1,
                         pipelines=(PipelinePlan((StagePlan(0, (0, 2)),), (0,)),))


def _published(generation: int) -> tuple[ExecutionPlan, StepProgram]:
    plan = _plan(generation)
    return plan, step_program(plan, uniform_profile(num_layers=2))


# -- processes ---------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_killed_worker_is_reported_as_exited_at_once_and_the_others_are_untouched(tmp_path):
    with LocalCluster(tmp_path, nodes=1, per_node=4, timeouts=TIMEOUTS) as cluster:
        before = cluster.workers()
        killed_at = time.time()
        os.kill(before[2]["pid"], signal.SIGKILL)
        failure = cluster.wait_event("failure", timeout=10)
        latency = failure["detected_at"] - killed_at
        print(f"SIGKILL -> detected: {latency * 1000:.0f} ms")
        assert (failure["cause"], failure["ranks"], failure["detail"]) == ("exit", [2], "killed by SIGKILL")
        assert latency < TIMEOUTS.heartbeat_timeout  # the launcher saw the exit; no heartbeat had to be missed
        time.sleep(2 * TIMEOUTS.heartbeat_timeout)  # long enough for any wrong verdict on the survivors
        assert len(cluster.events("failure")) == 1
        after = cluster.workers()
        assert after[2]["state"] == "exited"
        for rank in (0, 1, 3):
            assert after[rank] == before[rank] and alive(before[rank]["pid"])


@pytest.mark.timeout(300)
def test_a_worker_reporting_an_error_and_a_stopped_one_are_failed_and_killed_by_their_launcher(tmp_path):
    with LocalCluster(tmp_path, nodes=1, per_node=3, timeouts=TIMEOUTS, reporting_rank=2) as cluster:
        error = cluster.wait_event("failure", timeout=10)
        assert (error["cause"], error["ranks"], error["detail"]) == ("error", [2], "RuntimeError: injected")
        assert cluster.wait_event("rank_exit", timeout=5, rank=2)["detail"] == "killed by SIGKILL"

        pid = cluster.workers()[1]["pid"]
        stopped_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        hang = cluster.wait_event("failure", timeout=10, cause="heartbeat")
        latency = hang["detected_at"] - stopped_at
        print(f"SIGSTOP -> detected: {latency * 1000:.0f} ms")
        assert hang["ranks"] == [1]
        assert _SILENCE_NOTICED <= latency < TIMEOUTS.heartbeat_timeout + SLACK_S
        killed = cluster.wait_event("rank_exit", timeout=5, rank=1)
        assert killed["detail"] == "killed by SIGKILL" and process_state(pid) is None  # killed and reaped
        assert len(cluster.events("failure")) == 2 and alive(cluster.workers()[0]["pid"])
        # The controller's store held one heartbeat for the node, none per rank: the
        # launcher forwarded rank 1's stale entry, and rank 0's, which went on changing.
        store = signed_client(cluster.port, cluster.run_dir)
        assert not any(store.check([rank_heartbeat_key(r)]) for r in range(3))
        beat = NodeHeartbeat.from_json(store.get(node_heartbeat_key(0)))
        assert {"0", "1"} <= set(beat.seqs)


@pytest.mark.timeout(300)
def test_an_abort_reaches_every_worker_through_its_launcher_within_two_beats(tmp_path):
    """Workers never read the controller's store to learn of an abort: the controller's
    heartbeat names it and it rings every launcher, which reads that at its next beat and
    relays it."""
    aborts = tmp_path / "aborts"
    aborts.mkdir()
    with LocalCluster(tmp_path, nodes=2, per_node=2, timeouts=TIMEOUTS, aborts=aborts) as cluster:
        asked = time.time()
        (tmp_path / ABORT_REQUEST).touch()
        heard = wait_for(lambda: [float(p.read_text()) for p in aborts.glob("[0-9]")] if len(list(aborts.glob("[0-9]")))
                         == 4 else None, timeout=10, what="every worker heard of the abort")
        latency = max(heard) - asked
        print(f"abort -> every worker's guard: {latency * 1000:.0f} ms")
        assert latency < 2 * TIMEOUTS.heartbeat_interval + SLACK_S
        assert all(w["state"] == "alive" for w in cluster.workers().values())


@pytest.mark.timeout(300)
def test_a_killed_launcher_is_one_node_failure_and_a_lost_controller_takes_everything_down(tmp_path):
    with LocalCluster(tmp_path, nodes=2, per_node=2, timeouts=TIMEOUTS) as cluster:
        workers = cluster.workers()
        killed_at = time.time()
        cluster.launchers[1].kill()
        wait_for(lambda: not alive(workers[2]["pid"]) and not alive(workers[3]["pid"]), timeout=SLACK_S,
                 what="node 1's workers die with their launcher")
        failure = cluster.wait_event("failure", timeout=10)
        latency = failure["detected_at"] - killed_at
        print(f"launcher SIGKILL -> node failure detected: {latency * 1000:.0f} ms")
        assert (failure["cause"], failure["node"], failure["ranks"]) == ("node", 1, [2, 3])
        assert _SILENCE_NOTICED <= latency < TIMEOUTS.heartbeat_timeout + SLACK_S
        time.sleep(TIMEOUTS.heartbeat_timeout)
        assert len(cluster.events("failure")) == 1
        assert alive(workers[0]["pid"]) and alive(workers[1]["pid"]) and cluster.launchers[0].is_alive()

        killed_at = time.monotonic()
        cluster.controller.kill()
        wait_for(lambda: not alive(workers[0]["pid"]) and not alive(workers[1]["pid"]),
                 timeout=TIMEOUTS.heartbeat_timeout, what="node 0's workers gone")
        workers_gone = time.monotonic() - killed_at
        # The launcher stops its workers as fast, then exits: Python takes about a second to
        # unload torch here.
        wait_for(lambda: not cluster.launchers[0].is_alive(), timeout=5, what="node 0's launcher gone")
        print(f"controller SIGKILL -> workers gone: {workers_gone * 1000:.0f} ms, "
              f"launcher gone: {(time.monotonic() - killed_at) * 1000:.0f} ms")
        assert cluster.launchers[0].exitcode == EXIT_CONTROLLER_LOST


@pytest.mark.timeout(300)
def test_a_controller_restarted_within_the_window_is_reattached_to_and_a_worker_that_gave_up_joins_again(tmp_path):
    """``Timeouts.controller_reattach_s``: the controller is SIGKILLed; its launchers and
    workers outlive it, and a controller started again on the same port and run directory
    (the same secret) has every node registered again and every worker announce itself
    (``RankReattached``) from the same process, which then beats to it and waits for its
    verdict (``ReattachVerdict``): taken back, it lives on; refused, it exits 0 (no failure),
    and a launcher whose workers were all refused exits 75 (its command is to start again).
    Ranks 1 and 3 give up on the lost controller at once (exit 75, as a worker whose blocks
    are at different steps): node 0's launcher starts rank 1 again as a joiner once rank 0
    is taken back; node 1's, whose rank 2 is refused, starts nothing."""
    timeouts = replace(TIMEOUTS, controller_reattach_s=60.0)
    with LocalCluster(tmp_path, nodes=2, per_node=2, timeouts=timeouts, reattaching=True,
                      giving_up=(1, 3)) as cluster:
        before = {rank: row["pid"] for rank, row in cluster.workers().items()}
        cluster.controller.kill()
        cluster.controller.join()
        time.sleep(timeouts.heartbeat_timeout)  # the launchers find it gone; the workers keep their memory
        wait_for(lambda: not alive(before[1]) and not alive(before[3]), timeout=10, what="ranks 1 and 3 gave up")
        assert alive(before[0]) and alive(before[2]) and all(p.is_alive() for p in cluster.launchers)
        restarted_at = time.time()
        cluster.restart_controller()
        wait_for(lambda: len([e for e in cluster.events("rank_reattached") if e["time"] > restarted_at]) == 2,
                 timeout=30, what="every worker left reattached")
        reattached = [e for e in cluster.events("rank_reattached") if e["time"] > restarted_at]
        assert {e["rank"]: e["pid"] for e in reattached} == {0: before[0], 2: before[2]}
        assert {(e["generation"], e["epoch"], e["committed_step"]) for e in reattached} == {(0, 0, 0)}
        nodes = {e["node"] for e in cluster.events("node_joined") if e["time"] > restarted_at}
        assert nodes == {0, 1}
        time.sleep(2 * timeouts.heartbeat_timeout)  # no verdict yet: nobody is started again
        assert not [e for e in cluster.events("rank_joined") if e["time"] > restarted_at and e["rank"] in (1, 3)]
        client = signed_client(cluster.port, cluster.run_dir)
        for rank in (0, 2):  # node 0's taken back, node 1's refused
            client.set(reattach_verdict_key(rank), ReattachVerdict(rank, 1, rank < 2, "" if rank < 2 else
                                                                   "refused by the test").to_json())
        cluster.launchers[1].join(timeout=10)
        assert cluster.launchers[1].exitcode == EXIT_CONTROLLER_LOST  # its command is to be started again
        again = wait_for(lambda: [e["pid"] for e in cluster.events("rank_joined")
                                  if e["time"] > restarted_at and e["rank"] == 1], timeout=30,
                         what="rank 1 started again")
        assert again[0] != before[1] and alive(again[0])
        assert not [e for e in cluster.events("rank_joined") if e["time"] > restarted_at and e["rank"] == 3]
        time.sleep(2 * timeouts.heartbeat_timeout)  # beating to the restarted controller: no one failed
        assert not [e for e in cluster.events("failure") if e["time"] > restarted_at]
        assert alive(before[0]) and cluster.launchers[0].is_alive()


@pytest.mark.timeout(300)
def test_a_dead_worker_is_restarted_as_a_joiner_and_a_kill_order_for_its_old_process_spares_the_new_one(tmp_path):
    """``odyssey.restart_workers``: rank 1 is killed and its launcher starts it again, as a
    joiner; a kill order that comes late for the old process spares the new one. Killed
    again, with no restart left, it stays dead."""
    with LocalCluster(tmp_path, nodes=1, per_node=2, timeouts=TIMEOUTS, restart_workers=1) as cluster:
        first = cluster.workers()[1]["pid"]
        os.kill(first, signal.SIGKILL)
        assert cluster.wait_event("failure", timeout=10)["ranks"] == [1]
        second = wait_for(lambda: cluster.workers()[1]["state"] == "alive" and cluster.workers()[1]["pid"] != first
                          and cluster.workers()[1]["pid"], timeout=30, what="rank 1 restarted and registered")
        registered = [e for e in cluster.events("rank_joined") if e["rank"] == 1]
        assert [e["pid"] for e in registered] == [first, second]
        client = signed_client(cluster.port, cluster.run_dir)
        client.queue_push(kill_orders_key(0), KillOrder(1, first).to_json())  # late, for the old process
        time.sleep(3 * TIMEOUTS.poll_interval)
        assert alive(second)
        os.kill(second, signal.SIGKILL)
        wait_for(lambda: len(cluster.events("failure")) == 2, timeout=10, what="the second failure")
        time.sleep(1)
        assert cluster.workers()[1]["state"] == "exited" and alive(cluster.workers()[0]["pid"])


@pytest.mark.timeout(300)
def test_a_replacement_launcher_fails_a_frozen_node_and_fences_it_when_it_thaws(tmp_path):
    """Node 1 freezes whole (its launcher and workers stopped: no socket closes) and a new
    launcher for node 1 starts elsewhere before the old one is found silent: the old node's
    ranks fail as one node failure at once, the new workers register as joiners. When the
    frozen node thaws, its launcher finds itself replaced, kills its workers and exits, so
    no rank runs twice."""
    with LocalCluster(tmp_path, nodes=2, per_node=2, timeouts=TIMEOUTS) as cluster:
        old_launcher, old_workers = cluster.launchers[1], [cluster.workers()[r]["pid"] for r in (2, 3)]
        frozen = [old_launcher.pid, *old_workers]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            cluster.start_launcher(1)
            failure = cluster.wait_event("failure", timeout=10)
            assert (failure["cause"], failure["node"], failure["ranks"]) == ("node", 1, [2, 3])

            def registered() -> list[int] | None:
                pids = [w["pid"] for r, w in cluster.workers().items()
                        if r in (2, 3) and w["state"] == "alive" and w["pid"] not in old_workers]
                return pids if len(pids) == 2 else None

            new_workers = wait_for(registered, timeout=60, what="both of the replacement's workers registered")
        finally:  # the cluster kills the workers workers.json names: the frozen ones are no longer there
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        old_launcher.join(timeout=10)
        assert old_launcher.exitcode == EXIT_REPLACED
        wait_for(lambda: not any(alive(pid) for pid in old_workers), timeout=5, what="the old workers killed")
        assert all(alive(pid) for pid in new_workers)
        assert len(cluster.events("failure")) == 1


@pytest.mark.timeout(300)
def test_a_node_failed_as_silent_whose_launcher_lives_registers_again_and_is_watched_again(tmp_path):
    """Node 1 stalls whole for twice the heartbeat timeout (its launcher and workers
    stopped, then continued: a node under swap, or one the controller could not read):
    the controller fails it and fences its launcher. The launcher, alive, kills its
    workers (they ran in the generation the run left), registers the node again and starts
    them afresh: they are alive, on a node watched again, so a later loss of it is found."""
    with LocalCluster(tmp_path, nodes=2, per_node=1, timeouts=TIMEOUTS) as cluster:
        launcher, old_workers = cluster.launchers[1], [cluster.workers()[r]["pid"] for r in (1,)]
        for pid in (launcher.pid, *old_workers):
            os.kill(pid, signal.SIGSTOP)
        try:
            failure = cluster.wait_event("failure", timeout=10)
            assert (failure["cause"], failure["node"], failure["ranks"]) == ("node", 1, [1])
        finally:
            for pid in (launcher.pid, *old_workers):
                os.kill(pid, signal.SIGCONT)

        def registered_again() -> list[int] | None:
            rows = cluster.workers()
            pids = [rows[r]["pid"] for r in (1,) if rows[r]["state"] == "alive" and rows[r]["pid"] not in old_workers]
            return pids if len(pids) == 1 else None

        new_workers = wait_for(registered_again, timeout=60, what="node 1's worker started again and registered")
        assert [n["node"] for n in cluster.events("node_joined")].count(1) == 2
        assert launcher.is_alive() and not any(alive(pid) for pid in old_workers)
        assert len(cluster.events("failure")) == 1 and alive(cluster.workers()[0]["pid"])
        launcher.kill()
        lost = cluster.wait_event("failure", timeout=10, node=1, ranks=[1])
        assert lost["cause"] == "node"
        wait_for(lambda: not any(alive(pid) for pid in new_workers), timeout=SLACK_S, what="the new workers gone")


# -- the store and plans, in this process -----------------------------------------------


class Recording:
    """A store that passes the plan's calls through and keeps what was read and written."""

    def __init__(self, store):
        self.store = store
        self.read: list[tuple[str, int]] = []
        """(key, bytes) of each get."""
        self.written: list[tuple[list[str], int]] = []
        """(keys, bytes of keys and values) of each set or multi_set."""

    def wait(self, keys):
        self.store.wait(keys)

    def get(self, key):
        value = self.store.get(key)
        self.read.append((key, len(value)))
        return value

    def set(self, key, value):
        self.multi_set([key], [value])

    def multi_set(self, keys, values):
        self.written.append((list(keys), sum(map(len, keys)) + sum(map(len, values))))
        self.store.multi_set(keys, values)


def _master_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def _rerouted_tp2() -> tuple[ExecutionPlan, StepProgram]:
    """DP3 x PP2 at TP2, worker 4 failed (workers 3 and 5 run its micro-batches), with
    transfers from a peer and from the checkpoint; only worker 0 splits its backwards."""
    profile = uniform_profile(num_layers=4)
    plan = with_sync(reroute_plan(symmetric_plan(dp=3, pp=2, num_layers=4, micro_batches_per_pipeline=2),
                                  failed_workers={4}, profile=profile), profile)
    plan = replace(plan, tensor_parallel_size=2,
                   transfers=(Transfer(2, 6, 0, 100), Transfer("embedding", None, 1, 50), Transfer("output", 7, 10, 9)))
    program = step_program(plan, profile, pricing=PLAIN)
    backwards = tuple(op._replace(kind=WEIGHT_GRAD) for op in program.ops[0] if op.kind == "B")
    return plan, replace(program, ops={**program.ops, 0: program.ops[0] + backwards}, split_backward=True)


def test_a_plan_is_published_in_slices_and_each_rank_reads_the_frame_and_its_own_op_list_only():
    plan, program = _rerouted_tp2()
    published = PlanPublished(plan, program, 1.5, start_step=3, snapshot_interval=2, snapshot=(2, 0), joined=(5,))
    master = _master_store()
    writes = Recording(master)
    write_plan(writes, published, batch_bytes=100)
    batches = [size for _, size in writes.written[:-1]]
    assert len(batches) > 1 and max(batches) <= 100, "op lists in batches within the limit"
    assert writes.written[-1][0] == [plan_key(plan.generation)], "the frame last: once it is there, so are they"
    assert sorted(k for keys, _ in writes.written[:-1] for k in keys) == sorted(
        plan_ops_key(plan.generation, w) for w in plan.workers)
    for rank in range(12):  # 6 workers of 2 TP ranks; worker 4 is failed
        worker, reader = rank // 2, Recording(master)
        got = read_plan(reader, reader.get(plan_key(plan.generation)), rank=rank,
                        current_generation=plan.generation - 1)
        assert got.plan == plan and replace(got, program=program) == published
        assert (got.program.generation, got.program.staggered_optimizer) == (program.generation,
                                                                            program.staggered_optimizer)
        assert got.program.split_backward, "from the frame, whether or not this worker's list splits"
        frame = (plan_key(plan.generation), len(published.frame()))
        if worker == 4:
            assert got.program.ops == {} and reader.read == [frame]
        else:
            own = plan_ops_key(plan.generation, worker)
            assert got.program.ops == {worker: program.ops[worker]}
            assert reader.read == [frame, (own, len(master.get(own)))]
    with pytest.raises(ValueError, match="over the store batch of 30"):
        write_plan(_master_store(), published, batch_bytes=30)


def test_a_worker_refuses_an_op_list_its_plan_does_not_give_it():
    plan, program = _rerouted_tp2()
    published = PlanPublished(plan, program, 1.5)
    store = _master_store()
    write_plan(store, published)
    wrong = json.dumps([list(op) for op in program.ops[1] + (Op("F", 0, 0, 0),)]).encode()
    store.set(plan_ops_key(plan.generation, 1), zlib.compress(wrong))
    with pytest.raises(ProtocolError, match=r"gives Op\(kind='F', pipeline=0, stage=0, micro_batch=0\) to worker 1; "
                                            "the plan gives it to 0"):
        read_plan(store, store.get(plan_key(plan.generation)), rank=3, current_generation=plan.generation - 1)
    store.set(plan_ops_key(plan.generation, 1), zlib.compress(b'[["X", 0, 0, 0]]'))
    with pytest.raises(ProtocolError, match=r"op \['X', 0, 0, 0\] of worker 1 is not"):
        read_plan(store, store.get(plan_key(plan.generation)), rank=2, current_generation=plan.generation - 1)


def test_a_starting_worker_whose_node_store_answers_late_tries_again_within_its_initial_heartbeat_timeout(
        monkeypatch):
    """A node's first connections come while all its workers import torch and Megatron: a
    worker whose first connection or beat timed out died before it had a log (exit status
    1 in a failure-free CI run). Through the connection seam: two timeouts, then a beat;
    and past ``initial_heartbeat_timeout`` the timeout is raised."""
    master = _master_store()
    node_store = dist.HashStore()
    timeouts = replace(TIMEOUTS, initial_heartbeat_timeout=2.0)
    launch = WorkerLaunch(rank=3, local_rank=3, node=0, world_size=4, store_host="127.0.0.1", store_port=master.port,
                          node_store_port=0, node_ranks=(0, 1, 2, 3), launcher_pid=os.getpid(), timeouts=timeouts,
                          secret=SECRET)
    link = ControllerLink(launch)
    tries = []

    def connect(late: int) -> dist.Store:
        tries.append(len(tries))
        if len(tries) <= late:
            raise dist.DistStoreError("timed out connecting")
        return node_store

    monkeypatch.setattr(link, "_fresh_beats", lambda: connect(late=2))
    link._first_beat()
    assert len(tries) == 3 and node_store.check([rank_heartbeat_key(3)])
    tries.clear()
    monkeypatch.setattr(link, "_fresh_beats", lambda: connect(late=10**6))
    began = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        link._first_beat()
    assert 2.0 <= time.monotonic() - began < 4.0


def test_a_worker_whose_launcher_is_gone_reports_no_error_of_its_own_and_leaves_the_cause_to_the_node():
    """A node fault kills the launcher, then the rest of the node within a beat: a worker
    that raises in between (its peer on the node died, the node's store went) must not
    report, or the node's one failure gets a second cause (CI recorded "error,node"). The
    launcher a zombie its parent has not reaped counts as gone; a live one gets the report."""
    master = _master_store()
    inbox = SignedStore(master, Signer(SECRET))
    launcher = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: process_state(launcher.pid) == "Z", timeout=10, what="an unreaped exited launcher")
    try:
        for launcher_pid, reported in ((launcher.pid, 0), (os.getpid(), 1)):
            launch = WorkerLaunch(rank=5, local_rank=1, node=1, world_size=8, store_host="127.0.0.1",
                                  store_port=master.port, node_store_port=0, node_ranks=(4, 5, 6, 7),
                                  launcher_pid=launcher_pid, timeouts=TIMEOUTS, secret=SECRET)
            ControllerLink(launch).report_failure("DistNetworkError: Connection reset by peer")
            assert inbox.queue_len(INBOX) == reported
    finally:
        launcher.wait()
    assert RankFailureReport.from_json(inbox.queue_pop(INBOX)).rank == 5


def test_each_start_of_a_run_s_controller_counts_one_epoch_more(tmp_path):
    """The epoch a reattaching worker names (``RankReattached``) is the controller start it
    followed: the run directory's ``controller_started`` events count them."""
    for epoch in (0, 1):
        controller = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path)
        controller.start()
        controller.stop()
        assert controller.epoch == epoch
    assert [e["epoch"] for e in read_jsonl(tmp_path / "events.jsonl", key="events")] == [0, 1]


def test_a_survivor_announcing_itself_after_the_judgement_is_refused_at_once(tmp_path):
    """Survivors are judged together (``SurvivorInbox.close``): one whose announcement
    comes later is refused by the polling thread, with the reason in its verdict, and is
    not among those judged."""
    controller = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path)  # polled here
    store = controller.store.clone()
    store.queue_push(INBOX, RankReattached(4, 100, 0, 3, 7).to_json())
    controller._poll(store)
    assert [r.rank for r in controller.survivors.close()] == [4]
    assert not store.check([reattach_verdict_key(4)])  # the judgement answers it
    store.queue_push(INBOX, RankReattached(5, 101, 0, 3, 7).to_json())
    controller._poll(store)
    verdict = ReattachVerdict.from_json(store.get(reattach_verdict_key(5)))
    assert (verdict.accepted, verdict.epoch, verdict.why) == (False, 0, "announced itself after the survivors were judged")
    assert [r.rank for r in controller.survivors.reports()] == [4]


def test_plans_are_published_in_generation_order_and_a_stale_one_is_refused(tmp_path):
    controller = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path)
    launch = WorkerLaunch(rank=0, local_rank=0, node=0, world_size=1, store_host="127.0.0.1",
                          store_port=controller.port, node_store_port=0, node_ranks=(0,), launcher_pid=os.getpid(),
                          timeouts=TIMEOUTS, secret=controller.secret)
    link = ControllerLink(launch)  # not started: no registration, no heartbeat thread
    link.store = Recording(link.store)
    controller.publish_plan(*_published(0))
    assert (link.wait_plan(newer_than=-1).plan, link.wait_plan(newer_than=-1).program) == _published(0)
    assert [key for key, _ in link.store.read] == [plan_key(0), plan_ops_key(0, 0)] * 2
    with pytest.raises(StaleGenerationError, match="generation 0 is stale"):
        controller.publish_plan(*_published(0))
    with pytest.raises(StaleGenerationError, match="generation 2 is not the next one"):
        controller.publish_plan(*_published(2))
    controller.publish_plan(*_published(1))
    assert link.wait_plan(newer_than=0).plan == _plan(1)
    # A message under the next generation's key that carries an old plan: the worker refuses it.
    controller.store.set(plan_key(2), PlanPublished(*_published(1), time.time()).frame())
    with pytest.raises(StaleGenerationError, match="plan generation 1 is stale: generation 1 is already running"):
        link.wait_plan(newer_than=1)
    # A program that is not its plan's is refused before anything is written.
    plan, program = _published(2)
    with pytest.raises(ValueError, match=r"op lists for workers \[\], the plan's live workers are \[0\]"):
        controller.publish_plan(plan, replace(program, ops={}))
    assert controller.published_generation == 1 and not controller.store.check([plan_ops_key(2, 0)])
    controller.record.flush()  # written by the record's own thread
    assert sorted(p.name for p in tmp_path.glob("plan-*.json")) == ["plan-0.json", "plan-1.json"]
    assert read_published(json.loads((tmp_path / "plan-1.json").read_text())) == _published(1)


def test_the_successor_key_names_what_follows_each_generation_and_a_stop_is_not_overwritten(tmp_path):
    """Workers between generations wait on it: the next plan, or the stop order they must
    carry out before the run is done."""
    controller = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path)
    controller.publish_plan(*_published(0))
    following = controller.store.get(successor_key(-1))  # the frame itself: one get between generations
    assert PlanPublished.from_frame(following, current_generation=-1).plan == _plan(0)
    assert not controller.store.check([successor_key(0)])
    controller.end_run(RUN_STOP, StopOrder(3, "SIGTERM", {}).to_json())
    controller.end_run(RUN_DONE, "1")
    assert controller.store.get(successor_key(0)).decode() == RUN_STOP and controller.store.check([RUN_DONE])


def test_the_controller_turns_inbox_messages_into_failures_records_and_kill_orders(tmp_path, caplog):
    slow = Timeouts(heartbeat_interval=0.1, heartbeat_timeout=60.0, collective_timeout=90.0, recovery_timeout=120.0)
    controller = Controller(host="127.0.0.1", port=0, timeouts=slow, run_dir=tmp_path)
    controller.start()
    client = signed_client(controller.port, tmp_path)
    client.set(node_heartbeat_key(0), NodeHeartbeat(0, 1000.0, {"0": 0, "1": 0}, {}, {"0": 20, "1": 21}).to_json())
    for msg in (NodeRegistration(0, 10, "h", (0, 1)), RankRegistration(0, 20, "h", 0), RankRegistration(1, 21, "h", 0)):
        client.queue_push(INBOX, msg.to_json())
    client.queue_push(INBOX, b"\x80 not json")  # dropped with a warning; the controller goes on
    client.queue_push(INBOX, RankFailureReport(1, None, "boom", 5.0).to_json())
    error = controller.next_failure(timeout=10)
    assert (error.cause, error.ranks, error.detail) == (Cause.ERROR, (1,), "boom")
    assert KillOrder.from_json(client.queue_pop(kill_orders_key(0), block=False)) == KillOrder(1, 21)
    client.queue_push(INBOX, RankExit(0, 0, -9, 6.0).to_json())
    exit_failure = controller.next_failure(timeout=10)
    assert (exit_failure.cause, exit_failure.ranks, exit_failure.failed_at) == (Cause.EXIT, (0,), 6.0)
    assert controller.next_failure(timeout=0.3) is None
    controller.stop()
    assert "dropped a malformed inbox message" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["controller_started", "node_joined", "rank_joined", "rank_joined",
                                             "failure", "rank_exit", "failure"]
    workers = json.loads((tmp_path / "workers.json").read_text())
    assert {rank: row["state"] for rank, row in workers.items()} == {"0": "exited", "1": "failed"}


class Counting:
    """A store that passes every call through and names each request it made."""

    def __init__(self, store):
        self.store = store
        self.requests: list[str] = []

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.requests.append(name)
            return method(*args, **kwargs)

        return counted


def _no_worker(launch: WorkerLaunch) -> None:
    raise AssertionError("this launcher starts no worker")


def test_a_launcher_asks_one_request_a_beat_and_reads_the_controllers_heartbeat_when_rung(tmp_path, caplog):
    """A launcher's beat is one ``compare_set``; the controller rings it (``DOORBELL`` over its
    node's heartbeat) for an abort or a kill order, and its next beat reads the controller's
    heartbeat (and then the kill queue); unrung, it reads only every heartbeat timeout."""
    controller = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path)
    controller.start()
    launcher = NodeLauncher(LaunchConfig(master_port=controller.port, nproc_per_node=2), timeouts=TIMEOUTS,
                            target=_no_worker, secret=controller.secret)
    try:
        store = Counting(signed_client(controller.port, tmp_path))
        node_store = launcher._node_client
        store.store.set(launcher_key(0), launcher._name)
        launcher._tie.beat(store, node_store)
        assert store.requests == ["compare_set", "multi_get"], "the first beat reads the controller's"
        store.requests.clear()
        started = time.monotonic()
        for _ in range(3):
            launcher._tie.beat(store, node_store)
        assert time.monotonic() - started < TIMEOUTS.heartbeat_timeout
        assert store.requests == ["compare_set"] * 3
        # A node beside the controller is never found silent: the test beats when it likes.
        for msg in (NodeRegistration(0, os.getpid(), socket.gethostname(), (0, 1)),
                    RankRegistration(1, 4242, "h", 0)):
            store.store.queue_push(INBOX, msg.to_json())
        wait_for(lambda: controller.detector.live_nodes() == [0] or None, timeout=10, what="node 0 registered")

        controller.abort(5)
        store.requests.clear()
        launcher._tie.beat(store, node_store)
        assert store.requests == ["compare_set", "set", "multi_get"], "rung: beat over the bell, then read"
        assert NodeView.from_json(node_store.get(NODE_VIEW)).aborted == (5,)
        assert NodeHeartbeat.from_json(store.store.get(node_heartbeat_key(0))).seq == 4, "its fifth beat"

        store.store.queue_push(INBOX, RankFailureReport(1, None, "boom", 5.0).to_json())
        assert controller.next_failure(timeout=10).ranks == (1,)  # its kill order queued, node 0 rung
        store.requests.clear()
        launcher._tie.beat(store, node_store)
        assert store.requests == ["compare_set", "set", "multi_get", "queue_len", "queue_pop"]
        assert list(launcher._tie.kill_orders) == [KillOrder(1, 4242)]
        store.requests.clear()
        launcher._tie.beat(store, node_store)
        assert store.requests == ["compare_set"]
    finally:
        controller.stop()
        launcher._keeper.close()
    assert "malformed heartbeat" not in caplog.text, "the controller's poll passes over a bell"


@pytest.mark.timeout(120)
def test_a_launcher_waits_for_the_run_spec_past_the_recovery_timeout_while_the_controller_beats(tmp_path):
    """Node 0 opens the store, then prepares the data (minutes for a real corpus): another
    node's launcher registers, beats and waits for the run's spec however long that takes
    while the controller beats, and is handed it before any worker starts (here it stops
    there: the hand-over raises)."""
    timeouts = Timeouts(heartbeat_interval=0.1, heartbeat_timeout=1.0, collective_timeout=2.0, recovery_timeout=3.0)
    controller = Controller(host="127.0.0.1", port=0, timeouts=timeouts, run_dir=tmp_path)
    controller.start()

    class Handed(Exception):
        pass

    handed: list[bytes] = []

    def on_run_spec(spec: bytes) -> None:
        handed.append(spec)
        raise Handed

    launcher = NodeLauncher(LaunchConfig(nnodes=2, node_rank=1, master_port=controller.port), timeouts=timeouts,
                            target=_no_worker, secret=controller.secret, on_run_spec=on_run_spec)
    ended: list[str] = []

    def run() -> None:
        try:
            launcher.run()
        except Handed:
            ended.append("handed the spec")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: controller.detector.live_nodes() == [1] or None, timeout=10, what="node 1 registered")
        time.sleep(timeouts.recovery_timeout + 1)
        assert thread.is_alive() and handed == [], "still waiting, past the recovery timeout"
        assert controller.next_failure(timeout=0) is None and controller.detector.live_nodes() == [1]
        controller.store.set(RUN_SPEC, "the run's spec")
        thread.join(timeout=10)
        assert handed == [b"the run's spec"] and ended == ["handed the spec"]
    finally:
        controller.stop()


def test_a_first_generation_stops_waiting_for_its_ranks_once_the_polling_thread_died(tmp_path, monkeypatch):
    """A start's first generation waits for registrations the polling thread takes in
    (``TrainingRun._await_first_ranks``): once that thread died, ``awaited`` raises at once
    instead of answering the same ranks until the recovery timeout (two minutes by default)."""
    controller = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path)
    assert controller.awaited([0, 1]) == (0, 1)

    def broken(store: SignedStore) -> None:
        raise OSError("injected: the store connection broke")

    monkeypatch.setattr(controller, "_poll", broken)
    controller.start()
    try:
        deadline = time.monotonic() + 10
        with pytest.raises(RuntimeError, match="the controller's polling thread died"):
            while time.monotonic() < deadline:
                controller.awaited([0, 1])
                time.sleep(0.01)
    finally:
        monkeypatch.undo()  # stop() polls once more, on this thread
        controller.stop()


def test_the_controller_reads_node_beats_on_every_poll_and_checks_a_key_only_until_it_read_it(tmp_path):
    """Each poll reads every live node's beat (one ``multi_get``) before it judges silence,
    so no verdict rests on a beat older than the poll; and a key it read is never missing."""
    controller = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path)  # polled here
    store = Counting(controller.store.clone())
    store.store.set(node_heartbeat_key(0), NodeHeartbeat(0, 1.0, {"0": 0}, {}, {"0": 20}).to_json())
    store.store.queue_push(INBOX, NodeRegistration(0, 10, "h", (0,)).to_json())
    polls = []
    for _ in range(3):
        store.requests.clear()
        controller._poll(store)
        polls.append(store.requests[:])
    assert polls == [["set", "queue_len", "queue_pop", "check", "multi_get"], ["set", "queue_len", "multi_get"],
                     ["set", "queue_len", "multi_get"]]
    assert controller.detector.nodes[0].watch.last.seq == 0


def test_a_controller_poll_held_for_several_heartbeat_timeouts_fails_no_node_whose_launcher_beat(tmp_path, caplog):
    """Two real launchers beat every interval from their own threads; the controller's poll
    (run here, by hand, as its thread would) is held twice for three heartbeat
    timeouts each (a GC pause, a thread waiting on a disk or a lock). Each poll reads the
    beats before it judges, on the clock of that read: no node is failed, and each late
    poll says so in one line of the node's log. (Reading every other poll, the first poll
    after a hold judged the beats read before it: both nodes failed as silent.)"""
    caplog.set_level(logging.INFO, logger="odyssey_megatron.runtime.control.controller")
    controller = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path)  # polled here
    store = controller.store.clone()
    launchers = [NodeLauncher(LaunchConfig(nnodes=3, node_rank=n, master_port=controller.port, nproc_per_node=1),
                              timeouts=TIMEOUTS, target=_no_worker, secret=controller.secret) for n in (1, 2)]
    try:
        for n, launcher in enumerate(launchers, start=1):
            beats = signed_client(controller.port, tmp_path, timeout_s=TIMEOUTS.heartbeat_timeout)
            launcher._tie.attach(beats, launcher._node_client)
            # Not the controller's process, and no ranks: no start-up grace.
            store.queue_push(INBOX, NodeRegistration(n, 100 + n, f"node{n}", ()).to_json())
        for _ in range(2):
            for _ in range(4):  # an even number of polls between holds
                controller._poll(store)
                time.sleep(TIMEOUTS.poll_interval)
            assert controller.detector.live_nodes() == [1, 2]
            time.sleep(3 * TIMEOUTS.heartbeat_timeout)  # the poll held
            controller._poll(store)
        for _ in range(4):
            controller._poll(store)
            time.sleep(TIMEOUTS.poll_interval)
        assert controller.next_failure(timeout=0) is None and controller.detector.live_nodes() == [1, 2]
        late = [r.getMessage() for r in caplog.records if "after its previous look" in r.getMessage()]
        assert len(late) == 2 and all(" 3." in line for line in late), late
    finally:
        for launcher in launchers:
            launcher._tie.stop()
            launcher._keeper.close()


def test_the_store_listens_on_the_configured_address_only(tmp_path):
    controller = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path)
    socket.create_connection(("127.0.0.1", controller.port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):  # another loopback address, same port: nothing there
        socket.create_connection(("127.0.0.2", controller.port), timeout=5)


def test_a_taken_port_is_an_error_at_once(tmp_path):
    first = Controller(host="127.0.0.1", port=0, timeouts=TIMEOUTS, run_dir=tmp_path / "a")
    with pytest.raises(OSError, match="in use"):
        Controller(host="127.0.0.1", port=first.port, timeouts=TIMEOUTS, run_dir=tmp_path / "b")


# -- the detector's rules, with made-up times --------------------------------------------

T = TIMEOUTS.heartbeat_timeout


def _node_beat(seq: int, ranks: dict[int, int], generations: dict[int, int] | None = None,
               node: int = 0, pids: dict[int, int] | None = None) -> dict[str, NodeHeartbeat]:
    """Node ``node``'s beat ``seq`` carrying rank -> its last beat's seq (and generation,
    and the process that wrote it: by default the one ``_detector_with_node`` registered)."""
    beat = NodeHeartbeat(seq, 1000.0 + seq, {str(r): s for r, s in ranks.items()},
                         {str(r): g for r, g in (generations or {}).items()},
                         {str(r): (pids or {}).get(r, 20 + r) for r in ranks})
    return {node_heartbeat_key(node): beat}


def _detector_with_node(ranks=(0, 1)) -> Detector:
    detector = Detector(T)
    detector.node_joined(NodeRegistration(0, 10, "h", tuple(ranks)), now=0.0, wall=1000.0)
    for rank in ranks:
        detector.rank_joined(RankRegistration(rank, 20 + rank, "h", 0), now=0.0)
    return detector


def test_the_launcher_in_the_controllers_process_is_never_found_silent_and_the_others_are():
    """Node 0's launcher shares the controller's busy process: its late beats are no node
    failure (that process cannot be lost without the controller); node 1's are."""
    detector = Detector(T, controller_process=("h0", 10))
    detector.node_joined(NodeRegistration(0, 10, "h0", (0, 1)), now=0.0, wall=1000.0)
    detector.node_joined(NodeRegistration(1, 10, "h1", (2, 3)), now=0.0, wall=1000.0)  # same pid, another host
    [failure] = detector.check(now=10 * T, wall=2000.0)
    assert (failure.cause, failure.node, failure.ranks) == (Cause.NODE, 1, (2, 3))


def test_a_silent_rank_is_hung_only_once_its_launcher_beat_after_its_deadline():
    detector = _detector_with_node()
    detector.observe(_node_beat(1, {0: 1, 1: 1}), now=0.25)
    # Rank 1 goes silent after t=0.25; rank 0 and the launcher beat until t=1.25 (rank 1's deadline), then pause.
    detector.observe(_node_beat(2, {0: 2, 1: 1}), now=1.25)
    assert detector.check(now=1.5, wall=2000.0) == []  # rank 1 is late, but its launcher has not beaten since
    detector.observe(_node_beat(3, {0: 3, 1: 1}), now=1.5)
    [failure] = detector.check(now=1.5, wall=2000.0)
    assert (failure.cause, failure.ranks, failure.failed_at, failure.detected_at) == (Cause.HEARTBEAT, (1,), 1001.0, 2000.0)
    assert detector.workers()[1]["state"] == "failed" and detector.workers()[0]["state"] == "alive"


def test_a_silent_launcher_fails_its_node_with_every_live_rank_at_once():
    detector = _detector_with_node((0, 1, 2))
    detector.rank_exited(RankExit(2, 0, 0, 1000.5), wall=1000.5)  # a clean exit: no failure, not lost later
    detector.observe(_node_beat(1, {0: 1, 1: 1}), now=0.5)
    assert detector.check(now=0.5 + T, wall=2000.0) == []  # exactly the timeout is not over it
    [failure] = detector.check(now=0.75 + T, wall=2000.0)
    assert (failure.cause, failure.node, failure.ranks, failure.failed_at) == (Cause.NODE, 0, (0, 1), 1001.0)
    assert detector.heartbeat_keys() == [] and detector.check(now=10.0, wall=2001.0) == []


def test_a_lost_node_names_every_rank_it_ran_since_their_keeper_slots_went_with_its_launcher():
    """Rank 2 was killed before its node was lost: the node fails ranks 0 and 1 (2 failed
    already), and the snapshot memory its launcher kept held all three ranks' slots."""
    detector = _detector_with_node((0, 1, 2))
    killed = detector.rank_exited(RankExit(2, 0, -9, 1000.5), wall=1000.5)
    assert (killed.ranks, killed.node_ranks) == ((2,), ())
    [failure] = detector.check(now=10 * T, wall=2000.0)
    assert (failure.cause, failure.ranks, failure.node_ranks) == (Cause.NODE, (0, 1), (0, 1, 2))


def test_exits_and_reports_fail_a_rank_once():
    detector = _detector_with_node((0, 1, 2, 3))
    assert detector.rank_exited(RankExit(0, 0, 0, 1.0), wall=2.0) is None  # status 0: finished
    exit_failure = detector.rank_exited(RankExit(1, 0, -9, 1.0), wall=2.0)
    assert (exit_failure.cause, exit_failure.ranks, exit_failure.detail) == (Cause.EXIT, (1,), "killed by SIGKILL")
    error = detector.rank_reported(RankFailureReport(2, 0, "boom", 3.0), wall=4.0)
    assert (error.cause, error.ranks, error.failed_at, error.detail) == (Cause.ERROR, (2,), 3.0, "boom")
    assert detector.rank_exited(RankExit(2, 0, -9, 5.0), wall=5.0) is None  # killed on order: already failed
    assert detector.rank_reported(RankFailureReport(1, 0, "late", 6.0), wall=6.0) is None
    assert detector.rank_exited(RankExit(3, 0, 1, 7.0), wall=7.0).detail == "exit status 1"
    detector.node_left(NodeLeft(0, 8.0))
    assert detector.heartbeat_keys() == []


def test_a_starting_rank_gets_the_initial_timeout_until_it_has_entered_a_generation():
    """The case of a slow start on a busy node: a healthy rank silent for over the
    heartbeat timeout before its first generation is not hung; once it has entered one,
    the ordinary timeout holds."""
    detector = Detector(T, initial_heartbeat_timeout=10 * T)
    detector.node_joined(NodeRegistration(0, 10, "h", (0, 1)), now=0.0, wall=1000.0)
    for rank in (0, 1):
        detector.rank_joined(RankRegistration(rank, 20 + rank, "h", 0), now=0.0)
    for tick in range(1, 9):  # the launcher beats on; rank 0 is silent for 8 timeouts, rank 1 beats in generation 0
        detector.observe(_node_beat(tick, {1: tick}, {1: 0}), now=tick * T)
        assert detector.check(now=tick * T, wall=2000.0) == []
    detector.observe(_node_beat(20, {0: 1, 1: 8}, {0: 0, 1: 0}), now=9 * T)
    for tick in range(10, 12):  # now started, rank 0 gets the ordinary timeout
        detector.observe(_node_beat(tick + 20, {0: 1, 1: tick}, {0: 0, 1: 0}), now=tick * T + 0.5)
    [failure] = detector.check(now=11 * T + 0.5, wall=2001.0)
    assert (failure.cause, failure.ranks) == (Cause.HEARTBEAT, (0,))


def test_a_stalled_collective_takes_its_rank_out_once():
    detector = _detector_with_node((0, 1))
    stall = detector.rank_stalled(CollectiveStalled(1, 3, "a collective waited over the collective timeout", 5.0),
                                  wall=6.0)
    assert (stall.cause, stall.ranks, stall.failed_at) == (Cause.STALL, (1,), 5.0)
    assert detector.rank_stalled(CollectiveStalled(1, 3, "again", 7.0), wall=7.0) is None


def test_a_restarted_workers_start_up_grace_holds_whatever_its_predecessors_last_beat_said():
    """The launcher may forward the dead process's last beat (its generation, its seq) after
    the new one registered: it is not the newcomer's, which keeps the initial timeout."""
    detector = Detector(T, initial_heartbeat_timeout=10 * T)
    detector.node_joined(NodeRegistration(0, 10, "h", (0, 1)), now=0.0, wall=1000.0)
    for rank in (0, 1):
        detector.rank_joined(RankRegistration(rank, 20 + rank, "h", 0), now=0.0)
    detector.rank_exited(RankExit(1, 0, -9, 1000.5), wall=1000.5)
    detector.rank_joined(RankRegistration(1, 99, "h", 0), now=1.0)  # restarted, starting up
    detector.observe(_node_beat(2, {0: 2, 1: 7}, {0: 3, 1: 3}), now=1.0)  # rank 1's entry: still pid 21's
    for tick in range(3, 8):  # the newcomer starts up silent for 5 timeouts; rank 0 and the launcher beat on
        detector.observe(_node_beat(tick, {0: tick, 1: 7}, {0: 3, 1: 3}), now=tick * T)
        assert detector.check(now=tick * T, wall=2000.0) == []
    assert detector.workers()[1]["generation"] is None


def test_a_first_generation_awaits_every_rank_of_this_start_and_none_that_failed():
    """``Detector.awaited``: a start's first generation waits for ranks not registered yet
    and for those registered only as a lost controller's survivors (refused: their node's
    command started again brings fresh processes), not for a rank that failed or exited
    (that is a failure like any other)."""
    detector = Detector(T, initial_heartbeat_timeout=10 * T)
    detector.node_joined(NodeRegistration(0, 10, "h", (0, 1, 2)), now=0.0, wall=1000.0)
    assert detector.awaited(range(6)) == (0, 1, 2, 3, 4, 5)  # 3-5: a node not registered yet
    detector.rank_joined(RankRegistration(0, 20, "h", 0), now=0.0)
    detector.rank_joined(RankRegistration(1, 21, "h", 0), now=0.0)
    detector.rank_exited(RankExit(1, 0, -9, 1000.5), wall=1000.5)
    assert detector.awaited(range(3)) == (2,)
    detector.node_joined(NodeRegistration(1, 11, "h", (3, 4, 5)), now=1.0, wall=1001.0)  # a survivors' launcher
    for rank in (3, 4, 5):
        detector.rank_joined(RankRegistration(rank, 30 + rank, "h", 1, survivor=True), now=1.0)
    detector.rank_exited(RankExit(3, 1, 0, 1001.5), wall=1001.5)  # refused: it exits
    assert detector.awaited(range(6)) == (2, 3, 4, 5)
    detector.node_joined(NodeRegistration(1, 11, "h", (3, 4, 5)), now=1.1, wall=1001.1)  # after its survivors
    for rank in (4, 5):
        detector.rank_exited(RankExit(rank, 1, 0, 1001.5), wall=1001.5)
    assert detector.awaited(range(6)) == (2, 3, 4, 5)
    detector.node_left(NodeLeft(1, 1001.6))
    assert detector.awaited(range(6)) == (2, 3, 4, 5)
    assert detector.node_joined(NodeRegistration(1, 12, "h", (3, 4, 5)), now=2.0, wall=1002.0) is None  # started again
    detector.rank_joined(RankRegistration(2, 22, "h", 0), now=2.0)
    for rank in (3, 4):
        detector.rank_joined(RankRegistration(rank, 40 + rank, "h", 1), now=2.0)
    assert detector.awaited(range(6)) == (5,)
    detector.rank_joined(RankRegistration(5, 45, "h", 1), now=2.0)
    assert detector.awaited(range(6)) == ()


def _polled(detector: Detector, beats: dict[str, NodeHeartbeat], now: float) -> list:
    """One controller poll: the look, what it read, the verdicts."""
    detector.looked(now)
    detector.observe(beats, now)
    return detector.check(now, wall=2000.0 + now)


def test_silence_during_the_controllers_own_stall_counts_from_its_late_look():
    """The controller's process stops for 3 s with the store it hosts (SIGSTOP, swap): no
    beat could be written meanwhile, and its first look after it finds every beat 3 s old.
    That look is late and counts the silence from itself: nodes that beat again within the
    timeout are never failed, and one that stays silent fails a timeout after the look,
    not at once."""
    detector = _detector_with_node()
    detector.node_joined(NodeRegistration(1, 11, "h1", ()), now=0.0, wall=1000.0)
    for tick in range(1, 11):  # on time: a look every 0.05 s
        beats = {**_node_beat(tick, {0: tick, 1: tick}), **_node_beat(tick, {}, node=1)}
        assert _polled(detector, beats, now=tick * 0.05) == []
    stalled = 0.5 + 3.0
    assert detector.looked(stalled) == pytest.approx(3.0)
    assert detector.check(stalled, wall=2000.0) == []
    for tick in range(11, 20):  # node 0 and its ranks beat again 0.5 s later; node 1 stays silent
        beats = _node_beat(tick, {0: tick, 1: tick}) if tick > 15 else {}
        assert _polled(detector, beats, now=stalled + (tick - 10) * 0.1) == []
    [lost] = _polled(detector, _node_beat(21, {0: 21, 1: 21}), now=stalled + T + 0.05)
    assert (lost.cause, lost.node) == (Cause.NODE, 1)


def test_a_controller_late_at_every_look_still_finds_a_dead_node():
    """One late look is excused per two timeouts: a controller that looks only every 0.6 s
    (late each time) fails a silent node within two timeouts, and the live one never."""
    detector = _detector_with_node(ranks=())
    detector.node_joined(NodeRegistration(1, 11, "h1", ()), now=0.0, wall=1000.0)
    failures = []
    for tick in range(1, 8):
        failures += _polled(detector, _node_beat(tick, {}), now=tick * 0.6)
    assert [(f.cause, f.node) for f in failures] == [(Cause.NODE, 1)]
    assert failures[0].detected_at - 2000.0 <= 2 * T + 0.6


def test_a_starting_node_gets_the_initial_timeout_until_every_rank_of_it_registered():
    """A replacement node's launcher registers, then imports and forks its workers under
    the load of the run: it may beat late then. Until its last rank registered it gets the
    ranks' start-up grace; from then on, the ordinary timeout."""
    detector = Detector(T, initial_heartbeat_timeout=10 * T)
    detector.node_joined(NodeRegistration(1, 10, "h", (2, 3)), now=0.0, wall=1000.0)
    assert detector.check(now=8 * T, wall=1008.0) == []  # silent for 8 timeouts while it starts
    detector.rank_joined(RankRegistration(2, 22, "h", 1), now=8 * T)
    assert detector.check(now=9 * T, wall=1009.0) == []  # rank 3 still starting
    detector.observe(_node_beat(1, {2: 1}, node=1, pids={2: 22}), now=9 * T)
    detector.rank_joined(RankRegistration(3, 23, "h", 1), now=9 * T)
    assert detector.check(now=10 * T, wall=1010.0) == []
    [lost] = detector.check(now=10 * T + 0.01, wall=1010.0)
    assert (lost.cause, lost.node, lost.ranks) == (Cause.NODE, 1, (2, 3))
    assert f"silent for over {T} s" in lost.detail


def test_a_failed_nodes_ranks_are_alive_only_once_it_registered_again_and_then_watched():
    """A node failed as silent whose launcher lived on: a worker of it that registers (its
    launcher restarted it) is not alive, since no one watches that launcher; once the
    launcher registers the node again (fenced, it does), its workers are alive, and its
    silence fails them again."""
    detector = _detector_with_node()
    [lost] = detector.check(now=2 * T, wall=2000.0)
    assert lost.launcher == "h:10"
    detector.rank_joined(RankRegistration(1, 31, "h", 0), now=2 * T)
    assert detector.alive_ranks() == [] and detector.workers()[1]["state"] == "failed"
    assert detector.node_joined(NodeRegistration(0, 10, "h", (0, 1)), now=3 * T, wall=2001.0) is None
    for rank in (0, 1):
        detector.rank_joined(RankRegistration(rank, 40 + rank, "h", 0), now=3 * T)
    assert detector.alive_ranks() == [0, 1]
    [again] = detector.check(now=4 * T + 0.01, wall=2002.0)
    assert (again.cause, again.ranks) == (Cause.NODE, (0, 1))


def test_heartbeats_carry_the_generation_each_worker_runs():
    detector = _detector_with_node()
    assert detector.observe(_node_beat(1, {0: 1}), now=0.1) is False  # still no plan
    assert detector.observe(_node_beat(2, {0: 2}, {0: 0}), now=0.2) is True
    assert [row["generation"] for row in detector.workers().values()] == [0, None]


# -- messages, timeouts and the launch configuration -------------------------------------


def test_messages_round_trip_and_malformed_ones_are_refused():
    for msg in (RankRegistration(3, 99, "h", 1), NodeRegistration(1, 98, "h", (2, 3)), RankExit(3, 1, -9, 1.5),
                RankFailureReport(3, None, "boom", 2.0), CollectiveStalled(3, 2, "timed out", 2.5), NodeLeft(1, 3.0)):
        assert parse_inbox(msg.to_json()) == msg
    beat = Heartbeat(4, 1004.0, generation=2, watching=3, pid=1234)
    assert Heartbeat.from_json(beat.to_json()) == beat
    [node_beat] = _node_beat(5, {3: 4, 4: 1}, {3: 2}).values()
    assert NodeHeartbeat.from_json(node_beat.to_json()) == node_beat
    assert node_beat.rank_beats() == {3: Heartbeat(4, 1005.0, 2, pid=23), 4: Heartbeat(1, 1005.0, None, pid=24)}
    view = NodeView(7, 1007.0, (2, 3), controller_lost="store unreachable")
    assert NodeView.from_json(view.to_json()) == view and view.controller_beat() == Heartbeat(7, 1007.0)
    with pytest.raises(ProtocolError, match="field 'seqs' must be dict"):
        NodeHeartbeat.from_json('{"kind": "node_heartbeat", "seq": 1, "sent_at": 1.0, "seqs": {"3": "x"}, '
                                '"generations": {}}')
    with pytest.raises(ProtocolError, match="unknown inbox message kind 'shutdown'"):
        parse_inbox('{"kind": "shutdown"}')
    with pytest.raises(ProtocolError, match="field 'rank' must be int"):
        parse_inbox('{"kind": "rank_exit", "rank": "3", "node": 1, "exitcode": 0, "exited_at": 1.0}')
    with pytest.raises(ProtocolError, match="field 'ranks' must be tuple"):
        parse_inbox('{"kind": "register_node", "node": 1, "pid": 2, "host": "h", "ranks": [1.5]}')
    with pytest.raises(ProtocolError, match="not a JSON message"):
        Heartbeat.from_json(b"\x80(pickle")
    assert KillOrder.from_json(KillOrder(3, 1234).to_json()) == KillOrder(3, 1234)


def test_the_frame_of_a_4096_worker_plan_is_under_2_kb_and_reads_back_exactly():
    """Its size follows what is irregular in the plan (here a rerouted stage), not the
    world's size: the plan's own JSON is 300 KB."""
    profile = uniform_profile(num_layers=8)
    plan = with_sync(symmetric_plan(dp=1024, pp=4, num_layers=8, micro_batches_per_pipeline=16), profile)
    plan = reroute_plan(plan, failed_workers={2050}, profile=profile)
    published = PlanPublished(plan, StepProgram(plan.generation, {}, staggered_optimizer=True, split_backward=True), 2.0)
    frame = published.frame()
    assert len(frame) < 2_000 and len(json.dumps(plan.to_dict())) > 300_000
    assert PlanPublished.from_frame(frame, current_generation=plan.generation - 1) == published


def _frame_with(published: PlanPublished, change) -> bytes:
    data = json.loads(zlib.decompress(published.frame()))
    change(data)
    return zlib.compress(json.dumps(data).encode())


def test_a_frame_round_trips_exactly_and_malformed_ones_are_refused():
    plan, program = _rerouted_tp2()
    joining = PlanPublished(plan, program, 4.0, start_step=3, joined=(0,))
    assert PlanPublished.from_frame(joining.frame(), current_generation=plan.generation - 1) == replace(
        joining, program=replace(program, ops={}))
    with pytest.raises(StaleGenerationError, match=f"plan generation {plan.generation} is stale"):
        PlanPublished.from_frame(joining.frame(), current_generation=plan.generation)
    with pytest.raises(ProtocolError, match="not a compressed JSON message"):
        PlanPublished.from_frame(b"\x80(pickle", current_generation=0)
    with pytest.raises(ProtocolError, match="with published_at, start_step, fresh"):
        PlanPublished.from_frame(_frame_with(joining, lambda d: d.update(joined=["0"])), current_generation=0)
    with pytest.raises(ProtocolError, match="malformed plan: .*cannot be cut into pieces"):
        PlanPublished.from_frame(_frame_with(joining, lambda d: d["plan"]["workers"].pop()), current_generation=0)
    with pytest.raises(ProtocolError, match="malformed plan: .*not an integer"):
        PlanPublished.from_frame(_frame_with(joining, lambda d: d["plan"]["layers"].__setitem__(0, 1.5)),
                                 current_generation=0)
    with pytest.raises(ProtocolError, match="malformed plan: .*flags must be booleans"):
        PlanPublished.from_frame(_frame_with(joining, lambda d: d["program"].update(split_backward=1)),
                                 current_generation=0)


@pytest.mark.parametrize("override, culprit", [
    ({"heartbeat_timeout": 0.1}, "odyssey.heartbeat_timeout: must be greater than odyssey.heartbeat_interval (0.1)"),
    ({"collective_timeout": 1.0}, "odyssey.collective_timeout: must be greater than odyssey.heartbeat_timeout (1.0)"),
    ({"recovery_timeout": 5.0}, "odyssey.recovery_timeout: must be greater than odyssey.collective_timeout (30.0)"),
    ({"heartbeat_interval": 0.001}, "odyssey.heartbeat_interval: must be >= 0.01"),
])
def test_timeouts_must_grow_in_their_order(override, culprit):
    with pytest.raises(ConfigError) as error:
        OdysseyConfig(**override)
    assert str(error.value).startswith(culprit) and "\n" not in str(error.value)


def test_launch_config_reads_torchrun_flags_then_environment_then_defaults():
    assert LaunchConfig.resolve({}, {}) == LaunchConfig(1, 0, "127.0.0.1", 0, 1)
    env = {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    config = LaunchConfig.resolve({"nproc_per_node": "8"}, env)
    assert config == LaunchConfig(4, 3, "10.0.0.1", 29500, 8)
    assert config.world_size == 32 and list(config.ranks) == list(range(24, 32))
    flags = {"nnodes": "2", "node_rank": "1", "master_addr": "node0", "master_port": "1234", "nproc_per_node": None}
    assert LaunchConfig.resolve(flags, env) == LaunchConfig(2, 1, "node0", 1234, 1)  # a flag wins over its variable


def test_beside_a_dedicated_controller_node_0_has_no_ranks_and_the_others_number_them_from_0():
    flags = {"nnodes": "3", "master_port": "29500", "nproc_per_node": "4"}
    nodes = [LaunchConfig.resolve({**flags, "node_rank": str(n)}, {}, dedicated_controller=True) for n in range(3)]
    assert [list(node.ranks) for node in nodes] == [[], [0, 1, 2, 3], [4, 5, 6, 7]]
    assert {node.world_size for node in nodes} == {8} and {node.first_worker_node for node in nodes} == {1}
    with pytest.raises(ConfigError) as error:
        LaunchConfig.resolve({"nproc_per_node": "8"}, {}, dedicated_controller=True)
    assert str(error.value).startswith("cluster.dedicated_controller: needs the controller's node and at least one")


def test_launch_config_reads_slurms_variables_where_torchruns_are_absent():
    slurm = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09,12]", "MASTER_PORT": "29500"}
    assert LaunchConfig.resolve({"nproc_per_node": "8"}, slurm) == LaunchConfig(4, 2, "gpu07", 29500, 8)
    torchrun = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}
    assert LaunchConfig.resolve({}, {**slurm, **torchrun}) == LaunchConfig(2, 1, "10.0.0.1", 29500, 1)
    assert LaunchConfig.resolve({"node_rank": "3"}, slurm).node_rank == 3  # a flag wins over both


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"), ("login1,gpu[1-4]", "login1"), ("gpu[003-005],login1", "gpu003"), ("a-b[2,5]-ib,c", "a-b2-ib"),
])
def test_the_master_is_the_first_host_of_slurms_node_list(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("flags, env, culprit", [
    ({}, {"SLURM_NNODES": "2", "SLURM_NODEID": "2", "MASTER_PORT": "1"}, "SLURM_NODEID: must lie in 0..1; got 2"),
    ({}, {"SLURM_JOB_NODELIST": "[1-2]"}, "SLURM_JOB_NODELIST: is not a SLURM node list"),
    ({}, {"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n1"}, "--master-port: must name a port (not 0) when there are 2"),
    ({"node_rank": "2", "nnodes": "2", "master_port": "1"}, {}, "--node-rank: must lie in 0..1; got 2"),
    ({}, {"NNODES": "2", "NODE_RANK": "x", "MASTER_PORT": "1"}, "NODE_RANK: must be an integer; got 'x'"),
    ({"nnodes": "2"}, {}, "--master-port: must name a port (not 0) when there are 2 nodes"),
    ({}, {"NNODES": "2", "MASTER_PORT": "0"}, "MASTER_PORT: must name a port (not 0) when there are 2 nodes"),
    ({"master_port": "70000"}, {}, "--master-port: must lie in 0..65535; got 70000"),
    ({"nnodes": "0"}, {}, "--nnodes: must lie in 1..16384; got 0"),
    ({"nproc_per_node": "0"}, {}, "--nproc-per-node: must lie in 1..1024; got 0"),
    ({}, {"MASTER_ADDR": " "}, "MASTER_ADDR: must be a host name or IP address"),
])
def test_bad_launch_settings_are_one_line_naming_the_flag_or_variable(flags, env, culprit):
    with pytest.raises(ConfigError) as error:
        LaunchConfig.resolve(flags, env)
    assert str(error.value).startswith(culprit) and "\n" not in str(error.value)


def test_a_node_registering_again_replaces_the_old_launcher_whose_live_ranks_fail_as_one_node():
    detector = _detector_with_node()
    replaced = detector.node_joined(NodeRegistration(0, 11, "h2", (0, 1)), now=1.0, wall=1001.0)
    assert (replaced.cause, replaced.node, replaced.ranks) == (Cause.NODE, 0, (0, 1))
    assert "launcher pid 10 on h replaced by pid 11 on h2" in replaced.detail
    assert detector.starting_ranks() == [0, 1] and detector.alive_ranks() == []
    detector.rank_joined(RankRegistration(0, 30, "h2", 0), now=1.5)
    assert detector.starting_ranks() == [1] and detector.alive_ranks() == [0] and detector.pid_of(0) == 30
    assert detector.check(now=1.6, wall=1001.6) == []  # the new launcher's watch starts now


def test_a_lost_node_registering_again_fails_nothing_more_and_a_restarted_rank_is_alive_again():
    detector = _detector_with_node()
    [lost] = detector.check(now=10 * T, wall=2000.0)
    assert lost.cause is Cause.NODE
    assert detector.node_joined(NodeRegistration(0, 11, "h", (0, 1)), now=10 * T, wall=2000.0) is None
    for rank in (0, 1):
        detector.rank_joined(RankRegistration(rank, 40 + rank, "h", 0), now=10 * T)
    assert detector.alive_ranks() == [0, 1]
    exited = detector.rank_exited(RankExit(1, 0, -9, 2001.0), wall=2001.0)
    assert exited.ranks == (1,) and detector.alive_ranks() == [0]
    detector.rank_joined(RankRegistration(1, 50, "h", 0), now=10 * T + 1)  # its launcher restarted it
    assert detector.alive_ranks() == [0, 1] and detector.pid_of(1) == 50
