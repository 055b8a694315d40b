"""DP scale-in: Huawei MindCluster elastic training (scenario name ``dp_scale_in``).

With no backup node to reschedule onto, MindCluster scales the job in by whole DP
domains: the faulty domain's pods are removed, the training processes stop, and the
healthy ones rebuild their communication groups and go on, their state kept in memory
(MindIO's optimizer replicas; no checkpoint is read). The interrupted step is lost. When
the removed pods can be scheduled again (here: once their failed hosts are repaired;
there are no spares), the job scales back out: the pods start while the others train,
then every domain stops while the groups are rebuilt and the new domain receives its
state from a peer, so that copy is on the whole job's clock. Assumed: the global batch
is kept, the survivors taking over the removed domains' micro-batches as in
``redistribute``. Not modelled: a fault in the pod holding rank 0, which MindCluster
cannot scale in (it falls back to process-level rescheduling). Mechanism and costs
shared with the other replica systems: ``simulator.replicas``.
"""

from __future__ import annotations

from odyssey_megatron.planner.batch import distribute_batch
from odyssey_megatron.simulator.replicas import ReplicaSystem


class DpScaleInSystem(ReplicaSystem):
    name = "dp_scale_in"
    background_heal = False

    def shares(self, replicas: int) -> list[int]:
        """The job's micro-batches spread over the remaining domains."""
        return distribute_batch(self.context.num_micro_batches, [self.context.pipeline_parallel_size] * replicas)

    def lost_on_failure(self, replicas_before: int, replicas_lost: int) -> float:
        return self.step_s / 2
