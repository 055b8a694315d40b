"""Hot spares: in-job restart onto spare nodes (scenario name ``hot_spares``).

nvidia-resiliency-ext's in-job restart with spare nodes, TrainMover (about 20 s) and
DeadPool (under 40 s) keep warm nodes beside the job: a failed node, or the node of a
failed device, is swapped for a spare and the job restarts in place
(``hot_spares.restart_s`` after detection), on the job's own plan at its full rate. The
state comes from the live peers in memory, so only the interrupted step is lost (half a
step on average, as every system here is charged). A repaired node joins the spare pool
without touching the job. The spares are paid for all the time: ``spare_devices``
counts in the goodput's denominator.

When no spare is left, the job cannot keep its size: like checkpoint-restart it restarts
from the last checkpoint on the survivors' best symmetric layout
(``restart_from_checkpoint``), and it restarts again onto its own plan once repaired
nodes cover every missing one. Not modelled: a spare failing while it stands in (a
failure slot that is down waits for its own repair before it can fail again).
"""

from __future__ import annotations

from typing import AbstractSet

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.simulator.restart import restart_from_checkpoint, time_since_checkpoint
from odyssey_megatron.simulator.system import RESTARTING, Outcome, SimulationContext, initial_layout


def spare_devices_for(devices: int, *, rack_devices: int, spares_per_rack: int, devices_per_node: int) -> int:
    """Spares a job of ``devices`` holds: ``spares_per_rack`` in each rack of
    ``rack_devices`` it fills, in whole nodes."""
    racks = -(-devices // (rack_devices - spares_per_rack))
    return -(-racks * spares_per_rack // devices_per_node) * devices_per_node


class HotSparesSystem:
    name = "hot_spares"

    def __init__(self, context: SimulationContext, *, detection_s: float, restart_s: float, spare_devices: int):
        self.context = context
        self.detection_s = detection_s
        self.restart_s = restart_s
        self.spare_devices = spare_devices
        self.free_nodes = spare_devices // context.devices_per_node
        """Spare nodes standing by."""
        self.covered: set[int] = set()
        """The job's nodes down, a spare in their place."""
        self.missing: set[int] = set()
        """The job's nodes down with no spare left to take their place."""
        self.full_rate = 0.0
        """The job's plan's samples/s."""
        self.rate = 0.0
        """Samples/s now."""
        self.step_s = 0.0

    def start(self, cluster: ClusterState) -> float:
        """The job's own plan, as every system starts."""
        estimate = estimate_plan(initial_layout(self.context), self.context.profile, cluster,
                                 pricing=self.context.pricing)
        self.full_rate = self.rate = estimate.samples_per_s
        self.step_s = estimate.step_time_s
        return self.full_rate

    def _shrunk(self, cluster: ClusterState) -> ClusterState:
        """A cluster short of the missing nodes (the restart packs the survivors)."""
        return ClusterState(world_size=cluster.world_size, tensor_parallel_size=cluster.tensor_parallel_size,
                            devices_per_node=cluster.devices_per_node).fail_nodes(range(len(self.missing)))

    def _place_spares(self, cluster: ClusterState) -> int:
        """Follow ``cluster``: a node whose devices are all repaired frees its spare (or
        stops missing); a node newly down takes a free spare, else goes missing; the
        missing take spares freed. Returns how many nodes a spare newly took over."""
        down = {cluster.node_of_worker(w) for w in cluster.failed_workers}
        healed = (self.covered | self.missing) - down
        self.free_nodes += len(healed & self.covered)
        self.covered -= healed
        self.missing -= healed
        self.missing |= down - self.covered
        swapped = min(len(self.missing), self.free_nodes)
        for node in sorted(self.missing)[:swapped]:
            self.missing.remove(node)
            self.covered.add(node)
        self.free_nodes -= swapped
        return swapped

    def on_failure(self, cluster: ClusterState, failed: AbstractSet[int], now_s: float) -> Outcome:
        missing_before = len(self.missing)
        swapped = self._place_spares(cluster)
        note = f"{len(failed)} worker(s) failed: {swapped} spare node(s) in, {self.free_nodes} left"
        if len(self.missing) > missing_before:
            outcome = restart_from_checkpoint(self.context, self._shrunk(cluster), now_s,
                                              f"{note}, {len(self.missing)} node(s) missing")
        elif swapped:
            outcome = Outcome(pause_s=self.detection_s + self.restart_s, samples_per_s=self.rate,
                              lost_s=self.step_s / 2, note=note)
        else:  # a node already down or missing
            outcome = Outcome(pause_s=0.0, samples_per_s=self.rate, note=note)
        self.rate = outcome.samples_per_s
        return outcome

    def on_join(self, cluster: ClusterState, joined: AbstractSet[int], now_s: float) -> Outcome:
        """A repaired node frees its spare, which a missing node takes: once none is
        missing the job restarts onto its own plan; until then it goes on as it is."""
        missing_before = len(self.missing)
        self._place_spares(cluster)
        note = f"{len(joined)} worker(s) repaired: {len(self.missing)} node(s) missing, {self.free_nodes} spare"
        if missing_before and not self.missing:
            self.rate = self.full_rate
            return Outcome(pause_s=self.context.restart_s + self.context.checkpoint_load_s,
                           samples_per_s=self.full_rate, lost_s=time_since_checkpoint(self.context, now_s),
                           pause_state=RESTARTING, note=f"{note}; restarted on the job's plan")
        return Outcome(pause_s=0.0, samples_per_s=self.rate, note=note)
