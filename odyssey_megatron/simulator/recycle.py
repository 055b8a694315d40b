"""ReCycle (paper 003) in the simulator: reroute to same-stage peers, nothing else.

After a failure the failed stages' micro-batches go to their data-parallel peers. ReCycle
runs one schedule per failure set, repeated every iteration (paper 003, 4.2.2), with
Decoupled BackProp and the Staggered Optimizer as memory allows. The estimator prices
exactly that for Odyssey's reroutes (``estimator.step_schedule``: fixed op lists, split
backwards where they pay and fit, the staggered steady-state period), so
ReCycle's steps are priced by the same code, and the systems differ only in policy.
Normalization (paper 003, 4.2.1; ``planner.normalize``, which Odyssey's reroute uses
too) moves each new failure to the stage of its pipeline where rerouting costs least,
by swapping roles with a survivor that then copies the failed stage from a peer; it is
greedy per failure, where the paper's dynamic programme may also move earlier failures
again. A stage that lost every
replica, or a peer that would run out of memory, means a checkpoint restart on a
symmetric layout. A repaired worker takes back the slot that names it, after copying
that stage from a peer.

Its steps run with the job's schedule options (``SimulationContext.pricing``), like every
system's. With ``decoupled=False`` the system is ReCycle as paper 001 models it (Eq.
12-13: adopted micro-batches on plain 1F1B op lists, failure-free steps too), an
ablation whose failure-free step is slower by design.
"""

from __future__ import annotations

from typing import AbstractSet

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import estimate_plan, transfer_time
from odyssey_megatron.estimator.memory import held_profile
from odyssey_megatron.estimator.step_schedule import rerouted_makespan
from odyssey_megatron.plan import ExecutionPlan, Transfer
from odyssey_megatron.planner import reroute_plan
from odyssey_megatron.planner.normalize import normalize_failures
from odyssey_megatron.restorer import live_holdings, plan_transfers, with_sync
from odyssey_megatron.simulator.restart import restart_onto_symmetric
from odyssey_megatron.settings import PLAIN
from odyssey_megatron.simulator.system import Outcome, SimulationContext, initial_layout


class ReCycleSystem:
    spare_devices = 0
    def __init__(self, context: SimulationContext, *, detection_s: float, reroute_s: float, decoupled: bool = True,
                 name: str = "recycle"):
        self.name = name
        self.pricing = context.pricing if decoupled else PLAIN
        self.context = context
        self.detection_s = detection_s
        self.reroute_s = reroute_s
        self.base = initial_layout(context)
        """Which worker plays which slot: the original layout after normalization swaps,
        or the layout restarted onto."""
        self.step_s = 0.0

    def start(self, cluster: ClusterState) -> float:
        self.step_s, samples_per_s, _ = self._speed(self.base, cluster)
        return samples_per_s

    def _speed(self, plan: ExecutionPlan, cluster: ClusterState, memo: dict | None = None) -> tuple[float, float, bool]:
        """(step seconds, samples/s, fits memory) of ``plan`` under ReCycle's schedule;
        ``memo`` as in ``estimate_plan``."""
        estimate = estimate_plan(plan, self.context.profile, cluster, pricing=self.pricing, memo=memo)
        return estimate.step_time_s, estimate.samples_per_s, estimate.fits_memory

    def _reroute(self, cluster: ClusterState, now_s: float, note: str, *, lost_s: float, pause_s: float,
                 after_failure: bool, memo: dict | None = None) -> Outcome:
        plan = reroute_plan(self.base, failed_workers=cluster.failed_workers, profile=self.context.profile)
        why = "no peer left for a stage"
        if plan is not None:
            step_s, samples_per_s, fits = self._speed(with_sync(plan, self.context.profile), cluster, memo)
            if fits:
                self.step_s = step_s
                return Outcome(pause_s=pause_s, samples_per_s=samples_per_s, lost_s=lost_s, note=f"{note}: rerouted")
            why = "a peer would run out of memory"
        outcome, plan, step_s = restart_onto_symmetric(self.context, cluster, now_s, f"{note}: {why}",
                                                    after_failure=after_failure)
        if plan is not None:
            self.base, self.step_s = plan, step_s
        return outcome

    def _copy_s(self, transfers: tuple[Transfer, ...], cluster: ClusterState) -> float:
        return transfer_time(transfers, profile=self.context.profile, cluster=cluster, storage_bandwidth=1.0)  # no reads

    def _copies(self, layout: ExecutionPlan, holdings: dict, cluster: ClusterState) -> tuple[Transfer, ...]:
        """Stage copies that give ``layout``'s live owners their stages from ``holdings``
        (none where the layout cannot be rerouted: that is a checkpoint restart)."""
        profile = self.context.profile
        rerouted = reroute_plan(layout, failed_workers=cluster.failed_workers, profile=profile)
        if rerouted is None:
            return ()
        return plan_transfers(rerouted, holdings=holdings, profile=profile, cluster=cluster)

    def on_failure(self, cluster: ClusterState, failed: AbstractSet[int], now_s: float) -> Outcome:
        memo: dict = {}  # normalization's prices, reused for the chosen reroute; this cluster state only
        holdings = live_holdings(self.base, cluster=cluster, profile=self.context.profile)  # before any swap
        normalized = normalize_failures(
            self.base, new_failures=failed, cluster=cluster, profile=self.context.profile,
            cost=lambda plan: rerouted_makespan(plan, held_profile(plan, self.context.profile, pricing=self.pricing),
                                                cluster, pricing=self.pricing, memo=memo),
        )
        copies = self._copies(normalized, holdings, cluster) if normalized is not self.base else ()
        self.base = normalized
        copy_s = self._copy_s(copies, cluster)
        return self._reroute(cluster, now_s, f"{len(failed)} worker(s) failed",
                             lost_s=self.step_s / 2, pause_s=self.detection_s + self.reroute_s + copy_s, after_failure=True,
                             memo=memo)

    def on_join(self, cluster: ClusterState, joined: AbstractSet[int], now_s: float) -> Outcome:
        before = cluster.fail_ranks(r for w in joined for r in cluster.worker_ranks(w))  # the joined hold nothing
        holdings = {w: [] for w in cluster.alive_workers}
        holdings.update(live_holdings(self.base, cluster=before, profile=self.context.profile))
        copy_s = self._copy_s(self._copies(self.base, holdings, cluster), cluster)
        return self._reroute(cluster, now_s, f"{len(joined)} worker(s) rejoined", lost_s=0.0,
                             pause_s=self.reroute_s + copy_s, after_failure=False)
