"""What a worker and the processes that outlive it agree on, and nothing else: the store
keys and the JSON messages (the timeouts they wait by live below, in ``odyssey_megatron.timeouts``).

The rank side (``runtime.rank``) and the control side (``runtime.control``) import this
module and never each other. Everything crosses the controller's TCPStore as JSON (never
pickle: a store is a network service). Senders stamp messages with their wall clock;
receivers judge liveness on their own monotonic clock, by watching a heartbeat's sequence
number change (``HeartbeatWatch``), so clock skew between nodes never fails a worker.

A plan is published in slices (``write_plan``/``read_plan``): each live worker's op list
under its own key, then a frame every worker reads (the message's fields, the plan in a
compact column form, the step program's flags), all zlib-compressed JSON. A worker reads
the frame and its own op list only, whatever the world's size; and no value comes near
the store's request limit.

A *rank* here is a worker process's rank fixed at launch (``node * nproc_per_node +
local_rank``); plan worker ``w`` (a TP group) is ranks ``w*TP .. w*TP+TP-1``.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar, Optional

from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.schedules.program import StepProgram, check_own_ops, check_program, ops_from_json, ops_to_json
from odyssey_megatron.snapshot.restore import Restore, participants
from odyssey_megatron.timeouts import Timeouts

__all__ = [
    "CONTROLLER_HEARTBEAT",
    "CollectiveStalled",
    "DOORBELL",
    "ControllerHeartbeat",
    "EXIT_CONTROLLER_LOST",
    "EXIT_REPLACED",
    "INBOX",
    "Heartbeat",
    "HeartbeatWatch",
    "Message",
    "NODE_VIEW",
    "NodeHeartbeat",
    "NodeLeft",
    "NodeRegistration",
    "NodeView",
    "PlanPublished",
    "ProtocolError",
    "RankExit",
    "RankFailureReport",
    "RankRegistration",
    "RunSpec",
    "StepReport",
    "StaleGenerationError",
    "WorkerLaunch",
    "FROZEN",
    "KillOrder",
    "PUBLISHED_GENERATION",
    "RUN_DONE",
    "RUN_SPEC",
    "RUN_STOP",
    "STORE_BATCH_BYTES",
    "StopOrder",
    "StopRequested",
    "ABORTED",
    "ALL_ARRIVED",
    "abort_key",
    "all_arrived_key",
    "applied_key",
    "decided_key",
    "arrived_key",
    "final_key",
    "fault_fired_key",
    "generation_prefix",
    "handover_key",
    "launcher_key",
    "process_group_prefix",
    "ready_key",
    "step_report_key",
    "stopped_key",
    "successor_key",
    "kill_orders_key",
    "missed_beat",
    "node_applied_key",
    "node_decided_key",
    "node_heartbeat_key",
    "node_report_key",
    "parse_inbox",
    "plan_key",
    "plan_ops_key",
    "rank_heartbeat_key",
    "read_plan",
    "write_plan",
]

# -- store keys ----------------------------------------------------------------------

INBOX = "control/inbox"
"""Queue of registrations, exits, failure reports and departures, read by the controller only."""
CONTROLLER_HEARTBEAT = "heartbeat/controller"


def rank_heartbeat_key(rank: int) -> str:
    """A worker's ``Heartbeat``, in its node's store (its launcher's), not the controller's."""
    return f"heartbeat/rank/{rank}"


def node_heartbeat_key(node: int) -> str:
    """The node's ``NodeHeartbeat``: its launcher's beat with each of its workers' last one;
    or ``DOORBELL``, until the launcher's next beat."""
    return f"heartbeat/node/{node}"


DOORBELL = b"doorbell"
"""What the controller writes over a node's heartbeat key when the node's launcher must
read the controller's heartbeat at once (an abort, a kill order for it). A launcher writes
each beat with ``compare_set`` against its previous one, so one request per interval both
beats and finds whether anyone wrote there since (the doorbell, or another launcher of the
node: a replacement); otherwise it reads the controller's heartbeat only every
``heartbeat_timeout``, to see it live."""


NODE_VIEW = "node/view"
"""In a node's store: the ``NodeView`` its launcher relays to the node's workers."""


def kill_orders_key(node: int) -> str:
    """Queue of ``KillOrder``: ranks the controller declared failed, which node ``node``'s
    launcher must kill."""
    return f"control/kill/node/{node}"


def launcher_key(node: int) -> str:
    """Who launches node ``node`` now (``host:pid``), set by its launcher as it starts: a
    launcher that finds it set joins a running run (a repaired or replacement node), and
    one that finds another there has been replaced and ends its workers (fencing)."""
    return f"control/launcher/node/{node}"


def generation_prefix(generation: int) -> str:
    """Every key of one plan generation lives under this prefix (process groups too, through
    a ``PrefixStore``), so nothing of an aborted generation is read by the next."""
    return f"gen{generation}/"


def plan_key(generation: int) -> str:
    """The generation's plan frame (``PlanPublished.frame``), set after every op list (a
    worker that sees it finds its own): the successor of the generation before, so the
    get a worker waits in between generations returns the frame itself."""
    return successor_key(generation - 1)


def plan_ops_key(generation: int, worker: int) -> str:
    """Worker ``worker``'s op list in the generation's step program, read by its TP ranks."""
    return generation_prefix(generation) + f"ops/{worker}"


STORE_BATCH_BYTES = 4 << 20
"""Most bytes of keys and values one ``multi_set`` carries: the libuv TCPStore server drops
a request over 8 MiB (the client sees its connection reset)."""


RUN_SPEC = "run/spec"
"""The training run's ``RunSpec``, set by the controller before any worker starts."""
RUN_STOP = "run/stop"
"""A ``StopOrder``, set by the controller when the run stops on purpose (a signal) or its
owner fails: every worker leaves its generation, writes the blocks the order assigns it as
of the last committed step, sets its ``stopped_key`` and exits."""
RUN_DONE = "run/done"
"""Set by the controller when the last step is committed and ``final.pt`` written: idle
workers and those waiting for a plan exit."""


PUBLISHED_GENERATION = "run/generation"
"""The newest plan generation published: where a joining worker starts watching."""


def process_group_prefix(generation: int) -> str:
    """Where a generation's ``init_process_group`` rendezvous (a ``PrefixStore``)."""
    return generation_prefix(generation) + "pg/"


def arrived_key(generation: int) -> str:
    """Counter: ranks that arrived to enter the generation. Ranks wait for all of them on
    the store, where the abort key can end the wait, before the process group's
    rendezvous, which only a timeout ends."""
    return generation_prefix(generation) + "arrived"


def all_arrived_key(generation: int) -> str:
    """Set by the rank whose arrival completes ``arrived_key`` (``ALL_ARRIVED``), or by the
    controller when it ends the generation first (``ABORTED``): arriving ranks wait on it,
    without polling, for whichever comes first."""
    return generation_prefix(generation) + "all_arrived"


ALL_ARRIVED = b"all"
ABORTED = b"abort"


def successor_key(generation: int) -> str:
    """What follows generation ``generation`` (-1: the first plan), set by the controller
    once it is known: the next generation's plan frame (``plan_key``), or the name of
    ``RUN_STOP`` or ``RUN_DONE``. A worker between generations waits on it, without polling."""
    return generation_prefix(generation) + "successor"


def ready_key(generation: int) -> str:
    """Counter: ranks that entered the generation (groups built, blocks moved, stage built)."""
    return generation_prefix(generation) + "ready"


def abort_key(generation: int) -> str:
    """Set by the controller when a failure ends the generation: a rank waiting on the
    store (not in a collective, where the peers' closed sockets end its wait) stops."""
    return generation_prefix(generation) + "abort"


def handover_key(generation: int) -> str:
    """Set by the controller to end the generation at the next step boundary (a join): the
    rank that commits the next step decides it as the generation's last (``step_ledger``)."""
    return generation_prefix(generation) + "handover"


def applied_key(generation: int, step: int) -> str:
    """Counter: ranks of the generation whose gradients for ``step`` are final
    (``step_ledger``). The step is committed once it equals the generation's training
    ranks; the controller freezes it (``FROZEN``) when a failure ends the generation, so a
    late rank cannot commit it."""
    return generation_prefix(generation) + f"applied/{step}"


def stopped_key(rank: int) -> str:
    """Set by a rank once it carried out the ``StopOrder`` (wrote its part, or had none)."""
    return f"run/stopped/{rank}"


def decided_key(generation: int, step: int) -> str:
    """Whether ``step`` committed (``step_ledger``): set once its counter decided it, by the
    rank that completed it or by the controller that froze it."""
    return generation_prefix(generation) + f"decided/{step}"


FROZEN = -(1 << 40)
"""Added to an ``applied_key`` counter to freeze it: below zero, never the world size again."""


def step_report_key(generation: int, step: int) -> str:
    """Appended JSON lines, one per training rank of the generation that took ``step``'s
    optimizer step: ``StepReport``."""
    return generation_prefix(generation) + f"report/{step}"


def node_report_key(generation: int, step: int) -> str:
    """In a node's store: the ``StepReport`` lines of the node's ranks for ``step``
    (``runtime.rank.node_ledger``), carried to ``step_report_key`` in one append."""
    return generation_prefix(generation) + f"node/report/{step}"


def node_applied_key(generation: int, step: int) -> str:
    """In a node's store: counter of the node's ranks counted into ``step``."""
    return generation_prefix(generation) + f"node/applied/{step}"


def node_decided_key(generation: int, step: int) -> str:
    """In a node's store: ``step``'s decision, as the rank that carried the node's count left it."""
    return generation_prefix(generation) + f"node/decided/{step}"


def snapshot_parts_key(generation: int, step: int) -> str:
    """Counter: training ranks of the generation whose shard and parity chunk of the
    snapshot of ``step`` are in their node's keeper."""
    return generation_prefix(generation) + f"snapshot/{step}/parts"


def snapshot_done_key(generation: int, step: int) -> str:
    """Set by the rank whose part completed the snapshot of ``step``: it counts from now on."""
    return generation_prefix(generation) + f"snapshot/{step}/done"


def fault_fired_key(key: str) -> str:
    """Set when the injected fault ``key`` (``odyssey.faults[i]``) fired: a restarted worker
    does not fire it again."""
    return f"faults/fired/{key}"


def final_key(generation: int) -> str:
    """Counter: ranks that wrote their part of ``final.pt``."""
    return generation_prefix(generation) + "final"


EXIT_CONTROLLER_LOST = 75
"""Exit status of a worker or launcher that lost its controller (EX_TEMPFAIL)."""
EXIT_REPLACED = 76
"""Exit status of a launcher another launcher of the same node replaced (fenced)."""

# -- messages ------------------------------------------------------------------------


class ProtocolError(ValueError):
    """A message that is not valid JSON of the expected kind and fields."""


class StaleGenerationError(ProtocolError):
    """A plan that is not newer than the one its reader (or publisher) already has."""


def _conforms(value: Any, annotation: str) -> bool:
    optional = annotation.startswith("Optional[")
    base = annotation.removeprefix("Optional[").removesuffix("]") if optional else annotation
    if value is None:
        return optional
    if base == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if base == "str":
        return isinstance(value, str)
    if base == "bool":
        return isinstance(value, bool)
    if base == "dict[str, int]":
        return isinstance(value, dict) and all(isinstance(k, str) and _conforms(v, "int") for k, v in value.items())
    if base in ("tuple[int, ...]", "tuple[float, ...]"):
        return isinstance(value, (list, tuple)) and all(_conforms(v, base[6:-6]) for v in value)
    raise TypeError(f"no JSON check for {annotation}")


class Message:
    """A JSON message: a ``kind`` tag plus the dataclass fields, each type-checked on parse."""

    KIND: ClassVar[str]

    def to_json(self) -> str:
        return json.dumps({"kind": self.KIND, **asdict(self)}, allow_nan=False)

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("kind") != cls.KIND:
            raise ProtocolError(f"expected a {cls.KIND!r} message; got {str(data)[:200]}")
        values = {}
        for f in fields(cls):
            if f.name not in data or not _conforms(data[f.name], f.type):
                raise ProtocolError(f"{cls.KIND} message: field {f.name!r} must be {f.type}; got {data.get(f.name)!r}")
            values[f.name] = tuple(data[f.name]) if f.type.startswith("tuple[") else data[f.name]
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | bytes) -> Any:
        return cls.from_dict(_loads(text))


