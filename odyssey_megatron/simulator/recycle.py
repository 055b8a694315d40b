"""ReCycle (paper 003) in the simulator: reroute to same-stage peers, nothing else.

After a failure the failed stages' micro-batches go to their data-parallel peers. The
step time is ReCycle's own schedule over the rerouted op lists: Decoupled BackProp and
the Staggered Optimizer (``recycle_schedule``), plus the same DP sync as every system.
Normalization (paper 003, 4.2.1) moves each new failure to the stage of its pipeline
where rerouting costs least, by swapping roles with a survivor that then copies the
failed stage's weights from a peer. A stage that lost every replica, or a peer that
would run out of memory, means a checkpoint restart on a symmetric layout. A repaired
worker takes back the slot that names it, after copying that stage from a peer.

ReCycle decouples backward only where memory allows (deferred weight gradients keep
activations alive); here a plan whose decoupled schedule overflows a worker runs plain
1F1B instead. With ``decoupled=False`` the system is ReCycle as paper 001 models it
(Eq. 12-13: adopted micro-batches scheduled by plain 1F1B op lists), for comparison.
Normalization is greedy per failure; the paper's dynamic programme may also move
earlier failures again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import AbstractSet

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import estimate_plan, transfer_time
from odyssey_megatron.estimator.memory import peak_memory
from odyssey_megatron.plan import ExecutionPlan, StagePlan, Transfer
from odyssey_megatron.planner import reroute_plan
from odyssey_megatron.restorer import with_sync
from odyssey_megatron.simulator.checkpoint import restart_onto_symmetric
from odyssey_megatron.simulator.recycle_schedule import recycle_schedule
from odyssey_megatron.simulator.system import Outcome, SimulationContext, initial_layout


class ReCycleSystem:
    def __init__(self, context: SimulationContext, *, detection_s: float, reroute_s: float, decoupled: bool = True,
                 name: str = "recycle"):
        self.name = name
        self.decoupled = decoupled
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

    def _pipeline_time(self, plan: ExecutionPlan, cluster: ClusterState) -> float | None:
        """Seconds per iteration without DP sync; None when no schedule fits in memory."""
        profile = self.context.profile
        if self.decoupled:
            timing = recycle_schedule(plan, profile, cluster)
            if max(peak_memory(plan, profile, timing.memory_order).values()) <= profile.memory_budget_bytes:
                return timing.period_s
        estimate = estimate_plan(plan, profile, cluster)
        return estimate.pipeline_time_s if estimate.fits_memory else None

    def _speed(self, plan: ExecutionPlan, cluster: ClusterState) -> tuple[float, float, bool]:
        """(step seconds, samples/s, fits memory) of ``plan`` under ReCycle's schedule."""
        estimate = estimate_plan(plan, self.context.profile, cluster)
        pipeline_s = self._pipeline_time(plan, cluster)
        if pipeline_s is None:
            return estimate.step_time_s, estimate.samples_per_s, False
        step_s = pipeline_s + estimate.sync_time_s
        return step_s, estimate.samples_per_step / step_s, True

    def _rerouted(self, base: ExecutionPlan, cluster: ClusterState) -> ExecutionPlan | None:
        plan = reroute_plan(base, failed_workers=cluster.failed_workers, profile=self.context.profile)
        return None if plan is None else with_sync(plan, self.context.profile)

    def _reroute(self, cluster: ClusterState, now_s: float, note: str, *, lost_s: float, pause_s: float) -> Outcome:
        plan = self._rerouted(self.base, cluster)
        if plan is not None:
            step_s, samples_per_s, fits = self._speed(plan, cluster)
            if fits:
                self.step_s = step_s
                return Outcome(pause_s=pause_s, samples_per_s=samples_per_s, lost_s=lost_s, note=f"{note}: rerouted")
        outcome, plan, step_s = restart_onto_symmetric(
            self.context, cluster, now_s, f"{note}: no peer left for a stage"
        )
        if plan is not None:
            self.base, self.step_s = plan, step_s
        return outcome

    def _slot_of(self, worker: int) -> tuple[int, int] | None:
        for pi, si, stage in self.base.stage_positions():
            if stage.worker == worker:
                return pi, si
        return None

    def _holders(self, si: int, cluster: ClusterState, *, besides: int) -> list[int]:
        """Live workers other than ``besides`` that hold stage ``si``."""
        workers = [p.stages[si].worker for p in self.base.pipelines]
        return [w for w in workers if w is not None and w != besides and w not in cluster.failed_workers]

    def _copy_stage_s(self, pi: int, si: int, dst: int, cluster: ClusterState) -> float:
        """Seconds for ``dst`` to receive stage ``si``'s weights and optimizer state from a
        live peer (one on its node if any)."""
        peers = self._holders(si, cluster, besides=dst)
        if not peers:
            return 0.0  # no replica: the reroute fails and a restart follows
        src = min(peers, key=lambda w: (not cluster.same_node(w, dst), w))
        profile = self.context.profile
        transfers = [
            Transfer(block, src_rank, dst_rank, profile.block(block).state_bytes)
            for block in self.base.blocks_of_stage(pi, si, profile)
            for src_rank, dst_rank in zip(cluster.worker_ranks(src), cluster.worker_ranks(dst))
        ]
        return transfer_time(transfers, profile=profile, cluster=cluster, storage_bandwidth=1.0)  # no reads

    def _normalize(self, cluster: ClusterState, failed: AbstractSet[int]) -> float:
        """Move each failed worker's slot to the stage of its pipeline where rerouting is
        fastest (swapping with that stage's survivor); returns the longest copy."""
        copy_s = 0.0
        for worker in sorted(failed):
            slot = self._slot_of(worker)
            if slot is None or not self._holders(slot[1], cluster, besides=worker):
                continue  # not in the layout, or no survivor could copy its stage
            pi, si = slot
            plan = self._rerouted(self.base, cluster)
            unmoved_s = self._pipeline_time(plan, cluster) if plan else None
            best = (float("inf") if unmoved_s is None else unmoved_s, None)
            stages = list(self.base.pipelines[pi].stages)
            for sj, stage in enumerate(stages):
                if sj == si or stage.worker is None or stage.worker in cluster.failed_workers:
                    continue
                swapped = list(stages)
                swapped[si], swapped[sj] = StagePlan(stage.worker, stages[si].layers), StagePlan(worker, stage.layers)
                pipelines = list(self.base.pipelines)
                pipelines[pi] = replace(pipelines[pi], stages=tuple(swapped))
                candidate = replace(self.base, pipelines=tuple(pipelines))
                plan = self._rerouted(candidate, cluster)
                time_s = self._pipeline_time(plan, cluster) if plan is not None else None
                if time_s is not None and time_s < best[0] - 1e-9:
                    best = (time_s, (candidate, sj, stage.worker))
            if best[1] is not None:
                candidate, sj, survivor = best[1]
                self.base = candidate
                copy_s = max(copy_s, self._copy_stage_s(pi, si, survivor, cluster))
        return copy_s

    def on_failure(self, cluster: ClusterState, failed: AbstractSet[int], now_s: float) -> Outcome:
        copy_s = self._normalize(cluster, failed)
        return self._reroute(cluster, now_s, f"{len(failed)} worker(s) failed",
                             lost_s=self.step_s / 2, pause_s=self.detection_s + self.reroute_s + copy_s)

    def on_join(self, cluster: ClusterState, joined: AbstractSet[int], now_s: float) -> Outcome:
        copy_s = max([self._copy_stage_s(*slot, w, cluster) for w in joined if (slot := self._slot_of(w))],
                     default=0.0)
        return self._reroute(cluster, now_s, f"{len(joined)} worker(s) rejoined", lost_s=0.0,
                             pause_s=self.reroute_s + copy_s)
