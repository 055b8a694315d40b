"""A node's tie to the controller's store (``NodeTie``): the one thread that talks to it
for the whole node, so that store's load grows with nodes, not ranks.

Once per heartbeat interval it writes the node's heartbeat carrying each worker's last
beat from the node's own store (``NodeHeartbeat``: the node's silence is how the
controller learns the node is lost, a worker's stale entry that the worker hangs) with
``compare_set`` against its previous one, which tells it whether anyone wrote there
since: the controller's ``DOORBELL``, or a launcher that replaced this one. Then, or
every heartbeat timeout, it reads the controller's heartbeat with the node's launcher key
in one request; that heartbeat names the generations lately aborted and counts the node's
kill orders, so only a new order costs a further read. It relays to the workers what
they need back (``NodeView``). What it found is for the launcher's main thread
(``runtime.control.launcher``): the controller lost or silent, who launches the node, a
fence lifted, kill orders.
"""

from __future__ import annotations

import collections
import datetime
import logging
import math
import threading
import time
from typing import Optional

import torch.distributed as dist

from odyssey_megatron.runtime.protocol.auth import ForgedValue, SignedStore
from odyssey_megatron.runtime.protocol.keys import (
    CONTROLLER_HEARTBEAT,
    NODE_VIEW,
    fenced,
    kill_orders_key,
    launcher_key,
    node_heartbeat_key,
    rank_heartbeat_key,
)
from odyssey_megatron.runtime.protocol.liveness import HeartbeatWatch, missed_beat
from odyssey_megatron.runtime.protocol.messages import (
    ControllerHeartbeat,
    Heartbeat,
    KillOrder,
    NodeHeartbeat,
    NodeView,
    ProtocolError,
)
from odyssey_megatron.timeouts import Timeouts

__all__ = ["NodeTie"]

log = logging.getLogger(__name__)


