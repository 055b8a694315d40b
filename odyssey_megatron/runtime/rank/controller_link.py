"""A worker's tie to the controller: registration, heartbeats, failure reports, plans.

The heartbeat runs on a daemon thread with its own connection to its node's store (its
launcher's, on the loopback address: the launcher forwards every worker's last beat to
the controller in one node heartbeat, and relays back what the worker needs, a
``NodeView``), so it beats while the training thread computes or sits in a collective.
Each beat also looks in the view for the abort of the generation the worker runs and,
once there, calls ``on_abort`` (the worker's collective guard), which ends the training
thread's waits on that generation's groups even where no socket closes. The view carries
the controller's heartbeat too; when the launcher found the controller's store gone, or
that heartbeat stops changing for the collective timeout (``Timeouts.controller_silence``:
longer than a worker's, as the controller's process is busier), the controller is gone:
the thread calls ``on_controller_lost`` (the worker aborts its generation and saves what
it holds, which is committed state) and ends the process if the worker has not
reattached within the collective timeout plus ``Timeouts.controller_reattach_s``
(``os._exit``: the training thread may be blocked where no exception reaches it). It
beats on meanwhile: a worker that saved waits in that window (``reattach``) for its
launcher to find a restarted controller, then announces itself to it (``RankReattached``). A lost node leaves no orphans either: every beat checks that the
launcher still runs. (The kernel's parent-death signal, which the worker also asks for,
fires only when its parent, the launcher's fork server, exits; and that server waits for
its workers to close their copies of the pipe it watches for the launcher's end.)
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

from odyssey_megatron.runtime.protocol.auth import SignedStore, Signer, connect_signed
from odyssey_megatron.runtime.protocol.keys import (
    INBOX,
    NODE_VIEW,
    PUBLISHED_GENERATION,
    RUN_DONE,
    RUN_STOP,
    rank_heartbeat_key,
    reattach_verdict_key,
    successor_key,
)
from odyssey_megatron.runtime.protocol.launch import EXIT_CONTROLLER_LOST, WorkerLaunch
from odyssey_megatron.runtime.protocol.liveness import HeartbeatWatch, missed_beat
from odyssey_megatron.runtime.protocol.messages import (
    CollectiveStalled,
    Heartbeat,
    NodeView,
    ProtocolError,
    RankFailureReport,
    RankReattached,
    RankRegistration,
    ReattachVerdict,
)
from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished, read_plan
from odyssey_megatron.runtime.rank.op_timers import OpTimers

__all__ = ["ControllerLink"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a killed process its parent has not reaped yet (a zombie) does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def _die_with_parent(launcher_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent (the launcher's fork server)
    dies (Linux; elsewhere the heartbeat's check of the launcher ends it)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if not _alive(launcher_pid):  # the launcher died before the tie was made
        os._exit(EXIT_CONTROLLER_LOST)


class ControllerLink:
    """Construct in the worker process with what its launcher handed it; ``start`` once,
    before anything else talks to the controller."""

    launch: WorkerLaunch
    store: SignedStore
    """The worker's main connection (registration, reports, plans); waits up to the recovery timeout."""
    generation: Optional[int]
    """The plan generation the worker has entered, sent with every heartbeat (None while
    it starts up: the detector's start-up grace); set it once entered."""
    watching: Optional[int]
    """The plan generation the worker enters or runs; set it on adopting a plan."""
    on_controller_lost: Optional[Callable[[str], None]]
    """Called once (on the heartbeat thread) when the controller is gone; without it, or if
    the process still runs a collective timeout later, the process exits at once."""
    progress: Optional[OpTimers]
    """Where the worker is in its step (``OpTimers.position``), sent with every heartbeat
    and stall report once set."""
    on_abort: Optional[Callable[[int], None]]
    """Called with the generation (on the heartbeat thread) once the controller aborts
    ``watching``; the worker may have moved on to the next one meanwhile."""
    published_at_start: int
    """The newest generation published before the worker registered (-1: none): a joining
    worker watches from there, as no generation before it can name the worker."""

    def __init__(self, launch: WorkerLaunch):
        self.launch = launch
        self.generation = self.watching = None
        self.on_abort = None
        self.on_controller_lost = None
        self.progress = None
        self.published_at_start = -1
        self.signer = Signer(launch.secret)
        self.store = connect_signed(launch.store_host, launch.store_port, signer=self.signer,
                                    timeout=datetime.timedelta(seconds=launch.timeouts.recovery_timeout))
        self._beats: Optional[SignedStore] = None
        self._aborted: frozenset[int] = frozenset()
        """Generations the controller aborted, as the node's view last relayed them."""
        self._seq = 0
        self._lost_at: Optional[tuple[float, float]] = None
        """(monotonic, wall) time the controller was found lost, until a restarted one is
        reattached to."""
        self._view: Optional[NodeView] = None
        """The node's view as the heartbeat thread last read it."""
        self._thread = threading.Thread(target=self._beat_loop, name="odyssey-heartbeat", daemon=True)

    def _fresh_beats(self) -> SignedStore:
        """A connection of the heartbeat thread's own to the node's store, waiting at most a
        heartbeat timeout."""
        return connect_signed("127.0.0.1", self.launch.node_store_port, signer=self.signer,
                              timeout=datetime.timedelta(seconds=self.launch.timeouts.heartbeat_timeout))

    def start(self) -> None:
        """Tie to the launcher, register (after a first heartbeat, so its launcher forwards
        one) and start beating."""
        _die_with_parent(self.launch.launcher_pid)
        self._first_beat()
        if self.store.check([PUBLISHED_GENERATION]):
            self.published_at_start = int(self.store.get(PUBLISHED_GENERATION))
        self._register()
        self._thread.start()

    def _register(self, *, survivor: bool = False) -> None:
        self.store.queue_push(INBOX, RankRegistration(self.launch.rank, os.getpid(), socket.gethostname(),
                                                      self.launch.node, survivor).to_json())

    def reattach(self, *, epoch: int, generation: int, committed_step: Optional[int]) -> Optional[ReattachVerdict]:
        """After the controller's loss, the held blocks saved: wait (to the end of the
        window) for the launcher to relay a restarted controller's beat, connect to its
        store (same address, same secret), register again, announce where this worker
        stands, and wait for the restarted controller's verdict (it judges every survivor
        together: ``runtime.control.reattaching``). ``committed_step``: the steps its blocks
        hold; None where it holds none (idle). None where no controller came back in time,
        or none answered within the recovery timeout after the window."""
        lost_at, lost_wall = self._lost_at
        deadline = lost_at + self._window()
        while time.monotonic() < deadline:
            view = self._view
            if view is not None and view.controller_lost is None and view.controller_sent_at > lost_wall:
                try:
                    self.store = connect_signed(self.launch.store_host, self.launch.store_port, signer=self.signer,
                                                timeout=datetime.timedelta(seconds=self.launch.timeouts.recovery_timeout))
                    self._register(survivor=True)
                    self.store.queue_push(INBOX, RankReattached(self.launch.rank, os.getpid(), epoch, generation,
                                                                committed_step).to_json())
                except dist.DistError as exc:  # it went again: wait on while the window lasts
                    log.warning("rank %d: could not reattach: %s", self.launch.rank, str(exc).splitlines()[0])
                    time.sleep(self.launch.timeouts.poll_interval)
                    continue
                log.warning("rank %d: announced itself to the restarted controller (generation %d, %s)",
                            self.launch.rank, generation,
                            "idle" if committed_step is None else f"step {committed_step}")
                self._lost_at = None  # the restarted controller is watched from now on
                return self._verdict(wait_s=deadline - time.monotonic() + self.launch.timeouts.recovery_timeout)
            time.sleep(self.launch.timeouts.poll_interval)
        return None

    def _verdict(self, *, wait_s: float) -> Optional[ReattachVerdict]:
        """The restarted controller's verdict on this worker, waiting up to ``wait_s``
        (it waits for every survivor before it judges); None if it went again meanwhile."""
        key = reattach_verdict_key(self.launch.rank)
        deadline = time.monotonic() + wait_s
        try:
            while not self.store.check([key]):
                if time.monotonic() > deadline or self._lost_at is not None:
                    return None
                time.sleep(self.launch.timeouts.poll_interval)
            return ReattachVerdict.from_json(self.store.get(key))
        except dist.DistError:
            return None

    def _window(self) -> float:
        """From the controller's loss to this process's end, unless it reattached: the save's
        time (a collective timeout), then the reattach window."""
        return self.launch.timeouts.collective_timeout + self.launch.timeouts.controller_reattach_s

    def _first_beat(self) -> None:
        """Connect to the node's store and beat, trying again on a timeout for as long as a
        starting worker may stay silent (``initial_heartbeat_timeout``): on a node whose
        workers all import torch and Megatron at once, its launcher can answer a first
        connection or beat later than a heartbeat timeout, and a worker that gave up there
        died before it had a log, failing a healthy run's rank (CI saw exit status 1)."""
        deadline = time.monotonic() + self.launch.timeouts.initial_heartbeat_timeout
        while True:
            try:
                self._beats = self._fresh_beats()
                self._beat(self._beats)
                return
            except dist.DistError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(self.launch.timeouts.poll_interval)

    def report_failure(self, error: str) -> None:
        """Name this worker failed by an error of its own; its launcher then kills it. Not
        once its launcher is gone: the node is lost, and what the worker raised in the beat
        or so it outlives its launcher (a peer on the node died first, the node's store went
        with it) is that loss, which the controller names when the launcher's beats stop. A
        report would give the one failure a second cause (CI recorded "error,node")."""
        if not _alive(self.launch.launcher_pid):
            log.error("rank %d: its launcher (pid %d) is gone: not reporting %s", self.launch.rank,
                      self.launch.launcher_pid, error)
            return
        report = RankFailureReport(self.launch.rank, self.watching, error, time.time())
        self.store.queue_push(INBOX, report.to_json())

    def report_stall(self, generation: Optional[int], detail: str) -> None:
        """Tell the controller a collective of ``generation`` waited out the collective
        timeout with no abort: nothing else would end the generation."""
        step, ops_done = self._position()
        self.store.queue_push(INBOX, CollectiveStalled(self.launch.rank, generation, detail, time.time(), step,
                                                       ops_done).to_json())

    def aborted(self, generation: int) -> bool:
        """Whether the controller aborted ``generation`` (the worker watches it), as the
        heartbeat thread last heard from the launcher: no request to the controller's store."""
        return generation in self._aborted

    def next_after(self, generation: int) -> PlanPublished | str:
        """What follows ``generation``, once the controller set it (waiting up to the
        recovery timeout): the next plan with this worker's op list (``read_plan``: none
        where the plan has the worker idle), or ``RUN_STOP`` or ``RUN_DONE``; a plan
        carrying an older generation is refused (StaleGenerationError)."""
        following = self.store.get(successor_key(generation))  # a get waits for its key
        if following in (RUN_STOP.encode(), RUN_DONE.encode()):
            return following.decode()
        return read_plan(self.store, following, rank=self.launch.rank, current_generation=generation)

    def wait_plan(self, *, newer_than: int) -> PlanPublished:
        """``next_after(newer_than)``, which must be a plan."""
        following = self.next_after(newer_than)
        if isinstance(following, str):
            raise ProtocolError(f"expected plan generation {newer_than + 1}; the run ended ({following})")
        return following

    def _position(self) -> tuple[Optional[int], Optional[int]]:
        """(step, ops done) where the worker trains, else (None, None)."""
        position = self.progress.position if self.progress is not None else None
        return position if position is not None else (None, None)

    def _beat(self, store: SignedStore) -> None:
        beat = Heartbeat(self._seq, time.time(), self.generation, self.watching, os.getpid(), *self._position())
        store.set(rank_heartbeat_key(self.launch.rank), beat.to_json())
        self._seq += 1

    def _beat_loop(self) -> None:
        timeouts = self.launch.timeouts
        controller = HeartbeatWatch(timeouts.controller_silence, time.monotonic())
        next_beat = time.monotonic() + timeouts.heartbeat_interval
        aborted: Optional[int] = None
        while True:  # until the process ends; a clean exit is reported by the launcher
            time.sleep(max(0.0, next_beat - time.monotonic()))
            next_beat = max(next_beat + timeouts.heartbeat_interval, time.monotonic())
            try:
                self._beat(self._beats)
                view = self._view = NodeView.from_json(self._beats.get(NODE_VIEW))
                if self._lost_at is None and view.controller_lost is not None:
                    self._controller_lost(f"its launcher lost it: {view.controller_lost}")
                if self._lost_at is not None:  # watched afresh once a restarted controller is reattached to
                    controller = HeartbeatWatch(timeouts.controller_silence, time.monotonic())
                controller.see(view.controller_beat(), time.monotonic())
                self._aborted = frozenset(view.aborted)
                generation = self.watching
                if generation is not None and generation != aborted and generation in view.aborted:
                    aborted = generation
                    if self.on_abort is not None:
                        self.on_abort(generation)
            except (dist.DistError, ProtocolError) as exc:
                if not _alive(self.launch.launcher_pid):
                    self._exit(f"its launcher (pid {self.launch.launcher_pid}) is gone")
                if not missed_beat(exc):
                    self._controller_lost(f"its node's store unreachable: {str(exc).splitlines()[0]}")
                try:
                    self._beats = self._fresh_beats()  # a late answer must not be read as the next one's
                except dist.DistError as lost:
                    self._controller_lost(f"its node's store unreachable: {str(lost).splitlines()[0]}")
            if self._lost_at is None and controller.stale(time.monotonic()):
                self._controller_lost(f"no controller heartbeat for over {timeouts.controller_silence} s")
            if self._lost_at is not None and time.monotonic() > self._lost_at[0] + self._window():
                self._exit("no controller reattached to within the collective timeout and "
                           "its reattach window")
            if not _alive(self.launch.launcher_pid):
                self._exit(f"its launcher (pid {self.launch.launcher_pid}) is gone")

    def _controller_lost(self, why: str) -> None:
        """Hand the loss to the worker, once per loss: it saves, then waits the reattach
        window (``reattach``); the heartbeat loop ends the process past the window."""
        if self._lost_at is not None:
            return
        if self.on_controller_lost is None:
            self._exit(f"controller lost ({why})")
        log.error("rank %d: controller lost (%s); saving what this rank holds", self.launch.rank, why)
        self._lost_at = (time.monotonic(), time.time())
        self.on_controller_lost(why)

    def _exit(self, why: str) -> None:
        log.error("rank %d: %s; exiting", self.launch.rank, why)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_CONTROLLER_LOST)
