"""The fault detector's judgement, apart from any store or process: which ranks failed,
seen how, and when.

The controller feeds it what arrives (registrations, exits, failure reports, departures,
heartbeats) with its own clocks and turns its verdicts into records and kill orders; being
plain Python, every rule is unit-tested with made-up times. Ranks fail four ways:

- **exit**: its launcher saw the process end (a clean exit, status 0, is no failure);
- **error**: the worker reported an error of its own and can not go on;
- **heartbeat**: its heartbeats stopped while its launcher lived on: hung (SIGSTOP, a
  deadlock holding the GIL); its launcher kills it. Until a worker has entered its first
  plan generation (its beats carry none) it gets the longer initial timeout: starting up
  on a busy node may starve its heartbeat thread;
- **stall**: a collective waited out the collective timeout with every heartbeat alive (a
  rank hung with its heartbeat thread alive, a rank that slow, a data-plane fault): the
  rank the waiting one waited for, as the generation's heartbeats place them
  (``blame.WaitGraph``), is taken out like a hung rank, so the run goes on; the waiting
  rank only where the positions show it waited for nobody;
- **straggler**: it beats and computes, but slower than its peers for long
  (``stragglers``), and ``odyssey.straggler`` is remove: it is taken out like a hung rank;
- **node**: the launcher stopped beating: the node is lost with every rank on it. Not
  node 0's launcher where it runs in the controller's own process: the controller's
  threads (the decision center planning in Python beside them) delay its beats under
  load, and that process cannot be lost without the controller; its workers' exits and
  heartbeats are judged as anywhere else.

A node starts like a rank: until every rank its launcher announced has registered (its
launcher has imported, started the fork server and forked them all: on a replacement
node, under the load of a run in progress or from a slow shared filesystem, this is when
its beats come late) its launcher gets the initial timeout too.

The controller's own lateness is no one's silence: it tells the detector each time it
looked at the heartbeats (``looked``), and a look that comes late (its process stopped,
a GC pause, swap, its polling thread held) measures every silence from itself, not from
before the controller's stall (``protocol.liveness.Looks``).

A node's launcher that registers again (a replacement node, the same one restarted, or a
launcher whose node was failed while it lived on) replaces the node and is judged afresh:
if the old one still counted as alive, its ranks fail as one node failure first, so what
the old launcher ran is never confused with what the new one starts. A rank that
registers again after it failed or exited (its launcher restarted it) is alive again:
capacity that the controller may take back (``alive_ranks``); but not on a failed node,
whose launcher nobody watches: its ranks are alive again once it registers again.

A rank's beats reach the controller inside its launcher's (``NodeHeartbeat``: one store
key per node, however many ranks it runs), as the launcher last read them from its node's
store. They stop together when a node dies, and the rank's may stop changing a beat
earlier. So a silent rank counts as hung only once its launcher has beaten after the
rank's deadline; until then the node may still turn out lost, and then all its ranks fail
as one node failure.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Optional

from odyssey_megatron.runtime.control.blame import Position, WaitGraph
from odyssey_megatron.runtime.protocol.keys import launcher_name, node_heartbeat_key
from odyssey_megatron.runtime.protocol.liveness import HeartbeatWatch, Looks
from odyssey_megatron.runtime.protocol.messages import (
    CollectiveStalled,
    NodeHeartbeat,
    NodeLeft,
    NodeRegistration,
    RankExit,
    RankFailureReport,
    RankRegistration,
    StragglerRemoved,
)

__all__ = ["Cause", "Detector", "Failure", "describe_exit"]


class Cause(str, Enum):
    EXIT = "exit"
    ERROR = "error"
    HEARTBEAT = "heartbeat"
    STALL = "stall"
    STRAGGLER = "straggler"
    NODE = "node"
    LATE = "late"
    """Beating, but not in the generation every other rank entered within the recovery timeout."""


@dataclass(frozen=True)
class Failure:
    """Ranks that failed together, seen one way; times are wall-clock seconds."""

    cause: Cause
    ranks: tuple[int, ...]
    node: Optional[int]
    """The lost node (cause ``node``) as launched (``--node-rank``: for records and the
    console), else None. The decision center takes ranks, never this number: its nodes
    are counted from the first with workers (``cluster``)."""
    failed_at: float
    """Best estimate of the failure: the exit as its launcher saw it, the report, or the
    last heartbeat sent (the sender's clock)."""
    detected_at: float
    detail: str
    node_ranks: tuple[int, ...] = ()
    """Cause ``node``: every rank the node ran, ``ranks`` and those that failed or exited
    before it; their snapshot keeper slots went with its launcher. Else empty."""
    launcher: Optional[str] = None
    """Cause ``node``: the lost launcher's name (``keys.launcher_name``), which the
    controller fences. Else None."""

    def to_record(self) -> dict:
        return {"cause": self.cause.value, "ranks": list(self.ranks), "node": self.node, "failed_at": self.failed_at,
                "detected_at": self.detected_at, "detail": self.detail}


class _State(str, Enum):
    STARTING = "starting"
    """Announced by its launcher, not registered yet: no heartbeat to watch."""
    ALIVE = "alive"
    FAILED = "failed"
    EXITED = "exited"
    LEFT = "left"
    """A node whose launcher finished after all its ranks exited."""


@dataclass
class _Rank:
    node: int
    state: _State = _State.STARTING
    pid: Optional[int] = None
    host: Optional[str] = None
    generation: Optional[int] = None
    watch: Optional[HeartbeatWatch] = None
    position: Optional[Position] = None
    """Where its last beat placed it in ``generation`` (``Heartbeat.position``)."""
    survivor: bool = False
    """Its process is a lost controller's survivor (``RankRegistration.survivor``)."""


@dataclass
class _Node:
    ranks: tuple[int, ...]
    pid: int
    host: str
    registered_at: float
    watch: HeartbeatWatch
    state: _State = _State.ALIVE


def describe_exit(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exit status {exitcode}"
    try:
        return f"killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"killed by signal {-exitcode}"


def _ranks_word(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _where(positions: dict[int, Optional[Position]], ranks: tuple[int, ...]) -> str:
    """Where ``ranks`` are, as their beats (or the report) placed them."""
    places = sorted({positions.get(r) for r in ranks}, key=lambda p: (p is not None, p or (0, 0)))
    return "; ".join("no step of the generation yet" if p is None else f"step {p[0]}, {p[1]} op(s) done"
                     for p in places)


class Detector:
    """Every rank's and node's liveness; methods take the controller's monotonic ``now``
    (heartbeat ages) and wall-clock ``wall`` (records)."""

    def __init__(self, heartbeat_timeout: float, initial_heartbeat_timeout: Optional[float] = None, *,
                 controller_process: Optional[tuple[str, int]] = None):
        self.heartbeat_timeout = heartbeat_timeout
        self.initial_heartbeat_timeout = initial_heartbeat_timeout or heartbeat_timeout
        """A rank's timeout until its beats name a generation (it entered its first)."""
        self.controller_process = controller_process
        """(host, pid) of the controller's process: a launcher there is never found silent."""
        self.looks = Looks(late_after=heartbeat_timeout / 4, excuse_every=2 * heartbeat_timeout)
        """The controller's looks at the heartbeats: one a quarter of the timeout after the
        previous is its own lateness (it polls every half beat: with the default 100 ms
        beats and 1 s timeout, five polls fit in that quarter)."""
        self.ranks: dict[int, _Rank] = {}
        self.nodes: dict[int, _Node] = {}

    # -- what arrives in the inbox ---------------------------------------------------

    def node_joined(self, msg: NodeRegistration, now: float, wall: float) -> Optional[Failure]:
        """Watch the node from now on; where it replaces a launcher still counted alive, the
        old one's live ranks fail together (returned)."""
        beside_controller = (msg.host, msg.pid) == self.controller_process
        timeout = math.inf if beside_controller else self.initial_heartbeat_timeout if msg.ranks else \
            self.heartbeat_timeout
        old = self.nodes.get(msg.node)
        replaced = None
        if old is not None and old.state == _State.ALIVE:
            replaced = self._fail_node(msg.node, wall, f"launcher pid {old.pid} on {old.host} replaced by pid "
                                                       f"{msg.pid} on {msg.host}")
        self.nodes[msg.node] = _Node(msg.ranks, msg.pid, msg.host, wall, HeartbeatWatch(timeout, now))
        for rank in msg.ranks:  # a reattaching launcher may register after its survivors did: they stay survivors
            self.ranks[rank] = _Rank(node=msg.node, survivor=rank in self.ranks and self.ranks[rank].survivor)
        return replaced

    def rank_joined(self, msg: RankRegistration, now: float) -> None:
        rank = self.ranks.setdefault(msg.rank, _Rank(node=msg.node))
        node = self.nodes.get(rank.node)
        failed_node = node is not None and node.state == _State.FAILED
        rank.state, rank.pid, rank.host = _State.FAILED if failed_node else _State.ALIVE, msg.pid, msg.host
        rank.survivor = msg.survivor
        rank.watch = HeartbeatWatch(self.initial_heartbeat_timeout, now)
        self._started(rank.node)

    def awaited(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """Of ``ranks``, those a start's first generation waits for: no process registered
        yet, or only a lost controller's survivor (refused where that generation is
        entered: its node's command started again brings a fresh one). A rank that failed
        or exited is not awaited: the generation goes on without it as from any failure."""
        return tuple(r for r in sorted(ranks) if r not in self.ranks or self.ranks[r].state == _State.STARTING
                     or self.ranks[r].survivor)

    def rank_exited(self, msg: RankExit, wall: float) -> Optional[Failure]:
        rank = self.ranks.setdefault(msg.rank, _Rank(node=msg.node))
        live = rank.state in (_State.STARTING, _State.ALIVE)
        rank.state = _State.EXITED
        self._started(rank.node)
        if not live or msg.exitcode == 0:
            return None
        return Failure(Cause.EXIT, (msg.rank,), None, msg.exited_at, wall, describe_exit(msg.exitcode))

    def rank_reported(self, msg: RankFailureReport, wall: float) -> Optional[Failure]:
        rank = self.ranks.get(msg.rank)
        if rank is None or rank.state not in (_State.STARTING, _State.ALIVE):
            return None
        rank.state = _State.FAILED
        return Failure(Cause.ERROR, (msg.rank,), None, msg.reported_at, wall, msg.error)

    def rank_stalled(self, msg: CollectiveStalled, wall: float, *,
                     waits: Optional[WaitGraph] = None) -> Optional[Failure]:
        """A rank whose collective timed out with no failure known: the ranks it waited
        for are taken out, as ``waits`` (the generation's, where the controller has it)
        finds them from the report's position and the generation's last beats; without
        ``waits``, or where it finds none, the reporter. None where the ranks blamed have
        all failed or exited already (that failure ends the generation). The controller
        passes only the first report of a generation it has not ended."""
        rank = self.ranks.get(msg.rank)
        if rank is None or rank.state not in (_State.STARTING, _State.ALIVE):
            return None
        blamed, detail = (msg.rank,), msg.detail
        if waits is not None and waits.generation == msg.generation:
            positions = {r: other.position for r, other in self.ranks.items()
                         if other.state == _State.ALIVE and other.generation == msg.generation}
            positions[msg.rank] = None if msg.step is None or msg.ops_done is None else (msg.step, msg.ops_done)
            blamed = waits.behind(msg.rank, positions)
            if blamed != (msg.rank,):
                live = tuple(r for r in blamed if self.ranks[r].state == _State.ALIVE)
                if not live:
                    return None
                detail = (f"{_ranks_word(live)} behind ({_where(positions, live)}) while rank {msg.rank} waited "
                          f"({_where(positions, (msg.rank,))}): {msg.detail}")
                blamed = live
        for r in blamed:
            self.ranks[r].state = _State.FAILED
        return Failure(Cause.STALL, blamed, None, msg.reported_at, wall, detail)

    def straggler_removed(self, msg: StragglerRemoved, wall: float) -> Optional[Failure]:
        """A rank the owner found too slow: it is taken out, if it is still alive."""
        rank = self.ranks.get(msg.rank)
        if rank is None or rank.state != _State.ALIVE:
            return None
        rank.state = _State.FAILED
        return Failure(Cause.STRAGGLER, (msg.rank,), None, msg.reported_at, wall, msg.detail)

    def ranks_late(self, ranks: Iterable[int], generation: int, wall: float, timeout_s: float) -> Optional[Failure]:
        """Of ``ranks``, those still live whose beats do not name ``generation`` after the
        recovery timeout (``timeout_s``) for entering it: taken out together, as a rank
        that is behind (the others waited for it); None if there is none."""
        late = tuple(r for r in sorted(ranks) if r in self.ranks
                     and self.ranks[r].state in (_State.STARTING, _State.ALIVE)
                     and self.ranks[r].generation != generation)
        if not late:
            return None
        for r in late:
            self.ranks[r].state = _State.FAILED
        return Failure(Cause.LATE, late, None, wall - timeout_s, wall,
                       f"beating, but not in generation {generation} within the recovery timeout ({timeout_s} s)")

    def node_left(self, msg: NodeLeft) -> None:
        if msg.node in self.nodes:
            self.nodes[msg.node].state = _State.LEFT

    # -- heartbeats ----------------------------------------------------------------------

    def heartbeat_keys(self) -> list[str]:
        """Keys of every watched heartbeat: live nodes' (each carries its ranks' beats)."""
        return [node_heartbeat_key(n) for n in self.live_nodes()]

    def live_nodes(self) -> list[int]:
        """Nodes whose launcher is watched (registered, neither lost nor left)."""
        return [n for n, node in list(self.nodes.items()) if node.state == _State.ALIVE]

    def looked(self, now: float) -> float:
        """The controller read the live nodes' heartbeats at ``now`` (call it before
        ``observe`` with what it read, on every poll): the time since its previous look if
        this one was late (its own stall), which then counts against no one; else 0."""
        late = self.looks.look(now)
        if late:
            watches = [node.watch for node in self.nodes.values() if node.state == _State.ALIVE]
            watches += [rank.watch for rank in self.ranks.values() if rank.state == _State.ALIVE and rank.watch]
            for watch in watches:
                watch.excuse(now)
        return late

    def observe(self, beats: dict[str, NodeHeartbeat], now: float) -> bool:
        """Take in node heartbeats read under ``heartbeat_keys``; True when a rank's plan
        generation changed."""
        changed = False
        for n, node in self.nodes.items():
            beat = beats.get(node_heartbeat_key(n))
            if beat is None:
                continue
            node.watch.see(beat, now)
            for r, rank_beat in beat.rank_beats().items():
                rank = self.ranks.get(r)
                if rank is None or rank.node != n or rank.watch is None or rank_beat.pid != rank.pid:
                    continue  # not registered, or a beat of the process it replaced
                rank.watch.see(rank_beat, now)
                if rank_beat.generation is not None:  # started: the start-up grace is over
                    rank.watch.timeout = self.heartbeat_timeout
                changed |= rank_beat.generation != rank.generation
                rank.generation, rank.position = rank_beat.generation, rank_beat.position()
        return changed

    def check(self, now: float, wall: float) -> list[Failure]:
        """Failures by silence: one per lost node, then one for all ranks newly found hung."""
        failures = []
        for n, node in self.nodes.items():
            if node.state == _State.ALIVE and node.watch.stale(now):
                failures.append(self._fail_node(n, wall, f"launcher pid {node.pid} on {node.host} silent for over "
                                                         f"{node.watch.timeout} s"))
        hung = [r for r, rank in self.ranks.items() if rank.state == _State.ALIVE and self._hung(rank, now)]
        if hung:
            for r in hung:
                self.ranks[r].state = _State.FAILED
            last = min(self.ranks[r].watch.last.sent_at if self.ranks[r].watch.last else wall for r in hung)
            failures.append(Failure(Cause.HEARTBEAT, tuple(hung), None, last, wall,
                                    f"no heartbeat for over {self.heartbeat_timeout} s while its launcher lived"))
        return failures

    def _fail_node(self, n: int, wall: float, detail: str) -> Failure:
        """Node ``n`` is lost with every rank of it still starting or alive."""
        node = self.nodes[n]
        node.state = _State.FAILED
        lost = tuple(r for r in node.ranks if self.ranks[r].state in (_State.STARTING, _State.ALIVE))
        for r in lost:
            self.ranks[r].state = _State.FAILED
        last = node.watch.last.sent_at if node.watch.last else node.registered_at
        return Failure(Cause.NODE, lost, n, last, wall, detail, node_ranks=node.ranks,
                       launcher=launcher_name(node.host, node.pid))

    def _started(self, n: int) -> None:
        """Node ``n``'s start-up grace ends once none of its ranks is starting."""
        node = self.nodes.get(n)
        if node is not None and node.watch.timeout != math.inf and not any(
                self.ranks[r].state == _State.STARTING for r in node.ranks):
            node.watch.timeout = self.heartbeat_timeout

    def _hung(self, rank: _Rank, now: float) -> bool:
        if not rank.watch.stale(now):
            return False
        node = self.nodes.get(rank.node)
        return node is None or node.watch.changed_at > rank.watch.changed_at + rank.watch.timeout

    # -- views ---------------------------------------------------------------------------

    def live_ranks(self) -> list[int]:
        """Ranks starting or alive (neither failed nor exited)."""
        return [r for r, rank in list(self.ranks.items()) if rank.state in (_State.STARTING, _State.ALIVE)]

    def alive_ranks(self) -> list[int]:
        """Ranks registered and alive: started and heartbeating, since they last (re)started."""
        return [r for r, rank in list(self.ranks.items()) if rank.state == _State.ALIVE]

    def starting_ranks(self) -> list[int]:
        """Ranks a launcher announced that have not registered yet (their workers start up)."""
        return [r for r, rank in list(self.ranks.items()) if rank.state == _State.STARTING]

    def pid_of(self, rank: int) -> Optional[int]:
        """The process the rank registered from last, if it did."""
        return self.ranks[rank].pid

    def node_of(self, rank: int) -> int:
        return self.ranks[rank].node

    def workers(self) -> dict[int, dict]:
        """Rank -> pid, host, node, generation, state, for ``workers.json``."""
        return {r: {"pid": rank.pid, "host": rank.host, "node": rank.node, "generation": rank.generation,
                    "state": rank.state.value}
                for r, rank in sorted(self.ranks.items())}
