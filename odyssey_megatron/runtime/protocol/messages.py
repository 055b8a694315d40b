"""The JSON messages: a ``kind`` tag plus dataclass fields, each type-checked on parse
(never pickle: a store is a network service)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Optional


class ProtocolError(ValueError):
    """A message that is not valid JSON of the expected kind and fields."""


class StaleGenerationError(ProtocolError):
    """A plan that is not newer than the one its reader (or publisher) already has."""


def conforms(value: Any, annotation: str) -> bool:
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
        return isinstance(value, dict) and all(isinstance(k, str) and conforms(v, "int") for k, v in value.items())
    if base in ("tuple[int, ...]", "tuple[float, ...]"):
        return isinstance(value, (list, tuple)) and all(conforms(v, base[6:-6]) for v in value)
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
            if f.name not in data or not conforms(data[f.name], f.type):
                raise ProtocolError(f"{cls.KIND} message: field {f.name!r} must be {f.type}; got {data.get(f.name)!r}")
            values[f.name] = tuple(data[f.name]) if f.type.startswith("tuple[") else data[f.name]
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | bytes) -> Any:
        return cls.from_dict(parse_json(text))


def parse_json(text: str | bytes) -> Any:
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
    step: Optional[int] = None
    """The training step the worker runs in ``generation`` (its last committed is the one
    before); None while it enters the generation or trains nothing there."""
    ops_done: Optional[int] = None
    """Ops of ``step``'s op list (forwards, backwards, weight gradients) finished: the next
    one, at this index, is what the worker computes or waits for; the list's length once
    it is past them (gradient sync, clipping), one more once it counted into the step's
    commit (it waits for the decision, then takes its optimizer step)."""

    def position(self) -> Optional[tuple[int, int]]:
        """(step, ops done) where the worker trains, else None."""
        return None if self.step is None or self.ops_done is None else (self.step, self.ops_done)


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
    steps: dict[str, int] = field(default_factory=dict)
    """Rank -> the step its last beat named (``Heartbeat.step``), for ranks that train."""
    ops_done: dict[str, int] = field(default_factory=dict)
    """Rank -> the ops of that step it finished (``Heartbeat.ops_done``)."""

    def rank_beats(self) -> dict[int, Heartbeat]:
        """Each rank's last beat as the launcher saw it, stamped with the node's clock."""
        return {int(rank): Heartbeat(seq, self.sent_at, self.generations.get(rank), pid=self.pids.get(rank),
                                     step=self.steps.get(rank), ops_done=self.ops_done.get(rank))
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
    survivor: bool = False
    """A survivor of a lost controller registering with a restarted one (it announces
    itself next: ``RankReattached``), not a process this start began."""


@dataclass(frozen=True)
class RankReattached(Message):
    """A worker that outlived its controller and saved what it holds, announcing itself to a
    restarted controller: where it stands, for ``runtime.control.reattach`` to judge."""

    KIND = "rank_reattached"
    rank: int
    pid: int
    epoch: int
    """The controller start it last followed (0: the run's first): a survivor of an earlier
    start is told apart from the lost controller's."""
    generation: int
    """The last plan generation it ran (or sat out, idle)."""
    committed_step: Optional[int]
    """The steps its blocks have taken, all committed; None: it holds no block (idle in
    that generation)."""


@dataclass(frozen=True)
class ReattachVerdict(Message):
    """A restarted controller's answer to a ``RankReattached`` (``reattach_verdict_key``):
    the survivor trains on from its memory under this controller start, or is refused and
    exits (its held blocks are saved: the run resumes from disk)."""

    KIND = "reattach_verdict"
    rank: int
    epoch: int
    """The restarted controller's start, which an accepted survivor follows from now on."""
    accepted: bool
    why: str
    """Why it is refused; empty where it is taken back."""
    step: Optional[int] = None
    """Where it is taken back: the committed step the run goes on from."""


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
    step: Optional[int] = None
    """Where the waiting rank was (``Heartbeat.step``, ``Heartbeat.ops_done``): the
    controller blames the rank it waited for, by comparing the generation's progress."""
    ops_done: Optional[int] = None


@dataclass(frozen=True)
class StragglerRemoved(Message):
    """The owner found ``rank`` a straggler under ``odyssey.straggler: remove``
    (``runtime.control.stragglers``): the controller fails it as it fails a hung rank."""

    KIND = "straggler_removed"
    rank: int
    generation: int
    detail: str
    """Its measured slowdown (``Straggler.detail``)."""
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
    (``str(block)``) to the worker that writes it (each of its TP ranks its shard): one
    live holder in the last settled plan (``snapshot.shards.owners``), so every block
    is written once."""

    KIND = "stop"
    step: int
    """Committed steps: every block written has taken exactly this many."""
    reason: str
    writers: dict[str, int]


_INBOX_KINDS = {cls.KIND: cls for cls in (RankRegistration, NodeRegistration, RankExit, RankFailureReport,
                                          CollectiveStalled, StragglerRemoved, NodeLeft, StopRequested,
                                          RankReattached)}


def parse_inbox(text: str | bytes) -> Message:
    """One message from ``INBOX``, of whichever kind it is."""
    data = parse_json(text)
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in _INBOX_KINDS:
        raise ProtocolError(f"unknown inbox message kind {kind!r}; expected one of {', '.join(_INBOX_KINDS)}")
    return _INBOX_KINDS[kind].from_dict(data)


@dataclass(frozen=True)
class StepReport(Message):
    """A rank's step: the micro-batches whose last stage ran on it, with the loss of each
    and the sample ids it consumed, so the controller can prove every sample was used
    once; the seconds its ops took (``runtime.rank.op_timers``), for the online profile
    and the straggler watch (``runtime.control.stragglers``); and the learning rate its
    optimizer applies to the step, which every rank must agree on."""

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
    lr: float
    """The step's learning rate (``hooks.lr_schedule``: a function of the step alone)."""


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
    epoch: int = 0
    """The controller's start (0: the run's first; each ``--resume`` counts one more): a
    worker that outlives it names it when it reattaches (``RankReattached``)."""
