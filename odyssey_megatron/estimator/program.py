"""The step program of a plan: the op lists and flags the estimator priced it with.

``estimate_plan`` prices one pipeline of each class of identical untouched ones
(``estimator.distinct``); the program hands each pipeline of the class its
representative's op lists, renamed to its own workers and micro-batches, so every worker
runs the order that was priced.
"""

from __future__ import annotations

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.distinct import distinct_pipelines
from odyssey_megatron.estimator.memory import held_profile
from odyssey_megatron.estimator.step_schedule import timed_step_schedule
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import WEIGHT_GRAD
from odyssey_megatron.schedules.program import StepProgram
from odyssey_megatron.settings import PLAIN, Pricing


def step_program(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None = None,
    *,
    pricing: Pricing = PLAIN,
    memo: dict | None = None,
) -> StepProgram:
    """What every worker of ``plan`` runs per step, as ``estimate_plan`` with the same
    arguments priced it: its op lists (split backwards where ``pricing.decouple`` lets them
    pay) and whether optimizer steps are staggered (where ``pricing.staggered`` lets them
    pay: the priced step is the staggered period, shorter than the makespan)."""
    distinct, stands_for = distinct_pipelines(plan, cluster)
    timing, pipeline_s = timed_step_schedule(distinct, held_profile(plan, profile, pricing=pricing), cluster,
                                             pricing=pricing, memo=memo)
    kept = {}
    for pi, rep in enumerate(stands_for):
        kept.setdefault(rep, pi)  # the pipeline of ``plan`` each of ``distinct``'s is
    ops = {worker: tuple(op._replace(pipeline=kept[op.pipeline]) for op in listed)
           for worker, listed in timing.schedule.items()}
    for pi, rep in enumerate(stands_for):
        if kept[rep] == pi:
            continue  # priced itself
        source, target = plan.pipelines[kept[rep]], plan.pipelines[pi]
        micro_batch = dict(zip(source.micro_batches, target.micro_batches))
        for own, theirs in zip(source.stages, target.stages):
            ops[theirs.worker] = tuple(op._replace(pipeline=pi, micro_batch=micro_batch[op.micro_batch])
                                       for op in ops[own.worker])
    return StepProgram(generation=plan.generation, ops=ops, staggered_optimizer=pipeline_s < timing.makespan_s,
                       split_backward=any(op.kind == WEIGHT_GRAD for listed in ops.values() for op in listed))
