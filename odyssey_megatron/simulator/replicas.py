"""Data-parallel replicas that leave on a failure and come back after repair.

What replica drop (torchft), micro-batch redistribution (ReCoVer) and DP scale-in
(MindCluster) share. A *replica* is one pipeline of the job's plan (PP workers of TP
devices each: a DP domain). Replicas sit on whole nodes of their own, as torchft deploys
replica groups (``NODE_ALIGNED``: replica d on workers d * PP .. d * PP + PP - 1), so a
node failure takes out only the replicas on that node (one where a replica fills a node
or more); ``replica_placement: stage_major`` keeps the job's plan's placement instead
(Megatron's rank order), where one node holds one stage of several replicas and a node
failure takes them all out. A failed worker takes its whole replica out; the other
replicas go on in their slots (no stage moves, nothing is re-split). A replica stays out
until every one of its failed workers is repaired: it has fixed hosts and there are no
spares (the scheduler's free nodes are the repaired ones). It then restarts its
processes (``restart_s``), heals its stage state from a live peer replica (the
restorer's transfers from a same-stage peer, priced by ``transfer_time``), and joins
at a step boundary after the survivors rebuild their communicators
(``reconfigure_s``). Whether the healing runs while the others train or the whole job
waits for it is each system's mechanism (``background_heal``).

Prices: the replicas in, in their original slots, with their micro-batch shares
(``shares``: the failed replicas' quota spread over the survivors or dropped), priced by
the shared estimator with the job's schedule options and placed as they run: with no
failures, stage-major replicas train exactly at the job plan's rate; node-aligned ones at
their own plan's (activations sent within a node, gradients all-reduced across nodes).

With no replica left, no peer holds a whole model copy: the state since the last
checkpoint is lost and training stops until a replica is repaired, which then restarts
from the checkpoint (``restart_s + checkpoint_load_s``) and the others heal from it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import AbstractSet

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import estimate_plan, transfer_time
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner.batch import assign_micro_batch_ids
from odyssey_megatron.planner.initial import node_aligned
from odyssey_megatron.restorer import live_holdings, plan_transfers, with_sync
from odyssey_megatron.simulator.restart import time_since_checkpoint
from odyssey_megatron.simulator.system import (
    NODE_ALIGNED,
    RECOVERING,
    RESTARTING,
    Outcome,
    Phase,
    SimulationContext,
    initial_layout,
)


def replica_layout(context: SimulationContext) -> ExecutionPlan:
    """The job's plan with its pipelines placed per ``context.replica_placement``: as it is
    (stage-major), or each pipeline on whole nodes (``planner.initial.node_aligned``)."""
    plan = initial_layout(context)
    return node_aligned(plan, context.profile) if context.replica_placement == NODE_ALIGNED else plan


class ReplicaSystem:
    """The shared mechanism; a system names its batch policy (``shares``), what a
    failure rolls back (``lost_on_failure``) and how a rejoin heals (``background_heal``)."""

    name: str
    spare_devices = 0
    background_heal: bool
    """True: a rejoining replica heals from a peer while the others train (only the
    communicator rebuild pauses them); False: the whole job waits for the copy too."""

    def __init__(self, context: SimulationContext, *, detection_s: float, reconfigure_s: float):
        self.context = context
        self.detection_s = detection_s
        self.reconfigure_s = reconfigure_s
        self.base = replica_layout(context)
        self.replica_of = {stage.worker: index for index, pipeline in enumerate(self.base.pipelines)
                           for stage in pipeline.stages}
        """Which replica each worker serves."""
        self.out: set[int] = set()
        """Replicas with a failed worker."""
        self.available_at: dict[int, float] = {}
        """Repaired replicas restarting and healing: when each can be admitted."""
        self.joined_at: dict[int, float] = {}
        """When each of those joins (admitted after the ones before it), as last planned."""
        self.cold = False
        """No replica was left: the next one back restarts from the last checkpoint."""
        self.loaded_at = 0.0
        """When the last restart from a checkpoint has loaded it."""
        self.step_s = 0.0
        self._placement: ClusterState | None = None
        self._prices: dict[frozenset[int], tuple[float, float, float]] = {}

    # What each system decides.
    def shares(self, replicas: int) -> list[int]:
        """Micro-batches per replica in a step with ``replicas`` of them."""
        raise NotImplementedError

    def lost_on_failure(self, replicas_before: int, replicas_lost: int) -> float:
        """Seconds of training a failure that takes ``replicas_lost`` of ``replicas_before``
        replicas out throws away."""
        raise NotImplementedError

    # The shared mechanism.
    @property
    def num_replicas(self) -> int:
        return len(self.base.pipelines)

    def start(self, cluster: ClusterState) -> float:
        self._placement = ClusterState(world_size=cluster.world_size, tensor_parallel_size=cluster.tensor_parallel_size,
                                       devices_per_node=cluster.devices_per_node)
        step_s, samples_per_s, _ = self.price(frozenset(range(self.num_replicas)))
        self.step_s = step_s
        return samples_per_s

    def plan_of(self, replicas: AbstractSet[int]) -> ExecutionPlan:
        """The job's plan on ``replicas`` alone, in their slots, with ``shares``."""
        chosen = sorted(replicas)
        ids = assign_micro_batch_ids(self.shares(len(chosen)))
        pipelines = tuple(replace(self.base.pipelines[r], micro_batches=ids[i]) for i, r in enumerate(chosen))
        return with_sync(replace(self.base, pipelines=pipelines), self.context.profile)

    def price(self, replicas: frozenset[int]) -> tuple[float, float, float]:
        """(step seconds, samples/s, samples/s short of the global batch) with ``replicas`` in."""
        if not replicas:
            return 0.0, 0.0, 0.0
        if replicas not in self._prices:
            plan = self.plan_of(replicas)
            estimate = estimate_plan(plan, self.context.profile, self._placement, pricing=self.context.pricing)
            trained = sum(len(p.micro_batches) for p in plan.pipelines)
            short = (self.context.num_micro_batches - trained) * self.context.profile.samples_per_micro_batch
            self._prices[replicas] = (estimate.step_time_s, estimate.samples_per_s, short / estimate.step_time_s)
        return self._prices[replicas]

    def heal_s(self, replica: int, peer: int) -> float:
        """Copy ``peer``'s stage state to ``replica``'s workers (each worker from its
        same-stage peer, all at once)."""
        profile, cluster = self.context.profile, self._placement
        plan = self.plan_of({replica, peer})
        holdings = live_holdings(self.plan_of({peer}), cluster=cluster, profile=profile)
        holdings.update({stage.worker: [] for stage in self.base.pipelines[replica].stages})
        transfers = plan_transfers(plan, holdings=holdings, profile=profile, cluster=cluster)
        return transfer_time(transfers, profile=profile, cluster=cluster, storage_bandwidth=1.0)  # no reads

    def _in(self, now_s: float) -> set[int]:
        """Replicas training at ``now_s``: not out, and admitted if they were repaired."""
        return {r for r in range(self.num_replicas)
                if r not in self.out and (r not in self.available_at or self.joined_at.get(r, now_s + 1) <= now_s)}

    def _outcome(self, now_s: float, *, pause_s: float, lost_s: float, note: str, pause_state: str = RECOVERING) -> Outcome:
        """From ``now_s``: the pause (at least until a checkpoint being loaded is in), then
        one phase per replica still to join (training on those in, then the pause that
        admits the next), then the final throughput."""
        if self.loaded_at > now_s + pause_s:
            pause_s, pause_state = self.loaded_at - now_s, RESTARTING
        live = self._in(now_s)
        for replica in live:
            self.available_at.pop(replica, None)
            self.joined_at.pop(replica, None)
        ramp, t = [], now_s + pause_s
        for replica, available in sorted(self.available_at.items(), key=lambda item: (item[1], item[0])):
            _, rate, short = self.price(frozenset(live))
            if available > t:
                ramp.append(Phase(available - t, rate, short))
                t = available
            admit = self.reconfigure_s + (0.0 if self.background_heal else self._heal_from(replica, live))
            if admit > 0:
                ramp.append(Phase(admit, 0.0))
            t += admit
            self.joined_at[replica] = t
            live.add(replica)
        self.step_s, rate, short = self.price(frozenset(live))
        return Outcome(pause_s=pause_s, samples_per_s=rate, lost_s=lost_s, pause_state=pause_state, note=note,
                       ramp=tuple(ramp), dropped_per_s=short)

    def _heal_from(self, replica: int, live: AbstractSet[int]) -> float:
        return self.heal_s(replica, min(live)) if live else 0.0

    def on_failure(self, cluster: ClusterState, failed: AbstractSet[int], now_s: float) -> Outcome:
        live = self._in(now_s)
        hit = {self.replica_of[w] for w in failed if w in self.replica_of}
        self.out |= hit
        for replica in hit:
            self.available_at.pop(replica, None)
            self.joined_at.pop(replica, None)
        lost = hit & live
        note = f"{len(failed)} worker(s) failed: {len(lost)} replica(s) out, {len(live - lost)} in"
        if not lost:
            return self._outcome(now_s, pause_s=0.0, lost_s=0.0, note=note)
        if lost == live:  # no whole model copy left in memory
            self.cold = True
            self.available_at.clear()
            self.joined_at.clear()
            return Outcome(pause_s=0.0, samples_per_s=0.0, lost_s=time_since_checkpoint(self.context, now_s),
                           note=f"{note}: stopped until a replica is repaired")
        return self._outcome(now_s, pause_s=self.detection_s + self.reconfigure_s,
                             lost_s=self.lost_on_failure(len(live), len(lost)), note=note)

    def on_join(self, cluster: ClusterState, joined: AbstractSet[int], now_s: float) -> Outcome:
        live = self._in(now_s)
        back = {r for r in self.out
                if all(stage.worker not in cluster.failed_workers for stage in self.base.pipelines[r].stages)}
        self.out -= back
        note = f"{len(joined)} worker(s) rejoined: {len(back)} replica(s) back"
        if self.cold and back:  # the first replicas back load the checkpoint; later ones heal from them
            self.cold = False
            self.loaded_at = now_s + self.context.restart_s + self.context.checkpoint_load_s
            return self._outcome(now_s, pause_s=0.0, lost_s=0.0, note=f"{note}, from the last checkpoint")
        for replica in back:
            heal = self._heal_from(replica, live) if self.background_heal else 0.0
            self.available_at[replica] = now_s + self.context.restart_s + heal
        return self._outcome(now_s, pause_s=0.0, lost_s=0.0, note=note)