def _loads(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"not a JSON message: {exc}") from None


@dataclass(frozen=True)
class Heartbeat(Message):
    """A worker's beat, written over its heartbeat key every ``heartbeat_interval``."""

    KIND = "heartbeat"
    seq: int
    sent_at: float
    generation: Optional[int] = None
    """The plan generation a worker runs; None before its first plan."""
    watching: Optional[int] = None
    """The plan generation a worker enters or runs (its launcher relays that generation's abort)."""
    pid: Optional[int] = None
    """The worker's process: a restarted worker's first beats must not be read as its
    predecessor's, nor the predecessor's last one as the newcomer's."""


@dataclass(frozen=True)
class ControllerHeartbeat(Message):
    """The controller's beat under ``CONTROLLER_HEARTBEAT``, carrying what a launcher must
    act on, so one read is all a launcher asks when rung (``DOORBELL``): the generations
    lately aborted (relayed to the node's workers), and per node how many kill orders were
    ever queued for it (a launcher reads its queue only when that grows)."""

    KIND = "controller_heartbeat"
    seq: int
    sent_at: float
    aborted: tuple[int, ...]
    """The last few generations the controller aborted (``abort_key`` holds them all)."""
    kill_orders: dict[str, int]
    """Node -> ``KillOrder``s queued under its ``kill_orders_key`` since the run began."""


