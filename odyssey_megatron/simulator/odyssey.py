"""Odyssey in the simulator: the real decision center, the same code as the live runtime.

On a failure the decision center picks reroute or reparallelize by Eq. 8; the pause is
detection plus the chosen candidate's transition (modelled search time, restorer's
transfer time, restart cost). The in-flight step is lost. When a stage lost every
replica and no layer survives anywhere, Odyssey too must restart from a checkpoint.

With ``odyssey.batch_on_failure: shrink`` (the scenario's ``odyssey_shrink``) a decision
may drop the broken pipelines' micro-batches: the samples its steps lack against the
job's global batch are ``dropped_samples``, counted as replica drop's are.

Eq. 8's failure rate is the scenario's (``scenario_failure_model``): the truth its failures
are drawn from, where a live run starts from a prior and learns. Without repairs its
horizon ends with the scenario. The *oracle* is the same system with hindsight: Eq. 8 gets
the actual time to the next event instead of the expected one, which is the best any
policy choice could do.

Step times are the runtime's as configured (``odyssey.decoupled_weight_grads``,
``odyssey.staggered_optimizer``). A staggered step that clipping should have scaled is
retaken at the cost of the forwards its next step ran before settling; how often
gradients clip depends on the training run, so that cost is not charged here.
"""

from __future__ import annotations

from typing import AbstractSet, Sequence

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import OdysseyConfig
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner import FailureRateModel, UnrecoverableFailure
from odyssey_megatron.planner.initial import node_aligned
from odyssey_megatron.simulator.restart import restart_onto_symmetric
from odyssey_megatron.simulator.scenario import FailureConfig
from odyssey_megatron.simulator.system import Horizon, Outcome, SimulationContext, initial_layout


def scenario_failure_model(failures: FailureConfig, *, learn: bool) -> FailureRateModel | None:
    """The failure rate Odyssey's Eq. 8 weighs by in a scenario: the one its failures are
    drawn from, fixed (a node failure is one event at the devices' summed rate, as the live
    run counts it); None (the recipe's prior, learned as the run goes) where ``learn`` or
    where a trace gives no rate."""
    if learn or failures.process == "trace":
        return None
    rate = failures.rate_per_device_hour
    return FailureRateModel(device_mtbf_hours=1.0 / rate, learn=False,
                            given_by=f"the scenario's failures.rate_per_device_hour={rate:g}")


