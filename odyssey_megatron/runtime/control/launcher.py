"""The node launcher: starts this node's worker processes and reports on them; unlike
torchrun it never kills survivors when one dies, and a worker that died while its node
lives on is started again only where ``odyssey.restart_workers`` allows, as a joiner:
the run goes on meanwhile and takes it back when the controller decides to
(``WorkerLaunch.joining``).

A launcher started with the same ``--node-rank`` while the run goes on (the node repaired,
or a replacement host) finds the node's launcher key set: its workers join too. It writes
its own name there, and a launcher that finds another's name in it has been replaced (a
frozen node that came back): it kills its workers and exits, so no rank runs twice. One
that finds its own name fenced there (``keys.fenced``) lives on while the controller
failed its node as silent (the node stalled, or so it seemed to the controller, say
while this launcher started under load): it kills its workers too, which ran in a
generation the run has left, then registers the node again and starts them afresh as
joiners, to be judged afresh and taken back.

A launcher of ``odyssey train`` starts its workers once node 0 has published the run's spec
(``on_run_spec``): node 0 opens the store before it prepares the data, and the launcher
waits, registered and beating, for as long as the controller beats.

It waits on the workers' process sentinels, so an exit is seen at once and reported to the
controller's inbox. It serves its node's own store on the loopback address, where its
workers beat, and one thread talks to the controller's store for the whole node
(``runtime.control.node_tie``): the node's heartbeat, the controller's, the node's kill
orders (its ranks, hung or failed: a failed worker never comes back into a collective)
and the view relayed to the workers (``NodeView``). When the controller's heartbeat stops, or its store is
gone, the launcher tells its workers, which save what they hold
(``runtime.rank.controller_link``). Then, for the collective timeout plus
``Timeouts.controller_reattach_s``, it keeps them and the node's keeper (the in-memory
snapshots) and looks for a controller restarted at the same address: found, it takes the
node's launcher key, registers the node again and beats to it, and its workers reattach
(``RankReattached``); where all of them are refused, it exits once they have
(``EXIT_CONTROLLER_LOST``: the run resumes from disk, and the node's command must be
started again). Where one is taken back, the workers that gave up on the lost controller
meanwhile (their blocks at different steps, or their own wait over) start again as
joiners. Past the window, it kills the workers left and exits. Its
workers die with it when it is killed (see ``runtime.rank.controller_link``), so a lost
node leaves no orphans either.

Workers start from multiprocessing's fork server, which imports the worker's module (torch,
Megatron-Core: seconds of CPU each) once and forks every worker from it, instead of each
worker importing it again on cores the others share. The fork server is a fresh process
of its own (no threads of the launcher's are copied); when the launcher dies its workers
see it within a heartbeat interval and exit (``runtime.rank.controller_link``), and the
fork server with them.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from odyssey_megatron.runtime.control.detector import describe_exit
from odyssey_megatron.runtime.control.fork_server import start_fork_server
from odyssey_megatron.runtime.control.launch_config import LaunchConfig
from odyssey_megatron.runtime.control.node_tie import NodeTie
from odyssey_megatron.runtime.control.store_server import StoreServer
from odyssey_megatron.runtime.protocol.auth import SignedStore, Signer, connect_signed
from odyssey_megatron.runtime.protocol.keys import (
    CONTROLLER_HEARTBEAT,
    INBOX,
    RUN_DONE,
    RUN_SPEC,
    RUN_STOP,
    fenced,
    launcher_key,
    launcher_name,
    reattach_verdict_key,
)
from odyssey_megatron.runtime.protocol.launch import EXIT_CONTROLLER_LOST, EXIT_REPLACED, WorkerLaunch
from odyssey_megatron.runtime.protocol.messages import (
    ControllerHeartbeat,
    KillOrder,
    NodeLeft,
    NodeRegistration,
    ProtocolError,
    RankExit,
    ReattachVerdict,
    StopRequested,
)
from odyssey_megatron.snapshot.keeper import NodeKeeper
from odyssey_megatron.timeouts import Timeouts

__all__ = ["NodeLauncher"]

log = logging.getLogger(__name__)


class _ControllerLost(Exception):
    pass


class _Replaced(Exception):
    """Another launcher took this node's place."""