@dataclass(frozen=True)
class NodeHeartbeat(Message):
    """A launcher's beat under ``node_heartbeat_key``, carrying its workers' liveness: each
    worker beats into its node's store and the launcher forwards the latest beat of each,
    so the controller's store sees one write per node per interval, not one per rank. A
    worker that hangs stops changing its ``seqs`` entry while the node's ``seq`` goes on."""

    KIND = "node_heartbeat"
    seq: int
    sent_at: float
    seqs: dict[str, int]
    """Rank -> the sequence number of its last beat (ranks that have beaten at all)."""
    generations: dict[str, int]
    """Rank -> the plan generation it runs, for ranks that have entered one."""
    pids: dict[str, int]
    """Rank -> the process that wrote its last beat."""

    def rank_beats(self) -> dict[int, Heartbeat]:
        """Each rank's last beat as the launcher saw it, stamped with the node's clock."""
        return {int(rank): Heartbeat(seq, self.sent_at, self.generations.get(rank), pid=self.pids.get(rank))
                for rank, seq in self.seqs.items()}


@dataclass(frozen=True)
class NodeView(Message):
    """What a launcher relays from the controller to its node's workers under ``NODE_VIEW``,
    every heartbeat interval: the controller's heartbeat, the generations it aborted that
    a worker of the node watches, and whether the launcher lost the controller."""

    KIND = "node_view"
    controller_seq: int
    controller_sent_at: float
    aborted: tuple[int, ...]
    controller_lost: Optional[str] = None
    """Why the launcher counts the controller gone (its connection closed, or its beats stopped)."""

    def controller_beat(self) -> Heartbeat:
        return Heartbeat(self.controller_seq, self.controller_sent_at)