class OdysseySystem:
    spare_devices = 0
    def __init__(
        self,
        context: SimulationContext,
        *,
        settings: OdysseyConfig,
        detection_s: float,
        decision_s: float,
        event_times: Sequence[float] | None = None,
        horizon_s: float = float("inf"),
        name: str = "odyssey",
        failure_model: FailureRateModel | None = None,
        repairs: bool = True,
        mean_repair_s: float = 7200.0,
        failure_unit: str = "device",
    ):
        """``decision_s``: the modelled search time each decision charges. ``event_times``
        (all cluster events, sorted) turns on hindsight, the oracle: the interval Eq. 8 sees
        is the real one, to the next event or the ``horizon_s`` (the scenario's end).
        ``failure_model``: Eq. 8's failure rate (``scenario_failure_model``; None: the
        recipe's). Without ``repairs`` no worker comes back, and Eq. 8's horizon is cut at
        ``horizon_s``; with them a failed unit is back after ``mean_repair_s`` on average.
        ``failure_unit`` (``device`` or ``node``) is what fails in the scenario."""
        self.name = name
        self.context = context
        self.settings = settings
        self.detection_s = detection_s
        self.decision_s = decision_s
        self.event_times = event_times
        self.horizon_s = horizon_s
        self.failure_model = failure_model
        self.repairs = repairs
        self.mean_repair_s = mean_repair_s
        self.failure_unit = failure_unit
        self.center: DecisionCenter | None = None
        """The decision center the live runtime runs, built on ``start``."""
        self.step_s = 0.0

    def start(self, cluster: ClusterState) -> float:
        """Starts on the placement of the job's plan that trains more by expectation
        (``_expected_rate``): Megatron's rank order, or each pipeline on whole nodes
        (``planner.initial.node_aligned``, as torchft places replicas). Odyssey places its
        own plan, so it starts on the planner's best, as the replica systems start on theirs."""
        plan = initial_layout(self.context, max_layer_splits=self.settings.max_layer_splits)
        placements = (plan, node_aligned(plan, self.context.profile))
        self.center = max((self._center(p, cluster) for p in placements), key=self._expected_rate)  # a tie: Megatron's
        estimate = self.center.estimate
        self.step_s = estimate.step_time_s
        return estimate.samples_per_s

    def _center(self, plan: ExecutionPlan, cluster: ClusterState) -> DecisionCenter:
        return DecisionCenter(plan=plan, cluster=cluster, profile=self.context.profile,
                              settings=self.settings.decisions, search_time_s=self.decision_s,
                              failure_model=self.failure_model)

    def _expected_rate(self, center: DecisionCenter) -> float:
        """Samples/s over the scenario if ``center``'s plan trains at its failure-free rate
        except while degraded, where it trains at the rate its decision after a first failure
        reaches, averaged over one failure of each stage (the unit, device or node, of the
        middle pipeline's worker of that stage: where a reroute lands depends on the stage,
        and the first pipeline's can land apart, 538.7 against 518.2 samples/s on 7B's 1,024
        node-aligned workers): degraded from the first failure expected to the end without
        repairs, a mean repair time per failure with them. A placement is a choice for every
        failure to come and this weighs the first only: where dozens come (paper 001's rate)
        it can keep Megatron's order where node-aligned pipelines train more (README)."""
        first_s = center.failure_model.expected_interval_s(center.cluster.alive_devices)
        if self.repairs:
            degraded = min(1.0, self.mean_repair_s / first_s)
        else:
            degraded = max(0.0, 1.0 - first_s / self.horizon_s)
        cluster, middle = center.cluster, center.plan.pipelines[len(center.plan.pipelines) // 2]
        if self.failure_unit == "node":
            cases = [{"nodes": [n]} for n in dict.fromkeys(cluster.node_of_worker(stage.worker)
                                                           for stage in middle.stages)]
        else:
            cases = [{"workers": [stage.worker]} for stage in middle.stages]
        after = []
        for case in cases:  # a decision commits its plan: each is priced on a center of its own
            try:
                decision = self._center(center.plan, cluster).on_failure(**case, time_left_s=self._time_left(0.0),
                                                                         in_memory=True)
                after.append(decision.chosen.estimate.samples_per_s)
            except UnrecoverableFailure:
                after.append(0.0)
        return (1.0 - degraded) * center.estimate.samples_per_s + degraded * sum(after) / len(after)

    def _interval(self, now_s: float) -> float | None:
        if self.event_times is None:
            return None
        return min([t for t in self.event_times if t > now_s] + [self.horizon_s]) - now_s

    def _time_left(self, now_s: float) -> float | None:
        """The scenario's seconds left, where no worker comes back (Eq. 8's horizon ends there)."""
        return None if self.repairs else self.horizon_s - now_s

    def _restart(self, cluster: ClusterState, now_s: float, note: str) -> Outcome:
        outcome, plan, step_s = restart_onto_symmetric(self.context, cluster, now_s, note)
        if plan is not None:
            self.center.settle(plan)
            self.step_s = step_s
        return outcome

    def _react(self, cluster: ClusterState, now_s: float, note: str, *, workers: AbstractSet[int],
               failed: bool) -> Outcome:
        """Tell the decision center that ``workers`` failed (or rejoined) and price the pause."""
        lost = self.step_s / 2 if failed else 0.0  # the interrupted step, half done on average
        try:
            if failed:
                decision = self.center.on_failure(workers=sorted(workers), at_s=now_s, interval_s=self._interval(now_s),
                                                  time_left_s=self._time_left(now_s), in_memory=True)
            else:
                decision = self.center.on_join(workers=sorted(workers), at_s=now_s, interval_s=self._interval(now_s),
                                               time_left_s=self._time_left(now_s))
        except UnrecoverableFailure as exc:
            return self._restart(cluster, now_s, f"{note}: {exc}")
        chosen = decision.chosen
        self.step_s = chosen.estimate.step_time_s
        pause = (self.detection_s if failed else 0.0) + chosen.transition_s
        return Outcome(pause_s=pause, samples_per_s=chosen.estimate.samples_per_s, lost_s=lost,
                       dropped_per_s=chosen.dropped_samples_per_step / chosen.estimate.step_time_s,
                       note=f"{note}: {chosen.policy} {chosen.layout}",
                       horizon=Horizon(now_s, decision.expected_interval_s,
                                       "hindsight: the scenario's next event, or its end" if self.event_times
                                       is not None else decision.interval_source, decision.horizon_s))

    def on_failure(self, cluster: ClusterState, failed: AbstractSet[int], now_s: float) -> Outcome:
        return self._react(cluster, now_s, f"{len(failed)} worker(s) failed", workers=failed, failed=True)

    def on_join(self, cluster: ClusterState, joined: AbstractSet[int], now_s: float) -> Outcome:
        return self._react(cluster, now_s, f"{len(joined)} worker(s) rejoined", workers=joined, failed=False)
