"""A plan published in slices: each live worker's op list under its own key, then the frame
every worker reads; a worker reads the frame and its own op list only."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, replace
from typing import Any, Optional

from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.runtime.protocol.keys import plan_key, plan_ops_key
from odyssey_megatron.runtime.protocol.messages import ProtocolError, StaleGenerationError, conforms, parse_json
from odyssey_megatron.schedules.program import StepProgram, check_own_ops, check_program, ops_from_json, ops_to_json
from odyssey_megatron.snapshot.restore import Restore, participants

STORE_BATCH_BYTES = 4 << 20
"""Most bytes of keys and values one ``multi_set`` carries: the libuv TCPStore server drops
a request over 8 MiB (the client sees its connection reset)."""


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
                and conforms(message.get("published_at"), "float") and conforms(message.get("start_step"), "int")
                and conforms(message.get("fresh"), "bool") and conforms(message.get("snapshot_interval"), "int")
                and conforms(message.get("joined"), "tuple[int, ...]")):
            raise ProtocolError(f"expected a 'plan' frame with published_at, start_step, fresh, snapshot_interval "
                                f"and joined; got {str(message)[:200]}")
        try:
            plan = ExecutionPlan.from_columns(message["plan"])
            header = message["program"]
            if not (conforms(header["staggered_optimizer"], "bool") and conforms(header["split_backward"], "bool")):
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
        return parse_json(zlib.decompress(data))
    except zlib.error as exc:
        raise ProtocolError(f"not a compressed JSON message: {exc}") from None
