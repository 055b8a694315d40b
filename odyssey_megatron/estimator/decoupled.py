"""Op lists with decoupled weight gradients (paper 003's Decoupled BackProp).

Splitting each backward into the input-gradient part (*B*: the previous stage waits for
it) and the weight-gradient part (*W*: nothing waits for it) lets a worker hand the
input gradient on early and run the W later, when no forward or backward is ready,
which moves work into the pipeline's bubbles. It matters most to a rerouting peer: it
does the work of two stages, so it is on the critical path of every pipeline it serves,
while the pipeline's other stages sit in cool-down bubbles. Every worker splits: a plan
is priced and run with one choice of schedule options, so a failure-free plan gets the
same help as a rerouted one and losing a worker never looks like a speed-up.

A deferred W keeps its micro-batch's activations alive (the runtime holds the linear
layers' inputs and output gradients until the W runs), so a peer whose memory holds no
more micro-batches runs a queued W before its next forward.

With ``iterations`` > 1 several steps are list-scheduled back to back and each stage's DP
peers step their optimizer as soon as they all finished, not after the whole pipeline
(paper 003's Staggered Optimizer). A runtime repeats one step's op lists: the first
step's, or, with staggered steps, the last one's, which the list scheduler ordered for
the staggered start of a steady state (``step_schedule`` picks; ``estimator.staggered``
prices them).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.estimator.memory import owner_memory
from odyssey_megatron.estimator.pipeline import PipelineTiming
from odyssey_megatron.estimator.replay import OpGraph, op_graph, replay
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.profile import ModelProfile
from odyssey_megatron.schedules.ops import Op


@dataclass(frozen=True)
class DecoupledTiming:
    first: PipelineTiming
    """The first step: its makespan and each worker's ops (F, B and W) in the order they ran."""
    period_s: float
    """Steady-state seconds per step over the iterations; the first step's makespan for one."""
    last: dict[int, list[Op]]
    """Each worker's ops (F, B and W) in the order the last step ran them."""


def decoupled_pipelines(
    plan: ExecutionPlan, profile: ModelProfile, cluster: ClusterState | None = None, *, iterations: int = 1,
    graph: OpGraph | None = None,
) -> DecoupledTiming:
    """List-schedule ``plan`` with every backward decoupled; raises ScheduleDeadlock.
    ``graph``: the plan's ``op_graph``, if the caller has it."""
    room = {  # micro-batches whose activations fit beside a stage owner's weights
        worker: (profile.memory_budget_bytes - static) // activation if activation else float("inf")
        for worker, (static, activation) in owner_memory(plan, profile).items()
    }
    stage_peers: dict[int, set[int]] = defaultdict(set)  # optimizer barrier: the stage's DP group
    for _, si, stage in plan.stage_positions():
        if stage.worker is not None:
            stage_peers[si].add(stage.worker)
    run = replay(graph or op_graph(plan, profile, cluster), split_backward=True, room=room, iterations=iterations,
                 optimizer_groups=[frozenset(peers) for peers in stage_peers.values()])
    ends = run.step_end_s
    first = PipelineTiming(makespan_s=ends[0], pipeline_end_s=run.pipeline_end_s, worker_busy_s=run.busy_s,
                           schedule=run.first)
    period = ends[0] if iterations == 1 else (ends[-1] - ends[0]) / (iterations - 1)
    return DecoupledTiming(first, period, run.last)
