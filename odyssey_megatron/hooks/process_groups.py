"""Process groups for one plan generation.

Every rank calls ``dist.new_group`` for every group, in the same order (gloo and NCCL
both require it), and keeps only its own. Making a group waits for no other member: it
publishes this rank's address (``collective_guard.prepare_backend``), and the collective
guard connects the members when it takes the groups in (``CollectiveGuard.track``), in an
operation it leaves if a member died. A rank gets:

- its TP group (the ranks of its worker) and a singleton group that stands in for
  Megatron's PP/CP/EP/DP groups: to Megatron a stage is a whole model; the Odyssey
  executor moves activations between stages and ``LayerGradSync`` does DP sync;
- one DP group per sync unit it belongs to, per TP rank: the k-th ranks of the unit's
  workers all-reduce shard k;
- its pipeline's PP group (per TP rank), for Megatron's own 1F1B schedule, when no
  stage of that pipeline has failed and the stages' ranks ascend (``megatron_pipeline``);
- a group of every rank that trains (the plan's workers) for the global gradient norm;
  a survivor that only sends blocks while entering the plan (``ExecutionPlan.participants``)
  is in the world but not in it.

Plans name workers; ``RankMap`` says which process ranks a worker has in the current
world (after a failure the survivors re-form a smaller world with new ranks). A new plan
gets a new set of groups; ``PlanGroups.destroy`` drops this set's groups.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from odyssey_megatron.plan import ExecutionPlan, PipelinePlan


@dataclass(frozen=True)
class RankMap:
    """Workers present in this world, in rank order; worker i of the list has ranks
    i*TP .. i*TP+TP-1."""

    workers: tuple[int, ...]
    tensor_parallel_size: int

    @classmethod
    def identity(cls, num_workers: int, tensor_parallel_size: int) -> "RankMap":
        return cls(tuple(range(num_workers)), tensor_parallel_size)

    @classmethod
    def of(cls, workers: Sequence[int], tensor_parallel_size: int) -> "RankMap":
        return cls(tuple(sorted(workers)), tensor_parallel_size)

    @property
    def world_size(self) -> int:
        return len(self.workers) * self.tensor_parallel_size

    def rank(self, worker: int, tp_rank: int = 0) -> int:
        return self.workers.index(worker) * self.tensor_parallel_size + tp_rank

    def of_launch_rank(self, launch_rank: int) -> int:
        """This world's rank of launch rank ``launch_rank`` (worker ``launch_rank // TP``)."""
        return self.rank(*divmod(launch_rank, self.tensor_parallel_size))

    def worker(self, rank: int) -> int:
        return self.workers[rank // self.tensor_parallel_size]


def megatron_pipeline(pipeline: PipelinePlan, ranks: RankMap) -> bool:
    """Whether Megatron's 1F1B can run ``pipeline``: every stage live, and stage i at group
    rank i, which needs ascending ranks since ``dist.new_group`` orders members by rank (a
    recovery's assignment may put a higher rank before a lower one)."""
    if any(stage.worker is None for stage in pipeline.stages):
        return False
    order = [ranks.rank(stage.worker) for stage in pipeline.stages]
    return order == sorted(order)


@dataclass
class PlanGroups:
    pg_collection: ProcessGroupCollection
    unit_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    """Sync unit index -> this rank's DP group for it (units of two or more workers only)."""
    pipeline_group: dist.ProcessGroup | None = None
    """This rank's pipeline (same TP rank on every stage), if ``megatron_pipeline``."""
    norm_group: dist.ProcessGroup | None = None
    """Every training rank: the global gradient norm's all-reduce, which may be in flight while
    the next step's point-to-point traffic runs on the default group."""
    _owned: list[dist.ProcessGroup] = field(default_factory=list)

    @property
    def owned(self) -> list[dist.ProcessGroup]:
        """Every group of this set that this rank is in."""
        return list(self._owned)

    def destroy(self) -> None:
        """Tear down this generation's groups; drop every other reference too (gloo closes
        sockets only when the last Python reference to a group is gone)."""
        for group in self._owned:
            dist.destroy_process_group(group)
        self._owned.clear()
        self.unit_groups.clear()
        self.pipeline_group = self.norm_group = None


def build_plan_groups(plan: ExecutionPlan, *, rank: int, ranks: RankMap,
                      timeout: datetime.timedelta | None = None,
                      on_shared: Callable[[], None] | None = None) -> PlanGroups:
    """This rank's groups for ``plan``; collective: every rank must call it. ``timeout``:
    how long an operation on them may wait (the collective timeout); without it a group
    takes its backend's default (gloo: 30 minutes), not the default group's. ``on_shared``
    is called after each group this rank shares with others is made (its address
    published, its peers still making theirs): where a fault injector strikes mid-setup."""
    tp = plan.tensor_parallel_size
    mine: list[dist.ProcessGroup] = []

    def create(ranks: list[int]) -> dist.ProcessGroup | None:
        group = dist.new_group(ranks, timeout=timeout)
        if rank not in ranks:
            return None
        mine.append(group)
        if len(ranks) > 1 and on_shared is not None:
            on_shared()
        return group

    singleton = tp_group = None
    for r in range(ranks.world_size):
        group = create([r])
        singleton = group if group is not None else singleton
    for w in ranks.workers:
        group = create([ranks.rank(w, k) for k in range(tp)])
        tp_group = group if group is not None else tp_group

    unit_groups = {}
    for index, unit in enumerate(plan.sync_units):
        if len(unit.workers) < 2:
            continue
        for k in range(tp):
            group = create([ranks.rank(w, k) for w in unit.workers])
            if group is not None:
                unit_groups[index] = group
    norm_group = create(sorted(ranks.rank(w, k) for w in plan.workers for k in range(tp)))
    pipeline_group = None
    for pipeline in plan.pipelines:
        if not megatron_pipeline(pipeline, ranks):
            continue
        for k in range(tp):
            group = create([ranks.rank(stage.worker, k) for stage in pipeline.stages])
            pipeline_group = group if group is not None else pipeline_group
    collection = ProcessGroupCollection(
        tp=tp_group, cp=singleton, pp=singleton, ep=singleton, expt_dp=singleton,
        embd=None, pos_embd=None, dp=singleton, dp_cp=singleton,
    )
    return PlanGroups(pg_collection=collection, unit_groups=unit_groups, pipeline_group=pipeline_group,
                      norm_group=norm_group, _owned=mine)
