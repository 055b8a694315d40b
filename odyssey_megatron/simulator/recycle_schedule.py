"""ReCycle's step time after rerouting (paper 003, sections 3.2-3.3), from its op lists.

ReCycle fills pipeline bubbles with rerouted work by two mechanisms that plain 1F1B
does not have: Decoupled BackProp (a rerouting peer runs its weight gradients when
nothing else is ready, as memory allows) and the Staggered Optimizer (each stage steps
once its own DP peers are done, so early stages start the next iteration while late
ones are still in cool-down). ``estimator.decoupled`` schedules both; several iterations
run back to back and the step time is the steady-state period between them.
"""

from __future__ import annotations

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.estimator.decoupled import decoupled_pipelines
from odyssey_megatron.estimator.memory import peak_memory
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile

ITERATIONS = 3
"""Iterations scheduled back to back; the first absorbs the start-up transient."""


def recycle_pipeline_time(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None, *, floor_s: float
) -> float | None:
    """Seconds per iteration of a rerouted ``plan`` run the way ReCycle runs it (DP sync
    excluded): its schedule where that fits in memory, else plain 1F1B op lists; None when
    neither fits. Decoupling absorbs adopted work but is not credited with beating
    ``floor_s``, the fault-free 1F1B step of the layout every system starts from."""
    timing = decoupled_pipelines(plan, profile, cluster, iterations=ITERATIONS)
    if max(peak_memory(plan, profile, timing.first.schedule).values()) <= profile.memory_budget_bytes:
        return max(timing.period_s, floor_s)
    estimate = estimate_plan(plan, profile, cluster)
    return estimate.pipeline_time_s if estimate.fits_memory else None
