"""Plans written down by their shape, for worked examples in tests and benchmarks."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan
from odyssey_megatron.planner.layers import stage_ranges


def pipelines_plan(splits: Sequence[tuple[int, ...]], micro_batches: Sequence[int], *,
                   worker_of: Optional[Callable[[int, int], int]] = None,
                   policy: str = "reparallelize") -> ExecutionPlan:
    """Pipelines with the given layers per stage and micro-batch counts (consecutive ids);
    workers numbered pipeline-major unless ``worker_of(pipeline, stage)`` says otherwise."""
    pipelines, next_worker, next_mb = [], 0, 0
    for d, (split, count) in enumerate(zip(splits, micro_batches)):
        stages = []
        for s, layers in enumerate(stage_ranges(split)):
            stages.append(StagePlan(worker_of(d, s) if worker_of else next_worker, layers))
            next_worker += 1
        pipelines.append(PipelinePlan(tuple(stages), tuple(range(next_mb, next_mb + count))))
        next_mb += count
    return ExecutionPlan(generation=0, policy=policy, num_layers=sum(splits[0]), tensor_parallel_size=1,
                         pipelines=tuple(pipelines))
