"""Estimator: step time, peak memory and transition time of an ExecutionPlan.

Step time = pipeline time from the op-list programme (Eq. 10-11; with staggered optimizer
steps its steady-state period) + DP gradient sync in coloured rounds + the optimizer
phase (the global norm's all-reduce and Adam, ``estimator.optimizer``) + with the
distributed optimizer the weight all-gather after it. Peak memory per
stage follows Eq. 14 on the real op lists, with the distributed optimizer's share of the
state at the plan's own holder counts (``memory.held_profile``). The closed forms (Eq. 9, 12-14) live in
``closed_form`` for textbook checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.communication import param_gather_time, sync_time
from odyssey_megatron.estimator.distinct import distinct_pipelines
from odyssey_megatron.estimator.memory import held_profile, peak_memory
from odyssey_megatron.estimator.optimizer import optimizer_time
from odyssey_megatron.estimator.replay import ScheduleDeadlock
from odyssey_megatron.estimator.step_schedule import timed_step_schedule
from odyssey_megatron.estimator.transition import transfer_time
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.settings import PLAIN, Pricing

__all__ = ["PlanEstimate", "ScheduleDeadlock", "estimate_plan", "transfer_time"]


@dataclass(frozen=True)
class PlanEstimate:
    pipeline_time_s: float
    sync_time_s: float
    optimizer_time_s: float
    """The global norm's all-reduce (unless steps are staggered) and the slowest rank's Adam step."""
    peak_memory_bytes: tuple[tuple[Optional[int], ...], ...]
    """Per pipeline, per stage; None for a failed stage (its peers carry its memory)."""
    memory_budget_bytes: int
    samples_per_step: int
    tokens_per_sample: int
    param_gather_time_s: float = 0.0
    """The distributed optimizer's weight all-gather after the step (``Pricing.distributed_optimizer``)."""

    @property
    def step_time_s(self) -> float:
        return self.pipeline_time_s + self.sync_time_s + self.optimizer_time_s + self.param_gather_time_s

    @property
    def max_peak_memory_bytes(self) -> int:
        return max((m for stage in self.peak_memory_bytes for m in stage if m is not None), default=0)

    @property
    def fits_memory(self) -> bool:
        return self.max_peak_memory_bytes <= self.memory_budget_bytes

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_time_s if self.step_time_s > 0 else float("inf")

    @property
    def tokens_per_s(self) -> float:
        return self.samples_per_s * self.tokens_per_sample


def estimate_plan(
    plan: ExecutionPlan,
    profile: ModelProfile,
    cluster: ClusterState | None = None,
    *,
    pricing: Pricing = PLAIN,
    memo: dict | None = None,
    slowdowns: Mapping[int, float] | None = None,
) -> PlanEstimate:
    """Estimate one step of ``plan`` as the runtime runs it (``step_schedule``: with
    ``pricing.decouple`` workers may split their backwards; ``pricing.staggered`` optimizer
    steps price the steady-state period where that pays; ``memo`` as in
    ``timed_step_schedule``); raises ScheduleDeadlock if its op lists cannot run. Pipelines
    that time alike are simulated once (``estimator.distinct``). ``slowdowns``: workers
    whose forwards and backwards take that many times their profiled seconds (a straggler
    at the slowdown ``runtime.control.stragglers`` measured over those ops); their op
    lists are chosen for that speed too. ``profile`` holds each block's whole optimizer
    state; its per-rank memory is taken at ``plan``'s holder counts (``held_profile``)."""
    held = held_profile(plan, profile, pricing=pricing)
    distinct, stands_for = distinct_pipelines(plan, cluster, slowdowns=slowdowns)
    timing, pipeline_s = timed_step_schedule(distinct, held, cluster, pricing=pricing, memo=memo,
                                             slowdowns=slowdowns)
    peaks = peak_memory(distinct, held, timing.schedule)
    return PlanEstimate(
        pipeline_time_s=pipeline_s,
        sync_time_s=sync_time(plan, profile, cluster),
        optimizer_time_s=optimizer_time(plan, profile, cluster, staggered=pipeline_s < timing.makespan_s,
                                        sharded=pricing.distributed_optimizer),
        peak_memory_bytes=tuple(
            tuple(peaks.get(kept.worker) if stage.worker is not None else None
                  for stage, kept in zip(p.stages, distinct.pipelines[stands_for[pi]].stages))
            for pi, p in enumerate(plan.pipelines)
        ),
        memory_budget_bytes=profile.memory_budget_bytes,
        samples_per_step=plan.num_micro_batches * profile.samples_per_micro_batch,
        tokens_per_sample=profile.tokens_per_sample,
        param_gather_time_s=param_gather_time(plan, profile, cluster) if pricing.distributed_optimizer else 0.0,
    )
