"""The controller: the one process that outlives every worker. It hosts the rendezvous
TCPStore, runs the fault detector, records the run and publishes plans.

A daemon thread polls twice per heartbeat interval: it writes the controller's own
heartbeat (workers and launchers save and exit when it stops, after
``odyssey.controller_reattach_s`` unless a restarted controller takes them back, so a lost
controller leaves no orphans), drains the inbox (survivors of a lost controller
announcing themselves go to ``SurvivorInbox``), reads every live node's heartbeat (which
carries its workers' beats, ``NodeHeartbeat``) in one round trip, and only then judges silence, on the clock
of that read, so a late poll (this process stopped, a GC pause, swap) is logged and
blamed on no node (``Detector.looked``). It turns the detector's verdicts into
``events.jsonl`` records, kill orders for the failed ranks' launchers, fencing of a lost
node's launcher (``keys.fenced``: should it live on, it registers the node again), and
``Failure`` items for the owner (the training orchestrator) to act on with
``next_failure``. It never waits on a disk: the run record writes from a thread of its
own (``RunRecord``). Launchers read the controller's heartbeat only when it rings them
(``DOORBELL``: an abort, a kill order) or every heartbeat timeout, so the store's load
is one request per node per interval. The thread never waits on the owner, so a long
decision delays neither heartbeats nor detection.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.run_dir import read_jsonl
from odyssey_megatron.runtime.control.blame import WaitGraph
from odyssey_megatron.runtime.control.console import CONSOLE, failure_line
from odyssey_megatron.runtime.control.detector import Cause, Detector, Failure, describe_exit
from odyssey_megatron.runtime.control.heartbeat_reader import HeartbeatReader
from odyssey_megatron.runtime.control.run_record import RunRecord
from odyssey_megatron.runtime.control.store_server import StoreServer
from odyssey_megatron.runtime.control.survivor_inbox import SurvivorInbox
from odyssey_megatron.runtime.protocol.auth import ForgedValue, SignedStore, Signer, controller_secret
from odyssey_megatron.runtime.protocol.keys import (
    ABORTED,
    CONTROLLER_HEARTBEAT,
    DOORBELL,
    INBOX,
    PUBLISHED_GENERATION,
    abort_key,
    all_arrived_key,
    fenced,
    kill_orders_key,
    launcher_key,
    node_heartbeat_key,
    successor_key,
)
from odyssey_megatron.runtime.protocol.messages import (
    CollectiveStalled,
    ControllerHeartbeat,
    KillOrder,
    Message,
    NodeLeft,
    NodeRegistration,
    parse_inbox,
    ProtocolError,
    RankExit,
    RankFailureReport,
    RankReattached,
    RankRegistration,
    StaleGenerationError,
    StopRequested,
    StragglerRemoved,
)
from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished, write_plan
from odyssey_megatron.schedules.program import StepProgram
from odyssey_megatron.snapshot.restore import Restore
from odyssey_megatron.timeouts import Timeouts

__all__ = ["Controller"]

RECENT_ABORTS = 4
"""Aborted generations the controller's heartbeat carries: a launcher rung for an abort
reads it at its next beat, and an abort is of the newest generation."""

log = logging.getLogger(__name__)
console = logging.getLogger(CONSOLE)


class Controller:
    """Hosts the store on ``host:port`` (port 0: a free one, see ``port``) and watches
    every rank and node that registers there. Call ``start`` once, ``stop`` at the end."""

    # -- configuration
    timeouts: Timeouts
    record: RunRecord
    # -- the store it hosts
    secret: bytes
    """The run's (``protocol.auth``), created in the run directory at its first start."""
    store: SignedStore
    host: str
    port: int
    # -- detection, on the polling thread
    detector: Detector
    # -- plans
    published_generation: int
    """The newest generation published; -1 before the first."""
    stop_request: Optional[tuple[str, int]]
    """(reason, exit status) once the run was asked to stop on purpose (``request_stop``)."""

    def __init__(self, *, host: str, port: int, timeouts: Timeouts, run_dir: Path):
        self.timeouts = timeouts
        self.record = RunRecord(run_dir)
        self.epoch = sum(e["event"] == "controller_started" for e in read_jsonl(self.record.events_path, key="--resume")
                         ) if self.record.events_path.is_file() else 0
        """This controller's start in the run (0: its first; each ``--resume`` one more): the
        workers name it when they reattach to a later start (``RankReattached``)."""
        self.secret = controller_secret(run_dir)  # before the store opens: a launcher that reached it finds it
        self._server = StoreServer(host, port, timeout=timeouts.recovery_timeout)
        self.host, self.port = host, self._server.port
        self.store = SignedStore(self._server.store, Signer(self.secret))
        self._seq = 0
        self._beating = threading.Lock()
        """The polling thread and the owner (an abort) both beat."""
        self._judging = threading.Lock()
        """The polling thread and the owner (``fail_late``, ``awaited``) both pass verdicts on ranks."""
        self._aborted: tuple[int, ...] = ()
        self._kill_orders: dict[int, int] = {}
        """Node -> kill orders queued for it so far (``ControllerHeartbeat.kill_orders``)."""
        self._heartbeats = HeartbeatReader()  # the polling thread's
        self._beat(self.store)  # before anyone can read it: a client's first look finds a controller
        self.detector = Detector(timeouts.heartbeat_timeout, timeouts.initial_heartbeat_timeout,
                                 controller_process=(socket.gethostname(), os.getpid()))
        self.published_generation = -1
        self._published: Optional[tuple[ExecutionPlan, StepProgram]] = None
        """The plan and program published last (the owner's thread sets it whole)."""
        self._waits: Optional[WaitGraph] = None
        """The newest generation's wait graph, made at its first stall report (the polling thread's)."""
        self.stop_request = None
        self.survivors = SurvivorInbox(self.record, epoch=self.epoch)
        """Survivors of a lost controller that announced themselves to this one."""
        self._failures: queue.Queue[Failure] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="odyssey-controller", daemon=True)
        self._crash: Optional[BaseException] = None
        self.record.event("controller_started", host=host, port=self.port, epoch=self.epoch)
        log.info("controller: store on %s:%d", host, self.port)

    def start(self) -> None:
        self._thread.start()

    def continue_after(self, generation: int) -> None:
        """Number the plans from ``generation + 1`` on: the survivors this controller took
        back ran ``generation`` under the lost controller, and wait for what follows it."""
        if self.published_generation != -1:
            raise RuntimeError(f"generation {self.published_generation} is published already")
        self.published_generation = generation

    def stop(self) -> None:
        """Stop polling, after taking in what is still in the inbox (the last exits), and
        wait until the run record is written."""
        self._stop.set()
        self._thread.join()
        self._poll(self.store)
        self.record.flush()

    def next_failure(self, timeout: float) -> Optional[Failure]:
        """The next failure detected, waiting up to ``timeout`` s; None if none came.
        Raises if the polling thread died (it logged why)."""
        try:
            return self._failures.get(timeout=timeout)
        except queue.Empty:
            self._raise_if_polling_died()
            return None

    def _raise_if_polling_died(self) -> None:
        """Nothing the polling thread reads (failures, registrations) comes in once it died."""
        if self._crash is not None:
            raise RuntimeError("the controller's polling thread died") from self._crash

    def request_stop(self, reason: str, *, status: int) -> None:
        """Ask the run to stop at its next step boundary (the first request counts);
        ``status``: the exit status it then ends with (128 + the signal)."""
        if self.stop_request is None:
            self.stop_request = (reason, status)
            self.record.event("stop_requested", reason=reason)

    def publish_plan(self, plan: ExecutionPlan, program: StepProgram, *, start_step: int = 0,
                     fresh: bool = False, estimated_step_s: float | None = None, snapshot_interval: int = 0,
                     snapshot: tuple[int, int] | None = None, restore: Restore | None = None,
                     joined: tuple[int, ...] = ()) -> None:
        """Publish ``plan`` with its step program under its generation's keys (``write_plan``:
        each worker's op list apart, then the frame every worker reads), to be run from step
        ``start_step``; generations go up one by one, so an older or
        repeated one is refused (a decision overtaken by a newer one). ``estimated_step_s``
        (the estimator's step time) goes into the record; ``fresh``, ``snapshot_interval``,
        ``snapshot``, ``restore`` and ``joined``: see ``PlanPublished``."""
        if plan.generation != self.published_generation + 1:
            problem = "stale" if plan.generation <= self.published_generation else "not the next one"
            raise StaleGenerationError(f"plan generation {plan.generation} is {problem}: generation "
                                       f"{self.published_generation} was published last")
        published = PlanPublished(plan, program, time.time(), start_step, fresh, snapshot_interval, snapshot,
                                  restore, joined)
        write_plan(self.store, published)  # checks that the program is the plan's first
        self.store.set(PUBLISHED_GENERATION, str(plan.generation))
        self._published = (plan, program)
        self.published_generation = plan.generation
        # Kept for people once the workers have it: at 16,384 ranks the whole plan's JSON
        # takes seconds to write.
        self.record.plan(plan, program)
        self.record.event("plan", generation=plan.generation, policy=plan.policy, workers=list(plan.workers),
                          start_step=start_step, estimated_step_s=estimated_step_s,
                          rollback_to=restore.step if restore is not None else None, joined=list(joined))
        log.info("controller: published plan generation %d (%s)", plan.generation, plan.policy)

    def remove_straggler(self, rank: int, *, generation: int, detail: str) -> None:
        """Have ``rank`` (a straggler of ``generation``) failed, through the inbox: the polling
        thread fails it, orders its kill and queues the failure (``next_failure``)."""
        self.store.queue_push(INBOX, StragglerRemoved(rank, generation, detail, time.time()).to_json())

    def end_run(self, key: str, value: str) -> None:
        """Set ``RUN_DONE`` or ``RUN_STOP`` (``key``) to ``value``, and wake the workers
        waiting for what follows the newest generation (unless a stop already did: the
        workers carry out the stop order, then the run is done)."""
        self.store.set(key, value)
        self.store.compare_set(successor_key(self.published_generation), "", key)

    def awaited(self, ranks: list[int]) -> tuple[int, ...]:
        """On the owner's thread: the ranks of ``ranks`` a start's first generation still
        waits for (``Detector.awaited``). Raises if the polling thread died: no rank would
        be seen to register again, and the wait would last its whole timeout for nothing."""
        self._raise_if_polling_died()
        with self._judging:
            return self.detector.awaited(ranks)

    def fail_late(self, ranks: list[int], generation: int) -> bool:
        """On the owner's thread: fail the ranks of ``ranks`` that beat but have not entered
        ``generation`` within the recovery timeout (``Detector.ranks_late``), as any failure
        (recorded, killed, queued for ``next_failure``); whether there was one."""
        with self._judging:
            failure = self.detector.ranks_late(ranks, generation, time.time(), self.timeouts.recovery_timeout)
            if failure is not None:
                self._report(self.store, failure)
        return failure is not None

    # -- the polling thread ----------------------------------------------------------------

    def abort(self, generation: int) -> None:
        """End ``generation``: its abort key, its arriving ranks woken, and every launcher
        rung, to read it in the controller's heartbeat at its next beat (they relay it to
        their workers)."""
        self.store.set(abort_key(generation), "1")
        self.store.set(all_arrived_key(generation), ABORTED)
        self._aborted = (*self._aborted, generation)[-RECENT_ABORTS:]
        self._ring(self.store, self.detector.live_nodes())

    def _ring(self, store: SignedStore, nodes: list[int]) -> None:
        """Beat, then ring the launchers of ``nodes`` (``DOORBELL``): each reads that beat
        or a later one at its next beat."""
        self._beat(store)
        if nodes:
            store.multi_set([node_heartbeat_key(n) for n in nodes], [DOORBELL] * len(nodes))

    def _beat(self, store: SignedStore) -> None:
        with self._beating:
            beat = ControllerHeartbeat(self._seq, time.time(), self._aborted,
                                       {str(n): count for n, count in self._kill_orders.items()})
            store.set(CONTROLLER_HEARTBEAT, beat.to_json())
            self._seq += 1

    def _poll_loop(self) -> None:
        store = self.store.clone()
        period = self.timeouts.poll_interval
        next_poll = time.monotonic()
        try:
            while not self._stop.wait(max(0.0, next_poll - time.monotonic())):
                next_poll = max(next_poll + period, time.monotonic())
                self._poll(store)
        except BaseException as exc:
            log.exception("controller: polling thread failed; workers will exit when its heartbeat stops")
            self._crash = exc

    def _poll(self, store: SignedStore) -> None:
        self._beat(store)
        with self._judging:
            workers_changed = False
            for _ in range(store.queue_len(INBOX)):
                try:
                    workers_changed |= self._take(store, parse_inbox(store.queue_pop(INBOX, block=False)))
                except ForgedValue:
                    continue  # refused (logged once): never acted on
                except ProtocolError as exc:
                    log.warning("controller: dropped a malformed inbox message: %s", exc)
            beats = self._heartbeats.read(store, self.detector.heartbeat_keys())
            now = time.monotonic()  # after the read: a stall before it only makes the beats fresher
            late = self.detector.looked(now)
            if late:
                # In the node's log, not on the terminal: on a loaded node 0 this is routine.
                log.info("controller: looked at the node heartbeats %.1f s after its previous look (this process "
                            "stalled); their silence counts from now", late)
            workers_changed |= self.detector.observe(beats, now)
            for failure in self.detector.check(now, time.time()):
                self._report(store, failure)
                workers_changed = True
            if workers_changed:
                self.record.workers(self.detector.workers())

    def _take(self, store: SignedStore, msg: Message) -> bool:
        """Hand one inbox message to the detector; True if workers.json changes."""
        now, wall = time.monotonic(), time.time()
        if isinstance(msg, NodeRegistration):
            replaced = self.detector.node_joined(msg, now, wall)
            if replaced is not None:
                self._report(store, replaced)
            self.record.event("node_joined", node=msg.node, pid=msg.pid, host=msg.host, ranks=list(msg.ranks))
            log.info("controller: node %d joined (launcher pid %d on %s, ranks %s)", msg.node, msg.pid, msg.host,
                     list(msg.ranks))
        elif isinstance(msg, RankRegistration):
            self.detector.rank_joined(msg, now)
            self.record.event("rank_joined", rank=msg.rank, pid=msg.pid, host=msg.host, node=msg.node)
        elif isinstance(msg, RankExit):
            self.record.event("rank_exit", rank=msg.rank, node=msg.node, exitcode=msg.exitcode,
                              exited_at=msg.exited_at, detail=describe_exit(msg.exitcode))
            failure = self.detector.rank_exited(msg, wall)
            if failure is not None:
                self._report(store, failure)
        elif isinstance(msg, RankFailureReport):
            failure = self.detector.rank_reported(msg, wall)
            if failure is not None:
                self._report(store, failure)
        elif isinstance(msg, CollectiveStalled):
            self.record.event("collective_stalled", rank=msg.rank, generation=msg.generation, detail=msg.detail)
            ended = msg.generation is None or msg.generation < self.published_generation or store.check(
                [abort_key(msg.generation)])
            failure = None if ended else self.detector.rank_stalled(msg, wall, waits=self._wait_graph())
            if failure is not None:  # the first stall of a running generation ends it
                self._report(store, failure)
        elif isinstance(msg, StragglerRemoved):
            failure = None if msg.generation < self.published_generation else self.detector.straggler_removed(msg, wall)
            if failure is not None:
                self._report(store, failure)
        elif isinstance(msg, StopRequested):
            self.request_stop(f"{msg.signal} on node {msg.node}", status=128 + signal.Signals[msg.signal].value)
            return False
        elif isinstance(msg, RankReattached):
            self.survivors.announced(store, msg)
            return False
        elif isinstance(msg, NodeLeft):
            self.detector.node_left(msg)
            self.record.event("node_left", node=msg.node, left_at=msg.left_at)
            return False
        return True

    def _wait_graph(self) -> Optional[WaitGraph]:
        """What each rank of the newest generation waits for (``blame``): whom a stall is blamed on."""
        published = self._published
        if published is not None and (self._waits is None or self._waits.plan is not published[0]):
            self._waits = WaitGraph(*published)
        return self._waits

    def _report(self, store: SignedStore, failure: Failure) -> None:
        """Record a failure, order the kill of failed ranks that may still run, fence a lost
        node's launcher, and queue it."""
        self.record.event("failure", **failure.to_record())
        console.warning(failure_line(failure))
        if failure.cause in (Cause.HEARTBEAT, Cause.ERROR, Cause.STALL, Cause.STRAGGLER, Cause.NODE, Cause.LATE):
            # a lost node's launcher kills its ranks if it ever comes back (fencing)
            ordered = set()
            if failure.launcher is not None:  # unless a launcher replaced it since (then that one is named there)
                store.compare_set(launcher_key(failure.node), failure.launcher, fenced(failure.launcher))
                ordered.add(failure.node)
            for rank in failure.ranks:
                pid = self.detector.pid_of(rank)
                if pid is not None:  # one that never registered is killed with its fenced launcher
                    node = self.detector.node_of(rank)
                    store.queue_push(kill_orders_key(node), KillOrder(rank, pid).to_json())
                    self._kill_orders[node] = self._kill_orders.get(node, 0) + 1
                    ordered.add(node)
            if ordered:
                self._ring(store, sorted(ordered))
        self._failures.put(failure)
