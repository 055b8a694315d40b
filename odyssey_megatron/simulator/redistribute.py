"""Micro-batch redistribution: ReCoVer, arXiv 2605.11215 (scenario name ``redistribute``).

ReCoVer keeps one invariant: every iteration trains the job's number of micro-batches.
Its fault-tolerant collectives isolate the failed replica; its in-step recovery keeps
the micro-batches the iteration already finished, so a failure redoes only the failed
replicas' part of the interrupted step (half a step times their share, on average); its
versatile-workload policy spreads the failed replicas' quota over the survivors (here
``planner.batch.distribute_batch``, the split Odyssey and Oobleck use), so the global
batch never shrinks and the survivors' steps grow longer. The paper evaluates losses
only; a repaired replica is assumed to rejoin as torchft's does (restart and heal from a
peer while the others train). Mechanism and costs shared with the other replica
systems: ``simulator.replicas``.
"""

from __future__ import annotations

from odyssey_megatron.planner.batch import distribute_batch
from odyssey_megatron.simulator.replicas import ReplicaSystem


class RedistributeSystem(ReplicaSystem):
    name = "redistribute"
    background_heal = True

    def shares(self, replicas: int) -> list[int]:
        """The job's micro-batches spread over ``replicas`` equal pipelines."""
        return distribute_batch(self.context.num_micro_batches, [self.context.pipeline_parallel_size] * replicas)

    def lost_on_failure(self, replicas_before: int, replicas_lost: int) -> float:
        return self.step_s / 2 * replicas_lost / replicas_before
