"""Replica drop: torchft's fault-tolerant HSDP/DDP (scenario name ``replica_drop``).

torchft runs each data-parallel replica group under a quorum: the replica that lost a
rank leaves and the others go on at once, each keeping its own fixed batch, so the
global batch shrinks by the lost replicas' share. Those samples are trained nowhere and
are reported as dropped (torchft's work in progress to keep the batch constant is what
``redistribute`` models). The step in flight is not committed on any replica
(``should_commit`` fails), so a failure loses the interrupted step: half a step on
average, as every system here is charged. A repaired replica restarts and heals from a
peer (torchft's live checkpoint recovery) while the others train; the quorum admits it
after the communicator rebuild. Mechanism and costs shared with the other replica
systems: ``simulator.replicas``.
"""

from __future__ import annotations

from odyssey_megatron.simulator.replicas import ReplicaSystem


class ReplicaDropSystem(ReplicaSystem):
    name = "replica_drop"
    background_heal = True

    def shares(self, replicas: int) -> list[int]:
        """Every replica keeps its quota of the job's batch."""
        return [self.context.num_micro_batches // self.num_replicas] * replicas

    def lost_on_failure(self, replicas_before: int, replicas_lost: int) -> float:
        return self.step_s / 2