@dataclass(frozen=True)
class RankRegistration(Message):
    """A worker process announcing itself, after its first heartbeat is in the store."""

    KIND = "register_rank"
    rank: int
    pid: int
    host: str
    node: int


@dataclass(frozen=True)
class NodeRegistration(Message):
    """A node launcher announcing itself and the ranks it will start, after its first heartbeat."""

    KIND = "register_node"
    node: int
    pid: int
    host: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class RankExit(Message):
    """A launcher saw a worker process end; ``exitcode`` < 0 is the killing signal, negated."""

    KIND = "rank_exit"
    rank: int
    node: int
    exitcode: int
    exited_at: float


@dataclass(frozen=True)
class RankFailureReport(Message):
    """A worker that cannot go on (an error of its own) names itself failed; its launcher
    then kills it on the controller's order."""

    KIND = "rank_failure"
    rank: int
    generation: Optional[int]
    error: str
    reported_at: float


@dataclass(frozen=True)
class CollectiveStalled(Message):
    """A worker's collective waited out the collective timeout with no abort from the
    controller: a peer that still beats does not answer (a data-plane fault the heartbeats
    do not see). The worker has left the generation."""

    KIND = "collective_stalled"
    rank: int
    generation: Optional[int]
    detail: str
    reported_at: float


