"""ExecutionPlan: what every rank runs, as plain data with a JSON round trip.

Its one codec has two forms: ``to_dict`` (field by field: ``plan-<g>.json``,
``odyssey plan --json``) and ``to_columns`` (the same plan as delta-coded columns: what the
controller publishes to every worker, 2 KB compressed where the field-by-field form is
300 KB at 4,096 workers).

A plan lists pipelines; each pipeline lists stages (a worker and a layer range
[start, end)) and the global micro-batch ids it trains each step. A stage whose worker
is ``None`` has failed and its micro-batches are *rerouted*: ``reroutes`` names, per
micro-batch, the worker of a same-stage peer in another pipeline that runs it. DP
gradient sync is described by ``sync_units`` (blocks held by the same set of workers)
grouped into ``comm_rounds``; ``transfers`` move weights and optimizer state before the
plan starts. The controller publishes plans as JSON, never pickle, together with their
step program (``schedules.program``).

A plan names *workers*: a worker is a TP group, with an id fixed at launch (worker w
starts with ranks w*TP .. w*TP+TP-1), which it keeps when the world shrinks. A process's
*rank* is its place in the current world; ``hooks.process_groups.RankMap`` maps workers
to ranks where groups are built, and nothing in a plan is a rank.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator, Optional

from odyssey_megatron.blocks import Block, block_sort_key
from odyssey_megatron.profile import ModelProfile

POLICIES = ("initial", "reroute", "reparallelize", "shrink")
"""How a plan came about; a "shrink" plan trains fewer micro-batches than the recipe's
batch (``planner.shrink``)."""
PLAN_FORMAT_VERSION = 2
"""2: stages name workers only (1 also listed launch-time ranks)."""


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: who runs it and which transformer layers it holds."""

    worker: Optional[int]
    layers: tuple[int, int]
    """[start, end) in model order; the first stage also holds the embedding, the last the output head."""

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class PipelinePlan:
    stages: tuple[StagePlan, ...]
    micro_batches: tuple[int, ...]
    """Global micro-batch ids this pipeline consumes each step, in execution order."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def layer_counts(self) -> tuple[int, ...]:
        return tuple(s.num_layers for s in self.stages)


@dataclass(frozen=True)
class Reroute:
    """Micro-batches of a failed stage that a same-stage peer runs instead."""

    pipeline: int
    stage: int
    worker: int
    micro_batches: tuple[int, ...]


@dataclass(frozen=True)
class SyncUnit:
    """Blocks held by exactly the same set of workers: one DP all-reduce."""

    blocks: tuple[Block, ...]
    workers: tuple[int, ...]


@dataclass(frozen=True)
class Transfer:
    """Move one block's weights and optimizer state, one TP shard, between ranks as
    launched (``worker * TP + k``): ``src`` and ``dst`` hold the same TP rank k.

    ``layer`` is a transformer layer index, "embedding" or "output". ``src`` is None when
    no survivor holds the block: the shard is read from the last checkpoint instead.
    """

    layer: Block
    src: Optional[int]
    dst: int
    bytes: int


@dataclass(frozen=True)
class ExecutionPlan:
    generation: int
    policy: str
    num_layers: int
    tensor_parallel_size: int
    pipelines: tuple[PipelinePlan, ...]
    reroutes: tuple[Reroute, ...] = ()
    sync_units: tuple[SyncUnit, ...] = ()
    comm_rounds: tuple[tuple[int, ...], ...] = ()
    """Indices into sync_units; units in one round touch disjoint workers and run concurrently."""
    transfers: tuple[Transfer, ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")

    # -- derived views ---------------------------------------------------------------

    @property
    def workers(self) -> tuple[int, ...]:
        """Live workers that own a stage, in pipeline order."""
        return tuple(s.worker for p in self.pipelines for s in p.stages if s.worker is not None)

    @property
    def participants(self) -> tuple[int, ...]:
        """Workers that take part in entering this plan, ascending: those that own a stage
        and survivors that only send a block (they idle afterwards)."""
        senders = {t.src // self.tensor_parallel_size for t in self.transfers if t.src is not None}
        return tuple(sorted(set(self.workers) | senders))

    @property
    def num_micro_batches(self) -> int:
        return sum(len(p.micro_batches) for p in self.pipelines)

    @property
    def blocks_from_nowhere(self) -> list[Block]:
        """Blocks this plan loads from a checkpoint (a transfer with no source): no survivor
        held them, so it cannot start from memory."""
        return sorted({t.layer for t in self.transfers if t.src is None}, key=block_sort_key)

    def stage_positions(self) -> Iterator[tuple[int, int, StagePlan]]:
        for pi, pipeline in enumerate(self.pipelines):
            for si, stage in enumerate(pipeline.stages):
                yield pi, si, stage

    def blocks_of_stage(self, pipeline: int, stage: int, profile: ModelProfile) -> list[Block]:
        p = self.pipelines[pipeline]
        start, end = p.stages[stage].layers
        return profile.stage_blocks(start, end, first=stage == 0, last=stage == p.num_stages - 1)

    def holdings(self, profile: ModelProfile) -> dict[int, list[Block]]:
        """Blocks each live stage owner holds (rerouting peers hold their own stage only)."""
        return {
            stage.worker: self.blocks_of_stage(pi, si, profile)
            for pi, si, stage in self.stage_positions()
            if stage.worker is not None
        }

    def holder_counts(self, profile: ModelProfile) -> dict[Block, int]:
        """How many live stage owners hold each block: its sync unit's size, over which
        the distributed optimizer shards the block's state (``optimizer_shards``)."""
        counts: dict[Block, int] = {}
        for blocks in self.holdings(profile).values():
            for block in blocks:
                counts[block] = counts.get(block, 0) + 1
        return counts

    def executor(self, pipeline: int, stage: int, micro_batch: int) -> int:
        """The worker that runs ``micro_batch`` of ``pipeline`` at ``stage``."""
        owner = self.pipelines[pipeline].stages[stage].worker
        if owner is not None:
            return owner
        for r in self.reroutes:
            if r.pipeline == pipeline and r.stage == stage and micro_batch in r.micro_batches:
                return r.worker
        raise KeyError(f"no worker runs micro-batch {micro_batch} of pipeline {pipeline} stage {stage}")

    # -- JSON ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["format_version"] = PLAN_FORMAT_VERSION
        data["comm_rounds"] = [list(r) for r in self.comm_rounds]
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ExecutionPlan":
        version = data.get("format_version", PLAN_FORMAT_VERSION)
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"plan format_version {version} is not supported (this build reads {PLAN_FORMAT_VERSION})")
        return cls(
            generation=data["generation"],
            policy=data["policy"],
            num_layers=data["num_layers"],
            tensor_parallel_size=data["tensor_parallel_size"],
            pipelines=tuple(
                PipelinePlan(
                    stages=tuple(StagePlan(s["worker"], tuple(s["layers"])) for s in p["stages"]),
                    micro_batches=tuple(p["micro_batches"]),
                )
                for p in data["pipelines"]
            ),
            reroutes=tuple(
                Reroute(r["pipeline"], r["stage"], r["worker"], tuple(r["micro_batches"])) for r in data["reroutes"]
            ),
            sync_units=tuple(SyncUnit(tuple(u["blocks"]), tuple(u["workers"])) for u in data["sync_units"]),
            comm_rounds=tuple(tuple(r) for r in data["comm_rounds"]),
            transfers=tuple(Transfer(t["layer"], t["src"], t["dst"], t["bytes"]) for t in data["transfers"]),
        )

    @classmethod
    def from_json(cls, text: str) -> "ExecutionPlan":
        return cls.from_dict(json.loads(text))

    def to_columns(self) -> dict[str, Any]:
        """The plan as columns (stage workers, layer bounds and micro-batches of every pipeline
        each in one list, as ``_deltas``): ``to_dict`` repeats field names per stage and
        writes id after id, 1.2 MB at 16,384 ranks."""
        stages = [stage for pipeline in self.pipelines for stage in pipeline.stages]
        return {
            "generation": self.generation, "policy": self.policy, "num_layers": self.num_layers,
            "tensor_parallel_size": self.tensor_parallel_size,
            "stage_counts": [pipeline.num_stages for pipeline in self.pipelines],
            "workers": _deltas(stage.worker for stage in stages),
            "layers": _deltas(bound for stage in stages for bound in stage.layers),
            "micro_batch_counts": [len(pipeline.micro_batches) for pipeline in self.pipelines],
            "micro_batches": _deltas(m for pipeline in self.pipelines for m in pipeline.micro_batches),
            "reroutes": [[r.pipeline, r.stage, r.worker, list(r.micro_batches)] for r in self.reroutes],
            "sync_units": [[list(unit.blocks), _deltas(unit.workers)] for unit in self.sync_units],
            "comm_rounds": [list(r) for r in self.comm_rounds],
            "transfers": [[t.layer, t.src, t.dst, t.bytes] for t in self.transfers],
        }

    @classmethod
    def from_columns(cls, data: dict[str, Any]) -> "ExecutionPlan":
        """The plan ``to_columns`` wrote; ValueError, KeyError, TypeError or IndexError where
        ``data`` is not one."""
        if not all(_is_int(data[name]) for name in ("generation", "num_layers", "tensor_parallel_size")):
            raise ValueError("a plan's generation, num_layers and tensor_parallel_size must be integers")
        stage_counts = data["stage_counts"]
        workers = _cut(_sums(data["workers"], optional=True), stage_counts)
        layers = _cut(_sums(data["layers"]), [2 * n for n in stage_counts])
        micro_batches = _cut(_sums(data["micro_batches"]), data["micro_batch_counts"])
        if len(micro_batches) != len(workers):
            raise ValueError(f"{len(workers)} pipelines' stages, {len(micro_batches)} pipelines' micro-batches")
        pipelines = tuple(
            PipelinePlan(tuple(StagePlan(w, (bounds[2 * i], bounds[2 * i + 1])) for i, w in enumerate(ws)),
                         tuple(mbs))
            for ws, bounds, mbs in zip(workers, layers, micro_batches))
        return cls(
            generation=data["generation"], policy=data["policy"], num_layers=data["num_layers"],
            tensor_parallel_size=data["tensor_parallel_size"], pipelines=pipelines,
            reroutes=tuple(Reroute(p, s, w, tuple(mbs)) for p, s, w, mbs in data["reroutes"]),
            sync_units=tuple(SyncUnit(tuple(blocks), tuple(_sums(ws))) for blocks, ws in data["sync_units"]),
            comm_rounds=tuple(tuple(r) for r in data["comm_rounds"]),
            transfers=tuple(Transfer(layer, src, dst, size) for layer, src, dst, size in data["transfers"]),
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _deltas(values: Iterable[Optional[int]]) -> list[Optional[int]]:
    """Each value less the last value before it (None stays None): runs of worker ids,
    micro-batches and layer bounds become runs of one number, which zlib folds away."""
    out, last = [], 0
    for value in values:
        out.append(None if value is None else value - last)
        last = last if value is None else value
    return out


def _sums(deltas: Any, *, optional: bool = False) -> list[Optional[int]]:
    """The values ``_deltas`` was given."""
    out, last = [], 0
    for delta in deltas:
        if not (_is_int(delta) or (optional and delta is None)):
            raise ValueError(f"{delta!r} in a plan column is not an integer")
        last = last if delta is None else last + delta
        out.append(None if delta is None else last)
    return out


def _cut(values: list, counts: Any) -> list[list]:
    """``values`` cut into consecutive pieces of ``counts``, which must cover it exactly."""
    if not (isinstance(counts, list) and all(_is_int(c) and c >= 0 for c in counts) and sum(counts) == len(values)):
        raise ValueError(f"{len(values)} plan values cannot be cut into pieces of {str(counts)[:100]}")
    pieces, at = [], 0
    for count in counts:
        pieces.append(values[at:at + count])
        at += count
    return pieces


def validate_plan(plan: ExecutionPlan, *, num_micro_batches: int) -> None:
    """Raise ValueError unless the plan trains every layer once per pipeline and every
    micro-batch exactly once per step, with no worker owning two stages."""
    owners = plan.workers
    if len(owners) != len(set(owners)):
        raise ValueError("a worker owns more than one stage")
    for pi, pipeline in enumerate(plan.pipelines):
        if not pipeline.stages:
            raise ValueError(f"pipeline {pi} has no stages")
        expected = 0
        for stage in pipeline.stages:
            start, end = stage.layers
            if start != expected or end <= start:
                raise ValueError(f"pipeline {pi} layers are not a contiguous cover: {pipeline.layer_counts}")
            expected = end
        if expected != plan.num_layers:
            raise ValueError(f"pipeline {pi} covers {expected} of {plan.num_layers} layers")
        if not pipeline.micro_batches:
            raise ValueError(f"pipeline {pi} is idle (no micro-batches)")
    ids = sorted(m for p in plan.pipelines for m in p.micro_batches)
    if ids != list(range(num_micro_batches)):
        raise ValueError(f"micro-batch ids are not exactly 0..{num_micro_batches - 1} once each")
    for pi, si, stage in plan.stage_positions():
        if stage.worker is None:
            covered = sorted(m for r in plan.reroutes if (r.pipeline, r.stage) == (pi, si) for m in r.micro_batches)
            if covered != sorted(plan.pipelines[pi].micro_batches):
                raise ValueError(f"failed stage {si} of pipeline {pi} has micro-batches nobody reroutes")
