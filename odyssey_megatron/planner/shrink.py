"""A smaller batch after a failure (``odyssey.batch_on_failure: shrink``), as torchft's
replica drop trains one: the pipelines a failure left whole go on with their own
micro-batches, and those of the broken ones are trained nowhere (dropped), with no
reroute and no weights moved.

The recipe's batch stays the target: every later decision prices its reparallelized
candidates at the whole batch, so a join, or a failure after which a reparallelized plan
trains more samples a second, goes back to it.

How long a smaller batch lasts is what Eq. 8 must weigh it over. Its deficit does not end
at the next failure: that failure breaks more pipelines, and only a plan of the whole batch
ends it, at the transition that dropping saved now. Where no worker comes back, weighing
it to the next failure alone buys that saving again at every failure and can keep the
small batch for the rest of the run (issue 45's trace of the 7B node cell); so a smaller batch and the best plan of the whole batch are weighed against each
other over the rest of the run (``batch_horizon_s``), and every later failure decides
again. With repairs a join ends the deficit, where both pay the join's transition: the
Eq. 8 horizon then.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import AbstractSet

from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.planner.batch import assign_micro_batch_ids


@dataclass(frozen=True)
class BatchTarget:
    """The recipe's batch and the job's plan it was first split over: what every plan of
    the whole batch trains, and the share a pipeline of a smaller batch keeps."""

    micro_batches: int
    per_pipeline: int
    """Micro-batches each pipeline of the job's plan trains."""
    pipeline_workers: int
    """Workers each pipeline of the job's plan holds."""

    @classmethod
    def of(cls, plan: ExecutionPlan) -> "BatchTarget":
        """The target of the job that starts on ``plan`` (the symmetric DP x PP plan)."""
        dp = len(plan.pipelines)
        return cls(plan.num_micro_batches, plan.num_micro_batches // dp, max(1, len(plan.workers) // dp))

    def reformed_micro_batches(self, alive_workers: int) -> int:
        """The batch of as many whole pipelines of the job's shape as ``alive_workers`` form,
        each with its share: what torchft's replica drop trains on them."""
        pipelines = min(alive_workers // self.pipeline_workers, self.micro_batches // max(1, self.per_pipeline))
        return self.per_pipeline * pipelines


def shrunk_plan(current: ExecutionPlan, *, failed_workers: AbstractSet[int]) -> ExecutionPlan | None:
    """The pipelines of ``current`` whose every stage owner is alive, each with as many
    micro-batches as before (ids renumbered 0..n-1, so the plan trains the first n of the
    recipe's N: the rest of each step's samples are the dropped ones); the broken
    pipelines' live workers idle. None where no pipeline is broken or none is whole.
    Its DP sync is not set (``restorer.with_sync``)."""
    whole = [p for p in current.pipelines
             if all(s.worker is not None and s.worker not in failed_workers for s in p.stages)]
    if not whole or len(whole) == len(current.pipelines):
        return None
    ids = assign_micro_batch_ids([len(p.micro_batches) for p in whole])
    pipelines = tuple(replace(p, micro_batches=mbs) for p, mbs in zip(whole, ids))
    return replace(current, policy="shrink", generation=current.generation + 1, pipelines=pipelines,
                   reroutes=(), transfers=(), sync_units=(), comm_rounds=())


def batch_horizon_s(*, horizon_s: float, time_left_s: float | None) -> float:
    """The seconds a plan of a smaller batch and the best plan of the whole one are weighed
    over (module docstring): the run's seconds left where no worker comes back
    (``time_left_s`` given), the Eq. 8 horizon ``horizon_s`` otherwise, and never less
    than it."""
    if time_left_s is None or time_left_s <= 0:
        return horizon_s
    return max(horizon_s, time_left_s)
