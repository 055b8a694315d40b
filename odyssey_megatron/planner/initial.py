"""The failure-free plan: Megatron's symmetric DP x PP layout, in Megatron's rank order or
with each pipeline on whole nodes."""

from __future__ import annotations

from dataclasses import replace

from odyssey_megatron.estimator.memory import layout_profile
from odyssey_megatron.plan import ExecutionPlan, PipelinePlan, StagePlan
from odyssey_megatron.planner.batch import assign_micro_batch_ids
from odyssey_megatron.planner.layers import SplitSearch, stage_ranges
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.settings import PLAIN, Pricing
from odyssey_megatron.units import GIB


def initial_plan(
    *,
    data_parallel_size: int,
    pipeline_parallel_size: int,
    tensor_parallel_size: int,
    num_micro_batches: int,
    profile: ModelProfile,
    max_layer_splits: int,
    pricing: Pricing = PLAIN,
) -> ExecutionPlan:
    """Stage s of pipeline d runs on worker s * DP + d (Megatron's tp-dp-pp rank order);
    raises ValueError if no layer split fits the memory budget, each rank keeping its
    share of the optimizer state at DP holders where ``pricing.distributed_optimizer``."""
    per_pipeline, rest = divmod(num_micro_batches, data_parallel_size)
    if rest:
        raise ValueError(f"{num_micro_batches} micro-batches do not split over {data_parallel_size} pipelines")
    held = layout_profile(profile, [pipeline_parallel_size] * data_parallel_size, pricing=pricing)
    best = SplitSearch(held, limit=max_layer_splits).best(pipeline_parallel_size, per_pipeline)
    if best is None:
        raise ValueError(
            f"no split of {profile.num_layers} layers over {pipeline_parallel_size} stages fits "
            f"the memory budget of {profile.memory_budget_bytes / GIB:.1f} GiB per device"
        )
    ranges = stage_ranges(best[0])
    ids = assign_micro_batch_ids([per_pipeline] * data_parallel_size)
    pipelines = tuple(
        PipelinePlan(
            stages=tuple(StagePlan(s * data_parallel_size + d, layers) for s, layers in enumerate(ranges)),
            micro_batches=ids[d],
        )
        for d in range(data_parallel_size)
    )
    plan = ExecutionPlan(
        generation=0,
        policy="initial",
        num_layers=profile.num_layers,
        tensor_parallel_size=tensor_parallel_size,
        pipelines=pipelines,
    )
    return with_sync(plan, profile)


def node_aligned(plan: ExecutionPlan, profile: ModelProfile) -> ExecutionPlan:
    """``plan`` (``initial_plan``'s) with pipeline d's stage s on worker d * PP + s: each
    pipeline on consecutive workers, so on whole nodes, as torchft deploys replica groups.
    Its stages send activations within a node and its gradients are all-reduced across
    nodes; a node failure takes out the pipelines on that node, not one stage of many."""
    pipelines = tuple(
        replace(pipeline, stages=tuple(replace(stage, worker=d * len(pipeline.stages) + s)
                                       for s, stage in enumerate(pipeline.stages)))
        for d, pipeline in enumerate(plan.pipelines)
    )
    return with_sync(replace(plan, pipelines=pipelines), profile)