@dataclass(frozen=True)
class NodeLeft(Message):
    """A launcher whose workers have all exited leaves; its silence is then no node failure."""

    KIND = "node_left"
    node: int
    left_at: float


@dataclass(frozen=True)
class StopRequested(Message):
    """A launcher of another node was told to stop (SIGINT or SIGTERM): the whole run stops."""

    KIND = "stop_requested"
    node: int
    signal: str
    requested_at: float


@dataclass(frozen=True)
class KillOrder(Message):
    """Under ``kill_orders_key``: kill ``rank`` if it still runs as process ``pid`` (a
    restarted worker is another process, which the order does not name)."""

    KIND = "kill"
    rank: int
    pid: int


@dataclass(frozen=True)
class StopOrder(Message):
    """Under ``RUN_STOP``: save what is committed and exit. ``writers`` maps each block
    (``str(block)``) to the worker that writes it (each of its TP ranks its shard): the
    first live holder in the last settled plan, so every block is written once."""

    KIND = "stop"
    step: int
    """Committed steps: every block written has taken exactly this many."""
    reason: str
    writers: dict[str, int]


_INBOX_KINDS = {cls.KIND: cls for cls in (RankRegistration, NodeRegistration, RankExit, RankFailureReport,
                                          CollectiveStalled, NodeLeft, StopRequested)}


def parse_inbox(text: str | bytes) -> Message:
    """One message from ``INBOX``, of whichever kind it is."""
    data = _loads(text)
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in _INBOX_KINDS:
        raise ProtocolError(f"unknown inbox message kind {kind!r}; expected one of {', '.join(_INBOX_KINDS)}")
    return _INBOX_KINDS[kind].from_dict(data)


