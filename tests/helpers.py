"""Small plan builders shared by the tests."""

from __future__ import annotations

from typing import Sequence

from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan
from odyssey_megatron.planner.layers import stage_ranges


def symmetric_plan(*, dp: int, pp: int, num_layers: int, micro_batches_per_pipeline: int) -> ExecutionPlan:
    """Megatron's layout: stage s of pipeline d on worker s * dp + d, even layers (remainder last)."""
    base, extra = divmod(num_layers, pp)
    split = tuple(base + (1 if s >= pp - extra else 0) for s in range(pp))
    return asymmetric_plan([split] * dp, [micro_batches_per_pipeline] * dp, worker_of=lambda d, s: s * dp + d)


def asymmetric_plan(
    splits: Sequence[tuple[int, ...]],
    micro_batches: Sequence[int],
    *,
    worker_of=None,
    policy: str = "reparallelize",
) -> ExecutionPlan:
    """Pipelines with the given layer counts per stage; workers numbered pipeline-major by default."""
    pipelines, next_worker, next_mb = [], 0, 0
    for d, (split, count) in enumerate(zip(splits, micro_batches)):
        stages = []
        for s, layers in enumerate(stage_ranges(split)):
            worker = worker_of(d, s) if worker_of else next_worker
            next_worker += 1
            stages.append(StagePlan(worker, layers))
        pipelines.append(PipelinePlan(tuple(stages), tuple(range(next_mb, next_mb + count))))
        next_mb += count
    return ExecutionPlan(
        generation=0,
        policy=policy if worker_of is None else "initial",
        num_layers=sum(splits[0]),
        tensor_parallel_size=1,
        pipelines=tuple(pipelines),
    )
