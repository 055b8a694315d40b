"""Checkpoint-restart: the Varuna-style baseline. It restarts from the last checkpoint
on every failure and every repair (``simulator.restart``: onto layouts stock Megatron
runs unless the scenario names ``restart_layouts: varuna``), starting, like every
system, on the job's own plan."""

from __future__ import annotations

from typing import AbstractSet

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator import estimate_plan
from odyssey_megatron.simulator.restart import restart_from_checkpoint
from odyssey_megatron.simulator.system import Outcome, SimulationContext, initial_layout


class CheckpointRestartSystem:
    """Restart from the last checkpoint on every failure and every repair."""

    name = "checkpoint"
    spare_devices = 0

    def __init__(self, context: SimulationContext):
        self.context = context

    def start(self, cluster: ClusterState) -> float:
        """The job's own plan, as every system starts."""
        return estimate_plan(initial_layout(self.context), self.context.profile, cluster,
                             pricing=self.context.pricing).samples_per_s

    def on_failure(self, cluster: ClusterState, failed: AbstractSet[int], now_s: float) -> Outcome:
        return restart_from_checkpoint(self.context, cluster, now_s, f"{len(failed)} worker(s) failed")

    def on_join(self, cluster: ClusterState, joined: AbstractSet[int], now_s: float) -> Outcome:
        return restart_from_checkpoint(self.context, cluster, now_s, f"{len(joined)} worker(s) rejoined",
                                       after_failure=False)