@dataclass(frozen=True)
class PlanPublished:
    """A plan and its step program, published in slices (``write_plan``); generations are
    published one after another. Read by a worker (``read_plan``), ``program`` holds that
    worker's op list only, or none where the plan has it idle."""

    plan: ExecutionPlan
    program: StepProgram
    published_at: float
    start_step: int = 0
    """The first step the generation runs: the number of steps committed before it."""
    fresh: bool = False
    """No step has committed since the run started (or resumed): no trained state exists,
    so every worker draws its stage from the seed (or the resumed checkpoint) and no block
    moves, whatever it held before."""
    snapshot_interval: int = 0
    """Steps between the generation's in-memory snapshots (0: none)."""
    snapshot: Optional[tuple[int, int]] = None
    """(step, generation) of the last complete snapshot: its keeper buffers are kept."""
    restore: Optional[Restore] = None
    """A rollback: every block comes back from the snapshot it names, as of its step
    (``start_step``), not from what the survivors hold."""
    joined: tuple[int, ...] = ()
    """Workers that come back in this generation (restarted or on a replacement node): they
    hold nothing and receive every block of their stage; a joining worker enters no
    generation before the first that names it."""

    def participants(self) -> tuple[int, ...]:
        """Workers that enter the generation: the plan's, and those that read a snapshot shard for it."""
        return participants(self.plan, self.restore)

    def frame(self) -> bytes:
        """What every worker reads under ``plan_key``: the fields, the plan (``ExecutionPlan.to_columns``)
        and the step program's flags, without any op list."""
        return _pack({"kind": "plan", "published_at": self.published_at, "start_step": self.start_step,
                      "fresh": self.fresh, "snapshot_interval": self.snapshot_interval,
                      "snapshot": list(self.snapshot) if self.snapshot else None,
                      "restore": self.restore.to_dict() if self.restore else None, "joined": list(self.joined),
                      "plan": self.plan.to_columns(),
                      "program": {"staggered_optimizer": self.program.staggered_optimizer,
                                  "split_backward": self.program.split_backward}})

    def op_lists(self) -> dict[str, bytes]:
        """Each live worker's op list under its ``plan_ops_key``, once the whole program is
        checked against the plan."""
        check_program(self.plan, self.program)
        return {plan_ops_key(self.plan.generation, worker): _pack(ops_to_json(ops))
                for worker, ops in sorted(self.program.ops.items())}

    @classmethod
    def from_frame(cls, data: bytes, *, current_generation: int) -> "PlanPublished":
        """Parse a ``frame``, refusing a plan not newer than ``current_generation`` (the
        reader's; -1 before any); its program holds no op list yet (``with_own_ops``)."""
        message = _unpack(data)
        if not (isinstance(message, dict) and message.get("kind") == "plan"
                and _conforms(message.get("published_at"), "float") and _conforms(message.get("start_step"), "int")
                and _conforms(message.get("fresh"), "bool") and _conforms(message.get("snapshot_interval"), "int")
                and _conforms(message.get("joined"), "tuple[int, ...]")):
            raise ProtocolError(f"expected a 'plan' frame with published_at, start_step, fresh, snapshot_interval "
                                f"and joined; got {str(message)[:200]}")
        try:
            plan = ExecutionPlan.from_columns(message["plan"])
            header = message["program"]
            if not (_conforms(header["staggered_optimizer"], "bool") and _conforms(header["split_backward"], "bool")):
                raise ValueError(f"step program flags must be booleans; got {header!r}")
            snapshot = message["snapshot"]
            snapshot = None if snapshot is None else (int(snapshot[0]), int(snapshot[1]))
            restore = None if message["restore"] is None else Restore.from_dict(message["restore"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ProtocolError(f"plan message: malformed plan: {exc!r}") from None
        if plan.generation <= current_generation:
            raise StaleGenerationError(f"plan generation {plan.generation} is stale: generation {current_generation} "
                                       "is already running")
        program = StepProgram(plan.generation, {}, staggered_optimizer=header["staggered_optimizer"],
                              split_backward=header["split_backward"])
        return cls(plan=plan, program=program, published_at=message["published_at"],
                   start_step=message["start_step"], fresh=message["fresh"],
                   snapshot_interval=message["snapshot_interval"], snapshot=snapshot, restore=restore,
                   joined=tuple(message["joined"]))

    def with_own_ops(self, worker: int, data: bytes) -> "PlanPublished":
        """This message with ``worker``'s op list (read from its ``plan_ops_key``) as its
        program's, checked against the plan (``check_own_ops``)."""
        try:
            program = replace(self.program, ops={worker: ops_from_json(_unpack(data), worker=worker)})
            check_own_ops(self.plan, program, worker)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"plan generation {self.plan.generation}: {exc}") from None
        return replace(self, program=program)


def write_plan(store: Any, published: PlanPublished, *, batch_bytes: int = STORE_BATCH_BYTES) -> None:
    """Publish ``published`` on ``store``: every op list, in ``multi_set`` batches of at most
    ``batch_bytes`` (keys and values), then the frame, which is what workers wait for."""
    batch: dict[str, bytes] = {}
    size = 0
    for key, value in published.op_lists().items():
        if len(key) + len(value) > batch_bytes:
            raise ValueError(f"{key} holds {len(value)} bytes: over the store batch of {batch_bytes}")
        if size + len(key) + len(value) > batch_bytes:
            store.multi_set(list(batch), list(batch.values()))
            batch, size = {}, 0
        batch[key] = value
        size += len(key) + len(value)
    if batch:
        store.multi_set(list(batch), list(batch.values()))
    store.set(plan_key(published.plan.generation), published.frame())


def read_plan(store: Any, frame: bytes, *, rank: int, current_generation: int) -> PlanPublished:
    """Plan generation ``current_generation + 1`` from its ``frame`` as rank ``rank`` needs
    it: with the op list of the rank's worker, read from ``store``, where the plan has it
    live; a frame carrying a generation not newer than ``current_generation`` is refused
    (StaleGenerationError)."""
    published = PlanPublished.from_frame(frame, current_generation=current_generation)
    worker = rank // published.plan.tensor_parallel_size
    if worker not in published.plan.workers:
        return published
    return published.with_own_ops(worker, store.get(plan_ops_key(published.plan.generation, worker)))


def _pack(value: Any) -> bytes:
    return zlib.compress(json.dumps(value, separators=(",", ":"), allow_nan=False).encode())


def _unpack(data: bytes) -> Any:
    try:
        return _loads(zlib.decompress(data))
    except zlib.error as exc:
        raise ProtocolError(f"not a compressed JSON message: {exc}") from None


# -- liveness ------------------------------------------------------------------------


def missed_beat(exc: BaseException) -> bool:
    """Whether a store error is a read that timed out (a beat missed: on a busy node the
    store may answer late; staleness decides) rather than a closed connection (the
    controller is gone). By type: a TCPStore read past its timeout raises
    ``DistStoreError``; a closed or refused connection ``DistNetworkError`` (both provoked
    in tests/test_missed_beat.py)."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistStoreError)


@dataclass
class HeartbeatWatch:
    """One receiver's view of one sender: when (receiver's monotonic clock) the sender's
    sequence number last changed. Stale once it has not changed for ``timeout`` seconds."""

    timeout: float
    changed_at: float
    """Monotonic time of the last change; the start of watching counts as one."""
    last: Optional[Heartbeat] = None

    def see(self, beat: Heartbeat, now: float) -> None:
        if self.last is None or beat.seq != self.last.seq:
            self.last = beat
            self.changed_at = now

    def stale(self, now: float) -> bool:
        return now - self.changed_at > self.timeout


@dataclass(frozen=True)
class StepReport(Message):
    """A rank's step: the micro-batches whose last stage ran on it, with the loss of each
    and the sample ids it consumed, so the controller can prove every sample was used
    once; and the seconds its ops took (``runtime.rank.op_timers``; zeros where
    ``odyssey.online_profile`` is off), for the online profile."""

    KIND = "step_report"
    rank: int
    micro_batches: tuple[int, ...]
    losses: tuple[float, ...]
    samples: tuple[int, ...]
    """Sample ids, micro-batch after micro-batch (``micro_batch_size`` each)."""
    forward_s: float
    forwards: int
    backward_s: float
    """Whole backwards, or the input-gradient halves where backwards are split."""
    backwards: int
    weight_grad_s: float
    weight_grads: int
    optimizer_s: float
    """Megatron's optimizer's inner (Adam) step."""


@dataclass(frozen=True)
class RunSpec(Message):
    """What every worker of a training run reads before its first plan."""

    KIND = "run_spec"
    config_yaml: str
    """The resolved recipe (``config.config_yaml``)."""
    data: str
    """The prepared corpus (``data.PreparedData`` as JSON)."""
    run_dir: str
    """Where workers write their part of ``final.pt`` (a filesystem every node sees)."""
    resume: Optional[str] = None
    """A checkpoint directory the first generation loads its blocks from; None: the seed."""


@dataclass(frozen=True)
class WorkerLaunch:
    """What a launcher hands a worker process it starts (pickled by multiprocessing, locally)."""

    rank: int
    local_rank: int
    node: int
    world_size: int
    store_host: str
    store_port: int
    node_store_port: int
    """The node's store, served by its launcher on the loopback address: the worker's
    heartbeats go there (``NodeHeartbeat``), the launcher's ``NodeView`` comes back, and the
    node's ranks commit their steps together there (``runtime.rank.node_ledger``)."""
    node_ranks: tuple[int, ...]
    """Every rank its launcher runs (this one among them)."""
    launcher_pid: int
    timeouts: Timeouts
    keeper: tuple[tuple[str, ...], ...] = ()
    """The node's keeper memory (``snapshot.keeper``): per local rank, the paths of its two
    data and two parity buffers."""
    joining: bool = False
    """The run is under way: the worker was restarted, or its node replaced, and holds
    nothing; it waits for a generation that admits it (``PlanPublished.joined``)."""