class NodeTie:
    """The heartbeat thread of node ``node`` (workers ``ranks``), for the launcher named
    ``name``; ``attach`` ties it to a controller's store (again, after a restart)."""

    def __init__(self, *, node: int, ranks: range, name: str, timeouts: Timeouts):
        self.node, self.ranks, self.name, self.timeouts = node, ranks, name, timeouts
        self._seq = 0
        self._beating = threading.Event()
        """Set when the heartbeat thread must stop."""
        self._beater: threading.Thread | None = None
        self.aborted: set[int] = set()
        """Generations the controller aborted, as its heartbeats named them."""
        self.kill_orders: collections.deque[KillOrder] = collections.deque()
        self.fenced = threading.Event()
        """Set when the controller failed this node while this launcher lives: it registers again."""
        self._forget_controller()

    def _forget_controller(self) -> None:
        """What this tie knows of a controller, as before its first beat to one."""
        self._last_beat = b""
        """The node heartbeat written last (``compare_set`` expects it there)."""
        self._next_read = -math.inf
        """Monotonic time by which the controller's heartbeat is read again, unless rung first."""
        self._kill_orders_seen = 0
        """Kill orders for the node the controller's heartbeat counted when the queue was last read."""
        self.controller = HeartbeatWatch(self.timeouts.controller_silence, time.monotonic())
        self.controller_lost: Optional[str] = None
        """Why the thread found the controller's store gone (None while it answers)."""
        self.launching: Optional[str] = None
        """Who the node's launcher key names now."""

    def attach(self, store: SignedStore, node_store: SignedStore) -> None:
        """Name this launcher under the node's launcher key, beat once (the node's first
        beat and view, before any worker reads them) and beat on from a thread of its own,
        so the node lives on while the main thread starts workers."""
        self._forget_controller()
        store.set(launcher_key(self.node), self.name)
        self.launching = self.name
        beats = store.clone()
        beats.set_timeout(datetime.timedelta(seconds=self.timeouts.heartbeat_timeout))
        node_store = node_store.clone()
        self.beat(beats, node_store)
        self.start(beats, node_store)

    def start(self, store: SignedStore, node_store: SignedStore) -> None:
        """Beat from a thread of its own until ``stop``."""
        def beat_loop() -> None:
            nonlocal store
            while not self._beating.wait(self.timeouts.heartbeat_interval):
                try:
                    self.beat(store, node_store)
                except (dist.DistError, ProtocolError) as exc:
                    if not missed_beat(exc):
                        self.controller_lost = f"store unreachable: {str(exc).splitlines()[0]}"
                        return
                    store = store.clone()  # a late answer must not be read as the next request's
                    store.set_timeout(datetime.timedelta(seconds=self.timeouts.heartbeat_timeout))

        self._beating = threading.Event()
        self._beater = threading.Thread(target=beat_loop, name="odyssey-node-heartbeat", daemon=True)
        self._beater.start()

    def stop(self) -> None:
        """Stop and join the heartbeat thread: a daemon thread inside a store call when the
        interpreter exits aborts the process (C++ terminate) instead of exiting with its status."""
        self._beating.set()
        if self._beater is not None:
            self._beater.join()

    def beat(self, store: SignedStore, node_store: SignedStore) -> None:
        """One heartbeat interval with the controller's store, for the whole node: forward
        the workers' beats; if rung (or due), read what concerns the node; relay it back."""
        workers = _worker_beats(node_store, self.ranks, node=self.node)
        beat = NodeHeartbeat(
            self._seq, time.time(), seqs={str(r): b.seq for r, b in workers.items()},
            generations={str(r): b.generation for r, b in workers.items() if b.generation is not None},
            pids={str(r): b.pid for r, b in workers.items() if b.pid is not None},
            steps={str(r): b.step for r, b in workers.items() if b.position() is not None},
            ops_done={str(r): b.ops_done for r, b in workers.items() if b.position() is not None}).to_json().encode()
        self._seq += 1
        rung = store.compare_set(node_heartbeat_key(self.node), self._last_beat, beat) != beat
        if rung:  # the doorbell (or another launcher's beat, or a forged value) is there: beat over it, then read
            store.set(node_heartbeat_key(self.node), beat)
        self._last_beat = beat
        now = time.monotonic()
        if rung or now >= self._next_read:
            self._next_read = now + self.timeouts.heartbeat_timeout
            self._read_controller(store)
        self.relay(node_store)

    def _read_controller(self, store: SignedStore) -> None:
        """Read the controller's heartbeat and the node's launcher key; take the node's kill
        orders if the heartbeat counts new ones."""
        controller, launching = store.multi_get([CONTROLLER_HEARTBEAT, launcher_key(self.node)])
        if launching is not None:  # else forged (refused, logged): who launches the node is as last read
            self.launching = launching.decode()
        if controller is None:
            return  # forged (refused, logged): the controller's next beat is read when due
        controller = ControllerHeartbeat.from_json(controller)
        self.controller.see(controller, time.monotonic())
        if self.launching == fenced(self.name):  # take the node's name back first: it is fenced once
            now_there = store.compare_set(launcher_key(self.node), self.launching, self.name)
            self.launching = None if now_there is None else now_there.decode()
            if self.launching == self.name:
                self.fenced.set()
        self.aborted.update(controller.aborted)
        queued = controller.kill_orders.get(str(self.node), 0)
        if queued > self._kill_orders_seen:  # new orders: take the whole queue
            orders = kill_orders_key(self.node)
            for _ in range(store.queue_len(orders)):
                try:
                    self.kill_orders.append(KillOrder.from_json(store.queue_pop(orders, block=False)))
                except ForgedValue:
                    continue  # refused (logged once): no process is killed on it
            self._kill_orders_seen = queued

    def relay(self, node_store: SignedStore, *, controller_lost: Optional[str] = None) -> None:
        """Tell the node's workers what the controller's store said last (``NodeView``)."""
        beat = self.controller.last or Heartbeat(-1, 0.0)
        view = NodeView(beat.seq, beat.sent_at, tuple(sorted(self.aborted)), controller_lost=controller_lost)
        node_store.set(NODE_VIEW, view.to_json())


def _worker_beats(node_store: SignedStore, ranks: range, *, node: int) -> dict[int, Heartbeat]:
    """Each of the node's workers' last beat in the node's store (those that beat yet)."""
    keys = {rank: rank_heartbeat_key(rank) for rank in ranks}
    present = {rank: key for rank, key in keys.items() if node_store.exists([key])}
    beats = {}
    for rank, raw in zip(present, node_store.multi_get(list(present.values())) if present else []):
        if raw is None:
            continue  # forged (refused, logged): that worker's entry waits for its next beat
        try:
            beats[rank] = Heartbeat.from_json(raw)
        except ProtocolError as exc:  # not the controller's fault: that worker's entry waits
            log.warning("node %d: malformed heartbeat of rank %d: %s", node, rank, exc)
    return beats
