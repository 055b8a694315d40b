"""The profile the decision center prices with, rescaled to what the job measures.

Every step, each training rank reports the seconds its forwards, its backwards (with
their split-off weight-gradient ops) and its Adam step took (``runtime.rank.op_timers``).
Summed over the ranks and set against what the starting profile predicts for the same
ops on the same stages (``ModelProfile.stage_times``, ``ModelProfile.optimizer_s``),
they give one factor per kind of work. An exponential moving average of each factor
rescales the starting profile: the blocks' forward times (and the fixed cost per op),
their backward and weight-gradient times, the optimizer's cost per parameter byte. The
profile's shape (a layer against the embedding and the head, the weight-gradient share)
stays the starting profile's, and its links and memory are not touched: the ranks time
compute, not communication.

A generation's first step is not used: a new stage model's first passes allocate.
Where ranks share a host's cores (8 CPU ranks on 2 cores), the factors include that
sharing, which a plan on fewer ranks would have less of.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.runtime.protocol.messages import StepReport

__all__ = ["OnlineProfile", "Scales"]

SMOOTHING = 0.3
"""Weight of the newest step's factors in the moving average."""
REPRICE_CHANGE = 0.1
"""A factor that moved this much (relative) since the decision center last took the
profile makes it take the new one."""


@dataclass(frozen=True)
class Scales:
    """Measured over predicted seconds, per kind of work."""

    forward: float = 1.0
    backward: float = 1.0
    optimizer: float = 1.0

    def differs(self, other: "Scales", *, by: float) -> bool:
        return any(abs(a / b - 1) > by for a, b in zip(self.as_tuple(), other.as_tuple()))

    def as_tuple(self) -> tuple[float, float, float]:
        return self.forward, self.backward, self.optimizer


class OnlineProfile:
    """The starting profile and the moving average of the measured factors."""

    def __init__(self, base: ModelProfile):
        self.base = base
        self.scales = Scales()
        self.steps_observed = 0

    def observe(self, plan: ExecutionPlan, reports: Iterable[StepReport]) -> None:
        """Fold one committed step of ``plan`` into the factors."""
        measured, predicted = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        stages = {stage.worker: (pi, si, stage) for pi, si, stage in plan.stage_positions()
                  if stage.worker is not None}
        holdings = plan.holdings(self.base)
        for report in reports:
            worker = report.rank // plan.tensor_parallel_size
            if worker not in stages:
                continue
            pi, si, stage = stages[worker]
            times = self.base.stage_times(*stage.layers, first=si == 0, last=si == plan.pipelines[pi].num_stages - 1)
            if report.forwards:
                measured[0] += report.forward_s
                predicted[0] += report.forwards * times.forward_s
            if report.backwards:
                measured[1] += report.backward_s + report.weight_grad_s
                predicted[1] += report.backwards * times.backward_s
            if report.optimizer_s > 0:
                measured[2] += report.optimizer_s
                predicted[2] += self.base.optimizer_s(holdings[worker])
        current = self.scales.as_tuple()
        step = [m / p if m > 0 and p > 0 else c for m, p, c in zip(measured, predicted, current)]
        weight = 1.0 if self.steps_observed == 0 else SMOOTHING
        self.scales = Scales(*(c + weight * (s - c) for s, c in zip(step, current)))
        self.steps_observed += 1

    def profile(self) -> ModelProfile:
        """The starting profile with its compute times rescaled by the factors."""
        forward, backward, optimizer = self.scales.as_tuple()
        base = self.base
        return replace(base.compute_scaled(forward=forward, backward=backward),
                       op_overhead_s=base.op_overhead_s * forward,
                       optimizer_s_per_param_byte=base.optimizer_s_per_param_byte * optimizer)