class NodeLauncher:
    """One node's launcher; ``run`` returns its exit status: 0 once every worker has
    exited, ``EXIT_CONTROLLER_LOST`` if the controller went away first."""

    config: LaunchConfig
    timeouts: Timeouts
    target: Callable[[WorkerLaunch], None]
    """The worker's main function, importable by name (spawn pickles it by reference)."""

    def __init__(self, config: LaunchConfig, *, timeouts: Timeouts, target: Callable[[WorkerLaunch], None],
                 secret: bytes, restart_workers: int = 0, on_run_spec: Optional[Callable[[bytes], None]] = None,
                 joining: bool = False, preload: Sequence[str] = ()):
        """``preload``: what the fork server imports for the workers beside ``target``'s own
        module (``odyssey train``: ``fork_server.WORKER_PRELOAD``; a test's idle workers
        need nothing more). ``joining``: the run is under way (node 0 of a run a restarted
        controller goes on with from its survivors' memory); a launcher that finds the
        node's launcher key taken knows it by itself."""
        self.config, self.timeouts, self.target = config, timeouts, target
        self._secret = secret  # the run's (``protocol.auth``): for every store value, and for its workers
        self._signer = Signer(secret)
        self.on_run_spec = on_run_spec
        """Given the run's spec (``RUN_SPEC``) before the workers, which read it, start: the
        launcher waits for it, registered and beating, for as long as the controller beats
        (node 0 opens the store before it prepares the data, which may take minutes). None:
        the workers start at once."""
        self.restart_workers = restart_workers
        """Times each rank's worker may be started again after it died (``odyssey.restart_workers``)."""
        self._restarts: dict[int, int] = {}
        self._name = launcher_name(socket.gethostname(), os.getpid())
        """What this launcher writes under the node's launcher key."""
        self._joining = joining
        """The run was under way when this launcher started: its workers join it."""
        self._preload = (getattr(target, "func", target).__module__, *preload)  # a partial's: its function's
        self._reattached = False
        """It reattached to a restarted controller (``runtime.control.reattaching``)."""
        self._refused: list[int] = []
        """Ranks of this node that exited 0 after the reattach while the run went on: the
        restarted controller refused them."""
        self._gave_up: set[int] = set()
        """Ranks of this node whose worker exited for the lost controller
        (``EXIT_CONTROLLER_LOST``: its blocks at different steps, or its own wait over) while
        this launcher outlived it: started again as joiners once the restarted controller
        takes the node's other workers back (``_start_the_gave_up_again``)."""
        self._context = None
        self._workers: dict[int, multiprocessing.Process] = {}
        self._node_store = StoreServer("127.0.0.1", 0, timeout=timeouts.heartbeat_timeout)
        """The node's store, where its workers beat and read the ``NodeView``."""
        self._node_client = SignedStore(self._node_store.store, self._signer)
        self._tie = NodeTie(node=config.node_rank, ranks=config.ranks, name=self._name, timeouts=timeouts)
        """The heartbeat thread: what it finds in the controller's store is for the main thread."""
        self._stop_signal: str | None = None
        """A stop signal this node's main process received, until sent to the controller."""
        self._keeper = NodeKeeper(len(config.ranks))
        """The node's snapshot memory: it lives as long as this process (``snapshot.keeper``)."""
        self._keeper_paths = tuple((*slot.data, *slot.parity) for slot in self._keeper.paths)

    def run(self) -> int:
        node = self.config.node_rank
        try:
            # A launcher may start before node 0's controller: wait for it up to the recovery timeout.
            store = connect_signed(self.config.master_addr, self.config.master_port, signer=self._signer,
                                   timeout=datetime.timedelta(seconds=self.timeouts.recovery_timeout))
            store.set_timeout(datetime.timedelta(seconds=self.timeouts.heartbeat_timeout))
            self._joining = self._joining or store.check([launcher_key(node)])
            self._tie.attach(store, self._node_client)
            self._register(store)
            if self.on_run_spec is not None:
                self.on_run_spec(self._wait_for_run_spec(store))
            self._start_workers()
            while True:
                try:
                    self._watch(store)
                    break
                except (dist.DistError, ProtocolError, _ControllerLost) as exc:
                    store = self._reattach(str(exc).splitlines()[0])
                    if store is None:
                        return EXIT_CONTROLLER_LOST
        except _Replaced as exc:
            log.error("node %d: %s; killing its workers", node, exc)
            return EXIT_REPLACED
        except (dist.DistError, ProtocolError, _ControllerLost) as exc:
            why = str(exc).splitlines()[0]
            log.error("node %d: lost the controller (%s); its workers save what they hold, then exit", node, why)
            self._tie.stop()
            self._tie.relay(self._node_client, controller_lost=why)  # at once: they save what they hold
            self._let_workers_exit(within=self.timeouts.collective_timeout)
            return EXIT_CONTROLLER_LOST
        finally:
            self._kill_all()
            self._tie.stop()
            self._keeper.close()
        store.queue_push(INBOX, NodeLeft(node, time.time()).to_json())
        if self._refused and not store.check([RUN_DONE]):
            self._give_up_the_node(store)
            log.error("node %d: the restarted controller refused its workers (their blocks are saved) and resumes "
                      "from disk: start this node's command again to take part", node)
            return EXIT_CONTROLLER_LOST
        log.info("node %d: all workers exited", node)
        return 0

    def _reattach(self, why: str) -> Optional[SignedStore]:
        """The controller is lost while the workers run: they save what they hold; wait the
        window for a restarted controller's store at the same address, and once it beats,
        take the node's launcher key, beat and register the node again there. The store,
        or None past the window (the workers left are killed on the way out)."""
        node, timeouts = self.config.node_rank, self.timeouts
        log.error("node %d: lost the controller (%s); its workers save what they hold, %s", node, why,
                  f"then wait up to {timeouts.controller_reattach_s:g} s for a restarted controller"
                  if timeouts.controller_reattach_s > 0 else "then exit")
        self._tie.stop()
        self._tie.relay(self._node_client, controller_lost=why)  # at once: they save what they hold
        lost_wall = time.time()
        deadline = time.monotonic() + timeouts.collective_timeout + timeouts.controller_reattach_s
        while self._workers and time.monotonic() < deadline:
            store = _restarted_store(self.config, self._signer, timeouts, lost_wall) \
                if timeouts.controller_reattach_s > 0 else None
            if store is not None:
                break
            self._reap_exited(timeout=timeouts.heartbeat_interval)
        else:
            return None
        self._tie.attach(store, self._node_client)  # relays the restarted controller's beat: the workers reattach
        self._register(store)
        self._reattached = True
        log.warning("node %d: reattached to the restarted controller", node)
        return store

    def _give_up_the_node(self, store: SignedStore) -> None:
        """Leaving a run that resumes from disk without this launcher's workers: free the
        node's launcher key, so that the node's command started again finds the node free
        and starts its workers into the resumed run's first generation, not as joiners of a
        run under way (which that generation would wait for in vain)."""
        key = launcher_key(self.config.node_rank)
        if store.check([key]) and store.multi_get([key]) == [self._name.encode()]:
            store.delete_key(key)

    def request_stop(self, signal_name: str) -> None:
        """Ask the controller to stop the run (from the main thread's signal handler; the
        watch loop sends it)."""
        self._stop_signal = signal_name

    def _register(self, store: SignedStore) -> None:
        store.queue_push(INBOX, NodeRegistration(self.config.node_rank, os.getpid(), socket.gethostname(),
                                                 tuple(self.config.ranks)).to_json())

    def _start_workers(self) -> None:
        self._context = start_fork_server(self._preload)
        for local_rank, rank in enumerate(self.config.ranks):
            self._start_worker(local_rank, rank, joining=self._joining)

    def _start_worker(self, local_rank: int, rank: int, *, joining: bool) -> None:
        launch = WorkerLaunch(rank=rank, local_rank=local_rank, node=self.config.node_rank,
                              world_size=self.config.world_size, store_host=self.config.master_addr,
                              store_port=self.config.master_port, node_store_port=self._node_store.port,
                              node_ranks=tuple(self.config.ranks), launcher_pid=os.getpid(),
                              timeouts=self.timeouts, secret=self._secret, keeper=self._keeper_paths,
                              joining=joining)
        process = self._context.Process(target=self.target, args=(launch,), name=f"odyssey-rank{rank}")
        process.start()
        self._workers[rank] = process
        log.info("node %d: %s rank %d (pid %d)", self.config.node_rank, "started joining" if joining else "started",
                 rank, process.pid)

    def _watch(self, store: SignedStore) -> None:
        """Until every worker has exited: report exits at once, and act on what the heartbeat
        thread found in the controller's store."""
        next_poll = time.monotonic()
        while self._workers:
            by_sentinel = {p.sentinel: rank for rank, p in self._workers.items()}
            ready = multiprocessing.connection.wait(list(by_sentinel), timeout=max(0.0, next_poll - time.monotonic()))
            for sentinel in ready:
                self._reap(store, by_sentinel[sentinel])
            now = time.monotonic()
            if now < next_poll:
                continue
            next_poll = max(next_poll + self.timeouts.poll_interval, now)
            self._check_controller(now)
            if self._tie.launching not in (None, self._name, fenced(self._name)):
                raise _Replaced(f"replaced by launcher {self._tie.launching}")
            if self._tie.fenced.is_set():
                self._tie.fenced.clear()
                self._register_again(store)
            if self._stop_signal is not None:
                store.queue_push(INBOX, StopRequested(self.config.node_rank, self._stop_signal, time.time()).to_json())
                self._stop_signal = None
            while self._tie.kill_orders:
                self._kill(self._tie.kill_orders.popleft())
            if self._reattached and self._gave_up:
                self._start_the_gave_up_again(store)

    def _check_controller(self, now: float) -> None:
        """_ControllerLost if the heartbeat thread found the controller gone or silent."""
        if self._tie.controller_lost is not None:
            raise _ControllerLost(self._tie.controller_lost)
        if self._tie.controller.stale(now):
            raise _ControllerLost(f"no controller heartbeat for over {self.timeouts.controller_silence} s")

    def _wait_for_run_spec(self, store: SignedStore) -> bytes:
        """The run's spec, once node 0 has published it; however long that takes while the
        controller beats."""
        while not store.check([RUN_SPEC]):
            self._check_controller(time.monotonic())
            time.sleep(self.timeouts.poll_interval)
        return store.get(RUN_SPEC)

    def _register_again(self, store: SignedStore) -> None:
        """The controller failed this node as silent, and this launcher lives: kill every
        worker (their exits reach the controller before the registration does), register the
        node again and start its workers afresh as joiners, unless the run is ending."""
        node = self.config.node_rank
        log.warning("node %d: the controller failed this node as silent; killing its workers and registering the "
                    "node again", node)
        for process in self._workers.values():
            process.kill()
        for rank in list(self._workers):
            self._reap(store, rank, restart=False)
        if store.check([RUN_DONE]) or store.check([RUN_STOP]):
            return
        self._joining = True
        self._register(store)
        self._start_workers()

    def _reap(self, store: SignedStore, rank: int, *, restart: bool = True) -> None:
        process = self._workers.pop(rank)
        process.join()
        exited_at = time.time()
        if self._reattached and process.exitcode == 0 and not store.check([RUN_DONE]) and not store.check([RUN_STOP]):
            self._refused.append(rank)
        store.queue_push(INBOX, RankExit(rank, self.config.node_rank, process.exitcode, exited_at).to_json())
        # INFO: a failed rank's exit reaches the terminal as the controller's failure line.
        log.info("node %d: rank %d (pid %d) exited: %s", self.config.node_rank, rank, process.pid,
                 describe_exit(process.exitcode))
        if self._reattached and process.exitcode == EXIT_CONTROLLER_LOST:
            self._gave_up.add(rank)  # its wait for the verdict ran out
        elif restart and self._restartable(store, rank, process.exitcode):
            self._restarts[rank] = self._restarts.get(rank, 0) + 1
            self._start_worker(self.config.ranks.index(rank), rank, joining=True)

    def _start_the_gave_up_again(self, store: SignedStore) -> None:
        """Once the restarted controller has taken one of this node's workers back (the run
        goes on from memory), start the ranks that gave up on the lost controller again, as
        joiners: the run takes them back as any returning worker. Not while it judges, nor
        where it refuses them all: the run then resumes from disk, and the node's command is
        started again."""
        if store.check([RUN_DONE]) or store.check([RUN_STOP]):
            return
        if not any(store.check([reattach_verdict_key(r)])
                   and ReattachVerdict.from_json(store.get(reattach_verdict_key(r))).accepted for r in self._workers):
            return
        for rank in sorted(self._gave_up - set(self._workers)):  # not one started afresh since (fenced)
            log.warning("node %d: rank %d gave up on the lost controller; starting it again to join the run the "
                        "restarted one took back", self.config.node_rank, rank)
            self._start_worker(self.config.ranks.index(rank), rank, joining=True)
        self._gave_up.clear()

    def _restartable(self, store: SignedStore, rank: int, exitcode: int) -> bool:
        """Whether a worker that exited with ``exitcode`` starts again: it died (not a clean
        exit, nor one for a lost controller), restarts are left, and the run goes on."""
        return (exitcode not in (0, EXIT_CONTROLLER_LOST) and self._restarts.get(rank, 0) < self.restart_workers
                and not store.check([RUN_DONE]) and not store.check([RUN_STOP]))

    def _kill(self, order: KillOrder) -> None:
        process = self._workers.get(order.rank)
        if process is not None and process.pid == order.pid:  # not a worker restarted since
            log.info("node %d: killing rank %d (pid %d) on the controller's order", self.config.node_rank,
                     order.rank, process.pid)
            process.kill()

    def _let_workers_exit(self, *, within: float) -> None:
        """Wait up to ``within`` seconds for every worker to exit by itself (the rest are
        killed after): workers that lost the controller save their blocks first."""
        deadline = time.monotonic() + within
        while self._workers and time.monotonic() < deadline:
            self._reap_exited(timeout=deadline - time.monotonic())

    def _reap_exited(self, *, timeout: float) -> None:
        """Forget the workers that exit within ``timeout`` seconds (no controller to tell)."""
        by_sentinel = {p.sentinel: rank for rank, p in self._workers.items()}
        for sentinel in multiprocessing.connection.wait(list(by_sentinel), timeout=max(0.0, timeout)):
            rank = by_sentinel[sentinel]
            process = self._workers.pop(rank)
            process.join()
            if process.exitcode == EXIT_CONTROLLER_LOST:
                self._gave_up.add(rank)

    def _kill_all(self) -> None:
        for process in self._workers.values():
            process.kill()
        for process in self._workers.values():
            process.join()
        self._workers.clear()


def _restarted_store(config: LaunchConfig, signer: Signer, timeouts: Timeouts,
                     lost_wall: float) -> Optional[SignedStore]:
    """The restarted controller's store at the lost one's address, once it beats there (a
    beat sent after the loss at ``lost_wall``); else None."""
    try:
        store = connect_signed(config.master_addr, config.master_port, signer=signer,
                               timeout=datetime.timedelta(seconds=timeouts.heartbeat_timeout))
        store.set_timeout(datetime.timedelta(seconds=timeouts.heartbeat_timeout))
        if not store.check([CONTROLLER_HEARTBEAT]):
            return None
        beat = store.get(CONTROLLER_HEARTBEAT)
    except (dist.DistError, ProtocolError):
        return None
    if beat is None or ControllerHeartbeat.from_json(beat).sent_at <= lost_wall:
        return None  # forged (refused, logged), or the lost controller's last beat
    return store
