"""ReCycle (paper 003) in the simulator: reroute to same-stage peers, nothing else.

After a failure the failed stages' micro-batches go to their data-parallel peers; the
step time is the estimator's list-scheduled op lists of that rerouted plan, so adopted
micro-batches fill bubbles as far as the schedule allows (ReCycle's decoupled backward
would fill a little more: an approximation in ReCycle's favour is not made). When a
stage has lost every replica, or a peer would run out of memory, ReCycle restarts from
the last checkpoint on a symmetric layout. A repaired worker takes its old place back.
"""

from __future__ import annotations

from typing import AbstractSet

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.planner import reroute_plan
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.simulator.checkpoint import restart_onto_symmetric
from odyssey_megatron.simulator.system import Outcome, SimulationContext, initial_layout


class ReCycleSystem:
    name = "recycle"

    def __init__(self, context: SimulationContext, *, detection_s: float, reroute_s: float):
        self.context = context
        self.detection_s = detection_s
        self.reroute_s = reroute_s
        self.base = initial_layout(context)
        """The layout rerouting is relative to: the original one, or the one restarted onto."""
        self.step_s = 0.0

    def start(self, cluster: ClusterState) -> float:
        estimate = estimate_plan(self.base, self.context.profile, cluster)
        self.step_s = estimate.step_time_s
        return estimate.samples_per_s

    def _reroute(self, cluster: ClusterState, now_s: float, note: str, *, lost_s: float, pause_s: float) -> Outcome:
        failed = cluster.failed_workers
        plan = reroute_plan(self.base, failed_workers=failed, profile=self.context.profile)
        if plan is not None:
            plan = with_sync(plan, self.context.profile)
            estimate = estimate_plan(plan, self.context.profile, cluster)
            if estimate.fits_memory:
                self.step_s = estimate.step_time_s
                return Outcome(pause_s=pause_s, samples_per_s=estimate.samples_per_s, lost_s=lost_s,
                               note=f"{note}: rerouted")
        outcome, plan, step_s = restart_onto_symmetric(
            self.context, cluster, now_s, f"{note}: no peer left for a stage"
        )
        if plan is not None:
            self.base, self.step_s = plan, step_s
        return outcome

    def on_failure(self, cluster: ClusterState, failed: AbstractSet[int], now_s: float) -> Outcome:
        return self._reroute(cluster, now_s, f"{len(failed)} worker(s) failed",
                             lost_s=self.step_s / 2, pause_s=self.detection_s + self.reroute_s)

    def on_join(self, cluster: ClusterState, joined: AbstractSet[int], now_s: float) -> Outcome:
        return self._reroute(cluster, now_s, f"{len(joined)} worker(s) rejoined", lost_s=0.0, pause_s=self.reroute_s)
